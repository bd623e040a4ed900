"""NCCL EP's low-latency dispatch / combine (PyPI's nccl-extensions) at the shapes of
benchmarks/moe.py, one process per GPU of this machine: the peer that jaxgin.moe is compared with.

    python benchmarks/nccl_ep.py [--tokens 128] [--hidden 7168] [--experts 256] [--top-k 8] [--out DIR]

What it needs, and why:
  2 NVIDIA GPUs    or more (--gpus): NCCL EP runs one process per GPU
  torch            tensors, and a gloo process group for NCCL's unique id, the checks and barriers
  nccl-extensions  with nccl4py, cuda-core, cuda-pathfinder; and the NCCL it pins (2.30.x): its
                   compiled host code holds NCCL's device-communicator struct, whose layout changed
                   in 2.32, so a newer NCCL is not a drop-in
  nvcc             NCCL EP compiles its kernels at first use (NCCL_EP_JIT_NVCC, else the nvcc on PATH)
  GIN              the LL mode refuses to start without it ("NCCL EP requires GIN"), even when every
                   peer is in the NVLink team and its kernels store to peers directly. On hosts with no
                   RDMA NIC, export NCCL_RMA_PLUGIN=... from `python -m jaxgin.transport` (NCCL >= 2.30)
                   so GIN exists; the JSON then holds what that transport carried, to show whether any
                   of the timed traffic went through it rather than over NVLink.

Per GPU, same routing distribution as benchmarks/moe.py (each token picks top-k distinct experts
uniformly at random; weights sum to 1), bfloat16:
  pair_us              N (dispatch, combine) pairs back to back between two CUDA events, no host
                       sync inside, / N; best of REPEATS. Compare with jaxgin_pair of moe.py.
  pair_graph_us        the same N pairs captured once in a CUDA graph and replayed (no host launch
                       cost); absent if capture fails (the reason is recorded)
  dispatch_us / combine_us   each call between its own events, the stream synchronized and the
                       ranks barriered between calls, as NCCL EP's own ep_bench times them; median
Before timing, combine(dispatch(x)) with identity experts must give x back and every expert's
received rows must be exactly the rows routed to it (from every rank); the run fails otherwise.
Writes nccl_ep.json (every rank's numbers) into --out.

Without 2 NVIDIA GPUs it says so and exits with status 4, without torch or nccl-extensions with
status 3, as every script here does (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIRS = 50
REPEATS = 5
PER_CALL_ITERS = 50
WARMUP = 10


def _routing(torch, rank, tokens, hidden, experts, top_k):
    g = torch.Generator().manual_seed(1000 + rank)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.contiguous()  # int64, distinct
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1).float().contiguous()
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).contiguous()
    return x, ids, weights


def _rows(torch, rows):
    """Each row's exact bits, sorted: NCCL EP fills an expert's slots in arrival order."""
    return sorted(r.tobytes() for r in rows.contiguous().view(torch.int16).numpy())


def _check(torch, dist, world, rank, x, ids, recv, counts, back, local):
    """Counts and rows against every rank's routing; combine(dispatch(x)) against x."""
    all_x = [torch.empty(x.shape, dtype=torch.float32) for _ in range(world)]  # gloo has no bf16; f32 is exact
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(all_x, x.float())
    dist.all_gather(all_ids, ids)
    all_x = [a.to(torch.bfloat16) for a in all_x]
    counts, recv = counts.cpu(), recv.cpu()
    problems = []
    for e in range(local):
        expert = rank * local + e
        want = torch.cat([all_x[r][(all_ids[r] == expert).any(dim=1)] for r in range(world)])
        got = int(counts[e])
        if got != want.shape[0]:
            problems.append(f"expert {expert}: {got} rows received, {want.shape[0]} routed to it")
        elif _rows(torch, recv[e, :got]) != _rows(torch, want):
            problems.append(f"expert {expert}: the received rows differ from the rows routed to it")
    xf = x.float()
    rel_err = float((back.cpu().float() - xf).abs().max() / xf.abs().max())
    if rel_err > 2e-2:
        problems.append(f"combine(dispatch(x)) differs from x: max relative error {rel_err:.3g}")
    return rel_err, problems


def _transport_counters():
    path = os.environ.get("NCCL_RMA_PLUGIN")
    if not path:
        return None
    from jaxgin.transport import counters

    return counters(path)


def worker(args) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", store=dist.FileStore(args.store, world), rank=rank, world_size=world)
    import nccl.core as nccl_core
    from nccl import ep

    uid = [nccl_core.get_unique_id().as_bytes if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    comm = nccl_core.Communicator.init(nranks=world, rank=rank, unique_id=nccl_core.UniqueId.from_bytes(uid[0]))

    tokens, hidden, experts, top_k = args.tokens, args.hidden, args.experts, args.top_k
    local = experts // world
    x, ids, weights = _routing(torch, rank, tokens, hidden, experts, top_k)
    dev = torch.device("cuda", rank)
    stream = torch.cuda.Stream(dev)
    sp = stream.cuda_stream
    with torch.cuda.stream(stream):
        x_d, ids_d, w_d = x.to(dev), ids.to(dev), weights.to(dev)
        recv = torch.zeros((local, world * tokens, hidden), dtype=torch.bfloat16, device=dev)
        counts = torch.zeros((local,), dtype=torch.int32, device=dev)
        back = torch.zeros((tokens, hidden), dtype=torch.bfloat16, device=dev)
    stream.synchronize()

    group = ep.Group.create(comm, ep.GroupConfig(
        algorithm=ep.Algorithm.LOW_LATENCY, num_experts=experts, max_dispatch_tokens_per_rank=tokens,
        max_recv_tokens_per_rank=tokens * world, max_token_bytes=hidden * 2, num_topk=top_k))
    t_ids, t_x, t_recv, t_counts, t_back, t_w = (ep.Tensor(t) for t in (ids_d, x_d, recv, counts, back, w_d))
    handle = group.create_handle(ep.Layout.EXPERT_MAJOR, t_ids, config=ep.HandleConfig(), stream=sp)
    d_in, d_out = ep.DispatchInputs(tokens=t_x), ep.DispatchOutputs(tokens=t_recv)
    d_layout = ep.LayoutInfo(expert_counters=t_counts)
    c_in, c_out = ep.CombineInputs(tokens=t_recv), ep.CombineOutputs(tokens=t_back, topk_weights=t_w)
    d_cfg, c_cfg = ep.DispatchConfig(), ep.CombineConfig()

    def dispatch():
        handle.dispatch(d_in, d_out, layout_info=d_layout, config=d_cfg, stream=sp)
        handle.complete(stream=sp)

    def combine():
        handle.combine(c_in, c_out, config=c_cfg, stream=sp)
        handle.complete(stream=sp)

    t0 = time.perf_counter()
    dispatch()
    combine()
    stream.synchronize()
    first_call_s = time.perf_counter() - t0  # includes NCCL EP's kernel compilation
    rel_err, problems = _check(torch, dist, world, rank, x, ids, recv, counts, back, local)
    result = {"rank": rank, "first_call_s": first_call_s, "roundtrip_rel_err": rel_err, "problems": problems,
              "received_rows": int(counts.sum()), "sent_rows": int(ids.numel())}

    for _ in range(WARMUP):
        dispatch()
        combine()
    stream.synchronize()
    dist.barrier()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(REPEATS):
        dist.barrier()
        start.record(stream)
        for _ in range(PAIRS):
            dispatch()
            combine()
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / PAIRS)
    result["pair_us"] = best

    events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(PER_CALL_ITERS)]
    for ev in events:
        ev[0].record(stream)
        dispatch()
        ev[1].record(stream)
        stream.synchronize()
        ev[2].record(stream)
        combine()
        ev[3].record(stream)
        stream.synchronize()
        dist.barrier()
    d = [ev[0].elapsed_time(ev[1]) * 1e3 for ev in events[1:]]
    c = [ev[2].elapsed_time(ev[3]) * 1e3 for ev in events[1:]]
    result.update(dispatch_us=float(np.median(d)), combine_us=float(np.median(c)),
                  dispatch_min_us=min(d), combine_min_us=min(c))

    # The same check after all the timed calls (the buffers were reused hundreds of times), into
    # cleared outputs so that stale rows cannot pass.
    with torch.cuda.stream(stream):
        recv.zero_()
        back.zero_()
        counts.zero_()
    dispatch()
    combine()
    stream.synchronize()
    _, result["problems_after_timing"] = _check(torch, dist, world, rank, x, ids, recv, counts, back, local)

    # Last, as it may leave the stream unusable: the pairs captured in a CUDA graph. Replayed only
    # if every rank captured, so that no rank waits on a peer that will never send.
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(PAIRS):
                dispatch()
                combine()
    except Exception as e:  # noqa: BLE001 (recorded in the JSON, not hidden)
        error = f"{type(e).__name__}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error)
    if any(errors):
        result["pair_graph_error"] = next(e for e in errors if e)
    else:
        best = float("inf")
        for _ in range(REPEATS):
            dist.barrier()
            with torch.cuda.stream(stream):  # replay() launches on the current stream
                start.record(stream)
                graph.replay()
                end.record(stream)
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / PAIRS)
        # A replay must do the work: into cleared outputs, it must give the same results.
        with torch.cuda.stream(stream):
            recv.zero_()
            back.zero_()
            counts.zero_()
            graph.replay()
        stream.synchronize()
        _, wrong = _check(torch, dist, world, rank, x, ids, recv, counts, back, local)
        if wrong:
            result["pair_graph_error"] = f"{best:.2f} us per pair, but the replay's outputs are wrong: {wrong[:3]}"
        else:
            result["pair_graph_us"] = best
    result["transport"] = _transport_counters()

    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        timed = ("pair_us", "pair_graph_us", "dispatch_us", "combine_us")
        report = {
            "wheel": f"nccl-extensions {importlib.metadata.version('nccl-extensions')}",
            "library": f"libnccl_ep {ep.get_lib_version()}", "nccl": str(nccl_core.get_version()),
            "device": torch.cuda.get_device_name(dev), "devices": world, "tokens": tokens, "hidden": hidden,
            "experts": experts, "top_k": top_k, "algorithm": "LOW_LATENCY", "layout": "EXPERT_MAJOR",
            "pairs": PAIRS, "rma_plugin": os.environ.get("NCCL_RMA_PLUGIN"), "ranks": gathered,
            # the slowest rank: a collective finishes when its last rank does
            "worst": {k: max(r[k] for r in gathered) if all(k in r for r in gathered) else None for k in timed},
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "nccl_ep.json").write_text(json.dumps(report, indent=1, default=str))
        print(json.dumps(report, indent=1, default=str), flush=True)
    handle.destroy()
    group.destroy()
    comm.destroy()
    dist.destroy_process_group()
    bad = result["problems"] + result["problems_after_timing"]
    if bad:
        print(f"rank {rank}: " + "; ".join(bad[:5]), file=sys.stderr, flush=True)
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=None, help="processes, one per GPU (default: every GPU)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds before the run is stopped")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args)
        return
    from jaxgin import cli

    gpus = cli.require_gpus(__file__, 2, "NCCL EP runs one process per GPU", through_jax=False)
    cli.require(__file__, "torch", why="tensors and the ranks' process group", install="torch")
    cli.require(__file__, "nccl.ep", why="NCCL EP itself", install="nccl-extensions")
    world = args.gpus or gpus
    if world < 2:
        sys.exit(f"--gpus={world}: NCCL EP needs at least 2 GPUs, one process each")
    if args.experts % world:
        sys.exit(f"--experts={args.experts} must be a multiple of the {world} GPUs")
    env = dict(os.environ)
    nvcc = env.get("NCCL_EP_JIT_NVCC") or shutil.which("nvcc")
    if not nvcc:
        sys.exit("NCCL EP compiles its kernels with nvcc: put nvcc on PATH or set NCCL_EP_JIT_NVCC")
    env.setdefault("NCCL_EP_JIT_NVCC", nvcc)
    env.setdefault("CUDA_HOME", str(Path(nvcc).resolve().parent.parent))
    store = Path(tempfile.mkdtemp(prefix="nccl-ep-")) / "store"
    common = [sys.executable, __file__, "--out", args.out, "--tokens", str(args.tokens), "--hidden", str(args.hidden),
              "--experts", str(args.experts), "--top-k", str(args.top_k), "--world", str(world), "--store", str(store)]
    procs = [subprocess.Popen([*common, "--rank", str(r)], env=env) for r in range(world)]
    deadline = time.monotonic() + args.timeout
    status = 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed or time.monotonic() > deadline:
            why = "a rank failed" if failed else f"no result after {args.timeout:.0f} s"
            print(f"nccl_ep: {why}; stopping the other ranks", file=sys.stderr, flush=True)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            status = 1
            break
        time.sleep(0.2)
    codes = [p.wait() for p in procs]
    sys.exit(status or max(abs(c) for c in codes))


if __name__ == "__main__":
    main()
