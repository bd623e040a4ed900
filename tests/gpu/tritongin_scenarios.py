"""GPU scenarios for tritongin, each run in a fresh process by tests/gpu/test_tritongin_gpu.py.

    python tests/gpu/tritongin_scenarios.py NAME [ITERATIONS]                  # one process, all visible GPUs
    python tests/gpu/tritongin_scenarios.py NAME ITERATIONS RANK N ADDR        # one of N processes (standalone,
                                                                               # triton_call, bringup)

Standalone launches go through Triton's own launcher (PyTorch streams, one launch per GPU; the
launches are asynchronous, so kernels that wait for each other run together). Every payload is a
stamp of (sender, iteration, word) that the receiver recomputes and compares word by word.
Each scenario prints one JSON line prefixed with RESULT:.
"""

import os
import sys
import time

import triton
import triton.language as tl

import job
import tritongin.language as tgl


@triton.jit
def _stamp(rank, iteration, offs):
    return rank * 1000003 + iteration * 7919 + offs


@triton.jit
def _tally(tally, got, want, mask):
    """Counts into tally[0] the words under `mask` that differ and into tally[1] those compared."""
    tl.atomic_add(tally, tl.sum(((got != want) & mask).to(tl.int32)))
    tl.atomic_add(tally + 1, tl.sum(mask.to(tl.int32)))


@triton.jit(do_not_specialize=["iteration"])
def ring_kernel(ctx, send, recv, tally, data_sig, credit_sig, words, iteration, BLOCK: tl.constexpr):
    """Puts a stamped tile to the right neighbour, waits for the left one's, checks it, returns a
    credit to the left (it may overwrite `recv` again) and waits for the right one's credit."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    right = (me + 1) % n
    left = (me + n - 1) % n
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(send + offs, _stamp(me, iteration, offs), mask=offs < words)
    tgl.put_signal(ctx, recv, send, words * 4, right, data_sig)
    tgl.wait_arrivals(ctx, data_sig, 1)
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        got = tl.load(recv + offs, mask=offs < words, other=0)
        _tally(tally, got, _stamp(left, iteration, offs), offs < words)
    tgl.signal(ctx, left, credit_sig, 1)
    tgl.wait_arrivals(ctx, credit_sig, 1)


@triton.jit(do_not_specialize=["iteration"])
def all_pairs_kernel(ctx, send, recv, tally, sig, words, iteration, BLOCK: tl.constexpr):
    """Every rank puts a tile to every other rank (slot = sender), then checks all it received."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(send + offs, _stamp(me, iteration, offs), mask=offs < words)
    for step in range(1, n):
        peer = (me + step) % n
        tgl.put_signal(ctx, recv + me * words, send, words * 4, peer, sig)
    tgl.wait_arrivals(ctx, sig, n - 1)
    for step in range(1, n):
        sender = (me + n - step) % n
        for start in range(0, words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            got = tl.load(recv + sender * words + offs, mask=offs < words, other=0)
            _tally(tally, got, _stamp(sender, iteration, offs), offs < words)
    tgl.barrier(ctx)  # nobody overwrites a slot before its owner checked it


@triton.jit(do_not_specialize=["iteration"])
def barrier_kernel(ctx, slots, tally, words, iteration, BLOCK: tl.constexpr):
    """Each program stores its share of a stamped tile into every peer's slot through peer_ptr
    (plain tl.store over NVLink), crosses the barrier, and checks what the others stored."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    pid = tl.program_id(0)
    share = tl.cdiv(words, tl.num_programs(0))
    lo = pid * share
    for step in range(1, n):
        peer = (me + step) % n
        remote = tgl.peer_ptr(ctx, slots + me * words, peer)
        for start in range(lo, lo + share, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = (offs < words) & (offs < lo + share)
            tl.store(remote + offs, _stamp(me, iteration, offs), mask=mask)
    tgl.barrier(ctx)
    for step in range(1, n):
        sender = (me + n - step) % n
        for start in range(lo, lo + share, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = (offs < words) & (offs < lo + share)
            got = tl.load(slots + sender * words + offs, mask=mask, other=0)
            _tally(tally, got, _stamp(sender, iteration, offs), mask)
    tgl.barrier(ctx)  # slots are rewritten only after everyone checked them


@triton.jit(do_not_specialize=["iteration"])
def barrier_put_kernel(ctx, send, slots, tally, sig, words, iteration, BLOCK: tl.constexpr):
    """barrier_kernel for peers that are not all LSA peers: each program puts its share of a stamped
    tile into every peer's slot with put_signal (signal `sig` + program id), waits for its shares
    from every peer, crosses the barrier, and checks them."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    pid = tl.program_id(0)
    share = tl.cdiv(words, tl.num_programs(0))
    lo = pid * share
    hi = tl.minimum(lo + share, words)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(send + offs, _stamp(me, iteration, offs), mask=offs < hi)
    for step in range(1, n):
        peer = (me + step) % n
        tgl.put_signal(ctx, slots + me * words + lo, send + lo, (hi - lo) * 4, peer, sig + pid)
    tgl.wait_arrivals(ctx, sig + pid, n - 1)
    tgl.barrier(ctx)
    for step in range(1, n):
        sender = (me + n - step) % n
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < hi
            got = tl.load(slots + sender * words + offs, mask=mask, other=0)
            _tally(tally, got, _stamp(sender, iteration, offs), mask)
    tgl.barrier(ctx)  # slots are rewritten only after everyone checked them


@triton.jit(do_not_specialize=["rounds"])
def pingpong_kernel(ctx, buf, sig, nbytes, rounds):
    """Ranks 0 and 1 bounce `nbytes` back and forth `rounds` times through put_signal."""
    me = tgl.rank(ctx)
    if me < 2:
        for _ in range(rounds):
            if me == 0:
                tgl.put_signal(ctx, buf, buf, nbytes, 1, sig)
                tgl.wait_arrivals(ctx, sig, 1)
            else:
                tgl.wait_arrivals(ctx, sig, 1)
                tgl.put_signal(ctx, buf, buf, nbytes, 0, sig)


@triton.jit
def raw_pingpong_kernel(ctx, flag, base, rounds):
    """The floor under pingpong_kernel on the same GPUs: ranks 0 and 1 bounce a counter through
    system-scope atomics on each other's memory (peer_ptr), no device library in between."""
    me = tgl.rank(ctx)
    if me < 2:
        theirs = tgl.peer_ptr(ctx, flag, 1 - me)
        for i in range(rounds):
            target = base + i + 1
            if me == 0:
                tl.atomic_xchg(theirs, target, sem="release", scope="sys")
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            while seen < target:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
            if me == 1:
                tl.atomic_xchg(theirs, target, sem="release", scope="sys")


@triton.jit
def push_kernel(ctx, src, dst, count, peer, BLOCK: tl.constexpr):
    """Bulk copy to a peer's heap with Triton's own vector stores through peer_ptr."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    tl.store(tgl.peer_ptr(ctx, dst, peer) + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def persistent_push_kernel(ctx, src, dst, count, peer, BLOCK: tl.constexpr, STAGES: tl.constexpr,
                           EVICT: tl.constexpr, STORE_CACHE: tl.constexpr = ""):
    """push_kernel's copy from a grid of a few programs per SM, each walking every grid-th block, so
    the loads of its next blocks are in flight while it stores this one (STAGES deep)."""
    to = tgl.peer_ptr(ctx, dst, peer)
    for b in tl.range(tl.program_id(0), tl.cdiv(count, BLOCK), tl.num_programs(0), num_stages=STAGES):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(to + offs, tl.load(src + offs, mask=mask, eviction_policy=EVICT), mask=mask,
                 cache_modifier=STORE_CACHE)


@triton.jit
def tma_push_kernel(ctx, src, dst, rows, peer, BR: tl.constexpr, C: tl.constexpr, STAGES: tl.constexpr):
    """persistent_push_kernel's copy as [rows, C] tiles through tensor descriptors: a TMA load brings
    each [BR, C] tile into shared memory and a TMA store (a bulk copy, not per-thread vector stores)
    sends it to the peer's heap."""
    src_tiles = tl.make_tensor_descriptor(src, shape=[rows, C], strides=[C, 1], block_shape=[BR, C])
    dst_tiles = tl.make_tensor_descriptor(tgl.peer_ptr(ctx, dst, peer), shape=[rows, C], strides=[C, 1],
                                          block_shape=[BR, C])
    for t in tl.range(tl.program_id(0), tl.cdiv(rows, BR), tl.num_programs(0), num_stages=STAGES):
        dst_tiles.store([t * BR, 0], src_tiles.load([t * BR, 0]))


@triton.jit
def persistent_pull_kernel(ctx, src, dst, count, peer, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """persistent_push_kernel the other way round: loads from the peer's heap through peer_ptr (the
    fused ops' pulled copy-out), stores into this GPU's own."""
    frm = tgl.peer_ptr(ctx, src, peer)
    for b in tl.range(tl.program_id(0), tl.cdiv(count, BLOCK), tl.num_programs(0), num_stages=STAGES):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < count
        tl.store(dst + offs, tl.load(frm + offs, mask=mask, cache_modifier=".cg"), mask=mask)


@triton.jit
def tma_pull_kernel(ctx, src, dst, rows, peer, BR: tl.constexpr, C: tl.constexpr, STAGES: tl.constexpr):
    """persistent_pull_kernel's copy through tensor descriptors: TMA loads bring the peer's [BR, C]
    tiles into shared memory (the TMA unit keeps the reads in flight, not the threads)."""
    src_tiles = tl.make_tensor_descriptor(tgl.peer_ptr(ctx, src, peer), shape=[rows, C], strides=[C, 1],
                                          block_shape=[BR, C])
    dst_tiles = tl.make_tensor_descriptor(dst, shape=[rows, C], strides=[C, 1], block_shape=[BR, C])
    for t in tl.range(tl.program_id(0), tl.cdiv(rows, BR), tl.num_programs(0), num_stages=STAGES):
        dst_tiles.store([t * BR, 0], src_tiles.load([t * BR, 0]))


@triton.jit
def _global_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit(do_not_specialize=["delay_ns"])
def late_put_kernel(ctx, src, dst, nbytes, sig, delay_ns):
    """Waits delay_ns on the GPU's clock, then puts src into dst of the next rank and flushes: a put
    still to come long after the host returned from the launch."""
    start = _global_ns()
    now = start
    while now - start < delay_ns:
        now = _global_ns()
    tgl.put_signal(ctx, dst, src, nbytes, (tgl.rank(ctx) + 1) % tgl.world_size(ctx), sig)
    tgl.flush(ctx)


def _setup(argv=()):
    """jax (one of N processes when argv is `RANK N ADDR`), torch and an initialized jaxgin; the
    number of GPUs this process drives."""
    import jax
    import torch

    job.join(argv)
    import jaxgin
    import tritongin

    jaxgin.initialize(heap_size=os.environ.get("JAXGIN_TEST_HEAP", "3GiB"))
    devices = len(jax.local_devices())
    return jax, torch, jaxgin, tritongin, devices


def _ranks(jax):
    """(world size, jaxgin rank of each local GPU): ranks follow JAX's global device order."""
    order = {d.id: i for i, d in enumerate(jax.devices())}
    return jax.device_count(), [order[d.id] for d in jax.local_devices()]


def _launch_all(torch, tritongin, devices, launch):
    """launch(d, ctx) on every GPU, each on its current PyTorch stream."""
    for d in range(devices):
        with torch.cuda.device(d):
            launch(d, tritongin.context(d))


def _sync(torch, devices):
    for d in range(devices):
        torch.cuda.synchronize(d)


def standalone(iterations: int, argv=()):
    jax, torch, jaxgin, tritongin, devices = _setup(argv)
    world, ranks = _ranks(jax)
    all_lsa = jaxgin.info()["lsa_team_size"] == world and not jaxgin.info()["force_gin"]
    out = {"devices": devices, "world": world, "iterations": iterations, "processes": jax.process_count(),
           "barrier_kernel": "peer_ptr stores" if all_lsa else "put_signal"}
    words, block = 16384, 1024  # 64 KiB tiles
    tallies = [torch.zeros(2, dtype=torch.int32, device=f"cuda:{d}") for d in range(devices)]  # _tally's

    send = tritongin.empty((words,), "int32")
    recv = tritongin.empty((world * words,), "int32")
    barrier_programs = 4
    sig = tritongin.signals(3 + barrier_programs)
    barrier = (
        (lambda d, ctx, i: barrier_kernel[(barrier_programs,)](ctx, recv.local(d), tallies[d], words, i, BLOCK=block))
        if all_lsa else
        (lambda d, ctx, i: barrier_put_kernel[(barrier_programs,)](ctx, send.local(d), recv.local(d), tallies[d],
                                                                   sig[3], words, i, BLOCK=block)))
    cases = {
        "ring": lambda d, ctx, i: ring_kernel[(1,)](ctx, send.local(d), recv.local(d), tallies[d], sig[0], sig[1],
                                                    words, i, BLOCK=block),
        "all_pairs": lambda d, ctx, i: all_pairs_kernel[(1,)](ctx, send.local(d), recv.local(d), tallies[d], sig[2],
                                                              words, i, BLOCK=block),
        "barrier": barrier,
    }
    for name, case in cases.items():
        for t in tallies:
            t.zero_()
        start = time.perf_counter()
        for i in range(iterations):
            _launch_all(torch, tritongin, devices, lambda d, ctx: case(d, ctx, i))
        _sync(torch, devices)
        out[name] = {
            "mismatched_words": int(sum(int(t[0].item()) for t in tallies)),
            "words_checked": int(sum(int(t[1].item()) for t in tallies)),  # counted by the kernels
            "seconds": round(time.perf_counter() - start, 3),
        }
    out["words"] = words
    # DLPack: the heap buffer seen through PyTorch holds what a ring step received. (One more step
    # after the other cases: on ranks other than 0 they overwrite the ring's slot, slot 0.)
    for t in tallies:
        t.zero_()
    _launch_all(torch, tritongin, devices, lambda d, ctx: cases["ring"](d, ctx, iterations))
    _sync(torch, devices)
    left_of_first = (ranks[0] + world - 1) % world
    view = torch.from_dlpack(recv.local(0))
    expected = left_of_first * 1000003 + iterations * 7919 + torch.arange(words, device="cuda:0", dtype=torch.int32)
    out["dlpack_view_matches"] = bool(torch.equal(view[:words], expected))
    out["faults"] = jaxgin.device_faults()
    job.report(out)


def latency():
    jax, torch, jaxgin, tritongin, devices = _setup()
    buf = tritongin.empty((1 << 20,), "uint8")
    sig = tritongin.signals(1)
    rounds = 2000
    out = {"devices": devices, "rounds": rounds, "one_way_us": {}}

    def best_one_way(launch) -> float:
        best = None
        for repeat in range(3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.device(0):
                start.record()
            _launch_all(torch, tritongin, devices, lambda d, ctx: launch(d, ctx, repeat))
            with torch.cuda.device(0):
                stop.record()
            _sync(torch, devices)
            one_way = start.elapsed_time(stop) * 1000 / (2 * rounds)
            best = one_way if best is None else min(best, one_way)
        return round(best, 3)

    # the same machine's floor, measured first: a fixed bound from one GPU kind failed on another
    # (H200's 1.71 us raw ping-pong against 4 x H100, 2026-11-27)
    flag = tritongin.empty((1,), "int32")
    out["raw_atomic_one_way_us"] = best_one_way(
        lambda d, ctx, repeat: raw_pingpong_kernel[(1,)](ctx, flag.local(d), repeat * rounds, rounds, num_warps=1))
    for nbytes in (8, 256, 4096, 65536):
        out["one_way_us"][str(nbytes)] = best_one_way(
            lambda d, ctx, _, nbytes=nbytes: pingpong_kernel[(1,)](ctx, buf.local(d), sig[0], nbytes, rounds,
                                                                   num_warps=4))
    out["faults"] = jaxgin.device_faults()
    job.report(out)


def bandwidth():
    jax, torch, jaxgin, tritongin, devices = _setup()
    nbytes = 1 << 30
    count = nbytes // 4
    src = tritongin.empty((count,), "float32")
    dst = tritongin.empty((count,), "float32")
    with torch.cuda.device(0):
        torch.from_dlpack(src.local(0)).copy_(torch.arange(count, dtype=torch.float32, device="cuda:0"))
    torch.from_dlpack(dst.local(1)).zero_()
    _sync(torch, devices)

    def timed(fn, repeats=5):
        with torch.cuda.device(0):
            fn()  # warm-up (compile, first touch)
            torch.cuda.synchronize(0)
            times = []
            for _ in range(repeats):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1000)
        return min(times)

    out = {"devices": devices, "bytes": nbytes, "triton_peer_ptr": {}, "variant_copy_correct": {}}
    ctx = tritongin.context(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out["sms"] = sms
    expected = torch.from_dlpack(src.local(0)).to("cuda:1")
    variants = {f"BLOCK={block},num_warps={warps}": (
        lambda block=block, warps=warps: push_kernel[(triton.cdiv(count, block),)](
            ctx, src.local(0), dst.local(0), count, 1, BLOCK=block, num_warps=warps))
        for block, warps in ((4096, 8), (8192, 8), (16384, 16))}
    for per_sm, block, warps, stages, evict in ((1, 8192, 8, 1, ""), (2, 8192, 8, 1, ""), (1, 8192, 8, 3, ""),
                                               (2, 4096, 8, 3, "evict_first"), (1, 16384, 16, 3, "evict_first")):
        name = f"persistent {per_sm}/SM,BLOCK={block},num_warps={warps},stages={stages},{evict or 'evict_normal'}"
        variants[name] = (lambda per_sm=per_sm, block=block, warps=warps, stages=stages, evict=evict:
                          persistent_push_kernel[(per_sm * sms,)](ctx, src.local(0), dst.local(0), count, 1,
                                                                   BLOCK=block, STAGES=stages, EVICT=evict,
                                                                   num_warps=warps))
    # Fewer programs than SMs (NVLink, not the SMs, may be the limit: fewer writers contend less),
    # and streaming stores (.cs: no reuse expected in L2).
    for programs, store_cache in ((16, ""), (32, ""), (64, ""), (sms, ".cs"), (2 * sms, ".cs")):
        name = f"persistent {programs} programs,BLOCK=8192,num_warps=8,stages=3,store {store_cache or 'default'}"
        variants[name] = (lambda programs=programs, store_cache=store_cache:
                          persistent_push_kernel[(programs,)](ctx, src.local(0), dst.local(0), count, 1, BLOCK=8192,
                                                              STAGES=3, EVICT="", STORE_CACHE=store_cache,
                                                              num_warps=8))
    # Tensor descriptors made on the device need Triton's global scratch (128 bytes per descriptor
    # and program), which Triton's own launcher takes from this allocator.
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda:0"))
    columns = 256  # the largest TMA box side: [rows, 256] float32 rows of 1 KiB
    for per_sm, rows, warps, stages in ((1, 32, 4, 3), (1, 64, 4, 2), (2, 16, 4, 3), (1, 32, 8, 4)):
        name = f"tma persistent {per_sm}/SM,tile={rows}x{columns},num_warps={warps},stages={stages}"
        variants[name] = (lambda per_sm=per_sm, rows=rows, warps=warps, stages=stages:
                          tma_push_kernel[(per_sm * sms,)](ctx, src.local(0), dst.local(0), count // columns, 1,
                                                           BR=rows, C=columns, STAGES=stages, num_warps=warps))
    # One SM's rate, and a few SMs': what a fused kernel's epilogue can push while its other SMs
    # compute (a program's 64 KiB tile), with vector stores and with TMA bulk stores.
    for programs in (1, 2, 4, 8):
        variants[f"persistent {programs} programs,BLOCK=8192,num_warps=8,stages=3,store default"] = (
            lambda programs=programs: persistent_push_kernel[(programs,)](
                ctx, src.local(0), dst.local(0), count, 1, BLOCK=8192, STAGES=3, EVICT="", num_warps=8))
        variants[f"tma persistent {programs} programs,tile=32x{columns},num_warps=4,stages=3"] = (
            lambda programs=programs: tma_push_kernel[(programs,)](ctx, src.local(0), dst.local(0), count // columns,
                                                                   1, BR=32, C=columns, STAGES=3, num_warps=4))
    # The ceiling first: a variant that faults leaves the context unusable for what follows.
    plain_src = torch.arange(count, dtype=torch.float32, device="cuda:0")
    plain_dst = torch.empty(count, dtype=torch.float32, device="cuda:1")
    seconds = timed(lambda: plain_dst.copy_(plain_src, non_blocking=True))
    out["plain_peer_copy_GBs"] = round(nbytes / seconds / 1e9, 1)
    dst_on_1 = torch.from_dlpack(dst.local(1))
    for name, launch in variants.items():
        try:
            dst_on_1.zero_()
            torch.cuda.synchronize(1)
            seconds = timed(launch)
            torch.cuda.synchronize(1)
        except Exception as error:  # reported with what was measured before it; the rest cannot run
            out["variant_error"] = {name: f"{type(error).__name__}: {error}"}
            break
        out["triton_peer_ptr"][name] = round(nbytes / seconds / 1e9, 1)
        out["variant_copy_correct"][name] = bool(torch.equal(dst_on_1, expected))  # every byte, every variant
    if "variant_error" not in out:
        _pulls(out, torch, ctx, src, dst, count, columns, sms, timed)
    out["copy_correct"] = "variant_error" not in out and all(out["variant_copy_correct"].values())
    best = max(out["triton_peer_ptr"].values())
    out["best_triton_GBs"] = best
    out["best_variant"] = max(out["triton_peer_ptr"], key=out["triton_peer_ptr"].get)
    out["ratio_to_plain_copy"] = round(best / out["plain_peer_copy_GBs"], 3)
    job.report(out)


def _pulls(out, torch, ctx, src, dst, count, columns, sms, timed):
    """GPU 0 reads GPU 1's heap into its own (a pulled copy-out), per number of programs, with vector
    loads and with TMA loads: one SM's pull rate, against its push rate above. Each variant's copy is
    checked byte for byte into out["variant_copy_correct"] ("pull ..." names)."""
    with torch.cuda.device(1):
        torch.from_dlpack(src.local(1)).copy_(torch.arange(count, dtype=torch.float32, device="cuda:1").flip(0))
    torch.cuda.synchronize(1)
    expected = torch.from_dlpack(src.local(1)).to("cuda:0")
    variants = {}
    for programs in (1, 2, 4, 8, sms):
        variants[f"pull {programs} programs,BLOCK=8192,num_warps=8,stages=3"] = (
            lambda programs=programs: persistent_pull_kernel[(programs,)](
                ctx, src.local(0), dst.local(0), count, 1, BLOCK=8192, STAGES=3, num_warps=8))
        for rows, stages in ((32, 4), (64, 3)):
            variants[f"tma pull {programs} programs,tile={rows}x{columns},num_warps=4,stages={stages}"] = (
                lambda programs=programs, rows=rows, stages=stages: tma_pull_kernel[(programs,)](
                    ctx, src.local(0), dst.local(0), count // columns, 1, BR=rows, C=columns, STAGES=stages,
                    num_warps=4))
    dst_on_0 = torch.from_dlpack(dst.local(0))
    out["triton_pull"] = {}
    for name, launch in variants.items():
        try:
            dst_on_0.zero_()
            torch.cuda.synchronize(0)
            seconds = timed(launch, repeats=3)
        except Exception as error:
            out["variant_error"] = {name: f"{type(error).__name__}: {error}"}
            return
        out["triton_pull"][name] = round(out["bytes"] / seconds / 1e9, 1)
        out["variant_copy_correct"][name] = bool(torch.equal(dst_on_0, expected))


@triton.jit
def ring_call_kernel(ctx, x, send, recv, data_sig, credit_sig, out, WORDS: tl.constexpr):
    """jaxgin.triton_call's ring: x (an XLA buffer) goes to the right neighbour through the heap;
    what the left one sent comes back as `out` (== jax.lax.ppermute)."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    offs = tl.arange(0, WORDS)
    tl.store(send + offs, tl.load(x + offs))
    tgl.put_signal(ctx, recv, send, WORDS * 4, (me + 1) % n, data_sig)
    tgl.wait_arrivals(ctx, data_sig, 1)
    tl.store(out + offs, tl.load(recv + offs))
    tgl.signal(ctx, (me + n - 1) % n, credit_sig, 1)
    tgl.wait_arrivals(ctx, credit_sig, 1)


@triton.jit
def burst_ring_kernel(ctx, x, send, recv, data_sig, credit_sig, out, WORDS: tl.constexpr, PUTS: tl.constexpr):
    """ring_call_kernel with PUTS puts of x to the right neighbour in a row, none waited for (into
    PUTS slots of recv), so that one CTA fills its GPU-to-proxy queue; `out` is the last slot."""
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    offs = tl.arange(0, WORDS)
    tl.store(send + offs, tl.load(x + offs))
    for i in range(PUTS):
        tgl.put_signal(ctx, recv + i * WORDS, send, WORDS * 4, (me + 1) % n, data_sig)
    tgl.wait_arrivals(ctx, data_sig, PUTS)
    tl.store(out + offs, tl.load(recv + (PUTS - 1) * WORDS + offs))
    tgl.signal(ctx, (me + n - 1) % n, credit_sig, 1)
    tgl.wait_arrivals(ctx, credit_sig, 1)


def triton_call(iterations: int, argv=()):
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax, torch, jaxgin, tritongin, _ = _setup(argv)
    devices = jax.device_count()
    words = 4096
    send = tritongin.empty((words,), "float32")
    recv = tritongin.empty((words,), "float32")
    sig = tritongin.signals(2)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    ring = [(i, (i + 1) % devices) for i in range(devices)]
    gather = job.gathered

    def body(x):
        ours = jaxgin.triton_call(ring_call_kernel, x, send, recv, sig[0], sig[1], grid=(1,), out_shape=x,
                                  WORDS=words)
        theirs = jax.lax.ppermute(x, "x", ring)
        return jnp.array_equal(ours, theirs)[None], ours

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x"))))
    host = np.arange(devices * words, dtype=np.float32)
    x = jax.make_array_from_callback(host.shape, NamedSharding(mesh, P("x")), lambda index: host[index])
    # Per device, the iterations that differed from lax, counted on the device, gathered once.
    # The first call finishes before the counting programs compile, and the last before the
    # gather's: over the host transport, XLA loading a program while a jaxgin program runs can
    # stall both (docs/guide.md).
    count = jax.jit(lambda failed, equal: failed + (~equal).astype(jnp.int32))
    start = time.perf_counter()
    equal, ours = jax.block_until_ready(step(x + 0))
    failed = jax.block_until_ready(count(jnp.zeros_like(equal, dtype=jnp.int32), equal))
    for i in range(1, iterations):
        equal, ours = step(x + i)
        failed = count(failed, equal)
    mismatches = int(np.sum(gather(failed)))
    elapsed = time.perf_counter() - start
    expected = np.roll(host.reshape(devices, words), 1, axis=0).ravel()
    hlo = step.lower(x).as_text()
    ours = gather(ours)
    job.report({
        "devices": devices,
        "processes": jax.process_count(),
        "iterations": iterations,
        "mismatches": mismatches,
        "last_equals_numpy_roll": bool(np.array_equal(np.asarray(ours), expected + iterations - 1)),
        "custom_calls_in_hlo": hlo.count("jaxgin_triton_call"),
        "seconds": round(elapsed, 2),
        "faults": jaxgin.device_faults(),
    })


def free_while_puts_land(argv=()):
    """A heap buffer freed right after launching a kernel that puts into the next rank's copy of it
    (50 ms later, on the GPU): the bytes handed out again must be zero once every put is done, so
    the free has to wait for the kernels and the peers' puts (jaxgin.op_support.release)."""
    jax, torch, jaxgin, tritongin, devices = _setup(argv)
    world, ranks = _ranks(jax)
    words = 1 << 20  # 4 MiB: a GIN put the unkind transport writes in pieces
    src = tritongin.empty((words,), "int32")
    dst = tritongin.empty((words,), "int32")
    sig = tritongin.signals(1)
    for d in range(devices):
        with torch.cuda.device(d):
            torch.from_dlpack(src.local(d)).fill_(1)
    _launch_all(torch, tritongin, devices,
                lambda d, ctx: late_put_kernel[(1,)](ctx, src.local(d), dst.local(d), words * 4, sig[0], 50_000_000))
    freed_at = dst.offset
    start = time.perf_counter()
    dst.free()  # at once: every put into it is still to come
    free_seconds = time.perf_counter() - start
    again = tritongin.empty((words,), "int32")
    _sync(torch, devices)
    time.sleep(0.2)  # what is still on its way lands (the unkind transport delays by up to 2 ms)
    nonzero = []
    for d in range(devices):
        with torch.cuda.device(d):
            nonzero.append(int(torch.count_nonzero(torch.from_dlpack(again.local(d))).item()))
    job.report({"devices": devices, "world": world, "ranks": ranks, "words": words,
                "reused_the_offset": again.offset == freed_at, "nonzero_words_after_reuse": nonzero,
                "free_seconds": round(free_seconds, 3), "faults": jaxgin.device_faults()})


def bringup(argv=()):
    """Triton and tritongin imported first (this module's top), then initialize / selftest /
    finalize: the launch pattern of every tritongin scenario, alone."""
    jax, torch, jaxgin, tritongin, devices = _setup(argv)
    report = jaxgin.selftest(rounds=2)
    info = jaxgin.info()
    jaxgin.finalize()
    job.report({"devices": devices, "world": info["world_size"], "gin_type": info["gin_type"],
               "selftest_ok": report.ok, "path": report.path})


if __name__ == "__main__":
    name, rest = sys.argv[1], sys.argv[2:]
    if name == "standalone":
        standalone(int(rest[0]) if rest else 1, rest[1:])
    elif name == "latency":
        latency()
    elif name == "bandwidth":
        bandwidth()
    elif name == "triton_call":
        triton_call(int(rest[0]) if rest else 1, rest[1:])
    elif name == "bringup":
        bringup(rest)
    elif name == "free_while_puts_land":
        free_while_puts_land(rest)
    else:
        raise SystemExit(f"unknown scenario {name}")
