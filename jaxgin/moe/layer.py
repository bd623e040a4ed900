"""moe_layer: a top-k routed MoE feed-forward block over an expert-parallel mesh axis, built on
jaxgin.moe.dispatch / combine and jax.lax.ragged_dot."""

from __future__ import annotations

import operator
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin.ffi import axes as axes_lib
from jaxgin.moe import _routing
from jaxgin.moe.exchange import combine, dispatch

OP = "jaxgin.moe.moe_layer"


def router(router_logits, top_k: int):
    """(weights float32 [T, K], ids int32 [T, K]): softmax over experts, the top_k largest,
    weights renormalised to sum to 1 per token."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    return weights / jnp.sum(weights, axis=-1, keepdims=True), ids.astype(jnp.int32)


def expert_ffn(rows, w1, w2, group_sizes, activation):
    """activation(rows @ w1[e]) @ w2[e] for rows grouped by expert e (group_sizes rows each), float32
    accumulation, results in rows' dtype."""
    hidden = jax.lax.ragged_dot(rows, w1, group_sizes, preferred_element_type=jnp.float32)
    hidden = activation(hidden).astype(rows.dtype)
    return jax.lax.ragged_dot(hidden, w2, group_sizes, preferred_element_type=jnp.float32).astype(rows.dtype)


def _axes(names) -> str:
    return repr(names[0]) if len(names) == 1 else repr(tuple(names))


def check_top_k(op, top_k, experts: int) -> int:
    """top_k as a Python int: any integer scalar (Python, numpy, a 0-d integer array), not a bool."""
    try:
        if isinstance(top_k, (bool, np.bool_)):
            raise TypeError
        value = operator.index(top_k)
    except TypeError:
        raise TypeError(
            f"{op}: top_k must be an integer (a Python or numpy int, known when tracing) in [1, {experts}] "
            f"(the number of experts), got {top_k!r} of type {type(top_k).__name__}"
        ) from None
    if not 1 <= value <= experts:
        raise ValueError(f"{op}: top_k must be an int in [1, {experts}] (the number of experts), got {value}")
    return value


def check_layer(op, x, router_logits, w1, w2, top_k, names, size):
    """(number of experts, top_k as an int), or an error naming the argument at fault."""
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [tokens, hidden], got shape {list(x.shape)}")
    if router_logits.ndim != 2 or router_logits.shape[0] != x.shape[0]:
        raise ValueError(
            f"{op}: router_logits must be [tokens, experts] with tokens = x.shape[0] = {x.shape[0]}, got "
            f"{list(router_logits.shape)}"
        )
    for name, w in (("w1", w1), ("w2", w2)):
        if w.ndim != 3:
            raise ValueError(f"{op}: {name} must be 3-D, [local experts, hidden, ffn] for w1 and [local experts, "
                             f"ffn, hidden] for w2, got {list(w.shape)}")
    experts = router_logits.shape[1]
    if experts % size:
        raise ValueError(
            f"{op}: router_logits must be [tokens, experts] = [{x.shape[0]}, {w1.shape[0] * size}] ({w1.shape[0]} "
            f"local experts in w1 x expert axis size {size}), got {list(router_logits.shape)}: its number of "
            f"experts must be a multiple of {size}"
        )
    local = experts // size
    for name, w in (("w1", w1), ("w2", w2)):
        if w.shape[0] == local:
            continue
        shard = (f"shard {name} over the expert axis {_axes(names)} along its first dimension (shard_map in_specs "
                 f"P({_axes(names)})), so that device d holds experts d*{local} ... (d+1)*{local} - 1")
        if w.shape[0] == experts:
            raise ValueError(
                f"{op}: {name} holds all {experts} experts on every device (replicated over the expert axis); each of "
                f"the {size} devices must hold {experts} / {size} = {local} of them, {name} [{local}, ...]: {shard}"
            )
        raise ValueError(
            f"{op}: {name} holds {w.shape[0]} experts on this device, but router_logits has {experts} experts over "
            f"an expert axis of size {size}, so each device must hold {local}: {shard}"
        )
    hidden, ffn = x.shape[1], w1.shape[2]
    if w1.shape[1] != hidden or w2.shape != (local, ffn, hidden):
        raise ValueError(
            f"{op}: with x [T, {hidden}] w1 must be [E_local, {hidden}, F] and w2 [E_local, F, {hidden}] (the same "
            f"F); got w1 {list(w1.shape)}, w2 {list(w2.shape)}"
        )
    return experts, check_top_k(op, top_k, experts)


def moe_layer(x, router_logits, w1, w2, *, top_k: int, axis_name, activation=jax.nn.silu,
              capacity: int | None = None, mode: str = "auto", return_stats: bool = False, fp8: bool = False):
    """Inside shard_map over the expert axis: the device at axis index d holds experts
    d*E_local ... (d+1)*E_local - 1 as w1 [E_local, H, F], w2 [E_local, F, H] (shard_map in_specs
    P(axis) for both; replicated weights are refused). For each token of x [T, H]:
    p = softmax(router_logits), (weights, ids) = top_k(p), weights /= sum(weights),
    y = sum_k weights[k] * (activation(x @ w1[ids[k]]) @ w2[ids[k]]). Expert compute is
    jax.lax.ragged_dot (float32 accumulation) over dispatch's expert-grouped rows. top_k: any
    integer scalar (Python or numpy) in [1, E].

    Differentiable in x, router_logits, w1 and w2. capacity / mode / fp8: as jaxgin.moe.dispatch
    (fp8=True: the experts see x's rows rounded to e4m3 with a scale per 128 values).
    Drops are never silent: return_stats=True returns (y, {"dropped": entries over capacity,
    "expert_counts": rows per local expert}); without it, a capacity below the worst case
    (P * T * min(top_k, E_local) rows) makes every call check at run time whether this device
    dropped entries and, when it did, warn (RuntimeWarning, through jax.debug.callback) how many and
    what capacity that call needed. With capacity=None (the default, nothing can drop) or
    return_stats=True no check is compiled in."""
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, router_logits, w1, w2 = map(jnp.asarray, (x, router_logits, w1, w2))
    experts, top_k = check_layer(OP, x, router_logits, w1, w2, top_k, names, size)
    weights, ids = router(router_logits, top_k)
    sent = dispatch(x, ids, weights, num_experts=experts, axis_name=names, capacity=capacity, mode=mode, fp8=fp8)
    y = combine(expert_ffn(sent.x, w1, w2, sent.expert_counts, activation), sent.handle)
    if return_stats:
        return y, {"dropped": sent.dropped, "expert_counts": sent.expert_counts}
    plan = sent.handle.plan
    worst = _routing.worst_case_capacity(size, plan.tokens, top_k, plan.local_experts)
    if plan.capacity < worst:
        _warn_when_dropped(sent, plan.capacity, worst, names)
    return y


def _warn_when_dropped(sent, capacity: int, worst: int, names):
    """At run time, only on a device that dropped entries: a RuntimeWarning saying how many and how
    to size capacity. The branch is a conditional on a scalar (its predicate is read on the host);
    the Python callback runs only on a drop."""

    def warn(dropped, needed, index):
        warnings.warn(
            f"{OP}: {int(dropped)} of {int(needed)} routed entries at expert-axis index {int(index)} did not fit "
            f"capacity={capacity} and were dropped, which changes the output. Pass capacity >= {int(needed)} (what "
            f"this call needed there) or capacity=None (the worst case, {worst} rows, never drops), or "
            f"return_stats=True to get the counts instead of this warning.",
            RuntimeWarning,
            stacklevel=1,
        )

    needed = jnp.sum(sent.expert_counts) + sent.dropped  # the router's ids are all valid: every drop is capacity's
    jax.lax.cond(sent.dropped > 0, lambda *a: jax.debug.callback(warn, *a), lambda *a: None,
                 sent.dropped, needed, jax.lax.axis_index(names))
