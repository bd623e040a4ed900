"""The chunked implementation of the fused ops (method="chunked"): one cuBLAS matmul per peer's chunk,
each chunk handed over by the GPU's copy engine while the next one is computed, all inside one XLA
custom call (csrc/ffi/chunked_matmul.cu); matmul_reduce_scatter then sums the partials it received
(XLA, one pass). The copies take no SMs from the matmuls, and the matmuls
are cuBLAS's own, so the op costs about the matmul alone once the exchange hides under it."""

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


def _block(state, op: str, names, size: int, slot: int) -> int:
    """Heap offset of this op configuration's slots and handoff words (csrc/kernels/chunk_handoff.h),
    placed on first use and kept. The words start at zero on every GPU (op_support's zero
    invariant), so a peer may add to them before this process placed them."""
    words = 2 * size * 8
    return op_support.placed(state, ("chunked", op, names, size, slot),
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
LAYOUTS = tuple(layout.name.lower() for layout in op_table.ChunkLayout)


def matmul_all_to_all(x, w, plan, layout: str = "chunk_per_peer"):
    """The result of chunk d of x @ w sent to axis index d, chunks placed by source (see
    matmul_all_to_all.reference)."""
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
    return chunked_matmul_p.bind(
        x, w, op="jaxgin.fused.all_gather_matmul", names=plan.names, size=plan.size,
        out_shape=(plan.size * plan.m, plan.n), slot=slot_bytes((plan.m, plan.k), x.dtype),
        tf32=_tf32(x.dtype, plan.precision), layout=_layout(layout),
    )


def reduce_scatter_partials(x, w, plan, layout: str = "chunk_per_peer"):
    """[size, cm, cn]: chunk `me` of every source's partial product x @ w, stacked by source (the
    caller sums them: matmul_reduce_scatter.reduce_in_order). Chunks are computed and exchanged as
    matmul_all_to_all's are, in the same layouts."""
    cm, cn = plan.chunk
    stacked = chunked_matmul_p.bind(
        x, w, op="jaxgin.fused.matmul_reduce_scatter", names=plan.names, size=plan.size,
        out_shape=(plan.size * cm, cn), slot=slot_bytes((cm, cn), x.dtype), tf32=_tf32(x.dtype, plan.precision),
        split_rows=plan.scatter_rows, layout=_layout(layout),
    )
    return stacked.reshape(plan.size, cm, cn)
