"""jaxgin's JAX ops on NVIDIA GPUs (skipped where there are none): ppermute, all_to_all and
put_signal / wait_signal against jax.lax in the same program (shapes, dtypes, gradients, traced
peers, XLA collectives in the same jit), 1000 back-to-back iterations with and without XLA command
buffers, replay of CUDA graphs, and a starved wait that must fail with a named error instead of hanging. On 2 GPUs and
on all visible ones, in one process and in one process per GPU."""

from pathlib import Path

import pytest

from harness import GPUS, WORLD_SIZES, record, run_processes, run_scenario

SCENARIOS = Path(__file__).with_name("ops_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 NVIDIA GPUs, found {GPUS}")]


def _check_correctness(result, world):
    assert result["devices"] == world
    assert result["checks"] >= 100
    assert result["failed"] == [], result["details"]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_equal_lax_one_process(world):
    result = run_scenario(SCENARIOS, ["correctness"], world)
    record(f"ops_correctness_single_process_{world}gpu", result)
    _check_correctness(result, world)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_equal_lax_process_per_gpu(world):
    results = run_processes(SCENARIOS, ["correctness"], world)
    record(f"ops_correctness_process_per_gpu_{world}gpu", {"processes": results})
    for result in results:
        assert result["processes"] == world
        _check_correctness(result, world)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_1000_iterations(world, command_buffers):
    result = run_scenario(SCENARIOS, ["iterations"], world, xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"ops_iterations_{'graphs' if command_buffers else 'plain'}_{world}gpu", result)
    assert result["iterations"] == 1000
    assert result["mismatches"] == 0


def test_cuda_graph_replay():
    """XLA records jaxgin's custom calls into command buffers and replays them: the host handler
    runs for a small fraction of the ops executed, and every result still equals jax.lax's."""
    result = run_scenario(SCENARIOS, ["graph_replay"], 2)
    record("ops_graph_replay_2gpu", result)
    assert result["mismatches"] == 0
    assert result["handler_calls"] < result["ops_executed"] / 4, result


def test_1000_iterations_process_per_gpu():
    results = run_processes(SCENARIOS, ["iterations"], 2)
    record("ops_iterations_process_per_gpu_2gpu", {"processes": results})
    assert all(r["mismatches"] == 0 and r["iterations"] == 1000 for r in results)


def test_starved_wait_fails_with_a_named_error():
    result = run_scenario(SCENARIOS, ["timeout"], 2, timeout=180)
    record("ops_timeout", result)
    assert result["error"], "the program must fail, not return"
    assert 2.0 <= result["seconds"] < 60.0
    assert result["faults"], "the device must record why"
    fault = result["faults"][0]
    assert "jaxgin.wait_signal" in fault and "waited for 2 puts" in fault and "only 1 arrived" in fault, fault
