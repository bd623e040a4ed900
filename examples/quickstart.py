"""jaxgin quickstart: bring jaxgin up, print what it runs on, check an exchange between all
devices, then use jaxgin's JAX ops inside shard_map and compare them with jax.lax's: ppermute,
all_to_all, and the ring exchange written with put_signal / wait_signal.

Needs: on a machine without GPUs nothing beyond pip install -e . (reference mode); on NVIDIA GPUs
pip install -e ".[cuda]" (JAX's CUDA plugin, NCCL, nvcc). A missing toolchain ends it with one line
that names it and the pip command (exit status 3).

On NVIDIA GPUs the exchange is a kernel of jaxgin's device library: every GPU writes a block into
every GPU's symmetric heap (LSA stores over NVLink within a host, GIN across hosts), signals it,
and checks what its peers wrote. Without GPUs it runs in reference mode on 4 virtual CPU devices
through jax.lax.all_to_all.

    python examples/quickstart.py
"""

import os

# Only affects JAX's CPU platform: 4 virtual devices for the reference mode.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import jaxgin  # noqa: E402
from jaxgin import cli  # noqa: E402

INSTALL_CUDA = 'pip install -e ".[cuda]"'


def ops_against_lax() -> None:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    box = jaxgin.Mailbox("quickstart_ring", shape=(1024,), dtype=jnp.float32)

    def step(block):
        me = jax.lax.axis_index("x")
        # Split phase: send my block to my right neighbour, compute meanwhile, then collect.
        token = jaxgin.put_signal(block[0], box, peer=(me + 1) % n, axis_name="x")
        busy = jnp.tanh(block).sum()  # work that overlaps the transfer
        inbox = jaxgin.wait_signal(box, count=1, axis_name="x", after=token)  # [n, 1024], row = sender
        from_left = inbox[(me - 1) % n]
        checks = jnp.stack([
            jnp.array_equal(from_left, jax.lax.ppermute(block[0], "x", ring)),
            jnp.array_equal(jaxgin.ppermute(block, "x", ring), jax.lax.ppermute(block, "x", ring)),
            jnp.array_equal(jaxgin.all_to_all(block, "x", 1, 1, tiled=True),
                            jax.lax.all_to_all(block, "x", 1, 1, tiled=True)),
        ])
        return checks[None], busy[None]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
    blocks = jnp.arange(n * 1024, dtype=jnp.float32).reshape(n, 1024)
    checks, _ = f(blocks)
    checks = multihost_utils.process_allgather(checks, tiled=True)  # every device's row, in every process
    names = ["put_signal/wait_signal ring == lax.ppermute", "ppermute == lax.ppermute", "all_to_all == lax.all_to_all"]
    for k, name in enumerate(names):
        if not checks[:, k].all():
            raise SystemExit(f"FAILED: {name} on devices {np.nonzero(~checks[:, k])[0].tolist()}")
    print(f"JAX ops OK on {n} devices: " + ", ".join(names))


def main() -> None:
    jaxgin.initialize()
    try:
        info = jaxgin.info()
        if info["backend"] == "reference":
            where = "no NCCL, no heap allocated: ops lower to jax.lax collectives"
            gpus = cli.cuda_gpu_count()
            if gpus:  # GPUs JAX does not drive: say so rather than pass the CPU run off as the GPU one
                where += f" (the CUDA driver shows {gpus} GPUs, but JAX's CUDA plugin is missing: {INSTALL_CUDA})"
        else:
            where = (f"NCCL={info['nccl_version']}, GIN={info['gin_type']}, LSA team={info['lsa_team_size']}, "
                     f"heap={info['heap_bytes'] >> 20} MiB per device")
        print(f"jaxgin {jaxgin.__version__} on {info['world_size']} {jax.default_backend()} devices: "
              f"backend={info['backend']}, {where}")
        report = jaxgin.selftest(rounds=20, block_bytes=64 * 1024)
        pairs = report.world_size * report.world_size
        if not report.ok:
            raise SystemExit(f"FAILED: wrong words per (receiver, sender): {report.mismatches}")
        print(f"exchange OK over the {report.path} path: {pairs} sender/receiver pairs x {report.rounds} rounds "
              f"x {report.block_bytes >> 10} KiB, every word checked")
        ops_against_lax()
    finally:
        jaxgin.finalize()


if __name__ == "__main__":
    cli.run(__file__, main)
