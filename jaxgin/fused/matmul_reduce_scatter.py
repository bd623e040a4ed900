"""matmul_reduce_scatter: jax.lax.psum_scatter(x @ w, ..., tiled=True), the way out of a
tensor-parallel block: each partial chunk sent to the GPU that owns it while the next is computed
(cuBLAS chunks and the copy engine, _chunked.py; or one Triton kernel's epilogue, _kernels.py) and
the arriving partials reduced by their owner in float32."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin import op_support
from jaxgin.route import axis_route
from jaxgin.triton_op import triton_call
from jaxgin.ffi import axes as axes_lib
from jaxgin.fused import _chunked, _common

OP = "jaxgin.fused.matmul_reduce_scatter"


@dataclasses.dataclass(frozen=True)
class _Plan(_common.MatmulPlan):
    scatter_rows: bool  # scatter_dimension == 0: axis index d owns rows d*cm.. of x @ w; else columns d*cn..
    precision: object
    tiles: _common.TileConfig | None
    method: str = "auto"

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def chunk(self) -> tuple[int, int]:
        return (self.m // self.size, self.n) if self.scatter_rows else (self.m, self.n // self.size)


def matmul_reduce_scatter(x, w, *, axis_name, scatter_dimension: int = 0, precision=None, tiles=None,
                          method: str = "auto"):
    """Inside shard_map: equals ``jax.lax.psum_scatter(x @ w, axis_name,
    scatter_dimension=scatter_dimension, tiled=True)`` for x [M, K] and w [K, N] of one dtype
    (bfloat16, float16 or float32), each GPU holding a partial product (x and w sharded along K).
    The dimension of x @ w named by `scatter_dimension` must be divisible by the axis size.

    Each GPU rounds its partial chunks to the dtype and the owner of a chunk sums the partials in
    float32 in the order of the axis (0, 1, ...), so the result is the same on every run and
    equals the reference mode's bit for bit where the products are the same.

    On GPUs, method="chunked" computes this GPU's partial of each peer's chunk with
    cuBLAS, next peer first, and the peer's copy engine fetches it over NVLink while the next chunk
    is computed (as matmul_all_to_all's chunked method); the owner then sums the partials it got in
    one pass. method="triton" is one Triton kernel that hands every finished tile over from the
    epilogue (an NVLink peer fetches it from this GPU's heap, a peer on another host gets a GIN
    put) and reduces its chunk's tiles as they arrive. A job with GPUs on other hosts runs the
    Triton kernel for "chunked" and "auto". method="unfused" is XLA's matmul, then
    jax.lax.all_to_all of the partial chunks and the same ordered sum (not psum_scatter, whose
    order is NCCL's); "auto" (default) as in matmul_all_to_all. `precision` is jax's (None follows
    jax_default_matmul_precision); `tiles` fixes the Triton kernel's TileConfig instead of tuning
    (method="triton" only). Differentiable: the backward pass is the transpose, an all_gather of
    the cotangent then two matmuls (XLA).
    """
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, w = _common.check_operands(OP, x, w)
    method = _common.check_method(OP, method, tiles)
    if not isinstance(scatter_dimension, (int, np.integer)) or isinstance(scatter_dimension, bool):
        raise TypeError(f"{OP}: scatter_dimension must be an int, got {scatter_dimension!r}")
    if not -2 <= scatter_dimension < 2:
        raise ValueError(f"{OP}: scatter_dimension={scatter_dimension} is out of range for the 2-D result x @ w "
                         f"(use 0, 1, -1 or -2)")
    rows = int(scatter_dimension) % 2 == 0
    (m, k), n = x.shape, w.shape[1]
    along = (m, "M = x.shape[0]") if rows else (n, "N = w.shape[1]")
    if along[0] % size:
        raise ValueError(
            f"{OP}: scatter_dimension={scatter_dimension} splits {along[1]} = {along[0]} into {size} chunks (the "
            f"size of axis {axis_name!r}), which does not divide it; pad it to a multiple of {size}"
        )
    plan = _Plan(names, size, m, n, k, rows, _common.lax_precision(precision), tiles, method)
    x, w = op_support.same_varying(names, x, w)
    return _fused(x, w, plan)


def _backward(plan, x, w, ct):
    # The transpose of a reduce-scatter is an all_gather; both matmuls need the gathered
    # cotangent, so it is gathered once (XLA) rather than inside a fused all_gather_matmul.
    gathered = jax.lax.all_gather(ct, plan.names, axis=0 if plan.scatter_rows else 1, tiled=True)
    dx = jnp.matmul(gathered, w.T, precision=plan.precision).astype(x.dtype)
    dw = jnp.matmul(x.T, gathered, precision=plan.precision).astype(w.dtype)
    return dx, dw


def partial_chunks(y, plan: _Plan):
    """[size, cm, cn]: chunk d of this GPU's partial product y (the rows or columns d owns)."""
    cm, cn = plan.chunk
    if plan.scatter_rows:
        return y.reshape(plan.size, cm, cn)
    return jnp.swapaxes(y.reshape(cm, plan.size, cn), 0, 1)


def reduce_in_order(arrived, dtype):
    """The sum over sources of `arrived` [size, cm, cn] (partials already in the output dtype), in
    float32, source 0 first: the kernel's order, so every run gives the same bits."""
    total = arrived[0].astype(jnp.float32)
    for s in range(1, arrived.shape[0]):
        total = total + arrived[s].astype(jnp.float32)
    return total.astype(dtype)


def reference(x, w, plan: _Plan):
    """The kernel's arithmetic in plain JAX: this GPU's partial product in the dtype, its chunks
    exchanged with jax.lax.all_to_all, each owner's sum in float32 in source order."""
    y = jnp.matmul(x, w, precision=plan.precision).astype(x.dtype)
    arrived = jax.lax.all_to_all(partial_chunks(y, plan), plan.names, 0, 0, tiled=True)  # [size, cm, cn], by source
    return reduce_in_order(arrived, x.dtype)


def _kernel(state, x, w, plan: _Plan, lag: int = 0, wait_first: bool = False, chunk_layout: str = "chunk_per_peer",
            fold: bool | None = None, push: bool = False):
    """The op on GPUs, as _common.plan_method picks it: XLA's matmul and all_to_all with the
    ordered sum (the reference), the chunked custom call (its cuBLAS calls laid out by `chunk_layout`,
    _chunked.LAYOUTS) and the sum of the partials it exchanged, or the Triton kernel, whose reducers
    `fold` into the own chunk's programs (None: wherever every peer is on NVLink) or are programs
    of their own that `lag` and `wait_first` place and order; `push` stores each partial into its
    owner's buffer rather than keeping it for the owner to fetch (LAG, WAIT_FIRST, FOLD and PUSH of
    _kernels.matmul_reduce_scatter_kernel); benchmarks/fused.py compares the non-defaults."""
    return _common.by_method(
        OP, state, plan, x.dtype, lambda: reference(x, w, plan),
        lambda: reduce_in_order(_chunked.reduce_scatter_partials(x, w, plan, chunk_layout, state), x.dtype),
        lambda gin: _triton(state, x, w, plan, gin, lag, wait_first, fold, push))


def _triton(state, x, w, plan: _Plan, gin: bool, lag: int, wait_first: bool, fold: bool | None = None,
            push: bool = False, trace: bool = False):
    """The Triton kernel: each partial tile handed to its chunk's owner from the epilogue (kept for
    the owner to fetch, or with `push` stored into the owner's buffer; NVLink only), and the owner
    summing the arrived partials in the axis's order: in the programs of its own partials (`fold`,
    NVLink only; None folds in a job without GIN peers, where it was measured faster) or in reducer
    programs. With `trace` (folded only), (out, trace): int32 [programs, 16], 8 int64 words per
    program in start order (_kernels._matmul_reduce_scatter's TRACE; view it as int64)."""
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)

    size, dtype = plan.size, x.dtype
    cm, cn = plan.chunk
    precision = _common.dot_precision(dtype, plan.precision)
    tiles = _common.choose_tiles(state, plan.m, plan.n, plan.k, dtype, precision, plan.tiles,
                                 "wide_first")
    count = -(-cm // tiles.block_m) * -(-cn // tiles.block_n)  # tiles of one chunk
    if fold is None:
        fold = not gin
    if fold and gin:
        raise ValueError("matmul_reduce_scatter: folded reducers run over NVLink only; a job with GIN peers needs "
                         "reducer programs (a GIN source's puts are waited for all at once)")
    if push and gin:
        raise ValueError("matmul_reduce_scatter: push is an NVLink layout; a job with GIN peers puts its partials")
    if trace and not fold:
        raise ValueError("matmul_reduce_scatter: only the folded kernel is traced")
    buffers = _common.op_buffers(
        state, ("matmul_reduce_scatter", plan.names, size, cm, cn, np.dtype(dtype).name, tiles, gin),
        # this GPU's partial of every chunk, two halves; a flag per (chunk, tile); GIN: per source a
        # ready flag and its waiter's claim word
        (2, size, cm, cn), dtype, size * count + 2 * size * gin,
        # GIN: [outgoing, incoming] x 2 halves x peers x tiles, one whole tile each; a signal per
        # (call parity, source)
        gin_area_shape=(2, 2, size, count, tiles.block_m * tiles.block_n) if gin else None,
        signals=2 * size * gin,
    )
    programs = size * count + (0 if fold else count)
    out = jax.core.ShapedArray((cm, cn), dtype)
    return triton_call(
        _kernels.matmul_reduce_scatter_traced_kernel if trace else _kernels.matmul_reduce_scatter_kernel,
        x, w, axis_route(plan.names), buffers.exchange, buffers.flags,
        buffers.state, buffers.gin_area if gin else buffers.exchange, buffers.signals,
        grid=(programs,), out_shape=_common.traced_out_shape(out, programs, trace),
        **_common.launch_options(tiles, dtype),
        M=plan.m, N=plan.n, K=plan.k, P=size, CM=cm, CN=cn, SCATTER_ROWS=plan.scatter_rows,
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m, PRECISION=precision,
        GIN=int(gin), XB=np.dtype(dtype).itemsize, LAG=min(lag, count), WAIT_FIRST=wait_first,
        REDUCE_SLABS=reduce_slabs(tiles.block_m, gin), FOLD=fold, PUSH=push,
        pure=True,
    )


def reduce_slabs(block_m: int, gin: bool) -> int:
    """Row slabs a reducer sums a tile in: 4 (32 rows of a 128-row tile) keeps the kernel's
    registers within what two programs of 8 warps may share on an SM; with GIN the put paths need
    more than that anyway, and the reducer keeps its whole-tile sum."""
    return 1 if gin else max(1, min(4, block_m // 16))


_fused = op_support.differentiable(reference, _kernel, _backward)
