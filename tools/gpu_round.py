"""The GPU round: every GPU test on a lent machine, scheduled over its GPUs, with a summary.

    python3 tools/gpu_round.py run   [OPTIONS] [PYTEST SELECTION]   # in the foreground
    python3 tools/gpu_round.py start [OPTIONS] [PYTEST SELECTION]   # in the background, then:
    python3 tools/gpu_round.py wait SECONDS                         # up to SECONDS; results into $OUT

A device call lasts at most 10 minutes and a round longer, so `start` copies the tree and runs the
round in a process session of its own, which outlives the call; `wait` (back-to-back calls) reads
its progress and copies the summary and the logs into $OUT.

What a round does: installs and builds jaxgin, lets pytest say what each GPU test needs
(tests/gpu/round_plan.py: GPUs, processes, GPUs to itself or not), then runs each test as a pytest
process of its own on GPUs chosen for it (CUDA_VISIBLE_DEVICES). Tests that read whole-GPU
memory or time kernels run first, each with its GPUs to itself; then the rest, longest first
(by the durations of an earlier round, --durations, else by their worlds), as many at once as
the caps allow: --processes in all (each emulated rank and each process-per-GPU scenario is one;
their proxy threads busy-poll CPU cores) and --ranks-per-gpu on one GPU (GPU memory, and time
slices: ranks that share a GPU take turns). The summary, gpu-round.json, is rewritten as each
test ends: {"machine", "commit", "nccl", "tier", "wall_seconds", "tests": [{"name", "outcome",
"seconds", "gpus", "message"}], "not_run": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ROUND_DIR = Path(os.environ.get("ROUND_DIR", "/root/jaxgin-gpu-round"))


@dataclass
class GpuTest:
    """One GPU test as the round schedules it (tests/gpu/round_plan.py's demands)."""

    nodeid: str
    gpus: int
    processes: int
    exclusive: bool
    expected_s: float = 60.0

    @property
    def name(self) -> str:
        return self.nodeid.split("tests/gpu/", 1)[-1]


def estimated_seconds(test: GpuTest) -> float:
    """How long `test` is expected to take when no earlier round timed it: the ordering's guess,
    longest first (the MoE and fused checks compile most; a world's ranks share GPUs)."""
    name = test.name
    scale = max(test.processes / max(test.gpus, 1), 1)
    if "moe" in name and ("check" in name or "emulated_hosts[" in name or "mixed_mesh_emulated_hosts[" in name):
        return 240 * scale
    if "fused_ops" in name:
        return 180 * scale
    if "launches" in name:
        return 150
    return 40 + 15 * scale


@dataclass
class Schedule:
    """Which test starts next on which GPUs. Exclusive tests go first, each on GPUs no other test
    uses, and nothing starts behind one that waits for its GPUs; the others go longest first,
    within the caps on processes (all GPUs) and ranks (per GPU), and fill in where they fit."""

    gpus: int
    max_processes: int
    max_ranks_per_gpu: int
    waiting: list[GpuTest] = field(default_factory=list)
    load: list[int] = field(default_factory=list)  # ranks on each GPU
    locked: list[bool] = field(default_factory=list)  # held by an exclusive test
    running: dict[str, tuple[GpuTest, list[int]]] = field(default_factory=dict)

    too_large: list[GpuTest] = field(default_factory=list)  # they need more GPUs than there are

    def __post_init__(self):
        self.load = [0] * self.gpus
        self.locked = [False] * self.gpus
        self.too_large = [t for t in self.waiting if t.gpus > self.gpus]
        self.waiting = sorted((t for t in self.waiting if t.gpus <= self.gpus),
                              key=lambda t: (not t.exclusive, -t.gpus if t.exclusive else 0, -t.expected_s))

    def ready(self) -> list[tuple[GpuTest, list[int]]]:
        """The tests to start now, each with its GPUs, taken off the waiting list."""
        started = []
        for test in list(self.waiting):
            place = self._place(test)
            if place is None:
                # Nothing overtakes a waiting test: smaller ones filling in behind it kept the
                # GPUs and the process cap busy, and world-8 jobs never started (4 x H200, 2026-11-27).
                break
            self.waiting.remove(test)
            self._take(test, place)
            started.append((test, place))
        return started

    def finished(self, test: GpuTest) -> None:
        _, place = self.running.pop(test.nodeid)
        for g in place:
            self.load[g] -= self._ranks_per_gpu(test)
            if test.exclusive:
                self.locked[g] = False

    def _ranks_per_gpu(self, test: GpuTest) -> int:
        return math.ceil(test.processes / test.gpus)

    def _place(self, test: GpuTest) -> list[int] | None:
        if test.exclusive:
            idle = [g for g in range(self.gpus) if self.load[g] == 0 and not self.locked[g]]
            return idle[:test.gpus] if len(idle) >= test.gpus else None
        running = sum(t.processes for t, _ in self.running.values())
        if self.running and running + test.processes > self.max_processes:
            return None
        per_gpu = self._ranks_per_gpu(test)
        free = sorted((g for g in range(self.gpus) if not self.locked[g]), key=lambda g: (self.load[g], g))
        place = sorted(free[:test.gpus])
        if len(place) < test.gpus:
            return None
        if any(self.load[g] > 0 and self.load[g] + per_gpu > self.max_ranks_per_gpu for g in place):
            return None
        return place

    def _take(self, test: GpuTest, place: list[int]) -> None:
        self.running[test.nodeid] = (test, place)
        for g in place:
            self.load[g] += self._ranks_per_gpu(test)
            if test.exclusive:
                self.locked[g] = True


def junit_outcome(path: Path) -> tuple[str, str]:
    """(outcome, message) of the one test in a pytest JUnit XML file."""
    case = ElementTree.parse(path).getroot().find(".//testcase")
    if case is None:
        return "error", "pytest ran no test"
    for tag in ("failure", "error", "skipped"):
        found = case.find(tag)
        if found is not None:
            text = (found.get("message") or "") + "\n" + (found.text or "")
            return {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], text.strip()[-3000:]
    return "passed", ""


def safe_name(nodeid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in nodeid.split("tests/gpu/", 1)[-1])[:150]


class Round:
    """One round's run: the plan, the scheduling loop, the processes, the summary."""

    def __init__(self, args, root: Path):
        self.args, self.root = args, root
        self.logs, self.results = root / "logs", root / "results"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.results.mkdir(parents=True, exist_ok=True)
        self.start = time.monotonic()
        self.summary: dict = {"machine": machine(), "commit": os.environ.get("ROUND_COMMIT") or git_commit(),
                              "nccl": nccl_version(), "tier": args.tier, "wall_seconds": 0.0, "tests": [],
                              "not_run": []}

    def say(self, line: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f} s] {line}", flush=True)

    def plan(self) -> list[GpuTest]:
        file = self.root / "plan.json"
        env = {**os.environ, "JAXGIN_ROUND_PLAN": str(file), "JAXGIN_TEST_TIER": self.args.tier}
        subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                        *self.args.selection], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        earlier = {}
        for summary in self.args.durations:  # the later files' durations win
            if Path(summary).is_file():
                earlier.update({t["name"]: t["seconds"] for t in json.loads(Path(summary).read_text())["tests"]})
        tests = [GpuTest(e["nodeid"], e["gpus"], e["processes"], e["exclusive"]) for e in json.loads(file.read_text())]
        if self.args.skip_passed:  # an interrupted round goes on with what had not passed
            passed = {t["name"] for t in json.loads(Path(self.args.skip_passed).read_text())["tests"]
                      if t["outcome"] == "passed"}
            tests = [t for t in tests if t.name not in passed]
        for t in tests:
            t.expected_s = earlier.get(t.name) or estimated_seconds(t)
        return tests

    def launch(self, test: GpuTest, place: list[int]) -> subprocess.Popen:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, place)), "JAXGIN_TEST_TIER": self.args.tier,
               "JAXGIN_RESULTS_DIR": str(self.results)}
        if not test.exclusive:
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # GPUs shared with other tests' processes
        if self.args.require_all:
            env["JAXGIN_TEST_REQUIRE_GPU"] = "1"
        log = open(self.logs / f"{safe_name(test.nodeid)}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                                 f"--junitxml={self.logs / (safe_name(test.nodeid) + '.xml')}", test.nodeid],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def run(self) -> int:
        tests = self.plan()
        self.say(f"{len(tests)} tests on {self.args.gpus} GPU(s), tier {self.args.tier}; caps: "
                 f"{self.args.processes} processes, {self.args.ranks_per_gpu} ranks per GPU")
        schedule = Schedule(self.args.gpus, self.args.processes, self.args.ranks_per_gpu, tests)
        self.summary["not_run"] = [f"{t.name}: needs {t.gpus} GPUs" for t in schedule.too_large]
        procs: dict[str, tuple[subprocess.Popen, float]] = {}
        deadline = self.start + self.args.deadline if self.args.deadline else None
        while schedule.waiting or procs:
            if deadline is None or time.monotonic() < deadline:
                for test, place in schedule.ready():
                    procs[test.nodeid] = (self.launch(test, place), time.monotonic())
                    self.say(f"start {test.name} on GPU {place} ({test.processes} processes"
                             f"{', GPUs to itself' if test.exclusive else ''})")
            elif schedule.waiting:
                self.summary["not_run"] += [f"{t.name}: not started by the deadline" for t in schedule.waiting]
                self.say(f"deadline: {len(schedule.waiting)} tests not started")
                schedule.waiting.clear()
            for nodeid, (proc, began) in list(procs.items()):
                if proc.poll() is None and not (deadline and time.monotonic() > deadline + self.args.grace):
                    continue
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                test, place = schedule.running[nodeid]
                schedule.finished(test)
                del procs[nodeid]
                self.record(test, place, proc.returncode, time.monotonic() - began)
            time.sleep(1)
        self.write()
        failed = [t for t in self.summary["tests"] if t["outcome"] != "passed"]
        self.say(f"done: {len(self.summary['tests']) - len(failed)} passed, {len(failed)} did not pass, "
                 f"{len(self.summary['not_run'])} not run")
        return 1 if failed or self.summary["not_run"] else 0

    def record(self, test: GpuTest, place: list[int], code: int, seconds: float) -> None:
        xml = self.logs / f"{safe_name(test.nodeid)}.xml"
        if xml.is_file():
            outcome, message = junit_outcome(xml)
        else:
            outcome, message = "error", f"pytest exited {code} without a report (killed at the deadline, or crashed)"
        entry = {"name": test.name, "outcome": outcome, "seconds": round(seconds, 1), "gpus": place,
                 "processes": test.processes}
        if message:
            entry["message"] = message
        self.summary["tests"].append(entry)
        self.say(f"{outcome:7} {test.name} ({seconds:.0f} s)")
        self.write()

    def write(self) -> None:
        self.summary["wall_seconds"] = round(time.monotonic() - self.start, 1)
        by_file: dict[str, dict[str, int]] = {}
        for t in self.summary["tests"]:
            counts = by_file.setdefault(t["name"].split("::")[0], {})
            counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
        self.summary["by_file"] = by_file
        (self.results / "gpu-round.json").write_text(json.dumps(self.summary, indent=1))


def machine() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "no GPU"


def visible_gpus() -> int:
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named:
        return len([g for g in named.split(",") if g.strip()])
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def nccl_version() -> str:
    out = subprocess.run([sys.executable, "-c", "from jaxgin import nccl; print(nccl.load().version_string)"],
                         capture_output=True, text=True, cwd=REPO)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def prepare(root: Path) -> None:
    """Install and build jaxgin (device library, host transport), the crash-stack preload, and
    what jaxgin finds; each step's output in root/logs."""
    steps = [("install", [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", "."]),
             ("build", [sys.executable, "-m", "jaxgin.build"]),
             ("transport", [sys.executable, "-m", "jaxgin.transport"]),
             ("backtrace", ["gcc", "-shared", "-fPIC", "-O1", "-o", "/tmp/native_backtrace.so",
                            "tools/native_backtrace.c", "-ldl"]),
             ("info", [sys.executable, "-m", "jaxgin.info"])]
    for name, command in steps:
        with open(root / "logs" / f"{name}.log", "w") as log:
            code = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
        print(f"{name}: exit {code}", flush=True)
        if code != 0 and name != "info":
            raise SystemExit(f"{name} failed: see {root / 'logs' / (name + '.log')}")
    os.environ["LD_PRELOAD"] = "/tmp/native_backtrace.so"  # a crashing rank prints its native stack


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("command", choices=["run", "start", "wait"])
    parser.add_argument("selection", nargs="*", help="pytest paths or node ids (default tests/gpu); "
                        "for wait, the seconds to wait (default 540)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression narrowing the selection")
    parser.add_argument("--tier", choices=["fast", "soak"], default="fast",
                        help="fast: every code path once (default); soak: the long loops")
    parser.add_argument("--require-all", action="store_true",
                        help="a GPU test that skips fails (JAXGIN_TEST_REQUIRE_GPU=1)")
    # Ranks that share a GPU take turns for its time slices while jaxgin's kernels spin: three
    # world-8 MoE jobs side by side (6 ranks per GPU, 4 x H200) took 400 s each, one beside two
    # idle jobs 87 s. So few ranks per GPU.
    parser.add_argument("--processes", type=int, default=int(os.environ.get("ROUND_PROCESSES", 20)),
                        help="test processes at once, all GPUs together (default 20)")
    parser.add_argument("--ranks-per-gpu", type=int, default=int(os.environ.get("ROUND_RANKS_PER_GPU", 4)),
                        help="test processes at once on one GPU (default 4)")
    parser.add_argument("--deadline", type=float, default=0, help="seconds after which no test starts (0: none)")
    parser.add_argument("--grace", type=float, default=120, help="seconds after the deadline before running tests are killed")
    parser.add_argument("--durations", action="append", default=[],
                        help="an earlier gpu-round.json (repeatable, later ones win): its test durations order this round")
    parser.add_argument("--no-install", action="store_true", help="jaxgin is installed and built already")
    parser.add_argument("--skip-passed", help="an earlier gpu-round.json: the tests that passed there are left out")
    parser.add_argument("--dir", type=Path, default=DEFAULT_ROUND_DIR, help="where a round keeps its files")
    args = parser.parse_intermixed_args(argv)

    if args.command == "wait":
        return wait(args.dir, float(args.selection[0]) if args.selection else 540)
    args.selection = (args.selection or ["tests/gpu"]) + (["-k", args.keyword] if args.keyword else [])
    if args.command == "start":
        return start(args, argv if argv is not None else sys.argv[1:])
    root = args.dir
    (root / "logs").mkdir(parents=True, exist_ok=True)
    os.environ.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", PYTHONFAULTHANDLER="1",
                      JAXGIN_CACHE_DIR=os.environ.get("JAXGIN_CACHE_DIR", "/tmp/jaxgin-cache"))
    # Device-side waits of ranks that share GPUs with other tests' ranks take turns for time slices:
    # a minute before a wait counts as starved (the fault tests set their own, shorter, timeouts).
    os.environ.setdefault("JAXGIN_TIMEOUT", "60")
    if not args.no_install:
        prepare(root)
    elif Path("/tmp/native_backtrace.so").is_file():
        os.environ["LD_PRELOAD"] = "/tmp/native_backtrace.so"
    args.gpus = visible_gpus()
    if args.gpus == 0:
        raise SystemExit("no NVIDIA GPU here: nvidia-smi -L lists none (or CUDA_VISIBLE_DEVICES names none)")
    code = Round(args, root).run()
    (root / "done").write_text(str(code))
    return code


def start(args, argv) -> int:
    """Runs this round in the background in a process session of its own, from a copy of the tree
    (a device call's working tree goes away when the call returns)."""
    root = args.dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copytree(REPO, root / "repo", symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "build", "__pycache__", ".device-stage", ".whl"))
    rest = [a for a in argv if a != "start"]
    os.environ.setdefault("ROUND_COMMIT", git_commit())  # the copy leaves .git behind
    with open(root / "round.log", "w") as log:
        subprocess.Popen([sys.executable, str(root / "repo" / "tools" / "gpu_round.py"), "run", *rest, "--dir", str(root)],
                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"round started in {root}; read it with: python3 tools/gpu_round.py wait SECONDS", flush=True)
    return 0


def wait(root: Path, seconds: float) -> int:
    """Waits up to `seconds` for the round to end, prints its progress, and copies the summary,
    the round's log and every test's log (one archive) into $OUT."""
    until = time.monotonic() + seconds
    while not (root / "done").exists() and time.monotonic() < until:
        time.sleep(5)
    out = Path(os.environ.get("OUT", "/tmp"))
    for name in ("round.log", "results/gpu-round.json", "logs/info.log"):
        if (root / name).is_file():
            shutil.copy(root / name, out / Path(name).name)
    with tarfile.open(out / "round-files.tar.gz", "w:gz") as archive:
        for part in ("logs", "results"):
            if (root / part).is_dir():
                archive.add(root / part, arcname=part)
    done = (root / "done").exists()
    print("round finished" if done else "round still running", flush=True)
    log = (root / "round.log").read_text() if (root / "round.log").is_file() else ""
    for line in log.splitlines()[-60:]:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
