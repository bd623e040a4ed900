"""_routing.route in Triton: the source side of a dispatch, computed on the device.

XLA computes route() in about nine fusions; route_kernel writes the same arrays, bit for bit. Program
b takes tokens [b * R, (b + 1) * R): it counts the experts and destinations of every earlier token,
then ranks its own entries among equal experts in (token, k) order. The program of the last block
also writes the totals (send_counts, masked entries). How a program counts the earlier tokens:
  - up to SCAN_TOKENS tokens, itself, a histogram per SCAN tokens, no waiting on other programs (so
    nothing depends on which programs are resident). The work grows with the square of the tokens;
    up to _routing.LOW_LATENCY_MAX_TOKENS tokens per GPU (one SCAN step) dispatch routes with these
    functions inside its own kernel (_kernels.dispatch_routing_kernel: blocks of its own size, the
    totals by its program 0);
  - above, from the counts of every whole chunk of CHUNK_TOKENS tokens before its own, which a
    launch before (chunk_counts_kernel) wrote, and its own chunk's earlier tokens itself: two
    launches, and work that grows with the tokens (route_alone; dispatch's routing where it does
    not route itself).
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from jaxgin.moe._routing import SourceRoute
from jaxgin.op_support import pow2
from jaxgin.triton_op import triton_call

TOKENS_PER_PROGRAM = 16  # R
SCAN_TOKENS = 256  # the most tokens one counting step of the earlier tokens takes
CHUNK_TOKENS = 128  # above SCAN_TOKENS: the chunks counted apart (each program counts its own chunk's)


def scan_tokens(tokens: int) -> int:
    """SCAN for `tokens` tokens: a power of two, all of them in one step up to SCAN_TOKENS; above,
    the chunk size."""
    return pow2(tokens) if tokens <= SCAN_TOKENS else CHUNK_TOKENS


def grid(tokens: int) -> tuple[int]:
    """route_kernel's grid: one program per TOKENS_PER_PROGRAM tokens."""
    return (-(-tokens // TOKENS_PER_PROGRAM),)


def num_warps(tokens: int) -> int:
    """The counting step covers every token: more warps for more of them."""
    return 4 if tokens <= 128 else 8


def constexprs(tokens: int, top_k: int, gpus: int, local_experts: int) -> dict:
    """route_kernel's compile-time parameters for int32 ids [tokens, top_k] routed over `gpus` GPUs
    of `local_experts` experts each (what exchange launches, and what the tests run and compile)."""
    return dict(T=tokens, K=top_k, P=gpus, EL=local_experts, R=TOKENS_PER_PROGRAM, SCAN=scan_tokens(tokens),
                BK=pow2(top_k), BP=pow2(gpus), BE=pow2(gpus * local_experts + 2))


def chunk_constexprs(launch: dict) -> dict:
    """chunk_counts_kernel's compile-time parameters, from route_kernel's (constexprs())."""
    return {name: launch[name] for name in ("T", "K", "P", "EL", "SCAN", "BK", "BP", "BE")}


@triton.jit
def _entries(ids, t, t_ok, ks, K: tl.constexpr, E: tl.constexpr, EL: tl.constexpr):
    """Entries of tokens t [n] (t_ok: real tokens): (bin [n, BK]: the expert id, E where it is
    masked (outside [0, E)); destination GPU [n, BK], -1 where masked; present [n, BK])."""
    present = t_ok[:, None] & (ks < K)[None, :]
    e = tl.load(ids + t[:, None] * K + ks[None, :], mask=present, other=-1)
    valid = (e >= 0) & (e < E)
    return tl.where(valid, e, E), tl.where(valid, e // EL, -1), present


@triton.jit
def _flat_bins(ids, t0, limit, NS: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BK: tl.constexpr):
    """Bins of tokens [t0, t0 + NS / BK) as one flat [NS] vector: the expert id, E where masked, and
    E + 1 past `limit` and in the padding of K to BK, which no caller reads. Built flat, and counted
    without a mask: on an H200 with Triton 3.6, tl.histogram with a mask reshaped from [n, BK]
    miscounted at 512 entries and more (docs/measurements.md, fifteenth session)."""
    f = tl.arange(0, NS)
    t = t0 + f // BK
    k = f % BK
    present = (t < limit) & (k < K)
    e = tl.load(ids + t * K + k, mask=present, other=-1)
    return tl.where(present, tl.where((e >= 0) & (e < E), e, E), E + 1)


@triton.jit
def _goes(dest, present, ps):
    """[n, BP]: whether token i has an entry on GPU d."""
    hit = (dest[:, :, None] == ps[None, None, :]) & present[:, :, None]
    return tl.max(hit.to(tl.int32), axis=1)


@triton.jit
def count_tokens_before(ids, limit, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                        SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Of tokens [0, limit): entries per expert bin [BE] (bin E: masked entries) and tokens per
    destination GPU [BP], counted SCAN tokens per step."""
    per_bin = tl.zeros((BE,), dtype=tl.int32)
    tokens_to = tl.zeros((BP,), dtype=tl.int32)
    for t0 in range(0, T, SCAN):  # constant bounds (Triton 3.6's interpreter takes no tensor bound)
        bins, to = _span_counts(ids, t0, limit, K, P, EL, SCAN, BK, BP, BE)
        per_bin += bins
        tokens_to += to
    return per_bin, tokens_to


@triton.jit
def _span_counts(ids, t0, limit, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, SCAN: tl.constexpr,
                 BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Of tokens [t0, t0 + SCAN) before `limit`: entries per expert bin [BE] (bin E: masked
    entries) and tokens per destination GPU [BP], in one counting step."""
    E: tl.constexpr = P * EL
    ss = tl.arange(0, SCAN)
    per_bin = tl.histogram(_flat_bins(ids, t0, limit, SCAN * BK, K, E, BK), BE)
    _, dest, present = _entries(ids, t0 + ss, t0 + ss < limit, tl.arange(0, BK), K, E, EL)
    return per_bin, tl.sum(_goes(dest, present, tl.arange(0, BP)), axis=0)


@triton.jit
def chunk_counts_kernel(ctx, ids, chunk_bins, chunk_tokens, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
                        EL: tl.constexpr, SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Program c: the counts of tokens [c * SCAN, (c + 1) * SCAN) (_span_counts) into chunk_bins
    [chunks, BE] and chunk_tokens [chunks, BP] (chunks = ceil(T / SCAN)), which route_kernel reads
    with CHUNKS."""
    c = tl.program_id(0)
    per_bin, tokens_to = _span_counts(ids, c * SCAN, T, K, P, EL, SCAN, BK, BP, BE)
    tl.store(chunk_bins + c * BE + tl.arange(0, BE), per_bin)
    tl.store(chunk_tokens + c * BP + tl.arange(0, BP), tokens_to)


@triton.jit
def counts_from_chunks(ids, chunk_bins, chunk_tokens, limit, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
                       EL: tl.constexpr, SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """count_tokens_before(limit) from chunk_counts_kernel's rows: the whole chunks before `limit`
    summed, the tokens of its own chunk before it counted here."""
    CHUNKS: tl.constexpr = (T + SCAN - 1) // SCAN
    ROWS: tl.constexpr = 16  # chunk rows summed per step
    whole = limit // SCAN
    es = tl.arange(0, BE)
    ps = tl.arange(0, BP)
    rs = tl.arange(0, ROWS)
    per_bin = tl.zeros((BE,), dtype=tl.int32)
    tokens_to = tl.zeros((BP,), dtype=tl.int32)
    for c0 in range(0, CHUNKS, ROWS):
        c = c0 + rs
        before = c < whole
        per_bin += tl.sum(tl.load(chunk_bins + c[:, None] * BE + es[None, :], mask=before[:, None], other=0), axis=0)
        tokens_to += tl.sum(tl.load(chunk_tokens + c[:, None] * BP + ps[None, :], mask=before[:, None], other=0),
                            axis=0)
    bins, to = _span_counts(ids, whole * SCAN, limit, K, P, EL, SCAN, BK, BP, BE)
    return per_bin + bins, tokens_to + to


@triton.jit
def block_route(ids, t0, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, R: tl.constexpr,
                SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """route()'s arrays for tokens t0 .. t0 + R - 1 (those past T masked), from the tokens before
    them counted here: (dest [R, BK]: GPU of each entry, -1 where masked or absent; code [R, BK]:
    local expert + EL * rank, meaningful where dest >= 0; slot [R, BP]: staging row on each GPU, -1
    where the token does not go there; first [R, BP]: tokens before it that go there)."""
    per_bin, tokens_to = count_tokens_before(ids, t0, T, K, P, EL, SCAN, BK, BP, BE)
    return block_route_after(ids, t0, per_bin, tokens_to, T, K, P, EL, R, BK, BP)


@triton.jit
def block_route_after(ids, t0, per_bin, tokens_to, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
                      EL: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """block_route, given the entries per expert bin and tokens per GPU of the tokens before t0."""
    E: tl.constexpr = P * EL
    N: tl.constexpr = R * BK
    ks = tl.arange(0, BK)
    ps = tl.arange(0, BP)
    t = t0 + tl.arange(0, R)
    bins, dest, present = _entries(ids, t, t < T, ks, K, E, EL)
    flat = tl.reshape(bins, (N,))
    flat_present = tl.reshape(present, (N,))
    i = tl.arange(0, N)
    earlier = (flat[None, :] == flat[:, None]) & (i[None, :] < i[:, None]) & flat_present[None, :]
    rank = tl.gather(per_bin, flat, 0) + tl.sum(earlier.to(tl.int32), axis=1)
    code = tl.reshape(flat % EL + EL * rank, (R, BK))
    goes = _goes(dest, present, ps)  # [R, BP]
    first = tokens_to[None, :] + tl.cumsum(goes, axis=0) - goes
    return dest, code, tl.where(goes > 0, first, -1), first


@triton.jit
def store_block_route(t0, dest, code, slot_rows, first, slot, before, meta, dest_out, T: tl.constexpr,
                      K: tl.constexpr, P: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """block_route's arrays for tokens t0 .. t0 + R - 1 into route()'s layout."""
    ks = tl.arange(0, BK)
    ps = tl.arange(0, BP)
    t = t0 + tl.arange(0, R)
    present = (t < T)[:, None] & (ks < K)[None, :]
    rows_ok = (t < T)[:, None] & (ps < P)[None, :]
    tl.store(before + t[:, None] * P + ps[None, :], first, mask=rows_ok)
    tl.store(slot + t[:, None] * P + ps[None, :], slot_rows, mask=rows_ok)
    tl.store(dest_out + t[:, None] * K + ks[None, :], dest, mask=present)
    for d in range(P):
        tl.store(meta + (t[:, None] * P + d) * K + ks[None, :], tl.where(dest == d, code, -1), mask=present)


@triton.jit
def store_totals(ids, send_counts, masked, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                 SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """send_counts [P, EL + 1] and masked [1] of all T tokens; returns (entries per expert bin [BE],
    tokens per destination [BP]) they were written from."""
    per_bin, tokens_to = count_tokens_before(ids, T, T, K, P, EL, SCAN, BK, BP, BE)
    store_totals_of(per_bin, tokens_to, send_counts, masked, P, EL, BP, BE)
    return per_bin, tokens_to


@triton.jit
def store_totals_of(per_bin, tokens_to, send_counts, masked, P: tl.constexpr, EL: tl.constexpr, BP: tl.constexpr,
                    BE: tl.constexpr):
    """send_counts and masked (store_totals) from all T tokens' counts."""
    E: tl.constexpr = P * EL
    es = tl.arange(0, BE)
    ps = tl.arange(0, BP)
    tl.store(send_counts + (es // EL) * (EL + 1) + es % EL, per_bin, mask=es < E)
    tl.store(send_counts + ps * (EL + 1) + EL, tokens_to, mask=ps < P)
    tl.store(masked, tl.sum(tl.where(es == E, per_bin, 0)))


@triton.jit
def tokens_before_each(ids, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                       SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr):
    """route()'s `before` of every token [SCAN, BP] (T <= SCAN): tokens before it that go to each GPU."""
    ts = tl.arange(0, SCAN)
    _, dest, present = _entries(ids, ts, ts < T, tl.arange(0, BK), K, P * EL, EL)
    goes = _goes(dest, present, tl.arange(0, BP))
    return tl.cumsum(goes, axis=0) - goes


@triton.jit
def route_kernel(ctx, ids, chunk_bins, chunk_tokens, slot, before, meta, dest_out, send_counts, masked,
                 T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, R: tl.constexpr,
                 SCAN: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, CHUNKS: tl.constexpr):
    """ids int32 [T, K] -> slot, before [T, P], meta [T, P, K], dest [T, K], send_counts [P, EL + 1],
    masked [1], as _routing.route returns them. BE: a power of two > P * EL + 1 (one bin per expert,
    one for masked entries, one for absent ones); SCAN: scan_tokens(T). CHUNKS (T > SCAN_TOKENS):
    the earlier tokens counted from chunk_counts_kernel's chunk_bins and chunk_tokens (else not
    read). Launch: grid(), num_warps(), constexprs(). The dispatch kernel runs the same functions
    for its own blocks (_kernels.dispatch_routing_kernel); this kernel is the routing alone."""
    t0 = tl.program_id(0) * R
    last = tl.program_id(0) == tl.num_programs(0) - 1
    if CHUNKS:
        per_bin, tokens_to = counts_from_chunks(ids, chunk_bins, chunk_tokens, t0, T, K, P, EL, SCAN, BK, BP, BE)
        dest, code, slot_rows, first = block_route_after(ids, t0, per_bin, tokens_to, T, K, P, EL, R, BK, BP)
        if last:
            per_bin, tokens_to = counts_from_chunks(ids, chunk_bins, chunk_tokens, T, T, K, P, EL, SCAN, BK, BP, BE)
            store_totals_of(per_bin, tokens_to, send_counts, masked, P, EL, BP, BE)
    else:
        dest, code, slot_rows, first = block_route(ids, t0, T, K, P, EL, R, SCAN, BK, BP, BE)
        if last:
            store_totals(ids, send_counts, masked, T, K, P, EL, SCAN, BK, BP, BE)
    store_block_route(t0, dest, code, slot_rows, first, slot, before, meta, dest_out, T, K, P, R, BK, BP)


def route_alone(topk_ids, plan):
    """route()'s arrays (SourceRoute, masked entries) computed on a GPU through jaxgin.triton_call:
    route_kernel, after chunk_counts_kernel above SCAN_TOKENS tokens. dispatch routes with it where
    it does not route inside its own kernel; tests check the device functions with it at GPU counts
    one GPU cannot dispatch over; benchmarks time it."""
    p, t, k, el = plan.size, plan.tokens, plan.top_k, plan.local_experts
    i32 = lambda *shape: jax.core.ShapedArray(shape, jnp.int32)  # noqa: E731
    ids = topk_ids.astype(jnp.int32)
    launch = constexprs(t, k, p, el)
    chunked = t > SCAN_TOKENS
    if chunked:
        chunks = -(-t // launch["SCAN"])
        chunk_bins, chunk_tokens = triton_call(
            chunk_counts_kernel, ids, grid=(chunks,),
            out_shape=[i32(chunks, launch["BE"]), i32(chunks, launch["BP"])], num_warps=num_warps(t), num_stages=1,
            **chunk_constexprs(launch),
            pure=True,
        )
    else:
        chunk_bins = chunk_tokens = ids  # not read
    slot, before, meta, dest, send_counts, masked = triton_call(
        route_kernel, ids, chunk_bins, chunk_tokens, grid=grid(t),
        out_shape=[i32(t, p), i32(t, p), i32(t, p, k), i32(t, k), i32(p, el + 1), i32(1)],
        num_warps=num_warps(t), num_stages=1, CHUNKS=int(chunked), **launch,
        pure=True,
    )
    return SourceRoute(slot, before, meta, dest, send_counts), masked.reshape(())
