"""One emulated-hosts job outside pytest, for diagnosis: every rank's whole stdout and stderr kept.

    python3 tools/emulated_job.py --world 2 --graphs --env JAXGIN_TRANSPORT_TRACE=1 \
        --out /tmp/job tests/gpu/transport_scenarios.py iterations

Writes rank<R>.out / rank<R>.err and summary.json (exit codes, seconds, RESULT lines) under --out.
Ranks are started exactly as the GPU tests start them (tests/gpu/harness.py, emulated=True).
--stacks-after T (repeatable) sends SIGUSR2 to every rank still running T seconds after the start:
with tools/native_backtrace.c preloaded (as GPU rounds do) each rank then prints every thread's
native stack into its stderr and goes on (the GPU machines have no gdb, and cuda-gdb could not
attach there).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))

import harness  # noqa: E402

COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def _ranks_running() -> dict[int, int]:
    """rank -> pid of this process's children (their command lines end in RANK WORLD ADDR)."""
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and len(argv) >= 3 and argv[-3].isdigit():
            ranks[int(argv[-3])] = int(entry.name)
    return ranks


def _dump_stacks(times: list[float], start: float) -> None:
    for t in sorted(times):
        time.sleep(max(0.0, start + t - time.monotonic()))
        for pid in _ranks_running().values():
            try:
                os.kill(pid, signal.SIGUSR2)
            except ProcessLookupError:
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--graphs", action="store_true", help="XLA command buffers capture the custom calls")
    parser.add_argument("--xla-flags", default="", help="more XLA flags")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--stacks-after", type=float, action="append", default=[], metavar="SECONDS")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs="*")
    a = parser.parse_args()
    env = {}
    for item in a.env:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--env wants NAME=VALUE, got {item!r}")
        env[name] = value
    flags = " ".join(f for f in (COMMAND_BUFFERS if a.graphs else "", a.xla_flags) if f) or None
    a.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    if a.stacks_after:
        threading.Thread(target=_dump_stacks, args=(a.stacks_after, start), daemon=True).start()
    finished = harness.start_processes(a.script, a.args, a.world, a.timeout, env=env, emulated=True, xla_flags=flags)
    seconds = time.monotonic() - start
    summary = {"world": a.world, "args": a.args, "env": env, "xla_flags": flags, "seconds": round(seconds, 1),
               "exit_codes": [code for code, _, _ in finished], "results": []}
    for rank, (code, out, err) in enumerate(finished):
        (a.out / f"rank{rank}.out").write_text(out)
        (a.out / f"rank{rank}.err").write_text(err)
        lines = [line[len("RESULT:"):] for line in out.splitlines() if line.startswith("RESULT:")]
        summary["results"].append(json.loads(lines[-1]) if lines else None)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("world", "args", "seconds", "exit_codes")}))
    return 0 if all(code == 0 for code, _, _ in finished) else 1


if __name__ == "__main__":
    sys.exit(main())
