"""jaxgin quickstart: bring jaxgin up, print what it runs on, and check an exchange between all
devices.

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

import jaxgin  # noqa: E402


def main() -> None:
    jaxgin.initialize()
    try:
        info = jaxgin.info()
        print(f"jaxgin {jaxgin.__version__} on {info['world_size']} {jax.default_backend()} devices: "
              f"backend={info['backend']}, NCCL={info['nccl_version']}, GIN={info['gin_type']}, "
              f"LSA team={info['lsa_team_size']}, heap={info['heap_bytes'] >> 20} MiB per device")
        report = jaxgin.selftest(rounds=20, block_bytes=64 * 1024)
        pairs = report.world_size * report.world_size
        if not report.ok:
            raise SystemExit(f"FAILED: wrong words per (receiver, sender): {report.mismatches}")
        print(f"exchange OK over the {report.path} path: {pairs} sender/receiver pairs x {report.rounds} rounds "
              f"x {report.block_bytes >> 10} KiB, every word checked")
    finally:
        jaxgin.finalize()


if __name__ == "__main__":
    main()
