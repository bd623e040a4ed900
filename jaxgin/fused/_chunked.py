"""The chunked implementation of the fused ops (method="chunked"): one cuBLAS matmul per peer's chunk,
each chunk handed over by the GPU's copy engine while the next one is computed, all inside one XLA
custom call (csrc/ffi/chunked_matmul.cu); matmul_reduce_scatter then sums the partials it received
(XLA, one pass). The copies take no SMs from the matmuls, and the matmuls
are cuBLAS's own, so the op costs about the matmul alone once the exchange hides under it.

A layout for benchmarks (TRITON_TILES, not the ops' default) computes every chunk in one Triton
kernel instead, which hands each peer's chunk over from the epilogue of its last tile: one launch
instead of a cuBLAS call per chunk, the same copy-engine exchange (triton_chunks)."""

from __future__ import annotations

import jax
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxgin import op_support
from jaxgin.errors import JaxginError
from jaxgin.ffi import axes as axes_lib
from jaxgin.ffi import op_table
from jaxgin.fused import _common

chunked_matmul_p = Primitive("jaxgin_chunked_matmul")

_SLOT_ALIGN = 256


@chunked_matmul_p.def_abstract_eval
def _abstract(x, w, *, out_shape, **_):
    return x.update(shape=tuple(out_shape), dtype=x.dtype, weak_type=False)


def _no_batching(*_, op, **__):
    raise JaxginError(f"{op} cannot be vmapped: each call exchanges one matmul's chunks; map over a loop instead")


batching.primitive_batchers[chunked_matmul_p] = lambda args, dims, **params: _no_batching(**params)


def slot_bytes(shape, dtype) -> int:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return -(-nbytes // _SLOT_ALIGN) * _SLOT_ALIGN


def _block(state, op: str, names, size: int, slot: int, *variant) -> int:
    """Heap offset of this op configuration's slots and handoff words (csrc/kernels/chunk_handoff.h),
    placed on first use and kept (a block of its own per `variant`, if given). The words start at
    zero on every GPU (op_support's zero invariant), so a peer may add to them before this process
    placed them."""
    words = 2 * size * 8
    return op_support.placed(state, ("chunked", op, names, size, slot, *variant),
                             lambda: state.heap.allocate(slot * size + words))


def _lower(ctx, x, w, *, op, names, size, out_shape, slot, tf32, split_rows=None, concat_rows=None, layout=None):
    state = op_support.lowering_state(op)
    attrs = axes_lib.lowering_attributes(ctx, names, state, op)
    offset = _block(state, op, names, size, slot)
    if split_rows is not None:
        attrs.update(split_rows=np.int64(bool(split_rows)))
    if concat_rows is not None:
        attrs.update(concat_rows=np.int64(bool(concat_rows)))
    if layout is not None:
        attrs.update(layout=np.int64(op_table.ChunkLayout[layout.upper()]))
    return jax.ffi.ffi_lowering(op_table.target_of(op).name, has_side_effect=True)(
        ctx, x, w, offset=np.int64(offset), slot_bytes=np.int64(slot), tf32=np.int64(bool(tf32)), **attrs
    )


def _unsupported_platform(ctx, *args, op, **params):
    raise JaxginError(f"{op} was traced for jaxgin's cuda backend; it can only be compiled for CUDA GPUs")


mlir.register_lowering(chunked_matmul_p, _unsupported_platform)
mlir.register_lowering(chunked_matmul_p, _lower, platform="cuda")


def _tf32(dtype, precision) -> bool:
    return _common.dot_precision(dtype, precision) == "tf32"


# How the peers' chunks are split into cuBLAS calls (op_table.ChunkLayout; row chunks only): the
# ops use "chunk_per_peer"; benchmarks/fused.py --chunked-layouts-only weighs the others.
CUBLAS_LAYOUTS = tuple(layout.name.lower() for layout in op_table.ChunkLayout)
# ... or every chunk computed by one Triton kernel that hands each over from its epilogue
# (triton_chunks): matmul_all_to_all and matmul_reduce_scatter only.
TRITON_TILES = "triton_tiles"
LAYOUTS = CUBLAS_LAYOUTS + (TRITON_TILES,)


def matmul_all_to_all(x, w, plan, layout: str = "chunk_per_peer", state=None):
    """The result of chunk d of x @ w sent to axis index d, chunks placed by source (see
    matmul_all_to_all.reference); `state`: the runtime's, for the Triton layout."""
    if _layout(layout) == TRITON_TILES:
        return triton_chunks(state, x, w, plan, "jaxgin.fused.matmul_all_to_all", plan.split_rows, plan.concat_rows,
                             plan.out_shape)
    cm, cn = plan.chunk
    return chunked_matmul_p.bind(
        x, w, op="jaxgin.fused.matmul_all_to_all", names=plan.names, size=plan.size, out_shape=plan.out_shape,
        slot=slot_bytes((cm, cn), x.dtype), tf32=_tf32(x.dtype, plan.precision),
        split_rows=plan.split_rows, concat_rows=plan.concat_rows, layout=_layout(layout),
    )


def _layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"chunk layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return layout


def all_gather_matmul(x, w, plan, layout: str = "chunk_per_peer"):
    """Every shard of x times w, stacked by source (see all_gather_matmul.reference); the shards'
    cuBLAS calls laid out by `layout` (chunked_matmul.cu's all_gather_matmul)."""
    if _layout(layout) == TRITON_TILES:
        raise ValueError(f"all_gather_matmul: layout {TRITON_TILES!r} computes chunks bound for peers; this op "
                         f"multiplies shards that arrive (use one of {', '.join(CUBLAS_LAYOUTS)})")
    return chunked_matmul_p.bind(
        x, w, op="jaxgin.fused.all_gather_matmul", names=plan.names, size=plan.size,
        out_shape=(plan.size * plan.m, plan.n), slot=slot_bytes((plan.m, plan.k), x.dtype),
        tf32=_tf32(x.dtype, plan.precision), layout=_layout(layout),
    )


def reduce_scatter_partials(x, w, plan, layout: str = "chunk_per_peer", state=None):
    """[size, cm, cn]: chunk `me` of every source's partial product x @ w, stacked by source (the
    caller sums them: matmul_reduce_scatter.reduce_in_order). Chunks are computed and exchanged as
    matmul_all_to_all's are, in the same layouts."""
    cm, cn = plan.chunk
    if _layout(layout) == TRITON_TILES:
        stacked = triton_chunks(state, x, w, plan, "jaxgin.fused.matmul_reduce_scatter", plan.scatter_rows, True,
                                (plan.size * cm, cn))
        return stacked.reshape(plan.size, cm, cn)
    stacked = chunked_matmul_p.bind(
        x, w, op="jaxgin.fused.matmul_reduce_scatter", names=plan.names, size=plan.size,
        out_shape=(plan.size * cm, cn), slot=slot_bytes((cm, cn), x.dtype), tf32=_tf32(x.dtype, plan.precision),
        split_rows=plan.scatter_rows, layout=_layout(layout),
    )
    return stacked.reshape(plan.size, cm, cn)


# The Triton layout's custom call: a primitive of its own, since its handler also needs the mesh
# (known when it lowers) beside the compiled kernel's attributes.
triton_chunks_p = Primitive("jaxgin_triton_chunks")
triton_chunks_p.multiple_results = True


class _Kernel:
    """A compiled kernel's call (triton_op.LoweredCall) as a primitive parameter: hashed by identity."""

    def __init__(self, call):
        self.call = call


@triton_chunks_p.def_abstract_eval
def _triton_chunks_abstract(*operands, kernel, **_):
    return [jax.core.ShapedArray(t.shape, t.dtype) for t in kernel.call.out_types]


batching.primitive_batchers[triton_chunks_p] = lambda args, dims, **params: _no_batching(**params)


def _lower_triton_chunks(ctx, *operands, kernel, op, names, **attributes):
    state = op_support.lowering_state(op)
    # the mesh's attributes, then the kernel's (both carry the runtime's generation)
    attributes = {**axes_lib.lowering_attributes(ctx, names, state, op), **kernel.call.attributes, **attributes}
    return jax.ffi.ffi_lowering(op_table.target_of("jaxgin.fused.triton_chunks").name, has_side_effect=True)(
        ctx, *operands, **attributes)


mlir.register_lowering(triton_chunks_p, _unsupported_platform)
mlir.register_lowering(triton_chunks_p, _lower_triton_chunks, platform="cuda")


def triton_chunks(state, x, w, plan, op: str, split_rows: bool, concat_rows: bool, out_shape):
    """The exchange of matmul_all_to_all (or of matmul_reduce_scatter's partials, `out_shape` then
    [size * cm, cn]) with every chunk computed by one Triton kernel (_kernels.matmul_chunks_kernel),
    which hands each peer's chunk over from the epilogue of its last tile; the peers' copy engines
    pull it as in the cuBLAS layouts (csrc/ffi/chunked_matmul.cu's triton_chunks, whose flags need a
    block of their own). Its tiles are the op's Triton configuration (tuned on the matmul alone)."""
    from jaxgin import triton_op
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)
    from jaxgin.route import axis_route

    op_support.require_tritongin(op)
    dtype = np.dtype(x.dtype)
    cm, cn = plan.chunk
    precision = _common.dot_precision(dtype, plan.precision)
    tiles = _common.choose_tiles(state, plan.m, plan.n, plan.k, dtype, precision, plan.tiles, "wide_first")
    slot = slot_bytes((cm, cn), dtype)
    # the block's words are flags here, and the tile counters count whole calls by this grid's tiles
    offset = _block(state, op, plan.names, plan.size, slot, TRITON_TILES, tiles)
    slots = op_support.SymmetricArray((plan.size * slot // dtype.itemsize,), dtype, offset, plan.size * slot,
                                      state.generation)
    words = op_support.SymmetricArray((2 * plan.size,), np.dtype(np.int64), offset + plan.size * slot,
                                      2 * plan.size * 8, state.generation)
    counters = op_support.placed(state, ("chunked counters", op, plan.names, plan.size, slot, tiles),
                                 lambda: op_support.heap_array(state, (plan.size,), np.int64))
    tm, tn = -(-cm // tiles.block_m), -(-cn // tiles.block_n)
    call = triton_op.lowered_call(
        _kernels.matmul_chunks_kernel, (x, w, axis_route(plan.names), slots, words, counters),
        grid=(plan.size * tm * tn,), out_shape=jax.core.ShapedArray(tuple(out_shape), dtype),
        **_common.launch_options(tiles, dtype),
        constexprs=dict(N=plan.n, K=plan.k, P=plan.size, CM=cm, CN=cn, SPLIT_ROWS=bool(split_rows),
                        CONCAT_ROWS=bool(concat_rows), OUT_N=int(out_shape[1]), SLOT=slot // dtype.itemsize,
                        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
                        PRECISION=precision),
    )
    results = triton_chunks_p.bind(
        *call.operands, kernel=_Kernel(call), op=op, names=plan.names, offset=np.int64(offset),
        slot_bytes=np.int64(slot), chunk_rows=np.int64(cm), chunk_cols=np.int64(cn),
        element_bytes=np.int64(dtype.itemsize), concat_rows=np.int64(bool(concat_rows)),
        reduce=np.int64(op.endswith("reduce_scatter")))
    return call.results(results)
