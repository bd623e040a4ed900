"""jaxgin.moe on NVIDIA GPUs (skipped where there are none): dispatch equals the reference
placement bit for bit, combine equals the reference within rounding, moe_layer equals the dense
per-token computation in values and gradients (random and adversarial routing, top_k 1 to 8, a
capacity that overflows and warns, masked expert ids), and back-to-back calls with routing
changing every call (moe_scenarios.LOOP_CALLS); one process for all GPUs (with and without XLA
command buffers), one process per GPU, emulated hosts and mixed meshes."""

from pathlib import Path

import pytest

from harness import (ANY_GPU, EMULATED_WORLDS, MIXED_RANKS_PER_HOST, MIXED_WORLD, TWO_GPUS, GPUS, WORLD_SIZES,
                     record, require_emulated_hosts, run_processes, run_scenario, spot_cases_at, spot_env)
from moe_scenarios import LOOP_CALLS, planned_cases

SCENARIOS = Path(__file__).with_name("moe_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

pytestmark = [pytest.mark.gpu, ANY_GPU]


def _assert_cases(result, ragged_baseline=True, spot=False):
    """Every case of the scenario (its spot cases with `spot`: moe_scenarios.planned_cases)."""
    assert [c["case"] for c in result["cases"]] == [c[0] for c in planned_cases(result["devices"], spot)], result
    assert result["ragged_baseline"] is ragged_baseline, result
    if not spot:  # run where every case runs (moe_scenarios.check)
        assert result["rows_only"] == {"dispatch": [1.0], "combine": [0.0]}, result  # one kernel per call
        turns = result["grids_in_turn"]  # one configuration, other modes and capacities in turn
        assert turns["calls"] == 9 and turns["mismatches"] == 0.0 and turns["combine_max_diff"] <= 0.125, turns
        # fp8=True delivers exactly the rows it rounds to (jaxgin.moe.fp8), in both modes
        exact = {"values_differing": 0, "counts_differing_gpus": 0}
        assert result["fp8"] == {"low_latency": exact, "high_throughput": exact}, result["fp8"]
        # the routing kernel's arrays equal XLA's route() on the GPU (moe_scenarios.ROUTING_KERNEL_SHAPES)
        routing = result["routing_kernel"]
        assert len(routing) == 5 and all(all(c["equal"].values()) for c in routing), routing
        assert sum(c["masked_entries"] > 0 for c in routing) == 2, routing
    else:
        assert "rows_only" not in result and "grids_in_turn" not in result and "fp8" not in result, result
        assert "routing_kernel" not in result, result
    for case in result["cases"]:
        f32 = case["dtype"] == "float32"
        assert all(case["dispatch_exact"]), case
        assert case["launches_per_call"] == {"dispatch": [1.0], "combine": [1.0]}, case
        assert case["loop_calls"] == LOOP_CALLS and case["loop_dispatch_mismatches"] == 0.0, case
        assert case["combine_rel_err"] <= (1e-5 if f32 else 2e-2), case
        assert case["loop_combine_max_diff"] <= (1e-4 if f32 else 0.125), case
        masked = case["case"] == "masked_ids"
        if masked:  # masked entries are sent nowhere and counted as dropped, nothing else is
            assert case["masked_entries"] > 0 and case["dropped"] == case["masked_entries"], case
        if case["capacity"] is None:
            assert masked or case["dropped"] == 0, case
            # float32: XLA's GPU matmuls (ragged_dot and the dense einsums) use TF32 by default; the
            # ragged_all_to_all layer shows the same difference from the dense one.
            tolerance = 2e-3 if f32 else 3e-2
            assert case["layer_rel_err"] <= tolerance, case
            if ragged_baseline and not masked:  # the ragged_all_to_all baseline takes no masked ids
                assert case["ragged_layer_rel_err"] <= tolerance, case
            grads = case["grad_rel_err"]
            assert max(grads["x"], grads["logits"]) <= tolerance, case
            # bf16 weight gradients sum every row an expert took, rounded as the GEMM algorithm that
            # XLA's autotuner picks for that compilation rounds (docs/measurements.md, thirty-seventh session)
            assert max(grads["w1"], grads["w2"]) <= (tolerance if f32 else 5e-2), case
        else:
            assert case["dropped"] > 0, case  # the overflow case must overflow, and say so
            assert case["layer_drop_warnings"] >= 1, case  # moe_layer without return_stats warns


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_moe_single_process(world, command_buffers):
    spot = spot_cases_at(world, WORLD_SIZES)
    result = run_scenario(SCENARIOS, ["check"], world, xla_flags=COMMAND_BUFFERS if command_buffers else None,
                          env=spot_env(spot))
    record(f"moe_check_{'graphs' if command_buffers else 'plain'}_{world}gpu", result)
    assert result["devices"] == world
    _assert_cases(result, spot=spot)


@TWO_GPUS
def test_moe_process_per_gpu():
    results = run_processes(SCENARIOS, ["check"], GPUS, env=spot_env(False))
    record(f"moe_check_processes_{GPUS}gpu", results[0])
    for result in results:
        assert result["processes"] == GPUS
        _assert_cases(result)


@pytest.mark.parametrize("world", EMULATED_WORLDS, ids=lambda w: f"world{w}")
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_moe_emulated_hosts(world, command_buffers):
    """Every peer on another (emulated) host: dispatch and combine take their GIN paths, with the
    same checks as over NVLink, and move what they must through the host transport
    (_assert_traffic)."""
    require_emulated_hosts()
    spot = spot_cases_at(world, EMULATED_WORLDS, command_buffers)
    results = run_processes(SCENARIOS, ["check"], world, emulated=True, timeout=1800,
                            xla_flags=COMMAND_BUFFERS if command_buffers else None, env=spot_env(spot))
    record(f"emulated_moe_check_{'graphs' if command_buffers else 'plain'}_{world}ranks", {"processes": results})
    for result in results:
        assert result["processes"] == world
        _assert_cases(result, ragged_baseline=False, spot=spot)
        _assert_traffic(result, remote_gpus=world - 1)


def _assert_traffic(result, remote_gpus):
    """Through the host transport went exactly each token's row once per destination host (to
    its network entry there, which forwards it over NVLink) plus the counts and the routing
    metadata, and for combine one summed row per (token, other host) back from its network entry
    on each host plus the maps of where the partials lie: for dispatch, two puts per such GPU
    (counts, starts) and 3 + 2 x (GPUs of the host) per such host (count, rows, weights; codes and
    staging rows per GPU), for combine one map per other host and one put per source this GPU is
    the entry for (each below the transport's 4 MiB piece size, so one transport put each)."""
    assert len(result["traffic"]) == 2, result
    for t in result["traffic"]:
        d, c = t["dispatch"], t["combine"]
        assert t["remote_gpus"] == remote_gpus, t
        # exactly the rows, the counts and the metadata; nothing resent, nothing dropped
        assert d["bytes"] == t["dispatch_minimum_bytes"] + t["dispatch_metadata_bytes"], t
        assert d["bytes"] <= 1.05 * t["dispatch_minimum_bytes"], t
        assert c["bytes"] == t["combine_minimum_bytes"] + t["combine_metadata_bytes"], t
        assert d["puts"] == t["dispatch_expected_puts"] and c["puts"] == t["combine_expected_puts"], t
        assert t["dispatch_hosts_reached"] == t["remote_hosts"], t  # these shapes reach every host
        # a token bound for two GPUs of one other host crossed the network once
        hosts_apart = t["dispatch_rows_host_minimum_bytes"] < t["dispatch_rows_rank_minimum_bytes"]
        assert hosts_apart if t["remote_gpus"] > t["remote_hosts"] else not hosts_apart, t


@TWO_GPUS
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_moe_mixed_mesh_emulated_hosts(command_buffers):
    """Emulated hosts of two GPUs each (NVLink inside a host, GIN across): dispatch and combine take
    both paths in one call, with the same checks as everywhere else. The host transport carries
    exactly what the GPUs of other hosts must get, never the host-mate's share."""
    require_emulated_hosts()
    world = MIXED_WORLD
    spot = spot_cases_at(world, [world], command_buffers)
    results = run_processes(SCENARIOS, ["check"], world, emulated=True, ranks_per_host=MIXED_RANKS_PER_HOST,
                            timeout=1800, xla_flags=COMMAND_BUFFERS if command_buffers else None, env=spot_env(spot))
    record(f"mixed_moe_check_{'graphs' if command_buffers else 'plain'}_{world}ranks", {"processes": results})
    for result in results:
        assert result["processes"] == world
        _assert_cases(result, ragged_baseline=False, spot=spot)
        _assert_traffic(result, remote_gpus=world - MIXED_RANKS_PER_HOST)
