"""What the ops' Triton kernels share on the device: the per-peer choice of data path, and the
hand-over of GIN arrivals to the programs that wait for them (the device side of op_support).

Every op kernel that moves data between GPUs (jaxgin.fused, jaxgin.moe) has two paths per peer,
picked on the device because a mesh may mix them:

- an NVLink (LSA) peer is reached with Triton's own loads and stores through ``peer_ptr``, and
  readiness travels as flags (``set_flag`` / ``wait_flag``: values, so any number of programs can
  wait for one);
- a peer on another host (GIN) gets a ``put_signal`` from a heap staging area (a NIC reads only
  registered memory) into a receive area in its heap, and readiness arrives as signal increments.

Increments are counts, not values, and ``wait_arrivals`` consumes them, so only one program may
wait on a signal. ``arrivals_to_flag`` bridges the two: one program waits for a source's puts and
raises the same local flag an NVLink source would have raised, so everything downstream (placement,
copy-out, the matmul) is shared by both paths. Where many programs need the same arrivals,
``wait_gin_source`` makes the first of them that one waiter.

Every op kernel also follows one call protocol, so that replays need no host values: a call
counter on the device picks the half of each two-halved buffer (``call_position``), and the last
program to finish advances it (``finish_call``). Work that other programs wait for is handed out
by the order in which programs started (``start_order``) or claimed from a counter, never dealt
by ``tl.program_id``: waits then point only at programs that have started, whatever order the
hardware starts a grid's programs in.

Import only from kernel modules: it needs Triton, an optional dependency.
"""

import triton
import triton.language as tl

import jaxgin.triton_device.language as tgl

# An axis route (jaxgin.axis_route): route[AXIS_INDEX] is this GPU's index along the axis,
# route[RANKS + d] the global rank of axis index d.
AXIS_INDEX = tl.constexpr(0)
RANKS = tl.constexpr(1)
# Word CALLS of every op's state is the call counter; each kernel module names the words after it.
CALLS = tl.constexpr(0)


@triton.jit
def rank_of(route, d):
    """The global rank (tritongin numbering) of axis index `d`, from an axis route."""
    return tl.load(route + RANKS + d)


@triton.jit
def gin_route(ctx, route, d, me, GIN: tl.constexpr):
    """1 when axis index `d` (route: [me, rank of axis index 0, 1, ...], jaxgin.axis_route) is
    another GPU reached through GIN, else 0. With GIN = 0 (a job whose GPUs are all NVLink peers,
    op_support.gin_in_job) it is 0 without a library call, and kernels compile their GIN branches
    away."""
    gin = me * 0  # a runtime int32 either way, so callers branch on it alike
    if GIN:
        gin = tgl.gin_peer(ctx, rank_of(route, d))  # 0 for this GPU itself
    return gin


@triton.jit
def _axis_hosts(route, hosts, P: tl.constexpr, BP: tl.constexpr):
    """(axis indices [BP], the host of each [BP], -1 past P)."""
    idx = tl.arange(0, BP)
    ok = idx < P
    return idx, tl.load(hosts + tl.load(route + RANKS + idx, mask=ok, other=0), mask=ok, other=-1)


@triton.jit
def _host_of(idx, host, d):
    return tl.sum(tl.where(idx == d, host, 0))


@triton.jit
def _place(idx, host, d):
    """host_place, from _axis_hosts' arrays."""
    return tl.sum(tl.where((idx < d) & (host == _host_of(idx, host, d)), 1, 0))


@triton.jit
def _size(idx, host, d):
    """host_size, from _axis_hosts' arrays."""
    return tl.sum(tl.where(host == _host_of(idx, host, d), 1, 0))


@triton.jit
def host_place(route, hosts, d, P: tl.constexpr, BP: tl.constexpr):
    """Axis index `d`'s place among the axis indices of its host (0 for the first in axis order)."""
    idx, host = _axis_hosts(route, hosts, P, BP)
    return _place(idx, host, d)


@triton.jit
def host_size(route, hosts, d, P: tl.constexpr, BP: tl.constexpr):
    """How many axis indices share axis index `d`'s host (d included)."""
    idx, host = _axis_hosts(route, hosts, P, BP)
    return _size(idx, host, d)


@triton.jit
def network_entry(route, hosts, s, d, P: tl.constexpr, BP: tl.constexpr):
    """The axis index on `d`'s host that receives over the network what axis index `s` sends to
    that host; `d` itself where s and d share a host (jaxgin.hosts.entries states the rule): the
    index of d's host whose place there is s's place modulo the host's size.
    hosts: int32 [world], each rank's host (jaxgin.hosts.rank_hosts); BP: P rounded up to a power
    of two."""
    idx, host = _axis_hosts(route, hosts, P, BP)
    host_d = _host_of(idx, host, d)
    # each axis index's place among its host's (those before it on the same host): s's is among them
    earlier = (host[:, None] == host[None, :]) & (idx[None, :] < idx[:, None])
    place = tl.sum(tl.where(earlier, 1, 0), axis=1)
    place_s = tl.sum(tl.where(idx == s, place, 0))
    entry = tl.sum(tl.where((host == host_d) & (place == place_s % _size(idx, host, d)), idx, 0))
    return tl.where(_host_of(idx, host, s) == host_d, d, entry)


@triton.jit
def arrivals_to_flag(ctx, signal, count, flag, value, my_rank):
    """CTA-collective. Waits for `count` more puts on this GPU's `signal` (bounded by the runtime's
    timeout; the fault names the signal and, over the host transport, a peer whose process ended),
    then sets this GPU's flag word `flag` to `value` (release), so every program waiting on the flag
    sees the puts' payloads. The one waiter per signal that wait_arrivals allows."""
    tgl.wait_arrivals(ctx, signal, count)
    tgl.set_flag(ctx, flag, value, my_rank)


@triton.jit
def wait_gin_source(ctx, claim, signal, count, flag, value, my_rank):
    """CTA-collective. Every program that needs a GIN source's `count` puts on `signal` calls this,
    and returns once they have arrived. The first caller of the call claims `claim` (a word of the
    op's state, zero at first, holding the last call that claimed it: `value` = call counter + 1
    moves it on by compare-and-swap) and hands the arrivals to `flag` (arrivals_to_flag); every
    caller then waits on the flag. The waiter is thus a program that has started, whichever it
    is, and no program waits for one that may not have (see start_order). Exactly one claim per
    call: some program must call this in every call, or the next call's arrivals would be counted
    against this one."""
    first = tl.atomic_cas(claim, value - 1, value, sem="relaxed", scope="gpu") == value - 1
    if first:
        arrivals_to_flag(ctx, signal, count, flag, value, my_rank)
    tgl.wait_flag(ctx, flag, value)


@triton.jit
def call_position(route, state):
    """(this GPU's axis index, the call counter state[CALLS], the half of the two-halved buffers
    this call uses)."""
    me = tl.load(route + AXIS_INDEX)
    epoch = tl.load(state + CALLS)
    return me, epoch, epoch % 2


@triton.jit
def start_order(counter):
    """This program's place (0 .. programs - 1) in the order the grid's programs started, taken
    from `counter`, a word of the op's state that is zero when a call starts (finish_call zeroes
    it). CUDA does not promise to start a grid's programs in program-id order, so a kernel whose
    programs wait for other programs (on this GPU or on peers) numbers them by this instead: every
    program at a lower place has started (and holds an SM, or is done), so if programs only wait
    for lower places, and the lowest never wait, every wait ends (by induction over places, on
    every GPU at once), even while another kernel holds some of the SMs."""
    return claim(counter)


@triton.jit
def claim(counter):
    """The next number (0, 1, ...) handed out by `counter`, a word of the op's state that is zero
    when a call starts (finish_call zeroes it): a place in the start order, or a work item that
    programs share. Relaxed: only the number is handed out, no data with it."""
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu").to(tl.int32)


@triton.jit
def finish_call(state, finished, epoch, programs, counters, COUNTERS: tl.constexpr):
    """Every program of the grid calls this last, with `finished` a counter word of the op's state
    (zero between calls). The last of `programs` to arrive zeroes it and the op's other per-call
    counters (COUNTERS words from `counters`: every program has made its last claim on them by
    then), and advances the call counter state[CALLS] (release: every program's work precedes the
    next call). Zeroed rather than offset by the call number, the counters stay right when calls of
    one configuration run with different grids."""
    done = tl.atomic_add(finished, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        tl.atomic_xchg(finished, 0, sem="relaxed", scope="gpu")
        for i in tl.static_range(COUNTERS):
            tl.atomic_xchg(counters + i, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(state + CALLS, epoch + 1, sem="release", scope="gpu")


# Traced kernels (the tools' view of where a kernel's time goes): a record of 8 int64 words per
# program, in an int32 [programs, 16] output (XLA outside x64 mode has no int64 arrays).


@triton.jit
def now_ns(TRACE: tl.constexpr):
    """The GPU's global timer in ns when TRACE, else 0 (no instruction)."""
    if TRACE:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)
    return tl.full((), 0, tl.int64)


@triton.jit
def trace_word(trace, place, word: tl.constexpr, value):
    """Word `word` of program record `place` in a traced kernel's records."""
    tl.store(trace.to(tl.pointer_type(tl.int64), bitcast=True) + place.to(tl.int64) * 8 + word, value)
