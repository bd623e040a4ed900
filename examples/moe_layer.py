"""A small MoE block trained for a few steps under shard_map: jaxgin.moe.moe_layer (dispatch and
combine through jaxgin) next to the same layer on jax.lax.ragged_all_to_all, same weights, same
data: loss per step and time per training step.

Needs: on a machine without GPUs nothing beyond pip install -e . (reference mode); on NVIDIA GPUs
pip install -e ".[cuda]" (JAX's CUDA plugin, NCCL, nvcc, Triton). A missing one ends it with one
line that names it and the pip command (exit status 3).

On NVIDIA GPUs (2 or more) it runs jaxgin's Triton kernels over NVLink on every GPU of this
process; without them it runs the reference path on 4 virtual CPU devices (the ragged_all_to_all
layer is skipped there: XLA:CPU does not implement ragged-all-to-all). Started on several hosts
(examples/multihost/, docs/cluster.md), its peers on other hosts get GIN puts; the
ragged_all_to_all layer then runs only where XLA_FLAGS holds RAGGED_FALLBACK below: XLA runs
ragged_all_to_all across processes only through that NCCL send/recv fallback.

    python examples/moe_layer.py
"""

import os
import time

# Only affects JAX's CPU platform: 4 virtual devices for the reference mode.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxgin  # noqa: E402
from jaxgin import cli  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
RAGGED_FALLBACK = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"
if ON_GPU:
    cli.require(__file__, "triton", why="jaxgin.moe's kernels on GPUs", install='-e ".[cuda]"')
cli.run(__file__, jaxgin.initialize)
# Without GPUs, the 4 virtual devices of this process, or every process's when several run.
DEVICES = jax.devices() if ON_GPU or jax.process_count() > 1 else jax.devices()[:4]
MESH = Mesh(np.array(DEVICES), ("ep",))
N = len(DEVICES)
TOKENS, HIDDEN, FFN, LOCAL_EXPERTS, TOP_K = (1024, 1024, 512, 8, 4) if ON_GPU else (64, 64, 32, 2, 2)
EXPERTS = LOCAL_EXPERTS * N
DTYPE = jnp.bfloat16 if ON_GPU else jnp.float32
STEPS = 5


def make_step(layer):
    """One SGD step of a residual MoE block fitting a fixed random target."""

    def loss_fn(params, x, target):
        router, w1, w2 = params
        y = x + layer(x, (x @ router).astype(jnp.float32), w1, w2, top_k=TOP_K, axis_name="ep")
        return jax.lax.pmean(jnp.mean((y.astype(jnp.float32) - target.astype(jnp.float32)) ** 2), "ep")

    def step(params, x, target):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        # the router is replicated: its gradient is the mean over the axis
        grads = (jax.lax.pmean(grads[0], "ep"), grads[1], grads[2])
        params = jax.tree.map(lambda p, g: (p.astype(jnp.float32) - 0.5 * g.astype(jnp.float32)).astype(p.dtype),
                              params, grads)
        return params, loss

    specs = ((P(), P("ep"), P("ep")), P("ep"), P("ep"))
    return jax.jit(jax.shard_map(step, mesh=MESH, in_specs=specs, out_specs=(specs[0], P())))


def train(layer, params, x, target):
    step = make_step(layer)
    params_now, loss = step(params, x, target)  # compile
    jax.block_until_ready(loss)
    losses, start = [], time.perf_counter()
    params_now = params
    for _ in range(STEPS):
        params_now, loss = step(params_now, x, target)
        losses.append(float(loss))
    return losses, (time.perf_counter() - start) / STEPS * 1e3


keys = jax.random.split(jax.random.key(0), 5)
shard = NamedSharding(MESH, P("ep"))
x = jax.device_put(jax.random.normal(keys[0], (N * TOKENS, HIDDEN), jnp.float32).astype(DTYPE), shard)
target = jax.device_put(jax.random.normal(keys[1], (N * TOKENS, HIDDEN), jnp.float32).astype(DTYPE), shard)
params = (
    jax.device_put((jax.random.normal(keys[2], (HIDDEN, EXPERTS)) / np.sqrt(HIDDEN)).astype(DTYPE),
                   NamedSharding(MESH, P())),
    jax.device_put((jax.random.normal(keys[3], (EXPERTS, HIDDEN, FFN)) / np.sqrt(HIDDEN)).astype(DTYPE), shard),
    jax.device_put((jax.random.normal(keys[4], (EXPERTS, FFN, HIDDEN)) / np.sqrt(FFN)).astype(DTYPE), shard),
)

print(f"{N} {'GPUs' if ON_GPU else 'CPU devices (reference path)'}: {TOKENS} tokens/device, hidden {HIDDEN}, "
      f"{EXPERTS} experts, top-{TOP_K}, {np.dtype(DTYPE).name}")
losses, ms = train(jaxgin.moe.moe_layer, params, x, target)
print(f"jaxgin.moe.moe_layer         loss {' '.join(f'{v:.5f}' for v in losses)}   {ms:8.2f} ms/step")
assert losses[-1] < losses[0], "training did not reduce the loss"
if ON_GPU and jax.process_count() > 1 and RAGGED_FALLBACK not in os.environ.get("XLA_FLAGS", ""):
    print(f"ragged_all_to_all layer      skipped: with several processes XLA runs it only with {RAGGED_FALLBACK} "
          "in XLA_FLAGS")
elif ON_GPU:
    ragged_losses, ragged_ms = train(jaxgin.moe.ragged.moe_layer, params, x, target)
    print(f"ragged_all_to_all layer      loss {' '.join(f'{v:.5f}' for v in ragged_losses)}   {ragged_ms:8.2f} ms/step")
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, ragged_losses))
    print(f"loss agreement: max relative difference {gap:.2e}; step time ratio {ragged_ms / ms:.2f}x")
else:
    print("ragged_all_to_all layer      skipped: XLA:CPU has no ragged-all-to-all (runs on GPUs)")
jaxgin.finalize()
