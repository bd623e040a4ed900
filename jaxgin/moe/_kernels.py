"""Triton kernels of MoE dispatch and combine (tritongin device functions for the communication).

One launch per op, so consecutive calls never interleave on a GPU. Both kernels are persistent:
the grid is at most one program per SM and programs loop over work items, because programs wait
for what other programs (of this GPU or of others) sent. No wait may depend on a program that has
not started: another kernel (an XLA collective on another stream, waiting for peers) can hold SMs,
and CUDA starts a grid's programs in no promised order. So dispatch gives out its roles by start
order (senders first: jaxgin.op_kernels.start_order), and senders never wait on placers; combine's
programs claim their work items from a counter, and the one that completes the last raises the
flags. Whatever subset of programs holds SMs, the work that others wait for gets done.

dispatch (routing arithmetic: _routing.py). Up to 256 tokens per GPU the kernel routes itself
(dispatch_routing_kernel, with _routing_device.py's functions): each program routes the token
blocks it sends or places, counting the earlier tokens on its own (no program waits for another's
routing), and program 0 the totals; above, and in jobs with GIN peers, it reads route()'s arrays
made by the routing kernels before it (dispatch_kernel; _routing_device.route_alone).
  1. counts first: program 0 writes this GPU's send counts, and where each of its token blocks'
     rows start in the staging area, into every GPU's counts area and raises this GPU's counts flag
     there; every program routes its first block, then waits for all P, so from then on every GPU
     knows where each source's entries land in its grouped output, and which staging rows each
     source block fills. In the kernel that routes, only placers wait for every GPU's counts:
     program 0 posts the counts alone (no block starts, no block of its own), and the senders,
     which need only their own blocks' routing, send as soon as those counts are out, each writing
     where its block's rows start and end on the peer before the block's flag;
  2. the programs split in two kinds, so that stores bound by NVLink and stores bound by HBM never
     wait behind each other in one SM (a warp stalled on a full NVLink queue stalls its local
     stores too). Senders (a fraction of the SMs) store every token block into this GPU's staging
     area on every other GPU that owns one of its experts, in block order, and raise the block's
     flag there (release). Placers meanwhile put this GPU's own entries from x straight into their
     grouped rows (no staging for this GPU's own tokens) and zero the rows past the last kept
     entry. Then every program, sender or placer, claims the other GPUs' blocks one at a time from
     a counter, in the order they are sent, and places each once its flag is up: each received
     row is copied from staging into the grouped output once per entry that landed here, with its
     positions and weights for combine. Senders that finish first place most.
  With FP8 (dispatch(fp8=True)), senders stage each row as e4m3 values and scales
  (_fp8_device.quantize, store_quantized: fp8.packed_width(H) 16-bit words), placers dequantize
  staged rows into x's dtype as they place them (load_rows), and this GPU's own entries are
  rounded in registers.
combine:
  1. every received token's entries are reduced (weighted, float32) into one row that goes back
     to the GPU it came from, into this GPU's slot of that GPU's return area; programs claim
     these items from a counter, so the step never waits for a program that is not resident;
  2. the program that completes the last item raises this GPU's flag on every GPU (release: every
     program's stores precede it);
  3. every token adds up what each GPU returned for it.

Peers on other hosts (GIN). Each peer's path is picked on the device (jaxgin.op_kernels.gin_route,
shared with the fused kernels); NVLink peers take the stores above. A NIC reads only the symmetric
heap, the network rewards few large transfers, and the NIC is the scarce link, so a token crosses
to each other host once, to that host's network entry for this GPU (jaxgin.hosts), which forwards
it over NVLink:
  - counts: program 0 puts the counts row and the block starts to every GIN peer itself (2 puts,
    signal `sig + me` there); on the receiver, program 0 waits for those 2 arrivals and raises the
    same local counts flag an NVLink peer would have raised, so everything after step 1 is shared;
  - data: senders pack, per other host, the union of what goes to its GPUs in token order
    (exchange routes with route() in such jobs, and _routing.host_union numbers the union's rows):
    each row once with its weights, and per GPU of the host the row's codes and staging row there
    (_send_block). The last sender to finish packing puts each union to the host's entry, into
    relay areas by source (_put_host_unions: 3 + 2 x GPUs-of-the-host puts, signal `sig + P + me`
    there; bare increments for what is empty). After their own blocks, the entry's senders wait
    for each source whose entry they are, copy every row into the staging area for that source of
    each GPU of the host that takes it (its own included), exactly where the source would have
    stored it over NVLink, and raise those GPUs' data_ready flag for the source, which their
    placers wait on instead of the source's per-block flags (_forward_from_network). Senders wait
    only for other GPUs' last packers, which post before they wait for anything but the counts;
  - combine: in reverse, once per host. Program 0 first puts each other host's entry a map of
    where that host's GPUs will keep their rows of this GPU's tokens (_put_union_maps; signal
    `sig + 3P + me` there). Every GPU reduces its rows for a source of another host into its own
    send_back; after its host's GPUs have all reduced, the source's entry sums their rows of each
    token (read over NVLink), rounds once, and puts them home (_forward_union_block: 1 put, or 1
    increment when empty; signal `sig + 2P + me` there). Home waits for 1 arrival per other host
    and sums one row per host; the sum inside a host is why a GIN job's combine may round
    differently from an NVLink job's.
Counts and combine's returns wait with jaxgin.op_kernels.arrivals_to_flag, the maps with
wait_gin_source, the forwarding senders with tgl.wait_arrivals. The counts of arrivals per call are fixed, so the consumed count lives on the
device: right under CUDA-graph replay. Send and relay areas have two halves like the staging
areas: a GPU rewrites half h at call n + 2, after its peers finished call n + 1, so after the NIC
read it and the entry forwarded it.

Buffer reuse across calls (as in jaxgin/fused/_kernels.py): staging/return/counts areas have two
halves picked by a device-side call counter (state[CALLS]) that the last program to finish
advances; a GPU that starts call n + 1 has received a flag of every peer's call n, so every peer
finished call n - 1 and no longer reads the half call n + 1 writes. Flags carry the call number, so
they need no reset. dispatch: state[DISPATCH_STARTED] hands out places in the start order,
state[DISPATCH_FINISHED] counts programs done, state[DISPATCH_PACKED] senders done packing (GIN),
state[DISPATCH_CLAIMED] hands out the other GPUs' blocks to place.
combine: state[COMBINE_COMPLETED] items completed, state[COMBINE_CLAIMED] items claimed,
state[COMBINE_FINISHED] programs done. Every counter is zero when a call starts (the last program
to finish zeroes them), so calls of one configuration may run with different grids (modes,
capacities). Nothing depends on host values, so CUDA-graph replay is right.
"""

import triton
import triton.language as tl

import jaxgin.triton_device.language as tgl
from jaxgin.moe import _fp8_device as fp8_rows
from jaxgin.moe import _routing_device
from jaxgin.op_kernels import (arrivals_to_flag, call_position, claim, finish_call, gin_route, host_place,
                                host_size, network_entry, now_ns, rank_of, start_order, trace_word, wait_gin_source)

# dispatch's state, int64 words zeroed at first: [CALLS (jaxgin.op_kernels), STARTED, FINISHED, PACKED,
# CLAIMED].
DISPATCH_STARTED = tl.constexpr(1)
DISPATCH_FINISHED = tl.constexpr(2)
DISPATCH_PACKED = tl.constexpr(3)
DISPATCH_CLAIMED = tl.constexpr(4)
DISPATCH_STATE_WORDS = 5  # what exchange._buffers allocates
# combine's: [CALLS, COMPLETED, CLAIMED, FINISHED, then with GIN FORWARD_CLAIMED and P words
# FORWARDED by source] (finish_call zeroes COMPLETED onwards: FINISHED among them, already zero).
COMBINE_COMPLETED = tl.constexpr(1)
COMBINE_CLAIMED = tl.constexpr(2)
COMBINE_FINISHED = tl.constexpr(3)
COMBINE_FORWARD_CLAIMED = tl.constexpr(4)
COMBINE_FORWARDED = tl.constexpr(5)
COMBINE_STATE_WORDS = 4  # what exchange._buffers allocates (with GIN: 2 + P more)


@triton.jit
def _column(tile, index, k):
    """tile[:, k] of a [rows, cols] tile (index = arange(cols)), as a [rows] tensor."""
    return tl.sum(tl.where(index[None, :] == k, tile, 0), axis=1)


@triton.jit
def _last_to_arrive(counter, arrivals):
    """Each of `arrivals` programs calls this after its last store to a peer or to a send area.
    Returns whether the caller is the last to arrive; then every program's stores are visible to it
    (acquire), and the flags it sets or puts it posts afterwards release them to the peers."""
    tl.debug_barrier()  # the whole program's stores precede the release below
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="sys")
    last = arrived == arrivals - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last


@triton.jit
def _first_rows(counts, es, ps, source, EL: tl.constexpr):
    """[BE] first grouped row of (local expert e, source) from the received counts [BP, BE]."""
    pairs = tl.where((es < EL)[None, :], counts, 0)  # [BP, BE] entries from source s for expert e
    total = tl.sum(pairs, axis=0)
    base = tl.cumsum(total, axis=0) - total
    return base + tl.sum(tl.where((ps < source)[:, None], pairs, 0), axis=0)


@triton.jit
def _positions(codes, start, C: tl.constexpr, EL: tl.constexpr):
    """Grouped rows of [rows, K] entry codes (local expert + EL * rank; -1: none) given the first
    row of each expert for their source; -1 where nothing lands (no entry, or past capacity)."""
    e = tl.where(codes >= 0, codes % EL, 0)
    first = tl.reshape(tl.gather(start, tl.reshape(e, (e.shape[0] * e.shape[1],)), 0), e.shape)
    pos = first + codes // EL
    return tl.where((codes >= 0) & (pos < C), pos, -1)


@triton.jit
def _block_routing(ids, slot, blk, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, SCAN: tl.constexpr, BR: tl.constexpr,
                   ROUTED: tl.constexpr):
    """Routing of token block `blk`: (slots [BT, BP]: its staging row on each GPU, -1 where it does
    not go; dest, code [BT, BK]: each entry's GPU and code; first [BT, BP]: route()'s `before`).
    ROUTED: computed here from ids (_routing_device.block_route); else slots loaded from route()'s
    arrays, and entries' codes come from its meta (_entry_codes), dest, code and first unused."""
    t = blk * BT + tl.arange(0, BT)
    if ROUTED:
        dest, code, slots, first = _routing_device.block_route(ids, blk * BT, T, K, P, EL, BT, SCAN, BK, BP, BR)
    else:
        ps = tl.arange(0, BP)
        slots = tl.load(slot + t[:, None] * P + ps[None, :], mask=(t < T)[:, None] & (ps < P)[None, :], other=-1)
        dest = tl.full((BT, BK), -1, tl.int32)
        code = dest
        first = slots
    return slots, dest, code, first


@triton.jit
def _sent_totals(ids, send_counts, masked, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                 BK: tl.constexpr, BP: tl.constexpr, SCAN: tl.constexpr, BR: tl.constexpr, ROUTED: tl.constexpr,
                 STARTS: tl.constexpr):
    """ROUTED: what this GPU sends, from ids (send_counts and masked written too): entries per
    expert bin [BR], tokens per GPU [BP], and with STARTS route()'s `before` of every token
    [SCAN, BP] (else zeros). Else zeros (route()'s arrays are read instead: _counts_and_starts)."""
    if ROUTED:
        per_bin, tokens_to = _routing_device.store_totals(ids, send_counts, masked, T, K, P, EL, SCAN, BK, BP, BR)
        if STARTS:
            before_all = _routing_device.tokens_before_each(ids, T, K, P, EL, SCAN, BK, BP)
        else:
            before_all = tl.zeros((SCAN, BP), dtype=tl.int32)
    else:
        per_bin = tl.zeros((BR,), dtype=tl.int32)
        tokens_to = tl.zeros((BP,), dtype=tl.int32)
        before_all = tl.zeros((SCAN, BP), dtype=tl.int32)
    return per_bin, tokens_to, before_all


@triton.jit
def _counts_and_starts(d, send_counts, before, per_bin, tokens_to, before_all, T: tl.constexpr, P: tl.constexpr,
                       EL: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr, BB: tl.constexpr,
                       ROUTED: tl.constexpr):
    """What dispatch tells GPU d first: counts [BE] (this GPU's entries per local expert of d, then
    its tokens sent to d; EL + 1 used) and starts [BB] (the staging row on d where each token
    block's rows start, then the total; TB + 1 used), from _sent_totals (ROUTED) or route()'s arrays."""
    TB: tl.constexpr = (T + BT - 1) // BT
    es = tl.arange(0, BE)
    bs = tl.arange(0, BB)
    ps = tl.arange(0, BP)
    if ROUTED:
        counts = tl.gather(per_bin, d * EL + tl.minimum(es, EL - 1), 0)
        counts = tl.where(es == EL, tl.sum(tl.where(ps == d, tokens_to, 0)), counts)
        starts = tl.gather(_column(before_all, ps, d), tl.minimum(bs * BT, T - 1), 0)
    else:
        counts = tl.load(send_counts + d * (EL + 1) + es, mask=es < EL + 1)
        starts = tl.load(before + tl.minimum(bs * BT, T - 1) * P + d, mask=bs < TB)
    return counts, tl.where(bs < TB, starts, tl.sum(tl.where(es == EL, counts, 0)))


@triton.jit
def _entry_codes(meta, t, d, go, dest, code, K: tl.constexpr, P: tl.constexpr, BK: tl.constexpr,
                 ROUTED: tl.constexpr):
    """[BT, BK] codes of tokens t's entries on GPU d (-1: the entry's expert is elsewhere), for the
    tokens where `go`."""
    ks = tl.arange(0, BK)
    if ROUTED:
        codes = tl.where(go[:, None] & (dest == d), code, -1)
    else:
        codes = tl.load(meta + (t[:, None] * P + d) * K + ks[None, :], mask=go[:, None] & (ks < K)[None, :], other=-1)
    return codes


@triton.jit
def _block_span(earlier, slots, d, BT: tl.constexpr, BP: tl.constexpr):
    """Where a token block's rows start and end among the staging rows of this GPU on GPU d, from
    its routing (earlier [BT, BP]: tokens before each that go to each GPU; slots: -1 where not)."""
    ps = tl.arange(0, BP)
    start = tl.sum(tl.where((tl.arange(0, BT) == 0)[:, None] & (ps == d)[None, :], earlier, 0))
    return start, start + tl.sum(tl.where((ps == d)[None, :] & (slots >= 0), 1, 0))


@triton.jit
def _send_block(ctx, blk, x, slots, dest, code, earlier, meta, weights, route, stage_x, stage_meta, stage_w,
                stage_starts, block_flags, send_x, send_meta, send_w, hslot, hosts, send_slot, me, half, epoch,
                T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, GIN: tl.constexpr, SW: tl.constexpr,
                FP8: tl.constexpr, ROUTED: tl.constexpr, STARTS: tl.constexpr):
    """Token block `blk` into this GPU's staging area on every other GPU that owns one of its
    tokens' experts, then the block's flag there (release); for GIN peers into this GPU's send
    areas for their host instead (put later, whole): each token once per host, at its union row
    hslot[t, d] (_routing.host_union), its row in send_x / send_w of the host's network entry e
    (jaxgin.hosts), and per GPU d of that host the token's codes there and its staging row on d
    (-1: none) in send_meta / send_slot of d. Staged rows are SW elements wide: x's rows, or with
    FP8 their e4m3 values and scales (_fp8_device.store_quantized). Each column step of x is loaded
    (and quantized) once and stored to every destination. STARTS (NVLink peers only): also where
    the block's rows start and end in this GPU's staging rows on the peer (earlier [BT, BP]: tokens
    before each that go to each GPU), before the flag."""
    TB: tl.constexpr = (T + BT - 1) // BT
    ROW_BYTES: tl.constexpr = SW * (stage_x.dtype.element_ty.primitive_bitwidth // 8)
    ROW_ALIGN: tl.constexpr = 16 if ROW_BYTES % 16 == 0 else ROW_BYTES & -ROW_BYTES  # bytes, a power of 2
    ks = tl.arange(0, BK)
    k_ok = ks < K
    hs = tl.arange(0, BH)
    ps = tl.arange(0, BP)
    t = blk * BT + tl.arange(0, BT)
    t_ok = t < T
    w_rows = tl.load(weights + t[:, None] * K + ks[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    # Where row 0 of this GPU's rows lands on each destination, as an address by destination: the
    # peer's address is a chain of dependent loads in the device library, so it is looked up once
    # per block and peer, not once per column step.
    x_at = tl.zeros((BP,), dtype=tl.int64)
    x_rows = slots  # [BT, BP]: each token's row in what is stored for d (-1: no store for d)
    for d in range(P):
        if d != me:
            sl = _column(slots, ps, d)
            go = sl >= 0
            peer = rank_of(route, d)
            codes = _entry_codes(meta, t, d, go, dest, code, K, P, BK, ROUTED)
            if gin_route(ctx, route, d, me, GIN) != 0:
                u = tl.load(hslot + t * P + d, mask=t_ok, other=-1)
                in_union = u >= 0
                e = network_entry(route, hosts, me, d, P, BP)
                mine = (half * P + d) * T + u
                tl.store(send_meta + mine[:, None] * K + ks[None, :], codes, mask=in_union[:, None] & k_ok[None, :])
                tl.store(send_slot + mine, sl, mask=in_union)
                first = (half * P + e) * T
                w_to = send_w
                x_to = send_x
                row = first + u
                go = in_union
                x_rows = tl.where((ps == d)[None, :], tl.where(e == d, u, -1)[:, None], x_rows)  # once per host
            else:
                first = (half * P + me) * T
                meta_to = tgl.peer_ptr(ctx, stage_meta, peer)
                w_to = tgl.peer_ptr(ctx, stage_w, peer)
                x_to = tgl.peer_ptr(ctx, stage_x, peer)
                row = first + sl
                tl.store(meta_to + row[:, None] * K + ks[None, :], codes, mask=go[:, None] & k_ok[None, :])
            tl.store(w_to + row[:, None] * K + ks[None, :], w_rows, mask=go[:, None] & k_ok[None, :])
            x_at = tl.where(ps == d, (x_to + first.to(tl.int64) * SW).to(tl.int64), x_at)
    remote = tl.max(tl.where((ps != me)[None, :], x_rows, -1), axis=1) >= 0  # [BT] rows some peer takes
    for h0 in range(0, H, BH):
        h = h0 + hs
        h_ok = h < H
        rows = tl.load(x + t[:, None].to(tl.int64) * H + h[None, :], mask=remote[:, None] & h_ok[None, :],
                       other=0.0)
        if FP8:
            q, scale = fp8_rows.quantize(rows, BT, BH)
        for d in range(P):
            if d != me:
                sl = _column(x_rows, ps, d)
                go = sl >= 0
                # x_at's addresses are rows of 16-byte aligned areas, SW * XB bytes apart: saying
                # so lets Triton store 16 bytes at a time (a sum of addresses tells it nothing)
                to = tl.multiple_of(tl.sum(tl.where(ps == d, x_at, 0)).to(stage_x.dtype), ROW_ALIGN)
                if FP8:
                    fp8_rows.store_quantized(to, sl, q, scale, h0, go, H, SW, BT, BH)
                else:
                    tl.store(to + sl.to(tl.int64)[:, None] * SW + h[None, :], rows, mask=go[:, None] & h_ok[None, :])
    for d in range(P):
        if d != me:
            if gin_route(ctx, route, d, me, GIN) == 0:
                if STARTS:
                    there = tgl.peer_ptr(ctx, stage_starts, rank_of(route, d)) + (half * P + me) * (T + 1) + blk
                    start, end = _block_span(earlier, slots, d, BT, BP)
                    tl.store(there, start)
                    tl.store(there + 1, end)
                tgl.set_flag(ctx, block_flags + me * TB + blk, epoch + 1, rank_of(route, d))


@triton.jit
def _put_host_unions(ctx, route, hosts, hrows, send_x, send_meta, send_w, send_slot, send_n, relay_x, relay_meta,
                     relay_w, relay_slot, relay_n, sig, me, half, T: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
                     BP: tl.constexpr, SW: tl.constexpr, XB: tl.constexpr, L: tl.constexpr):
    """CTA-collective, by the last sender to finish packing: to the network entry e of each other
    host, that host's union (_send_block) into this GPU's relay areas there: per GPU d of the host
    its codes and staging rows (2 puts), then the union's row count, rows and weights (3 puts),
    each +1 on e's signal `sig + P + me` (bare increments for what is empty)."""
    for d in range(P):
        if gin_route(ctx, route, d, me, 1) != 0:
            e = network_entry(route, hosts, me, d, P, BP)
            entry = rank_of(route, e)
            n = tl.load(hrows + d).to(tl.int64)
            mine = ((half * P + d) * T).to(tl.int64)
            there = (((half * P + me) * L + host_place(route, hosts, d, P, BP)) * T).to(tl.int64)
            if n > 0:
                tgl.put_signal(ctx, relay_meta + there * K, send_meta + mine * K, n * K * 4, entry, sig + P + me)
                tgl.put_signal(ctx, relay_slot + there, send_slot + mine, n * 4, entry, sig + P + me)
            else:
                tgl.signal(ctx, entry, sig + P + me, 2)
            if e == d:  # once per host
                tl.store(send_n + half * P + d, n.to(tl.int32))
                tl.debug_barrier()  # the count is in memory before the put reads it
                tgl.put_signal(ctx, relay_n + half * P + me, send_n + half * P + d, 4, entry, sig + P + me)
                rows = ((half * P + me) * T).to(tl.int64)
                if n > 0:
                    tgl.put_signal(ctx, relay_x + rows * SW, send_x + mine * SW, n * SW * XB, entry, sig + P + me)
                    tgl.put_signal(ctx, relay_w + rows * K, send_w + mine * K, n * K * 4, entry, sig + P + me)
                else:
                    tgl.signal(ctx, entry, sig + P + me, 2)


@triton.jit
def _heap_of(ctx, route, array, d, me):
    """`array` (a heap buffer) of axis index d, an NVLink peer or this GPU (then its own address,
    which this GPU's placers read through)."""
    at = array
    if d != me:
        at = tgl.peer_ptr(ctx, array, rank_of(route, d))
    return at


@triton.jit
def _forward_from_network(ctx, pid, route, hosts, stage_x, stage_meta, stage_w, data_ready, relay_x, relay_meta,
                          relay_w, relay_slot, relay_n, sig, me, half, epoch, T: tl.constexpr, K: tl.constexpr,
                          P: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                          NS: tl.constexpr, SW: tl.constexpr, L: tl.constexpr):
    """Senders, after their own blocks: for each source of another host whose network entry this
    GPU is (a source per sender, round robin), waits for its union's puts, then copies each row
    into the staging area for that source of every GPU of this host that takes it (NVLink stores;
    this GPU's own too), in the layout the source would have written, and raises their data flags
    for it. The waits end: every GPU's last packer posts its puts before it waits for any."""
    ks = tl.arange(0, BK)
    k_ok = ks < K
    hs = tl.arange(0, BH)
    ps = tl.arange(0, BP)
    for s in range(pid, P, NS):
        if gin_route(ctx, route, s, me, 1) != 0:
            if network_entry(route, hosts, s, me, P, BP) == me:
                tgl.wait_arrivals(ctx, sig + P + s, 3 + 2 * host_size(route, hosts, me, P, BP))
                n = tl.load(relay_n + half * P + s, cache_modifier=".cg")
                src = (half * P + s) * T
                for u0 in range(0, n, BT):
                    u = u0 + tl.arange(0, BT)
                    u_ok = u < n
                    w = tl.load(relay_w + (src + u)[:, None] * K + ks[None, :], mask=u_ok[:, None] & k_ok[None, :],
                                other=0.0, cache_modifier=".cg")
                    to_rows = tl.full((BT, BP), -1, tl.int32)  # each row's staging row on each GPU here
                    for d in range(P):
                        if gin_route(ctx, route, d, me, 1) == 0:  # this host's GPUs, this one included
                            at = ((half * P + s) * L + host_place(route, hosts, d, P, BP)) * T + u
                            sl = tl.load(relay_slot + at, mask=u_ok, other=-1, cache_modifier=".cg")
                            go = sl >= 0
                            codes = tl.load(relay_meta + at[:, None] * K + ks[None, :],
                                            mask=go[:, None] & k_ok[None, :], other=-1, cache_modifier=".cg")
                            row = src + sl
                            tl.store(_heap_of(ctx, route, stage_meta, d, me) + row[:, None] * K + ks[None, :], codes,
                                     mask=go[:, None] & k_ok[None, :])
                            tl.store(_heap_of(ctx, route, stage_w, d, me) + row[:, None] * K + ks[None, :], w,
                                     mask=go[:, None] & k_ok[None, :])
                            to_rows = tl.where((ps == d)[None, :], sl[:, None], to_rows)
                    for h0 in range(0, SW, BH):
                        h = h0 + hs
                        h_ok = h < SW
                        rows = tl.load(relay_x + (src + u).to(tl.int64)[:, None] * SW + h[None, :],
                                       mask=u_ok[:, None] & h_ok[None, :], cache_modifier=".cg")
                        for d in range(P):
                            if gin_route(ctx, route, d, me, 1) == 0:
                                sl = _column(to_rows, ps, d)
                                to = _heap_of(ctx, route, stage_x, d, me)
                                tl.store(to + (src + sl).to(tl.int64)[:, None] * SW + h[None, :], rows,
                                         mask=(sl >= 0)[:, None] & h_ok[None, :])
                for d in range(P):
                    if gin_route(ctx, route, d, me, 1) == 0:
                        tgl.set_flag(ctx, data_ready + s, epoch + 1, rank_of(route, d))


@triton.jit
def _place_own_block(blk, x, slots, dest, code, meta, weights, out_x, out_pos, out_w, me, my_start, my_rows,
                     T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                     C: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                     FP8: tl.constexpr, ROUTED: tl.constexpr):
    """This GPU's own entries of token block `blk`, from x straight into their grouped rows (with
    FP8 rounded as the other GPUs' rows are: quantized and dequantized in registers)."""
    ks = tl.arange(0, BK)
    k_ok = ks < K
    hs = tl.arange(0, BH)
    t = blk * BT + tl.arange(0, BT)
    mine = _column(slots, tl.arange(0, BP), me)  # own row of each token, -1: no entry here
    here = (mine >= 0)[:, None] & k_ok[None, :]
    w_rows = tl.load(weights + t[:, None] * K + ks[None, :], mask=here, other=0.0)
    codes = _entry_codes(meta, t, me, mine >= 0, dest, code, K, P, BK, ROUTED)
    pos = _positions(codes, my_start, C, EL)
    tl.store(out_pos + (me * T + mine)[:, None] * K + ks[None, :], pos, mask=here)
    tl.store(out_w + (me * T + mine)[:, None] * K + ks[None, :], tl.where(pos >= 0, w_rows, 0.0), mask=here)
    _no_rows_past(out_pos, out_w, me, blk, my_rows, T, K, BT, BK)
    for h0 in range(0, H, BH):
        h = h0 + hs
        h_ok = h < H
        rows = tl.load(x + t[:, None].to(tl.int64) * H + h[None, :], mask=(mine >= 0)[:, None] & h_ok[None, :],
                       other=0.0)
        if FP8:
            q, scale = fp8_rows.quantize(rows, BT, BH)
            rows = fp8_rows.dequantize(q, scale, out_x.dtype.element_ty, BT, BH)
        for k in tl.static_range(K):
            pk = _column(pos, ks, k)
            tl.store(out_x + pk[:, None].to(tl.int64) * H + h[None, :], rows, mask=(pk >= 0)[:, None] & h_ok[None, :])


@triton.jit
def _no_rows_past(out_pos, out_w, source, blk, rows, T: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr):
    """Rows of block `blk`'s range at or past `rows` (what `source` sent here) hold no entry."""
    ks = tl.arange(0, BK)
    r = blk * BT + tl.arange(0, BT)
    empty = ((r >= rows) & (r < T))[:, None] & (ks < K)[None, :]
    tl.store(out_pos + (source * T + r)[:, None] * K + ks[None, :], tl.full((BT, BK), -1, tl.int32), mask=empty)
    tl.store(out_w + (source * T + r)[:, None] * K + ks[None, :], tl.zeros((BT, BK), tl.float32), mask=empty)


@triton.jit
def _place_block(ctx, blk, s, me, route, stage_x, stage_meta, stage_w, stage_starts, block_flags, data_ready,
                 out_x, out_pos, out_w, half, epoch, counts, rows_from,
                 T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                 C: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                 BE: tl.constexpr, GIN: tl.constexpr, SW: tl.constexpr, FP8: tl.constexpr):
    """Dispatch step 2, placing: token block `blk` of GPU s (not this one), once its flag is up (for
    a source on another host: once this host's network entry for it has placed all its rows here)."""
    TB: tl.constexpr = (T + BT - 1) // BT
    ks = tl.arange(0, BK)
    k_ok = ks < K
    hs = tl.arange(0, BH)
    ps = tl.arange(0, BP)
    es = tl.arange(0, BE)
    if gin_route(ctx, route, s, me, GIN) != 0:
        tgl.wait_flag(ctx, data_ready + s, epoch + 1)
    else:
        tgl.wait_flag(ctx, block_flags + s * TB + blk, epoch + 1)
    starts = stage_starts + (half * P + s) * (T + 1) + blk
    first = tl.load(starts, cache_modifier=".cg")
    r = first + tl.arange(0, BT)
    r_ok = r < tl.load(starts + 1, cache_modifier=".cg")
    srow = (half * P + s) * T + r
    present = r_ok[:, None] & k_ok[None, :]
    codes = tl.load(stage_meta + srow[:, None] * K + ks[None, :], mask=present, other=-1, cache_modifier=".cg")
    w = tl.load(stage_w + srow[:, None] * K + ks[None, :], mask=present, other=0.0, cache_modifier=".cg")
    pos = _positions(codes, _first_rows(counts, es, ps, s, EL), C, EL)
    tl.store(out_pos + (s * T + r)[:, None] * K + ks[None, :], pos, mask=present)
    tl.store(out_w + (s * T + r)[:, None] * K + ks[None, :], tl.where(pos >= 0, w, 0.0), mask=present)
    _no_rows_past(out_pos, out_w, s, blk, tl.sum(tl.where(ps == s, rows_from, 0)), T, K, BT, BK)
    for h0 in range(0, H, BH):
        h = h0 + hs
        h_ok = h < H
        if FP8:
            rows = fp8_rows.load_rows(stage_x, srow, h0, r_ok, out_x.dtype.element_ty, H, SW, BT, BH)
        else:
            rows = tl.load(stage_x + srow[:, None].to(tl.int64) * SW + h[None, :],
                           mask=r_ok[:, None] & h_ok[None, :], cache_modifier=".cg")
        for k in tl.static_range(K):
            pk = _column(pos, ks, k)
            tl.store(out_x + pk[:, None].to(tl.int64) * H + h[None, :], rows, mask=(pk >= 0)[:, None] & h_ok[None, :])


@triton.jit
def _received_counts(stage_counts, half, P: tl.constexpr, EL: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Every GPU's counts for this one (once their flags are up): [BP, BE] entries by source and
    local expert, then the source's rows in column EL; and the rows from each source [BP]."""
    ps = tl.arange(0, BP)
    es = tl.arange(0, BE)
    counts = tl.load(stage_counts + (half * P + ps[:, None]) * (EL + 1) + es[None, :],
                     mask=(ps < P)[:, None] & (es < EL + 1)[None, :], other=0, cache_modifier=".cg")
    return counts, tl.sum(tl.where((es == EL)[None, :], counts, 0), axis=1)


@triton.jit
def _place_claimed_blocks(ctx, state, route, stage_x, stage_meta, stage_w, stage_starts, block_flags, data_ready,
                          out_x, out_pos, out_w, me, half, epoch, counts, rows_from,
                          T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr,
                          C: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                          BE: tl.constexpr, GIN: tl.constexpr, SW: tl.constexpr, FP8: tl.constexpr):
    """Dispatch step 2, placing, for every program once its own work is done: the other GPUs' token
    blocks, claimed one at a time from state[DISPATCH_CLAIMED] in block order (the order senders
    send them), so placers and senders that finish early share what is left."""
    TB: tl.constexpr = (T + BT - 1) // BT
    ITEMS: tl.constexpr = (P - 1) * TB
    item = claim(state + DISPATCH_CLAIMED)
    while item < ITEMS:
        other = item % (P - 1)
        _place_block(ctx, item // (P - 1), other + (other >= me).to(tl.int32), me, route, stage_x, stage_meta,
                     stage_w, stage_starts, block_flags, data_ready, out_x, out_pos, out_w, half, epoch, counts,
                     rows_from, T, H, K, P, EL, C, BT, BH, BK, BP, BE, GIN, SW, FP8)
        item = claim(state + DISPATCH_CLAIMED)


@triton.jit
def dispatch_kernel(
    ctx, x, slot, before, meta, weights, send_counts, route, hslot, hrows, hosts,
    stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
    send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
    send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
    out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
    BZ: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    SW: tl.constexpr, FP8: tl.constexpr, L: tl.constexpr,
):
    """dispatch of x along a routing computed before (route()'s arrays slot, before, meta,
    send_counts; with GIN, _routing.host_union's hslot, hrows and the ranks' hosts: _dispatch
    tells the rest)."""
    _dispatch(ctx, x, x, slot, before, meta, out_dropped, weights, send_counts, out_dropped, route,
              hslot, hrows, hosts,
              stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
              send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
              send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
              out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, out_dropped,
              T, H, K, P, EL, C, BT, BH, BK, BP, BE, BZ, BB, NS, XB, GIN, SW, FP8, L, 0, 1, 1, 0)


@triton.jit
def dispatch_traced_kernel(
    ctx, x, slot, before, meta, weights, send_counts, route, hslot, hrows, hosts,
    stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
    send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
    send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
    out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, trace,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
    BZ: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    SW: tl.constexpr, FP8: tl.constexpr, L: tl.constexpr,
):
    """dispatch_kernel that also writes dispatch_routing_traced_kernel's records into trace (its
    "first block routed" word: the first block's routing loaded)."""
    _dispatch(ctx, x, x, slot, before, meta, out_dropped, weights, send_counts, out_dropped, route,
              hslot, hrows, hosts,
              stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
              send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
              send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
              out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, trace,
              T, H, K, P, EL, C, BT, BH, BK, BP, BE, BZ, BB, NS, XB, GIN, SW, FP8, L, 0, 1, 1, 1)


@triton.jit
def dispatch_routing_kernel(
    ctx, x, ids, weights, route,
    stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
    send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
    send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
    out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped,
    slot, before, meta, dest, send_counts, masked,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
    BZ: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    SW: tl.constexpr, FP8: tl.constexpr, L: tl.constexpr, SCAN: tl.constexpr, BR: tl.constexpr,
):
    """dispatch of x along ids int32 [T, K], routed here: every program routes the token blocks it
    sends or places (_routing_device.block_route, counting the earlier tokens itself), and program
    0 the totals it sends first, so no routing kernel runs before. Also writes route()'s arrays
    (slot, before, meta, dest, send_counts, masked: outputs here) for combine and the gradients.
    T <= SCAN = _routing_device.scan_tokens(T); BR = _routing_device.constexprs()'s BE. Jobs with
    GIN peers route with route() and dispatch_kernel (GIN must be 0 here)."""
    tl.static_assert(GIN == 0, "dispatch across hosts needs route()'s host unions: dispatch_kernel")
    _dispatch(ctx, x, ids, slot, before, meta, dest, weights, send_counts, masked, route,
              slot, slot, slot,  # no host unions: never read with GIN = 0
              stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
              send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
              send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
              out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, masked,
              T, H, K, P, EL, C, BT, BH, BK, BP, BE, BZ, BB, NS, XB, GIN, SW, FP8, L, 1, SCAN, BR, 0)


@triton.jit
def dispatch_routing_traced_kernel(
    ctx, x, ids, weights, route,
    stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
    send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
    send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
    out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped,
    slot, before, meta, dest, send_counts, masked, trace,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
    BZ: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    SW: tl.constexpr, FP8: tl.constexpr, L: tl.constexpr, SCAN: tl.constexpr, BR: tl.constexpr,
):
    """dispatch_routing_kernel that also writes a record per program into trace (int32 [programs,
    16]; tools/profile_moe.py --trace-dispatch: where the kernel's time goes). Words, by place in
    the start order (senders first), ns of the GPU's global timer: start, counts posted (place 0;
    else 0), first block routed, every GPU's counts seen, own work done (a sender: its blocks
    sent; a placer: this GPU's entries placed), unused rows zeroed (a sender: as own work), its
    share of the other GPUs' blocks placed, end."""
    tl.static_assert(GIN == 0, "dispatch across hosts needs route()'s host unions: dispatch_kernel")
    _dispatch(ctx, x, ids, slot, before, meta, dest, weights, send_counts, masked, route,
              slot, slot, slot,  # no host unions: never read with GIN = 0
              stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
              send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
              send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
              out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, trace,
              T, H, K, P, EL, C, BT, BH, BK, BP, BE, BZ, BB, NS, XB, GIN, SW, FP8, L, 1, SCAN, BR, 1)


@triton.jit
def _dispatch(
    ctx, x, ids, slot, before, meta, dest_out, weights, send_counts, masked, route, hslot, hrows, hosts,
    stage_x, stage_meta, stage_w, stage_counts, stage_starts, flags, block_flags, state,
    send_x, send_meta, send_w, send_head, send_starts, data_ready, sig,
    send_slot, send_n, relay_x, relay_meta, relay_w, relay_slot, relay_n,
    out_x, out_pos, out_w, out_expert_counts, out_rows, out_dropped, trace,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr, EL: tl.constexpr, C: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr,
    BZ: tl.constexpr, BB: tl.constexpr, NS: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    SW: tl.constexpr, FP8: tl.constexpr, L: tl.constexpr, ROUTED: tl.constexpr, SCAN: tl.constexpr,
    BR: tl.constexpr, TRACE: tl.constexpr,
):
    """x [T, H] -> out_x [C, H] grouped by local expert. On every GPU: staging stage_x [2, P, T, SW],
    stage_meta / stage_w [2, P, T, K], stage_counts [2, P, EL + 1], stage_starts [2, P, T + 1]
    (half, source, row or block: staging row where each block's rows start, then the total);
    flags [P] (counts, by source); block_flags [P, TB] (by source and token block).
    out_pos / out_w [P, T, K]: where entry k of the row from source s landed (-1: nowhere) and its
    weight (0 where nowhere); out_expert_counts [EL]; out_rows [P] rows per source; out_dropped [1].
    BB: a power of two > T / BT, the blocks as one vector. NS: programs that send (0 when P = 1),
    fewer than the grid; the others place. SW, XB: elements per staged row and bytes per element: H
    and x's item size, or with FP8 (rows staged as e4m3 values and scales, jaxgin.moe.fp8's packed
    layout, and placed dequantized: _fp8_device.py) fp8.packed_width(H) 16-bit words and 2. The
    staging and send areas hold SW-element rows.
    GIN (1 when the job has GIN peers; else the send and relay areas are not used and may be any
    buffers): send_x / send_meta / send_w / send_head / send_starts shaped like the staging areas,
    indexed by destination instead of source, send_slot [2, P, T] and send_n [2P] (_send_block:
    rows by union row, x and weights under the host's entry, codes and staging rows under each GPU
    of the host); relay_x / relay_w like the staging areas, relay_meta [2, P, L, T, K] and
    relay_slot [2, P, L, T] (by source, then the GPU's place on this host: jaxgin.op_kernels.
    host_place; L: the most GPUs of one host), relay_n [2P]: what the sources of other hosts put
    here when this GPU is their network entry (_forward_from_network); data_ready [P] flags by
    source; signals sig .. sig + 2P - 1. TRACE: records into trace (dispatch_routing_traced_kernel)."""
    TB: tl.constexpr = (T + BT - 1) // BT
    # EARLY (the routing kernel, with senders; step 1 above): place 0 posts the counts alone,
    # places 1 .. NS - 1 send once they are out, and the first placer writes the count outputs.
    EARLY: tl.constexpr = ROUTED == 1 and NS > 1
    FIRST_SENDER: tl.constexpr = 1 if EARLY else 0
    WRITER: tl.constexpr = NS if EARLY else 0
    SEND_STEP: tl.constexpr = NS - FIRST_SENDER if NS > 0 else 1
    nprog = tl.num_programs(0)
    me, epoch, half = call_position(route, state)
    # Roles by the order programs started (senders first), so that a placer's waits point only
    # at programs that have started, here and on the peers (jaxgin.op_kernels.start_order).
    pid = start_order(state + DISPATCH_STARTED)
    started = now_ns(TRACE)
    posted = started * 0
    my_rank = rank_of(route, me)
    hs = tl.arange(0, BH)
    ps = tl.arange(0, BP)
    es = tl.arange(0, BE)
    bs = tl.arange(0, BB)

    # 1. Counts and block starts first.
    if pid == 0:
        per_bin, tokens_to, before_all = _sent_totals(ids, send_counts, masked, T, K, P, EL, BK, BP, SCAN, BR, ROUTED,
                                                      not EARLY)
        for d in range(P):
            peer = rank_of(route, d)
            counts, starts = _counts_and_starts(d, send_counts, before, per_bin, tokens_to, before_all,
                                                T, P, EL, BT, BP, BE, BB, ROUTED)
            if gin_route(ctx, route, d, me, GIN) != 0:
                out_row = half * P + d
                there = half * P + me
                tl.store(send_head + out_row * (EL + 1) + es, counts, mask=es < EL + 1)
                tl.store(send_starts + out_row * (T + 1) + bs, starts, mask=bs <= TB)
                tgl.put_signal(ctx, stage_counts + there * (EL + 1), send_head + out_row * (EL + 1), (EL + 1) * 4,
                               peer, sig + me)
                tgl.put_signal(ctx, stage_starts + there * (T + 1), send_starts + out_row * (T + 1), (TB + 1) * 4,
                               peer, sig + me)
            else:
                tl.store(tgl.peer_ptr(ctx, stage_counts, peer) + (half * P + me) * (EL + 1) + es, counts,
                         mask=es < EL + 1)
                if not EARLY:
                    tl.store(tgl.peer_ptr(ctx, stage_starts, peer) + (half * P + me) * (T + 1) + bs, starts,
                             mask=bs <= TB)
                tgl.set_flag(ctx, flags + me, epoch + 1, peer)
        if GIN:  # what GIN sources put arrives counted: raise their counts flags here
            for s in range(P):
                if gin_route(ctx, route, s, me, GIN) != 0:
                    arrivals_to_flag(ctx, sig + s, 2, flags + s, epoch + 1, my_rank)
        posted = now_ns(TRACE)
    # The first block this program sends or places is routed while the counts travel.
    blk = tl.where(pid < NS, pid - FIRST_SENDER, pid - NS)
    blk = tl.where(blk < 0, TB, blk)  # EARLY's place 0: no block
    slots, dest, code, first = _block_routing(ids, slot, blk, T, K, P, EL, BT, BK, BP, SCAN, BR, ROUTED)
    routed = now_ns(TRACE)
    if pid >= NS * FIRST_SENDER:  # everyone, or with EARLY only the placers
        for source in range(P):
            tgl.wait_flag(ctx, flags + source, epoch + 1)
    elif pid > 0:  # EARLY's senders: this GPU's counts are out
        tgl.wait_flag(ctx, flags + me, epoch + 1)
    counted = now_ns(TRACE)
    counts, rows_from = _received_counts(stage_counts, half, P, EL, BP, BE)
    my_start = _first_rows(counts, es, ps, me, EL)
    my_rows = tl.sum(tl.where(ps == me, rows_from, 0))
    total = tl.sum(tl.where((es < EL)[None, :], counts, 0), axis=0)  # [BE] entries per local expert

    # 2. Senders: every token block to the other GPUs, in block order.
    if NS > 0:
        sending = pid < NS
    else:
        sending = False  # one GPU: no sender code (Triton 3.6 failed to compile it for NS = 0)
    if sending:
        while blk < TB:
            _send_block(ctx, blk, x, slots, dest, code, first, meta, weights, route, stage_x, stage_meta, stage_w,
                        stage_starts, block_flags, send_x, send_meta, send_w, hslot, hosts, send_slot, me, half, epoch,
                        T, H, K, P, BT, BH, BK, BP, GIN, SW, FP8, ROUTED, EARLY)
            blk += SEND_STEP
            if blk < TB:
                slots, dest, code, first = _block_routing(ids, slot, blk, T, K, P, EL, BT, BK, BP, SCAN, BR, ROUTED)
        own_done = now_ns(TRACE)
        zeroed = own_done
        if GIN:
            # The last sender to finish packing puts each other host's union to its network entry
            # there: 3 + 2 x (GPUs of that host) arrivals (_forward_from_network).
            if _last_to_arrive(state + DISPATCH_PACKED, NS):
                _put_host_unions(ctx, route, hosts, hrows, send_x, send_meta, send_w, send_slot, send_n, relay_x,
                                 relay_meta, relay_w, relay_slot, relay_n, sig, me, half, T, K, P, BP, SW, XB, L)
            _forward_from_network(ctx, pid, route, hosts, stage_x, stage_meta, stage_w, data_ready, relay_x,
                                  relay_meta, relay_w, relay_slot, relay_n, sig, me, half, epoch,
                                  T, K, P, BT, BH, BK, BP, NS, SW, L)
        if EARLY:  # these senders waited only for this GPU's counts; placing needs every GPU's
            for source in range(P):
                tgl.wait_flag(ctx, flags + source, epoch + 1)
            counts, rows_from = _received_counts(stage_counts, half, P, EL, BP, BE)
    else:
        # 3. Placers: this GPU's own entries, then the unused rows.
        q = pid - NS
        placers = nprog - NS
        while blk < TB:
            _place_own_block(blk, x, slots, dest, code, meta, weights, out_x, out_pos, out_w, me, my_start, my_rows,
                             T, H, K, P, EL, C, BT, BH, BK, BP, FP8, ROUTED)
            if ROUTED:
                _routing_device.store_block_route(blk * BT, dest, code, slots, first, slot, before, meta, dest_out,
                                                  T, K, P, BT, BK, BP)
            blk += placers
            if blk < TB:
                slots, dest, code, first = _block_routing(ids, slot, blk, T, K, P, EL, BT, BK, BP, SCAN, BR, ROUTED)
        own_done = now_ns(TRACE)
        filled = tl.minimum(tl.sum(total), C)
        for zb in range(q, (C + BZ - 1) // BZ, placers):
            z = zb * BZ + tl.arange(0, BZ)
            if zb * BZ + BZ > filled:
                z_ok = (z >= filled) & (z < C)
                for h0 in range(0, H, BH):
                    h = h0 + hs
                    tl.store(out_x + z[:, None].to(tl.int64) * H + h[None, :],
                             tl.zeros((BZ, BH), dtype=out_x.dtype.element_ty), mask=z_ok[:, None] & (h < H)[None, :])
        zeroed = now_ns(TRACE)
    if P > 1:  # 4. Everyone: the other GPUs' blocks as they land.
        _place_claimed_blocks(ctx, state, route, stage_x, stage_meta, stage_w, stage_starts, block_flags, data_ready,
                              out_x, out_pos, out_w, me, half, epoch, counts, rows_from,
                              T, H, K, P, EL, C, BT, BH, BK, BP, BE, GIN, SW, FP8)
    placed = now_ns(TRACE)
    if pid == WRITER:
        base = tl.cumsum(total, axis=0) - total
        kept = tl.minimum(tl.maximum(C - base, 0), total)
        tl.store(out_expert_counts + es, kept, mask=es < EL)
        tl.store(out_rows + ps, rows_from, mask=ps < P)
        tl.store(out_dropped, tl.sum(total) - tl.sum(kept))
    if TRACE:
        trace_word(trace, pid, 0, started)
        trace_word(trace, pid, 1, posted)
        trace_word(trace, pid, 2, routed)
        trace_word(trace, pid, 3, counted)
        trace_word(trace, pid, 4, own_done)
        trace_word(trace, pid, 5, zeroed)
        trace_word(trace, pid, 6, placed)
        trace_word(trace, pid, 7, now_ns(TRACE))
    # STARTED .. CLAIMED (FINISHED and PACKED are zero by then: rezeroed, harmless)
    finish_call(state, state + DISPATCH_FINISHED, epoch, nprog, state + DISPATCH_STARTED, 4)


@triton.jit
def _put_union_maps(ctx, route, hosts, union_map, send_map, map_recv, sig, me, half, P: tl.constexpr,
                    BP: tl.constexpr, MW: tl.constexpr, BM: tl.constexpr, L: tl.constexpr):
    """CTA-collective. To the network entry e of each other host (jaxgin.hosts), which returns one
    row per token of this GPU that went there: where each GPU of that host keeps its partial of
    each such token. union_map [P, MW] (exchange._union_maps, under e's axis index): the union's
    row count n, then n x L staging rows (-1: none on that GPU). Copied into the heap (a NIC reads
    only the heap), then 1 put of 1 + n L words into map_recv [half, me] there, +1 on e's
    `sig + P + me`."""
    for d in range(P):
        if gin_route(ctx, route, d, me, 1) != 0:
            if network_entry(route, hosts, me, d, P, BP) == d:
                n = tl.load(union_map + d * MW)
                words = 1 + n * L
                mine = send_map + (half * P + d) * MW
                for w0 in range(0, words, BM):
                    w = w0 + tl.arange(0, BM)
                    tl.store(mine + w, tl.load(union_map + d * MW + w, mask=w < words), mask=w < words)
                tl.debug_barrier()  # the map is in memory before the put reads it
                tgl.put_signal(ctx, map_recv + (half * P + me) * MW, mine, words * 4, rank_of(route, d), sig + P + me)


@triton.jit
def _forward_union_block(ctx, route, hosts, back, flags, send_back, send_union, map_recv, state, sig, s, blk, me,
                         half, epoch, T: tl.constexpr, H: tl.constexpr, P: tl.constexpr, BT: tl.constexpr,
                         BH: tl.constexpr, BP: tl.constexpr, MW: tl.constexpr, XB: tl.constexpr, L: tl.constexpr):
    """Forwarding item (s, blk) of a source s on another host whose network entry this GPU is:
    block blk of the rows that go back to s, each the sum (float32, rounded once) of the partials
    that this host's GPUs reduced for one token of s (their send_back rows for s, read over
    NVLink, at the staging rows s's map gives). The program that completes s's last block puts
    all of them (1 put, or a bare increment when none) into s's return area, at this GPU's slot,
    +1 on s's `sig + me`."""
    TB: tl.constexpr = (T + BT - 1) // BT
    ps = tl.arange(0, BP)
    hs = tl.arange(0, BH)
    for d in range(P):  # the host's GPUs have reduced (their partials for s are in place)
        if gin_route(ctx, route, d, me, 1) == 0:
            tgl.wait_flag(ctx, flags + d, epoch + 1)
    wait_gin_source(ctx, flags + 2 * P + s, sig + P + s, 1, flags + P + s, epoch + 1, rank_of(route, me))
    got = map_recv + (half * P + s) * MW
    n = tl.load(got, cache_modifier=".cg")
    u = blk * BT + tl.arange(0, BT)
    u_ok = u < n
    rows = tl.full((BT, BP), -1, tl.int32)  # each union row's partial row on each GPU of the host
    for d in range(P):
        if gin_route(ctx, route, d, me, 1) == 0:
            sl = tl.load(got + 1 + u * L + host_place(route, hosts, d, P, BP), mask=u_ok, other=-1, cache_modifier=".cg")
            rows = tl.where((ps == d)[None, :], sl[:, None], rows)
    first = ((half * P + s) * T).to(tl.int64)
    for h0 in range(0, H, BH):
        h = h0 + hs
        h_ok = h < H
        acc = tl.zeros((BT, BH), dtype=tl.float32)
        for d in range(P):
            if gin_route(ctx, route, d, me, 1) == 0:
                sl = _column(rows, ps, d)
                at = _heap_of(ctx, route, send_back, d, me)
                v = tl.load(at + (first + sl)[:, None] * H + h[None, :], mask=(sl >= 0)[:, None] & h_ok[None, :],
                            other=0.0, cache_modifier=".cg")
                acc += v.to(tl.float32)
        tl.store(send_union + (first + u)[:, None] * H + h[None, :], acc.to(send_union.dtype.element_ty),
                 mask=u_ok[:, None] & h_ok[None, :])
    tl.debug_barrier()  # the whole block is stored before it counts as forwarded
    if tl.atomic_add(state + COMBINE_FORWARDED + s, 1, sem="acq_rel", scope="sys") == TB - 1:
        if n > 0:
            tgl.put_signal(ctx, back + ((half * P + me) * T).to(tl.int64) * H, send_union + first * H,
                           n.to(tl.int64) * H * XB, rank_of(route, s), sig + me)
        else:
            tgl.signal(ctx, rank_of(route, s), sig + me, 1)


@triton.jit
def combine_kernel(
    ctx, y, weights, pos, rows, slot, route, hslot, hosts, union_map, back, flags, state, send_back, send_union,
    send_map, map_recv, sig, out,
    T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    BT: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr, XB: tl.constexpr, GIN: tl.constexpr,
    L: tl.constexpr, MW: tl.constexpr,
):
    """y [C, H] expert outputs in dispatch's layout -> out [T, H]: out[t] = sum over t's entries of
    weight * y[position]. Return area on every GPU: back [2, P, T, H] (half, GPU that reduced or
    other host's entry that summed, row). flags [3P]: reduced-here flags by GPU, then (GIN) map
    arrival flags and their claim words by source.
    GIN: a token's rows come back once per other host: each GPU of a host reduces its partial for
    a source s on another host into send_back [2, P, T, H] (half, s, its staging row), and s's
    network entry on this host (jaxgin.hosts) sums the host's partials (_forward_union_block) into
    send_union [2, P, T, H] and puts them to s. Where the partials of each token lie comes from s
    at the start of the call (_put_union_maps: union_map [P, MW] in, send_map / map_recv [2, P, MW]
    heap areas). hslot [T, P]: this GPU's tokens' rows in those unions (_routing.host_union);
    hosts: each rank's host; L: the most GPUs of a host. Signals sig .. sig + 2P - 1 (rows back,
    maps)."""
    TB: tl.constexpr = (T + BT - 1) // BT
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    me, epoch, half = call_position(route, state)
    my_rank = rank_of(route, me)
    ks = tl.arange(0, BK)
    k_ok = ks < K
    hs = tl.arange(0, BH)
    ps = tl.arange(0, BP)
    if GIN:
        if pid == 0:  # first of all: the entries need the maps before they can sum
            _put_union_maps(ctx, route, hosts, union_map, send_map, map_recv, sig, me, half, P, BP, MW, 1024, L)

    # 1. Reduce each received token's entries here; send one row home (GIN: into the send area,
    #    which this host's entry for the source reads).
    #    Items are claimed from a counter rather than dealt by program id: programs that are not
    #    resident (a kernel on another stream holds their SMs, such as an XLA collective that waits
    #    for peers whose GPUs are full of programs waiting for this one) then do none of this
    #    step, and the resident ones finish it. Both counters start each call at zero (the last
    #    program to finish zeroes them): a call claims ITEMS + nprog times (every program's last
    #    claim fails) and completes ITEMS items.
    ITEMS: tl.constexpr = P * TB
    mine = pid * 0
    item = claim(state + COMBINE_CLAIMED)
    while item < ITEMS:
        s = item % P  # sources alternate, so NVLink stores and local ones interleave on every SM
        r = (item // P) * BT + tl.arange(0, BT)
        r_ok = r < tl.load(rows + s)
        present = r_ok[:, None] & k_ok[None, :]
        landed = tl.load(pos + (s * T + r)[:, None] * K + ks[None, :], mask=present, other=-1)
        w = tl.load(weights + (s * T + r)[:, None] * K + ks[None, :], mask=present, other=0.0)
        peer = rank_of(route, s)
        if gin_route(ctx, route, s, me, GIN) != 0:
            home = send_back
            row = ((half * P + s) * T + r).to(tl.int64)
        else:
            home = tgl.peer_ptr(ctx, back, peer)
            row = ((half * P + me) * T + r).to(tl.int64)
        for h0 in range(0, H, BH):
            h = h0 + hs
            h_ok = h < H
            acc = tl.zeros((BT, BH), dtype=tl.float32)
            for k in tl.static_range(K):
                pk = _column(landed, ks, k)
                wk = _column(w, ks, k)
                v = tl.load(y + pk[:, None].to(tl.int64) * H + h[None, :], mask=(pk >= 0)[:, None] & h_ok[None, :],
                            other=0.0)
                acc += wk[:, None] * v.to(tl.float32)
            tl.store(home + row[:, None] * H + h[None, :], acc.to(out.dtype.element_ty),
                     mask=r_ok[:, None] & h_ok[None, :])
        mine += 1
        item = claim(state + COMBINE_CLAIMED)

    # 2. The program that completes the last item raises this GPU's flag on every NVLink GPU (its
    #    rows are in their return areas, its partials for other hosts' sources in send_back).
    tl.debug_barrier()  # the whole program's stores precede the release below
    before = tl.atomic_add(state + COMBINE_COMPLETED, mine.to(tl.int64), sem="acq_rel", scope="sys")
    last = (mine > 0) & (before + mine == ITEMS)
    if last:
        for d in range(P):
            if gin_route(ctx, route, d, me, GIN) == 0:
                tgl.set_flag(ctx, flags + me, epoch + 1, rank_of(route, d))

    if GIN:
        # 2b. As the network entry of other hosts' sources: sum this host's partials of their
        #     tokens and put them home, a block per claimed item (items of sources whose entry
        #     this GPU is not are skipped). The waits in it are for this host's GPUs' step 2 and
        #     for maps the sources posted first: neither waits for this step anywhere.
        item = claim(state + COMBINE_FORWARD_CLAIMED)
        while item < ITEMS:
            s = item % P
            if gin_route(ctx, route, s, me, GIN) != 0:
                if network_entry(route, hosts, s, me, P, BP) == me:
                    _forward_union_block(ctx, route, hosts, back, flags, send_back, send_union, map_recv, state, sig,
                                         s, item // P, me, half, epoch, T, H, P, BT, BH, BP, MW, XB, L)
            item = claim(state + COMBINE_FORWARD_CLAIMED)
        # Every forwarding item is claimed by now; the rows of each other host arrive from its
        # entry for this GPU (1 put each).
        if last:
            for d in range(P):
                if gin_route(ctx, route, d, me, GIN) != 0:
                    if network_entry(route, hosts, me, d, P, BP) == d:
                        arrivals_to_flag(ctx, sig + d, 1, flags + d, epoch + 1, my_rank)

    # 3. Add up what every GPU of this host, and every other host's entry, returned for each token.
    for d in range(P):
        if gin_route(ctx, route, d, me, GIN) == 0:
            tgl.wait_flag(ctx, flags + d, epoch + 1)
        elif network_entry(route, hosts, me, d, P, BP) == d:
            tgl.wait_flag(ctx, flags + d, epoch + 1)
    for blk in range(pid, TB, nprog):
        t = blk * BT + tl.arange(0, BT)
        t_ok = t < T
        both = t_ok[:, None] & (ps < P)[None, :]
        slots = tl.load(slot + t[:, None] * P + ps[None, :], mask=both, other=-1)
        if GIN:  # from another host: the token's row in the union its entry returned, once per host
            hrows = tl.load(hslot + t[:, None] * P + ps[None, :], mask=both, other=-1)
            for d in range(P):
                if gin_route(ctx, route, d, me, GIN) != 0:
                    once = network_entry(route, hosts, me, d, P, BP) == d
                    taken = tl.where(once, _column(hrows, ps, d), -1)
                    slots = tl.where((ps == d)[None, :], taken[:, None], slots)
        for h0 in range(0, H, BH):
            h = h0 + hs
            h_ok = h < H
            acc = tl.zeros((BT, BH), dtype=tl.float32)
            for d in range(P):
                sl = _column(slots, ps, d)
                row = ((half * P + d) * T + sl).to(tl.int64)
                v = tl.load(back + row[:, None] * H + h[None, :], mask=(sl >= 0)[:, None] & h_ok[None, :], other=0.0,
                            cache_modifier=".cg")
                acc += v.to(tl.float32)
            tl.store(out + t[:, None].to(tl.int64) * H + h[None, :], acc.to(out.dtype.element_ty),
                     mask=t_ok[:, None] & h_ok[None, :])
    finish_call(state, state + COMBINE_FINISHED, epoch, nprog, state + COMBINE_COMPLETED, 2 + (2 + P) * GIN)
