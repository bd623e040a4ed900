"""moe_layer: a top-k routed MoE feed-forward block over an expert-parallel mesh axis, built on
jaxgin.moe.dispatch / combine and jax.lax.ragged_dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def check_layer(op, x, router_logits, w1, w2, top_k, size):
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be [tokens, hidden], got shape {list(x.shape)}")
    if w1.ndim != 3 or w2.ndim != 3:
        raise ValueError(
            f"{op}: w1 must be [local experts, hidden, ffn] and w2 [local experts, ffn, hidden], got "
            f"{list(w1.shape)} and {list(w2.shape)}"
        )
    local, hidden, ffn = w1.shape
    if hidden != x.shape[1] or w2.shape != (local, ffn, hidden):
        raise ValueError(
            f"{op}: with x [T, {x.shape[1]}] w1 must be [E_local, {x.shape[1]}, F] and w2 [E_local, F, {x.shape[1]}]; "
            f"got w1 {list(w1.shape)}, w2 {list(w2.shape)}"
        )
    if router_logits.shape != (x.shape[0], local * size):
        raise ValueError(
            f"{op}: router_logits must be [tokens, experts] = [{x.shape[0]}, {local * size}] ({local} local experts "
            f"x axis size {size}), got {list(router_logits.shape)}"
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= local * size:
        raise ValueError(f"{op}: top_k must be an int in [1, {local * size}] (the number of experts), got {top_k!r}")
    return local * size


def moe_layer(x, router_logits, w1, w2, *, top_k: int, axis_name, activation=jax.nn.silu,
              capacity: int | None = None, mode: str = "auto", return_stats: bool = False):
    """Inside shard_map over the expert axis: the device at axis index d holds experts
    d*E_local ... (d+1)*E_local - 1 as w1 [E_local, H, F], w2 [E_local, F, H]. For each token of
    x [T, H]: p = softmax(router_logits), (weights, ids) = top_k(p), weights /= sum(weights),
    y = sum_k weights[k] * (activation(x @ w1[ids[k]]) @ w2[ids[k]]). Expert compute is
    jax.lax.ragged_dot (float32 accumulation) over dispatch's expert-grouped rows.

    Differentiable in x, router_logits, w1 and w2. capacity / mode: as jaxgin.moe.dispatch.
    return_stats=True returns (y, {"dropped": entries over capacity, "expert_counts": rows per
    local expert}) so a too small capacity shows."""
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, router_logits, w1, w2 = map(jnp.asarray, (x, router_logits, w1, w2))
    experts = check_layer(OP, x, router_logits, w1, w2, top_k, size)
    weights, ids = router(router_logits, top_k)
    sent = dispatch(x, ids, weights, num_experts=experts, axis_name=names, capacity=capacity, mode=mode)
    y = combine(expert_ffn(sent.x, w1, w2, sent.expert_counts, activation), sent.handle)
    if return_stats:
        return y, {"dropped": sent.dropped, "expert_counts": sent.expert_counts}
    return y
