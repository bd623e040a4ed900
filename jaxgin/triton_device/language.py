"""The device functions behind ``tritongin.language``: communication from inside ``@triton.jit`` kernels.

Call them from any Triton kernel (plain ``@triton.jit``) with the jaxgin context the kernel
receives as an argument (``tritongin.context()`` standalone, or the first argument under
``jaxgin.triton_call``)::

    @triton.jit
    def ring(ctx, buf, signal, nbytes):
        me = tgl.rank(ctx)
        right = (me + 1) % tgl.world_size(ctx)
        tgl.put_signal(ctx, buf, buf, nbytes, right, signal)
        tgl.wait_arrivals(ctx, signal, 1)

Thread semantics. Triton runs a scalar call on every thread of a program (a CTA). Functions marked
*CTA-collective* rely on that: every thread of the program must reach the call with the same
arguments (keep them out of branches that depend on data a thread computed alone); one thread is
elected inside the device library. Functions marked *any thread* have no such requirement.

Memory ordering. ``put_signal``'s payload is visible to whoever observes the signal increment it
caused; ``signal`` is ordered after every store the program made before it; ``wait_signal`` and
``wait_arrivals`` acquire, so the payloads counted in the signal are visible to every thread of the
program once they return. Every wait is bounded by the runtime's timeout: past it the fault is
recorded (op, rank, signal, expected and observed values) and the kernel traps; the host raises
``jaxgin.DeviceFault`` (or ``jaxgin.device_faults()`` lists them) naming them.

Heap pointers. ``dst``/``src`` of ``put_signal`` and ``ptr`` of ``peer_ptr`` must point into the
symmetric heap (``tritongin.empty``, or heap buffers ``jaxgin.triton_call`` passes); the device
library checks the range of every put and faults instead of writing elsewhere.
"""

from __future__ import annotations

import hashlib

from jaxgin.errors import install_command

try:
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ModuleNotFoundError as e:
    if e.name not in ("triton", "triton.language"):  # a broken Triton names what it lacks itself
        raise
    raise ModuleNotFoundError(
        f"tritongin.language needs Triton, which is not installed: {install_command('cuda')} (or pip install "
        "'triton>=3.6')", name="triton") from None

from jaxgin.triton_device import _externs
from jaxgin.triton_device import link as _link


class _LibraryFunction(JITFunction):
    """A device function whose Triton cache key includes the linked device library's identity.

    Triton folds the keys of the functions a kernel calls into the kernel's own key, so every
    kernel that calls one of these is keyed by the NCCL (and nvcc, ptxas, sources) it is
    linked against."""

    @property
    def cache_key(self) -> str:
        own = JITFunction.cache_key.fget(self)
        return hashlib.sha256(f"{own}-jaxgin-{_link.library_key()}".encode()).hexdigest()


def _device_function(fn):
    _link.install()
    return _LibraryFunction(fn)


@_device_function
def rank(ctx):
    """Any thread. This GPU's rank (JAX's global device order), int32."""
    return _externs.rank(ctx)


@_device_function
def world_size(ctx):
    """Any thread. Number of ranks, int32."""
    return _externs.world_size(ctx)


@_device_function
def peer_ptr(ctx, ptr, peer):
    """Any thread. The address through which this GPU reaches `peer`'s copy of heap location
    `ptr` over NVLink (`ptr` a heap pointer, or a tensor of them), with `ptr`'s type, so bulk data
    moves with Triton's own ``tl.store``/``tl.load``. `peer` must be in this rank's LSA team (a
    GPU of this host); otherwise the kernel faults naming the peer. Plain stores through it are not
    ordered with a later ``signal`` by themselves: ``signal`` orders them (it synchronises the
    program and releases at system scope, also when the signal goes through GIN)."""
    delta = _externs.peer_delta(ctx, peer)
    # Peer mappings of the heap are offsets of whole allocation granules, so the delta keeps `ptr`'s
    # alignment; saying so lets Triton keep its 16-byte vector stores.
    delta = tl.multiple_of(delta, 16)
    byte_ptr = ptr.to(tl.pointer_type(tl.int8), bitcast=True)
    return (byte_ptr + delta).to(ptr.dtype, bitcast=True)


@_device_function
def gin_peer(ctx, peer):
    """Any thread. 1 (int32) when ``put_signal`` to `peer` goes through GIN (a GPU of another host,
    or every other GPU when the runtime forces GIN), 0 when it stores over NVLink, and 0 for this
    rank itself. A kernel picks its data path per peer with it: Triton's own stores through
    ``peer_ptr`` for NVLink peers; for GIN peers, stores into a heap staging area and one
    ``put_signal`` per region (a NIC reads only registered memory). Faults if `peer` is not a rank."""
    return _externs.gin_peer(ctx, peer)


@_device_function
def put_signal(ctx, dst, src, nbytes, peer, signal):
    """CTA-collective. Copies `nbytes` from local heap address `src` to `dst`'s heap offset on
    `peer`, then adds 1 to signal `signal` on `peer`; the payload is visible before the increment.
    LSA peers: the program's threads store through NVLink; other peers: one GIN put-with-signal.
    Afterwards `src` may be overwritten on LSA paths; call ``flush`` before reusing it when the peer
    may be remote."""
    _externs.put_signal(ctx, dst, src, nbytes, peer, signal)


@_device_function
def signal(ctx, peer, signal, value):
    """CTA-collective (synchronises the program first). Adds `value` to `signal` on `peer`, after
    every store the program made before the call and after this program's earlier puts to `peer`;
    not necessarily after other programs' puts (this kernel's or earlier ones'): over GIN a signal
    settles only the puts of its own GIN context, which is its program's. Wait for those puts' own
    signals instead."""
    _externs.signal(ctx, peer, signal, value)


@_device_function
def read_signal(ctx, signal):
    """Any thread. Current value of this rank's `signal` (acquire), int64."""
    return _externs.read_signal(ctx, signal)


@_device_function
def wait_signal(ctx, signal, value):
    """CTA-collective. Blocks until this rank's `signal` is >= `value` (an absolute count: signals
    only grow, over the whole life of the runtime); returns the value seen. For kernels that run
    more than once (loops, jax.jit, CUDA graphs) prefer ``wait_arrivals``, which needs no absolute
    value."""
    return _externs.wait_signal(ctx, signal, value)


@_device_function
def wait_arrivals(ctx, signal, count):
    """CTA-collective. Blocks until `count` more increments arrived on this rank's `signal` than
    were consumed by earlier ``wait_arrivals`` on it, then consumes them. The consumed count lives
    in device memory, so the same kernel is right when replayed in a CUDA graph. One program at a
    time per signal."""
    return _externs.wait_arrivals(ctx, signal, count)


@_device_function
def set_flag(ctx, flag, value, peer):
    """CTA-collective (synchronises the program first). Sets the int64 heap word `flag` on `peer`
    (an LSA peer) to `value`, after every store the program made before the call (release). Flags
    carry values rather than counts: set them to a call counter, and any number of programs on the
    peer can wait for that call with ``wait_flag`` (a later value satisfies an earlier wait)."""
    _externs.set_flag(ctx, flag, value, peer)


@_device_function
def wait_flag(ctx, flag, value):
    """CTA-collective. Blocks until this rank's int64 heap word `flag` is >= `value` (acquire: what
    the setter stored before ``set_flag`` is visible to the program afterwards); returns the value
    seen. Bounded by the runtime's timeout (a fault naming the flag's heap offset)."""
    return _externs.wait_flag(ctx, flag, value)


@_device_function
def wait_peer_flag(ctx, flag, value, peer):
    """CTA-collective. As ``wait_flag``, but waits on LSA peer `peer`'s copy of the heap word `flag`
    (polled over NVLink): the consumer side of a pull, where the peer stores data into its own heap,
    sets its own flag with ``set_flag(ctx, flag, value, own_rank)``, and readers load it through
    ``peer_ptr``. Faults naming the peer if it is not an LSA peer."""
    return _externs.wait_peer_flag(ctx, flag, value, peer)


@_device_function
def flush(ctx):
    """CTA-collective. The sources of this program's earlier puts may be overwritten afterwards
    (it does not mean they arrived: a signal says that)."""
    _externs.flush(ctx)


@_device_function
def barrier(ctx):
    """CTA-collective, on every rank: program p waits for program p of every rank (p below the
    runtime's barrier slots, 64 by default). Everything the program did before it, its puts
    included, happens before everything program p of every rank does after it (other programs'
    puts: as for ``signal``)."""
    _externs.barrier(ctx)


__all__ = [
    "barrier",
    "flush",
    "gin_peer",
    "peer_ptr",
    "put_signal",
    "rank",
    "read_signal",
    "set_flag",
    "signal",
    "wait_arrivals",
    "wait_flag",
    "wait_peer_flag",
    "wait_signal",
    "world_size",
]
