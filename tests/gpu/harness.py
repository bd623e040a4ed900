"""What the GPU tests share: how many GPUs there are, how a scenario runs in a fresh process (a
device fault leaves a CUDA context unusable, and several processes need their own JAX runtime),
and where results are recorded (JAXGIN_RESULTS_DIR, for closing notes and benchmarks)."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


GPUS = _gpu_count()
# Worlds of the tests parametrized by one: 2 and every visible GPU; on a machine with one GPU, that
# one (an axis of size 1: every op's peer is the device itself, through the same kernels).
WORLD_SIZES = sorted({2, GPUS}) if GPUS >= 2 else [GPUS] if GPUS == 1 else [2]
ANY_GPU = pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU, found none")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 NVIDIA GPUs, found {GPUS}")


def scenario_env(gpus: int, xla_flags: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared machines
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    return env


def record(name: str, result: dict) -> None:
    directory = os.environ.get("JAXGIN_RESULTS_DIR")
    if directory:
        Path(directory, f"{name}.json").write_text(json.dumps(result, indent=1))


def result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT:")]
    assert lines, f"scenario printed no result:\n{stdout[-4000:]}"
    return json.loads(lines[-1][len("RESULT:"):])


def run_scenario(script: Path, args, gpus: int, timeout: float = 600, xla_flags: str | None = None,
                 env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, str(script), *args], env={**scenario_env(gpus, xla_flags), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"scenario {args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return result(proc.stdout)


def start_processes(script: Path, args, world: int, timeout: float = 600, env: dict | None = None):
    """The scenario in `world` processes of one GPU each (jax.distributed on localhost), each
    given `RANK WORLD ADDR` after `args`. Returns [(returncode, stdout, stderr)] per rank."""
    port = free_port()
    env = {**scenario_env(world), **(env or {})}
    procs = [
        subprocess.Popen([sys.executable, str(script), *args, str(r), str(world), f"127.0.0.1:{port}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def run_processes(script: Path, args, world: int, timeout: float = 600) -> list[dict]:
    """start_processes, every process expected to succeed; their RESULT lines."""
    finished = start_processes(script, args, world, timeout)
    for rank, (code, out, err) in enumerate(finished):
        assert code == 0, f"process {rank} failed ({code}):\n{out[-4000:]}\n{err[-8000:]}"
    return [result(out) for _, out, _ in finished]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_mesh_check(check, axis_name: str) -> None:
    """A scenario script's entry point. argv `check` runs one process over every visible GPU;
    `check RANK WORLD COORDINATOR` is one process of a process-per-GPU job (run_processes). Calls
    check(mesh) on a 1-D mesh of all devices named `axis_name`, between jaxgin.initialize and
    finalize, and prints RESULT: {json} for result()."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxgin

    if len(sys.argv) > 3:
        rank, world, coordinator = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
        jax.distributed.initialize(coordinator, num_processes=world, process_id=rank, local_device_ids=[rank])
    jaxgin.initialize()
    report = check(Mesh(np.array(jax.devices()), (axis_name,)))
    jaxgin.finalize()
    print("RESULT:" + json.dumps(report))
