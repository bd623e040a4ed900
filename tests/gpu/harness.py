"""What the GPU tests share: how many GPUs there are, how a scenario runs in a fresh process (a
device fault leaves a CUDA context unusable, and several processes need their own JAX runtime),
and where results are recorded (JAXGIN_RESULTS_DIR, for closing notes and benchmarks).

Two kinds of multi-process job: one process per GPU (peers on one host, LSA), and **emulated
hosts**: `world` processes spread over the GPUs present (on a machine with one GPU all on GPU 0),
each claiming a host of its own (NCCL_HOSTID, JAXGIN_TRANSPORT_HOST_ID), so that NCCL makes every
peer a GIN peer and jaxgin's host transport carries every byte. That is how the multi-rank code
paths run on a machine with one GPU; it needs NCCL >= 2.30 (RMA plugins). Times measured in such a
job are not performance: the processes time-slice the GPUs.
"""

import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import pytest

import job


def _visible_gpus() -> list[int]:
    """The nvidia-smi indices of the GPUs the tests may use: every GPU, or those CUDA_VISIBLE_DEVICES
    names (by index or UUID), so that a machine's GPUs can be split between test sessions running
    side by side (tools/gpu_round.py gives each test its GPUs that way)."""
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    listed = [line for line in out.stdout.splitlines() if line.startswith("GPU ")] if out.returncode == 0 else []
    uuids = {line.rsplit("UUID: ", 1)[-1].rstrip(")"): i for i, line in enumerate(listed) if "UUID: " in line}
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is None:
        return list(range(len(listed)))
    chosen = []
    for g in (g.strip() for g in named.split(",") if g.strip()):
        if g.isdigit() and int(g) < len(listed):
            chosen.append(int(g))
        elif g in uuids:
            chosen.append(uuids[g])
        else:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={named!r}: {g!r} is none of this machine's GPUs (nvidia-smi -L "
                             f"lists indices 0 to {len(listed) - 1} and their UUIDs)")
    return chosen


VISIBLE_GPUS = _visible_gpus()
GPUS = len(VISIBLE_GPUS)
# Worlds of the tests parametrized by one: 2 and every visible GPU; on a machine with one GPU, that
# one (an axis of size 1: every op's peer is the device itself, through the same kernels).
WORLD_SIZES = sorted({2, GPUS}) if GPUS >= 2 else [GPUS] if GPUS == 1 else [2]
ANY_GPU = pytest.mark.skipif(GPUS < 1, reason="needs an NVIDIA GPU, found none")
TWO_GPUS = pytest.mark.skipif(GPUS < 2, reason=f"needs >= 2 NVIDIA GPUs, found {GPUS}")
# Worlds of the emulated-hosts tests of the GIN data paths (fused ops, MoE, dead peers in them),
# whatever the number of GPUs; the tests of paths that a world adds nothing to (the JAX ops, the
# runtime, tritongin) take the smallest and the largest in the fast tier (job.tier).
# JAXGIN_TEST_EMULATED_WORLDS narrows them (a round on one GPU: "2,4").
ALL_EMULATED_WORLDS = (2, 4, 8)  # the scenarios' shapes divide by each


def _emulated_worlds() -> list[int]:
    named = os.environ.get("JAXGIN_TEST_EMULATED_WORLDS", ",".join(map(str, ALL_EMULATED_WORLDS)))
    worlds = sorted({int(w) for w in named.split(",") if w.strip().isdigit()})
    if not worlds or not set(worlds) <= set(ALL_EMULATED_WORLDS):
        raise ValueError(f"JAXGIN_TEST_EMULATED_WORLDS={named!r}: expected a comma-separated choice of "
                         f"{ALL_EMULATED_WORLDS}")
    return worlds


EMULATED_WORLDS = _emulated_worlds()


def _one_rank_per_gpu(worlds, gpus: int) -> int:
    """The largest of `worlds` that puts at most one rank on a GPU (the smallest if none does)."""
    return max([w for w in worlds if w <= max(gpus, 2)], default=min(worlds))


def _spot_worlds(worlds, gpus: int) -> list[int]:
    """The emulated worlds of the families a world adds nothing to, in the fast tier: the smallest,
    and the largest that puts at most one rank on a GPU (a world-8 job time-slices 4 GPUs and each
    costs minutes of a round that must fit 15; the GIN data paths still run at every world)."""
    return sorted({worlds[0], _one_rank_per_gpu(worlds, gpus)})


EMULATED_SPOT_WORLDS = job.by_tier(_spot_worlds(EMULATED_WORLDS, GPUS), EMULATED_WORLDS)
by_tier = job.by_tier


def spot_cases_at(world: int, worlds, command_buffers: bool = False) -> bool:
    """Whether a scenario at `world` runs its spot cases (job.spot_cases). In the fast tier every
    case runs once per test family, plain, at the largest of its `worlds` (WORLD_SIZES,
    EMULATED_WORLDS) that gives each rank a GPU of its own; the other worlds and every run under
    command buffers take the spot cases (the same code paths; capture changes how calls are
    launched, not which shapes the kernels see). A world-8 job on 4 GPUs spent most of its 238 s
    compiling the 7 MoE cases (4 x H100, 2026-11-27)."""
    return job.tier() == "fast" and (world != _one_rank_per_gpu(worlds, GPUS) or command_buffers)


def spot_env(spot: bool) -> dict:
    """The setting that tells a scenario to run its spot cases only, or every case."""
    return {"JAXGIN_TEST_SPOT_CASES": "1" if spot else "0"}
# Mixed meshes: emulated hosts of MIXED_RANKS_PER_HOST ranks on different GPUs (NVLink, LSA, inside
# a host; GIN across), up to two such ranks per GPU: a world of one of EMULATED_WORLDS (the
# scenarios' shapes divide by those), the largest of at most twice the GPUs (3 GPUs: world 4, not
# 6, whose chunks of 512 rows the fused scenarios cannot split).
# JAXGIN_TEST_MIXED_WORLD asks for another of EMULATED_WORLDS (world 8 on 2 GPUs: 4 hosts of 2
# ranks, four ranks a GPU).
MIXED_RANKS_PER_HOST = 2
MIXED_WORLD = int(os.environ.get("JAXGIN_TEST_MIXED_WORLD")
                  or max([w for w in EMULATED_WORLDS if w <= 2 * GPUS] or [min(EMULATED_WORLDS)]))
if MIXED_WORLD not in EMULATED_WORLDS or MIXED_WORLD % MIXED_RANKS_PER_HOST:
    raise ValueError(f"JAXGIN_TEST_MIXED_WORLD={MIXED_WORLD}: pick an even world of {EMULATED_WORLDS}")
# The JAXGIN_TEST_HEAP of an emulated rank: eight of them share one GPU with their JAX runtimes.
EMULATED_HEAP = "1GiB"
# XLA flags of every emulated rank. No autotuning: each rank would time candidate kernels on a GPU
# that the other ranks time-slice, which makes its compiles slow and its choices noise. What the
# tests compare does not depend on which GEMM kernel XLA picks: jaxgin's own kernels are compared
# exactly, XLA's matmuls within a tolerance that covers any of them. JAXGIN_TEST_EMULATED_XLA_FLAGS
# replaces them (set it empty to compare a round with autotuning).
EMULATED_XLA_FLAGS = os.environ.get("JAXGIN_TEST_EMULATED_XLA_FLAGS", "--xla_gpu_autotune_level=0")


def require_emulated_hosts() -> None:
    """Skips the calling test unless the NCCL here loads RMA plugins (emulated hosts need jaxgin's
    host transport), saying what to install."""
    from jaxgin import nccl, transport

    install = nccl.load()
    if install.version < transport.MIN_NCCL:
        pytest.skip(f"emulated hosts need NCCL >= 2.30 (RMA plugins, for jaxgin's host transport); found "
                    f"{install.version_string}: pip install \"nvidia-nccl-cu13>=2.30\"")


def _worker_gpu() -> int | None:
    """With JAXGIN_TEST_EMULATED_ONE_GPU=1 under pytest-xdist: the GPU of this worker (workers
    take the GPUs round-robin), on which each of its emulated-hosts jobs of one rank per host
    runs whole, as it would on a machine with one GPU. None otherwise."""
    if os.environ.get("JAXGIN_TEST_EMULATED_ONE_GPU") != "1" or not VISIBLE_GPUS:
        return None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return VISIBLE_GPUS[int(worker.removeprefix("gw")) % len(VISIBLE_GPUS)]


def emulated_env(rank: int, ranks_per_host: int = 1) -> dict:
    """The environment of rank `rank` of an emulated-hosts job: a host id of its own (shared by
    `ranks_per_host` consecutive ranks, which then reach each other over NVLink: they sit on
    different GPUs), one GPU (ranks spread round-robin over the visible GPUs, or all on the
    worker's GPU: _worker_gpu), GIN through the host transport (forced for every peer when each
    rank is a host of its own), and no XLA memory pool taken up front (ranks share GPUs)."""
    pinned = _worker_gpu() if ranks_per_host == 1 else None
    gpu = pinned if pinned is not None else VISIBLE_GPUS[rank % GPUS] if GPUS else 0
    host = f"emuhost{rank // ranks_per_host}"
    if ranks_per_host > max(GPUS, 1):
        raise ValueError(f"ranks_per_host={ranks_per_host}: a host's ranks need a GPU each, and there are {GPUS}")
    return {
        "CUDA_VISIBLE_DEVICES": str(gpu),
        "JAXGIN_TEST_LOCAL_DEVICE": "0",
        "JAXGIN_TEST_PHYSICAL_GPU": str(gpu),
        "JAXGIN_TEST_EMULATED_HOSTS": "1",
        "JAXGIN_TEST_RANKS_PER_HOST": str(ranks_per_host),
        "NCCL_HOSTID": host,
        "JAXGIN_TRANSPORT_HOST_ID": host,
        "NCCL_SOCKET_IFNAME": "lo",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "JAXGIN_FORCE_GIN": "1" if ranks_per_host == 1 else "0",
        "JAXGIN_GIN_TRANSPORT": "host",
        "JAXGIN_TRANSPORT_QUIET": "1",
        "JAXGIN_TEST_HEAP": os.environ.get("JAXGIN_TEST_HEAP", EMULATED_HEAP),
        **unkind_transport_env(),
    }


def unkind_transport_env() -> dict:
    """The host transport of every emulated job as unkind as NCCL's GIN rules allow (every behaviour,
    jaxgin.transport.UNKIND_BEHAVIOURS), seeded per test so that a round covers several seeds (1 to
    3) and numbers of GIN contexts (4, the default, 1, 3 or 8); JAXGIN_TRANSPORT_UNKIND,
    JAXGIN_TRANSPORT_SEED and JAXGIN_GIN_CONTEXTS set for pytest win (`none`: the kind transport)."""
    pick = zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "job").split(" ")[0].encode())
    return {"JAXGIN_TRANSPORT_UNKIND": os.environ.get("JAXGIN_TRANSPORT_UNKIND", "all"),
            "JAXGIN_TRANSPORT_SEED": os.environ.get("JAXGIN_TRANSPORT_SEED", str(1 + pick % 3)),
            "JAXGIN_GIN_CONTEXTS": os.environ.get("JAXGIN_GIN_CONTEXTS", str((4, 1, 3, 8)[pick // 3 % 4]))}


def scenario_env(gpus: int, xla_flags: str | None = None) -> dict:
    """A scenario's environment: this one without what would change what the scenario checks
    (JAX's platform, XLA flags, and a case selection left from diagnosing, JAXGIN_TEST_CASES,
    which a test that means it passes in `env`)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS", "JAXGIN_TEST_CASES")}
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, VISIBLE_GPUS[:gpus] or range(gpus)))
    env.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared machines
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    return env


def keep_outputs(finished) -> None:
    """The whole output of every rank of a job in which some rank exited non-zero, under
    JAXGIN_RESULTS_DIR/nonzero-exit/<test>/ (expected in the fault tests): pytest shows only a
    digest, and only once the session ends, which a GPU round may not reach."""
    folder = _results_path("nonzero-exit")
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for rank, (code, out, err) in enumerate(finished):
        Path(folder, f"rank{rank}.out").write_text(f"exit code {code}\n{out}")
        Path(folder, f"rank{rank}.err").write_text(err)


def _results_path(kind: str) -> Path | None:
    """JAXGIN_RESULTS_DIR/<kind>/<the running test, as a file name>, or None outside a GPU round."""
    directory = os.environ.get("JAXGIN_RESULTS_DIR")
    if not directory:
        return None
    test = os.environ.get("PYTEST_CURRENT_TEST", "job").split(" ")[0]
    return Path(directory, kind, "".join(c if c.isalnum() or c in "-_.[]" else "_" for c in test))


def _drain(pipe, sink: list, copy: Path | None = None) -> None:
    """Reads `pipe` to its end into `sink`; with `copy`, each line also goes to that file as it comes."""
    out = open(copy, "a") if copy else None
    try:
        for line in iter(pipe.readline, ""):
            sink.append(line)
            if out:
                out.write(line)
                out.flush()
    finally:
        if out:
            out.close()


def record(name: str, result: dict) -> None:
    directory = os.environ.get("JAXGIN_RESULTS_DIR")
    if directory:
        Path(directory, f"{name}.json").write_text(json.dumps(result, indent=1))


def result(stdout: str) -> dict:
    """A scenario's RESULT (job.report), which must have run on GPUs through jaxgin's CUDA backend:
    with JAX on CPU a scenario compares jax.lax with itself and would pass."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT:")]
    assert lines, f"scenario printed no result:\n{stdout[-4000:]}"
    found = json.loads(lines[-1][len("RESULT:"):])
    ran_on = found.get("ran_on", {})
    assert ran_on.get("jax_platform") == "gpu" and ran_on.get("jaxgin_cuda_backends"), (
        f"the scenario did not run on jaxgin's CUDA backend: {ran_on or 'no ran_on in its result'}")
    return found


def run_scenario(script: Path, args, gpus: int, timeout: float = 600, xla_flags: str | None = None,
                 env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, str(script), *args], env={**scenario_env(gpus, xla_flags), **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        keep_outputs([(proc.returncode, proc.stdout, proc.stderr)])
    assert proc.returncode == 0, (f"scenario {args} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                                  f"{first_causes(proc.stderr)}{proc.stderr[-8000:]}")
    return result(proc.stdout)


def first_causes(stderr: str, keep: int = 20) -> str:
    """jaxgin's own lines (fault lines, transport notes) and Python's exception lines from the whole
    of `stderr`: a crash's first cause comes early and the teardown noise after it (XLA's
    CUDA_ERROR_LAUNCH_FAILED lines, nanobind's leak report) fills the tail a failure message keeps."""
    lines = [line for line in stderr.splitlines()
             if line.startswith(("jaxgin", "Traceback", "RuntimeError", "jax.errors", "jaxlib")) or "Error:" in line[:60]]
    return ("first causes (from the whole stderr):\n" + "\n".join(lines[:keep]) + "\n...\n") if lines else ""


def start_processes(script: Path, args, world: int, timeout: float = 600, env: dict | None = None,
                    emulated: bool = False, xla_flags: str | None = None, ranks_per_host: int = 1):
    """The scenario in `world` processes (jax.distributed on localhost), each given `RANK WORLD
    ADDR` after `args`: one GPU each, or with `emulated`, emulated hosts of `ranks_per_host` ranks
    (emulated_env).
    Returns [(returncode, stdout, stderr)] per rank; ranks still running at `timeout` print their
    stacks (_print_stacks) and are killed, and the others are still collected."""
    port = free_port()
    if emulated:
        xla_flags = f"{xla_flags or ''} {EMULATED_XLA_FLAGS}".strip()
    base = scenario_env(world, xla_flags)  # an emulated rank's own CUDA_VISIBLE_DEVICES replaces it
    base["JAXGIN_TEST_JOB_DIR"] = tempfile.mkdtemp(prefix="jaxgin-job-")  # job.meet's files
    procs = []
    for r in range(world):
        rank_env = {**base, **(emulated_env(r, ranks_per_host) if emulated else {}), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script), *args, str(r), str(world), f"127.0.0.1:{port}"],
                                      env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    # Every pipe is drained by a thread of its own from the start: a rank whose pipe filled up
    # would block in its write and look hung (XLA logs a lot once a context is broken). Rank 0's
    # output also goes, line by line, to JAXGIN_RESULTS_DIR/progress/: the scenarios print each
    # case's row as it finishes, which is all that is left of a job that a round's end cuts off.
    progress = _results_path("progress")
    if progress is not None:
        progress.parent.mkdir(parents=True, exist_ok=True)
        progress = progress.with_name(progress.name + ".log")
    outputs = [{"out": [], "err": []} for _ in procs]
    readers = [threading.Thread(target=_drain, args=(f, outputs[r][key], progress if (r, key) == (0, "out") else None),
                                daemon=True)
               for r, p in enumerate(procs) for key, f in (("out", p.stdout), ("err", p.stderr))]
    for t in readers:
        t.start()
    deadline = time.monotonic() + timeout
    hung = []
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung = [q for q in procs if q.poll() is None]
                _print_stacks(hung)
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        shutil.rmtree(base["JAXGIN_TEST_JOB_DIR"], ignore_errors=True)
    for t in readers:
        t.join(timeout=10)
    note = f"\n[harness: still running after {timeout:.0f} s: stacks printed above, then killed]"
    outputs = [("".join(o["out"]), "".join(o["err"]) + (note if p in hung else "")) for p, o in zip(procs, outputs)]
    finished = [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]
    if any(code != 0 for code, _, _ in finished):
        keep_outputs(finished)
    return finished


def _print_stacks(running) -> None:
    """Before a hung job is killed: every thread's native stack (SIGUSR2, when GPU rounds preload
    tools/native_backtrace.c; without it SIGUSR2 would kill) and then Python's (SIGABRT, which
    PYTHONFAULTHANDLER=1 turns into a dump of every thread) into each rank's stderr, so that a hang
    says where each rank waited."""
    if not running:
        return
    if "native_backtrace" in os.environ.get("LD_PRELOAD", ""):
        threads = 0
        for p in running:
            threads = max(threads, _thread_count(p.pid))
            p.send_signal(signal.SIGUSR2)
        # The dumper visits one thread every 50 ms; the last-made threads (NCCL's, the transport's)
        # are the ones that matter, so every thread gets its turn before the SIGABRT below.
        time.sleep(min(1 + 0.06 * threads, 30))
    if os.environ.get("PYTHONFAULTHANDLER"):
        for p in running:
            if p.poll() is None:
                p.send_signal(signal.SIGABRT)
        time.sleep(2)


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def run_processes(script: Path, args, world: int, timeout: float = 600, emulated: bool = False,
                  xla_flags: str | None = None, env: dict | None = None, ranks_per_host: int = 1) -> list[dict]:
    """start_processes, every process expected to succeed; their RESULT lines."""
    finished = start_processes(script, args, world, timeout, env=env, emulated=emulated, xla_flags=xla_flags,
                               ranks_per_host=ranks_per_host)
    failed = [rank for rank, (code, _, _) in enumerate(finished) if code != 0]
    assert not failed, "\n".join(f"process {rank} of {world} failed ({finished[rank][0]}):\n{finished[rank][1][-2000:]}\n"
                                 f"{digest(finished[rank][2])}" for rank in failed)
    return [result(out) for _, out, _ in finished]


def results_after_a_fault(finished, must_name: tuple[str, ...]) -> tuple[list[dict], list[int]]:
    """For jobs whose every rank meets a device fault: the RESULT of each rank that printed one,
    and the ranks jaxgin's fault watch ended instead. XLA may have queued a rank's whole program
    before its kernel trapped and then wait for a completion that a CUDA context in error never
    signals; the fault watch ends such a rank with FAULT_EXIT_CODE after printing the fault. Such a
    rank counts only if its stderr says so and names the fault (every text in `must_name`)."""
    from jaxgin.fault_watch import FAULT_EXIT_CODE

    results, ended = [], []
    for rank, (code, out, err) in enumerate(finished):
        if "RESULT:" in out:
            results.append(result(out))
            continue
        assert code == FAULT_EXIT_CODE and "still waits for device results" in err, (rank, code, digest(err))
        for text in must_name:
            assert text in err, (rank, text, digest(err))
        ended.append(rank)
    return results, ended


# Lines XLA repeats by the hundred once a context is broken or a peer is gone: they hide the cause.
_NOISE = ("Failed to unload module", "destroying CUDA event", "Stream not idle on destroy", "Failed to destroy CUDA stream",
          "=== Source Location Trace", "cuda_status.cc", "grpc_util.h", "GRPC error information", "Stream removed",
          "absl::", "std::_Function_handler", "tsl::", "(unknown)", "coordination_service")


def digest(stderr: str, lines: int = 60) -> str:
    """A failed process's stderr without XLA's repeated teardown noise: its first and last lines."""
    kept = [line for line in stderr.splitlines() if line.strip() and not any(n in line for n in _NOISE)]
    if len(kept) > 2 * lines:
        kept = kept[:lines] + [f"[... {len(kept) - 2 * lines} lines ...]"] + kept[-lines:]
    return "\n".join(kept)


def went_through_transport(result: dict, *, mapped: bool) -> None:
    """A transport_scenarios.py result ran with every peer forced through GIN and jaxgin's host
    transport carried the traffic: by CUDA IPC copies (`mapped`), or staged through TCP only."""
    info = result["transport_info"]
    assert info["gin_type"] == "proxy" and info["gin_transport"] == "host" and info["force_gin"], info
    counters = result["transport"]
    assert counters["signals_applied"] > 0, counters
    if mapped:
        assert counters["bytes_mapped"] > 0, counters  # CUDA IPC copies carried the data
    else:
        assert counters["bytes_staged"] > 0 and counters["bytes_mapped"] == 0, counters  # TCP carried it


def selected(items: list) -> list:
    """`items` (a scenario's cases), or only those at the indices in $JAXGIN_TEST_CASES
    (comma-separated), for diagnosing one case outside the tests (tools/emulated_job.py)."""
    chosen = os.environ.get("JAXGIN_TEST_CASES", "")
    return [items[int(i)] for i in chosen.split(",")] if chosen else items


def folded_worst(call, init, *, calls: int, fold_every: int, axis_name: str):
    """jax.lax.fori_loop of `calls` steps worst = call(i, worst) inside shard_map over `axis_name`:
    each GPU keeps its own worst for `fold_every` calls, then one XLA collective (pmax) folds it
    over the GPUs. The scenario loops compare every call this way, so that XLA's collectives still
    interleave with the ops' kernels as in a model, without one per call."""
    import jax

    if calls % fold_every:
        raise ValueError(f"calls ({calls}) must be a multiple of fold_every ({fold_every})")

    def stretch(s, worst):
        local = jax.lax.pcast(worst, axis_name, to="varying")  # each GPU's own worst until the fold
        return jax.lax.pmax(jax.lax.fori_loop(s * fold_every, (s + 1) * fold_every, call, local), axis_name)

    return jax.lax.fori_loop(0, calls // fold_every, stretch, init)


def loop_fold(default: int) -> int:
    """How many loop calls run between the folds of the worst difference over the GPUs (each
    fold one XLA collective): `default`, or $JAXGIN_TEST_LOOP_FOLD for diagnosis (1: a collective
    after every call, which keeps the ranks in step)."""
    return int(os.environ.get("JAXGIN_TEST_LOOP_FOLD", default))


class PhaseClock:
    """Wall seconds per phase of a scenario, recorded with its results so that a round's time can be
    planned and cut where it goes (compiling, or running). Test durations only: ranks that share a
    GPU time-slice it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._mark = time.monotonic()

    def lap(self, phase: str) -> None:
        """Charges the time since the previous lap (or the start) to `phase`."""
        now = time.monotonic()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._mark, 2)
        self._mark = now


def transport_per_call(run, calls: int) -> dict:
    """What one call of run() puts through jaxgin's host transport from this process: the counters'
    growth over `calls` calls after a warm one (compiled and placed before counting), divided by
    `calls`, every process counting between the same two barriers. {"bytes", "puts", "signals"}."""
    import jax
    from jax.experimental import multihost_utils

    from jaxgin import transport

    def totals() -> dict:
        c = transport.counters()
        return {"bytes": c["bytes_mapped"] + c["bytes_staged"], "puts": c["puts_mapped"] + c["puts_staged"],
                "signals": c["signals_applied"]}

    jax.block_until_ready(run())
    multihost_utils.sync_global_devices("transport_per_call_before")
    before = totals()
    for _ in range(calls):
        jax.block_until_ready(run())
    multihost_utils.sync_global_devices("transport_per_call_after")
    after = totals()
    return {key: (after[key] - before[key]) / calls for key in after}


# Coordinator ports come from below Linux's ephemeral range (32768 on), which every other socket
# of a round (NCCL's bootstrap, the transport, other jobs' gRPC clients) draws from: a port picked
# there and released before JAX binds it was taken in between ("Address already in use", rank 0
# crashed in jax.distributed.initialize; 2 x H200, 2026-11-28).
_COORDINATOR_PORTS = range(20000, 32000)


def free_port() -> int:
    """A port no socket of this machine holds, on every address (JAX's coordinator binds [::] and
    0.0.0.0), from _COORDINATOR_PORTS."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    addresses = [(socket.AF_INET, "0.0.0.0")] + ([(socket.AF_INET6, "::")] if socket.has_ipv6 else [])
    for _ in range(200):
        port = rng.choice(_COORDINATOR_PORTS)
        if all(_bindable(family, address, port) for family, address in addresses):
            return port
    raise RuntimeError(f"no free port in {_COORDINATOR_PORTS}")


def _bindable(family, address: str, port: int) -> bool:
    try:
        with socket.socket(family) as s:
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((address, port))
        return True
    except OSError as e:
        # No IPv6 on this machine counts as free there; a port in use does not.
        return family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL


def run_mesh_check(check, axis_name: str) -> None:
    """A scenario script's entry point. argv `check` runs one process over every visible GPU;
    `check RANK WORLD COORDINATOR` is one process of a process-per-GPU job (run_processes). Calls
    check(mesh) on a 1-D mesh of all devices named `axis_name`, between jaxgin.initialize and
    finalize, and prints RESULT: {json} for result(). With JAXGIN_TEST_REPORT_ERROR=1 an exception
    from check is reported instead ({"error", "faults"}), for tests of refusals and faults."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxgin

    clock = PhaseClock()
    job.join(sys.argv[2:])
    heap = os.environ.get("JAXGIN_TEST_HEAP")
    jaxgin.initialize(**({"heap_size": heap} if heap else {}))
    clock.lap("join_and_initialize")
    if os.environ.get("JAXGIN_TEST_REPORT_ERROR") == "1":
        # The test expects the check to fail (a refusal, or a device fault): report how.
        try:
            report = {"error": "", "result": check(Mesh(np.array(jax.devices()), (axis_name,)))}
        except Exception as e:
            report = {"error": f"{type(e).__name__}: {e}"[:2000]}
        report["faults"] = jaxgin.device_faults()
        job.report(report)
        job.exit_together("report_error")
        os._exit(0)  # after a device fault the CUDA context is unusable: skip teardown
    report = check(Mesh(np.array(jax.devices()), (axis_name,)))
    clock.lap("check")
    jaxgin.finalize()
    clock.lap("finalize")
    report["phase_seconds"] = clock.seconds
    job.report(report)
