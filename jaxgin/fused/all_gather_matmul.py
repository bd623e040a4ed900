"""all_gather_matmul: jax.lax.all_gather(x, tiled=True) @ w with each peer's shard consumed as it
arrives, so the gather hides under the compute (kernel: _kernels.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin import op_support
from jaxgin.hosts import rank_hosts
from jaxgin.route import axis_route
from jaxgin.triton_op import triton_call
from jaxgin.ffi import axes as axes_lib
from jaxgin.fused import _chunked, _common

OP = "jaxgin.fused.all_gather_matmul"

# Programs that push this GPU's shard to its peers; the rest of the grid computes. Enough CTAs to
# keep NVLink busy (a CTA's stores reach ~20-30 GB/s) while leaving the SMs to the matmul.
SENDERS = 16
# The senders copy blocks of 1024 columns and as many rows as the program has warps: 32 elements
# per thread. Larger blocks (32 x 1024 were) raise the whole kernel's registers past what two
# programs of 128 x 128 tiles and 8 warps may share on an SM.
SEND_COLUMNS = 1024


def send_rows(num_warps: int) -> int:
    return num_warps


# Row groups per shard in a job with GIN peers: each is one put and one signal per source and call
# parity, so 2 * axis size * GIN_GROUPS signals per op configuration.
GIN_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class _Plan(_common.MatmulPlan):  # m: the rows of each shard
    precision: object
    tiles: _common.TileConfig | None
    method: str = "auto"

    @property
    def flop(self) -> float:
        return 2.0 * self.size * self.m * self.k * self.n


def all_gather_matmul(x, w, *, axis_name, precision=None, tiles=None, method: str = "auto"):
    """Inside shard_map: equals ``jax.lax.all_gather(x, axis_name, tiled=True) @ w`` for a shard
    x [M, K] and w [K, N] of one dtype (bfloat16, float16 or float32; float32 accumulation); the
    result is [axis size * M, N], rows of axis index s at s*M.

    On GPUs, method="chunked" pushes this GPU's shard into every peer's heap with the copy
    engine while cuBLAS multiplies the own shard, then each peer's shard as it arrives.
    method="triton" is one Triton kernel: a few programs push the shard (NVLink stores, flagged per
    row group) while the others compute; other hosts get the shard by GIN puts, row group by row
    group, once per host: one GPU there receives it and forwards it to its host-mates over NVLink
    (jaxgin.hosts; a job with such peers runs the Triton kernel for "chunked" and "auto").
    method="unfused" is jax.lax.all_gather then XLA's matmul; "auto" (default) as in
    matmul_all_to_all, for the matmul of the gathered rows. `precision` and `tiles` as there.
    Differentiable: the backward pass is XLA's (all_gather of x for dw, reduce-scatter of the x
    cotangent).
    """
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, w = _common.check_operands(OP, x, w)
    (m, k), n = x.shape, w.shape[1]
    plan = _Plan(names, size, m, n, k, _common.lax_precision(precision), tiles, _common.check_method(OP, method, tiles))
    x, w = op_support.same_varying(names, x, w)
    return _fused(x, w, plan)


def _backward(plan, x, w, ct):
    # The gathered x is not kept from the forward pass (the exchange buffers are reused by the
    # next call), so dw gathers it again; dx is the transpose of the gather: a reduce-scatter.
    gathered = jax.lax.all_gather(x, plan.names, tiled=True)
    dw = jnp.matmul(gathered.T, ct, precision=plan.precision).astype(w.dtype)
    d_gathered = jnp.matmul(ct, w.T, precision=plan.precision)
    dx = jax.lax.psum_scatter(d_gathered, plan.names, scatter_dimension=0, tiled=True).astype(x.dtype)
    return dx, dw


def reference(x, w, plan: _Plan):
    """The kernel's order in plain JAX: one product per source shard, placed at the source's rows."""
    shards = jax.lax.all_gather(x, plan.names)  # [size, m, k]
    return jnp.concatenate(
        [jnp.matmul(shards[s], w, precision=plan.precision) for s in range(plan.size)], axis=0
    ).astype(x.dtype)


def unfused(x, w, plan: _Plan):
    """XLA's composition: jax.lax.all_gather, then one matmul of the gathered rows."""
    gathered = jax.lax.all_gather(x, plan.names, tiled=True)
    return jnp.matmul(gathered, w, precision=plan.precision).astype(x.dtype)


def _kernel(state, x, w, plan: _Plan, chunk_layout: str = "chunk_per_peer"):
    """The op on GPUs, as _common.plan_method picks it: XLA's composition, the chunked custom call
    (its cuBLAS calls laid out by `chunk_layout`, _chunked.LAYOUTS; benchmarks/fused.py compares
    them) or the Triton kernel."""
    return _common.by_method(OP, state, plan, x.dtype, lambda: unfused(x, w, plan),
                             lambda: _chunked.all_gather_matmul(x, w, plan, chunk_layout),
                             lambda gin: _triton(state, x, w, plan, gin))


def _triton(state, x, w, plan: _Plan, gin: bool, senders: int = SENDERS, trace: bool = False):
    """The Triton kernel: a grid of `senders` programs that push this GPU's shard, and the matmul's
    programs, each waiting for its source's rows. With `trace`, (out, trace): int32 [programs, 16],
    8 int64 words per program in start order (_kernels._trace_program; view it as int64)."""
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)

    size, dtype = plan.size, x.dtype
    precision = _common.dot_precision(dtype, plan.precision)
    tiles = _common.choose_tiles(state, size * plan.m, plan.n, plan.k, dtype, precision, plan.tiles, "gather",
                                 senders)
    tm, tn = -(-plan.m // tiles.block_m), -(-plan.n // tiles.block_n)
    # GIN: fewer, larger row groups (each a put and a signal per source and call parity)
    groups, per_group = _common.row_groups(tm, GIN_GROUPS if gin else 32)
    buffers = _common.op_buffers(
        state, ("all_gather_matmul", plan.names, size, plan.m, plan.k, np.dtype(dtype).name, tiles, gin, groups),
        (2, size, plan.m, plan.k), dtype, size * groups, signals=2 * size * groups * gin,
    )
    hosts = jnp.asarray(rank_hosts(state, OP) if gin else np.zeros(1, np.int32))
    programs = senders + size * tm * tn
    out = jax.core.ShapedArray((size * plan.m, plan.n), dtype)
    return triton_call(
        _kernels.all_gather_matmul_traced_kernel if trace else _kernels.all_gather_matmul_kernel,
        x, w, axis_route(plan.names), hosts, buffers.exchange, buffers.flags, buffers.state, buffers.signals,
        grid=(programs,), out_shape=_common.traced_out_shape(out, programs, trace),
        **_common.launch_options(tiles, dtype),
        ML=plan.m, N=plan.n, K=plan.k, P=size, G=groups, GR=per_group * tiles.block_m, SENDERS=senders,
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m, PRECISION=precision,
        SEND_BM=send_rows(tiles.num_warps), SEND_BK=SEND_COLUMNS, GIN=int(gin), XB=np.dtype(dtype).itemsize,
        BP=op_support.pow2(size),
        pure=True,
    )


_fused = op_support.differentiable(reference, _kernel, _backward)
