"""Issue 7 on any number of GPUs, one included: a wait that starves in one process that drives
every visible GPU, then finalize(), must fail with jaxgin's named timeout and give back every GPU's
memory. The dead-peer test (test_reliability_gpu.py) needs two GPUs; this one exercises the same
teardown (reset, then the undo of NCCL's recorded virtual-memory calls) on a machine with one."""

from pathlib import Path

import pytest

from harness import GPUS, record, run_scenario

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU, found none")]

SCENARIOS = Path(__file__).with_name("reliability_scenarios.py")

# What JAX's own arrays keep mapped after a reset (XLA allocates them as CUDA virtual memory too):
# 38 MiB measured on 2 x H200 with XLA allocating as it goes. NCCL's buffers left 200 MiB more.
JAX_LEFTOVER_MIB = 64


@pytest.mark.parametrize("record_nccl_memory", [True, False], ids=["recorded", "heaps-only"])
def test_starved_wait_then_finalize_returns_every_gpus_memory(record_nccl_memory):
    env = {"JAXGIN_TIMEOUT": "2", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAXGIN_TEST_HEAP": "1GiB",
           "JAXGIN_RECORD_NCCL_MEMORY": "1" if record_nccl_memory else "0"}
    r = run_scenario(SCENARIOS, ["starved"], GPUS, timeout=300, env=env)
    record(f"fault_starved_{'recorded' if record_nccl_memory else 'heaps_only'}_{GPUS}gpu", r)
    assert r["devices"] == GPUS, r
    assert r["error"], r
    assert 1 <= len(r["faults"]) <= GPUS, r["faults"]  # a line per GPU whose wait trapped
    for fault in r["faults"]:
        assert "timed out" in fault and "jaxgin.wait_signal_from" in fault and "never arrived" in fault, fault
    assert r["seconds_to_error"] < r["timeout_s"] + 30, r
    assert r["finalize_error"] == "", r
    assert any("was reset to release its memory" in w for w in r["finalize_warnings"]), r
    assert r["primary_context_active_after_finalize"] == [False] * GPUS, r
    for before, after in zip(r["gpu_used_mib_before_finalize"], r["gpu_used_mib_after_finalize"]):
        assert before is not None and after is not None and after < before, r
    if record_nccl_memory:
        # The GPU machines install CUPTI with jaxgin's `test` extra: the record must have been taken.
        assert r["fault_cleanup"] == "all of NCCL's GPU memory", r
        assert any("NCCL's allocations, the heaps among them, were released" in w for w in r["finalize_warnings"]), r
        assert max(r["gpu_used_mib_after_finalize"]) <= JAX_LEFTOVER_MIB, r
    else:
        assert "JAXGIN_RECORD_NCCL_MEMORY=0" in r["fault_cleanup"], r
        # Only the heaps come back: what initialize() added besides the heap may stay.
        for start, initialized, after in zip(r["gpu_used_mib_before_initialize"], r["gpu_used_mib_after_initialize"],
                                             r["gpu_used_mib_after_finalize"]):
            assert after <= max(initialized - start - r["heap_mib"], 0) + 16, r
