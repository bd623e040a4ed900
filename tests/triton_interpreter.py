"""Runs jaxgin's pure Triton device functions (no tritongin calls) in Triton's interpreter
(TRITON_INTERPRET=1) on this machine, with numpy arrays as device memory, against the plain JAX
they stand for. A script of its own: Triton reads TRITON_INTERPRET when a kernel is defined, so it
needs a fresh process.

    python tests/triton_interpreter.py fp8|placement|routing|dispatch_routing|tile_order|network_entries

prints one JSON line: the cases checked (tests/test_moe.py asserts on it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

from jaxgin.moe import _fp8_device as fp8_rows  # noqa: E402
from jaxgin.fused import _kernels as fused_kernels  # noqa: E402  (only pure helpers of these two run here,
from jaxgin.moe import _kernels  # noqa: E402        never their tritongin calls)
from jaxgin.moe import _routing_device  # noqa: E402
from jaxgin import op_support  # noqa: E402
from jaxgin.op_kernels import host_place, host_size, network_entry  # noqa: E402


class HostArray:
    """A numpy array that Triton's interpreter takes for device memory: it reads and writes it in
    place, through its address."""

    def __init__(self, array):
        self.array = np.ascontiguousarray(array)
        self.dtype = self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def _in_place() -> None:
    """The interpreter copies torch tensors to the host and back around a launch; these arrays are
    host memory already, so it is told to use them as they are."""
    for name in ("_init_args_hst", "_restore_args_dev"):
        if not hasattr(interpreter.GridExecutor, name):
            raise SystemExit(f"this Triton's interpreter has no GridExecutor.{name}: tests/triton_interpreter.py "
                             "needs updating for it")
    interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
    interpreter.GridExecutor._restore_args_dev = lambda self, *args, **kwargs: None


@triton.jit
def _stage_and_place(x, staged, out, T: tl.constexpr, H: tl.constexpr, SW: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr):
    """What the dispatch kernel does to a row with fp8: stage it (quantize, store_quantized),
    then place it (load_rows)."""
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = r < T
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        rows = tl.load(x + r[:, None] * H + h[None, :], mask=ok[:, None] & (h < H)[None, :], other=0.0)
        q, scale = fp8_rows.quantize(rows, BT, BH)
        fp8_rows.store_quantized(staged, r, q, scale, h0, ok, H, SW, BT, BH)
    for h0 in range(0, H, BH):
        h = h0 + tl.arange(0, BH)
        rows = fp8_rows.load_rows(staged, r, h0, ok, out.dtype.element_ty, H, SW, BT, BH)
        tl.store(out + r[:, None] * H + h[None, :], rows, mask=ok[:, None] & (h < H)[None, :])


def _triton_version() -> tuple[int, int]:
    return tuple(int(v) for v in triton.__version__.split(".")[:2])


def fp8() -> list[dict]:
    import jax

    from jaxgin.moe import fp8 as fp8_lib

    checked = []
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for t, h, bt, bh, seed in ((5, 384, 4, 256, 0), (33, 1024, 4, 512, 1)):
            rng = np.random.default_rng(seed)
            # magnitudes from 1e-9 to 3000 per row: subnormal e4m3 values, ties, carries into the exponent
            x = rng.standard_normal((t, h)) * np.exp(rng.uniform(-20, 8, size=(t, 1)))
            x[1, :128] = 0  # an all-zero block: scale 1
            x[2, :] = rng.integers(-3, 4, h)  # exact small integers
            if dtype is not np.float16:  # scales far from 1 (2^-108 and 2^92), values still normal
                x[3, :] = rng.standard_normal(h) * 1e-30
                x[4, :] = rng.standard_normal(h) * 1e30
            x[0, :5] = [-0.0, 0.0, -1e-12, 1e-12, -1.0]  # zeros and values that round to zero keep their sign
            x = x.astype(dtype)
            width = fp8_lib.packed_width(h)
            staged, out = HostArray(np.zeros((t, width), np.int16)), HostArray(np.zeros((t, h), dtype))
            _stage_and_place[(-(-t // bt),)](HostArray(x), staged, out, T=t, H=h, SW=width, BT=bt, BH=bh)
            packed = np.asarray(jax.jit(lambda v: fp8_lib.pack(*fp8_lib.quantize(v)))(x))
            rounded = np.asarray(jax.jit(fp8_lib.rounded)(x))
            rows_equal = bool(np.array_equal(out.array.view(np.uint8), rounded.view(np.uint8)))
            if dtype is np.float16 and _triton_version() < (3, 9):
                rows_equal = None  # this interpreter's float32 -> float16 conversion is not the GPU's rounding
            checked.append(dict(dtype=np.dtype(dtype).name, tokens=t, hidden=h,
                                packed_equal=bool(np.array_equal(staged.array, packed)), rows_equal=rows_equal,
                                rounded_differs_from_x=not np.array_equal(rounded.view(np.uint8), x.view(np.uint8))))
    return checked


@triton.jit
def _place(counts, codes, out, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
           C: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """The dispatch kernel's placement arithmetic (_kernels._first_rows, _positions) for every
    source's rows, as its placers run it: out [P, T, K] grouped rows (-1: nowhere)."""
    ps = tl.arange(0, BP)
    es = tl.arange(0, BE)
    ks = tl.arange(0, BK)
    got = tl.load(counts + ps[:, None] * (EL + 1) + es[None, :], mask=(ps < P)[:, None] & (es < EL + 1)[None, :],
                  other=0)
    for s in tl.static_range(P):
        start = _kernels._first_rows(got, es, ps, s, EL)
        for t0 in range(0, T, BT):
            r = t0 + tl.arange(0, BT)
            ok = (r < T)[:, None] & (ks < K)[None, :]
            code = tl.load(codes + (s * T + r)[:, None] * K + ks[None, :], mask=ok, other=-1)
            tl.store(out + (s * T + r)[:, None] * K + ks[None, :], _kernels._positions(code, start, C, EL), mask=ok)


def placement() -> list[dict]:
    """_place against jaxgin.moe._routing.placement, on routings made by _routing.route (what the
    sources send), capacities that keep everything and that drop."""
    import jax
    import jax.numpy as jnp

    from jaxgin.moe import _routing

    pow2 = op_support.pow2
    checked = []
    for p, t, k, el, capacity, seed in ((4, 37, 3, 5, None, 0), (3, 20, 6, 2, 25, 1), (2, 64, 8, 16, 200, 2),
                                        (1, 9, 2, 3, 4, 3)):
        rng = np.random.default_rng(seed)
        ids = rng.integers(-1, p * el, size=(p, t, k)).astype(np.int32)  # the sources' topk ids (-1: masked)
        plan = _routing.Plan(("ep",), p, t, 1, k, el, 1, "float32", _routing.LOW_LATENCY)
        capacity = capacity or _routing.worst_case_capacity(p, t, k, el)
        for d in range(p):  # every receiving GPU
            routes = [_routing.route(jnp.asarray(ids[s]), plan)[0] for s in range(p)]
            counts = np.stack([np.asarray(r.send_counts)[d] for r in routes])  # [P, EL + 1] from each source
            codes = np.stack([np.asarray(r.meta)[:, d, :] for r in routes])  # [P, T, K]
            want, _, _ = jax.jit(lambda c, x: _routing.placement(c, x, capacity, el))(counts, codes)
            out = HostArray(np.zeros((p, t, k), np.int32))
            _place[(1,)](HostArray(counts), HostArray(codes), out, T=t, K=k, P=p, EL=el, C=capacity, BT=8,
                         BK=pow2(k), BP=pow2(p), BE=pow2(el + 1))
            want = np.asarray(want)
            checked.append(dict(gpus=p, receiver=d, capacity=capacity, landed=int((want >= 0).sum()),
                                dropped=int(((codes >= 0) & (want < 0)).sum()), equal=bool(np.array_equal(out.array, want))))
    return checked


def routing() -> list[dict]:
    """_routing_device.route_kernel against jaxgin.moe._routing.route, array by array: several
    programs (each counting the earlier tokens itself, in one step up to 256 tokens; above, from
    chunk_counts_kernel's counts of 128-token chunks, at 300 and 700 tokens, and at 768, whole
    chunks only), blocks cut short, masked ids, top_k that is not a power of two, one GPU, experts
    all on one GPU."""
    import jax.numpy as jnp

    from jaxgin.moe import _routing, _routing_device

    checked = []
    for p, t, k, el, case, seed in ((4, 128, 8, 64, "random", 0), (4, 37, 3, 5, "masked", 1), (1, 9, 2, 3, "random", 2),
                                    (8, 50, 6, 4, "masked", 3), (2, 256, 8, 16, "one_gpu", 4), (3, 16, 1, 7, "random", 5),
                                    (2, 300, 4, 8, "masked", 6), (4, 700, 8, 16, "masked", 7),
                                    (2, 768, 8, 128, "random", 8)):
        rng = np.random.default_rng(seed)
        low = -1 if case == "masked" else 0
        ids = rng.integers(low, p * el + (2 if case == "masked" else 0), size=(t, k)).astype(np.int32)
        if case == "one_gpu":
            ids = rng.integers(0, el, size=(t, k)).astype(np.int32)
        plan = _routing.Plan(("ep",), p, t, 1, k, el, 1, "float32", _routing.LOW_LATENCY)
        want, want_masked = _routing.route(jnp.asarray(ids), plan)
        got = dict(slot=np.full((t, p), -7, np.int32), before=np.full((t, p), -7, np.int32),
                   meta=np.full((t, p, k), -7, np.int32), dest=np.full((t, k), -7, np.int32),
                   send_counts=np.full((p, el + 1), -7, np.int32), masked=np.full((1,), -7, np.int32))
        arrays = {name: HostArray(a) for name, a in got.items()}
        launch = _routing_device.constexprs(t, k, p, el)
        chunks = -(-t // launch["SCAN"])
        chunk_bins = HostArray(np.full((chunks, launch["BE"]), -7, np.int32))
        chunk_tokens = HostArray(np.full((chunks, launch["BP"]), -7, np.int32))
        ctx = HostArray(np.zeros(1, np.uint8))
        chunked = t > _routing_device.SCAN_TOKENS
        if chunked:
            _routing_device.chunk_counts_kernel[(chunks,)](
                ctx, HostArray(ids), chunk_bins, chunk_tokens,
                **_routing_device.chunk_constexprs(launch))
        _routing_device.route_kernel[_routing_device.grid(t)](
            ctx, HostArray(ids), chunk_bins, chunk_tokens, *arrays.values(), CHUNKS=int(chunked), **launch)
        equal = {name: bool(np.array_equal(arrays[name].array, np.asarray(getattr(want, name))))
                 for name in ("slot", "before", "meta", "dest", "send_counts")}
        equal["masked"] = int(arrays["masked"].array[0]) == int(want_masked)
        checked.append(dict(gpus=p, tokens=t, top_k=k, local_experts=el, case=case, programs=_routing_device.grid(t)[0],
                            chunks=chunks if chunked else 0, masked_entries=int(want_masked), equal=equal))
    return checked


@triton.jit
def _dispatch_routing(ids, slot, before, meta, dest, send_counts, masked, counts_to, starts_to, block_starts,
                      block_ends, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr,
                      SCAN: tl.constexpr, BR: tl.constexpr):
    """What dispatch_routing_kernel routes: program b its token block b (_block_routing, stored as
    its placers store it) and where the block's rows start and end on each GPU, as its sender
    writes them there (block_starts / block_ends [P, TB]); program 0 also the totals and what it
    tells each GPU first (counts_to [P, EL + 1], starts_to [P, TB + 1]: the kernel that routes
    posts the counts alone, the other one both)."""
    b = tl.program_id(0)
    TB: tl.constexpr = (T + BT - 1) // BT
    slots, dest_b, code, first = _kernels._block_routing(ids, slot, b, T, K, P, EL, BT, BK, BP, SCAN, BR, 1)
    _routing_device.store_block_route(b * BT, dest_b, code, slots, first, slot, before, meta, dest, T, K, P, BT, BK, BP)
    for d in tl.static_range(P):
        start, end = _kernels._block_span(first, slots, d, BT, BP)
        tl.store(block_starts + d * TB + b, start)
        tl.store(block_ends + d * TB + b, end)
    if b == 0:
        es = tl.arange(0, BE)
        bs = tl.arange(0, BB)
        per_bin, tokens_to, before_all = _kernels._sent_totals(ids, send_counts, masked, T, K, P, EL, BK, BP, SCAN, BR, 1,
                                                               1)
        for d in tl.static_range(P):
            counts, starts = _kernels._counts_and_starts(d, send_counts, before, per_bin, tokens_to, before_all,
                                                         T, P, EL, BT, BP, BE, BB, 1)
            tl.store(counts_to + d * (EL + 1) + es, counts, mask=es < EL + 1)
            tl.store(starts_to + d * (TB + 1) + bs, starts, mask=bs <= TB)


def dispatch_routing() -> list[dict]:
    """The dispatch kernel's own routing (dispatch_routing_kernel: blocks of BT tokens, the totals
    and block starts program 0 sends first) against _routing.route: route()'s arrays, each GPU's
    counts row (send_counts[d]) and the staging row where each block starts on d (before at the
    block's first token, then the tokens sent to d), as program 0 computes it and as each block's
    sender does."""
    import jax.numpy as jnp

    from jaxgin.moe import _routing, _routing_device

    pow2 = op_support.pow2
    checked = []
    for p, t, k, el, bt, case, seed in ((4, 128, 8, 64, 2, "random", 0), (4, 37, 3, 5, 2, "masked", 1),
                                        (1, 9, 2, 3, 2, "random", 2), (8, 50, 6, 4, 8, "masked", 3),
                                        (2, 256, 8, 16, 2, "one_gpu", 4), (3, 17, 1, 7, 8, "random", 5)):
        rng = np.random.default_rng(seed)
        ids = rng.integers(-1 if case == "masked" else 0, p * el + (2 if case == "masked" else 0),
                           size=(t, k)).astype(np.int32)
        if case == "one_gpu":
            ids = rng.integers(0, el, size=(t, k)).astype(np.int32)
        plan = _routing.Plan(("ep",), p, t, 1, k, el, 1, "float32", _routing.LOW_LATENCY)
        want, want_masked = _routing.route(jnp.asarray(ids), plan)
        want = {name: np.asarray(getattr(want, name)) for name in ("slot", "before", "meta", "dest", "send_counts")}
        tb = -(-t // bt)
        got = dict(slot=np.full((t, p), -7, np.int32), before=np.full((t, p), -7, np.int32),
                   meta=np.full((t, p, k), -7, np.int32), dest=np.full((t, k), -7, np.int32),
                   send_counts=np.full((p, el + 1), -7, np.int32), masked=np.full((1,), -7, np.int32),
                   counts_to=np.full((p, el + 1), -7, np.int32), starts_to=np.full((p, tb + 1), -7, np.int32),
                   block_starts=np.full((p, tb), -7, np.int32), block_ends=np.full((p, tb), -7, np.int32))
        arrays = {name: HostArray(a) for name, a in got.items()}
        routing = _routing_device.constexprs(t, k, p, el)
        _dispatch_routing[(tb,)](HostArray(ids), *arrays.values(), T=t, K=k, P=p, EL=el, BT=bt, BK=pow2(k),
                                 BP=pow2(p), BE=pow2(el + 1), BB=pow2(tb + 1), SCAN=routing["SCAN"], BR=routing["BE"])
        starts = np.concatenate([want["before"][::bt].T, want["send_counts"][:, el:]], axis=1)
        equal = {name: bool(np.array_equal(arrays[name].array, want[name])) for name in want}
        equal.update(masked=int(arrays["masked"].array[0]) == int(want_masked),
                     counts_to=bool(np.array_equal(arrays["counts_to"].array, want["send_counts"])),
                     starts_to=bool(np.array_equal(arrays["starts_to"].array, starts)),
                     block_starts=bool(np.array_equal(arrays["block_starts"].array, starts[:, :tb])),
                     block_ends=bool(np.array_equal(arrays["block_ends"].array, starts[:, 1:])))
        checked.append(dict(gpus=p, tokens=t, top_k=k, local_experts=el, block_tokens=bt, case=case,
                            masked_entries=int(want_masked), equal=equal))
    return checked


@triton.jit
def _coords(out, TILES: tl.constexpr, TM: tl.constexpr, TN: tl.constexpr, GROUP_M: tl.constexpr,
            BLOCK: tl.constexpr):
    """out [TILES, 2]: the fused kernels' tile of each program number (_tile_coords)."""
    t = tl.arange(0, BLOCK)
    ti, tj = fused_kernels._tile_coords(t, TM, TN, GROUP_M)
    tl.store(out + t * 2, ti, mask=t < TILES)
    tl.store(out + t * 2 + 1, tj, mask=t < TILES)


def tile_order() -> list[dict]:
    """_tile_coords over whole grids: every tile exactly once, and each run of GROUP_M * TN program
    numbers within one group of GROUP_M row tiles (what makes a weight tile's reads hit L2)."""
    checked = []
    for tm, tn, group in ((8, 8, 8), (7, 3, 4), (32, 8, 8), (5, 16, 8), (1, 9, 8), (13, 1, 2)):
        tiles = tm * tn
        out = HostArray(np.zeros((tiles, 2), np.int32))
        _coords[(1,)](out, TILES=tiles, TM=tm, TN=tn, GROUP_M=group, BLOCK=1 << (tiles - 1).bit_length())
        ti, tj = out.array[:, 0], out.array[:, 1]
        every_tile_once = sorted(zip(ti.tolist(), tj.tolist())) == [(i, j) for i in range(tm) for j in range(tn)]
        runs = [set(ti[start:start + group * tn] // group) for start in range(0, tiles, group * tn)]
        checked.append(dict(tm=tm, tn=tn, group_m=group, every_tile_once=every_tile_once,
                            groups_in_runs=all(len(r) == 1 for r in runs)))
    return checked


@triton.jit
def _entries(route, hosts, out, P: tl.constexpr, BP: tl.constexpr):
    s = tl.program_id(0)
    for d in range(P):
        tl.store(out + s * P + d, network_entry(route, hosts, s, d, P, BP))


@triton.jit
def _places(route, hosts, out, P: tl.constexpr, BP: tl.constexpr):
    d = tl.program_id(0)
    tl.store(out + d * 2, host_place(route, hosts, d, P, BP))
    tl.store(out + d * 2 + 1, host_size(route, hosts, d, P, BP))


def network_entries() -> list[dict]:
    """op_kernels.network_entry for every (sender, destination) pair against jaxgin.hosts.entries,
    and host_place / host_size for every axis index,
    over host layouts (hosts of 2 and 4 GPUs, every GPU a host of its own, axes whose order is not
    the ranks'), and the rule's promises: each other host gets a sender's data once, at one GPU of
    that host, and with hosts of equal size every GPU receives from one sender per host."""
    from jaxgin.hosts import entries

    layouts = [
        ([0, 0, 1, 1], [0, 1, 2, 3]), ([0, 0, 1, 1, 2, 2, 3, 3], list(range(8))), ([0, 1, 2, 3], [0, 1, 2, 3]),
        ([0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6, 7]), ([0, 0, 1, 1, 2, 2], [3, 0, 5, 2, 1, 4]),
        ([0, 0, 1, 1, 2, 2, 3, 3], [6, 7, 2, 3]),  # an axis over some ranks only (a 2-D mesh's column)
    ]
    checked = []
    for rank_hosts, axis_ranks in layouts:
        p = len(axis_ranks)
        out = HostArray(np.full((p, p), -1, np.int32))
        _entries[(p,)](HostArray(np.asarray([p, *axis_ranks], np.int32)), HostArray(np.asarray(rank_hosts, np.int32)),
                       out, P=p, BP=op_support.pow2(p))
        axis_hosts = [rank_hosts[r] for r in axis_ranks]
        want = entries(axis_hosts)
        places = HostArray(np.full((p, 2), -1, np.int32))
        _places[(p,)](HostArray(np.asarray([p, *axis_ranks], np.int32)), HostArray(np.asarray(rank_hosts, np.int32)),
                      places, P=p, BP=op_support.pow2(p))
        want_places = [[axis_hosts[:d].count(axis_hosts[d]), axis_hosts.count(axis_hosts[d])] for d in range(p)]
        once = all(
            len({int(want[s, d]) for d in range(p) if axis_hosts[d] == h}) == 1
            and axis_hosts[int(want[s, [d for d in range(p) if axis_hosts[d] == h][0]])] == h
            for s in range(p) for h in set(axis_hosts) - {axis_hosts[s]})
        receivers = {}
        for s in range(p):
            for d in range(p):
                if axis_hosts[d] != axis_hosts[s]:
                    receivers.setdefault((int(want[s, d]), axis_hosts[s]), set()).add(s)
        checked.append(dict(hosts=axis_hosts, equal=bool(np.array_equal(out.array, want)),
                            places_and_sizes=bool(np.array_equal(places.array, want_places)), once_per_host=once,
                            one_sender_per_host_each=all(len(v) == 1 for v in receivers.values())))
    return checked


if __name__ == "__main__":
    _in_place()
    print(json.dumps({"fp8": fp8, "placement": placement, "routing": routing, "dispatch_routing": dispatch_routing,
                      "tile_order": tile_order, "network_entries": network_entries}[sys.argv[1]]()))
