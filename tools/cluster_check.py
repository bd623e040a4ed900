"""The multi-host checks on one GPU machine, with emulated hosts (tests/gpu/harness.py): the doctor
on the machine, then python -m jaxgin.pairtest in emulated worlds (every rank a host of its own,
every pair over GIN through jaxgin's host transport) and on the mixed mesh (hosts of 2 ranks on
different GPUs: NVLink inside, GIN across), all jobs side by side; with --examples, the quickstart
and the MoE example started by examples/multihost/two_hosts.sh's commands on two emulated hosts of
half the GPUs each, one process per host. Needs NCCL >= 2.30 (the host transport's RMA plugins).

    python3 tools/cluster_check.py --out DIR [--worlds 2,4,8] [--no-mixed] [--examples]

Writes DIR/doctor.json, DIR/pairtest_<job>.json (process 0's report) with every rank's output in
DIR/pairtest_<job>/, DIR/example_<name>/ with every host's output, and DIR/cluster_check.json: what
ran, exit codes, seconds, verdicts. Exit status 0 when every job exited 0; 1 otherwise, and with an
NCCL older than 2.30, where the doctor runs and no job. Times of emulated hosts are not
performance: the ranks share GPUs (the pair test runs with --slow-fraction 0).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


def rank_main(argv: list[str]) -> None:
    """A rank started by harness.start_processes (which appends RANK WORLD ADDR): becomes
    python -m jaxgin.launch with its place spelled out, on the GPU the harness gave it."""
    *program, rank, world, address = argv
    os.execv(sys.executable, [sys.executable, "-m", "jaxgin.launch", "--coordinator", address, "--num-processes",
                              world, "--process-id", rank, "--local-device-ids",
                              os.environ.get("JAXGIN_TEST_LOCAL_DEVICE", "0"), *program])


if __name__ == "__main__" and sys.argv[1:2] == ["rank"]:
    rank_main(sys.argv[2:])  # before the imports below, which a rank does not need

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import harness  # noqa: E402

from jaxgin import nccl, transport  # noqa: E402

PAIRTEST = ["-m", "jaxgin.pairtest", "--slow-fraction", "0", "--latency-iterations", "20",
            "--bandwidth-iterations", "4", "--bandwidth-bytes", "1MiB"]


def pairtest_job(name: str, world: int, ranks_per_host: int, out: Path, timeout: float) -> dict:
    folder = out / f"pairtest_{name}"
    folder.mkdir(parents=True, exist_ok=True)
    report = out / f"pairtest_{name}.json"
    start = time.monotonic()
    finished = harness.start_processes(Path(__file__), ["rank", *PAIRTEST, "--out", str(report)], world, timeout,
                                       emulated=True, ranks_per_host=ranks_per_host)
    for rank, (_, stdout, stderr) in enumerate(finished):
        (folder / f"rank{rank}.out").write_text(stdout)
        (folder / f"rank{rank}.err").write_text(harness.digest(stderr, 200))
    result = json.loads(report.read_text()) if report.exists() else None
    return {"job": name, "world": world, "ranks_per_host": ranks_per_host, "seconds": round(time.monotonic() - start, 1),
            "exit_codes": [code for code, _, _ in finished],
            "verdict": result["verdict"] if result else None, "summary": result["summary"] if result else None,
            "pairs": len(result["pairs"]) if result else 0,
            "paths": sorted({p["path"] for p in result["pairs"]}) if result else []}


def example_job(script: str, out: Path, timeout: float) -> dict:
    """The commands two_hosts.sh prints for two hosts, run here, each on an emulated host of half the GPUs."""
    folder = out / f"example_{Path(script).stem}"
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    port = harness.free_port()
    printed = subprocess.run(["bash", "examples/multihost/two_hosts.sh", "127.0.0.1", "127.0.0.1", "--", script],
                             cwd=ROOT, env=env | {"JAXGIN_DRY_RUN": "1", "JAXGIN_PORT": str(port)},
                             capture_output=True, text=True, check=True).stdout.splitlines()
    half = max(harness.GPUS // 2, 1)
    procs = []
    for host, line in enumerate(printed):
        ranks = range(host * half, (host + 1) * half)  # the ranks of this host in a mixed mesh of `half` per host
        host_env = harness.emulated_env(ranks[0], half) | {
            "CUDA_VISIBLE_DEVICES": ",".join(harness.emulated_env(r, half)["CUDA_VISIBLE_DEVICES"] for r in ranks),
            "XLA_FLAGS": harness.EMULATED_XLA_FLAGS}
        command = line.split(": ", 1)[1]
        procs.append(subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env | host_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(timeout - (time.monotonic() - start), 1)))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            outputs.append((stdout, stderr + f"\n[cluster_check: killed after {timeout:.0f} s]"))
    for host, (stdout, stderr) in enumerate(outputs):
        (folder / f"host{host}.out").write_text(stdout)
        (folder / f"host{host}.err").write_text(harness.digest(stderr, 200))
    return {"example": script, "hosts": len(printed), "gpus_per_host": half, "commands": printed,
            "seconds": round(time.monotonic() - start, 1), "exit_codes": [p.returncode for p in procs],
            "last_lines": [stdout.strip().splitlines()[-3:] for stdout, _ in outputs]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worlds", default="2,4,8", help="emulated worlds, one rank per host")
    parser.add_argument("--no-mixed", action="store_true", help="leave out the mixed mesh")
    parser.add_argument("--examples", action="store_true", help="the examples on two emulated hosts instead")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per job")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.pop("JAXGIN_RESULTS_DIR", None)  # the jobs run side by side: each keeps its outputs here
    install = nccl.packaged_install()
    summary: dict = {"gpus": harness.GPUS, "nccl": install.version_string if install else None}
    if not args.examples:  # the doctor judges any NCCL, an old one included
        doctor = subprocess.run([sys.executable, "-m", "jaxgin.doctor", "--json"], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        (args.out / "doctor.json").write_text(doctor.stdout)
        (args.out / "doctor.err").write_text(doctor.stderr)
        report = json.loads(doctor.stdout)
        summary["doctor"] = {k: report[k] for k in ("verdict", "exit_status", "summary", "gin_path")}
    if install is None or install.version < transport.MIN_NCCL:
        summary["emulated_hosts"] = (f"not run: they need NCCL >= 2.30 (RMA plugins), found {summary['nccl']}; stage "
                                     "it with ../shared/tools/nccl-stage")
        failed = True
    elif args.examples:
        summary["examples"] = [example_job(s, args.out, args.timeout)
                               for s in ("examples/quickstart.py", "examples/moe_layer.py")]
        failed = any(code != 0 for e in summary["examples"] for code in e["exit_codes"])
    else:
        jobs = [(f"world{w}", int(w), 1) for w in args.worlds.split(",")]
        if not args.no_mixed:
            jobs.append((f"mixed{harness.MIXED_WORLD}", harness.MIXED_WORLD, harness.MIXED_RANKS_PER_HOST))
        results: dict = {}
        threads = [threading.Thread(target=lambda j=j: results.__setitem__(j[0], pairtest_job(*j, args.out, args.timeout)))
                   for j in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        summary["pairtest"] = [results[name] for name, _, _ in jobs]
        failed = any(code != 0 for r in summary["pairtest"] for code in r["exit_codes"])
    (args.out / "cluster_check.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
