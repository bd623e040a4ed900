"""jaxgin's host transport on NVIDIA GPUs (issue 8): NCCL's GIN proxy backend over the RMA plugin.
Every peer is forced through GIN, so LSA carries nothing; the plugin's counters prove the bytes
went through it. Needs NCCL >= 2.30 (skipped otherwise; ../shared/tools/nccl-stage brings 2.32.3)."""

from pathlib import Path

import pytest
from harness import GPUS, WORLD_SIZES, record, run_processes, run_scenario, went_through_transport
from ops_scenarios import ITERATIONS

SCENARIOS = Path(__file__).with_name("transport_scenarios.py")
COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 NVIDIA GPUs, found {GPUS}")]


@pytest.fixture(scope="module", autouse=True)
def nccl_with_rma_plugins():
    from jaxgin import nccl, transport

    install = nccl.load()
    if install.version < transport.MIN_NCCL:
        pytest.skip(f"NCCL {install.version_string} loads no RMA plugins (needs >= 2.30)")


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_equal_lax_over_host_transport_one_process(world):
    result = run_scenario(SCENARIOS, ["correctness"], world)
    record(f"transport_ops_correctness_single_process_{world}gpu", result)
    assert result["failed"] == [], result["details"]
    assert result["checks"] >= 100
    went_through_transport(result, mapped=True)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_ops_equal_lax_over_host_transport_process_per_gpu(world):
    results = run_processes(SCENARIOS, ["correctness"], world)
    record(f"transport_ops_correctness_process_per_gpu_{world}gpu", {"processes": results})
    for result in results:
        assert result["failed"] == [], result["details"]
        went_through_transport(result, mapped=True)


@pytest.mark.parametrize("command_buffers", [False, True], ids=["plain", "command_buffers"])
def test_iterations_over_host_transport(command_buffers):
    result = run_scenario(SCENARIOS, ["iterations"], 2, xla_flags=COMMAND_BUFFERS if command_buffers else None)
    record(f"transport_iterations_{'graphs' if command_buffers else 'plain'}_2gpu", result)
    assert result["iterations"] == ITERATIONS and result["mismatches"] == 0
    went_through_transport(result, mapped=True)


def test_two_hosts_over_tcp(monkeypatch):
    """One process per GPU, each claiming its own host: every byte and signal crosses TCP."""
    monkeypatch.setenv("JAXGIN_TEST_HOST_PER_PROCESS", "1")
    results = run_processes(SCENARIOS, ["correctness"], 2)
    record("transport_ops_correctness_two_hosts_tcp_2gpu", {"processes": results})
    for result in results:
        assert result["failed"] == [], result["details"]
        went_through_transport(result, mapped=False)


def test_starved_wait_still_fails_with_a_named_error(monkeypatch):
    """A wait whose put never comes traps with its name, over the plugin as over LSA."""
    for name, value in (("JAXGIN_FORCE_GIN", "1"), ("JAXGIN_GIN_TRANSPORT", "host"), ("JAXGIN_TRANSPORT_QUIET", "1")):
        monkeypatch.setenv(name, value)
    result = run_scenario(Path(__file__).with_name("ops_scenarios.py"), ["timeout"], 2, timeout=180)
    record("transport_timeout", result)
    assert result["error"] and result["faults"], result
    assert "only 1 arrived" in result["faults"][0], result["faults"]
