"""Where jaxgin.moe's time goes: a jitted chain of dispatches, and one of dispatch + combine pairs,
traced with JAX's profiler at benchmarks/moe.py's shapes. Prints, for the first GPU, the device
events of one call in order (start offset, duration, name) and each name's total over the chain, so
a change to the kernels can be judged by what it removes. With --out, each chain's folder also holds
XLA's optimized program (optimized_hlo.txt), to tell which op made an event.

With --blocks, the chains run once per JAXGIN_MOE_BLOCKS setting, and each setting's kernels are
summed up by their median and shortest run over the chain's calls, beside the chain's median step
cycle (benchmarks/timing.py): on one GPU no kernel waits for a peer, so the median is what the
kernel costs; on more, the shortest run is the nearest to a call that did not wait. --json writes
those figures.

It also prints how many jaxgin handlers ran in each of the first calls (XLA recording its graphs
runs them; a replayed graph does not), and with --host what XLA's threads did meanwhile. With
--trace-dispatch, the dispatch kernel's traced twin runs once more (per setting) and each GPU's
programs are summed up by when they reached each step (RECORD_WORDS).

    python tools/profile_moe.py [--tokens 128] [--fp8] [--host] [--out DIR]
    python tools/profile_moe.py --chains pair --blocks "2,1024,4,4;1,8192,8,4" --json FILE
    python tools/profile_moe.py --chains pair --trace-dispatch --json FILE

Needs an NVIDIA GPU visible to JAX and Triton (pip install -e ".[cuda]"); without them it says so
and exits with status 4 or 3 (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxgin
from jaxgin import cli
from jaxgin.moe._routing import LOW_LATENCY_MAX_TOKENS

# benchmarks/timing.py: tied (the benchmarks' way of making each call wait for the previous one), the
# trace reading and the handler runs
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import device_events, handler_runs, host_events, span_seconds, step_cycle_seconds, tied  # noqa: E402

STEPS = 8
HANDLER_COUNT_CALLS = 4
CHAINS = ("dispatch", "combine", "pair")


def host_report(device: list[dict], host: list[dict]) -> None:
    """What the host's threads did while GPU 0 ran the profiled call: their events by name (count,
    total us) within GPU 0's window, and those that overlap the middle tenth of it, beside GPU 0's
    events there, so a kernel that waited for its launch shows behind the host event that made it."""
    if not device:
        return
    start, end = device[0]["ts"], max(e["ts"] + e["dur"] for e in device)
    inside = [e for e in host if e["ts"] < end and e["ts"] + e["dur"] > start]
    totals = collections.defaultdict(lambda: [0, 0.0])
    for e in inside:
        totals[(e["thread"], e["name"])][0] += 1
        totals[(e["thread"], e["name"])][1] += e["dur"]
    print(f"   host events during GPU 0's {end - start:.1f} us: {len(inside)}")
    for (thread, name), (n, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:20]:
        print(f"   {total:10.1f} us  x{n:<5d} [{thread[:24]}] {name[:90]}")
    lo = start + (end - start) * 0.45
    hi = lo + (end - start) * 0.1
    merged = [("gpu", e) for e in device if lo <= e["ts"] < hi] + [("host", e) for e in inside if lo <= e["ts"] < hi]
    print("   the middle tenth, both sides (us from GPU 0's first event):")
    for side, e in sorted(merged, key=lambda item: item[1]["ts"])[:60]:
        where = "GPU 0" if side == "gpu" else e["thread"][:24]
        print(f"   +{e['ts'] - start:9.1f} {e['dur']:8.1f} us  {where:24s} {e['name'][:80]}")


def kernel_figures(events: list[dict], calls: int) -> dict:
    """Per event name that runs at least once a call: its runs, median and shortest duration (us);
    and the chain's median step cycle (us; None when no event clocks it)."""
    runs = collections.defaultdict(list)
    for e in events:
        runs[e["name"]].append(e["dur"])
    cycle = step_cycle_seconds(events, calls)
    return dict(step_cycle_us=None if cycle is None else round(cycle * 1e6, 2),
                kernels={name: dict(runs=len(d), median_us=round(statistics.median(d), 2), min_us=round(min(d), 2))
                         for name, d in runs.items() if len(d) >= calls})


def report(title: str, events: list[dict], calls: int) -> None:
    print(f"\n== {title}: {len(events)} device events over {calls} calls")
    if not events:
        return
    span = span_seconds(events) * 1e6
    print(f"   span {span:.1f} us, {span / calls:.1f} us per call")
    totals = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        totals[e["name"]][0] += 1
        totals[e["name"]][1] += e["dur"]
    for name, (n, total) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:15]:
        print(f"   {total / calls:8.1f} us/call  x{n / calls:<4.1f} {name[:110]}")
    per_call = max(1, len(events) // calls)
    middle = events[per_call * (calls // 2):per_call * (calls // 2 + 1)]  # one call from the middle
    t0 = middle[0]["ts"]
    print("   one call:")
    for e in middle:
        print(f"   +{e['ts'] - t0:8.1f} {e['dur']:8.1f} us  {e['name'][:100]}")


# the traced dispatch kernels' record words (_kernels.dispatch_routing_traced_kernel says what each marks)
RECORD_WORDS = ("start", "counts_posted", "routed", "counts_seen", "own_done", "zeroed", "placed", "end")


def dispatch_records(mesh, x, ids, weights, experts: int, capacity: int, calls: int = 3) -> tuple[np.ndarray, int]:
    """Every GPU's records of the dispatch kernel, traced ([GPUs, programs, 8] int64, RECORD_WORDS,
    by place in the start order), from the last of `calls` calls; and how many of the first places
    send (the rest place). Up to LOW_LATENCY_MAX_TOKENS tokens the kernel that routes, above them
    the one that reads the routing kernels' arrays."""
    from jaxgin import op_support
    from jaxgin.ffi import axes as axes_lib
    from jaxgin.moe import _routing, exchange

    senders = {}

    def call(x, ids, w):
        names = axes_lib.axis_names("ep", exchange.DISPATCH)
        plan = _routing.make_plan(exchange.DISPATCH, names, mesh.size, x, ids, experts, capacity, "auto")
        x, ids, w = op_support.same_varying(names, x, ids, w)
        state = op_support.kernel_state()
        senders["NS"] = exchange._dispatch_launch(state, plan, False,
                                                  routing=exchange.routes_in_kernel(state, plan))["NS"]
        outs = exchange.dispatch_routing_kernel(state, x, w.astype(jnp.float32), ids.astype(jnp.int32), plan,
                                                trace=True)
        return outs[0], outs[-1]

    spec = P("ep")
    traced = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec)))
    for _ in range(calls):
        _, records = traced(x, ids, weights)
    return np.asarray(records).reshape(mesh.size, -1, 16).view(np.int64), senders["NS"]


def dispatch_trace_summary(records: np.ndarray, senders: int) -> dict:
    """One GPU's records as us from its first program's start: each word's median and latest over
    the senders and over the placers (counts_posted: place 0's)."""
    t0 = records[:, 0].min()

    def spread(values):
        us = (values - t0) / 1e3
        return dict(median=round(float(np.median(us)), 2), max=round(float(us.max()), 2)) if len(us) else None

    out = dict(span_us=round(float((records[:, 7].max() - t0) / 1e3), 2), programs=len(records), senders=senders,
               counts_posted_us=round(float((records[0, 1] - t0) / 1e3), 2))
    for role, rows in (("senders", records[:senders]), ("placers", records[senders:])):
        out[role] = {word: spread(rows[:, i]) for i, word in enumerate(RECORD_WORDS) if word != "counts_posted"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--fp8", action="store_true", help="dispatch with fp8=True (rows cross as e4m3)")
    parser.add_argument("--out", default=None, help="keep the traces here (default: a temporary folder)")
    parser.add_argument("--chains", default=",".join(CHAINS), help=f"comma-separated, of {', '.join(CHAINS)}")
    parser.add_argument("--blocks", default=None,
                        help="semicolon-separated JAXGIN_MOE_BLOCKS settings 'tokens,hidden,warps,senders' to compare")
    parser.add_argument("--json", default=None, help="write every setting's kernel figures to this file")
    parser.add_argument("--trace-dispatch", action="store_true",
                        help="also the dispatch kernel traced (per --blocks setting): when each of its programs "
                             "reached each step (RECORD_WORDS), summed up per GPU")
    parser.add_argument("--host", action="store_true",
                        help="also what the host's threads did during each profiled chain (XLA's launches, "
                             "jaxgin's handlers), beside the GPU's events")
    args = parser.parse_args()
    chains = args.chains.split(",")
    if not chains or set(chains) - set(CHAINS):
        parser.error(f"--chains {args.chains!r}: expected a comma-separated subset of {', '.join(CHAINS)}")
    cli.require_gpus(__file__, 1, "it profiles jaxgin.moe's kernels")
    cli.require(__file__, "triton", why="jaxgin.moe's kernels", install='-e ".[cuda]"')
    devices = jax.devices()
    cli.run(__file__, jaxgin.initialize, heap_size=max(1 << 30, 5 * len(devices) * args.tokens * args.hidden * 2))
    mesh = Mesh(np.array(devices), ("ep",))
    n, t, e, k = mesh.size, args.tokens, args.experts, args.top_k
    spec = P("ep")
    sharding = NamedSharding(mesh, spec)
    keys = jax.random.split(jax.random.key(t), 2)
    x = jax.device_put(jax.random.normal(keys[0], (n * t, args.hidden), jnp.float32).astype(jnp.bfloat16), sharding)
    logits = jax.device_put(jax.random.normal(keys[1], (n * t, e), jnp.float32), sharding)
    weights, ids = jax.jit(lambda v: jaxgin.moe.router(v, k))(logits)
    capacity = -(-t * k * 5 // 4)

    def dispatch(x, ids, w):
        return jaxgin.moe.dispatch(x, ids, w, num_experts=e, axis_name="ep", capacity=capacity, fp8=args.fp8)

    # Each call's expert ids are tied to the previous call's output, so that every call routes, as
    # in a layer (loop-invariant ids would be routed once, before the loop); x stays as it is (an
    # update would copy it each call), as in benchmarks/moe.py.
    def dispatches(x, ids, w):
        return jax.lax.fori_loop(0, STEPS, lambda _, i: tied(i, dispatch(x, i, w).x), ids, unroll=True)

    def pairs(x, ids, w):
        # as benchmarks/moe.py's pairs: combine's output is the next x, nothing runs between pairs
        # (ids tied to it only where the routing runs before the dispatch kernel)
        def step(_, carry):
            a, i = carry
            sent = dispatch(a, i, w)
            y = jaxgin.moe.combine(sent.x, sent.handle)
            return y, (tied(i, y) if t > LOW_LATENCY_MAX_TOKENS else i)

        return jax.lax.fori_loop(0, STEPS, step, (x, ids), unroll=True)[0]

    def combines(x, ids, w):
        sent = dispatch(x, ids, w)

        def step(_, handle):  # the rows stay; the next call's weights are tied to this call's output
            return dataclasses.replace(handle, weights=tied(handle.weights, jaxgin.moe.combine(sent.x, handle)))

        return jax.lax.fori_loop(0, STEPS, step, sent.handle, unroll=True).weights[0]

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="profile-moe-"))
    bodies = {"dispatch": dispatches, "combine": combines, "pair": pairs}
    titles = {"dispatch": "dispatch", "combine": "combine", "pair": "dispatch + combine"}
    figures, traces = [], []
    for setting in (args.blocks.split(";") if args.blocks else [None]):
        if setting:
            os.environ["JAXGIN_MOE_BLOCKS"] = setting
            print(f"\nJAXGIN_MOE_BLOCKS={setting}", flush=True)
        for name in chains:
            # compiled once: what runs below, and whose optimized HLO is kept beside the trace (which
            # HLO op made each device event)
            f = jax.jit(jax.shard_map(bodies[name], mesh=mesh, in_specs=(spec,) * 3,
                                      out_specs=spec)).lower(x, ids, weights).compile()
            runs = handler_runs(f, x, ids, weights, calls=HANDLER_COUNT_CALLS)  # the first loads every kernel
            where = out / (setting or "default").replace(",", "_") / name
            where.mkdir(parents=True, exist_ok=True)
            (where / "optimized_hlo.txt").write_text(f.as_text())
            with jax.profiler.trace(str(where), create_perfetto_trace=True):
                jax.block_until_ready(f(x, ids, weights))
            events = device_events(where)
            report(f"{titles[name]}{' (fp8 dispatch)' if args.fp8 else ''}, {t} tokens/GPU, {n} GPUs", events, STEPS)
            print(f"   jaxgin handler calls in each of the first {HANDLER_COUNT_CALLS} calls: {runs}")
            if args.host:
                host_report(events, host_events(where))
            row = dict(blocks=setting, chain=name, **kernel_figures(events, STEPS))
            print("   " + json.dumps(row), flush=True)
            figures.append(row)
        if args.trace_dispatch:
            records, senders = dispatch_records(mesh, x, ids, weights, e, capacity)
            traces.append(dict(blocks=setting, senders=senders,
                               gpus=[dispatch_trace_summary(r, senders) for r in records],
                               gpu0_records=(records[0] - records[0, :, 0].min()).tolist()))
            print("\n== dispatch kernel traced (us from each GPU's first program start)")
            for g, summary in enumerate(traces[-1]["gpus"]):
                print(f"   GPU {g}: " + json.dumps(summary), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(dict(device=devices[0].device_kind, devices=n, jax=jax.__version__,
                                                   tokens=t, hidden=args.hidden, experts=e, top_k=k, fp8=args.fp8,
                                                   calls_per_chain=STEPS, figures=figures,
                                                   dispatch_traces=traces), indent=1))
        print(f"wrote {args.json}")
    jaxgin.finalize()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
