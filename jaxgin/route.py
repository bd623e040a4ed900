"""jaxgin.axis_route: what a communicating kernel inside shard_map needs to address its axis peers.

Kernels (Triton through jaxgin.triton_call, or jaxgin's own) address peers by global rank, the
numbering of ``tritongin.rank``, while a shard_map program speaks of indices along mesh axes. The
mapping depends on the concrete mesh, which JAX only reveals when the program is lowered, and on
which device runs the program, which only the device knows. So the route is an int32 array built
from a constant table at lowering time and indexed by this device's position in the mesh::

    route = jaxgin.axis_route("x")   # int32[1 + axis size]
    # route[0]: this device's index along "x"; route[1 + j]: the global rank of index j

It is the same array on every replay of the program (no per-call host values), so kernels that use
it stay correct under CUDA-graph capture.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jaxgin import runtime
from jaxgin.errors import JaxginError
from jaxgin.ffi import axes as axes_lib

axis_route_p = Primitive("jaxgin_axis_route")


@axis_route_p.def_abstract_eval
def _abstract(position, *, names, size):
    return position.update(shape=(size + 1,), dtype=jnp.dtype(jnp.int32), weak_type=False)


def route_table(mesh_ranks: np.ndarray, mesh_axis_names, names) -> np.ndarray:
    """Row f: the route of the device at flat mesh position f (row-major over the mesh axes)."""
    shape = mesh_ranks.shape
    along = [mesh_axis_names.index(n) for n in names]
    sizes = [shape[a] for a in along]
    size = int(np.prod(sizes, dtype=np.int64))
    table = np.empty((mesh_ranks.size, size + 1), dtype=np.int32)
    for f in range(mesh_ranks.size):
        coords = list(np.unravel_index(f, shape))
        table[f, 0] = np.ravel_multi_index([coords[a] for a in along], sizes)
        for j in range(size):
            peer = list(coords)
            for a, c in zip(along, np.unravel_index(j, sizes)):
                peer[a] = c
            table[f, 1 + j] = mesh_ranks[tuple(peer)]
    return table


def _lower(ctx, position, *, names, size):
    state = runtime.current()
    attrs = axes_lib.lowering_attributes(ctx, names, state, "jaxgin.axis_route")
    mesh = ctx.module_context.axis_context.mesh
    ranks = attrs["mesh_ranks"].reshape(tuple(int(d) for d in attrs["mesh_shape"]))
    table = route_table(ranks, tuple(mesh.axis_names), names)
    return mlir.lower_fun(lambda p: jnp.asarray(table)[p], multiple_results=False)(ctx, position)


mlir.register_lowering(axis_route_p, _lower)


def axis_route(axis_name) -> jax.Array:
    """int32[1 + axis size] inside shard_map: [this device's index along `axis_name`, then the
    global rank (``tritongin.rank`` numbering) of every index along it]. Every mesh axis must be
    manual (the device's whole position picks its row of the route table)."""
    names = axes_lib.axis_names(axis_name, "jaxgin.axis_route")
    size = axes_lib.axis_size(names, "jaxgin.axis_route")
    axes_lib.require_shard_map(names, "jaxgin.axis_route")
    runtime.current()
    mesh = jax.sharding.get_abstract_mesh()
    everything = tuple(mesh.axis_names)
    manual = set(getattr(mesh, "manual_axes", everything))
    if not everything or set(everything) - manual:
        raise JaxginError(
            f"jaxgin.axis_route needs a shard_map that is manual over every mesh axis (mesh axes {everything}, "
            f"manual {sorted(manual, key=str)}); a device's rank depends on its position along all of them"
        )
    position = jax.lax.axis_index(everything)
    return axis_route_p.bind(position, names=names, size=size)
