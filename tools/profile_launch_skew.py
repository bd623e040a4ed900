"""When each GPU starts a chained program, and what its host thread did before: benchmarks/fused.py's
chains (STEPS dependent calls in one jit) profiled once each with JAX's profiler. For every chain it
prints each GPU's first kernel start relative to the earliest, and, per host thread, the events
that began before the last GPU's first kernel (name, start relative to the earliest GPU start,
duration), so a late GPU can be traced to the host step that held its launches back. One call
warms up, so the first profiled run is the program's second call, at which XLA records its command
buffers again (benchmarks/timing.py's WARMUP_CALLS). The first run's traces are kept under --out
(one .trace.json.gz per chain) for a closer look.

    python tools/profile_launch_skew.py [--m 4096 --k 7168 --n 2048] [--chains xla_matmul,triton_matmul,...]

Needs 2 or more NVIDIA GPUs visible to JAX (pip install -e ".[cuda]"); without them it says so and
exits with status 4 (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh

import jaxgin
from jaxgin import cli
from jaxgin.fused import _common

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from fused import ROWS, _chain, _operands, xla_matmul_all_to_all
from timing import _gpu_pids, _gpu_stream_events, _trace_events


def chains(tiles, precision) -> dict:
    """name -> the per-shard op that benchmarks/fused.py chains."""
    return {
        "xla_matmul": lambda x, w: x @ w,
        "triton_matmul": lambda x, w: _common.matmul(x, w, tiles, precision),
        "xla_matmul_all_to_all": xla_matmul_all_to_all,
        "chunked_all_to_all": lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", method="chunked"),
        "triton_all_to_all": lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", method="triton"),
    }


def host_threads(events: list[dict]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> "process / thread" for every thread of a process that is not a GPU."""
    gpu_pids = set(_gpu_pids(events).values())
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    return {(e["pid"], e["tid"]): f"{processes.get(e['pid'], e['pid'])} / {e['args']['name']}" for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] not in gpu_pids}


def summary(events: list[dict], host_events_per_thread: int) -> dict:
    """Each GPU's first start (us after the earliest GPU start) and, per host thread, its events that
    began before the last GPU started (from the earliest host event of the call on)."""
    firsts = {}
    for gpu, pid in sorted(_gpu_pids(events).items()):
        mine = _gpu_stream_events(events, [pid])
        if mine:
            firsts[gpu] = (mine[0]["ts"], mine[0].get("name", ""))
    t0 = min(ts for ts, _ in firsts.values())
    last_start = max(ts for ts, _ in firsts.values())
    threads = host_threads(events)
    host = {}
    for key, name in threads.items():
        mine = sorted((e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) == key
                       and e["ts"] <= last_start), key=lambda e: e["ts"])
        if mine:
            host[name] = [[round(e["ts"] - t0, 1), round(e.get("dur", 0.0), 1), e.get("name", "")[:100]]
                          for e in mine[-host_events_per_thread:]]
    return {"gpu_first_start_us": {str(g): [round(ts - t0, 1), name[:100]] for g, (ts, name) in firsts.items()},
            "host_events_before_last_gpu_start": host}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=4096)
    parser.add_argument("--k", type=int, default=7168)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chains", default="xla_matmul,triton_matmul,xla_matmul_all_to_all,chunked_all_to_all,"
                        "triton_all_to_all")
    parser.add_argument("--host-events", type=int, default=40, help="host events kept per thread (the last ones)")
    parser.add_argument("--runs", type=int, default=2, help="profiled runs per chain")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cli.require_gpus(__file__, 2, "it profiles the fused ops' chains between them")
    cli.run(__file__, jaxgin.initialize)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    dtype = jax.numpy.dtype(args.dtype)
    out = args.out or Path(tempfile.mkdtemp(prefix="launch-skew-"))
    out.mkdir(parents=True, exist_ok=True)
    precision = _common.dot_precision(dtype, None)
    tiles = _common.choose_tiles(jaxgin.runtime.current(), args.m, args.n, args.k, dtype, precision, None, "wide_first")
    x, w = _operands(mesh, jax.random.split(jax.random.key(0)), args.m, args.k, args.n, dtype)
    ops = chains(tiles, precision)
    report = {"m": args.m, "k": args.k, "n": args.n, "dtype": args.dtype, "chains": {}}
    for name in args.chains.split(","):
        chain = _chain(mesh, ops[name], ROWS)
        jax.block_until_ready(chain(x, w))
        runs = []
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="trace-") as where:
                with jax.profiler.trace(where, create_perfetto_trace=True):
                    jax.block_until_ready(chain(x, w))
                files = sorted(Path(where).rglob("*.trace.json.gz"))
                if run == 0 and files:
                    shutil.copy(files[-1], out / f"{name}.trace.json.gz")
                runs.append(summary(_trace_events(Path(where)), args.host_events))
        report["chains"][name] = runs
        print(name, [r["gpu_first_start_us"] for r in runs], flush=True)
    (out / "launch_skew.json").write_text(json.dumps(report, indent=1))
    print(f"wrote {out / 'launch_skew.json'}")


if __name__ == "__main__":
    main()
