"""Triton kernels of the fused ops (tritongin device functions for the communication).

One launch per op does everything, so consecutive calls never interleave on a GPU:

- matmul_all_to_all: program (i, tile) computes one output tile of the chunk for destination
  (me + 1 + i) % P (rotated so that no GPU is everyone's first destination; its own chunk last),
  stores it into this GPU's exchange buffer (slot of that destination) and sets the tile's flag
  there. The own chunk goes straight into the XLA output. Then the program fetches one tile that a
  peer published for this GPU, through NVLink, into the output (XLA's buffers are not in the
  symmetric heap, so peers cannot write them: the fetch is that one copy, spread over the kernel).
  Programs are numbered tile-major, so every wave mixes tiles of every destination.
  Fetching (pull) rather than storing into the peer (push) keeps NVLink traffic out of the matmul
  epilogue; on 2 x H200 the op took 231 us pulled vs 253 us pushed (4096x7168x2048, bf16), see
  benchmarks/fused.py --variants-only.
- all_gather_matmul: the first SENDERS programs push this GPU's shard of x to every peer's gather
  buffer (nearest destination first, row group by row group, flagging each); the others compute
  output tiles, own shard first, then each peer's as its row groups arrive. No copy-out: every
  tile is stored into the XLA output by the program that computed it.

Readiness is announced with flags (tritongin.language.set_flag / wait_flag) holding the call counter + 1
rather than with counting signals: any number of programs can wait for the same flag.

Buffer reuse across calls: the exchange/gather buffers have two halves, picked by the parity of a
call counter kept on the device (state[0], advanced by the last program to finish; state[1] counts
finished programs). A GPU that starts call n has received every peer's data of call n - 1, so every
peer has started n - 1 and finished n - 2: the half that call n writes (its own when pulling, the
peers' when pushing) is no longer read. Nothing depends on host values, so CUDA-graph replay is
right.
"""

import triton
import triton.language as tl

import jaxgin.triton.language as tgl


@triton.jit
def _tile_coords(t, TM: tl.constexpr, TN: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t of a TM x TN grid in grouped order: GROUP_M row tiles share each column tile while
    they are resident, so the weight tiles are read once per group from HBM."""
    per_group = GROUP_M * TN
    group = t // per_group
    first = group * GROUP_M
    rows = tl.minimum(TM - first, GROUP_M)
    within = t % per_group
    return first + within % rows, within // rows


@triton.jit
def _matmul_tile(a, a_rows, w, col0, cols, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PRECISION: tl.constexpr):
    """float32 [rows of a_rows, BN] = a[a_rows, :] @ w[:, col0 + 0..BN) (columns past `cols` read as 0).
    a_rows are always valid rows (callers wrap them), so the loads of a need no mask."""
    offs_k = tl.arange(0, BK)
    offs_n = col0 + tl.arange(0, BN)
    col_ok = tl.arange(0, BN) < cols
    a_ptrs = a + a_rows[:, None] * K + offs_k[None, :]
    w_ptrs = w + offs_k[:, None] * N + offs_n[None, :]
    acc = tl.zeros((a_rows.shape[0], BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        if K % BK == 0:
            x_tile = tl.load(a_ptrs)
            w_tile = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k * BK
            x_tile = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w_tile = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x_tile, w_tile, acc, input_precision=PRECISION)
        a_ptrs += BK
        w_ptrs += BK * N
    return acc


@triton.jit
def _finish_call(state, epoch, PROGRAMS: tl.constexpr):
    """Every program calls this last; the last one to arrive advances the call counter."""
    finished = tl.atomic_add(state + 1, 1, sem="acq_rel", scope="gpu")
    if finished == PROGRAMS - 1:
        tl.atomic_xchg(state + 1, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state, epoch + 1, sem="release", scope="gpu")


@triton.jit
def matmul_kernel(ctx, x, w, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """The fused kernels' matmul alone (out = x @ w): the reference for their compute speed and
    what tile configurations are tuned on."""
    TM: tl.constexpr = (M + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    ti, tj = _tile_coords(tl.program_id(0), TM, TN, GROUP_M)
    r = ti * BM + tl.arange(0, BM)
    acc = _matmul_tile(x, r % M, w, tj * BN, N - tj * BN, K, N, BN, BK, PRECISION)
    c = tj * BN + tl.arange(0, BN)
    tl.store(out + r[:, None] * N + c[None, :], acc.to(out.dtype.element_ty), mask=(r < M)[:, None] & (c < N)[None, :])


@triton.jit
def matmul_all_to_all_kernel(
    ctx, x, w, route, recv, flags, state, out,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    PARTS: tl.constexpr, INTERLEAVE: tl.constexpr, PULL: tl.constexpr,
):
    """y = x @ w; chunk [CM, CN] of y for axis index d (rows d*CM.. if SPLIT_ROWS, else columns
    d*CN..) goes to d, whose output holds the chunk from s at rows s*CM.. if CONCAT_ROWS, else at
    columns s*CN.. (OUT_N columns). Grid: P * TM * TN, program (i, t) = tile t of step i.

    Step i sends to (me + 1 + i) % P, so step i's arrivals come from (me - 1 - i) % P. Having
    stored its own tile, program (i, t) copies tile t of step i - 1's arrivals into the output:
    the peer computed it in a program numbered below this one, so the wait is short, and the
    copy-out is spread over the whole kernel instead of trailing it. A program only ever waits for
    a peer program with a lower number, so the kernels cannot deadlock.

    The op runs with INTERLEAVE and PULL (the defaults of matmul_all_to_all._kernel):
    INTERLEAVE numbers programs tile-major (program t * P + i) instead of step-major, so every wave
    of programs mixes tiles of every destination. PULL keeps a remote tile in this GPU's own buffer
    (slot d; flags[d * TILES + t] here = the call counter + 1 once it is stored) and the destination
    fetches it over NVLink in its copy-out; without PULL the tile is stored into the destination's
    buffer (slot me there; flags[me * TILES + t] there). PARTS (7 for the op; the breakdown
    benchmark clears bits to see what each costs): 1 sends remote tiles (else they go into this
    GPU's own output), 2 flags them, 4 copies arrivals out."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    pid = tl.program_id(0)
    if INTERLEAVE:
        step = pid % P
        t = pid // P
    else:
        step = pid // TILES
        t = pid % TILES
    me = tl.load(route)
    epoch = tl.load(state)
    half = epoch % 2
    d = (me + 1 + step) % P
    ti, tj = _tile_coords(t, TM, TN, GROUP_M)
    r = ti * BM + tl.arange(0, BM)  # rows and columns within a chunk
    c = tj * BN + tl.arange(0, BN)
    ok = (r < CM)[:, None] & (c < CN)[None, :]
    if SPLIT_ROWS:
        acc = _matmul_tile(x, d * CM + r % CM, w, tj * BN, CN - tj * BN, K, N, BN, BK, PRECISION)
    else:
        acc = _matmul_tile(x, r % CM, w, d * CN + tj * BN, CN - tj * BN, K, N, BN, BK, PRECISION)
    tile = acc.to(out.dtype.element_ty)
    if d == me or (PARTS & 1) == 0:
        if CONCAT_ROWS:
            tl.store(out + (d * CM + r)[:, None] * OUT_N + c[None, :], tile, mask=ok)
        else:
            tl.store(out + r[:, None] * OUT_N + (d * CN + c)[None, :], tile, mask=ok)
    elif PULL:
        tl.store(recv + (half * P + d) * (CM * CN) + r[:, None] * CN + c[None, :], tile, mask=ok)
        if PARTS & 2:
            tgl.set_flag(ctx, flags + d * TILES + t, epoch + 1, tl.load(route + 1 + me))
    else:
        peer = tl.load(route + 1 + d)
        slot = tgl.peer_ptr(ctx, recv, peer) + (half * P + me) * (CM * CN)
        tl.store(slot + r[:, None] * CN + c[None, :], tile, mask=ok)
        if PARTS & 2:
            tgl.set_flag(ctx, flags + me * TILES + t, epoch + 1, peer)
    if step > 0 and PARTS & 4:
        s = (me + P - step) % P
        if PULL:
            source = tl.load(route + 1 + s)
            tgl.wait_peer_flag(ctx, flags + me * TILES + t, epoch + 1, source)
            slot = tgl.peer_ptr(ctx, recv, source) + (half * P + me) * (CM * CN)
        else:
            tgl.wait_flag(ctx, flags + s * TILES + t, epoch + 1)
            slot = recv + (half * P + s) * (CM * CN)
        arrived = tl.load(slot + r[:, None] * CN + c[None, :], mask=ok, cache_modifier=".cg")
        if CONCAT_ROWS:
            tl.store(out + (s * CM + r)[:, None] * OUT_N + c[None, :], arrived, mask=ok)
        else:
            tl.store(out + r[:, None] * OUT_N + (s * CN + c)[None, :], arrived, mask=ok)
    _finish_call(state, epoch, P * TILES)


@triton.jit
def all_gather_matmul_kernel(
    ctx, x, w, route, gather, flags, state, out,
    ML: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
    SENDERS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr,
):
    """out [P*ML, N] = all_gather(x [ML, K]) @ w. The shard from s lands in gather half
    `epoch % 2`, slot s, on every other GPU, row group by row group (R tile rows each);
    flags[s * G + g] there = the call counter + 1 once group g has landed.
    Grid: SENDERS + P * TM * TN."""
    TM: tl.constexpr = (ML + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    pid = tl.program_id(0)
    me = tl.load(route)
    epoch = tl.load(state)
    half = epoch % 2
    if pid < SENDERS:
        for item in range(pid, (P - 1) * G, SENDERS):
            d = (me + 1 + item // G) % P
            g = item % G
            peer = tl.load(route + 1 + d)
            slot = tgl.peer_ptr(ctx, gather, peer) + (half * P + me) * (ML * K)
            for r0 in range(g * R * BM, tl.minimum(ML, (g + 1) * R * BM), SEND_BM):
                r = r0 + tl.arange(0, SEND_BM)
                for k0 in range(0, K, SEND_BK):
                    k = k0 + tl.arange(0, SEND_BK)
                    ok = (r < ML)[:, None] & (k < K)[None, :]
                    block = tl.load(x + r[:, None] * K + k[None, :], mask=ok)
                    tl.store(slot + r[:, None] * K + k[None, :], block, mask=ok)
            tgl.set_flag(ctx, flags + me * G + g, epoch + 1, peer)
    else:
        q = pid - SENDERS
        s = (me + P - q // TILES) % P  # own shard first, then the nearest sender's
        ti, tj = _tile_coords(q % TILES, TM, TN, GROUP_M)
        r = ti * BM + tl.arange(0, BM)
        if s == me:
            a = x
        else:
            tgl.wait_flag(ctx, flags + s * G + ti // R, epoch + 1)
            a = gather + (half * P + s) * (ML * K)
        acc = _matmul_tile(a, r % ML, w, tj * BN, N - tj * BN, K, N, BN, BK, PRECISION)
        c = tj * BN + tl.arange(0, BN)
        ok = (r < ML)[:, None] & (c < N)[None, :]
        tl.store(out + (s * ML + r)[:, None] * N + c[None, :], acc.to(out.dtype.element_ty), mask=ok)
    _finish_call(state, epoch, SENDERS + P * TILES)
