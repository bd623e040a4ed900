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
- matmul_reduce_scatter: program (i, tile) computes this GPU's partial of one tile of the chunk
  owned by (me + 1 + i) % P (its own chunk last), rounds it to the dtype and keeps it in its own
  buffer (slot of the owner), flagged; one program per tile of this GPU's chunk sums the partials
  of that tile from every source, fetched through NVLink (pull, as above), in float32 and source
  order, into the XLA output, right after that tile's partials in the start order (after every
  partial in a job with GIN peers).
- all_gather_matmul: the first SENDERS programs push this GPU's shard of x to every peer's gather
  buffer (nearest destination first, row group by row group, flagging each); the others compute
  output tiles, own shard first, then each peer's as its row groups arrive. No copy-out: every
  tile is stored into the XLA output by the program that computed it.

Peers on other hosts (GIN), picked per peer on the device (jaxgin.op_kernels.gin_route, shared
with the MoE kernels): a NIC reads only the symmetric heap, and XLA's output is not in it, so data
for such a peer is put from a heap staging area into a receive area in the peer's heap, and the
receiver copies it out. matmul_all_to_all puts each finished tile (packed, one put per tile) from
the matmul's epilogue; all_gather_matmul's senders put this GPU's shard row group by row group,
once per other host, to one GPU there that forwards it over NVLink (jaxgin.hosts).
Arrivals are counted by signals, and one program per signal hands them to the flag waiters
(jaxgin.op_kernels.arrivals_to_flag, wait_gin_source), so the rest of each kernel is the same for
both paths. Kernels compiled for a job without GIN peers (GIN = 0) keep only the NVLink paths.

Program numbers below are places in the order the programs started (jaxgin.op_kernels.start_order),
not tl.program_id: the deadlock-freedom arguments rest on lower numbers having started.

Readiness is announced with flags (tritongin.language.set_flag / wait_flag) holding the call counter + 1
rather than with counting signals: any number of programs can wait for the same flag.

Buffer reuse across calls: the exchange/gather buffers have two halves, picked by the parity of a
call counter kept on the device (state[CALLS], advanced by the last program to finish;
state[FINISHED] counts finished programs; state[STARTED] hands out places in the start order:
jaxgin.op_kernels.call_position, finish_call, start_order). A GPU that starts call n has received
every peer's data of call n - 1, so every peer has started n - 1 and finished n - 2: the half that
call n writes (its own when pulling, the peers' when pushing) is no longer read. Nothing depends on
host values, so CUDA-graph replay is right.
"""

import triton
import triton.language as tl

import jaxgin.triton_device.language as tgl
from jaxgin.op_kernels import (AXIS_INDEX, arrivals_to_flag, call_position, finish_call, gin_route, network_entry,
                                now_ns, rank_of, start_order, trace_word, wait_gin_source)

# Every fused op's state, int64 words zeroed at first: [CALLS (jaxgin.op_kernels), FINISHED, STARTED].
FINISHED = tl.constexpr(1)
STARTED = tl.constexpr(2)
STATE_WORDS = 3  # what _common.op_buffers allocates


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
def _operand_pointers(a, a_rows, w, col0, cols, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
    """The first K step's pointers into a (rows a_rows) and w (columns col0 ..), the K offsets of
    a step, and which of the BN columns are valid (the first `cols`)."""
    offs_k = tl.arange(0, BK)
    col_ok = tl.arange(0, BN) < cols
    a_ptrs = a + a_rows[:, None] * K + offs_k[None, :]
    w_ptrs = w + offs_k[:, None] * N + (col0 + tl.arange(0, BN))[None, :]
    return a_ptrs, w_ptrs, offs_k, col_ok


@triton.jit
def _k_step(acc, a_ptrs, w_ptrs, offs_k, col_ok, k, K: tl.constexpr, N: tl.constexpr, BK: tl.constexpr,
            PRECISION: tl.constexpr):
    """K step k: acc plus the step's operand tiles' product (loads past K read 0), and the next
    step's pointers."""
    if K % BK == 0:
        x_tile = tl.load(a_ptrs)
        w_tile = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
    else:
        k_ok = offs_k < K - k * BK
        x_tile = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    return tl.dot(x_tile, w_tile, acc, input_precision=PRECISION), a_ptrs + BK, w_ptrs + BK * N


@triton.jit
def _matmul_tile(a, a_rows, w, col0, cols, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, PRECISION: tl.constexpr):
    """float32 [rows of a_rows, BN] = a[a_rows, :] @ w[:, col0 + 0..BN) (columns past `cols` read as 0).
    a_rows are always valid rows (callers wrap them), so the loads of a need no mask."""
    a_ptrs, w_ptrs, offs_k, col_ok = _operand_pointers(a, a_rows, w, col0, cols, K, N, BN, BK)
    acc = tl.zeros((a_rows.shape[0], BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        acc, a_ptrs, w_ptrs = _k_step(acc, a_ptrs, w_ptrs, offs_k, col_ok, k, K, N, BK, PRECISION)
    return acc


@triton.jit
def _matmul_tile_copying(a, a_rows, w, col0, cols, src, src_stride, dst, dst_stride, copy_rows, copy_cols,
                         K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         PRECISION: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr, PIECES: tl.constexpr):
    """_matmul_tile that also copies a [CM, CN] tile from src (row stride src_stride; its first
    copy_rows rows and copy_cols columns; none if copy_rows is 0) to dst (row stride dst_stride),
    PIECES row slabs spread over the K loop (PIECES = 0: the whole tile after it): a slab is loaded
    in one K step and stored STRIDE steps later, so its latency (an NVLink read) hides under the
    matmul instead of stalling the program, and a wave's copies go out spread over its matmuls
    rather than in one burst at their end."""
    a_ptrs, w_ptrs, offs_k, col_ok = _operand_pointers(a, a_rows, w, col0, cols, K, N, BN, BK)
    acc = tl.zeros((a_rows.shape[0], BN), dtype=tl.float32)
    STEPS: tl.constexpr = (K + BK - 1) // BK
    tl.static_assert(PIECES <= STEPS, "more copy slabs than K steps")
    STRIDE: tl.constexpr = STEPS // max(PIECES, 1)
    SLAB: tl.constexpr = CM // max(PIECES, 1)
    # The copy moves 32-bit words (pairs of 16-bit elements): a slab of 16-bit values would be
    # unpacked right after its load, which stalls the program until the load lands.
    WORD: tl.constexpr = 32 // dst.dtype.element_ty.primitive_bitwidth  # elements per word
    src = src.to(tl.pointer_type(tl.int32), bitcast=True)
    dst = dst.to(tl.pointer_type(tl.int32), bitcast=True)
    src_stride = src_stride // WORD
    dst_stride = dst_stride // WORD
    copy_cols = copy_cols // WORD  # whole words: callers keep widths even for 16-bit types
    CW: tl.constexpr = CN // WORD
    slab_rows = tl.arange(0, SLAB)
    slab_cols = tl.arange(0, CW)
    slab_col_ok = (slab_cols < copy_cols)[None, :]
    slab = tl.zeros((SLAB, CW), dtype=tl.int32)
    for k in range(0, STEPS):
        if PIECES > 0 and k % STRIDE == 0 and k // STRIDE < PIECES:
            j = k // STRIDE
            rows = (j - 1) * SLAB + slab_rows  # the slab loaded STRIDE steps ago
            tl.store(dst + rows[:, None] * dst_stride + slab_cols[None, :], slab,
                     mask=((j > 0) & (rows < copy_rows))[:, None] & slab_col_ok)
            rows = j * SLAB + slab_rows
            slab = tl.load(src + rows[:, None] * src_stride + slab_cols[None, :],
                           mask=(rows < copy_rows)[:, None] & slab_col_ok, other=0.0,
                           cache_modifier=".cg")
        acc, a_ptrs, w_ptrs = _k_step(acc, a_ptrs, w_ptrs, offs_k, col_ok, k, K, N, BK, PRECISION)
    if PIECES == 0:  # the whole tile after the K loop (the exchange kernel's copy-out today)
        slab = tl.load(src + slab_rows[:, None] * src_stride + slab_cols[None, :],
                       mask=(slab_rows < copy_rows)[:, None] & slab_col_ok, other=0.0, cache_modifier=".cg")
        tl.store(dst + slab_rows[:, None] * dst_stride + slab_cols[None, :], slab,
                 mask=(slab_rows < copy_rows)[:, None] & slab_col_ok)
    else:  # the last slab, after the loop (stored inside it, Triton doubles the kernel's shared memory)
        rows = (PIECES - 1) * SLAB + slab_rows
        tl.store(dst + rows[:, None] * dst_stride + slab_cols[None, :], slab,
                 mask=(rows < copy_rows)[:, None] & slab_col_ok)
    return acc


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
def clock_kernel(ctx, after, stamp):
    """The GPU's global timer (ns) into stamp (int32 [2], one int64) once `after`, which it does not
    read, has been computed: tile configurations are tuned by the device's time between two stamps."""
    tl.store(stamp.to(tl.pointer_type(tl.int64), bitcast=True), now_ns(True))


@triton.jit
def matmul_copying_kernel(ctx, x, w, src, out, copied, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                          PRECISION: tl.constexpr, PIECES: tl.constexpr):
    """matmul_kernel whose programs also copy one [BM, BN] tile of src [M, N] into copied, folded
    into the K loop (_matmul_tile_copying) as the exchange kernel's copy-out: what that costs the
    matmul, on one GPU."""
    TM: tl.constexpr = (M + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    ti, tj = _tile_coords(tl.program_id(0), TM, TN, GROUP_M)
    r = ti * BM + tl.arange(0, BM)
    origin = (ti * BM) * N + tj * BN
    acc = _matmul_tile_copying(x, r % M, w, tj * BN, N - tj * BN, src + origin, N, copied + origin, N,
                               M - ti * BM, N - tj * BN, K, N, BN, BK, PRECISION, BM, BN, PIECES)
    c = tj * BN + tl.arange(0, BN)
    tl.store(out + r[:, None] * N + c[None, :], acc.to(out.dtype.element_ty), mask=(r < M)[:, None] & (c < N)[None, :])


@triton.jit
def _operand_descriptors(x, w, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr):
    """TMA descriptors of x [M, K] (BM x BK tiles) and w [K, N] (BK x BN tiles), made on the device;
    loads past an edge read zeros."""
    x_desc = tl.make_tensor_descriptor(x, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    return x_desc, w_desc


@triton.jit
def _matmul_tile_tma(x_desc, row0, w_desc, col0, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, PRECISION: tl.constexpr):
    """float32 [BM, BN] = x[row0 .. row0 + BM, :] @ w[:, col0 .. col0 + BN], operand tiles through TMA."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        acc = tl.dot(x_desc.load([row0, k * BK]), w_desc.load([k * BK, col0]), acc, input_precision=PRECISION)
    return acc


@triton.jit
def matmul_tma_kernel(ctx, x, w, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """matmul_kernel with TMA: one program per tile, operands and result through tensor descriptors."""
    TM: tl.constexpr = (M + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    ti, tj = _tile_coords(tl.program_id(0), TM, TN, GROUP_M)
    x_desc, w_desc = _operand_descriptors(x, w, M, N, K, BM, BN, BK)
    acc = _matmul_tile_tma(x_desc, ti * BM, w_desc, tj * BN, K, BM, BN, BK, PRECISION)
    out_desc = tl.make_tensor_descriptor(out, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    out_desc.store([ti * BM, tj * BN], acc.to(out.dtype.element_ty))


@triton.jit
def matmul_persistent_kernel(ctx, x, w, out, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                             PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """matmul_tma_kernel with PROGRAMS persistent programs, program p taking tiles p, p + PROGRAMS, ..."""
    TM: tl.constexpr = (M + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    x_desc, w_desc = _operand_descriptors(x, w, M, N, K, BM, BN, BK)
    out_desc = tl.make_tensor_descriptor(out, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    for t in tl.range(tl.program_id(0), TM * TN, PROGRAMS, warp_specialize=WARP_SPECIALIZE):
        ti, tj = _tile_coords(t, TM, TN, GROUP_M)
        acc = _matmul_tile_tma(x_desc, ti * BM, w_desc, tj * BN, K, BM, BN, BK, PRECISION)
        out_desc.store([ti * BM, tj * BN], acc.to(out.dtype.element_ty))


@triton.jit
def _chunk_tile(x, w, d, t, N: tl.constexpr, K: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
                SPLIT_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    """Tile t of the [CM, CN] chunk of x @ w that belongs to axis index d (rows d*CM.. if
    SPLIT_ROWS, else columns d*CN..): (its tile coordinates, its rows and columns within the chunk,
    their mask, the float32 tile)."""
    ti, tj, r, c, ok, x_rows, w_col0 = _chunk_place(d, t, CM, CN, SPLIT_ROWS, BM, BN, GROUP_M)
    acc = _matmul_tile(x, x_rows, w, w_col0, CN - tj * BN, K, N, BN, BK, PRECISION)
    return ti, tj, r, c, ok, acc


@triton.jit
def matmul_chunks_kernel(
    ctx, x, w, route, slots, words, counters, out,
    N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
    SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr, SLOT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
):
    """x @ w for the copy-engine exchange (csrc/ffi/chunked_matmul.cu's triton_chunks, which says
    what the words are): chunk [CM, CN] for axis index d (rows d*CM.. if SPLIT_ROWS, else columns
    d*CN..). Program (i, t) computes tile t of the chunk for d = (me + 1 + i) % P, so the chunks
    finish in that order and the own chunk, stored straight into out at its source's place
    (CONCAT_ROWS as _store_chunk_tile), comes last. A peer's chunk goes into its slot, slots + d *
    SLOT (row-major, CN columns), once d copied the previous call's (words[P + d], not waited for
    in the first call); the program that counts the chunk's last tile (counters[d], which grow by
    the chunk's tiles every call) zeroes that word and sets words[me] on d: d's copy engine pulls the
    chunk. The program that counts the own chunk's last tile waits for every peer's hand-over
    (words[s]). Every wait is bounded and waits only for peers' programs that wait for nothing."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    pid = tl.program_id(0)
    me = tl.load(route + AXIS_INDEX)
    d = (me + 1 + pid // TILES) % P
    ti, tj, r, c, ok, acc = _chunk_tile(x, w, d, pid % TILES, N, K, CM, CN, SPLIT_ROWS, BM, BN, BK, GROUP_M, PRECISION)
    tile = acc.to(out.dtype.element_ty)
    if d == me:
        _store_chunk_tile(out, tile, me, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)
    else:
        if tl.load(counters + d, volatile=True) >= TILES:  # not the first call: d must have copied the last chunk
            tgl.wait_flag(ctx, words + P + d, 1)
        tl.store(slots + d.to(tl.int64) * SLOT + r[:, None] * CN + c[None, :], tile, mask=ok)
    tl.debug_barrier()  # every thread's stores before the count (its release covers them)
    done = tl.atomic_add(counters + d, 1, sem="acq_rel", scope="gpu") + 1
    if done % TILES == 0:
        if d == me:
            for s in tl.static_range(P):
                if s != me:
                    tgl.wait_flag(ctx, words + s, 1)
        else:
            tl.atomic_xchg(words + P + d, 0, sem="relaxed", scope="sys")
            tgl.set_flag(ctx, words + me, 1, rank_of(route, d))


@triton.jit
def _tile_place(t, CM: tl.constexpr, CN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t of a [CM, CN] chunk in grouped order: its tile coordinates, its rows and columns
    within the chunk, and their mask."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    ti, tj = _tile_coords(t, TM, TN, GROUP_M)
    r = ti * BM + tl.arange(0, BM)
    c = tj * BN + tl.arange(0, BN)
    return ti, tj, r, c, (r < CM)[:, None] & (c < CN)[None, :]


@triton.jit
def _chunk_place(d, t, CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Where tile t of axis index d's chunk lies (_chunk_tile): its tile coordinates, rows and
    columns within the chunk and their mask, and the rows of x and first column of w it multiplies."""
    ti, tj, r, c, ok = _tile_place(t, CM, CN, BM, BN, GROUP_M)
    if SPLIT_ROWS:
        x_rows = d * CM + r % CM
        w_col0 = tj * BN
    else:
        x_rows = r % CM
        w_col0 = d * CN + tj * BN
    return ti, tj, r, c, ok, x_rows, w_col0


@triton.jit
def _store_chunk_tile(out, tile, s, r, c, ok, CM: tl.constexpr, CN: tl.constexpr, CONCAT_ROWS: tl.constexpr,
                      OUT_N: tl.constexpr):
    """Stores a [BM, BN] tile at rows r, columns c of the chunk from axis index s of the output."""
    tl.store(_in_output_chunk(out, s, r[:, None], c[None, :], CM, CN, CONCAT_ROWS, OUT_N), tile, mask=ok)


@triton.jit
def _in_output_chunk(out, s, rows, cols, CM: tl.constexpr, CN: tl.constexpr, CONCAT_ROWS: tl.constexpr,
                     OUT_N: tl.constexpr):
    """The output's address of rows `rows`, columns `cols` of the chunk from axis index s (at rows
    s*CM.. if CONCAT_ROWS, else at columns s*CN..)."""
    if CONCAT_ROWS:
        return out + (s * CM + rows) * OUT_N + cols
    else:
        return out + rows * OUT_N + (s * CN + cols)


@triton.jit
def _gin_tile_slot(gin_tiles, incoming, half, peer_index, t, P: tl.constexpr, TILES: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    """Where tile t for (outgoing) or from (incoming) axis index peer_index lives in the GIN tile
    area [2 directions, 2 halves, P, TILES, BM * BN]: packed rows of the tile's valid columns."""
    index = ((incoming * 2 + half) * P + peer_index) * TILES + t
    return gin_tiles + index.to(tl.int64) * (BM * BN)


@triton.jit
def _packed_offsets(rows, tj, CN: tl.constexpr, BN: tl.constexpr):
    """Offsets in the GIN tile area (_packed_tile's layout) of rows `rows` (within the tile) of
    column tile tj: a row holds only the tile's valid columns."""
    cols = tl.minimum(CN - tj * BN, BN)
    return rows[:, None] * cols + tl.arange(0, BN)[None, :]


@triton.jit
def _packed_tile(ti, tj, CM: tl.constexpr, CN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The layout of tile (ti, tj) of a [CM, CN] chunk in the GIN tile area, the same on both
    sides of the put: its valid rows of its valid columns, packed. Returns (offsets of the
    [BM, BN] tile's elements there, valid rows, valid columns)."""
    rows = tl.minimum(CM - ti * BM, BM)
    cols = tl.minimum(CN - tj * BN, BN)
    return _packed_offsets(tl.arange(0, BM), tj, CN, BN), rows, cols


@triton.jit
def _put_tile(ctx, route, gin_tiles, sig, tile, ok, ti, tj, t, d, me, half, P: tl.constexpr, TILES: tl.constexpr,
              CM: tl.constexpr, CN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, XB: tl.constexpr):
    """Tile t (ti, tj) of a chunk for axis index d on another host: its valid rows and columns,
    packed, into the outgoing tile area, then one put into d's incoming area (slot me there), +1
    on d's signal for this source, `sig + half * P + me`."""
    packed, rows, cols = _packed_tile(ti, tj, CM, CN, BM, BN)
    staged = _gin_tile_slot(gin_tiles, 0, half, d, t, P, TILES, BM, BN)
    tl.store(staged + packed, tile, mask=ok)
    there = _gin_tile_slot(gin_tiles, 1, half, me, t, P, TILES, BM, BN)
    tgl.put_signal(ctx, there, staged, rows * cols * XB, rank_of(route, d), sig + half * P + me)


@triton.jit
def _exchange_tile(
    ctx, x, w, route, recv, flags, gin_tiles, sig, out, pid, me, epoch, half,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    PARTS: tl.constexpr, INTERLEAVE: tl.constexpr, PULL: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr,
    COPY_SLABS: tl.constexpr, MOVED: tl.constexpr, TRACE: tl.constexpr = 0,
):
    """Program (step, t) of matmul_all_to_all_kernel below a GIN job's copy-out programs. Returns
    when its matmul ended, when its tile was stored (and flagged), when its wait for the arrival
    it copies out ended (TRACE; else zeros). The first MOVED arrivals (_arrival_index) are the
    movers' to copy, not their programs'."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    if INTERLEAVE:
        step = pid % P
        t = pid // P
    else:
        step = pid // TILES
        t = pid % TILES
    d = (me + 1 + step) % P
    ti, tj, r, c, ok, x_rows, w_col0 = _chunk_place(d, t, CM, CN, SPLIT_ROWS, BM, BN, GROUP_M)
    # COPY_SLABS (PULL, program order by step): if the arrival this program copies out is already
    # flagged when it starts, its copy goes in COPY_SLABS slabs through the matmul's K loop. Without
    # it, `copying` stays the constant 0 and the kernel compiles as if it did not exist.
    copying = 0
    if COPY_SLABS > 0 and PULL:
        s = (me + P - step) % P
        copying = (pid < 0).to(tl.int32)
        if step > 0 and (PARTS & 4) and gin_route(ctx, route, s, me, GIN) == 0:
            flag = tgl.peer_ptr(ctx, flags + me * TILES + t, rank_of(route, s))
            copying = (tl.atomic_add(flag, 0, sem="acquire", scope="sys") >= epoch + 1).to(tl.int32)
        # Inside the COPY_SLABS branch: Triton compiles both sides of an `if` on `copying` even
        # where it is the constant 0.
        if copying != 0:
            r0 = ti * BM
            c0 = tj * BN
            src = _pulled_slot(ctx, recv, rank_of(route, s), me, half, P, CM, CN) + r0 * CN + c0
            dst = _in_output_chunk(out, s, r0, c0, CM, CN, CONCAT_ROWS, OUT_N)
            acc = _matmul_tile_copying(x, x_rows, w, w_col0, CN - c0, src, CN, dst, OUT_N, CM - r0, CN - c0,
                                       K, N, BN, BK, PRECISION, BM, BN, COPY_SLABS)
        else:
            acc = _matmul_tile(x, x_rows, w, w_col0, CN - tj * BN, K, N, BN, BK, PRECISION)
    else:
        acc = _matmul_tile(x, x_rows, w, w_col0, CN - tj * BN, K, N, BN, BK, PRECISION)
    tile = acc.to(out.dtype.element_ty)
    computed = now_ns(TRACE)
    if d == me or (PARTS & 1) == 0:
        _store_chunk_tile(out, tile, d, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)
    elif gin_route(ctx, route, d, me, GIN) != 0:
        _put_tile(ctx, route, gin_tiles, sig, tile, ok, ti, tj, t, d, me, half, P, TILES, CM, CN, BM, BN, XB)
    elif PULL:
        tl.store(recv + (half * P + d) * (CM * CN) + r[:, None] * CN + c[None, :], tile, mask=ok)
        if PARTS & 2:
            tgl.set_flag(ctx, flags + d * TILES + t, epoch + 1, rank_of(route, me))
    else:
        peer = rank_of(route, d)
        slot = tgl.peer_ptr(ctx, recv, peer) + (half * P + me) * (CM * CN)
        tl.store(slot + r[:, None] * CN + c[None, :], tile, mask=ok)
        if PARTS & 2:
            tgl.set_flag(ctx, flags + me * TILES + t, epoch + 1, peer)
    stored = now_ns(TRACE)
    waited = stored
    s = (me + P - step) % P
    if MOVED > 0:
        mine = _arrival_index(step, t, P, TILES, INTERLEAVE) >= MOVED  # else a mover copies it
    else:
        mine = True
    if step > 0 and (PARTS & 4) and gin_route(ctx, route, s, me, GIN) == 0 and mine:
        if copying == 0:  # not copied in the K loop
            if PULL:
                slot = _flagged_pulled_slot(ctx, route, recv, flags, s, t, me, epoch, half, P, TILES, CM, CN)
            else:
                tgl.wait_flag(ctx, flags + s * TILES + t, epoch + 1)
                slot = recv + (half * P + s) * (CM * CN)
            waited = now_ns(TRACE)
            _copy_out_arrival(out, slot, s, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)
    return computed, stored, waited


@triton.jit
def _copy_out_arrival(out, slot, s, r, c, ok, CM: tl.constexpr, CN: tl.constexpr, CONCAT_ROWS: tl.constexpr,
                      OUT_N: tl.constexpr):
    """Copies rows r, columns c of the [CM, CN] chunk from axis index s at `slot` (through L2: it
    is read once) into that chunk's place in the output."""
    arrived = tl.load(slot + r[:, None] * CN + c[None, :], mask=ok, cache_modifier=".cg")
    _store_chunk_tile(out, arrived, s, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)


@triton.jit
def _arrival_index(step, t, P: tl.constexpr, TILES: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rank, in program order, of program (step, t)'s arrival among the arrivals (the programs
    of steps 1 ..): the order in which the peers compute them."""
    if INTERLEAVE:
        return t * (P - 1) + step - 1
    else:
        return (step - 1) * TILES + t


@triton.jit
def _move_arrivals(
    ctx, route, recv, flags, out, k, me, epoch, half,
    P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, INTERLEAVE: tl.constexpr, MOVERS: tl.constexpr,
    MOVED: tl.constexpr,
):
    """Mover k of matmul_all_to_all_kernel (MOVERS, NVLink and PULL only): copies arrivals k,
    k + MOVERS, .. below MOVED (_arrival_index order) into the output, each as soon as its source
    flags it, while the other SMs compute."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    for a in range(k, MOVED, MOVERS):
        if INTERLEAVE:
            t = a // (P - 1)
            step = 1 + a % (P - 1)
        else:
            step = 1 + a // TILES
            t = a % TILES
        s = (me + P - step) % P
        _ti, _tj, r, c, ok = _tile_place(t, CM, CN, BM, BN, GROUP_M)
        slot = _flagged_pulled_slot(ctx, route, recv, flags, s, t, me, epoch, half, P, TILES, CM, CN)
        _copy_out_arrival(out, slot, s, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)


@triton.jit
def _flagged_pulled_slot(ctx, route, recv, flags, s, t, me, epoch, half, P: tl.constexpr, TILES: tl.constexpr,
                         CM: tl.constexpr, CN: tl.constexpr):
    """_pulled_slot of axis index s, once s has flagged its tile t of this call there."""
    source = rank_of(route, s)
    tgl.wait_peer_flag(ctx, flags + me * TILES + t, epoch + 1, source)
    return _pulled_slot(ctx, recv, source, me, half, P, CM, CN)


@triton.jit
def _pulled_slot(ctx, recv, source, me, half, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr):
    """Where rank `source` keeps, in its own exchange buffer, the chunk it computed for axis index
    me (call parity half), as this GPU reaches it over NVLink: what a pulled copy-out reads."""
    return tgl.peer_ptr(ctx, recv, source) + (half * P + me) * (CM * CN)


@triton.jit
def _copy_out_gin_source(
    ctx, route, flags, gin_tiles, sig, out, q, me, epoch, half,
    P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, COPIERS: tl.constexpr, GIN: tl.constexpr,
):
    """Copy-out program q of a GIN job: copier q % COPIERS of axis index s = q // COPIERS. For a
    source on another host, copier 0 waits for its TILES puts of this call and raises its ready
    flag; every copier then moves its share of the arrived tiles into the output."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    s = q // COPIERS
    k = q % COPIERS
    if gin_route(ctx, route, s, me, GIN) != 0:
        ready = flags + P * TILES + s
        if k == 0:
            arrivals_to_flag(ctx, sig + half * P + s, TILES, ready, epoch + 1, rank_of(route, me))
        else:
            tgl.wait_flag(ctx, ready, epoch + 1)
        for t in range(k, TILES, COPIERS):
            ti, tj, r, c, ok = _tile_place(t, CM, CN, BM, BN, GROUP_M)
            packed, _, _ = _packed_tile(ti, tj, CM, CN, BM, BN)
            arrived = tl.load(_gin_tile_slot(gin_tiles, 1, half, s, t, P, TILES, BM, BN) + packed, mask=ok,
                              cache_modifier=".cg")
            _store_chunk_tile(out, arrived, s, r, c, ok, CM, CN, CONCAT_ROWS, OUT_N)


@triton.jit
def _matmul_all_to_all(
    ctx, x, w, route, recv, flags, state, gin_tiles, sig, out, trace,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    PARTS: tl.constexpr, INTERLEAVE: tl.constexpr, PULL: tl.constexpr, GIN: tl.constexpr, COPIERS: tl.constexpr,
    XB: tl.constexpr, COPY_SLABS: tl.constexpr, MOVERS: tl.constexpr, MOVED: tl.constexpr, TRACE: tl.constexpr,
):
    """y = x @ w; chunk [CM, CN] of y for axis index d (rows d*CM.. if SPLIT_ROWS, else columns
    d*CN..) goes to d, whose output holds the chunk from s at rows s*CM.. if CONCAT_ROWS, else at
    columns s*CN.. (OUT_N columns). Grid: P * TM * TN (+ P * COPIERS in a GIN job), program
    (i, t) = tile t of step i.

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
    buffer (slot me there; flags[me * TILES + t] there). COPY_SLABS (PULL only; 0 for the op so
    far): a program whose arrival is flagged when it starts copies it in COPY_SLABS row slabs
    spread over its K loop (_matmul_tile_copying), so the copy-out's NVLink reads hide under the
    matmul instead of following it; with programs in step order (no INTERLEAVE) the arrival was
    computed TILES programs earlier. An arrival not yet flagged is waited for and copied after the
    loop, as without COPY_SLABS. MOVERS (PULL, NVLink only; 0 for the op so far): the first MOVERS
    programs to start copy the first MOVED arrivals (_move_arrivals), those of every wave but the
    last, while the other SMs compute; the programs of those arrivals skip their copy-out. Movers
    wait for peer programs placed above them, so they must be few against the SMs (the host caps
    them); the compute programs still wait only for lower places. PARTS (7 for the op; the breakdown
    benchmark clears bits to see what each costs): 1 sends remote tiles (else they go into this
    GPU's own output), 2 flags them, 4 copies arrivals out.

    GIN (1 when the job has GPUs on other hosts; else gin_tiles and sig are unused): a tile for a
    destination on another host is packed into gin_tiles and put, one put per tile, into the
    destination's incoming area, +1 on its signal `sig + half * P + me` (a signal per call parity,
    so a fast source's next call is never counted for this one). The tile's wait cannot sit in
    program (i, t): the puts of a source's tiles complete in any order, and a wait for a higher
    numbered program could deadlock. So P * COPIERS programs after all tiles copy GIN arrivals out
    (one per source waits for its TILES puts and raises flags[P * TILES + s], the rest wait on that
    flag). Reuse is safe for the same reason as the exchange buffers: a GPU rewrites half h at call
    n + 2, after every peer finished call n + 1, so after its puts of call n were read and counted.

    TRACE (NVLink only): each program also writes trace[place] (_trace_program's record: start,
    its place, when its wait for the arrival it copies out ended, end, SM) and in words 5 and 6
    when its matmul ended and when its tile was stored and flagged.
    """
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    PROGRAMS: tl.constexpr = MOVERS + P * TILES + P * COPIERS  # COPIERS = 0 without GIN, MOVERS = 0 with
    me, epoch, half = call_position(route, state)
    place = start_order(state + STARTED)  # the program numbers that waits rely on
    pid = place - MOVERS
    if MOVERS > 0:
        mover = pid < 0
    else:
        mover = False  # compiled away
    if mover:
        started = now_ns(TRACE)
        _move_arrivals(ctx, route, recv, flags, out, place, me, epoch, half, P, CM, CN, CONCAT_ROWS, OUT_N, BM, BN,
                       GROUP_M, INTERLEAVE, MOVERS, MOVED)
        if TRACE:
            _trace_program(trace, P * TILES + place, started, pid, started, now_ns(TRACE))
    elif pid < P * TILES:
        started = now_ns(TRACE)
        computed, stored, waited = _exchange_tile(
            ctx, x, w, route, recv, flags, gin_tiles, sig, out, pid, me, epoch, half,
            M, N, K, P, CM, CN, SPLIT_ROWS, CONCAT_ROWS, OUT_N, BM, BN, BK, GROUP_M, PRECISION,
            PARTS, INTERLEAVE, PULL, GIN, XB, COPY_SLABS, MOVED, TRACE)
        if TRACE:
            _trace_program(trace, pid, started, pid, waited, now_ns(TRACE))
            trace_word(trace, pid, 5, computed)
            trace_word(trace, pid, 6, stored)
    else:
        if GIN:  # the copy-out programs exist only in a GIN job (compiled away otherwise: COPIERS = 0)
            _copy_out_gin_source(ctx, route, flags, gin_tiles, sig, out, pid - P * TILES, me, epoch, half,
                                 P, CM, CN, CONCAT_ROWS, OUT_N, BM, BN, GROUP_M, COPIERS, GIN)
    finish_call(state, state + FINISHED, epoch, PROGRAMS, state + STARTED, 1)


@triton.jit
def matmul_all_to_all_kernel(
    ctx, x, w, route, recv, flags, state, gin_tiles, sig, out,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    PARTS: tl.constexpr, INTERLEAVE: tl.constexpr, PULL: tl.constexpr, GIN: tl.constexpr, COPIERS: tl.constexpr,
    XB: tl.constexpr, COPY_SLABS: tl.constexpr, MOVERS: tl.constexpr, MOVED: tl.constexpr,
):
    """y = x @ w, its chunks exchanged over the axis: _matmul_all_to_all."""
    _matmul_all_to_all(ctx, x, w, route, recv, flags, state, gin_tiles, sig, out, flags,
                       M, N, K, P, CM, CN, SPLIT_ROWS, CONCAT_ROWS, OUT_N, BM, BN, BK, GROUP_M, PRECISION,
                       PARTS, INTERLEAVE, PULL, GIN, COPIERS, XB, COPY_SLABS, MOVERS, MOVED, 0)


@triton.jit
def matmul_all_to_all_traced_kernel(
    ctx, x, w, route, recv, flags, state, gin_tiles, sig, out, trace,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr,
    CM: tl.constexpr, CN: tl.constexpr, SPLIT_ROWS: tl.constexpr, CONCAT_ROWS: tl.constexpr, OUT_N: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
    PARTS: tl.constexpr, INTERLEAVE: tl.constexpr, PULL: tl.constexpr, GIN: tl.constexpr, COPIERS: tl.constexpr,
    XB: tl.constexpr, COPY_SLABS: tl.constexpr, MOVERS: tl.constexpr, MOVED: tl.constexpr,
):
    """matmul_all_to_all_kernel (NVLink only) that also writes a record per program into trace (int32
    [programs, 16]; benchmarks/fused.py --all-to-all-trace-only: where the kernel's time goes)."""
    _matmul_all_to_all(ctx, x, w, route, recv, flags, state, gin_tiles, sig, out, trace,
                       M, N, K, P, CM, CN, SPLIT_ROWS, CONCAT_ROWS, OUT_N, BM, BN, BK, GROUP_M, PRECISION,
                       PARTS, INTERLEAVE, PULL, GIN, COPIERS, XB, COPY_SLABS, MOVERS, MOVED, 1)


@triton.jit
def _partial_tile(
    ctx, x, w, route, partials, flags, gin_tiles, sig, pid, me, epoch, half,
    N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
    SCATTER_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr, FOLD: tl.constexpr, PUSH: tl.constexpr,
    TRACE: tl.constexpr = 0,
):
    """Program (step, t) of matmul_reduce_scatter_kernel: this GPU's partial of tile t of the chunk
    owned by d = (me + 1 + step) % P, in the dtype; kept and flagged here (d's reducers fetch it),
    with PUSH stored and flagged in d's buffer instead, or, for d on another host, packed and put
    into d's incoming area. FOLD: the own chunk's partial is not flagged (the program that stored
    it sums it). Returns when the tile's matmul ended (TRACE; else 0)."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    step = pid % P  # tile-major: every wave mixes tiles of every owner
    t = pid // P
    d = (me + 1 + step) % P
    ti, tj, r, c, ok, acc = _chunk_tile(x, w, d, t, N, K, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION)
    tile = acc.to(partials.dtype.element_ty)
    computed = now_ns(TRACE)
    if gin_route(ctx, route, d, me, GIN) != 0:
        _put_tile(ctx, route, gin_tiles, sig, tile, ok, ti, tj, t, d, me, half, P, TILES, CM, CN, BM, BN, XB)
    else:
        owner = rank_of(route, me)
        slot = partials + (half * P + d) * (CM * CN)
        flag = flags + d * TILES + t
        if PUSH and d != me:  # slot and flag of this source in the owner's buffers
            owner = rank_of(route, d)
            slot = tgl.peer_ptr(ctx, partials, owner) + (half * P + me) * (CM * CN)
            flag = flags + me * TILES + t
        tl.store(slot + r[:, None] * CN + c[None, :], tile, mask=ok)
        if not FOLD or d != me:
            tgl.set_flag(ctx, flag, epoch + 1, owner)
    return computed


@triton.jit
def _reduce_tile(
    ctx, route, partials, flags, gin_tiles, sig, out, t, me, epoch, half,
    P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    GROUP_M: tl.constexpr, GIN: tl.constexpr, WAIT_FIRST: tl.constexpr, REDUCE_SLABS: tl.constexpr,
    FOLD: tl.constexpr, PUSH: tl.constexpr, TRACE: tl.constexpr = 0,
):
    """Reducer t of matmul_reduce_scatter_kernel: tile t of this GPU's chunk, the sum of every
    source's partial in float32, source 0 first (the same bits on every run); with WAIT_FIRST
    every source waited for before any is loaded. FOLD: this program stored the own partial
    itself, so a CTA barrier stands in for its flag. Returns when its last wait ended (TRACE;
    else 0)."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    # Summed in slabs of rows: a whole [BM, BN] sum with its loads and addresses needs more
    # registers than the partials' matmul, and the kernel's count is the most any path needs.
    SLAB: tl.constexpr = BM // REDUCE_SLABS
    ti, tj = _tile_coords(t, TM, TN, GROUP_M)
    c = tj * BN + tl.arange(0, BN)
    if FOLD:
        tl.debug_barrier()  # every thread's stores of the own partial precede the loads below
    if WAIT_FIRST:
        for s in tl.static_range(P):
            _wait_source(ctx, route, flags, sig, s, t, me, epoch, half, P, TILES, GIN, FOLD, PUSH)
    waited = now_ns(TRACE)
    for slab in tl.static_range(REDUCE_SLABS):
        rows = slab * SLAB + tl.arange(0, SLAB)
        r = ti * BM + rows
        ok = (r < CM)[:, None] & (c < CN)[None, :]
        within = r[:, None] * CN + c[None, :]
        total = tl.zeros((SLAB, BN), dtype=tl.float32)
        for s in tl.static_range(P):
            if not WAIT_FIRST and slab == 0:  # every source waited for once, before its first load
                _wait_source(ctx, route, flags, sig, s, t, me, epoch, half, P, TILES, GIN, FOLD, PUSH)
                if s == P - 1:
                    waited = now_ns(TRACE)
            if s == me:
                part = tl.load(partials + (half * P + me) * (CM * CN) + within, mask=ok, other=0.0,
                               cache_modifier=".cg")
            elif gin_route(ctx, route, s, me, GIN) != 0:
                part = tl.load(_gin_tile_slot(gin_tiles, 1, half, s, t, P, TILES, BM, BN)
                               + _packed_offsets(rows, tj, CN, BN), mask=ok, other=0.0, cache_modifier=".cg")
            elif PUSH:  # stored here by the source, slot s
                part = tl.load(partials + (half * P + s) * (CM * CN) + within, mask=ok, other=0.0,
                               cache_modifier=".cg")
            else:
                there = tgl.peer_ptr(ctx, partials, rank_of(route, s)) + (half * P + me) * (CM * CN)
                part = tl.load(there + within, mask=ok, other=0.0, cache_modifier=".cg")
            total += part.to(tl.float32)
        tl.store(out + within, total.to(out.dtype.element_ty), mask=ok)
    return waited


@triton.jit
def _wait_source(ctx, route, flags, sig, s, t, me, epoch, half, P: tl.constexpr, TILES: tl.constexpr,
                 GIN: tl.constexpr, FOLD: tl.constexpr, PUSH: tl.constexpr):
    """Until source s's partial of this GPU's tile t is here (own, on an NVLink peer or, with
    PUSH, stored here by it, or put over GIN; with FOLD the own one is, stored by the waiting
    program)."""
    if s == me:
        if not FOLD:
            tgl.wait_flag(ctx, flags + me * TILES + t, epoch + 1)
    elif gin_route(ctx, route, s, me, GIN) != 0:
        # the first reducer to need source s waits for its TILES puts of this call (one claim per call)
        wait_gin_source(ctx, flags + P * TILES + P + s, sig + half * P + s, TILES, flags + P * TILES + s,
                        epoch + 1, rank_of(route, me))
    elif PUSH:
        tgl.wait_flag(ctx, flags + s * TILES + t, epoch + 1)
    else:
        tgl.wait_peer_flag(ctx, flags + me * TILES + t, epoch + 1, rank_of(route, s))


@triton.jit
def _matmul_reduce_scatter(
    ctx, x, w, route, partials, flags, state, gin_tiles, sig, out, trace,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
    SCATTER_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr, LAG: tl.constexpr, WAIT_FIRST: tl.constexpr,
    REDUCE_SLABS: tl.constexpr, FOLD: tl.constexpr, PUSH: tl.constexpr, TRACE: tl.constexpr,
):
    """out [CM, CN] = the sum over the axis of every GPU's x @ w restricted to the chunk this GPU
    owns (rows me*CM.. if SCATTER_ROWS, else columns me*CN..). Grid: P * TILES + TILES; P * TILES
    programs compute partial tiles (_partial_tile), TILES reduce this GPU's chunk (_reduce_tile).

    A partial for an NVLink owner stays in this GPU's buffer, half `epoch % 2`, slot of the owner,
    with flags[d * TILES + t] = the call counter + 1 once stored; the owner's reducer waits on that
    flag over NVLink and reads the tile from here (pull). For the own chunk the flag is local. For
    an owner on another host the partial is packed into the outgoing GIN area and put, one put per
    tile, into the owner's incoming area (slot me), +1 on its signal `sig + half * P + me`; there
    the first reducer to need the source waits for its TILES puts (wait_gin_source, claim word
    flags[P * TILES + P + s]) and raises flags[P * TILES + s] for the others.

    Computing programs never wait, and reducers wait only for them (here or on peers), each for
    programs before it in the start order, so the kernels cannot deadlock. Without GIN the start
    order puts reducer t right after the P programs of tile t + LAG (one per owner, tile-major;
    LAG <= TILES, the last LAG reducers at the end), so reductions overlap the rest of the matmul
    instead of trailing it: a source computes tile t of this GPU's chunk in its program (t, step),
    before reducer t's place on every GPU; LAG gives slower peers that many tiles of slack before
    a reducer waits for them. WAIT_FIRST: a reducer waits for every source before it loads any
    (the loads then overlap), instead of waiting and loading source by source. With GIN the
    reducers come last: the first one to need a source waits for all of its TILES puts, which
    later programs make. Reuse of a half is safe as in
    matmul_all_to_all_kernel: a GPU starts call n only after reading every source's partials of
    call n - 1, so every source has finished call n - 2, whose half call n rewrites. REDUCE_SLABS:
    row slabs a reducer sums its tile in (a power of two dividing BM), each element's sources in
    the same order.

    FOLD (NVLink only; LAG unused): no reducer programs (grid P * TILES, tile-major). The program
    of the own chunk's tile t, last of tile t's P places, reduces tile t itself once its partial is
    stored: it waits only for the peers' programs of tile t, at lower places, which never wait.
    Its own partial goes unflagged (a CTA barrier orders its stores before its loads).

    PUSH (NVLink only): a partial for an NVLink owner is stored into the owner's buffer instead
    (half `epoch % 2`, slot me there) and flagged there (flags[me * TILES + t]), so the owner's
    sums load local memory and wait on local flags. Reuse is safe by the same argument.

    TRACE (with FOLD): each program also writes trace[place] (_trace_program's record: start, its
    place, when its waits ended, end, SM; the own chunk's programs wait, the others' record their
    flag's time there) and in word 5 when its matmul ended."""
    TM: tl.constexpr = (CM + BM - 1) // BM
    TN: tl.constexpr = (CN + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    me, epoch, half = call_position(route, state)
    pid = start_order(state + STARTED)
    if FOLD:
        started = now_ns(TRACE)
        computed = _partial_tile(ctx, x, w, route, partials, flags, gin_tiles, sig, pid, me, epoch, half,
                                 N, K, P, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION, GIN, XB, FOLD, PUSH,
                                 TRACE)
        waited = now_ns(TRACE)
        if pid % P == P - 1:  # step P - 1: the tile of this GPU's own chunk
            waited = _reduce_tile(ctx, route, partials, flags, gin_tiles, sig, out, pid // P, me, epoch, half,
                                  P, CM, CN, BM, BN, GROUP_M, GIN, WAIT_FIRST, REDUCE_SLABS, FOLD, PUSH, TRACE)
        if TRACE:
            _trace_program(trace, pid, started, pid, waited, now_ns(TRACE))
            trace_word(trace, pid, 5, computed)
        finish_call(state, state + FINISHED, epoch, P * TILES, state + STARTED, 1)
    else:
        # Start-order places: LAG groups of P partials; then per tile t < TILES - LAG the P partials of
        # tile t + LAG and reducer t; then the last LAG reducers (with GIN: every partial, then every
        # reducer, which is LAG = TILES).
        LEAD: tl.constexpr = TILES if GIN else LAG
        BLOCKS: tl.constexpr = TILES - LEAD
        q = pid - LEAD * P
        block = q // (P + 1)
        place = q % (P + 1)
        if pid < LEAD * P:
            _partial_tile(ctx, x, w, route, partials, flags, gin_tiles, sig, pid, me, epoch, half,
                          N, K, P, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION, GIN, XB, FOLD, PUSH)
        elif (block < BLOCKS) & (place < P):
            _partial_tile(ctx, x, w, route, partials, flags, gin_tiles, sig, (block + LEAD) * P + place, me, epoch,
                          half, N, K, P, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION, GIN, XB, FOLD, PUSH)
        else:
            t = tl.where(block < BLOCKS, block, BLOCKS + q - BLOCKS * (P + 1))
            _reduce_tile(ctx, route, partials, flags, gin_tiles, sig, out, t, me, epoch, half,
                         P, CM, CN, BM, BN, GROUP_M, GIN, WAIT_FIRST, REDUCE_SLABS, FOLD, PUSH)
        finish_call(state, state + FINISHED, epoch, P * TILES + TILES, state + STARTED, 1)


@triton.jit
def matmul_reduce_scatter_kernel(
    ctx, x, w, route, partials, flags, state, gin_tiles, sig, out,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
    SCATTER_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr, LAG: tl.constexpr, WAIT_FIRST: tl.constexpr,
    REDUCE_SLABS: tl.constexpr, FOLD: tl.constexpr, PUSH: tl.constexpr,
):
    """out [CM, CN] = psum_scatter of every GPU's x @ w: _matmul_reduce_scatter."""
    _matmul_reduce_scatter(ctx, x, w, route, partials, flags, state, gin_tiles, sig, out, flags,
                           M, N, K, P, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION, GIN, XB, LAG,
                           WAIT_FIRST, REDUCE_SLABS, FOLD, PUSH, 0)


@triton.jit
def matmul_reduce_scatter_traced_kernel(
    ctx, x, w, route, partials, flags, state, gin_tiles, sig, out, trace,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, CM: tl.constexpr, CN: tl.constexpr,
    SCATTER_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr, LAG: tl.constexpr, WAIT_FIRST: tl.constexpr,
    REDUCE_SLABS: tl.constexpr, FOLD: tl.constexpr, PUSH: tl.constexpr,
):
    """matmul_reduce_scatter_kernel (FOLD) that also writes a record per program into trace (int32
    [programs, 16]; benchmarks/fused.py --reduce-scatter-trace-only: where the kernel's time goes)."""
    _matmul_reduce_scatter(ctx, x, w, route, partials, flags, state, gin_tiles, sig, out, trace,
                           M, N, K, P, CM, CN, SCATTER_ROWS, BM, BN, BK, GROUP_M, PRECISION, GIN, XB, LAG,
                           WAIT_FIRST, REDUCE_SLABS, FOLD, PUSH, 1)


@triton.jit
def _copy_rows(dst, x, lo, hi, K: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr):
    """dst[lo:hi, :] = x[lo:hi, :] for row-major [*, K] arrays, with the whole program."""
    for r0 in range(lo, hi, SEND_BM):
        r = r0 + tl.arange(0, SEND_BM)
        for k0 in range(0, K, SEND_BK):
            k = k0 + tl.arange(0, SEND_BK)
            ok = (r < hi)[:, None] & (k < K)[None, :]
            block = tl.load(x + r[:, None] * K + k[None, :], mask=ok)
            tl.store(dst + r[:, None] * K + k[None, :], block, mask=ok)


@triton.jit
def _forward_from_network(ctx, route, hosts, gather, flags, sig, me, epoch, half, pid, ML: tl.constexpr,
                          K: tl.constexpr, P: tl.constexpr, G: tl.constexpr, GR: tl.constexpr,
                          SENDERS: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr, BP: tl.constexpr):
    """Senders, after their own puts: for each (source on another host, row group) this GPU is
    the network entry of (jaxgin.hosts), waits for the group's put, copies it into the same slot
    of every host-mate's gather buffer over NVLink and raises its flag there and here. Nearest
    source first, as the computing programs take them. The waits end: every GPU's senders post
    their puts before they wait for any."""
    for item in range(pid, (P - 1) * G, SENDERS):
        s = (me + P - 1 - item // G) % P
        g = item % G
        if gin_route(ctx, route, s, me, 1) != 0:
            if network_entry(route, hosts, s, me, P, BP) == me:
                tgl.wait_arrivals(ctx, sig + (half * P + s) * G + g, 1)
                lo = g * GR
                hi = tl.minimum(ML, (g + 1) * GR)
                slot = (half * P + s) * (ML * K)
                for j in range(1, P):
                    m = (me + j) % P
                    if gin_route(ctx, route, m, me, 1) == 0:  # a host-mate: its entry for s is this GPU
                        mate = rank_of(route, m)
                        _copy_rows(tgl.peer_ptr(ctx, gather, mate) + slot, gather + slot, lo, hi, K, SEND_BM, SEND_BK)
                        tgl.set_flag(ctx, flags + s * G + g, epoch + 1, mate)
                tgl.set_flag(ctx, flags + s * G + g, epoch + 1, rank_of(route, me))


@triton.jit
def _trace_program(trace, place, started, tile, waited, ended):
    """One program's record in a traced kernel, 8 int64 words at place * 8 (`trace` any pointer to
    them; XLA outside x64 mode has no int64 arrays): start, tile (-1: a sender), when its waits
    ended (a sender: when its sends did), end (ns, the GPU's global timer), its SM."""
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    trace_word(trace, place, 0, started)
    trace_word(trace, place, 1, tile)
    trace_word(trace, place, 2, waited)
    trace_word(trace, place, 3, ended)
    trace_word(trace, place, 4, sm.to(tl.int64))


@triton.jit
def _all_gather_matmul(
    ctx, x, w, route, hosts, gather, flags, state, sig, out, trace,
    ML: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, G: tl.constexpr, GR: tl.constexpr,
    SENDERS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr,
    BP: tl.constexpr, TRACE: tl.constexpr,
):
    """out [P*ML, N] = all_gather(x [ML, K]) @ w. The shard from s lands in gather half
    `epoch % 2`, slot s, on every other GPU, row group by row group (GR rows each);
    flags[s * G + g] there = the call counter + 1 once group g has landed.
    Grid: SENDERS + P * TM * TN.

    GIN (1 when the job has GPUs on other hosts; else hosts and sig are unused): each shard crosses
    to each other host once. Senders go group by group; a group bound for another host is first
    copied into this GPU's own gather slot (which nothing else uses: the own shard is read from x),
    then put from there into the same place of that host's network entry for this GPU
    (jaxgin.hosts), +1 on its signal `sig + (half * P + me) * G + g` (a signal per call parity,
    group and source, because puts complete in any order). Then the senders of each entry forward
    what arrived to its host-mates (_forward_from_network) and raise the flags an NVLink source
    would have raised. Computing programs only wait for flags, which senders raise; senders wait
    only for other GPUs' senders' puts, posted before any sender waits: no wait can deadlock.

    TRACE: each program also writes trace[place] (_trace_program's record), place being its start
    order."""
    TM: tl.constexpr = (ML + BM - 1) // BM
    TN: tl.constexpr = (N + BN - 1) // BN
    TILES: tl.constexpr = TM * TN
    me, epoch, half = call_position(route, state)
    pid = start_order(state + STARTED)  # senders start first
    started = now_ns(TRACE)
    if pid < SENDERS:
        if GIN:
            own = gather + (half * P + me) * (ML * K)
            networked = 0  # destinations this GPU puts to: a group is staged only for them
            for j in range(1, P):
                d = (me + j) % P
                if gin_route(ctx, route, d, me, GIN) != 0:
                    networked += tl.where(network_entry(route, hosts, me, d, P, BP) == d, 1, 0)
            for g in range(pid, G, SENDERS):
                lo = g * GR
                hi = tl.minimum(ML, (g + 1) * GR)
                if networked > 0:
                    _copy_rows(own, x, lo, hi, K, SEND_BM, SEND_BK)
                for j in range(1, P):
                    d = (me + j) % P
                    peer = rank_of(route, d)
                    if gin_route(ctx, route, d, me, GIN) != 0:
                        if network_entry(route, hosts, me, d, P, BP) == d:
                            # the same heap offset on d: its slot for this GPU's shard
                            tgl.put_signal(ctx, own + lo * K, own + lo * K, (hi - lo) * K * XB, peer,
                                           sig + (half * P + me) * G + g)
                    else:
                        _copy_rows(tgl.peer_ptr(ctx, gather, peer) + (half * P + me) * (ML * K), x, lo, hi, K,
                                   SEND_BM, SEND_BK)
                        tgl.set_flag(ctx, flags + me * G + g, epoch + 1, peer)
            _forward_from_network(ctx, route, hosts, gather, flags, sig, me, epoch, half, pid, ML, K, P, G, GR,
                                  SENDERS, SEND_BM, SEND_BK, BP)
        else:
            for item in range(pid, (P - 1) * G, SENDERS):
                d = (me + 1 + item // G) % P
                g = item % G
                peer = rank_of(route, d)
                slot = tgl.peer_ptr(ctx, gather, peer) + (half * P + me) * (ML * K)
                _copy_rows(slot, x, g * GR, tl.minimum(ML, (g + 1) * GR), K, SEND_BM, SEND_BK)
                tgl.set_flag(ctx, flags + me * G + g, epoch + 1, peer)
        if TRACE:
            sent = now_ns(TRACE)
            _trace_program(trace, pid, started, -1, sent, sent)
    else:
        q = pid - SENDERS
        s = (me + P - q // TILES) % P  # own shard first, then the nearest sender's
        ti, tj = _tile_coords(q % TILES, TM, TN, GROUP_M)
        r = ti * BM + tl.arange(0, BM)
        if s == me:
            a = x
        else:
            for g in range(ti * BM // GR, tl.minimum(G, ((ti + 1) * BM + GR - 1) // GR)):  # its rows' groups
                tgl.wait_flag(ctx, flags + s * G + g, epoch + 1)
            a = gather + (half * P + s) * (ML * K)
        waited = now_ns(TRACE)
        acc = _matmul_tile(a, r % ML, w, tj * BN, N - tj * BN, K, N, BN, BK, PRECISION)
        c = tj * BN + tl.arange(0, BN)
        ok = (r < ML)[:, None] & (c < N)[None, :]
        tl.store(out + (s * ML + r)[:, None] * N + c[None, :], acc.to(out.dtype.element_ty), mask=ok)
        if TRACE:
            _trace_program(trace, pid, started, q, waited, now_ns(TRACE))
    finish_call(state, state + FINISHED, epoch, SENDERS + P * TILES, state + STARTED, 1)


@triton.jit
def all_gather_matmul_kernel(
    ctx, x, w, route, hosts, gather, flags, state, sig, out,
    ML: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, G: tl.constexpr, GR: tl.constexpr,
    SENDERS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr,
    BP: tl.constexpr,
):
    """out [P*ML, N] = all_gather(x [ML, K]) @ w: _all_gather_matmul."""
    _all_gather_matmul(ctx, x, w, route, hosts, gather, flags, state, sig, out, flags,
                       ML, N, K, P, G, GR, SENDERS, BM, BN, BK, GROUP_M, PRECISION, SEND_BM, SEND_BK, GIN, XB, BP, 0)


@triton.jit
def all_gather_matmul_traced_kernel(
    ctx, x, w, route, hosts, gather, flags, state, sig, out, trace,
    ML: tl.constexpr, N: tl.constexpr, K: tl.constexpr, P: tl.constexpr, G: tl.constexpr, GR: tl.constexpr,
    SENDERS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, SEND_BM: tl.constexpr, SEND_BK: tl.constexpr, GIN: tl.constexpr, XB: tl.constexpr,
    BP: tl.constexpr,
):
    """all_gather_matmul_kernel that also writes a record per program into trace (int32 [programs,
    16], 8 int64 words each; benchmarks/fused.py --gather-trace-only: where the kernel's time goes)."""
    _all_gather_matmul(ctx, x, w, route, hosts, gather, flags, state, sig, out, trace,
                       ML, N, K, P, G, GR, SENDERS, BM, BN, BK, GROUP_M, PRECISION, SEND_BM, SEND_BK, GIN, XB, BP, 1)
