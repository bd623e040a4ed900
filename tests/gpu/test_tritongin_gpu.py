"""tritongin on NVIDIA GPUs (skipped where there are none): ring, all-pairs and barrier exchanges
from standalone Triton launches, checked word by word for 1000 iterations; the same kind of
kernel through jaxgin.triton_call under jax.jit equal to jax.lax.ppermute, with and without XLA
command buffers; one-way put_signal latency and peer_ptr bandwidth (recorded, asserted against
the issue's targets)."""

from pathlib import Path

import pytest

from jaxgin import cli
from harness import ANY_GPU, TWO_GPUS, GPUS, WORLD_SIZES, record, run_scenario

SCENARIOS = Path(__file__).with_name("tritongin_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
# Raw NCCL device-API ping-pong over NVLink on 2 x H200 (../shared/baselines): 1.71 us one way.
RAW_PINGPONG_US = 1.71

# The scenarios launch kernels standalone: PyTorch holds their buffers and picks device and stream.
NEEDS_TORCH = pytest.mark.skipif(not cli.installed("torch"), reason='needs PyTorch: pip install -e ".[cuda,torch]"')
pytestmark = [pytest.mark.gpu, ANY_GPU, NEEDS_TORCH]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_standalone_exchanges_1000_iterations(world):
    result = run_scenario(SCENARIOS, ["standalone", "1000"], world)
    record(f"tritongin_standalone_{world}gpu", result)
    # A world of one has a ring (to itself) but no pair of distinct devices to exchange or check.
    for case in ("ring", "all_pairs", "barrier") if world > 1 else ("ring",):
        assert result[case]["words_checked"] > 0, (case, result)
    for case in ("ring", "all_pairs", "barrier"):
        assert result[case]["mismatched_words"] == 0, (case, result)
    assert result["dlpack_view_matches"]
    assert result["faults"] == []


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_triton_call_equals_lax_ppermute(world, command_buffers):
    result = run_scenario(SCENARIOS, ["triton_call", "1000"], world,
                          xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"tritongin_triton_call_{'graphs' if command_buffers else 'plain'}_{world}gpu", result)
    assert result["iterations"] == 1000
    assert result["mismatches"] == 0
    assert result["last_equals_numpy_roll"]
    assert result["custom_calls_in_hlo"] >= 1
    assert result["faults"] == []


@TWO_GPUS
def test_put_signal_latency():
    result = run_scenario(SCENARIOS, ["latency"], 2)
    result["raw_nccl_pingpong_us"] = RAW_PINGPONG_US
    record("tritongin_latency_2gpu", result)
    for nbytes in ("8", "256", "4096"):
        assert result["one_way_us"][nbytes] <= 2 * RAW_PINGPONG_US, result


@TWO_GPUS
def test_peer_ptr_bandwidth():
    result = run_scenario(SCENARIOS, ["bandwidth"], 2)
    record("tritongin_bandwidth_2gpu", result)
    assert result["copy_correct"]
    assert result["ratio_to_plain_copy"] >= 0.9, result
