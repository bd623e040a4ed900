"""How a scenario process joins a multi-process job (kept free of pytest: scenarios import it).

A scenario started by harness.start_processes gets `RANK WORLD ADDR` after its own arguments. In a
process-per-GPU job every process sees all GPUs and drives GPU RANK. In an emulated-hosts job
(harness.emulated_env) each process sees only the GPU it shares with others, and the harness says
which visible GPU to drive (JAXGIN_TEST_LOCAL_DEVICE) and which physical one that is
(JAXGIN_TEST_PHYSICAL_GPU, for nvidia-smi readings).
"""

import os


def local_device(rank: int) -> int:
    """The index, among this process's visible GPUs, of the one it drives."""
    return int(os.environ.get("JAXGIN_TEST_LOCAL_DEVICE", rank))


def physical_gpu(rank: int) -> int:
    """The nvidia-smi index of the GPU this process drives."""
    return int(os.environ.get("JAXGIN_TEST_PHYSICAL_GPU", rank))


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
