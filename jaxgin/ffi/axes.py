"""Mesh axes as jaxgin ops see them: trace-time checks and the attributes a lowering passes to
the CUDA handlers so they can turn an axis index into a global rank."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import jax.extend.core
import numpy as np

from jaxgin.errors import JaxginError


def axis_names(axis_name, op: str, *, allow_empty: bool = False) -> tuple[Hashable, ...]:
    """`axis_name` as a tuple of names. An empty tuple is refused unless `allow_empty` (jax.lax's
    collectives accept it as an axis of size 1, and jaxgin's drop-ins do too)."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names and not allow_empty:
        raise ValueError(f"{op}: axis_name must name at least one mesh axis")
    return names


def bound_axis_names() -> tuple[Hashable, ...]:
    """Every axis name bound where this is traced: the enclosing shard_maps' manual mesh axes and
    the axis_name of every enclosing vmap. Used for error messages only."""
    # jax has no public listing of vmap-bound names; jax.extend exports one it marks unstable, so
    # fall back to the shard_map axes when a release drops it.
    listing = getattr(jax.extend.core, "unsafe_get_axis_names_DO_NOT_USE", None)
    if listing is not None:
        return tuple(listing())
    return manual_axes()


def manual_axes() -> tuple[Hashable, ...]:
    """The mesh axes the enclosing jax.shard_map is manual over (empty outside any shard_map)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(getattr(mesh, "manual_axes", ()))


def unbound_axis_error(name, op: str) -> NameError:
    """The NameError for an axis name nothing binds here: it names the axis, lists the names that
    are bound, and says how to bind a mesh axis."""
    bound = bound_axis_names()
    mesh = jax.sharding.get_abstract_mesh()
    if name in tuple(mesh.axis_names):
        why = (f"{name!r} is an axis of the mesh {tuple(mesh.axis_names)} but the enclosing jax.shard_map is not "
               f"manual over it (pass it in shard_map's axis_names)")
    else:
        why = f"nothing binds {name!r} here"
    where = f"bound axis names here: {', '.join(map(repr, bound))}" if bound else "no axis name is bound here"
    return NameError(
        f"{op}: axis_name {name!r} is not bound ({why}; {where}). jaxgin ops run inside jax.shard_map over a "
        f"jax.sharding.Mesh; call {op} there with one of the mesh's axis names"
    )


def axis_size(names: Sequence[Hashable], op: str) -> int:
    """Size of the (product of the) named axes; `unbound_axis_error` when one is not bound."""
    size = 1
    for name in names:
        try:
            size *= jax.lax.axis_size(name)
        except NameError:
            raise unbound_axis_error(name, op) from None
    return size


def bound_by_shard_map(names: Sequence[Hashable]) -> bool:
    """Whether every one of `names` (all bound: check with axis_size first) is a manual axis of the
    enclosing jax.shard_map, so that devices hold its positions. False when one is a jax.vmap
    axis_name (there is only this device's batch then), also when a vmap axis of another size
    shadows a mesh axis of the same name."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = manual_axes()
    return all(n in manual and jax.lax.axis_size(n) == mesh.shape[n] for n in names)


def require_shard_map(names: Sequence[Hashable], op: str) -> None:
    """For ops that only exist between devices: a clear error while tracing when one of `names`
    (all bound: check with axis_size first) is bound by something other than jax.shard_map, a
    jax.vmap axis_name, instead of a failure in JAX's batching or in the lowering."""
    if not bound_by_shard_map(names):
        manual = manual_axes()
        named = [n for n in names if n not in manual] or list(names)
        raise JaxginError(
            f"{op}: axis_name {', '.join(map(repr, named))} is bound by jax.vmap (or another transformation), not "
            f"by jax.shard_map (manual mesh axes here: {manual!r}); {op} works between the devices of mesh axes, so "
            f"call it inside jax.shard_map over a mesh with that axis"
        )


def lowering_attributes(ctx, names: Sequence[Hashable], state, op: str) -> dict:
    """mesh_ranks / mesh_shape / axes attributes for the handlers (see csrc/ffi/common.h)."""
    axis_context = ctx.module_context.axis_context
    mesh = getattr(axis_context, "mesh", None)
    if mesh is None or not hasattr(mesh, "devices"):
        raise JaxginError(
            f"{op} on GPUs needs jax.shard_map over a concrete jax.sharding.Mesh (got axis context "
            f"{type(axis_context).__name__}); the CUDA lowering must know which device holds each mesh position"
        )
    manual = getattr(axis_context, "manual_axes", frozenset(mesh.axis_names))
    for name in names:
        if name not in mesh.axis_names:
            raise NameError(f"{op}: axis {name!r} is not an axis of the mesh {mesh.axis_names}")
        if name not in manual:
            raise JaxginError(f"{op}: axis {name!r} is not manual in this shard_map (manual axes: {sorted(manual)})")
    ranks = {device: rank for rank, device in enumerate(state.devices)}
    try:
        mesh_ranks = np.array([ranks[d] for d in mesh.devices.flat], dtype=np.int32)
    except KeyError as e:
        raise JaxginError(f"{op}: mesh device {e.args[0]} is not one of the devices jaxgin was initialized on") from None
    return dict(
        mesh_ranks=mesh_ranks,
        mesh_shape=np.array(mesh.devices.shape, dtype=np.int64),
        axes=np.array([mesh.axis_names.index(n) for n in names], dtype=np.int64),
        generation=np.int64(state.generation),
    )
