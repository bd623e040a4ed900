"""jaxgin.ppermute and jaxgin.all_to_all: drop-in replacements for jax.lax's, inside shard_map.

On GPUs they lower to one XLA FFI custom call whose kernel moves data with NVLink stores (LSA) or
GIN puts, straight from XLA's input buffer into the peer's symmetric heap, and copies it into XLA's
output buffer as it arrives (csrc/kernels/exchange.cu). On CPU, and in reference mode, they lower
to jax.lax.ppermute / jax.lax.all_to_all.

Both are linear: ppermute's transpose is ppermute with the inverse permutation; all_to_all's is
all_to_all with split and concat axes swapped, so jax.grad and jax.linear_transpose work.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxgin import op_support, runtime
from jaxgin.errors import JaxginError
from jaxgin.ffi import axes as axes_lib
from jaxgin.ffi import capture
from jaxgin.ffi.op_table import ExchangeKind


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


def _lowering(reference, kind, op):
    def lower_reference(ctx, x, **params):
        runtime.current()  # jaxgin ops need initialize() on every platform, so code moves to GPUs unchanged
        return mlir.lower_fun(lambda v: reference(v, **params), multiple_results=False)(ctx, x)

    def lower_cuda(ctx, x, *, axis_name, **params):
        state = op_support.kernel_state()
        if state is None:
            return lower_reference(ctx, x, axis_name=axis_name, **params)
        attrs = axes_lib.lowering_attributes(ctx, axis_name, state, op)
        perm = np.array([v for pair in params.get("perm", ()) for v in pair] or [-1, -1], dtype=np.int64)
        return jax.ffi.ffi_lowering(capture.target_for(op, state))(ctx, x, kind=np.int64(kind), perm=perm, **attrs)

    return lower_reference, lower_cuda


for _prim, _ref, _kind, _op in (
    (ppermute_p, _reference_ppermute, ExchangeKind.PPERMUTE, "jaxgin.ppermute"),
    (all_to_all_p, _reference_all_to_all, ExchangeKind.ALL_TO_ALL, "jaxgin.all_to_all"),
):
    _lower_reference, _lower_cuda = _lowering(_ref, _kind, _op)
    mlir.register_lowering(_prim, _lower_reference)
    mlir.register_lowering(_prim, _lower_cuda, platform="cuda")


# ---------------------------------------------------------------------------------------------
# Public API


def _check_perm(perm, size: int, op: str = "jaxgin.ppermute") -> tuple[tuple[int, int], ...]:
    """`perm` as (source, destination) pairs in [0, size), accepting and refusing what
    jax.lax.ppermute does, with the same exception types: a list or tuple (TypeError otherwise,
    an iterator such as zip(...) included) of pairs of ints (TypeError; ValueError for another
    length), indices in [-size, size) with negative ones counting from the end (IndexError), no
    source or destination twice once wrapped (ValueError). lax finds most of these only when it
    compiles; jaxgin finds them while tracing."""
    if not isinstance(perm, (list, tuple)):
        hint = " (materialize an iterator with list(...))" if hasattr(perm, "__next__") else ""
        raise TypeError(
            f"{op}: perm must be a list or a tuple of (source, destination) pairs, as for jax.lax.ppermute; "
            f"got {type(perm).__name__}{hint}"
        )
    pairs = []
    for entry in perm:
        try:
            pair = tuple(entry)
        except TypeError:
            raise TypeError(f"{op}: perm entry {entry!r} is not a (source, destination) pair; perm={perm!r}") from None
        if len(pair) != 2:
            raise ValueError(f"{op}: perm entry {entry!r} has {len(pair)} values, not 2 (source, destination); perm={perm!r}")
        try:
            pairs.append(tuple(operator.index(v) for v in pair))
        except TypeError:
            raise TypeError(f"{op}: perm entry {entry!r} must hold two integer axis indices; perm={perm!r}") from None
    for role, column in (("sources", 0), ("destinations", 1)):
        wrapped = [p[column] % size for p in pairs]
        if len(set(wrapped)) != len(wrapped):
            raise ValueError(
                f"{op}: perm {role} must be unique (negative indices count from the end of the axis of size "
                f"{size}), got perm={perm!r}"
            )
    for pair in pairs:
        if not all(-size <= v < size for v in pair):
            raise IndexError(
                f"{op}: perm entry {pair} is out of range for an axis of size {size} (indices must be in "
                f"[{-size}, {size}), negative ones counting from the end); perm={perm!r}"
            )
    return tuple((s % size, d % size) for s, d in pairs)


def _check_axis_index_groups(groups, size: int, op: str) -> tuple[tuple[int, ...], ...] | None:
    """axis_index_groups as jax.lax takes it: lists of axis indices that cover every index of the
    axis exactly once, all of one size."""
    if groups is None:
        return None
    try:
        groups = tuple(tuple(operator.index(i) for i in group) for group in groups)
    except TypeError:
        raise TypeError(f"{op}: axis_index_groups must be a list of lists of axis indices, got {groups!r}") from None
    flat = [i for group in groups for i in group]
    if sorted(flat) != list(range(size)):
        raise ValueError(
            f"{op}: axis_index_groups must cover all indices exactly once: every index of the axis of size {size} "
            f"in exactly one group, got {groups!r}"
        )
    if len({len(group) for group in groups}) != 1:
        raise ValueError(f"{op}: axis_index_groups must all have the same size, got {groups!r}")
    return groups


def _over_vmap_axis(lax_collective, op: str, names):
    """jax.lax's collective, for an axis_name bound by jax.vmap: the batch is on this device, so
    there is nothing for jaxgin to send; lax's vmap rules compute the result."""
    try:
        return lax_collective()
    except AssertionError as e:  # jax's own varying-axes check (pvary) inside a checking shard_map
        raise JaxginError(
            f"{op} over the jax.vmap axis_name {tuple(names)!r} runs as jax.lax's collective, which fails inside a "
            f"jax.shard_map that checks varying axes (an assertion in jax's pvary); pass check_vma=False to that "
            f"jax.shard_map, or exchange over one of its mesh axes"
        ) from e


def ppermute(x, axis_name, perm):
    """Like jax.lax.ppermute: sends each device's `x` to the axis index perm maps it to.

    Devices that nobody sends to receive zeros. `x` may be a pytree of arrays (each leaf moves).
    `perm` is what jax.lax.ppermute takes (a list or tuple of (source, destination) pairs,
    negative indices counting from the end), refused with lax's exception types. Over a jax.vmap
    axis_name, where there are no devices to talk between, it is jax.lax.ppermute.
    """
    op = "jaxgin.ppermute"
    names = axes_lib.axis_names(axis_name, op, allow_empty=True)
    size = axes_lib.axis_size(names, op)
    pairs = _check_perm(perm, size)
    if not axes_lib.bound_by_shard_map(names):
        if len(pairs) != size:
            raise ValueError(
                f"{op}: over the jax.vmap axis {tuple(names)!r} perm must be a full permutation of the {size} "
                f"indices (jax.lax.ppermute's vmap rule has no zero fill), got perm={perm!r}; use jax.shard_map "
                f"for partial permutations"
            )
        return _over_vmap_axis(lambda: jax.lax.ppermute(x, names, pairs), op, names)
    if not names:  # an axis of size 1: the value stays if perm keeps it, else zeros
        return jax.tree.map(lambda leaf: jnp.asarray(leaf) if pairs else jnp.zeros_like(leaf), x)
    return jax.tree.map(lambda leaf: ppermute_p.bind(op_support.same_varying(names, jnp.asarray(leaf))[0], axis_name=names, perm=pairs), x)


def _grouped_exchange(y, names, size: int, groups):
    """The all_to_all exchange on the canonical layout y [group size, ...]: row q goes to the q-th
    member of this device's group, row j of the result came from its j-th member."""
    if groups is None:
        return all_to_all_p.bind(y, axis_name=names)
    k = len(groups[0])
    if k == 1:
        return y
    if k == size:  # one group: the whole axis in another order, one exchange with rows relabelled
        order = np.asarray(groups[0])
        return jnp.take(all_to_all_p.bind(jnp.take(y, np.argsort(order), axis=0), axis_name=names), order, axis=0)
    # Several groups: shift s sends every member's row for the member s places on (one ppermute
    # per shift, each moving 1/k of the data, so no bytes travel to devices outside the group).
    position = np.empty(size, np.int32)
    for group in groups:
        position[list(group)] = np.arange(k)
    me = jnp.asarray(position)[jax.lax.axis_index(names)]
    # Group indices count over `names` in the order given; the ppermutes run over the same axes in
    # the mesh's order (the order jax.lax.ppermute, the reference lowering, insists on).
    mesh_names, relabel = _in_mesh_order(names)
    received = [jax.lax.dynamic_index_in_dim(y, me, 0, keepdims=False)]
    for shift in range(1, k):
        perm = tuple((int(relabel[group[q]]), int(relabel[group[(q + shift) % k]])) for group in groups for q in range(k))
        row = jax.lax.dynamic_index_in_dim(y, (me + shift) % k, 0, keepdims=False)
        received.append(ppermute_p.bind(row, axis_name=mesh_names, perm=perm))  # from member me - shift
    return jnp.take(jnp.stack(received), (me - jnp.arange(k)) % k, axis=0)


def _in_mesh_order(names):
    """`names` sorted in the mesh's axis order, and for each index over `names` (row-major in the
    order given) the index of the same device over the sorted names."""
    order = tuple(jax.sharding.get_abstract_mesh().axis_names)
    mesh_names = tuple(sorted(names, key=order.index))
    sizes = [jax.lax.axis_size(n) for n in names]
    coords = np.unravel_index(np.arange(int(np.prod(sizes))), sizes)
    relabel = np.ravel_multi_index([coords[names.index(n)] for n in mesh_names], [jax.lax.axis_size(n) for n in mesh_names])
    return mesh_names, relabel


def _tiled_all_to_all(x, names, size: int, split_axis: int, concat_axis: int, exchange):
    n = x.shape[split_axis]
    # Canonical layout: [size, n / size, rest...] with the split axis chunked and leading.
    y = jnp.moveaxis(x, split_axis, 0).reshape((size, n // size) + tuple(np.delete(x.shape, split_axis)))
    z = exchange(y)  # z[j]: the chunk device j sent to me
    z = jnp.moveaxis(z, 1, split_axis + 1)  # [size, *x.shape with split axis n / size]
    z = jnp.moveaxis(z, 0, concat_axis)  # chunks side by side before the concat axis
    shape = list(z.shape)
    merged = shape[:concat_axis] + [shape[concat_axis] * shape[concat_axis + 1]] + shape[concat_axis + 2 :]
    return z.reshape(merged)


def _canonical_axis(value, name: str, ndim: int) -> int:
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"jaxgin.all_to_all: {name} must be an int, got {value!r}") from None
    if not -ndim <= value < ndim:
        raise ValueError(f"jaxgin.all_to_all: {name}={value} is out of range for an array of rank {ndim}")
    return value % ndim


def all_to_all(x, axis_name, split_axis, concat_axis, *, axis_index_groups=None, tiled=False):
    """Like jax.lax.all_to_all (same arguments and result).

    Splits `x` along `split_axis` into one chunk per device of the axis, sends chunk i to axis
    index i and concatenates what arrives along `concat_axis`. Without `tiled`, x.shape[split_axis]
    must equal the axis size, that axis is removed and a new one of that size is inserted at
    `concat_axis`; with `tiled`, it must be divisible by the axis size. `x` may be a pytree (each
    leaf is exchanged, its axes counted in its own rank).

    `axis_index_groups` (lists of axis indices covering the axis once, all of one size) runs one
    all_to_all within each group, group size taking the place of axis size; several groups travel
    as one jaxgin ppermute per position in the group. Over a jax.vmap axis_name it is
    jax.lax.all_to_all (which has no axis_index_groups there).
    """
    op = "jaxgin.all_to_all"
    names = axes_lib.axis_names(axis_name, op, allow_empty=True)
    size = axes_lib.axis_size(names, op)
    groups = _check_axis_index_groups(axis_index_groups, size, op)
    if not axes_lib.bound_by_shard_map(names):
        if groups is not None:
            raise NotImplementedError(
                f"{op}: axis_index_groups over the jax.vmap axis {tuple(names)!r} is not supported (nor by "
                f"jax.lax.all_to_all); use jax.shard_map"
            )
        return _over_vmap_axis(lambda: jax.lax.all_to_all(x, names, split_axis, concat_axis, tiled=tiled), op, names)
    if groups is None:
        size_of = ("the axis size", size)
    else:
        size_of = ("the size of the axis_index_groups", len(groups[0]))
    if not names:
        exchange = lambda y: y  # an axis of size 1
    else:
        exchange = lambda y: _grouped_exchange(y, names, size, groups)
    return jax.tree.map(lambda leaf: _all_to_all_leaf(leaf, names, size_of, split_axis, concat_axis, tiled, exchange), x)


def _all_to_all_leaf(x, names, size_of: tuple[str, int], split_axis, concat_axis, tiled: bool, exchange):
    x = jnp.asarray(x)
    ndim = x.ndim
    if ndim == 0:
        raise ValueError("jaxgin.all_to_all: x must have at least one dimension to split")
    # Both forms keep the rank (non-tiled: one axis out, one in), so both axes index ndim axes.
    split_axis = _canonical_axis(split_axis, "split_axis", ndim)
    concat_axis = _canonical_axis(concat_axis, "concat_axis", ndim)
    what, size = size_of
    if tiled:
        if x.shape[split_axis] % size:
            raise ValueError(
                f"jaxgin.all_to_all: x.shape[{split_axis}] = {x.shape[split_axis]} is not divisible by {what} "
                f"{size} (tiled=True splits that axis into {size} equal chunks); pad it or pick another split_axis"
            )
    elif x.shape[split_axis] != size:
        raise ValueError(
            f"jaxgin.all_to_all: x.shape[{split_axis}] = {x.shape[split_axis]} must equal {what} {size} "
            f"when tiled=False (use tiled=True to split a larger axis into {size} chunks)"
        )
    x = op_support.same_varying(names, x)[0]
    if tiled:
        return _tiled_all_to_all(x, names, size, split_axis, concat_axis, exchange)
    # Same reduction to the tiled case as jax.lax.all_to_all: insert the new axis, exchange, then
    # drop the split axis (now of size 1).
    if split_axis < concat_axis:
        concat_axis += 1
        x = jnp.expand_dims(x, concat_axis)
    elif split_axis > concat_axis:
        x = jnp.expand_dims(x, concat_axis)
        split_axis += 1
    result = _tiled_all_to_all(x, names, size, split_axis, concat_axis, exchange)
    if split_axis != concat_axis:
        result = jnp.squeeze(result, split_axis)
    return result
