"""Matmuls fused with their communication, inside jax.shard_map.

    y = jaxgin.fused.matmul_all_to_all(x, w, axis_name="x")   # == lax.all_to_all(x @ w, "x", 0, 0, tiled=True)
    z = jaxgin.fused.all_gather_matmul(x, w, axis_name="x")   # == lax.all_gather(x, "x", tiled=True) @ w
    s = jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x")  # == lax.psum_scatter(x @ w, "x", tiled=True)

matmul_reduce_scatter's owner sums the partials it receives in float32 in the order of the axis,
so its result does not change from run to run.

On GPUs, method="chunked" is one XLA custom call that multiplies chunk by chunk with
cuBLAS while the copy engine moves finished chunks (matmul_all_to_all, and the partial chunks of
matmul_reduce_scatter, summed by XLA after the call) or this GPU's shard (all_gather_matmul) over
NVLink on side streams, so communication hides under compute and takes no SMs from it
(_chunked.py, csrc/ffi/chunked_matmul.cu). method="triton" is one Triton kernel (tritongin) run by
jaxgin.triton_call: output tiles leave for their destination the moment they are computed, or
peers' shards are consumed as they arrive. method="unfused" is XLA's matmul then XLA's
collective. method="auto" (the default) runs "chunked" where the matmul is long enough to hide the
exchange and "unfused" below that (and the Triton kernel in a job with GPUs on other hosts):

    print(jaxgin.fused.explain("matmul_all_to_all", (512, 7168), (7168, 2048), axis_size=4))

says which runs and why. In reference mode (CPU) every method computes the same chunk placement
in plain JAX.

Gradients go through jax.custom_vjp and equal those of the unfused compositions. The backward
passes are unfused on purpose: there the communication precedes the matmuls (matmul_all_to_all's
backward is all_to_all then matmul, all_gather_matmul's needs the gathered x and a reduce-scatter,
matmul_reduce_scatter's the gathered cotangent for both matmuls), which is the other fusion
pattern; they use jaxgin.all_to_all and XLA's collectives.

Tile sizes (method="triton"; cuBLAS picks its own): the first call for a (GPU, shape, dtype) times
a few configurations of the kernels' matmul alone by the GPU's clock and keeps the fastest (cached
on disk next to the build cache; in a multi-process job process 0 tunes and the others use its
choice, since the grid must agree on every GPU).
JAXGIN_FUSED_AUTOTUNE=0 uses the first candidate; ``tiles=TileConfig(...)`` fixes one.

Every mesh axis must be manual in the shard_map (the kernels find their peers' ranks from the
device's whole mesh position, see jaxgin.axis_route).
"""

from jaxgin.fused._common import MethodChoice, TileConfig
from jaxgin.fused.all_gather_matmul import all_gather_matmul
from jaxgin.fused.explain import explain
from jaxgin.fused.matmul_all_to_all import matmul_all_to_all
from jaxgin.fused.matmul_reduce_scatter import matmul_reduce_scatter

__all__ = ["MethodChoice", "TileConfig", "all_gather_matmul", "explain", "matmul_all_to_all", "matmul_reduce_scatter"]
