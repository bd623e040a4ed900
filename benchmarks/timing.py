"""How every benchmark here times a jitted program: WARMUP_CALLS calls (compilation, and XLA's
recording of its command buffers), then the best of `repeats` calls, each waited for. Programs put
their N dependent calls inside one jit, so the time is device time, and callers divide by N."""

from __future__ import annotations

import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax


# Calls before a timed or profiled one. XLA records a program's command buffers again at its second
# call (custom calls captured anew, the graph instantiated again: 0.6-1.3 ms of host time per GPU,
# by each GPU's thread at its own pace), which would show as one GPU starting late.
WARMUP_CALLS = 2


def _warm_up(f, *args):
    """WARMUP_CALLS calls of f, each waited for; the last one's result."""
    for _ in range(WARMUP_CALLS):
        result = jax.block_until_ready(f(*args))
    return result


def handler_calls() -> int:
    """jaxgin's FFI handler runs so far in this process, all targets (a replayed graph runs none)."""
    import jaxgin

    return sum(jaxgin.runtime.current().backend_lib.ffi_calls().values())


def handler_runs(f, *args, calls: int) -> list[int]:
    """jaxgin's handler runs in each of `calls` calls of f, each waited for: XLA records its graphs
    (running the handlers) in the first calls and replays them after."""
    runs = []
    for _ in range(calls):
        before = handler_calls()
        jax.block_until_ready(f(*args))
        runs.append(handler_calls() - before)
    return runs


def best_seconds(f, *args, repeats: int) -> float:
    _warm_up(f, *args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - start)
    return best


def _trace_events(trace_dir: Path) -> list[dict]:
    """Every event of the Perfetto trace that jax.profiler.trace(..., create_perfetto_trace=True)
    wrote under trace_dir."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz")) or sorted(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    if not files:
        raise RuntimeError(f"no trace under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _gpu_stream_events(events: list[dict], pids: list[int]) -> list[dict]:
    """Complete events ('X') on the stream lines of the processes `pids`, by start time. A device's
    stream lines hold the kernels and copies; its "XLA Ops" / "XLA Modules" lines repeat them by
    HLO name."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in pids}
    streams = {key for key, name in threads.items() if name.lower().startswith("stream")} or set(threads)
    return sorted((e for e in events if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams),
                  key=lambda e: e["ts"])


def _gpu_pids(events: list[dict]) -> dict[int, int]:
    """GPU index -> the trace's process id for it ("/device:GPU:N")."""
    found = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = e["args"]["name"]
            if "GPU:" in name and name.rsplit("GPU:", 1)[1].isdigit():
                found[int(name.rsplit("GPU:", 1)[1])] = e["pid"]
    return found


def device_events(trace_dir: Path) -> list[dict]:
    """Complete events ('X') of the first GPU's streams, by start time, from the trace under trace_dir."""
    events = _trace_events(trace_dir)
    gpus = _gpu_pids(events)
    if 0 in gpus:
        device = [gpus[0]]
    else:
        names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
        device = [pid for pid, name in names.items() if "device" in name.lower()][:1]
    return _gpu_stream_events(events, device)


def host_events(trace_dir: Path) -> list[dict]:
    """Complete events ('X') of the trace's host threads (every process but the GPUs'), by start time,
    each with its thread's name under "thread": what XLA's threads did while the GPUs ran."""
    events = _trace_events(trace_dir)
    gpus = set(_gpu_pids(events).values())
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return sorted(({**e, "thread": threads.get((e["pid"], e["tid"]), str(e["tid"]))} for e in events
                   if e.get("ph") == "X" and e.get("pid") not in gpus), key=lambda e: e["ts"])


def device_windows(trace_dir: Path) -> dict[int, tuple[float, float]]:
    """Per GPU of the trace under trace_dir: (its first stream event's start, its last one's end),
    in seconds on the trace's clock, which JAX's profiler shares between the GPUs of a process."""
    events = _trace_events(trace_dir)
    windows = {}
    for gpu, pid in sorted(_gpu_pids(events).items()):
        mine = _gpu_stream_events(events, [pid])
        if mine:
            windows[gpu] = (mine[0]["ts"] * 1e-6, max(e["ts"] + e["dur"] for e in mine) * 1e-6)
    if not windows:
        raise RuntimeError(f"the trace under {trace_dir} holds no GPU's stream events")
    return windows


def span_seconds(events: list[dict]) -> float:
    """From the first event's start to the last end, in seconds (trace times are microseconds)."""
    if not events:
        raise RuntimeError("the trace holds no device events")
    return (max(e["ts"] + e["dur"] for e in events) - events[0]["ts"]) * 1e-6


def _profiled_call(f, args, read):
    """read(trace folder) for one call of f profiled by JAX, after WARMUP_CALLS calls."""
    _warm_up(f, *args)
    with tempfile.TemporaryDirectory(prefix="device-trace-") as where:
        with jax.profiler.trace(where, create_perfetto_trace=True):
            jax.block_until_ready(f(*args))
        return read(Path(where))


def device_span_seconds(f, *args) -> float:
    """The first GPU's device span of one call of f (after the warm-up calls), from JAX's profiler:
    what the GPU took from its first kernel or copy to its last, without the host's launch and
    wait around them."""
    return span_seconds(_profiled_call(f, args, device_events))


def device_event_totals(f, *args) -> tuple[dict[str, dict], list[list]]:
    """GPU 0's kernels and copies in one call of f (after the warm-up calls): by name, how many ran
    and their summed duration in seconds (events on side streams overlap others, so the sum is
    not a span); and every event in start order as [name, start, duration, stream], in us from
    the first start (the stream is the trace's thread id)."""
    def read(where):
        events = device_events(where)
        totals = {}
        for e in events:
            total = totals.setdefault(e["name"], {"count": 0, "seconds": 0.0})
            total["count"] += 1
            total["seconds"] += e["dur"] * 1e-6
        t0 = events[0]["ts"] if events else 0
        return totals, [[e["name"], round(e["ts"] - t0, 1), round(e["dur"], 1), e["tid"]] for e in events]

    return _profiled_call(f, args, read)


def host_event_totals(f, *args, top: int = 15) -> list[list]:
    """The host's side of one call of f (after the warm-up calls): the `top` event names of the
    host threads by summed duration, each [name, count, summed us] (nested events each count: a
    launch inside XLA's thunk counts in both)."""
    def read(where):
        totals = {}
        for e in host_events(where):
            total = totals.setdefault(e["name"], [0, 0.0])
            total[0] += 1
            total[1] += e["dur"]
        ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
        return [[name, count, round(us, 1)] for name, (count, us) in ranked]

    return _profiled_call(f, args, read)


def step_cycle_seconds(events: list[dict], steps: int) -> float | None:
    """The median time from one step's start to the next's on GPU 0 in a chain of `steps` dependent
    steps (`events`: device_events of one run), clocked by a kernel or copy that runs k times a step
    (the smallest k; every k-th of its starts). What a step costs once the chain runs, without the
    run's fixed costs (the graph's launch, the GPUs' start skew). None when no name recurs so."""
    starts = {}
    for e in events:
        starts.setdefault(e["name"], []).append(e["ts"])
    clocks = sorted(((len(ts) // steps, ts) for ts in starts.values() if len(ts) >= steps and len(ts) % steps == 0),
                    key=lambda item: item[0])
    if not clocks or steps < 2:
        return None
    k, ts = clocks[0]
    every = ts[::k]
    return statistics.median(b - a for a, b in zip(every, every[1:])) * 1e-6


def device_step_seconds(f, *args, steps: int) -> tuple[float | None, float]:
    """(step_cycle_seconds, GPU 0's span / steps) of one call of f, a chain of `steps` steps (after
    the warm-up calls)."""
    def read(where):
        events = device_events(where)
        return step_cycle_seconds(events, steps), span_seconds(events) / steps

    return _profiled_call(f, args, read)


def device_windows_seconds(f, *args) -> dict[int, tuple[float, float]]:
    """Every GPU's (first start, last end) in one call of f (after the warm-up calls), in seconds from
    the earliest first start of any GPU: how much later each GPU began, and when each finished."""
    windows = _profiled_call(f, args, device_windows)
    t0 = min(start for start, _ in windows.values())
    return {gpu: (start - t0, end - t0) for gpu, (start, end) in windows.items()}


def best_seconds_threaded(f, x, *, repeats: int) -> float:
    """best_seconds for a program that donates its one argument and returns an array like it: each
    call takes the previous call's result, so the program finds the same buffers at every call
    (XLA then replays its recorded command buffers as they are, with no update for moved buffers,
    as in a training loop that donates its state)."""
    for _ in range(WARMUP_CALLS):
        x = jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - start)
    return best


def after(a, b):
    """`a` with its first element moved by 0 * b's first element, which XLA cannot prove to be
    zero: the next call, fed with the result, waits for the call that made `b`, and no call is
    loop-invariant (XLA hoists those out of the loop: a matmul of constant operands ran once in a
    loop of 50 with jax 0.12). `b` passes an optimization barrier, so that XLA cannot narrow the
    work that makes it to the one element read."""
    import jax.numpy as jnp

    b = jax.lax.optimization_barrier(b)
    moved = a.reshape(-1)[0].astype(jnp.float32) + b.reshape(-1)[0].astype(jnp.float32) * 0
    return a.at[(0,) * a.ndim].set(moved.astype(a.dtype))


def tied(a, b):
    """`a` plus 0 * b's first element, element by element: one small fusion and no copy for a small
    `a` (a chain's expert ids), where after() updates one element of a copy (two ops). As with
    after(), the next call waits for the call that made `b` and is not loop-invariant."""
    import jax.numpy as jnp

    b = jax.lax.optimization_barrier(b)
    return a + (b.reshape(-1)[0].astype(jnp.float32) * 0).astype(a.dtype)
