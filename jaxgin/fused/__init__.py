"""Matmuls fused with their communication, inside jax.shard_map.

    y = jaxgin.fused.matmul_all_to_all(x, w, axis_name="x")   # == lax.all_to_all(x @ w, "x", 0, 0, tiled=True)
    z = jaxgin.fused.all_gather_matmul(x, w, axis_name="x")   # == lax.all_gather(x, "x", tiled=True) @ w

On GPUs each is one Triton kernel (tritongin) run by jaxgin.triton_call: output tiles leave for
their destination the moment they are computed (matmul_all_to_all), or peers' shards are consumed
as they arrive (all_gather_matmul), so communication hides under compute. In reference mode (CPU)
they compute the same chunk placement in plain JAX.

Gradients go through jax.custom_vjp and equal those of the unfused compositions. The backward
passes are unfused on purpose: there the communication precedes the matmuls (matmul_all_to_all's
backward is all_to_all then matmul, all_gather_matmul's needs the gathered x and a reduce-scatter),
which is the other fusion pattern; they use jaxgin.all_to_all and XLA's collectives.

Tile sizes: the first call for a (GPU, shape, dtype) times a few configurations of the kernels'
matmul alone and keeps the fastest (cached on disk next to the build cache; in a multi-process job
process 0 tunes and the others use its choice, since the grid must agree on every GPU).
JAXGIN_FUSED_AUTOTUNE=0 uses the first candidate; ``tiles=TileConfig(...)`` fixes one.

Every mesh axis must be manual in the shard_map (the kernels find their peers' ranks from the
device's whole mesh position, see jaxgin.axis_route).
"""

from jaxgin.fused._common import TileConfig
from jaxgin.fused.all_gather_matmul import all_gather_matmul
from jaxgin.fused.matmul_all_to_all import matmul_all_to_all

__all__ = ["TileConfig", "all_gather_matmul", "matmul_all_to_all"]
