"""A matmul whose output chunks leave for their destination GPU while the rest is computed:
jaxgin.fused.matmul_all_to_all under jax.jit and shard_map, checked against (and timed next to)
the unfused jax.lax.all_to_all(x @ w), plus a gradient check and all_gather_matmul.

Needs: on a machine without GPUs nothing beyond pip install -e . (reference mode); on NVIDIA GPUs
pip install -e ".[cuda]" (JAX's CUDA plugin, NCCL, nvcc, Triton). A missing one ends it with one
line that names it and the pip command (exit status 3).

On NVIDIA GPUs (2 or more) it runs the default method="auto" on every GPU of this process, which
at this shape is "chunked" (cuBLAS chunks, copy-engine exchange); it prints which method ran and
why (jaxgin.fused.explain). Without GPUs it runs the reference path on 4 virtual CPU devices (same
results, no speed claim).

    python examples/fused_matmul_all_to_all.py
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


def timed(f, *args, steps=20) -> float:
    """Microseconds per call: `steps` dependent calls inside one jit (device time, not dispatch)."""

    def chain(x, w):
        def step(_, x):
            y = f(x, w)
            return x.at[0, 0].set((x[0, 0].astype(jnp.float32) + y[0, 0].astype(jnp.float32) * 0).astype(x.dtype))

        return jax.lax.fori_loop(0, steps, step, x)

    run = jax.jit(jax.shard_map(chain, mesh=MESH, in_specs=(P("x"), P()), out_specs=P("x")))
    jax.block_until_ready(run(*args))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(run(*args))
        best = min(best, time.perf_counter() - start)
    return best / steps * 1e6


def main() -> None:
    global MESH
    if jax.default_backend() == "gpu":
        cli.require(__file__, "triton", why="jaxgin.fused's kernels on GPUs", install='-e ".[cuda]"')
    jaxgin.initialize()
    on_gpu = jaxgin.info()["backend"] == "cuda"
    MESH = Mesh(np.array(jax.devices()), ("x",))
    n = MESH.size
    m, k, nn = (4096, 7168, 2048) if on_gpu else (256, 128, 64)
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.device_put(jax.random.normal(keys[0], (n * m, k), dtype), NamedSharding(MESH, P("x")))
    w = jax.device_put((jax.random.normal(keys[1], (k, nn)) / np.sqrt(k)).astype(dtype), NamedSharding(MESH, P()))

    fused = lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x")  # noqa: E731
    unfused = lambda x, w: jax.lax.all_to_all(x @ w, "x", 0, 0, tiled=True)  # noqa: E731
    once = lambda f: jax.jit(jax.shard_map(f, mesh=MESH, in_specs=(P("x"), P()), out_specs=P("x")))  # noqa: E731

    got, want = np.asarray(once(fused)(x, w), np.float32), np.asarray(once(unfused)(x, w), np.float32)
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{n} x {jax.devices()[0].device_kind}, x [{m}, {k}] @ w [{k}, {nn}] per device, bf16")
    print(jaxgin.fused.explain("matmul_all_to_all", (m, k), (k, nn), dtype, axis_size=n)
          if on_gpu else "reference mode: plain JAX stands in for every method")
    print(f"matmul_all_to_all vs lax.all_to_all(x @ w): max relative difference {err:.2e}")

    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    g_fused = jax.jit(jax.grad(loss(once(fused)), argnums=(0, 1)))(x, w)
    g_unfused = jax.jit(jax.grad(loss(once(unfused)), argnums=(0, 1)))(x, w)
    grad_err = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() / jnp.abs(b.astype(jnp.float32)).max())
                   for a, b in zip(g_fused, g_unfused))
    print(f"gradients vs the unfused composition: max relative difference {grad_err:.2e}")

    gather = lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x")  # noqa: E731
    gather_ref = lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w  # noqa: E731
    got, want = np.asarray(once(gather)(x, w), np.float32), np.asarray(once(gather_ref)(x, w), np.float32)
    print(f"all_gather_matmul vs lax.all_gather(x) @ w: max relative difference "
          f"{np.abs(got - want).max() / np.abs(want).max():.2e}")
    ok = err < 2e-2 and grad_err < 2e-2

    if on_gpu:
        t_matmul = timed(lambda x, w: x @ w, x, w)
        t_unfused, t_fused = timed(unfused, x, w), timed(fused, x, w)
        print(f"x @ w alone {t_matmul:.1f} us | x @ w then all_to_all {t_unfused:.1f} us | fused {t_fused:.1f} us "
              f"({t_unfused / t_fused:.2f}x faster than unfused, {t_fused / t_matmul:.2f}x the matmul alone)")
    else:
        print("no GPUs: ran jaxgin's reference path (timings are only meaningful on GPUs)")
    jaxgin.finalize()
    if not ok:
        raise SystemExit("mismatch")


if __name__ == "__main__":
    cli.run(__file__, main)
