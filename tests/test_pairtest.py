"""python -m jaxgin.pairtest on the CPU: every pair of 8 reference-mode devices in one process, and
of 4 devices in two processes joined through jaxgin.launch (the reports travel through
jax.distributed's key-value store); how pairs are judged slow or failed, and whom that names."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import jaxgin
from jaxgin import pairtest
from jaxgin.pairtest import Pair

ROOT = Path(__file__).resolve().parents[1]


def test_every_pair_of_eight_devices_in_reference_mode(monkeypatch):
    monkeypatch.setenv("NCCL_HOSTID", "rack1")
    jaxgin.initialize()
    report = pairtest.run(latency_bytes=16, bandwidth_bytes=4096, latency_iterations=3, bandwidth_iterations=2,
                          slow_fraction=0)
    assert [(p.a, p.b) for p in report.pairs] == [(a, b) for a in range(8) for b in range(a + 1, 8)]
    assert {p.path for p in report.pairs} == {"reference"}
    assert all(p.wrong_words == 0 and not p.error and p.latency_us > 0 and p.bandwidth_gbs > 0 for p in report.pairs)
    assert report.hosts == ["rack1"] * 8
    assert (report.verdict, report.exit_status, report.summary) == ("ready", 0, "all 28 pairs passed")
    assert report.settings["NCCL_HOSTID"] == "rack1"


def test_block_sizes_are_checked():
    jaxgin.initialize()
    with pytest.raises(ValueError, match="latency_bytes=6: a positive multiple of 4 bytes, at least 8"):
        pairtest.run(latency_bytes=6)


def _mesh_pairs(latency, bandwidth, hosts):
    """Every pair of ranks, LSA within a host and GIN across, with the figures the callables give."""
    world = len(hosts)
    return [Pair(a, b, "lsa" if hosts[a] == hosts[b] else "gin", latency(a, b), bandwidth(a, b))
            for a in range(world) for b in range(a + 1, world)]


HOSTS = [h for h in "ABCD" for _ in range(2)]  # 4 hosts of 2 ranks


def test_a_slow_host_is_named_by_its_pairs():
    slow_c = lambda a, b: 10.0 if "C" in (HOSTS[a], HOSTS[b]) else 40.0  # noqa: E731
    pairs = _mesh_pairs(lambda a, b: 12.0, lambda a, b: slow_c(a, b) if HOSTS[a] != HOSTS[b] else 300.0, HOSTS)
    marked, ranks, hosts = pairtest.judge(pairs, HOSTS, 0.5)
    slow = {(p.a, p.b) for p in marked if p.slow}
    assert slow == {(p.a, p.b) for p in pairs if p.path == "gin" and "C" in (HOSTS[p.a], HOSTS[p.b])}
    assert (ranks, hosts) == ([4, 5], ["C"])
    decided, summary = pairtest.verdict(marked, HOSTS, ranks, hosts)
    assert decided == "degraded" and summary.endswith("most pairs of host C, rank 4 (C), rank 5 (C) are slow")
    assert pairtest.judge(pairs, HOSTS, 0) == (pairs, [], [])


def test_one_slow_pair_names_no_host_and_latency_counts_too():
    pairs = _mesh_pairs(lambda a, b: 90.0 if (a, b) == (0, 7) else 12.0, lambda a, b: 40.0, HOSTS)
    marked, ranks, hosts = pairtest.judge(pairs, HOSTS, 0.5)
    assert [(p.a, p.b) for p in marked if p.slow] == [(0, 7)]
    assert (ranks, hosts) == ([], [])
    assert pairtest.verdict(marked, HOSTS, ranks, hosts) == ("degraded", "slow pairs 0<->7")


def test_a_failed_pair_names_both_ranks_and_hosts():
    pairs = [Pair(0, 1, "lsa", 3.0, 100.0),
             Pair(0, 2, "gin", error="JaxRuntimeError: CUDA error\nrank 2 waited for rank 0 ... signal 7"),
             ]
    decided, summary = pairtest.verdict(pairs, HOSTS, [], [])
    assert decided == "not ready"
    assert summary == "the pair of ranks 0 (A) and 2 (B) over gin failed: JaxRuntimeError: CUDA error"
    assert pairtest.verdict([Pair(1, 2, "gin", 3.0, 9.0, wrong_words=12)], HOSTS, [], [])[1].endswith(
        "failed: 12 wrong words")


def test_paths_follow_the_lsa_team_of_each_rank():
    hosts = HOSTS
    lsa = {r: (r % 2, 2) for r in range(8)}
    paths = pairtest._paths({"backend": "cuda", "force_gin": False}, hosts, lsa)
    assert [pair for pair, path in paths.items() if path == "lsa"] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert set(pairtest._paths({"backend": "cuda", "force_gin": True}, hosts, lsa).values()) == {"gin"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_through_launch(tmp_path):
    """Each process drives 2 CPU devices; process 0 writes the report."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "JAXGIN_"))}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu", "NCCL_HOSTID": ""}
    out = tmp_path / "pairs.json"
    procs = []
    for process, host in enumerate(["hostA", "hostB"]):
        command = [sys.executable, "-m", "jaxgin.launch", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(process), "-m", "jaxgin.pairtest", "--slow-fraction", "0", "--latency-iterations",
                   "4", "--bandwidth-iterations", "2", "--bandwidth-bytes", "64KiB", "--out", str(out)]
        procs.append(subprocess.Popen(command, cwd=ROOT, env=env | {"NCCL_HOSTID": host}, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    finished = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in finished]
    report = json.loads(out.read_text())
    assert report["hosts"] == ["hostA", "hostA", "hostB", "hostB"]
    assert [(p["a"], p["b"]) for p in report["pairs"]] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert all(p["latency_us"] > 0 and p["wrong_words"] == 0 for p in report["pairs"])
    assert report["verdict"] == "ready" and report["exit_status"] == 0 and report["bandwidth_bytes"] == 65536
    # XLA:CPU's collectives (Gloo) print to the same stdout from their own threads, and a line of
    # theirs can be split around the report's (CI, 2026-11-30): the report is looked for in order
    shown = finished[0][0]
    header = "jaxgin pairtest: 4 ranks on 2 hosts (hostA, hostB)"
    verdict = "verdict: ready (exit status 0): all 6 pairs passed"
    assert header in shown and verdict in shown and shown.index(header) < shown.index(verdict), shown[-3000:]
    assert "jaxgin pairtest" not in finished[1][0] and "verdict" not in finished[1][0]  # only process 0 reports
