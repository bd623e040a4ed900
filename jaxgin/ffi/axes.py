"""Mesh axes as jaxgin ops see them: trace-time checks and the attributes a lowering passes to
the CUDA handlers so they can turn an axis index into a global rank."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import jax
import numpy as np

from jaxgin.errors import JaxginError


def axis_names(axis_name, op: str) -> tuple[Hashable, ...]:
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names:
        raise ValueError(f"{op}: axis_name must name at least one mesh axis")
    return names


def axis_size(names: Sequence[Hashable], op: str) -> int:
    """Size of the (product of the) named axes; a clear error when one is not bound."""
    size = 1
    for name in names:
        try:
            size *= jax.lax.axis_size(name)
        except NameError:
            raise NameError(
                f"{op}: axis_name {name!r} is not bound here. jaxgin ops run inside jax.shard_map (or another "
                f"construct that binds mesh axis names); call it there with one of the mesh's axis names"
            ) from None
    return size


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
