"""matmul_all_to_all: jax.lax.all_to_all(x @ w, ..., tiled=True) with the output tiles sent from
the matmul's epilogue, so the exchange hides under the compute (kernel: _kernels.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxgin import op_support
from jaxgin.collectives import all_to_all
from jaxgin.route import axis_route
from jaxgin.triton_op import triton_call
from jaxgin.ffi import axes as axes_lib
from jaxgin.fused import _chunked, _common

OP = "jaxgin.fused.matmul_all_to_all"


@dataclasses.dataclass(frozen=True)
class _Plan(_common.MatmulPlan):
    split_rows: bool  # split_axis == 0: chunk d is rows d*cm.. of x @ w; else columns d*cn..
    concat_rows: bool  # concat_axis == 0: the chunk from s lands at rows s*cm..; else columns s*cn..
    precision: object
    tiles: _common.TileConfig | None
    method: str = "auto"

    @property
    def chunk(self) -> tuple[int, int]:
        return (self.m // self.size, self.n) if self.split_rows else (self.m, self.n // self.size)

    @property
    def flop(self) -> float:
        return 2.0 * self.m * self.k * self.n

    @property
    def out_shape(self) -> tuple[int, int]:
        cm, cn = self.chunk
        return (self.size * cm, cn) if self.concat_rows else (cm, self.size * cn)


def _axis(value, name: str) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{OP}: {name} must be an int, got {value!r}")
    if not -2 <= value < 2:
        raise ValueError(f"{OP}: {name}={value} is out of range for the 2-D result x @ w (use 0, 1, -1 or -2)")
    return int(value) % 2


def matmul_all_to_all(x, w, *, axis_name, split_axis: int = 0, concat_axis: int = 0, precision=None, tiles=None,
                      method: str = "auto"):
    """Inside shard_map: equals ``jax.lax.all_to_all(x @ w, axis_name, split_axis, concat_axis,
    tiled=True)`` for x [M, K] and w [K, N] of one dtype (bfloat16, float16 or float32; float32
    accumulation). The dimension of x @ w named by `split_axis` must be divisible by the axis size.

    On GPUs, method="chunked" computes each peer's chunk with cuBLAS, next peer first, and
    the peer's copy engine fetches it over NVLink into its result while the next chunk is computed;
    the own chunk is written into the result directly. method="triton" is one Triton kernel that
    stores each output tile for its destination and flags it; destinations fetch tiles during the
    kernel. Peers on other hosts are reached by GIN puts of each finished tile from the kernel; a job
    with such peers runs the Triton kernel for "chunked" and "auto" (the copy engine reaches NVLink
    peers only). method="unfused" is XLA's matmul then jax.lax.all_to_all. method="auto" (default)
    takes "chunked" for matmuls long enough to hide the exchange and "unfused" below that;
    jaxgin.fused.explain says which runs and why. `precision` is
    jax's (None follows jax_default_matmul_precision); `tiles` fixes the Triton kernel's TileConfig
    instead of tuning (method="triton" only).
    Differentiable: the backward pass is the swapped all_to_all (jaxgin.all_to_all) then two
    matmuls (XLA), see jaxgin/fused/__init__.py.
    """
    names = axes_lib.axis_names(axis_name, OP)
    size = axes_lib.axis_size(names, OP)
    x, w = _common.check_operands(OP, x, w)
    split, concat = _axis(split_axis, "split_axis"), _axis(concat_axis, "concat_axis")
    (m, k), n = x.shape, w.shape[1]
    along = (m, "M = x.shape[0]") if split == 0 else (n, "N = w.shape[1]")
    if along[0] % size:
        raise ValueError(
            f"{OP}: split_axis={split_axis} splits {along[1]} = {along[0]} into {size} chunks (the size of axis "
            f"{axis_name!r}), which does not divide it; pad it to a multiple of {size}"
        )
    plan = _Plan(names, size, m, n, k, split == 0, concat == 0, _common.lax_precision(precision), tiles,
                 _common.check_method(OP, method, tiles))
    x, w = op_support.same_varying(names, x, w)
    return _fused(x, w, plan)


def _backward(plan, x, w, ct):
    # The transpose of a tiled all_to_all is the one with split and concat swapped; the
    # communication comes first here, so the fused epilogue does not apply (unfused, on purpose).
    ct_y = all_to_all(ct, plan.names, 1 - plan.concat_rows, 1 - plan.split_rows, tiled=True)
    dx = jnp.matmul(ct_y, w.T, precision=plan.precision).astype(x.dtype)
    dw = jnp.matmul(x.T, ct_y, precision=plan.precision).astype(w.dtype)
    return dx, dw


def reference(x, w, plan: _Plan):
    """The same chunk placement as the kernel, in plain JAX: chunk d of x @ w computed alone,
    exchanged with jax.lax.all_to_all, placed by source."""
    cm, cn = plan.chunk
    chunks = []
    for d in range(plan.size):
        if plan.split_rows:
            chunks.append(jnp.matmul(x[d * cm:(d + 1) * cm], w, precision=plan.precision))
        else:
            chunks.append(jnp.matmul(x, w[:, d * cn:(d + 1) * cn], precision=plan.precision))
    arrived = jax.lax.all_to_all(jnp.stack(chunks), plan.names, 0, 0, tiled=True)  # [size, cm, cn], by source
    if plan.concat_rows:
        return arrived.reshape(plan.size * cm, cn).astype(x.dtype)
    return jnp.swapaxes(arrived, 0, 1).reshape(cm, plan.size * cn).astype(x.dtype)


def unfused(x, w, plan: _Plan):
    """XLA's composition: the whole matmul, then jax.lax.all_to_all."""
    y = jnp.matmul(x, w, precision=plan.precision).astype(x.dtype)
    return jax.lax.all_to_all(y, plan.names, 1 - plan.split_rows, 1 - plan.concat_rows, tiled=True)


def _kernel(state, x, w, plan: _Plan, parts: int = 7, interleave: bool = True, pull: bool = True,
            chunk_layout: str = "chunk_per_peer", copy_slabs: int = 0, movers: int = 0):
    """The op on GPUs, as _common.plan_method picks it: XLA's composition, the chunked custom call
    (its cuBLAS calls laid out by `chunk_layout`, _chunked.LAYOUTS), or the fused Triton kernel, whose `parts`,
    `interleave`, `pull`, `copy_slabs` and `movers` select variants; benchmarks/fused.py compares the non-defaults (the
    defaults are the op: see _kernels.matmul_all_to_all_kernel). In a job with GPUs on other hosts
    the kernel's tiles go to such GPUs by GIN puts from the matmul's epilogue."""
    return _common.by_method(OP, state, plan, x.dtype, lambda: unfused(x, w, plan),
                             lambda: _chunked.matmul_all_to_all(x, w, plan, chunk_layout, state),
                             lambda gin: _triton(state, x, w, plan, gin, parts, interleave, pull,
                                                 copy_slabs=copy_slabs, movers=movers))


def _triton(state, x, w, plan: _Plan, gin: bool, parts: int, interleave: bool, pull: bool, trace: bool = False,
            copy_slabs: int = 0, movers: int = 0):
    """The Triton kernel: the matmul's tiles handed to their destinations from its epilogue. With
    `trace` (NVLink only), (out, trace): int32 [programs, 16], 8 int64 words per program in start
    order (_kernels._matmul_all_to_all's TRACE; view it as int64). `copy_slabs` (with `pull`): the
    copy-out of an arrival flagged when its program starts goes through the K loop in up to that
    many row slabs (_kernels._matmul_all_to_all's COPY_SLABS). `movers` (with `pull`, NVLink only):
    that many programs copy the arrivals of every wave but the last while the others compute
    (MOVERS)."""
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)

    size, dtype = plan.size, x.dtype
    cm, cn = plan.chunk
    precision = _common.dot_precision(dtype, plan.precision)
    tiles = _common.choose_tiles(state, plan.m, plan.n, plan.k, dtype, precision, plan.tiles,
                                 "wide_first")
    tm, tn = -(-cm // tiles.block_m), -(-cn // tiles.block_n)
    copiers = _common.gin_copiers(size, tm * tn) if gin else 0
    if trace and gin:
        raise ValueError("matmul_all_to_all: the traced kernel runs over NVLink only")
    slabs = _copy_slabs(copy_slabs, pull, tiles, plan.k, cn, plan.out_shape[1], np.dtype(dtype).itemsize)
    if movers and parts != 7:
        raise ValueError(f"matmul_all_to_all: movers copy flagged arrivals; parts={parts} leaves some out (7 has all)")
    moved = _moved_arrivals(movers, pull, gin, slabs, tiles, np.dtype(dtype).itemsize,
                            op_support.sm_count(state.local_devices[0]), size, tm * tn, interleave)
    buffers = _common.op_buffers(
        state, ("matmul_all_to_all", plan.names, size, cm, cn, np.dtype(dtype).name, tiles, gin),
        (2, size, cm, cn), dtype, size * tm * tn + size * gin,
        # GIN: [outgoing, incoming] x 2 halves x peers x tiles, one whole tile each; a signal per
        # (call parity, source)
        gin_area_shape=(2, 2, size, tm * tn, tiles.block_m * tiles.block_n) if gin else None,
        signals=2 * size * gin,
    )
    programs = movers + size * tm * tn + size * copiers
    out = jax.core.ShapedArray(plan.out_shape, dtype)
    return triton_call(
        _kernels.matmul_all_to_all_traced_kernel if trace else _kernels.matmul_all_to_all_kernel,
        x, w, axis_route(plan.names), buffers.exchange, buffers.flags,
        buffers.state, buffers.gin_area if gin else buffers.exchange, buffers.signals,
        grid=(programs,), out_shape=_common.traced_out_shape(out, programs, trace),
        **_common.launch_options(tiles, dtype),
        M=plan.m, N=plan.n, K=plan.k, P=size, CM=cm, CN=cn, SPLIT_ROWS=plan.split_rows,
        CONCAT_ROWS=plan.concat_rows, OUT_N=plan.out_shape[1],
        BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m, PRECISION=precision,
        PARTS=parts, INTERLEAVE=interleave, PULL=pull, GIN=int(gin), COPIERS=copiers,
        XB=np.dtype(dtype).itemsize, COPY_SLABS=slabs, MOVERS=movers, MOVED=moved,
        pure=True,
    )


def _copy_slabs(asked: int, pull: bool, tiles, k: int, cn: int, out_n: int, itemsize: int) -> int:
    """The kernel's COPY_SLABS for `asked` slabs: a power of two, at most the tile's rows and the K
    loop's steps (a slab a step). The folded copy moves 32-bit words, so 16-bit chunks and outputs
    need an even width."""
    if asked <= 0:
        return 0
    if not pull:
        raise ValueError("matmul_all_to_all: copy_slabs folds the pulled copy-out into the K loop; it needs pull=True")
    if itemsize == 2 and (cn % 2 or out_n % 2):
        raise ValueError(f"matmul_all_to_all: copy_slabs moves 32-bit words; the chunk's width {cn} and the output's "
                         f"width {out_n} must be even for a 16-bit dtype")
    limit = min(asked, tiles.block_m, -(-k // tiles.block_k))
    return 1 << (limit.bit_length() - 1)


def _moved_arrivals(movers: int, pull: bool, gin: bool, copy_slabs: int, tiles, itemsize: int, sms: int, size: int,
                    tiles_per_step: int, interleave: bool) -> int:
    """The kernel's MOVED for `movers` mover programs: the arrivals of every compute program
    before the last wave (sms x programs per SM, less the movers' slots), counted in program
    order. The programs of the last wave copy their own, as without movers: they end together,
    and every SM then moves its tile at once."""
    if movers < 0:
        raise ValueError(f"matmul_all_to_all: movers must be 0 or more, got {movers}")
    if movers == 0:
        return 0
    if not pull or gin:
        raise ValueError("matmul_all_to_all: movers copy pulled arrivals over NVLink; they need pull=True and "
                         "no GPU on another host")
    if copy_slabs:
        raise ValueError("matmul_all_to_all: movers and copy_slabs are two ways to move the same arrivals; "
                         "choose one")
    slots = sms * _common.programs_per_sm(tiles, itemsize)
    if movers > slots // 8:
        raise ValueError(f"matmul_all_to_all: {movers} movers would hold more than an eighth of the "
                         f"{slots} program slots the GPU has for this kernel; at most {slots // 8}")
    last = max(0, size * tiles_per_step - (slots - movers))
    return last - -(-last // size) if interleave else max(0, last - tiles_per_step)


_fused = op_support.differentiable(reference, _kernel, _backward)
