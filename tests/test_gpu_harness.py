"""How the GPU tests' harness (tests/gpu/harness.py) places ranks on GPUs, checked without a GPU:
nvidia-smi's answer is faked, and the harness is loaded afresh for each machine it describes."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).with_name("gpu")


def load_harness(monkeypatch, gpus: int, visible: str | None):
    """tests/gpu/harness.py as it loads on a machine of `gpus` GPUs with CUDA_VISIBLE_DEVICES=`visible`."""
    listing = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})\n" for i in range(gpus))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listing, ""))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    spec = importlib.util.spec_from_file_location("harness_under_test", GPU_TESTS / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gpu_without_cuda_visible_devices(monkeypatch):
    h = load_harness(monkeypatch, 4, None)
    assert h.VISIBLE_GPUS == [0, 1, 2, 3] and h.GPUS == 4
    assert h.MIXED_WORLD == 8
    assert [h.emulated_env(r)["CUDA_VISIBLE_DEVICES"] for r in range(8)] == ["0", "1", "2", "3"] * 2


def test_cuda_visible_devices_narrows_the_gpus_to_physical_indices(monkeypatch):
    h = load_harness(monkeypatch, 4, "3")
    assert h.VISIBLE_GPUS == [3] and h.GPUS == 1
    assert h.scenario_env(1)["CUDA_VISIBLE_DEVICES"] == "3"  # a scenario drives GPU 3, not GPU 0
    env = h.emulated_env(5)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["JAXGIN_TEST_PHYSICAL_GPU"] == "3"


def test_mixed_world_is_one_the_scenarios_can_split(monkeypatch):
    """Three GPUs allow six ranks two to a host, but the fused scenarios' 512 rows do not split
    into 6 chunks (seen on a GPU): the mixed mesh takes the largest emulated world that fits."""
    for gpus, world in [(2, 4), (3, 4), (4, 8), (8, 8)]:
        h = load_harness(monkeypatch, gpus, None)
        assert h.MIXED_WORLD == world, gpus
        assert h.MIXED_WORLD in h.EMULATED_WORLDS


def test_one_gpu_per_worker_keeps_each_job_whole_on_one_gpu(monkeypatch):
    h = load_harness(monkeypatch, 4, "0,1,2")
    monkeypatch.setenv("JAXGIN_TEST_EMULATED_ONE_GPU", "1")
    for worker, gpu in [("gw0", "0"), ("gw1", "1"), ("gw4", "1"), ("gw5", "2")]:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        assert {h.emulated_env(r)["CUDA_VISIBLE_DEVICES"] for r in range(8)} == {gpu}, worker
        # hosts of two ranks still span two GPUs: their ranks reach each other over NVLink
        mixed = [h.emulated_env(r, ranks_per_host=2)["CUDA_VISIBLE_DEVICES"] for r in range(h.MIXED_WORLD)]
        assert all(mixed[2 * i] != mixed[2 * i + 1] for i in range(h.MIXED_WORLD // 2)), mixed


def test_gpus_named_by_uuid_are_their_indices(monkeypatch):
    h = load_harness(monkeypatch, 4, "GPU-2,GPU-0")
    assert h.VISIBLE_GPUS == [2, 0]
    assert h.scenario_env(2)["CUDA_VISIBLE_DEVICES"] == "2,0"


@pytest.mark.parametrize("visible", ["GPU-7", "4", "MIG-1"])
def test_a_gpu_the_machine_lacks_is_refused_naming_the_setting(monkeypatch, visible):
    with pytest.raises(ValueError, match=f"CUDA_VISIBLE_DEVICES='{visible}': '{visible}' is none of this "
                                         r"machine's GPUs \(nvidia-smi -L lists indices 0 to 1"):
        load_harness(monkeypatch, 2, visible)


def test_a_scenario_reads_its_physical_gpu_from_cuda_visible_devices(monkeypatch):
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    spec = importlib.util.spec_from_file_location("job_under_test", GPU_TESTS / "job.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    monkeypatch.delenv("JAXGIN_TEST_PHYSICAL_GPU", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [job.physical_gpu(r) for r in range(2)] == [2, 3]
    monkeypatch.setenv("JAXGIN_TEST_PHYSICAL_GPU", "1")  # an emulated rank is told outright
    assert job.physical_gpu(0) == 1
    assert "job_under_test" not in sys.modules


def test_a_failed_scenario_says_its_first_cause_even_when_teardown_noise_fills_the_tail(monkeypatch):
    """A rank that trapped prints jaxgin's fault line first and then thousands of lines of XLA's
    teardown errors; the failure message keeps the fault line (it was cut off on 4 x H100)."""
    harness = load_harness(monkeypatch, 2, None)
    noise = "E1127 cuda_stream.cc:342] Failed to destroy CUDA stream: CUDA_ERROR_LAUNCH_FAILED\n" * 500
    stderr = ("jaxgin: device-side wait timed out after 60 s at rank 1 (CUDA device 1)\n" + noise
              + "nanobind: leaked 2 instances!\n")
    kept = harness.first_causes(stderr)
    assert "device-side wait timed out after 60 s at rank 1" in kept
    assert "cuda_stream.cc" not in kept
    assert harness.first_causes(noise) == ""


def test_coordinator_ports_come_from_below_the_ephemeral_range_and_are_free(monkeypatch):
    """A port taken from Linux's ephemeral range can be handed to another socket between the pick
    and JAX's bind; the harness's come from below it, free on every address."""
    import socket

    harness = load_harness(monkeypatch, 2, None)
    ports = {harness.free_port() for _ in range(20)}
    assert all(p in harness._COORDINATOR_PORTS and p < 32768 for p in ports), ports
    held = socket.socket()
    port = harness.free_port()
    held.bind(("0.0.0.0", port))
    try:
        assert not harness._bindable(socket.AF_INET, "0.0.0.0", port)
    finally:
        held.close()
