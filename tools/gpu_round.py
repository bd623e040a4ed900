"""The GPU round: every GPU test on a lent machine, scheduled over its GPUs, with a summary; and
the round's other jobs (benchmarks, examples, the multi-host checks) in the same environment.

    python3 tools/gpu_round.py run   [OPTIONS] [PYTEST SELECTION]   # in the foreground
    python3 tools/gpu_round.py start [OPTIONS] [PYTEST SELECTION]   # in the background, then:
    python3 tools/gpu_round.py wait SECONDS                         # up to SECONDS; results into $OUT
    python3 tools/gpu_round.py bench [NAME ...]                     # benchmarks (bench --help lists them)
    python3 tools/gpu_round.py examples [NAME ...]                  # examples/*.py
    python3 tools/gpu_round.py cluster [--examples]                 # tools/cluster_check.py
    python3 tools/gpu_round.py session PHASE [PHASE ...]            # phases in the background, then wait

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
test ends: {"machine", "commit", "tree", "nccl", "tier", "wall_seconds", "tests": [{"name", "outcome",
"seconds", "gpus", "message"}], "not_run": [...]}.

bench, examples and cluster install and build jaxgin as a round does, then run their steps one
after another, each bounded, its output in --out (default $OUT) as NAME.log, and write
bench.json (examples.json, cluster.json): {"machine", "commit", "tree", "nccl", "steps": [{"name",
"command", "exit", "seconds", "log"}], "left_out"}; --dry-run prints the steps only. A session
runs phases one after another in the background, like start: each phase a command of this tool
(run, bench, examples, cluster; its files in DIR/phase-N), `await nccl VERSION [SECONDS]` or
`await file PATH [SECONDS]` (the session ends if it never comes), or any other shell command
($RESULTS names its folder); NAME=VALUE words in front set its environment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

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
        self.summary: dict = {"machine": machine(), **provenance(), "nccl": nccl_version(), "tier": args.tier,
                              "wall_seconds": 0.0, "tests": [], "not_run": []}

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
        # An interrupted round goes on with what had not passed in any of its parts.
        passed = {t["name"] for summary in self.args.skip_passed for t in json.loads(Path(summary).read_text())["tests"]
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


def git_commit(repo: Path = REPO, tree: str | None = None) -> str:
    """HEAD, when it holds the tree that runs (`tree`, else git_tree's); a stale .git's HEAD is not
    what ran, so then "unknown" with that HEAD named (the tree field says what ran)."""
    out = subprocess.run(["git", "rev-parse", "HEAD", "HEAD^{tree}"], cwd=repo, capture_output=True, text=True)
    head, _, head_tree = out.stdout.strip().partition("\n")
    if out.returncode != 0 or not head:
        return "unknown"
    return head if head_tree == (tree or git_tree(repo)) else f"unknown (the copy's HEAD {head[:12]} holds another tree)"


def git_tree(repo: Path = REPO) -> str:
    """The tree that runs, as git names it: `git write-tree` of every file git does not ignore,
    through an index of its own. It equals `git rev-parse COMMIT^{tree}` of a clean checkout of
    COMMIT, which the commit cannot say when the .git that came along is stale (find the commit
    with `git log --all --format='%H %T' | grep TREE`)."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(folder) / "index")}
        added = subprocess.run(["git", "add", "-A"], cwd=repo, env=env, capture_output=True, text=True)
        tree = subprocess.run(["git", "write-tree"], cwd=repo, env=env, capture_output=True, text=True)
    return tree.stdout.strip() if added.returncode == 0 and tree.returncode == 0 else "unknown"


def provenance() -> dict[str, str]:
    """What ran: the commit and the tree (ROUND_COMMIT / ROUND_TREE, set by in_background before
    the copy that leaves .git behind, else read here)."""
    tree = os.environ.get("ROUND_TREE") or git_tree()
    return {"commit": os.environ.get("ROUND_COMMIT") or git_commit(tree=tree), "tree": tree}


def nccl_version() -> str:
    out = subprocess.run([sys.executable, "-c", "from jaxgin import nccl; print(nccl.load().version_string)"],
                         capture_output=True, text=True, cwd=REPO)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def shared_environment() -> None:
    """What every job of a round runs with, tests, benchmarks and examples alike: output as it comes
    and Python's stacks on a crash (the logs are all a lease leaves), no NVLink multicast (never on
    shared machines), one build cache for every step."""
    os.environ.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", PYTHONFAULTHANDLER="1",
                      JAXGIN_CACHE_DIR=os.environ.get("JAXGIN_CACHE_DIR", "/tmp/jaxgin-cache"))


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
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in JOB_COMMANDS:
        return JOB_COMMANDS[argv[0]](argv[1:])
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
    parser.add_argument("--skip-passed", action="append", default=[],
                        help="an earlier gpu-round.json (repeatable): the tests that passed in any of them are left out")
    parser.add_argument("--dir", type=Path, default=DEFAULT_ROUND_DIR, help="where a round keeps its files")
    args = parser.parse_intermixed_args(argv)

    if args.command == "wait":
        return wait(args.dir, float(args.selection[0]) if args.selection else 540)
    for missing in [p for p in args.skip_passed if not Path(p).is_file()]:  # refused here, not in the background
        parser.error(f"--skip-passed {missing}: no such file (a round keeps its summary in "
                     "DIR/results/gpu-round.json)")
    args.selection = (args.selection or ["tests/gpu"]) + (["-k", args.keyword] if args.keyword else [])
    if args.command == "start":
        return start(args, argv)
    root = args.dir
    (root / "logs").mkdir(parents=True, exist_ok=True)
    shared_environment()
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
    argv, earlier = keep_earlier_summaries([a for a in argv if a != "start"], root)
    in_background(root, ["run", *argv, "--dir", str(root)], "round.log", keep=earlier)
    print(f"round started in {root}; read it with: python3 tools/gpu_round.py wait SECONDS", flush=True)
    return 0


def wait(root: Path, seconds: float) -> int:
    """Waits up to `seconds` for the round to end, prints its progress, and copies the summary,
    the round's log and every test's log (one archive) into $OUT."""
    until = time.monotonic() + seconds
    while not (root / "done").exists() and time.monotonic() < until and background_alive(root):
        time.sleep(5)
    out = Path(os.environ.get("OUT", "/tmp"))
    for name in ("round.log", "session.log", "results/gpu-round.json", "logs/info.log"):
        if (root / name).is_file():
            shutil.copy(root / name, out / Path(name).name)
    phases = sorted((p for p in root.glob("phase-*") if p.suffix == ".log"), key=lambda p: p.stat().st_mtime)
    with tarfile.open(out / "round-files.tar.gz", "w:gz") as archive:
        for part in ("logs", "results", *sorted(p.name for p in root.glob("phase-*"))):
            if (root / part).exists():
                archive.add(root / part, arcname=part)
    done, alive = (root / "done").exists(), background_alive(root)
    print("round finished" if done else "round still running" if alive else
          "round ended without finishing: its process is gone (its log below says why)", flush=True)
    log = root / ("session.log" if (root / "session.log").is_file() else "round.log")
    for line in (log.read_text() if log.is_file() else "").splitlines()[-60:]:
        print(line)
    if phases:  # a session: where its latest phase stands
        print(f"--- {phases[-1].name}")
        for line in phases[-1].read_text(errors="replace").splitlines()[-20:]:
            print(line)
    return 0 if done or alive else 1


def background_alive(root: Path) -> bool:
    """Whether the process that in_background started for root still runs (True when it left no
    pid: a round run in the foreground). A wait that kept waiting on a round that had died at once
    spent the last minutes of a lease."""
    try:
        os.kill(int((root / "pid").read_text()), 0)
    except (FileNotFoundError, ValueError):
        return True
    except ProcessLookupError:
        return False
    return True


def keep_earlier_summaries(argv: list[str], root: Path) -> tuple[list[str], dict[str, bytes]]:
    """argv with each --durations / --skip-passed file that exists read now and named again under
    root/earlier/, and those files' contents: the next round's folder is made afresh, and the last
    round left its summary there (root/results/gpu-round.json)."""
    kept, out, args = {}, [], iter(argv)
    for arg in args:
        out.append(arg)
        if arg in ("--durations", "--skip-passed"):
            path = Path(next(args, ""))
            if path.is_file():
                name = f"earlier/{len(kept)}-{path.name}"
                kept[name] = path.read_bytes()
                path = root / name
            out.append(str(path))
    return out, kept


def in_background(root: Path, arguments: list[str], log_name: str, keep: dict[str, bytes] | None = None) -> None:
    """This tool with `arguments`, run from a fresh copy of the tree in root (copy_tree) in a process
    session of its own that outlives the device call, its output in root/`log_name`; `keep`: files
    (path under root: contents) written there first."""
    copy_tree(root)
    for name, contents in (keep or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(contents)
    made = provenance()  # read here: the copy leaves .git behind
    os.environ["ROUND_COMMIT"], os.environ["ROUND_TREE"] = made["commit"], made["tree"]
    with open(root / log_name, "w") as log:
        process = subprocess.Popen([sys.executable, str(root / "repo" / "tools" / "gpu_round.py"), *arguments],
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    (root / "pid").write_text(str(process.pid))


def copy_tree(root: Path) -> None:
    """Makes root afresh with a copy of the tree in root/repo: a device call's working tree goes
    away when the call returns, and what runs in the background outlives the call."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copytree(REPO, root / "repo", symlinks=True,
                    ignore=shutil.ignore_patterns(".git", "build", "__pycache__", ".device-stage", ".whl"))


# The round's other jobs: benchmarks, examples and the multi-host checks, each a bounded step with a
# log of its own; and a session, which runs them and rounds one after another in the background.

@dataclass
class Step:
    """One bounded job: a Python script of this repository with its arguments, in which {out}
    stands for the folder its files go to."""

    name: str
    script: list[str]
    seconds: int
    gpus: int = 1
    default: bool = True  # in `bench` when no names are given
    needs: str = ""  # what it needs beyond GPUs and jaxgin's cuda extra
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[IO[str]], dict[str, str]] | None = None  # more environment, found on the machine; gets the log
    tail: int = 8  # lines of its log printed once it ends

    def command(self, out: Path) -> list[str]:
        return [sys.executable, *(a.replace("{out}", str(out)) for a in self.script)]


def nccl_ep_setup(log) -> dict[str, str]:
    """NCCL EP's wheels from .device-ncclep/ (the machines reach no package registry; cuda-bindings
    only where cuda.core does not import with the machine's own), GIN through jaxgin's host
    transport (no RDMA NIC there), and jaxgin's nvcc for the kernels NCCL EP compiles."""
    def run(*command):
        return subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, check=True).stdout

    wheels = sorted((REPO / ".device-ncclep").glob("*.whl"))
    bindings = [w for w in wheels if w.name.startswith("cuda_bindings-")]
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
    if len(wheels) > len(bindings):
        run(*pip, *(str(w) for w in wheels if w not in bindings))
    if bindings and subprocess.run([sys.executable, "-c", "import cuda.core"], capture_output=True).returncode:
        run(*pip, *map(str, bindings))
    plugin = run(sys.executable, "-m", "jaxgin.transport").strip().removeprefix("export NCCL_RMA_PLUGIN=")
    nvcc = os.environ.get("NCCL_EP_JIT_NVCC") or run(
        sys.executable, "-c", "from jaxgin.build import find_nvcc; print(find_nvcc())").strip()
    return {"NCCL_RMA_PLUGIN": plugin, "NCCL_EP_JIT_NVCC": nvcc}


LATENCY_OPS = "ppermute,all_to_all,put_wait,put_wait_from,self_copy"
BENCHMARKS = {step.name: step for step in [
    Step("latency", ["benchmarks/collectives.py", "--ops", LATENCY_OPS, "--max-bytes", "64KiB", "--out", "{out}",
                     "--name", "latency"], 200, gpus=2, tail=40),
    Step("fused", ["benchmarks/fused.py", "--out", "{out}"], 540, gpus=2, tail=30),  # with the Pallas job
    Step("chunking", ["benchmarks/fused.py", "--chunking-only", "--out", "{out}"], 200, tail=20),
    Step("moe", ["benchmarks/moe.py", "--out", "{out}"], 360, tail=30),  # 128 tokens: two chain lengths
    Step("triton_matmul", ["benchmarks/triton_matmul.py", "--out", "{out}"], 420, tail=20),
    # the tile code where a sweep's M gives fewer 128-row tiles than SMs: 64-row tiles against 128-row ones
    Step("triton_matmul_rows", ["benchmarks/triton_matmul.py", "--variants", "pointer", "--shapes",
                                "512x7168x2048,1024x7168x2048,2048x7168x2048", "--configs",
                                "64x128x64/4/4,64x128x64/5/4,64x256x64/4/4,64x256x64/3/8,128x128x64/3/8,128x128x64/4/4,"
                                "128x256x64/4/8,128x64x64/4/4", "--out", "{out}"], 400, default=False, tail=40),
    Step("triton_matmul_copying", ["benchmarks/triton_matmul.py", "--variants",
                                   "pointer,copying0,copying8,copying16,copying32", "--configs",
                                   "128x256x64/3/8,128x128x64/3/8", "--out", "{out}"], 300, default=False, tail=24),
    Step("collectives", ["benchmarks/collectives.py", "--out", "{out}"], 540, gpus=2, default=False, tail=40),
    # latency's ops, each run donating its input: XLA replays its recorded graphs without updating them
    Step("latency_donated", ["benchmarks/collectives.py", "--ops", LATENCY_OPS, "--max-bytes", "64KiB", "--donate",
                             "--out", "{out}", "--name", "latency_donated"], 200, gpus=2, default=False, tail=40),
    Step("chunked_layouts", ["benchmarks/fused.py", "--chunked-layouts-only", "--out", "{out}"], 420, gpus=2,
         default=False, tail=20),
    Step("chunked_triton", ["benchmarks/fused.py", "--chunked-triton-only", "--out", "{out}"], 330, gpus=2,
         default=False, tail=12),
    Step("windowed", ["benchmarks/fused.py", "--windowed-only", "--out", "{out}"], 240, gpus=2, default=False,
         tail=20),
    Step("fused_sweep", ["benchmarks/fused.py", "--sweep-only", "--out", "{out}"], 240, gpus=2, default=False,
         tail=12),
    Step("fused_variants", ["benchmarks/fused.py", "--variants-only", "--out", "{out}"], 300, gpus=2, default=False,
         tail=20),
    Step("fused_gather_trace", ["benchmarks/fused.py", "--gather-trace-only", "--out", "{out}"], 240, gpus=2,
         default=False, tail=8),
    # the issue's shapes alone (host clock and device span), without the sweep, breakdown and baselines' processes
    Step("fused_shapes", ["benchmarks/fused.py", "--shapes-only", "--no-windowed", "--no-pallas", "--out", "{out}"],
         360, gpus=2, default=False, tail=8),
    Step("fused_a2a_trace", ["benchmarks/fused.py", "--all-to-all-trace-only", "--out", "{out}"], 240, gpus=2,
         default=False, tail=10),
    # when each GPU starts a chain of Triton calls against XLA's and the chunked op's, with each host thread's events
    Step("launch_skew", ["tools/profile_launch_skew.py", "--out", "{out}/launch_skew"], 200, gpus=2, default=False,
         tail=12),
    Step("fused_rs_trace", ["benchmarks/fused.py", "--reduce-scatter-trace-only", "--out", "{out}"], 180, gpus=2,
         default=False, tail=8),
    Step("fused_gather_variants", ["benchmarks/fused.py", "--gather-variants-only", "--repeats", "3", "--out", "{out}"],
         420, gpus=2, default=False, tail=12),
    Step("fused_rs_variants", ["benchmarks/fused.py", "--reduce-scatter-variants-only", "--repeats", "3", "--out",
                               "{out}"], 300, gpus=2, default=False, tail=16),
    # every entry local: the HBM side of dispatch and combine alone (benchmarks/results/1xh200/moe_one_gpu.json)
    Step("moe_one_gpu", ["benchmarks/moe.py", "--tokens", "4096", "--experts", "128", "--only",
                         "jaxgin_dispatch,jaxgin_combine,xla_gather_same_rows,routing_only", "--out", "{out}/moe_one_gpu"],
         300, default=False, tail=40),
    # jaxgin's pair beside NCCL EP's of the same round: run after nccl_ep (`bench nccl_ep moe_with_nccl_ep`)
    Step("moe_with_nccl_ep", ["benchmarks/moe.py", "--nccl-ep", "{out}/nccl_ep.json", "--out", "{out}"], 360,
         gpus=2, default=False, tail=30),
    Step("moe_profile", ["tools/profile_moe.py", "--tokens", "128", "--out", "{out}/moe_profile"], 150, default=False,
         tail=40),  # times in its log; traces and optimized HLO in its folder
    # low latency: block shapes with fewer steps per program (each compiles for sm_90a without
    # spilling, fp8 included; 2,8192,8 and 4,2048,8 spill with fp8)
    Step("moe_blocks", ["benchmarks/moe.py", "--tokens", "128", "--only",
                        "jaxgin_dispatch,jaxgin_dispatch_fp8,jaxgin_combine,jaxgin_pair", "--blocks",
                        "2,1024,4,4;1,8192,8,4;1,4096,4,4;1,2048,4,4;2,4096,8,4", "--out", "{out}/moe_blocks"],
         480, default=False, tail=40),
    Step("moe_profile_fp8", ["tools/profile_moe.py", "--tokens", "128", "--fp8"], 150, default=False, tail=40),
    # block shapes by their kernels' device times (median and shortest run over a chain of pairs; a
    # setting applies to both kernels: 2,4096,8 is dispatch's preset, 1,4096,16 combine's)
    Step("moe_kernels", ["tools/profile_moe.py", "--tokens", "128", "--chains", "pair", "--blocks",
                         "2,4096,8,4;1,4096,16,4;1,4096,8,4;2,4096,16,4;1,2048,16,4",
                         "--json", "{out}/moe_kernels.json"], 420, default=False, tail=12),
    Step("moe_ht_blocks", ["tools/profile_moe.py", "--tokens", "4096", "--chains", "dispatch,combine", "--blocks",
                           "8,1024,8,3;8,1024,16,3;4,1024,8,3;8,512,16,3", "--json", "{out}/moe_ht_blocks.json"],
         300, default=False, tail=12),
    # high throughput: the routing kernels' and the dispatch and combine kernels' device times at
    # 4096 tokens, and the dispatch kernel traced (when senders end, when the last block is placed)
    Step("moe_ht_kernels", ["tools/profile_moe.py", "--tokens", "4096", "--chains", "dispatch,pair",
                            "--trace-dispatch", "--json", "{out}/moe_ht_kernels.json"], 180, default=False, tail=12),
    # a jaxgin.triton_call of a kernel with nothing to do against an XLA fusion, per call in a chain
    Step("call_overhead", ["tools/call_overhead.py", "--out", "{out}"], 120, default=False, tail=10),
    # tl.histogram counted three ways against numpy (a masked count of a reshaped block miscounted on an H200)
    Step("triton_histogram", ["tools/probe_triton_histogram.py", "--out", "{out}"], 120, default=False, tail=20),
    # the CUDA stack limit after NCCL's init, XLA's first collective and jaxgin's kernels (run it with
    # NCCL_SET_STACK_SIZE=1, as the host transport sets it: what a later launch could still grow)
    Step("stack_limit", ["tools/probe_stack_limit.py", "--out", "{out}"], 150, default=False, tail=10),
    # dispatch(fp8=True), fp8.quantize and fp8.rounded against a numpy / ml_dtypes oracle, value by value
    Step("check_fp8", ["tools/check_fp8.py", "--out", "{out}"], 200, default=False, tail=40),
    # latency's chains at 8 B traced with JAX's profiler: device time per op beside the wall-clock rows
    Step("latency_profile", ["tools/profile_latency.py", "--ops", "ppermute,put_wait_from,put_wait,self_copy", "--host"], 150,
         gpus=2, default=False, tail=80),
    # the same at 256 KiB, where the mailbox pair trailed XLA's ppermute most (collectives.json: 0.63x)
    Step("mailbox_profile", ["tools/profile_latency.py", "--bytes", "256KiB", "--ops", "ppermute,put_wait_from,put_wait",
                             "--host"],
         150, gpus=2, default=False, tail=80),
    Step("tune_matmul", ["tools/tune_triton_matmul.py", "--out", "{out}"], 400, default=False, needs="torch", tail=12),
    Step("transport_smoke", ["tools/transport_smoke.py", "--out", "{out}"], 400, default=False,
         needs="NCCL >= 2.30 (../shared/tools/nccl-stage)"),
    Step("nccl_ep", ["benchmarks/nccl_ep.py", "--out", "{out}", "--timeout", "320"], 330, gpus=2, default=False,
         needs="nccl-extensions and its wheels in .device-ncclep/, NCCL 2.30.x (nccl-stage)",
         env={"NCCL_EP_TIMEOUT_MS": "20000"}, setup=nccl_ep_setup, tail=60),
]}
CLUSTER_CHECK = Step("cluster_check", ["tools/cluster_check.py", "--out", "{out}"], 300, tail=60)
CLUSTER_EXAMPLES = Step("cluster_examples", ["tools/cluster_check.py", "--out", "{out}", "--examples"], 560, tail=40)


def example_steps() -> dict[str, Step]:
    return {p.stem: Step(p.stem, [f"examples/{p.name}"], 300, tail=20) for p in sorted((REPO / "examples").glob("*.py"))}


def run_step(step: Step, out: Path) -> dict:
    """Runs one step in a process group of its own (a benchmark's ranks are its children and go
    with it at the time limit), its output in out/NAME.log; prints the log's last lines."""
    log = out / f"{step.name}.log"
    command = step.command(out)
    print(f"=== {step.name}", flush=True)
    began = time.monotonic()
    with open(log, "w") as sink:
        try:
            env = {**os.environ, **step.env, **(step.setup(sink) if step.setup else {})}
        except (subprocess.CalledProcessError, OSError) as e:
            print(f"setup failed: {e}", file=sink)
            code = 1
        else:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                code = proc.wait(timeout=step.seconds)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                print(f"stopped after {step.seconds} s", file=sink)
                code = 124  # what timeout(1) says
    seconds = time.monotonic() - began
    lines = [line for line in log.read_text(errors="replace").splitlines() if "warning" not in line.lower()]
    for line in lines[-step.tail:]:
        print(line)
    print(f"--- {step.name}: exit {code} ({seconds:.0f} s)", flush=True)
    return {"name": step.name, "command": shlex.join(command), "exit": code, "seconds": round(seconds, 1),
            "log": log.name}


def run_steps(kind: str, steps: list[Step], left_out: list[str], args) -> int:
    """Installs and builds jaxgin as a round does, runs `steps` one after another and writes
    args.out/KIND.json; with --dry-run only prints what it would run."""
    shared_environment()
    # A wait that never ends fails a benchmark in 10 s rather than jaxgin's 30: nothing shares
    # these GPUs, so a wait that long is lost.
    os.environ.setdefault("JAXGIN_TIMEOUT", "10")
    if args.dry_run:
        for step in steps:
            extra = "".join(f" {k}={v}" for k, v in step.env.items())
            print(f"{step.name}:{extra} {shlex.join(step.command(args.out))} (at most {step.seconds} s)")
        for line in left_out:
            print(f"left out: {line}")
        return 0
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    os.environ["JAXGIN_RESULTS_DIR"] = str(out)
    if not args.no_install:
        prepare(out)
    summary = {"machine": machine(), **provenance(), "nccl": nccl_version(),
               "steps": [], "left_out": left_out}
    for step in steps:
        summary["steps"].append(run_step(step, out))
        (out / f"{kind}.json").write_text(json.dumps(summary, indent=1))
    failed = [s["name"] for s in summary["steps"] if s["exit"] != 0]
    print(f"{kind}: {len(steps) - len(failed)} of {len(steps)} exited 0" + (f"; not: {', '.join(failed)}" if failed else ""),
          flush=True)
    return 1 if failed else 0


def steps_parser(command: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"gpu_round.py {command}", description=description, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or f"/tmp/jaxgin-{command}"),
                        help="where the logs and the results go (default $OUT)")
    parser.add_argument("--dry-run", action="store_true", help="print each step's command and stop: nothing installed or run")
    parser.add_argument("--no-install", action="store_true", help="jaxgin is installed and built already")
    return parser


def chosen(parser, names: list[str], steps: dict[str, Step]) -> list[Step]:
    unknown = [n for n in names if n not in steps]
    if unknown:
        parser.error(f"no step {', '.join(unknown)}: choose from {', '.join(steps)}")
    return [steps[n] for n in names]


def bench(argv: list[str]) -> int:
    table = "\n".join(f"  {'*' if s.default else ' '} {s.name:16} {s.gpus} GPU{'s' if s.gpus > 1 else ''}, at most "
                      f"{s.seconds} s{'; needs ' + s.needs if s.needs else ''}" for s in BENCHMARKS.values())
    parser = steps_parser("bench", "The benchmarks and profiles of a round, one after another, each bounded. "
                          "A device call lasts 10 minutes: name a few, or run them in a session.",
                          "benchmarks (* the default set):\n" + table)
    parser.add_argument("names", nargs="*", help="which (default: those of the default set this machine's GPUs allow)")
    args = parser.parse_args(argv)
    if args.names:
        return run_steps("bench", chosen(parser, args.names, BENCHMARKS), [], args)
    gpus = visible_gpus() if shutil.which("nvidia-smi") or os.environ.get("CUDA_VISIBLE_DEVICES") else 0
    if gpus == 0 and not args.dry_run:
        raise SystemExit("no NVIDIA GPU here: nvidia-smi -L lists none (or CUDA_VISIBLE_DEVICES names none)")
    defaults = [s for s in BENCHMARKS.values() if s.default]
    return run_steps("bench", [s for s in defaults if s.gpus <= gpus],
                     [f"{s.name}: needs {s.gpus} GPU{'s' if s.gpus > 1 else ''}, this machine has {gpus}"
                      for s in defaults if s.gpus > gpus], args)


def examples(argv: list[str]) -> int:
    steps = example_steps()
    parser = steps_parser("examples", "The examples (examples/*.py) one after another, each bounded; "
                          "each says what it needs.")
    parser.add_argument("names", nargs="*", help=f"which (default all: {', '.join(steps)})")
    args = parser.parse_args(argv)
    return run_steps("examples", chosen(parser, args.names, steps) or list(steps.values()), [], args)


def cluster(argv: list[str]) -> int:
    parser = steps_parser("cluster", "The multi-host checks (tools/cluster_check.py): the doctor, and "
                          "jaxgin.pairtest at emulated worlds 2, 4 and 8 and on the mixed mesh, side by side. "
                          "Needs NCCL >= 2.30 (../shared/tools/nccl-stage).")
    parser.add_argument("--examples", action="store_true",
                        help="instead, the quickstart and the MoE example on two emulated hosts")
    args = parser.parse_args(argv)
    return run_steps("cluster", [CLUSTER_EXAMPLES if args.examples else CLUSTER_CHECK], [], args)


PHASE_COMMANDS = ("run", "bench", "examples", "cluster")  # what a session runs as commands of this tool
GATE_SECONDS = 1200.0


def parse_phase(phase: str) -> tuple[dict[str, str], list[str]]:
    """A phase's NAME=VALUE words in front, and the rest."""
    words = shlex.split(phase)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def phase_problem(phase: str) -> str | None:
    """What is wrong with a phase, found before the session starts rather than an hour into it."""
    _, words = parse_phase(phase)
    if not words:
        return "nothing to run"
    if words[0] in ("start", "wait", "session"):
        return f"{words[0]} inside a session: give run, bench, examples or cluster"
    if words[0] == "await":
        usage = "expected: await nccl VERSION [SECONDS] or await file PATH [SECONDS], VERSION like 2.30"
        if len(words) not in (3, 4) or words[1] not in ("nccl", "file"):
            return usage
        numbers = words[3:] + (words[2].split(".")[:2] if words[1] == "nccl" else [])
        if not all(n.replace(".", "", 1).isdigit() for n in numbers):
            return usage
    return None


def gate_open(what: str, target: str) -> bool:
    if what == "file":
        return Path(target).exists()
    # a fresh process: nccl-stage installs the wheel while the session runs
    out = subprocess.run([sys.executable, "-c", "from importlib.metadata import version; "
                          "print(version('nvidia-nccl-cu13'))"], capture_output=True, text=True).stdout.strip()
    have = tuple(int(p) for p in out.split(".")[:2] if p.isdigit())
    return bool(have) and have >= tuple(int(p) for p in target.split(".")[:2])


def run_phase(root: Path, number: int, phase: str) -> tuple[int, bool]:
    """Runs phase `number`: (its exit status, whether the session goes on)."""
    env, words = parse_phase(phase)
    if words[0] == "await":
        seconds = float(words[3]) if len(words) == 4 else GATE_SECONDS
        until = time.monotonic() + seconds
        while not gate_open(words[1], words[2]):
            if time.monotonic() >= until:
                return 1, False  # the later phases need what never came
            time.sleep(min(5.0, max(until - time.monotonic(), 0.1)))
        return 0, True
    folder = root / f"phase-{number}"
    folder.mkdir(parents=True, exist_ok=True)
    if words[0] in PHASE_COMMANDS:
        command = [sys.executable, str(Path(__file__).resolve()), *words, "--dir" if words[0] == "run" else "--out",
                   str(folder)]
    else:
        command, env = ["bash", "-c", phase], {**env, "RESULTS": str(folder)}
    with open(root / f"phase-{number}.log", "w") as log:
        code = subprocess.run(command, cwd=REPO, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    return code, True


def session(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gpu_round.py session", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Phases one after another in the background, from a copy of the tree, as start runs a round; "
                    "read them with: gpu_round.py wait SECONDS [--dir DIR]. Each phase's output goes to "
                    "DIR/phase-N.log, its files to DIR/phase-N/.",
        epilog="phases:\n"
               "  run|bench|examples|cluster [OPTIONS]   a command of this tool\n"
               "  await nccl VERSION [SECONDS]           until pip's nvidia-nccl-cu13 is VERSION or newer (the\n"
               "                                         staging's last chunk installs it: run that one in the\n"
               "                                         foreground, a few seconds; a process left in the\n"
               "                                         background ends with its device call)\n"
               "  await file PATH [SECONDS]              until PATH exists (default 1200 s; if never, the session ends)\n"
               "  anything else                          a shell command; $RESULTS names its folder\n"
               "NAME=VALUE words in front of a phase set its environment. For example:\n"
               "  gpu_round.py session 'bench triton_matmul' 'await nccl 2.30' \\\n"
               "    'CUDA_VISIBLE_DEVICES=0 JAXGIN_TEST_EMULATED_WORLDS=2,4 run --deadline 600'")
    parser.add_argument("phases", nargs="+", help="the phases, each one argument (quote it)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_ROUND_DIR, help="where the session keeps its files")
    parser.add_argument("--here", action="store_true", help=argparse.SUPPRESS)  # the background half
    args = parser.parse_args(argv)
    for phase in args.phases:
        if problem := phase_problem(phase):
            parser.error(f"phase {phase!r}: {problem}")
    root = args.dir
    if args.here:
        shared_environment()
        began, codes = time.monotonic(), []
        for number, phase in enumerate(args.phases, 1):
            print(f"[{time.monotonic() - began:7.1f} s] phase {number}: {phase}", flush=True)
            code, go_on = run_phase(root, number, phase)
            codes.append(code)
            print(f"[{time.monotonic() - began:7.1f} s] phase {number}: exit {code}"
                  f"{'' if go_on else '; it never came, so the session ends'}", flush=True)
            if not go_on:
                break
        (root / "done").write_text(" ".join(map(str, codes)))
        return 1 if any(codes) else 0
    in_background(root, ["session", "--here", "--dir", str(root), *args.phases], "session.log")
    print(f"session of {len(args.phases)} phases started in {root}; read it with: "
          f"python3 tools/gpu_round.py wait SECONDS --dir {root}", flush=True)
    return 0


JOB_COMMANDS = {"bench": bench, "examples": examples, "cluster": cluster, "session": session}

if __name__ == "__main__":
    sys.exit(main())
