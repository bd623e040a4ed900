"""The same MoE layer built on jax.lax.ragged_all_to_all: the baseline jaxgin.moe is measured
against (benchmarks/moe.py, examples/moe_layer.py) and a second check of its values.

Each (token, expert) entry is sent on its own (sorted by expert id, so by destination GPU), the
arrivals are regrouped by local expert for ragged_dot, and the outputs return the same way."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxgin.ffi import axes as axes_lib
from jaxgin.moe.layer import check_layer, expert_ffn, router

OP = "jaxgin.moe.ragged.moe_layer"


def moe_layer(x, router_logits, w1, w2, *, top_k: int, axis_name, activation=jax.nn.silu,
              capacity: int | None = None):
    """Same contract as jaxgin.moe.moe_layer. capacity: rows received per GPU (default the worst
    case, P * T * top_k); entries past it are not received (ragged_all_to_all's limit)."""
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, router_logits, w1, w2 = map(jnp.asarray, (x, router_logits, w1, w2))
    experts, top_k = check_layer(OP, x, router_logits, w1, w2, top_k, names, size)
    weights, ids = router(router_logits, top_k)
    received, group_sizes, state = dispatch(x, ids, num_experts=experts, axis_name=names, capacity=capacity)
    return combine(expert_ffn(received, w1, w2, group_sizes, activation), weights, state)


def dispatch(x, ids, *, num_experts: int, axis_name, capacity: int | None = None):
    """(rows [capacity, H] grouped by local expert, group sizes [E_local], state for combine)."""
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    local = num_experts // size
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    me = jax.lax.axis_index(names)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # entries by expert, so by destination GPU
    send = x[order // top_k]
    per_expert = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    send_sizes = per_expert.reshape(size, local).sum(axis=1)
    input_offsets = jnp.cumsum(send_sizes) - send_sizes
    every = jax.lax.all_gather(per_expert.reshape(size, local), names, tiled=False)  # [src, dst, EL]
    sizes = every.sum(axis=2)  # [src, dst]
    output_offsets = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    recv_sizes = sizes[:, me]
    cap = capacity if capacity is not None else size * tokens * top_k
    received = jax.lax.ragged_all_to_all(
        send, jnp.zeros((cap, hidden), x.dtype), input_offsets, send_sizes, output_offsets, recv_sizes,
        axis_name=names,
    )
    # Arrivals are grouped by source, then local expert; ragged_dot wants them by expert.
    segments = every[:, me, :].reshape(-1)  # rows per (source, local expert)
    segment = jnp.searchsorted(jnp.cumsum(segments), jnp.arange(cap), side="right")
    expert_of_row = jnp.where(segment < size * local, segment % local, local)
    regroup = jnp.argsort(expert_of_row, stable=True)
    back_offsets = jax.lax.all_gather(input_offsets, names, tiled=False)[:, me]  # where each source keeps our entries
    state = (order, regroup, recv_sizes, back_offsets, send_sizes, names, top_k)
    return received[regroup], every[:, me, :].sum(axis=0), state


def combine(out, weights, state):
    """[T, H]: each entry's row back to its token's GPU, weighted sum per token."""
    order, regroup, recv_sizes, back_offsets, send_sizes, names, top_k = state
    tokens = weights.shape[0]
    out = jnp.zeros_like(out).at[regroup].set(out)
    recv_offsets = jnp.cumsum(recv_sizes) - recv_sizes
    returned = jax.lax.ragged_all_to_all(
        out, jnp.zeros((tokens * top_k, out.shape[1]), out.dtype), recv_offsets, recv_sizes, back_offsets,
        send_sizes, axis_name=names,
    )
    entries = jnp.zeros_like(returned).at[order].set(returned).reshape(tokens, top_k, out.shape[1])
    return jnp.sum(entries.astype(jnp.float32) * weights[..., None], axis=1).astype(out.dtype)
