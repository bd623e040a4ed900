"""jaxgin.ppermute and jaxgin.all_to_all: drop-in replacements for jax.lax's, inside shard_map.

On GPUs they lower to one XLA FFI custom call whose kernel moves data with NVLink stores (LSA) or
GIN puts, straight from XLA's input buffer into the peer's symmetric heap, and copies it into XLA's
output buffer as it arrives (csrc/kernels/exchange.cu). On CPU, and in reference mode, they lower
to jax.lax.ppermute / jax.lax.all_to_all.

Both are linear: ppermute's transpose is ppermute with the inverse permutation; all_to_all's is
all_to_all with split and concat axes swapped, so jax.grad and jax.linear_transpose work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxgin import runtime
from jaxgin.ffi import axes as axes_lib

_EXCHANGE_TARGET = "jaxgin_exchange"
_PPERMUTE, _ALL_TO_ALL = 0, 1


# ---------------------------------------------------------------------------------------------
# Primitives. ppermute works on any array; all_to_all on a canonical layout [axis size, ...] whose
# row i goes to axis index i and whose output row j came from axis index j (the public function
# reshapes to and from it).

ppermute_p = Primitive("jaxgin_ppermute")
all_to_all_p = Primitive("jaxgin_all_to_all")


def _same_aval(x, **_):
    return x


ppermute_p.def_abstract_eval(_same_aval)
all_to_all_p.def_abstract_eval(_same_aval)
ppermute_p.def_impl(lambda *a, **k: jax.jit(lambda x: ppermute_p.bind(x, **k))(*a))  # outside jit: same path
all_to_all_p.def_impl(lambda *a, **k: jax.jit(lambda x: all_to_all_p.bind(x, **k))(*a))


def _ppermute_transpose(ct, x, *, axis_name, perm):
    ct = ad.instantiate_zeros(ct)
    inverse = tuple((dst, src) for src, dst in perm)
    return [ppermute_p.bind(ct, axis_name=axis_name, perm=inverse)]


def _all_to_all_transpose(ct, x, *, axis_name):
    # Row i of my input went to device i's row `me`; the cotangent travels the same way back,
    # which is again an all_to_all on the canonical layout.
    ct = ad.instantiate_zeros(ct)
    return [all_to_all_p.bind(ct, axis_name=axis_name)]


ad.deflinear2(ppermute_p, _ppermute_transpose)
ad.deflinear2(all_to_all_p, _all_to_all_transpose)


def _ppermute_batch(args, dims, **params):
    (x,), (d,) = args, dims
    return ppermute_p.bind(x, **params), d


def _all_to_all_batch(args, dims, **params):
    (x,), (d,) = args, dims
    if d == 0:  # keep the exchanged (axis-size) dimension leading
        x, d = jnp.moveaxis(x, 0, 1), 1
    return all_to_all_p.bind(x, **params), d


batching.primitive_batchers[ppermute_p] = _ppermute_batch
batching.primitive_batchers[all_to_all_p] = _all_to_all_batch


def _reference_ppermute(x, *, axis_name, perm):
    return jax.lax.ppermute(x, axis_name, perm)


def _reference_all_to_all(x, *, axis_name):
    return jax.lax.all_to_all(x, axis_name, 0, 0, tiled=True)


def _use_ffi():
    """The live state when this lowering should emit the CUDA custom call, None for the reference."""
    state = runtime.current()
    return state if state.options.backend == "cuda" else None


def _lowering(reference, kind, op):
    def lower_reference(ctx, x, **params):
        runtime.current()  # jaxgin ops need initialize() on every platform, so code moves to GPUs unchanged
        return mlir.lower_fun(lambda v: reference(v, **params), multiple_results=False)(ctx, x)

    def lower_cuda(ctx, x, *, axis_name, **params):
        state = _use_ffi()
        if state is None:
            return lower_reference(ctx, x, axis_name=axis_name, **params)
        attrs = axes_lib.lowering_attributes(ctx, axis_name, state, op)
        perm = np.array([v for pair in params.get("perm", ()) for v in pair] or [-1, -1], dtype=np.int64)
        return jax.ffi.ffi_lowering(_EXCHANGE_TARGET)(ctx, x, kind=np.int64(kind), perm=perm, **attrs)

    return lower_reference, lower_cuda


for _prim, _ref, _kind, _op in (
    (ppermute_p, _reference_ppermute, _PPERMUTE, "jaxgin.ppermute"),
    (all_to_all_p, _reference_all_to_all, _ALL_TO_ALL, "jaxgin.all_to_all"),
):
    _lower_reference, _lower_cuda = _lowering(_ref, _kind, _op)
    mlir.register_lowering(_prim, _lower_reference)
    mlir.register_lowering(_prim, _lower_cuda, platform="cuda")


# ---------------------------------------------------------------------------------------------
# Public API


def _check_perm(perm, size: int) -> tuple[tuple[int, int], ...]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(f"jaxgin.ppermute: perm must be a sequence of (source, destination) index pairs, got {perm!r}") from None
    sources = [s for s, _ in pairs]
    dests = [d for _, d in pairs]
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(f"jaxgin.ppermute: pair {(s, d)} of perm is out of range for an axis of size {size}")
    if len(set(sources)) != len(sources):
        raise ValueError(f"jaxgin.ppermute: perm sources must be unique, got {sources}")
    if len(set(dests)) != len(dests):
        raise ValueError(f"jaxgin.ppermute: perm destinations must be unique, got {dests}")
    return pairs


def as_varying(x, names):
    """`x` typed as varying over `names`: what arrives differs per device even when the input is
    the same everywhere, and shard_map / autodiff must know (a replicated type would let
    out_specs=P() pick one device's value and would skip summing cotangents)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.11; earlier releases call it `vma`
    have = manual.varying if manual is not None else getattr(aval, "vma", None)
    if have is None:  # outside shard_map's type checking
        return x
    missing = tuple(n for n in names if n not in have)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def ppermute(x, axis_name, perm):
    """Like jax.lax.ppermute: sends each device's `x` to the axis index perm maps it to.

    Devices that nobody sends to receive zeros. `x` may be a pytree of arrays.
    """
    names = axes_lib.axis_names(axis_name, "jaxgin.ppermute")
    size = axes_lib.axis_size(names, "jaxgin.ppermute")
    pairs = _check_perm(perm, size)
    return jax.tree.map(lambda leaf: ppermute_p.bind(as_varying(jnp.asarray(leaf), names), axis_name=names, perm=pairs), x)


def _tiled_all_to_all(x, names, size: int, split_axis: int, concat_axis: int):
    n = x.shape[split_axis]
    # Canonical layout: [size, n / size, rest...] with the split axis chunked and leading.
    y = jnp.moveaxis(x, split_axis, 0).reshape((size, n // size) + tuple(np.delete(x.shape, split_axis)))
    z = all_to_all_p.bind(y, axis_name=names)  # z[j]: the chunk device j sent to me
    z = jnp.moveaxis(z, 1, split_axis + 1)  # [size, *x.shape with split axis n / size]
    z = jnp.moveaxis(z, 0, concat_axis)  # chunks side by side before the concat axis
    shape = list(z.shape)
    merged = shape[:concat_axis] + [shape[concat_axis] * shape[concat_axis + 1]] + shape[concat_axis + 2 :]
    return z.reshape(merged)


def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, tiled: bool = False):
    """Like jax.lax.all_to_all (same arguments and result).

    Splits `x` along `split_axis` into one chunk per device of the axis, sends chunk i to axis
    index i and concatenates what arrives along `concat_axis`. Without `tiled`, x.shape[split_axis]
    must equal the axis size, that axis is removed and a new one of that size is inserted at
    `concat_axis`; with `tiled`, it must be divisible by the axis size.
    """
    names = axes_lib.axis_names(axis_name, "jaxgin.all_to_all")
    size = axes_lib.axis_size(names, "jaxgin.all_to_all")
    x = as_varying(jnp.asarray(x), names)
    ndim = x.ndim
    if ndim == 0:
        raise ValueError("jaxgin.all_to_all: x must have at least one dimension to split")
    for name, value in (("split_axis", split_axis), ("concat_axis", concat_axis)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise TypeError(f"jaxgin.all_to_all: {name} must be an int, got {value!r}")
    split_axis = int(split_axis) % ndim if -ndim <= split_axis < ndim else _axis_error("split_axis", split_axis, ndim)
    # Both forms keep the rank (non-tiled: one axis out, one in), so concat_axis indexes ndim axes.
    if not -ndim <= concat_axis < ndim:
        _axis_error("concat_axis", concat_axis, ndim)
    concat_axis = int(concat_axis) % ndim
    if tiled:
        if x.shape[split_axis] % size:
            raise ValueError(
                f"jaxgin.all_to_all: x.shape[{split_axis}] = {x.shape[split_axis]} is not divisible by the axis size "
                f"{size} (tiled=True splits that axis into {size} equal chunks); pad it or pick another split_axis"
            )
        return _tiled_all_to_all(x, names, size, split_axis, concat_axis)
    if x.shape[split_axis] != size:
        raise ValueError(
            f"jaxgin.all_to_all: x.shape[{split_axis}] = {x.shape[split_axis]} must equal the axis size {size} "
            f"when tiled=False (use tiled=True to split a larger axis into {size} chunks)"
        )
    # Same reduction to the tiled case as jax.lax.all_to_all: insert the new axis, exchange, then
    # drop the split axis (now of size 1).
    if split_axis < concat_axis:
        concat_axis += 1
        x = jnp.expand_dims(x, concat_axis)
    elif split_axis > concat_axis:
        x = jnp.expand_dims(x, concat_axis)
        split_axis += 1
    result = _tiled_all_to_all(x, names, size, split_axis, concat_axis)
    if split_axis != concat_axis:
        result = jnp.squeeze(result, split_axis)
    return result


def _axis_error(name: str, value: int, ndim: int):
    raise ValueError(f"jaxgin.all_to_all: {name}={value} is out of range for an array of rank {ndim}")
