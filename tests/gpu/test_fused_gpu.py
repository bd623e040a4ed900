"""jaxgin.fused on NVIDIA GPUs (skipped where there are none), both implementations:
matmul_all_to_all and all_gather_matmul equal XLA's unfused composition within rounding, and its
gradients; the Triton kernel also equals the unfused composition of its own tile code bit for bit;
back-to-back calls with changing data in one jit (fused_scenarios.LOOP_CALLS); one process for all
GPUs (with and without XLA command buffers), one process per GPU, emulated hosts and mixed meshes."""

from pathlib import Path

import pytest

import numpy as np
from fused_scenarios import (LOOP_CALLS, REDUCE_SCATTER_TRAFFIC_CASES, TRAFFIC_CASES, cases, reduce_scatter_cases,
                             scenario_cases, triton_tiles_cases)
from harness import (ANY_GPU, EMULATED_WORLDS, MIXED_RANKS_PER_HOST, MIXED_WORLD, TWO_GPUS, GPUS, WORLD_SIZES,
                     record, require_emulated_hosts, run_processes, run_scenario, spot_cases_at, spot_env)

SCENARIOS = Path(__file__).with_name("fused_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

pytestmark = [pytest.mark.gpu, ANY_GPU]


def _assert_cases(result, of=cases, spot=False):
    """Every case of the scenario (fused_scenarios.cases, its spot cases with `spot`, or `of`)
    with each method of its op."""
    expected = scenario_cases(result["devices"], of, spot)
    assert len(result["cases"]) == len(expected), result
    assert {case["method"] for case in result["cases"]} == {method for _, method in expected}, result
    for case in result["cases"]:
        tolerance = 1e-4 if case["dtype"] == "float32" else 2e-2
        assert case["loop_calls"] == LOOP_CALLS, case
        if case["method"] == "triton":
            assert case["exact"], case
            assert case["loop_max_rel_diff"] == 0.0, case
        else:
            assert case["loop_max_rel_diff"] <= tolerance, case
        assert case["rel_err_vs_xla"] <= tolerance, case
        assert case["grad_rel_err"] <= tolerance, case


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_fused_ops_single_process(world, command_buffers):
    spot = spot_cases_at(world, WORLD_SIZES)
    result = run_scenario(SCENARIOS, ["check"], world, xla_flags=COMMAND_BUFFERS if command_buffers else None,
                          env=spot_env(spot))
    record(f"fused_check_{'graphs' if command_buffers else 'plain'}_{world}gpu", result)
    assert result["devices"] == world
    _assert_cases(result, spot=spot)


def test_tile_tuner_times_the_matmul_on_the_device():
    """The tuner's figure is device time: eight times the rows take 3-20 times as long (the small
    matmul fills fewer SMs), the large one runs at 100-2000 TFLOP/s (a clock read in other units
    would not), and a configuration the GPU cannot run is never chosen (infinite time)."""
    result = run_scenario(SCENARIOS, ["tuning_clock"], 1)
    record("fused_tuning_clock_1gpu", result)
    small, large = result["seconds"]["512"], result["seconds"]["4096"]
    assert 0 < small and 3 < large / small < 20, result
    assert 100e12 < 2 * 4096 * 7168 * 2048 / large < 2000e12, result
    assert result["too_big"] == float("inf"), result


@TWO_GPUS
def test_fused_ops_process_per_gpu():
    results = run_processes(SCENARIOS, ["check"], GPUS, env=spot_env(False))
    record(f"fused_check_processes_{GPUS}gpu", results[0])
    for result in results:
        assert result["processes"] == GPUS
        _assert_cases(result)


@TWO_GPUS
@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_gather_matmul"])
def test_peer_that_never_calls_fails_naming_it(op):
    """Only axis index 0 runs the op (method="chunked"): its bounded wait for the other's chunk
    fails the program within the timeout (2 s here), and the fault names the op and the peer."""
    result = run_scenario(Path(__file__).with_name("ops_scenarios.py"), [f"starved_{op}"], 2, timeout=180)
    record(f"fused_starved_{op}", result)
    assert result["error"], "the program must fail, not return"
    assert 2.0 <= result["seconds"] < 60.0, result
    fault = result["faults"][0]
    assert f"jaxgin.fused.{op}" in fault and "peer rank 1" in fault and "never handed over its chunk" in fault, fault


@pytest.mark.parametrize("world", EMULATED_WORLDS)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_fused_ops_emulated_hosts(world, command_buffers):
    """Every peer on another (emulated) host: both methods run the Triton kernel's GIN paths (tiles
    put from the matmul's epilogue; the shard put row group by row group), with the same checks as
    over NVLink, and each call moves exactly what it must through the host transport: every other
    GPU's chunk (matmul_all_to_all) or this GPU's shard (all_gather_matmul) once per destination,
    in one put per tile or per row group."""
    require_emulated_hosts()
    spot = spot_cases_at(world, EMULATED_WORLDS, command_buffers)
    results = run_processes(SCENARIOS, ["check"], world, emulated=True, timeout=1800,
                            xla_flags=COMMAND_BUFFERS if command_buffers else None, env=spot_env(spot))
    record(f"emulated_fused_check_{'graphs' if command_buffers else 'plain'}_{world}ranks", {"processes": results})
    for result in results:
        assert result["processes"] == world
        _assert_cases(result, spot=spot)
        _assert_traffic(result, remote_gpus=world - 1)


@TWO_GPUS
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_fused_ops_mixed_mesh_emulated_hosts(command_buffers):
    """Emulated hosts of two GPUs each (NVLink inside a host, GIN across), so that one call takes
    both paths: the same checks as everywhere else, and through the host transport goes exactly
    what the GIN peers must get (the minimum for every peer, scaled to the peers on other hosts):
    the LSA peer's chunk never, the GIN peers' once."""
    require_emulated_hosts()
    world = MIXED_WORLD
    spot = spot_cases_at(world, [world], command_buffers)
    results = run_processes(SCENARIOS, ["check"], world, emulated=True, ranks_per_host=MIXED_RANKS_PER_HOST,
                            timeout=1800, xla_flags=COMMAND_BUFFERS if command_buffers else None, env=spot_env(spot))
    record(f"mixed_fused_check_{'graphs' if command_buffers else 'plain'}_{world}ranks", {"processes": results})
    for result in results:
        assert result["processes"] == world
        _assert_cases(result, spot=spot)
        _assert_traffic(result, remote_gpus=world - MIXED_RANKS_PER_HOST)


def _assert_traffic(result, remote_gpus, cases=TRAFFIC_CASES):
    """Through the host transport went exactly what the GPUs of other hosts must get (the
    host-mates' share goes over NVLink), in one put per tile or row group where the tiles are
    fixed (the Triton method's)."""
    assert len(result["traffic"]) == len(cases), result
    for t in result["traffic"]:
        assert t["remote_gpus"] == remote_gpus, t
        assert t["bytes"] == t["minimum_bytes"], t  # nothing resent, nothing padded, nothing dropped
        if t["expected_puts"] is not None:
            assert t["puts"] == t["expected_puts"], t
        else:
            assert t["puts"] > 0, t


# matmul_reduce_scatter, apart from the two ops above so that their results stand on their own.


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matmul_reduce_scatter_single_process(world):
    result = run_scenario(SCENARIOS, ["check_reduce_scatter"], world)
    record(f"reduce_scatter_check_{world}gpu", result)
    assert result["devices"] == world
    _assert_cases(result, reduce_scatter_cases)


@TWO_GPUS
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_chunked_triton_tiles_single_process(command_buffers):
    """The chunked method with its chunks computed by one Triton kernel that hands each over from its
    epilogue (the copy engines pull it): bit for bit the same tile code's composition, and so
    (within the rounding of XLA's sum for the reduce-scatter) over back-to-back calls whose data
    changes."""
    result = run_scenario(SCENARIOS, ["check_triton_tiles"], GPUS, xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"chunked_triton_tiles_check_{'graphs' if command_buffers else 'plain'}_{GPUS}gpu", result)
    assert [(c["op"], c["m"], c["dtype"], c["split"]) for c in result["cases"]] == \
        [(op, m, np.dtype(dtype).name, split) for op, m, _, _, dtype, split, _ in triton_tiles_cases(GPUS)]
    for case in result["cases"]:
        assert case["exact"], case
        if case["op"] == "a2a":
            assert case["loop_max_rel_diff"] == 0.0, case
        else:  # the partials' sum is XLA's, which may keep excess precision inside the loop's fusions
            assert case["loop_max_rel_diff"] <= (1e-4 if case["dtype"] == "float32" else 2e-2), case


@pytest.mark.parametrize("world", EMULATED_WORLDS)
def test_matmul_reduce_scatter_emulated_hosts(world):
    """Every peer on another host: partial tiles put from the epilogue, exactly each other GPU's
    chunk of this GPU's partial, one put per tile."""
    require_emulated_hosts()
    results = run_processes(SCENARIOS, ["check_reduce_scatter"], world, emulated=True, timeout=1800)
    record(f"emulated_reduce_scatter_check_{world}ranks", {"processes": results})
    for result in results:
        _assert_cases(result, reduce_scatter_cases)
        _assert_traffic(result, remote_gpus=world - 1, cases=REDUCE_SCATTER_TRAFFIC_CASES)


@TWO_GPUS
def test_matmul_reduce_scatter_mixed_mesh_emulated_hosts():
    require_emulated_hosts()
    world = MIXED_WORLD
    results = run_processes(SCENARIOS, ["check_reduce_scatter"], world, emulated=True,
                            ranks_per_host=MIXED_RANKS_PER_HOST, timeout=1800)
    record(f"mixed_reduce_scatter_check_{world}ranks", {"processes": results})
    for result in results:
        _assert_cases(result, reduce_scatter_cases)
        _assert_traffic(result, remote_gpus=world - MIXED_RANKS_PER_HOST, cases=REDUCE_SCATTER_TRAFFIC_CASES)
