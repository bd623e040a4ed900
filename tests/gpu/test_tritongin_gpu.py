"""tritongin on NVIDIA GPUs (skipped where there are none): ring, all-pairs and barrier exchanges
from standalone Triton launches, checked word by word (every word counted by the kernels) over
many iterations (ITERATIONS); the same kind of kernel through jaxgin.triton_call under jax.jit
equal to jax.lax.ppermute, with and without XLA command buffers; one-way put_signal latency and
peer_ptr bandwidth (recorded, asserted against the issue's targets). In emulated-hosts jobs the
exchanges and triton_call run with every peer through GIN, and back-to-back launches that import
Triton before jaxgin.initialize() must all come up. Freeing a heap buffer while peers' puts into
it are still to come leaves it zero once they land, over NVLink and over GIN."""

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from jaxgin import cli
from harness import (ANY_GPU, EMULATED_SPOT_WORLDS, TWO_GPUS, WORLD_SIZES, by_tier, record, require_emulated_hosts,
                     run_processes, run_scenario, start_processes)

SCENARIOS = Path(__file__).with_name("tritongin_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
# put_signal + wait_arrivals one way, against the same GPUs' floor (raw_pingpong_kernel). On
# 2 x H200 the raw NCCL device-API ping-pong took 1.71 us and put_signal 3.07 us (1.8x).
LATENCY_OVER_FLOOR = 2.5
# Iterations of the exchanges and triton_call rings (the soak tier's are the long ones), on GPUs of
# one host and over emulated hosts.
ITERATIONS, EMULATED_ITERATIONS = by_tier(200, 1000), by_tier(50, 200)

# The scenarios launch kernels standalone: PyTorch holds their buffers and picks device and stream.
NEEDS_TORCH = pytest.mark.skipif(not cli.installed("torch"), reason='needs PyTorch: pip install -e ".[cuda,torch]"')
pytestmark = [pytest.mark.gpu, ANY_GPU, NEEDS_TORCH]


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_standalone_exchanges(world):
    result = run_scenario(SCENARIOS, ["standalone", str(ITERATIONS)], world)
    record(f"tritongin_standalone_{world}gpu", result)
    _check_every_word(result, ITERATIONS, world, devices=world)
    assert result["dlpack_view_matches"]
    assert result["faults"] == []


def _check_every_word(result, iterations, world, devices):
    """Each of the `devices` GPUs compared, every iteration, every word it received: one tile in
    the ring, one from each other rank in the all-pairs and barrier exchanges (a world of one has
    a ring to itself and nothing else to compare); no word differed."""
    words = result["words"]
    for case in ("ring", "all_pairs", "barrier"):
        tiles = 1 if case == "ring" else world - 1
        assert result[case]["words_checked"] == iterations * devices * words * tiles, (case, result)
        assert result[case]["mismatched_words"] == 0, (case, result)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_triton_call_equals_lax_ppermute(world, command_buffers):
    result = run_scenario(SCENARIOS, ["triton_call", str(ITERATIONS)], world,
                          xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"tritongin_triton_call_{'graphs' if command_buffers else 'plain'}_{world}gpu", result)
    assert result["iterations"] == ITERATIONS
    assert result["mismatches"] == 0
    assert result["last_equals_numpy_roll"]
    assert result["custom_calls_in_hlo"] >= 1
    assert result["faults"] == []


@TWO_GPUS
def test_put_signal_latency():
    result = run_scenario(SCENARIOS, ["latency"], 2)
    record("tritongin_latency_2gpu", result)
    floor = result["raw_atomic_one_way_us"]
    assert 0.2 < floor < 20, result  # a floor that says the flag never moved, or timed nothing
    for nbytes in ("8", "256", "4096"):
        assert result["one_way_us"][nbytes] <= LATENCY_OVER_FLOOR * floor, result


@TWO_GPUS
def test_peer_ptr_bandwidth():
    result = run_scenario(SCENARIOS, ["bandwidth"], 2)
    record("tritongin_bandwidth_2gpu", result)
    assert result["copy_correct"]
    assert result["ratio_to_plain_copy"] >= 0.9, result


@pytest.mark.parametrize("world", EMULATED_SPOT_WORLDS)
def test_standalone_exchanges_emulated_hosts(world):
    require_emulated_hosts()
    results = run_processes(SCENARIOS, ["standalone", str(EMULATED_ITERATIONS)], world, emulated=True)
    record(f"emulated_tritongin_standalone_{world}ranks", {"processes": results})
    for result in results:
        assert result["world"] == world and result["barrier_kernel"] == "put_signal", result
        _check_every_word(result, EMULATED_ITERATIONS, world, devices=1)
        assert result["dlpack_view_matches"] and result["faults"] == [], result


@pytest.mark.parametrize("world", EMULATED_SPOT_WORLDS)
@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_triton_call_equals_lax_ppermute_emulated_hosts(world, command_buffers):
    require_emulated_hosts()
    results = run_processes(SCENARIOS, ["triton_call", str(EMULATED_ITERATIONS)], world, emulated=True,
                            xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"emulated_tritongin_triton_call_{'graphs' if command_buffers else 'plain'}_{world}ranks",
           {"processes": results})
    for result in results:
        assert result["devices"] == world and result["iterations"] == EMULATED_ITERATIONS, result
        assert result["mismatches"] == 0 and result["last_equals_numpy_roll"], result
        assert result["faults"] == [], result


def _check_free_waited(result, devices):
    assert result["devices"] == devices and result["reused_the_offset"], result
    # every put landed in the freed buffer, then it was zeroed: nothing of them in the reused bytes
    assert result["nonzero_words_after_reuse"] == [0] * devices, result
    assert result["free_seconds"] >= 0.04 and result["faults"] == [], result  # it waited for the 50 ms puts


@TWO_GPUS
def test_free_waits_for_puts_still_to_land():
    """Issue 51's risk 4 over NVLink: freeing zeroed the region at once while the peer's stores were
    still to come, leaving them in bytes handed out again as zero."""
    _check_free_waited(run_scenario(SCENARIOS, ["free_while_puts_land"], 2), devices=2)


def test_free_waits_for_puts_still_to_land_emulated_hosts():
    """The same over GIN (emulated hosts; with the unkind transport a put lands after its flush)."""
    require_emulated_hosts()
    for result in run_processes(SCENARIOS, ["free_while_puts_land"], 2, emulated=True):
        _check_free_waited(result, devices=1)


LAUNCHES = by_tier(10, 30)
LAUNCHES_AT_ONCE = 5  # jobs side by side on the GPU(s), to keep the test within minutes


def test_launches_importing_triton_first_all_come_up():
    """A world-2 emulated job whose ranks import Triton and tritongin before jaxgin.initialize(),
    launched LAUNCHES times back to back: every rank of every launch comes up, passes the selftest over
    GIN and finalizes (once one rank in five launches died with SIGSEGV in initialize())."""
    require_emulated_hosts()

    def launch(_):
        return start_processes(SCENARIOS, ["bringup"], 2, timeout=300, emulated=True)

    with ThreadPoolExecutor(LAUNCHES_AT_ONCE) as pool:
        launches = list(pool.map(launch, range(LAUNCHES)))
    crashes = [{"launch": i, "rank": rank, "code": code, "stderr": err[-3000:]}
               for i, finished in enumerate(launches) for rank, (code, out, err) in enumerate(finished)
               if code != 0 or '"selftest_ok": true' not in out]
    record("emulated_tritongin_launches", {"launches": LAUNCHES, "failed": crashes})
    assert crashes == [], crashes
