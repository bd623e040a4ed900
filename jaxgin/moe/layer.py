"""moe_layer: a top-k routed MoE feed-forward block over an expert-parallel mesh axis, built on
jaxgin.moe.dispatch / combine and jax.lax.ragged_dot."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin.ffi import axes as axes_lib
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
              capacity: int | None = None, mode: str = "auto", return_stats: bool = False):
    """Inside shard_map over the expert axis: the device at axis index d holds experts
    d*E_local ... (d+1)*E_local - 1 as w1 [E_local, H, F], w2 [E_local, F, H] (shard_map in_specs
    P(axis) for both; replicated weights are refused). For each token of x [T, H]:
    p = softmax(router_logits), (weights, ids) = top_k(p), weights /= sum(weights),
    y = sum_k weights[k] * (activation(x @ w1[ids[k]]) @ w2[ids[k]]). Expert compute is
    jax.lax.ragged_dot (float32 accumulation) over dispatch's expert-grouped rows. top_k: any
    integer scalar (Python or numpy) in [1, E].

    Differentiable in x, router_logits, w1 and w2. capacity / mode: as jaxgin.moe.dispatch.
    return_stats=True returns (y, {"dropped": entries over capacity, "expert_counts": rows per
    local expert}) so a too small capacity shows."""
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, router_logits, w1, w2 = map(jnp.asarray, (x, router_logits, w1, w2))
    experts, top_k = check_layer(OP, x, router_logits, w1, w2, top_k, names, size)
    weights, ids = router(router_logits, top_k)
    sent = dispatch(x, ids, weights, num_experts=experts, axis_name=names, capacity=capacity, mode=mode)
    y = combine(expert_ffn(sent.x, w1, w2, sent.expert_counts, activation), sent.handle)
    if return_stats:
        return y, {"dropped": sent.dropped, "expert_counts": sent.expert_counts}
    return y
