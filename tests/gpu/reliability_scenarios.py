"""GPU scenarios for issue 7 (reliability), each run in a fresh process by test_reliability_gpu.py.

    python tests/gpu/reliability_scenarios.py stress OPS [RANK N ADDR]     # one process, all visible GPUs,
    python tests/gpu/reliability_scenarios.py memory_model [RANK N ADDR]   #   or one of N processes
    python tests/gpu/reliability_scenarios.py starved [RANK N ADDR]
    python tests/gpu/reliability_scenarios.py fault KIND RANK N ADDR       # one of N processes (KIND: lines,
                                                                           #   ring, moe, matmul_all_to_all
                                                                           #   or burst)

Each prints one JSON line prefixed with RESULT:.
"""

import os
import subprocess
import sys
import time
import warnings

import job
import ops_scenarios


def stress(argv):
    """jaxgin.stress: random ops, sizes 0 B - 64 MiB, against jax.lax; memory before and after."""
    jax, jaxgin = ops_scenarios._setup(argv[1:])
    import numpy as np
    from jax.sharding import Mesh

    from jaxgin import stress as stress_lib

    mesh = Mesh(np.array(jax.devices()), ("x",))
    result = stress_lib.stress(mesh, int(argv[0]), seed=int(os.environ.get("JAXGIN_STRESS_SEED", "0")))
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    jaxgin.finalize()
    job.report(result)


MEMORY_MODEL_ITERATIONS = int(os.environ.get("JAXGIN_MEMORY_MODEL_ITERATIONS", job.by_tier(300, 3000)))


def memory_model(argv):
    """Would catch a missing fence: in one jitted loop, each iteration writes a payload (an XLA
    fusion right before the put), sends it, waits, and compares every element right after the
    wait. Element j of the payload sender s writes in iteration i is (i * n + s) * E + j (mod 2^32),
    so a read that ran ahead of the data sees the previous iteration's value and counts. The
    paths: mailbox lines (8 KiB, one CTA), mailbox slots (4 MiB: 64 CTAs write, 64 read) taken by
    wait_signal_from and by wait_signal (whose CTA 0 decides for the others), ppermute's line
    exchange (8 KiB) and ppermute's rings (4 MiB over many lanes)."""
    jax, jaxgin = ops_scenarios._setup(argv)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = ops_scenarios._mesh(jax)
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    report = {"devices": n, "iterations": MEMORY_MODEL_ITERATIONS, "paths": {}}
    paths = {"lines": 2048, "slots": 1 << 20, "slots_inbox": 1 << 20, "ppermute_lines": 2048, "ppermute": 1 << 20}
    for path, elements in paths.items():
        box = jaxgin.Mailbox(f"memory_model_{path}", (elements,), jnp.uint32)

        def body(dummy, path=path, elements=elements, box=box):
            me = jax.lax.axis_index("x").astype(jnp.uint32)
            left = (me + n - 1) % n
            j = jnp.arange(elements, dtype=jnp.uint32)

            def step(i, tally):
                i = i.astype(jnp.uint32)
                payload = (i * n + me) * elements + j + dummy[0]  # written right before the put
                if path.startswith("ppermute"):
                    got = jaxgin.ppermute(payload, "x", ring)
                else:
                    token = jaxgin.put_signal(payload, box, (me + 1) % n, axis_name="x")
                    if path == "slots_inbox":
                        got = jaxgin.wait_signal(box, 1, axis_name="x", after=token)[left]
                    else:
                        got = jaxgin.wait_signal_from(box, left, axis_name="x", after=token)
                want = (i * n + left) * elements + j + dummy[0]
                # read right after the wait; the second count is of payloads compared
                return tally + jnp.stack([jnp.sum(got != want, dtype=jnp.int32), jnp.int32(1)])

            zero = (dummy[0] * 0).astype(jnp.int32)
            return jax.lax.fori_loop(0, MEMORY_MODEL_ITERATIONS, step, jnp.stack([zero, zero]))[None]

        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        dummy = ops_scenarios._global(jax, mesh, (1,), jnp.uint32, 0) * 0  # zeros XLA cannot fold
        start = time.perf_counter()
        counts = job.gathered(f(dummy))  # [n, 2]: per device, mismatched elements and payloads compared
        report["paths"][path] = {"payload_bytes": elements * 4, "mismatched_elements": int(counts[:, 0].sum()),
                                 "elements_checked": int(counts[:, 1].sum()) * elements,
                                 "seconds": time.perf_counter() - start}
    jaxgin.finalize()
    job.report(report)


KILL_AT = 20  # iterations the victim completes before it dies


# Per-device ppermute payloads of the fault scenario: a line message (line exchange kernel) and a
# 16 KiB one (two ring chunks, generic exchange kernel).
FAULT_MESSAGES = {"lines": (1, 16), "ring": (4, 1024), "moe": (64, 256), "matmul_all_to_all": (128, 64),
                  "all_gather_matmul": (128, 64), "burst": (64,)}  # per GPU
BURST_PUTS = 64  # puts one CTA posts without waiting in the "burst" kind: far more than a queue of 4 holds


def _moe_round_trip(jax, jaxgin, mesh):
    """v -> combine(dispatch(v)) over axis "x", routing from v itself (top 2 of 4 experts per GPU)."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    experts = 4 * mesh.size

    def step(v):
        logits = jnp.tile(v[:, :1], (1, experts)) * jnp.arange(1, experts + 1, dtype=v.dtype)
        weights, ids = jaxgin.moe.router(logits, 2)
        sent = jaxgin.moe.dispatch(v, ids, weights, num_experts=experts, axis_name="x")
        return jaxgin.moe.combine(sent.x, sent.handle) * 0.5 + 1

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _matmul_all_to_all(jax, jaxgin, mesh):
    """v -> matmul_all_to_all(v, identity) over axis "x" (method="chunked", which runs the Triton
    kernel's GIN paths when peers are on other hosts): v's row blocks trade places each call."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def step(v):
        eye = jnp.eye(v.shape[1], dtype=v.dtype)
        return jaxgin.fused.matmul_all_to_all(v, eye, axis_name="x", method="chunked") + 1

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _all_gather_matmul(jax, jaxgin, mesh):
    """v -> the mean of every GPU's v (all_gather_matmul(v, identity) over axis "x", method
    "chunked", which runs the Triton kernel's GIN paths when peers are on other hosts) + 1: on a
    mixed mesh each shard crosses to the other host once and is forwarded there over NVLink."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def step(v):
        eye = jnp.eye(v.shape[1], dtype=v.dtype)
        gathered = jaxgin.fused.all_gather_matmul(v, eye, axis_name="x", method="chunked")
        return jnp.mean(gathered.reshape(mesh.size, *v.shape), axis=0) + 1

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _burst_ring(jax, jaxgin, mesh, words: int):
    """v -> the left neighbour's v + 1 over axis "x", through a Triton kernel that posts BURST_PUTS
    GIN puts in a row before it waits (tritongin_scenarios.burst_ring_kernel)."""
    import tritongin
    from jax.sharding import PartitionSpec as P
    from tritongin_scenarios import burst_ring_kernel

    send = tritongin.empty((words,), "float32")
    recv = tritongin.empty((BURST_PUTS * words,), "float32")
    sig = tritongin.signals(2)

    def step(v):
        return jaxgin.triton_call(burst_ring_kernel, v, send, recv, sig[0], sig[1], grid=(1,), out_shape=v,
                                  WORDS=words, PUTS=BURST_PUTS) + 1

    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def _wait_until_lost(rank: int, seconds: float = 60) -> None:
    """Until this process's host transport saw `rank`'s process end."""
    from jaxgin import transport

    deadline = time.monotonic() + seconds
    while rank not in transport.lost_peers():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the host transport never saw rank {rank}'s process end")
        time.sleep(0.05)


def fault(argv):
    """The last rank dies mid-loop (os._exit, no finalize); the others must fail with jaxgin's
    named wait timeout, not hang. Reports how long after their last good iteration they failed,
    then finalizes and reports the GPU memory in use before and after. argv: the message kind
    (FAULT_MESSAGES: a ppermute of that size each iteration; "moe": a MoE dispatch and combine;
    "matmul_all_to_all", "all_gather_matmul": the fused op), then rank, world and coordinator address."""
    message, argv = argv[0], argv[1:]
    used = {}
    gpu = job.physical_gpu(int(argv[0]))
    recoverable = _recoverable_tasks()
    jax, jaxgin = ops_scenarios._setup(argv, lambda: used.update(before=_gpu_used_mib(gpu)))
    used["initialized"] = _gpu_used_mib(gpu)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rank, n = int(argv[0]), int(argv[1])
    mesh = ops_scenarios._mesh(jax)
    if message == "moe":
        f = _moe_round_trip(jax, jaxgin, mesh)
    elif message == "matmul_all_to_all":
        f = _matmul_all_to_all(jax, jaxgin, mesh)
    elif message == "all_gather_matmul":
        f = _all_gather_matmul(jax, jaxgin, mesh)
    elif message == "burst":
        f = _burst_ring(jax, jaxgin, mesh, FAULT_MESSAGES[message][0])
    else:
        ring = [(i, (i + 1) % n) for i in range(n)]
        f = jax.jit(jax.shard_map(lambda v: jaxgin.ppermute(v, "x", ring) + 1, mesh=mesh, in_specs=P("x"),
                                  out_specs=P("x")))
    x = ops_scenarios._global(jax, mesh, FAULT_MESSAGES[message], jnp.float32, 5)
    last_good = time.perf_counter()
    completed, error = 0, ""
    for i in range(10 * KILL_AT):
        if rank == n - 1 and i == KILL_AT:
            if message == "burst":
                time.sleep(2)  # its last credit lands first (a GIN signal outlives its kernel)
            os._exit(17)  # the victim: gone without a goodbye
        if message == "burst" and i == KILL_AT:
            # Every put of the next call goes to a peer known to be gone: under
            # JAXGIN_TRANSPORT_PEER_LOSS=fail the first ends NCCL's GIN progress thread.
            _wait_until_lost(n - 1)
        try:
            x = f(x)
            jax.block_until_ready(x)
            completed += 1
            last_good = time.perf_counter()
        except Exception as e:  # XLA reports the trapped kernel as a CUDA error
            error = f"{type(e).__name__}: {e}"[:400]
            break
    seconds = time.perf_counter() - last_good
    info = jaxgin.info()
    report = {"message": message, "bytes_per_device": int(x.nbytes) // n, "heap_mib": info["heap_bytes"] >> 20,
              "rank": rank, "recoverable_tasks": recoverable, "completed": completed, "error": error,
              "seconds_to_error": seconds,
              "faults": jaxgin.device_faults(), "timeout_s": info["timeout_s"], "fault_cleanup": info["fault_cleanup"]}
    # A survivor that caught the error finalizes: every byte it held on its GPU must come back.
    report["gpu_used_mib_before_initialize"] = used["before"]  # JAX's context alone
    report["gpu_used_mib_after_initialize"] = used["initialized"]
    report["gpu_used_mib_before_finalize"] = _gpu_used_mib(gpu)
    _finalize_into(jaxgin, report)
    report["gpu_used_mib_after_finalize"] = _gpu_used_mib(gpu)
    report["primary_context_active_after_finalize"] = _primary_context_active(job.local_device(rank))
    # Every GPU's, the dead peer's included: nothing of it may outlive it on its GPU.
    report["all_gpus_used_mib_after_finalize"] = [_gpu_used_mib(job.physical_gpu(i)) for i in range(n)]
    if not job.emulated():
        # A survivor's heap stays on its GPU while another survivor still maps it (without the
        # record of NCCL's allocations, those mappings go only with that survivor's reset): read
        # once more after every survivor finalized. (Emulated ranks share GPUs: no reading.)
        report["survivors_missing_at_the_meeting"] = job.meet("finalized", rank, range(n - 1))
        time.sleep(0.5)  # nvidia-smi's figure lags the release a little
        report["gpu_used_mib_after_every_survivor_finalized"] = _gpu_used_mib(gpu)
    job.report(report)
    # A survivor that exits takes its connections with it, and rank 0 JAX's coordination service:
    # the other survivors' JAX clients then end them (SIGABRT, seen at world 8 on 4 x H200) before
    # they report. So every survivor waits for the others' reports before it exits.
    job.meet("reported", rank, range(n - 1))
    os._exit(0)  # the coordinator's peer is dead: skip jax.distributed's shutdown


def _recoverable_tasks() -> bool:
    """Asks JAX's coordination service to let the job's other processes run on when one dies, so
    that a dead peer reaches the survivors as jaxgin's named fault rather than as the service
    ending them ("another task died"). False where this JAX has no such option."""
    import jax

    try:
        jax.config.update("jax_enable_recoverability", True)
    except AttributeError:
        return False
    return True


def starved(argv):
    """One process driving every visible GPU (one is enough): a wait that starves on all of them
    (each device puts once into its own inbox, then waits twice for itself), then finalize(), whose
    teardowns of the broken GPUs run at once, each undoing what NCCL allocated there. Reports the
    error, the fault lines, finalize()'s warnings, and every GPU's used memory and context state
    before and after. XLA_PYTHON_CLIENT_PREALLOCATE=false keeps JAX's share small."""
    used = {}

    def before_initialize():
        import jax

        used["before"] = [_gpu_used_mib(i) for i in gpus(jax)]

    def gpus(jax):  # the nvidia-smi index of each GPU this process drives
        return [job.physical_gpu(int(argv[0]))] if argv else [job.physical_gpu(i) for i in range(len(jax.local_devices()))]

    jax, jaxgin = ops_scenarios._setup(argv, before_initialize)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    n = len(jax.devices())
    local = gpus(jax)
    mesh = ops_scenarios._mesh(jax)
    box = jaxgin.Mailbox("starved_everywhere", (8,), jnp.float32)

    def starve(v):
        # One put to itself, two waits for it: the second waits for a put that never comes (a
        # starved wait that needs no peer, so one GPU is enough).
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0], box, peer=me, axis_name="x")
        first = jaxgin.wait_signal_from(box, me, axis_name="x", after=token)
        return (first + jaxgin.wait_signal_from(box, me, axis_name="x", after=token))[None]

    f = jax.jit(jax.shard_map(starve, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = ops_scenarios._global(jax, mesh, (1, 8), jnp.float32, 3)
    info = jaxgin.info()
    report = {"devices": n, "heap_mib": info["heap_bytes"] >> 20, "timeout_s": info["timeout_s"],
              "fault_cleanup": info["fault_cleanup"], "gpu_used_mib_before_initialize": used["before"],
              "gpu_used_mib_after_initialize": [_gpu_used_mib(i) for i in local]}
    start = time.perf_counter()
    try:
        jax.block_until_ready(f(x))
        report["error"] = ""
    except Exception as e:  # XLA reports the trapped kernel as a CUDA error
        report["error"] = f"{type(e).__name__}: {e}"[:400]
    report["seconds_to_error"] = time.perf_counter() - start
    report["faults"] = jaxgin.device_faults()
    report["gpu_used_mib_before_finalize"] = [_gpu_used_mib(i) for i in local]
    _finalize_into(jaxgin, report)
    time.sleep(0.5)  # nvidia-smi's figure lags the release a little
    report["gpu_used_mib_after_finalize"] = [_gpu_used_mib(i) for i in local]
    report["primary_context_active_after_finalize"] = [_primary_context_active(i) for i in range(len(local))]
    job.report(report)
    job.exit_together("starved")
    os._exit(0)  # XLA's clients still point at the reset contexts: skip their teardown


def _finalize_into(jaxgin, report: dict) -> None:
    """jaxgin.finalize() after a fault, its error (empty if none) and its warnings into `report`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            jaxgin.finalize()
            report["finalize_error"] = ""
        except Exception as e:  # reported, asserted empty by the test
            report["finalize_error"] = f"{type(e).__name__}: {e}"[:400]
    report["finalize_warnings"] = [str(w.message)[:300] for w in caught]


def _primary_context_active(ordinal: int) -> bool | None:
    """Whether this process holds a CUDA context on GPU `ordinal` (the driver's own answer, which
    creates none): what it holds after finalize() is told apart from a context's memory by it."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
        return None
    if cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)):
        return None
    return bool(active.value)


def _gpu_used_mib(index: int) -> int | None:
    """Memory in use on GPU `index` (nvidia-smi, outside this process's CUDA context, which may be
    broken): with one process per GPU, what this process holds there."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(index)],
                         capture_output=True, text=True, check=False)
    return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip().isdigit() else None


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2:])
