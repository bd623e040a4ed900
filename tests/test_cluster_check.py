"""tools/cluster_check.py, the GPU machines' multi-host round, run here on the CPU: its emulated
ranks (tests/gpu/harness.py) then run jaxgin.pairtest in reference mode, one CPU device each, and
its example hosts the quickstart and the MoE example; what the round does around them (the doctor,
the launch of every rank, the reports it gathers) is what a GPU round does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(cli.cuda_gpu_count() > 0, reason="on GPUs the round runs real GPU jobs: tools/gpu_round.py cluster")


def _round(tmp_path: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS") and not k.startswith("JAXGIN_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run([sys.executable, "tools/cluster_check.py", "--out", str(tmp_path), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp_path / "cluster_check.json").read_text())


def test_pairtest_jobs_of_emulated_hosts(tmp_path):
    summary = _round(tmp_path, "--worlds", "2,4", "--no-mixed")
    assert summary["doctor"]["verdict"] == json.loads((tmp_path / "doctor.json").read_text())["verdict"]
    jobs = {job["job"]: job for job in summary["pairtest"]}
    assert [(j["world"], j["exit_codes"], j["pairs"], j["verdict"]) for j in jobs.values()] == [
        (2, [0, 0], 1, "ready"), (4, [0, 0, 0, 0], 6, "ready")]
    report = json.loads((tmp_path / "pairtest_world4.json").read_text())
    assert report["hosts"] == ["emuhost0", "emuhost1", "emuhost2", "emuhost3"]  # a host per rank
    assert report["settings"]["JAXGIN_FORCE_GIN"] == "1" and report["settings"]["JAXGIN_GIN_TRANSPORT"] == "host"
    assert sorted(p.name for p in (tmp_path / "pairtest_world2").iterdir()) == ["rank0.err", "rank0.out", "rank1.err",
                                                                             "rank1.out"]


def test_examples_on_two_emulated_hosts(tmp_path):
    summary = _round(tmp_path, "--examples")
    for example, last in zip(summary["examples"], ("JAX ops OK on 8 devices", "ragged_all_to_all layer")):
        assert example["exit_codes"] == [0, 0] and example["hosts"] == 2
        assert all(" python3 -m jaxgin.launch --coordinator 127.0.0.1:" in c for c in example["commands"])
        assert all(lines[-1].startswith(last) for lines in example["last_lines"]), example["last_lines"]
