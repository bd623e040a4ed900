"""What each GPU test needs of the machine, for the GPU round (tools/gpu_round.py): GPUs, processes,
and whether it needs its GPUs to itself. tests/conftest.py writes it at collection when
JAXGIN_ROUND_PLAN names a file (a JSON list, one entry per test)."""

import json

from harness import GPUS, MIXED_WORLD

# The tests that read whole-GPU memory (nvidia-smi, cudaMemGetInfo) or time kernels: another
# test's processes on their GPUs would change what they measure.
EXCLUSIVE = {
    "test_fault_cleanup_gpu.py::test_starved_wait_then_finalize_returns_every_gpus_memory",
    "test_reliability_gpu.py::test_stress_equals_lax_without_memory_growth",
    "test_reliability_gpu.py::test_dead_peer_fails_survivors_within_the_timeout",
    "test_runtime_gpu.py::test_lifecycle_one_process_all_gpus",
    "test_runtime_gpu.py::test_lifecycle_one_process_per_gpu",
    "test_tritongin_gpu.py::test_put_signal_latency",
    "test_tritongin_gpu.py::test_peer_ptr_bandwidth",
}
# Tests whose scenario drives the first GPU or two only, whatever the machine has. (The latency and
# bandwidth tests use two but take every GPU: beside each other on a 4 x H200, NVLink traffic on
# one pair added to the other pair's latency.)
FIXED_GPUS = {
    "test_fault_cleanup_gpu.py::test_starved_wait_then_finalize_returns_every_gpus_memory": 1,
    "test_reliability_gpu.py::test_payloads_are_complete_when_the_wait_returns": 2,
    "test_ops_gpu.py::test_command_buffers_keep_jaxgin_calls_in_program_order": 2,
    "test_ops_gpu.py::test_iterations_process_per_gpu": 2,
    "test_ops_gpu.py::test_starved_wait_fails_with_a_named_error": 2,
    "test_ops_gpu.py::test_starved_wait_from_fails_naming_the_sender": 2,
    "test_ops_gpu.py::test_traced_index_out_of_range_fails_naming_it": 2,
    "test_fused_gpu.py::test_peer_that_never_calls_fails_naming_it": 2,
    "test_runtime_gpu.py::test_wait_times_out_with_a_clear_error": 1,
    "test_runtime_gpu.py::test_force_gin_without_gin_says_why": 2,
    "test_transport_gpu.py::test_iterations_over_host_transport": 2,
    "test_transport_gpu.py::test_two_hosts_over_tcp": 2,
    "test_transport_gpu.py::test_starved_wait_still_fails_with_a_named_error": 2,
    "test_tritongin_gpu.py::test_launches_importing_triton_first_all_come_up": 2,
    "test_tritongin_gpu.py::test_free_waits_for_puts_still_to_land": 2,
}
# Processes beyond what a test's world says: the launch test runs 5 world-2 jobs at once.
PROCESSES = {"test_tritongin_gpu.py::test_launches_importing_triton_first_all_come_up": 10}


def demands(item) -> dict:
    """What `item` needs of the machine: GPUs, processes, and whether it needs its GPUs alone."""
    test = f"{item.path.name}::{item.originalname}"
    params = getattr(item, "callspec", None)
    world = MIXED_WORLD if "mixed_mesh" in test else params.params.get("world") if params is not None else None
    if test in FIXED_GPUS:
        gpus = FIXED_GPUS[test]
    elif "mixed_mesh" in test:
        gpus = GPUS  # the mixed world is chosen from every GPU there is
    elif world is not None:
        gpus = min(world, GPUS)  # an emulated job spreads its ranks over as many GPUs as it has ranks
    else:
        gpus = GPUS
    return {"nodeid": item.nodeid, "gpus": max(gpus, 1), "processes": max(PROCESSES.get(test) or world or gpus, 1),
            "exclusive": test in EXCLUSIVE}


def write(path: str, items) -> None:
    with open(path, "w") as out:
        json.dump([demands(item) for item in items], out, indent=1)
