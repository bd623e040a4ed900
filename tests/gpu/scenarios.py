"""GPU scenarios, each run in a fresh process by tests/gpu/test_runtime_gpu.py (a device fault
leaves a CUDA context unusable, and several processes need their own JAX runtime).

    python tests/gpu/scenarios.py lifecycle           # one process, all visible GPUs
    python tests/gpu/scenarios.py lifecycle RANK N ADDR  # one of N processes, one GPU each
    python tests/gpu/scenarios.py timeout
    python tests/gpu/scenarios.py force_gin

Each prints one JSON line prefixed with RESULT: that the test asserts on.
"""

import sys
import time

import job


def _free_bytes(backend, devices):
    return [backend.device_memory(d.local_hardware_id)[0] for d in devices]


def _xla_all_reduce(jax):
    """An XLA NCCL collective over every device, so XLA loads and uses its NCCL too."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = jax.make_array_from_callback((jax.device_count(),), NamedSharding(mesh, P("x")),
                                     lambda index: np.arange(jax.device_count(), dtype=np.float32)[index])
    total = f(x)
    return float(np.asarray(total.addressable_shards[0].data)[0])


def lifecycle(argv):
    import jax

    job.join(argv)
    import jaxgin
    from jaxgin import build, nccl, runtime

    local = jax.local_devices()
    backend = runtime.load_backend(nccl.load(), build.arch_for(local[0].compute_capability))
    # XLA preallocates its memory pool and creates its own NCCL communicator on first use: do that
    # before the baseline, so the baseline isolates what jaxgin takes and gives back. Not with
    # emulated hosts: NCCL loads jaxgin's host transport (NCCL_RMA_PLUGIN, which initialize() sets)
    # only at the process's first communicator, so jaxgin's must come first; and there the ranks
    # share the GPU, so memory is not compared.
    if not job.emulated():
        _xla_all_reduce(jax)
    free_before = _free_bytes(backend, local)
    result = {"processes": jax.process_count(), "devices": jax.device_count(), "cycles": []}
    for cycle in range(2):  # the second cycle proves finalize() -> initialize() works
        jaxgin.initialize(heap_size="256MiB")
        info = jaxgin.info()
        xla_sum = _xla_all_reduce(jax)
        start = time.perf_counter()
        small = jaxgin.selftest(rounds=1000, block_bytes=4096)
        small_s = time.perf_counter() - start
        large = jaxgin.selftest(rounds=20, block_bytes=1 << 20)
        free_during = _free_bytes(backend, local)
        jaxgin.finalize()
        free_after = _free_bytes(backend, local)
        result["cycles"].append(
            {
                "info": info,
                "xla_all_reduce": xla_sum,
                "nccl_libraries": [str(p) for p in nccl.loaded_libraries()],
                "selftest_4KiB": {"path": small.path, "ok": small.ok, "rounds": small.rounds,
                                  "mismatches": str(small.mismatches), "us_per_round": small_s / small.rounds * 1e6},
                "selftest_1MiB": {"path": large.path, "ok": large.ok, "rounds": large.rounds,
                                  "mismatches": str(large.mismatches)},
                "held_bytes_while_initialized": [b - d for b, d in zip(free_before, free_during)],
                "retained_bytes_after_finalize": [b - a for b, a in zip(free_before, free_after)],
            }
        )
    if argv:
        jax.distributed.shutdown()
    return result


def timeout(argv):
    import jaxgin
    from jaxgin import runtime

    jaxgin.initialize(heap_size="64MiB", timeout=2.0)
    start = time.perf_counter()
    try:
        runtime.block_until_signal(5, 1)  # nobody ever signals 5
    except jaxgin.DeviceFault as e:
        return {"raised": type(e).__name__, "message": str(e), "seconds": time.perf_counter() - start}
    return {"raised": None, "seconds": time.perf_counter() - start}


def force_gin(argv):
    import jaxgin

    try:
        jaxgin.initialize(heap_size="64MiB", force_gin=True, gin_transport="nic")
    except jaxgin.JaxginError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    info = jaxgin.info()
    jaxgin.finalize()
    return {"raised": None, "gin_type": info["gin_type"]}


if __name__ == "__main__":
    scenario = {"lifecycle": lifecycle, "timeout": timeout, "force_gin": force_gin}[sys.argv[1]]
    job.report(scenario(sys.argv[2:]))
