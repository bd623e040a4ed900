"""MoE dispatch / combine: jaxgin.moe vs the same exchange on jax.lax.ragged_all_to_all, same process,
same routing.

    python benchmarks/moe.py [--out DIR] [--tokens 128,4096] [--hidden 7168] [--experts 256] [--top-k 8]

Needs 1 or more NVIDIA GPUs visible to JAX in this process (with one, every entry is local: the
HBM side alone) and Triton (both from pip install -e ".[cuda]"); without them it says so and
exits with status 4 (too few GPUs) or 3 (a missing package), as every script here does (jaxgin.cli).

DeepSeek-V3-like defaults: hidden 7168, 256 experts, top-8, bfloat16, 128 tokens per GPU (low
latency) and 4096 (high throughput). Per token count, per GPU:
  jaxgin_dispatch / jaxgin_combine    jaxgin.moe.dispatch / combine (routing arithmetic included)
  jaxgin_dispatch_fp8                 jaxgin.moe.dispatch(fp8=True) (quantizing and dequantizing included;
                                      hidden a multiple of 128)
  jaxgin_pair                         dispatch then combine of its output, back to back
  ragged_dispatch / ragged_combine    jaxgin.moe.ragged.dispatch / combine (ragged_all_to_all)
  xla_all_to_all_same_bytes           jax.lax.all_to_all moving as many bytes to each peer as
                                      dispatch sends remotely, for scale
  xla_gather_same_rows                XLA gathering `capacity` rows of x: the HBM writes of
                                      dispatch's output layout alone, for scale (one GPU too)
  routing_only / routing_xla          dispatch's routing arithmetic alone: the routing kernels
                                      (up to 256 tokens what dispatch does inside its kernel, above
                                      what it runs before it) / as XLA's fusions
Effective bandwidth: bytes a GPU sends to other GPUs (one row per token and destination GPU) over
the time, next to the NVLink ceiling measured the same way (a peer-to-peer copy, GPU 0 -> 1).

Timing: one jitted, unrolled fori_loop of STEPS calls (no loop control between calls), each
call's input depending on the previous output and routing again: a dispatch's next expert ids (a
combine's next routing weights) are tied to its output by one small fusion, x (the rows) left as
it is, and a pair's next x is its own output, with no op between the pairs; best of REPEATS runs / STEPS
(times_us). Up to 256 tokens also a chain of 2 x STEPS: the difference per added call
(per_call_us) and what is left of a run of STEPS (per_program_run_us: launching the program and
waiting for it, spread over the calls in times_us; for combine also the dispatch feeding its chain).
device_span_us: the first GPU's span per call of the STEPS chain in JAX's profiler, from its first
kernel or copy to its last (the gaps between them included, the host's launch and wait not);
every row but the ragged_* ones (--no-device-span: none), with that call's kernels and copies by
name (device_events_per_call: count and us per call). Before timing, combine(dispatch(x)) with
identity experts must give x back (the routing weights sum to 1) on both paths. Writes moe.json
and moe.png.

--nccl-ep FILE: the nccl_ep.json that benchmarks/nccl_ep.py wrote earlier in the same round, at this
run's hidden size, experts, top-k and GPU count (checked before anything is timed). Its slowest
rank's pair goes beside the row of its token count as nccl_ep, with speedup_vs_nccl_ep: NCCL EP's
pair_us over jaxgin_pair's time (`gpu_round.py bench nccl_ep moe_with_nccl_ep`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxgin
from jaxgin import cli
from jaxgin.moe import _routing
from timing import best_seconds, device_event_totals, tied

STEPS = 20
SPEC = P("ep")
ROUTED_RESULT = 1  # routed() chains return their ids


def _sm(mesh, f, n_in):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * n_in, out_specs=SPEC))


def _peer_copy_ceiling(repeats: int) -> float | None:
    """Bytes/s of one large device-to-device copy GPU 0 -> GPU 1 (NVLink, copy engines)."""
    devices = jax.local_devices()
    if len(devices) < 2:
        return None
    a = jax.device_put(jnp.ones((256 << 20,), jnp.float32), devices[0])  # 1 GiB
    best = best_seconds(lambda: jax.device_put(a, devices[1]), repeats=repeats)
    return a.nbytes / best


def measure(mesh, tokens, hidden, experts, top_k, repeats, only=None, device_span=True) -> dict:
    n = mesh.size
    dtype = jnp.bfloat16
    capacity = -(-tokens * top_k * 5 // 4)  # 1.25 x the mean rows per GPU
    keys = jax.random.split(jax.random.key(tokens), 2)
    sharding = NamedSharding(mesh, SPEC)
    x = jax.device_put(jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(dtype), sharding)
    logits = jax.device_put(jax.random.normal(keys[1], (n * tokens, experts), jnp.float32), sharding)
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(logits)
    ids_host = np.asarray(ids).reshape(n, tokens, top_k)
    local = experts // n
    dest = ids_host // local
    sent_to = np.stack([(dest == d).any(axis=2) for d in range(n)], axis=-1)  # [n, T, n]
    remote_rows = max(int(sent_to[g].sum() - sent_to[g, :, g].sum()) for g in range(n))
    remote_bytes = remote_rows * hidden * 2

    def jg_dispatch(x, ids, w, fp8=False):
        return jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep", capacity=capacity, fp8=fp8)

    def rg_dispatch(x, ids):
        return jaxgin.moe.ragged.dispatch(x, ids, num_experts=experts, axis_name="ep", capacity=capacity)

    # Identity experts: combine(dispatch(x)) = x, since each token's weights sum to 1.
    def roundtrip(x, ids, w):
        sent = jg_dispatch(x, ids, w)
        rows, _, state = rg_dispatch(x, ids)
        return (jaxgin.moe.combine(sent.x, sent.handle), jaxgin.moe.ragged.combine(rows, w, state),
                sent.dropped[None])

    rt = jax.jit(jax.shard_map(roundtrip, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=(SPEC,) * 3))
    back_jg, back_rg, dropped = rt(x, ids, weights)
    xf = np.asarray(x, np.float32)
    err = {name: float(np.abs(np.asarray(b, np.float32) - xf).max() / np.abs(xf).max())
           for name, b in (("jaxgin", back_jg), ("ragged", back_rg))}
    # fp8 dispatch (rows of whole 128-value blocks only) against its own reference: dispatch of
    # the rounded rows, bit for bit
    fp8 = jaxgin.moe.fp8
    with_fp8 = hidden % fp8.BLOCK == 0 and (not only or "jaxgin_dispatch_fp8" in only)
    fp8_exact = None
    if with_fp8:
        rounded = jax.jit(fp8.rounded)(x)
        sm_x = lambda q: jax.jit(jax.shard_map(lambda v, i, w: jg_dispatch(v, i, w, q).x, mesh=mesh,  # noqa: E731
                                               in_specs=(SPEC,) * 3, out_specs=SPEC))
        # bits, not values: -0 and +0 differ
        fp8_exact = bool(np.array_equal(np.asarray(sm_x(True)(x, ids, weights)).view(np.uint16),
                                        np.asarray(sm_x(False)(rounded, ids, weights)).view(np.uint16)))

    def chain(step, steps, result=0):
        """`steps` calls of step, each fed the previous one's carry; returns carry element `result`."""
        def body(*args):
            return jax.lax.fori_loop(0, steps, lambda _, a: step(*a), args, unroll=True)[result]

        return body

    def routed(op):
        """A chain step that routes every call, as a layer does: the next call's expert ids are tied
        to this call's output (else XLA computes the routing of loop-invariant ids once, before the
        loop, and the chain times the op without it). x stays as it is: updating it would copy all
        of x each call (XLA cannot update a buffer in place that the op still reads), so the chain
        returns the ids (ROUTED_RESULT), which depend on every call."""
        def step(x, ids, w):
            return x, tied(ids, op(x, ids, w)), w

        return step

    per_peer = max(1, remote_bytes // (2 * max(n - 1, 1)))  # bf16 elements to each peer
    xla_block = jax.device_put(jnp.zeros((n * n, per_peer), dtype), sharding)
    rows_at = jax.device_put(jnp.asarray(np.random.default_rng(tokens).integers(0, tokens, n * capacity), jnp.int32),
                             sharding)

    def build(steps):
        """Every variant as a chain of `steps` calls: (program, number of inputs)."""
        variants = {}
        variants["jaxgin_dispatch"] = (
            chain(routed(lambda x, ids, w: jg_dispatch(x, ids, w).x), steps, ROUTED_RESULT), 3)
        # the same with fp8=True: e4m3 rows and a scale per 128 values (0.52x the bytes), quantizing
        # and dequantizing included
        if with_fp8:
            variants["jaxgin_dispatch_fp8"] = (
                chain(routed(lambda x, ids, w: jg_dispatch(x, ids, w, True).x), steps, ROUTED_RESULT), 3)
        variants["ragged_dispatch"] = (
            chain(routed(lambda x, ids, w: rg_dispatch(x, ids)[0]), steps, ROUTED_RESULT), 3)

        # Combine chains: the rows stay as dispatch made them and each call's routing weights are
        # tied to the previous call's output (as routed(): no copy of the rows between calls).
        def jg_combine(x, ids, w):
            sent = jg_dispatch(x, ids, w)

            def body(_, handle):
                return dataclasses.replace(handle, weights=tied(handle.weights, jaxgin.moe.combine(sent.x, handle)))

            return jax.lax.fori_loop(0, steps, body, sent.handle, unroll=True).weights

        def rg_combine(x, ids, w):
            rows, _, state = rg_dispatch(x, ids)
            body = lambda _, v: tied(v, jaxgin.moe.ragged.combine(rows, v, state))  # noqa: E731
            return jax.lax.fori_loop(0, steps, body, w, unroll=True)

        variants["jaxgin_combine"] = (jg_combine, 3)
        variants["ragged_combine"] = (rg_combine, 3)

        def jg_pair(x, ids, w):
            """dispatch then combine of its output, as a layer runs them and as benchmarks/nccl_ep.py
            times NCCL EP's pairs."""
            sent = jg_dispatch(x, ids, w)
            return jaxgin.moe.combine(sent.x, sent.handle)

        def pair_step(x, ids, w):
            """combine returns x's shape, so the next pair takes this one's output as its x with no op
            between them; the ids are tied to it only where routing kernels run before the dispatch
            kernel (above the low-latency tokens): the dispatch kernel routes below, and nothing else
            reads the ids alone."""
            y = jg_pair(x, ids, w)
            return y, (tied(ids, y) if tokens > _routing.LOW_LATENCY_MAX_TOKENS else ids), w

        variants["jaxgin_pair"] = (chain(pair_step, steps), 3)
        variants["xla_all_to_all_same_bytes"] = (
            chain(lambda a: (jax.lax.all_to_all(a, "ep", 0, 0, tiled=True),), steps), 1)

        # tied() keeps the gathered rows whole in memory (else XLA would gather the one element it reads).
        variants["xla_gather_same_rows"] = (chain(lambda x, r: (x, tied(r, jnp.take(x, r, axis=0))), steps, 1), 2)

        for name, xla in (("routing_only", False), ("routing_xla", True)):
            variants[name] = (chain(routed(lambda x, ids, w, xla=xla: _route_only(ids, experts, mesh.size, capacity,
                                                                                  xla=xla)), steps, ROUTED_RESULT), 3)
        return variants

    times, per_call, fixed, span, events = {}, {}, {}, {}, {}
    # At low latency a chain twice as long tells the cost of a call apart from the cost of running
    # the program once (launching it, waiting for it), which best / STEPS spreads over the calls.
    lengths = (STEPS, 2 * STEPS) if tokens <= _routing.LOW_LATENCY_MAX_TOKENS else (STEPS,)
    chains = {steps: build(steps) for steps in lengths}
    for name, (_, n_in) in chains[STEPS].items():
        if only and name not in only:
            continue
        args = {1: (xla_block,), 2: (x, rows_at), 3: (x, ids, weights)}[n_in]
        programs = {steps: _sm(mesh, chains[steps][name][0], n_in) for steps in lengths}
        total = {steps: best_seconds(programs[steps], *args, repeats=repeats) for steps in lengths}
        times[name] = total[STEPS] / STEPS * 1e6
        line = f"  {tokens} tokens  {name:28s} {times[name]:9.1f} us"
        if len(lengths) == 2:
            per_call[name] = (total[2 * STEPS] - total[STEPS]) / STEPS * 1e6
            fixed[name] = total[STEPS] * 1e6 - STEPS * per_call[name]
            line += f"   per call {per_call[name]:7.1f} us, per program run {fixed[name]:7.1f} us"
        if device_span and not name.startswith("ragged_"):  # ragged chains: many small ops, long traces
            totals, timeline = device_event_totals(programs[STEPS], *args)
            span[name] = max(start + duration for _, start, duration, _ in timeline) / STEPS
            events[name] = {event[:80]: {"count": e["count"] / STEPS, "us": e["seconds"] / STEPS * 1e6}
                            for event, e in sorted(totals.items(), key=lambda item: -item[1]["seconds"])}
            line += f"   device span {span[name]:7.1f} us"
        print(line, flush=True)
    # The combine loops include one dispatch (outside the loop): subtract it.
    for kind in ("jaxgin", "ragged"):
        for figures in (times, span):
            if f"{kind}_combine" in figures and f"{kind}_dispatch" in figures:
                figures[f"{kind}_combine"] -= figures[f"{kind}_dispatch"] / STEPS
    nan = float("nan")
    jg = times.get("jaxgin_dispatch", nan) + times.get("jaxgin_combine", nan)
    rg = times.get("ragged_dispatch", nan) + times.get("ragged_combine", nan)
    return dict(
        tokens=tokens, hidden=hidden, experts=experts, top_k=top_k, devices=n, capacity=capacity,
        dropped=int(np.asarray(dropped).sum()), roundtrip_rel_err=err, times_us=times,
        per_call_us=per_call or None, per_program_run_us=fixed or None, device_span_us=span or None,
        device_events_per_call=events or None,
        dispatch_plus_combine_us=dict(jaxgin=jg, ragged=rg), speedup_vs_ragged=rg / jg,
        remote_bytes_per_gpu=remote_bytes,
        fp8=dict(exact_against_its_reference=fp8_exact,
                 remote_bytes_per_gpu=remote_rows * fp8.packed_width(hidden) * 2) if with_fp8 else None,
        effective_GBps=dict(dispatch=remote_bytes / times.get("jaxgin_dispatch", nan) / 1e3,
                            combine=remote_bytes / times.get("jaxgin_combine", nan) / 1e3),
    )


def nccl_ep_anchor(path: Path, hidden: int, experts: int, top_k: int, devices: int) -> dict:
    """NCCL EP's low-latency pair from benchmarks/nccl_ep.py's JSON, or ValueError naming what does
    not match this run. Its slowest rank's figures: jaxgin's chain ends with its slowest GPU too."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--nccl-ep {path}: not readable as nccl_ep.py's JSON ({e})") from None
    ours = dict(hidden=hidden, experts=experts, top_k=top_k, devices=devices)
    wrong = [f"{key} {data.get(key)!r} (this run: {value})" for key, value in ours.items() if data.get(key) != value]
    if wrong:
        raise ValueError(f"--nccl-ep {path}: measured at other shapes: {'; '.join(wrong)}")
    worst = data.get("worst") or {}
    if not isinstance(data.get("tokens"), int) or not isinstance(worst.get("pair_us"), (int, float)):
        raise ValueError(f"--nccl-ep {path}: no tokens or worst.pair_us (not written by benchmarks/nccl_ep.py?)")
    return dict(tokens=data["tokens"], file=str(path), library=data.get("library"), nccl=data.get("nccl"),
                device=data.get("device"),
                **{key: worst.get(key) for key in ("pair_us", "pair_graph_us", "dispatch_us", "combine_us")})


def with_nccl_ep(rows: list[dict], anchor: dict) -> None:
    """The anchor beside every row of its token count, with NCCL EP's pair time over jaxgin's."""
    for row in rows:
        if row["tokens"] == anchor["tokens"]:
            ours = row["times_us"].get("jaxgin_pair")
            row["nccl_ep"] = anchor
            row["speedup_vs_nccl_ep"] = anchor["pair_us"] / ours if ours else None


def _route_only(ids, experts, size, capacity, xla=False):
    """dispatch's routing arithmetic alone: the device functions dispatch routes with (inside its
    kernel up to 256 tokens), as kernels of their own (_routing_device.route_alone), or with xla=True
    XLA's fusions (_routing.route)."""
    from jaxgin.moe import _routing_device

    plan = _routing.Plan(("ep",), size, ids.shape[0], 1, ids.shape[1], experts // size, capacity, "bfloat16",
                         _routing.HIGH_THROUGHPUT)
    route, _ = (_routing.route if xla else _routing_device.route_alone)(ids, plan)
    # every array whole (the barrier), as dispatch uses them: else XLA computes only what is read
    slot, before, meta, dest, counts = jax.lax.optimization_barrier(
        (route.slot, route.before, route.meta, route.dest, route.send_counts))
    return meta[:, :, 0] + slot[:, :1] + before[:, :1] + dest[:, :1] + counts[0, 0]


def plot(report: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = report["results"]
    names = ["jaxgin_dispatch", "ragged_dispatch", "jaxgin_combine", "ragged_combine"]
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        values = [row["times_us"].get(k, 0.0) for k in names]
        ax.bar(range(len(names)), values, color=["C0", "C1", "C0", "C1"])
        ax.set_xticks(range(len(names)), [k.replace("_", "\n") for k in names])
        ax.set_yscale("log")
        ax.set_ylabel("us per call (per GPU)")
        ax.set_title(f"{row['tokens']} tokens/GPU, {row['devices']} GPUs: {row['speedup_vs_ragged']:.1f}x")
    fig.suptitle("jaxgin.moe vs ragged_all_to_all (hidden 7168, 256 experts, top-8, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default=None, help="comma-separated variants to time (default: all)")
    parser.add_argument("--no-device-span", action="store_true",
                        help="skip the profiler's device span (device_span_us), wall clock only")
    parser.add_argument("--blocks", default=None,
                        help="semicolon-separated JAXGIN_MOE_BLOCKS settings 'tokens,hidden,warps,senders' to compare")
    parser.add_argument("--nccl-ep", type=Path, default=None, metavar="FILE",
                        help="nccl_ep.json of the same round: NCCL EP's pair beside jaxgin's (docstring)")
    args = parser.parse_args()
    cli.require_gpus(__file__, 1, "it times jaxgin.moe's kernels and XLA's ragged_all_to_all on them")
    cli.require(__file__, "triton", why="jaxgin.moe's kernels", install='-e ".[cuda]"')
    devices = jax.devices()
    tokens = [int(t) for t in args.tokens.split(",")]
    anchor = None
    if args.nccl_ep:
        try:
            anchor = nccl_ep_anchor(args.nccl_ep, args.hidden, args.experts, args.top_k, len(devices))
        except ValueError as e:
            parser.error(str(e))
        if anchor["tokens"] not in tokens:
            parser.error(f"--nccl-ep {args.nccl_ep}: measured at {anchor['tokens']} tokens, "
                         f"not among --tokens {args.tokens}")
    # staging + return areas: 2 halves x devices x tokens x hidden x 2 bytes each
    need = 4 * len(devices) * max(tokens) * args.hidden * 2
    cli.run(__file__, jaxgin.initialize, heap_size=max(1 << 30, int(need * 1.25)))
    mesh = Mesh(np.array(devices), ("ep",))
    report = dict(device=devices[0].device_kind, devices=len(devices), jax=jax.__version__,
                  jaxgin_info={k: str(v) for k, v in jaxgin.info().items()}, peer_copy_GBps=None, results=[])
    ceiling = _peer_copy_ceiling(args.repeats)
    report["peer_copy_GBps"] = ceiling / 1e9 if ceiling else None
    only = set(args.only.split(",")) if args.only else None
    for setting in (args.blocks.split(";") if args.blocks else [None]):
        if setting:
            os.environ["JAXGIN_MOE_BLOCKS"] = setting
            print(f"JAXGIN_MOE_BLOCKS={setting}", flush=True)
        for t in tokens:
            row = measure(mesh, t, args.hidden, args.experts, args.top_k, args.repeats, only, not args.no_device_span)
            row["blocks"] = setting
            report["results"].append(row)
    if anchor:
        with_nccl_ep(report["results"], anchor)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    png = plot(report, out / "moe.png")
    print(f"wrote {out / 'moe.json'}" + (f" and {png}" if png else ""))
    jaxgin.finalize()


if __name__ == "__main__":
    main()
