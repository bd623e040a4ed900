"""How a scenario process joins a multi-process job (kept free of pytest: scenarios import it).

A scenario started by harness.start_processes gets `RANK WORLD ADDR` after its own arguments. In a
process-per-GPU job every process sees all GPUs and drives GPU RANK. In an emulated-hosts job
(harness.emulated_env) each process sees only the GPU it shares with others, and the harness says
which visible GPU to drive (JAXGIN_TEST_LOCAL_DEVICE) and which physical one that is
(JAXGIN_TEST_PHYSICAL_GPU, for nvidia-smi readings).
"""

import json
import os
import sys
import time


def local_device(rank: int) -> int:
    """The index, among this process's visible GPUs, of the one it drives."""
    return int(os.environ.get("JAXGIN_TEST_LOCAL_DEVICE", rank))


def physical_gpu(rank: int) -> int:
    """The nvidia-smi index of the GPU this process drives (or, in a one-process job, of its
    visible GPU `rank`): the harness names physical GPUs, by index, in CUDA_VISIBLE_DEVICES."""
    if "JAXGIN_TEST_PHYSICAL_GPU" in os.environ:
        return int(os.environ["JAXGIN_TEST_PHYSICAL_GPU"])
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return int(visible[rank]) if rank < len(visible) else rank


def emulated() -> bool:
    """True in an emulated-hosts job: every peer is reached through GIN over the host transport."""
    return os.environ.get("JAXGIN_TEST_EMULATED_HOSTS") == "1"


def join(argv) -> tuple[int, int] | None:
    """jax.distributed.initialize for argv `RANK WORLD ADDR ...`; (rank, world), or None (and
    nothing done) for a one-process scenario (empty argv)."""
    if not argv:
        return None
    import jax

    rank, world, address = int(argv[0]), int(argv[1]), argv[2]
    jax.distributed.initialize(address, num_processes=world, process_id=rank, local_device_ids=[local_device(rank)])
    return rank, world


def gathered(a):
    """Every process's shards of the global array `a`, as one numpy array on this host, once the
    programs behind `a` finished: the gather compiles a program of its own, and over the host
    transport XLA loading a program while a jaxgin program runs can stall both (docs/guide.md)."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    a = jax.block_until_ready(a)
    if jax.process_count() == 1:
        return np.asarray(a)
    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def exit_together(name: str, timeout_s: float = 600.0) -> None:
    """Waits until every process of the job got here, then returns (at once in a one-process
    scenario). Scenarios that end without jax.distributed's shutdown (after a device fault) call
    it before exiting: a process that exits first looks to the others like a dead peer (their
    transports see its connections close, and JAX's coordination service ends them). The timeout
    is generous because a barrier that times out ends every process of the job (measured: 8 ranks
    sharing one H100 beside two other jobs did not all finalize within 120 s)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    try:
        client.wait_at_barrier(f"jaxgin_test_exit_{name}", int(timeout_s * 1000))
    except Exception as e:  # a peer that already died: nothing to wait for
        print(f"exit barrier '{name}': {type(e).__name__}: {e}"[:300], file=sys.stderr, flush=True)


TIERS = ("fast", "soak")


def tier() -> str:
    """JAXGIN_TEST_TIER: "fast" (the default) takes every code path once; "soak" runs the long
    loops (1000-call chains, 10,000-op stress) that hunt rare races."""
    value = os.environ.get("JAXGIN_TEST_TIER", "fast")
    if value not in TIERS:
        raise ValueError(f"JAXGIN_TEST_TIER={value!r}: expected one of {TIERS} (fast is the default)")
    return value


def by_tier(fast, soak):
    """`fast` in the default tier, `soak` under JAXGIN_TEST_TIER=soak."""
    return soak if tier() == "soak" else fast


def spot_cases() -> bool:
    """Whether the scenario runs its spot cases only (JAXGIN_TEST_SPOT_CASES=1, set by the test):
    in the fast tier every case runs at the largest world of a family and a few at the smaller
    ones, which take the same code paths."""
    return os.environ.get("JAXGIN_TEST_SPOT_CASES") == "1"



def report(result: dict) -> None:
    """Prints the scenario's RESULT line with what it ran on: JAX's platform and the CUDA backend
    libraries jaxgin loaded. With JAX on CPU a scenario would compare lax with itself and pass."""
    import jax

    from jaxgin import runtime

    ran_on = {"jax_platform": jax.default_backend(), "jaxgin_cuda_backends": runtime.loaded_backends()}
    if os.environ.get("JAXGIN_TEST_EMULATED_HOSTS") == "1":
        ran_on["host_transport"] = _host_transport()
    print("RESULT:" + json.dumps({**result, "ran_on": ran_on}), flush=True)


def _host_transport() -> dict:
    """An emulated host's transport: its unkind behaviours, seed, GIN contexts, and what it did (its
    counters)."""
    from jaxgin import runtime, transport
    from jaxgin.errors import JaxginError

    try:
        counters = transport.counters()
    except (JaxginError, OSError) as e:
        counters = {"unreadable": str(e)}
    try:  # what NCCL granted (JAXGIN_GIN_CONTEXTS asks); unknown once the scenario finalized
        contexts = [d["gin_contexts"] for d in runtime.info()["local_devices"]] if runtime.is_initialized() else None
    except (JaxginError, KeyError):
        contexts = None
    return {"unkind": os.environ.get("JAXGIN_TRANSPORT_UNKIND", "none"),
            "seed": os.environ.get("JAXGIN_TRANSPORT_SEED", "1"),
            "gin_contexts_asked": os.environ.get("JAXGIN_GIN_CONTEXTS", "4"), "gin_contexts": contexts,
            "counters": counters}


def meet(name: str, rank: int, ranks, timeout_s: float = 120.0) -> list[int]:
    """A barrier of some of a job's ranks (`ranks`, this one among them) through files in the
    job's folder (JAXGIN_TEST_JOB_DIR): the survivors of a dead peer, whom JAX's own barriers
    would make wait for the dead one. Returns the ranks that had not arrived at the timeout."""
    folder = os.environ["JAXGIN_TEST_JOB_DIR"]
    with open(os.path.join(folder, f"{name}.{rank}"), "w"):
        pass
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in ranks if not os.path.exists(os.path.join(folder, f"{name}.{r}"))]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.05)
