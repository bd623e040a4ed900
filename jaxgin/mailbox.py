"""Split-phase one-sided communication: put now, compute, wait later.

    box = jaxgin.Mailbox("ring", shape=(1024,), dtype=jnp.float32)
    # inside jax.shard_map over axis "x" of size n:
    me = jax.lax.axis_index("x")
    token = jaxgin.put_signal(block, box, peer=(me + 1) % n, axis_name="x")
    ...                                   # compute while the block travels
    inbox = jaxgin.wait_signal(box, count=1, axis_name="x", after=token)   # [n, 1024]
    left = inbox[(me - 1) % n]            # == jax.lax.ppermute(block, "x", ring)
    # or, waiting for that one sender only (no [n, ...] result):
    left = jaxgin.wait_signal_from(box, (me - 1) % n, axis_name="x", after=token)

A mailbox is a named region of every device's symmetric heap with one slot per sender on the
axis. put_signal writes an array into slot `my index` of the mailbox at `peer` (an axis index: a
Python int or a traced int32 scalar, so the destination may depend on data) and bumps that
mailbox's signal there. wait_signal blocks on the device until `count` puts arrived in this
device's mailbox and returns them as [axis size, *shape], the row of each sender that put, zeros
elsewhere. wait_signal_from waits for the next put of one given sender (an axis index, Python int
or traced) and returns just its payload; other senders' puts stay for later waits.

On GPUs a put to an NVLink peer of at most 8 KiB travels as "lines" (8 payload bytes and a flag
per 16-byte store, so the data is its own signal); larger puts and puts over GIN write the
sender's slot and then bump the mailbox's signal.

Rules (the device checks what it can and fails with a named error instead of hanging):
  - every put to a device needs a wait_signal on that device before the next put to it from the
    same sender into the same mailbox (the next put waits for it: flow control, bounded by the
    runtime timeout);
  - pass the put's token to wait_signal(after=...): it orders the wait after the put in the
    program (XLA must not hoist a wait above the puts it depends on) and, in reference mode,
    carries the data;
  - put_signal / wait_signal are not differentiable (use jaxgin.ppermute / all_to_all for that).

Reference mode checks these rules when the program runs and fails where a GPU would fault (there
after the runtime timeout): a wait_signal that finds fewer than `count` puts, a wait_signal_from
whose source has no put waiting, a put from a sender whose previous put into the same mailbox at
the same receiver no wait has taken yet, and a traced peer or source out of range. The error names
the op, the mailbox, the ranks (indices along the op's axis) and the counts, in the words of the
GPU's fault line. How: every put and wait computes, on each device, which senders' puts are
waiting in its mailbox (int32 masks next to the data, from the all_gather the reference put does
anyway), and a lax.cond on "is this a misuse" calls jax.pure_callback only on the bad branch; the
callback raises JaxginError, which JAX hands back as a JaxRuntimeError carrying the message (like
a GPU fault, when the result is read). The cond's int32 zero is added to the masks the data is
selected with, so the check runs before the op's result exists and XLA cannot drop it. A correct
program pays a few int32[axis size] operations and a not-taken branch per op; no callback runs.
checkify would need every caller to wrap their function, and an unconditional debug.callback would
run on the host at every op. The order of puts and waits is followed within one traced body (a
jit, a shard_map, a loop body): a wait in another body that takes a put's token (a loop body
waiting on a put made before the loop) makes the put unknown to later checks of its own body,
which then skip it rather than guess. The GPU does not fault on a put that no wait ever takes
(until a later put from the same sender to the same receiver, in a later call), so neither does
reference mode.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import sys
import weakref
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive, get_opaque_trace_state
from jax.interpreters import batching, mlir

from jaxgin import op_support, runtime
from jaxgin.errors import JaxginError
from jaxgin.ffi import axes as axes_lib
from jaxgin.ffi import capture
from jaxgin.ffi import op_table

MAILBOX_HEADER_BYTES = op_table.CONSTANTS["mailbox_header_bytes"]
MAX_AXIS_SIZE = op_table.CONSTANTS["max_exchange_peers"]

_declared: dict[str, tuple[tuple[int, ...], np.dtype]] = {}


@dataclasses.dataclass(frozen=True)
class Mailbox:
    """A named, typed receive area that exists on every device of an axis.

    Declaring the same name again with another shape or dtype is an error: the name identifies
    the heap region every device agrees on.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __init__(self, name: str, shape: int | Sequence[int], dtype):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Mailbox name must be a non-empty str, got {name!r}")
        shape = _shape_arg(name, shape)
        dtype = _dtype_arg(name, dtype)
        previous = _declared.setdefault(name, (shape, dtype))
        if previous != (shape, dtype):
            raise ValueError(
                f"Mailbox {name!r} was declared with shape {previous[0]} and dtype {previous[1]}; it cannot be "
                f"reused with shape {shape} and dtype {dtype}. Use another name"
            )
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _shape_arg(name: str, shape) -> tuple[int, ...]:
    """An int or a sequence of ints, as JAX takes shapes (8 means (8,))."""
    rule = "shape must be an int or a sequence of non-negative ints (like jnp.zeros' shape)"
    if _is_int(shape):
        shape = (shape,)
    elif isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(f"Mailbox {name!r}: {rule}, got {type(shape).__name__} {shape!r}")
    bad = [d for d in shape if not _is_int(d)]
    if bad:
        raise TypeError(f"Mailbox {name!r}: {rule}, got {tuple(shape)!r}: {bad[0]!r} is not an int")
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"Mailbox {name!r}: shape {shape} has a negative dimension; {rule}")
    return shape


def _dtype_arg(name: str, dtype) -> np.dtype:
    """A numeric or bool dtype JAX arrays can have."""
    wanted = f"Mailbox {name!r}: dtype must be a numeric or bool dtype such as jnp.float32, jnp.bfloat16 or 'int8'"
    try:
        checked = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{wanted}, got {dtype!r}") from None
    if not (jnp.issubdtype(checked, jnp.number) or jnp.issubdtype(checked, jnp.bool_)):
        raise TypeError(f"{wanted}, got {dtype!r}")
    return checked


def mailbox_bytes(payload_bytes: int, axis_size: int) -> int:
    """Heap bytes of a mailbox (mirrors mailbox_bytes in csrc/kernels/mailbox.h): header, a slot per
    sender, a GIN staging slot, and a line slot per sender when the payload fits lines."""
    slot = 16 if payload_bytes == 0 else -(-payload_bytes // 16) * 16
    line_slot = 0 if payload_bytes > runtime.LINE_MAX_BYTES else 16 * max(1, -(-payload_bytes // 8))
    return MAILBOX_HEADER_BYTES + slot * (axis_size + 1) + line_slot * axis_size


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Token:
    """What put_signal returns; pass it to wait_signal(after=...). On GPUs an int32 scalar (the
    destination index); in reference mode it also carries the data that round of puts delivered."""

    mailbox: str
    values: tuple

    def tree_flatten(self):
        return self.values, self.mailbox

    @classmethod
    def tree_unflatten(cls, mailbox, values):
        return cls(mailbox, tuple(values))


# ---------------------------------------------------------------------------------------------
# Primitives (CUDA backend only; reference mode computes with lax collectives at trace time).

put_signal_p = Primitive("jaxgin_put_signal")
wait_signal_p = Primitive("jaxgin_wait_signal")
wait_signal_from_p = Primitive("jaxgin_wait_signal_from")


@put_signal_p.def_abstract_eval
def _put_abstract(x, peer, **_):
    return x.update(shape=(), dtype=jnp.dtype(jnp.int32), weak_type=False)


# wait_signal's kernel writes only the rows it took and says which in a mask; the zeros of the
# other rows come from a select that XLA fuses with whatever reads the rows (often one row of them).
# An empty payload has no mask: XLA folds an empty element of a tuple to a constant, and what the
# program computes from the rows would no longer follow the wait.
wait_signal_p.multiple_results = True


@wait_signal_p.def_abstract_eval
def _wait_abstract(*tokens, axis_name, size, shape, dtype, **_):
    # Same varying-axes type as the tokens (what arrives differs per device, as they do).
    rows = tokens[0].update(shape=(size, *shape), dtype=jnp.dtype(dtype), weak_type=False)
    if rows.size == 0:
        return (rows,)
    return rows, tokens[0].update(shape=(size,), dtype=jnp.dtype(jnp.int32), weak_type=False)


def _no_batching(name):
    def rule(*_, **__):
        raise JaxginError(f"{name} cannot be vmapped: each call is one put into one mailbox; loop or use jaxgin.ppermute")

    return rule


@wait_signal_from_p.def_abstract_eval
def _wait_from_abstract(source, *tokens, shape, dtype, **_):
    return tokens[0].update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


batching.primitive_batchers[put_signal_p] = _no_batching("jaxgin.put_signal")
batching.primitive_batchers[wait_signal_p] = _no_batching("jaxgin.wait_signal")
batching.primitive_batchers[wait_signal_from_p] = _no_batching("jaxgin.wait_signal_from")

# Reference mode computes with lax collectives at trace time, which vmap would batch silently; an
# identity primitive with the same batching rule makes vmap fail the same way on every backend.
_unbatchable_p = Primitive("jaxgin_unbatchable")
_unbatchable_p.def_abstract_eval(lambda x, **_: x)
_unbatchable_p.def_impl(lambda x, **_: x)
mlir.register_lowering(_unbatchable_p, mlir.lower_fun(lambda x, **_: x, multiple_results=False))
batching.primitive_batchers[_unbatchable_p] = lambda args, dims, *, op: _no_batching(op)()


def _placement(state, box_name: str, payload_bytes: int, size: int) -> tuple[int, int]:
    """Heap offset and first signal of a mailbox on this runtime (placed on first use; its header,
    line slots and slots start at zero: see op_support's zero invariant)."""

    def place():
        if size > MAX_AXIS_SIZE:
            raise JaxginError(f"jaxgin mailboxes support axes of at most {MAX_AXIS_SIZE} devices, got {size}")
        return state.heap.allocate(mailbox_bytes(payload_bytes, size)), state.signals.allocate(2 * size), payload_bytes

    offset, signal_base, placed_bytes = op_support.placed(state, ("mailbox", box_name, size), place)
    if placed_bytes != payload_bytes:
        raise JaxginError(f"mailbox {box_name!r} is placed for {placed_bytes} bytes per slot, not {payload_bytes}")
    return offset, signal_base


def _lower_put(ctx, x, peer, *, axis_name, size, mailbox, payload_bytes):
    state = op_support.lowering_state("jaxgin.put_signal")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.put_signal")
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering(capture.target_for("jaxgin.put_signal", state), has_side_effect=True)(
        ctx, x, peer, offset=np.int64(offset), signal_base=np.int64(signal_base), **attrs
    )


def _lower_wait(ctx, *tokens, axis_name, size, shape, dtype, mailbox, count):
    state = op_support.lowering_state("jaxgin.wait_signal")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.wait_signal")
    payload_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering(capture.target_for("jaxgin.wait_signal", state), has_side_effect=True)(
        ctx, *tokens, offset=np.int64(offset), signal_base=np.int64(signal_base), count=np.int64(count), **attrs
    )


def _lower_wait_from(ctx, source, *tokens, axis_name, size, shape, dtype, mailbox):
    state = op_support.lowering_state("jaxgin.wait_signal_from")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.wait_signal_from")
    payload_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering(capture.target_for("jaxgin.wait_signal_from", state), has_side_effect=True)(
        ctx, source, *tokens, offset=np.int64(offset), signal_base=np.int64(signal_base), **attrs
    )


def _unsupported_platform(op):
    def rule(ctx, *args, **params):
        raise JaxginError(f"{op} was traced for jaxgin's cuda backend; it can only be compiled for CUDA GPUs")

    return rule


mlir.register_lowering(put_signal_p, _unsupported_platform("jaxgin.put_signal"))
mlir.register_lowering(wait_signal_p, _unsupported_platform("jaxgin.wait_signal"))
mlir.register_lowering(wait_signal_from_p, _unsupported_platform("jaxgin.wait_signal_from"))
mlir.register_lowering(put_signal_p, _lower_put, platform="cuda")
mlir.register_lowering(wait_signal_p, _lower_wait, platform="cuda")
mlir.register_lowering(wait_signal_from_p, _lower_wait_from, platform="cuda")


# ---------------------------------------------------------------------------------------------
# Public API


def _not_differentiable(op: str):
    def wrap(fn):
        fn = jax.custom_jvp(fn, nondiff_argnums=())

        @fn.defjvp
        def _jvp(primals, tangents):
            raise JaxginError(
                f"{op} is not differentiable (a one-sided put has no well-defined transpose without knowing "
                "every receiver's wait); differentiate through jaxgin.ppermute or jaxgin.all_to_all instead"
            )

        return fn

    return wrap


def _axis_index_arg(value, size: int, op: str, name: str, role: str):
    """A Python int checked now, or an integer scalar checked on the device (int32 either way)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if not 0 <= int(value) < size:
            raise ValueError(f"{op}: {name}={int(value)} is out of range for an axis of size {size}")
        return jnp.int32(value)
    wanted = f"{op}: {name} must be a Python int or an integer scalar (the {role}'s axis index)"
    try:
        value = jnp.asarray(value)
    except TypeError:
        raise TypeError(f"{wanted}, got {type(value).__name__} {value!r}") from None
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{wanted}, got {value.dtype}{list(value.shape)}")
    return value.astype(jnp.int32)


def put_signal(x, mailbox: Mailbox, peer, *, axis_name) -> Token:
    """Sends `x` into slot `my axis index` of `mailbox` on the device at axis index `peer` and bumps
    that mailbox's signal there. Returns a Token for wait_signal(after=...).

    `x` must match the mailbox's shape and dtype. A traced `peer` outside [0, axis size) makes the
    device fail with an error naming the op and the index (the program stops; nothing is written).
    In reference mode so does a put while this sender's previous put into the mailbox still waits
    at that receiver (on a GPU it would wait for the receiver's credit and time out).
    """
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"jaxgin.put_signal: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, "jaxgin.put_signal")
    size = axes_lib.axis_size(names, "jaxgin.put_signal")
    axes_lib.require_shard_map(names, "jaxgin.put_signal")
    x = jnp.asarray(x)
    if x.shape != mailbox.shape or x.dtype != mailbox.dtype:
        raise TypeError(
            f"jaxgin.put_signal: x is {x.dtype}{list(x.shape)} but mailbox {mailbox.name!r} holds "
            f"{mailbox.dtype}{list(mailbox.shape)}; every sender and receiver of a mailbox uses its shape and dtype"
        )
    peer_is_traced = not _is_int(peer)
    peer = _axis_index_arg(peer, size, "jaxgin.put_signal", "peer", "destination")
    state = runtime.current()

    @_not_differentiable("jaxgin.put_signal")
    def put(x, peer):
        if state.options.backend == "reference":
            return _reference_put(_unbatchable_p.bind(x, op="jaxgin.put_signal"), peer, names)
        return (
            put_signal_p.bind(x, peer, axis_name=names, size=size, mailbox=mailbox.name, payload_bytes=mailbox.nbytes),
        )

    if state.options.backend == "reference":
        return _checked_put(mailbox, names, size, peer, peer_is_traced, *put(x, peer))
    return Token(mailbox.name, tuple(put(x, peer)))


def _reference_put(x, peer, names):
    # Everyone's data and destination, then keep what was sent to me: the mail of this round.
    sent = jax.lax.all_gather(x, names)
    destinations = jax.lax.all_gather(peer, names)
    arrived = destinations == jax.lax.axis_index(names)
    mail = jnp.where(arrived.reshape((-1,) + (1,) * x.ndim), sent, jnp.zeros_like(sent))
    return mail, arrived.astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Reference mode: the protocol checks (the module docstring says what and how)


@dataclasses.dataclass(eq=False)
class _TracedPut:
    """A put as reference mode follows it through the traced body that made it. `pending` is
    int32[axis size]: on each device, nonzero at s while sender s's put (this one) waits in that
    device's mailbox and no wait of the body took it."""

    token: weakref.ref
    trace: object  # get_opaque_trace_state() of the body
    names: tuple
    pending: jax.Array
    followed: bool = True  # False once a wait in another body took from it (what it took is unknown here)


_traced_puts: dict[str, list[_TracedPut]] = {}  # per mailbox; a record leaves when its Token dies


def _follow(token: Token, names: tuple) -> None:
    puts = _traced_puts.setdefault(token.mailbox, [])
    record = _TracedPut(None, get_opaque_trace_state(), names, token.values[1])
    record.token = weakref.ref(token, lambda _: puts.remove(record))
    puts.append(record)


def _followed_here(mailbox: str, names: tuple) -> list[_TracedPut]:
    here = get_opaque_trace_state()
    return [p for p in _traced_puts.get(mailbox, ()) if p.followed and p.names == names and p.trace == here]


def _record_of(token: Token) -> _TracedPut | None:
    """The record of the put that made `token` (also through a pytree round trip in its body)."""
    for record in _traced_puts.get(token.mailbox, ()):
        made = record.token()
        if made is not None and made.values[1] is token.values[1]:
            return record
    return None


def _everyone(names: tuple) -> tuple:
    """Every manual mesh axis here: the devices that must stop together."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    return tuple(a for a in mesh.axis_names if a in manual) or names


def _check(bad, names: tuple, describe: Callable[..., str], *facts):
    """An int32 zero computed through a branch that, when `bad` holds on some device, raises
    JaxginError(describe(rank, *facts)) with the facts (NumPy values) of the first such device.
    Every device of the shard_map takes the branch (a psum decides), so none is left waiting in a
    later collective for one that stopped. Add the zero to what the op computes next: the check
    then runs first and is not dropped as dead code."""
    everyone = _everyone(names)

    def fail(bad, rank, *facts):
        first = int(np.flatnonzero(bad)[0])
        error = JaxginError(describe(rank[first], *(f[first] for f in facts)))
        _failed_checks.add(str(error))
        atexit.unregister(_report_failed_check_at_exit)  # once, after JAX's own exit handler (see there)
        atexit.register(_report_failed_check_at_exit)
        raise error

    def misuse(*local):
        gathered = jax.lax.all_gather(local, everyone)
        return jax.pure_callback(fail, jax.ShapeDtypeStruct((), jnp.int32), *gathered, vmap_method="sequential")

    # Adding a zero that varies over every axis lets the collectives run over all of them.
    zero = jax.lax.axis_index(everyone) * 0
    local = [jnp.asarray(f).astype(jnp.int32) + zero for f in (bad, jax.lax.axis_index(names), *facts)]
    anyone = jax.lax.psum(local[0], everyone) > 0
    return jax.lax.cond(anyone, misuse, lambda *_: jnp.int32(0), *local)


# Every device of the shard_map raises the same check error (none may run on alone), and JAX logs
# each failed callback with its traceback before handing one of them back as the JaxRuntimeError
# the program reads: the same message once per device. The JaxRuntimeError carries it; the logs go.
class _FailedCheckLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and str(record.exc_info[1]) in _failed_checks)


_failed_checks: set[str] = set()
logging.getLogger(jax.pure_callback.__module__).addFilter(_FailedCheckLogs())


def _report_failed_check_at_exit() -> None:
    """JAX raises a failed callback's error again at the next jax.effects_barrier(), which its own
    exit handler runs (this one runs before it), printing the traceback a second time. A program
    ended by that very error has shown it already: nothing more is said. Otherwise (the program
    caught it and went on) one line says it, as the GPU runtime says its device faults at exit."""
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError as e:
        shown = getattr(sys, "last_exc", None)
        messages = [m for m in sorted(_failed_checks) if m in str(e)]
        if not messages:
            raise
        if shown is None or type(shown) is not type(e) or shown.args != e.args:
            print(f"jaxgin: a program failed a reference-mode check: {messages[0]}", file=sys.stderr, flush=True)


def _axis(names: tuple) -> str:
    return repr(names[0]) if len(names) == 1 else repr(names)


def _out_of_range(op: str, name: str, index: int, me: int, names: tuple, size: int, box: str) -> str:
    return (
        f"{op} at rank {me} of axis {_axis(names)}: {name} index {index} is out of range: the mesh axis has {size} "
        f"devices, so it must be in [0, {size}) (mailbox {box!r}; a GPU fails the same way)"
    )


def _put_again(box: str, names: tuple, senders: list[int], receiver: int, seen_by: str = "") -> str:
    others = f" (ranks {senders[1:]} did the same)" if len(senders) > 1 else ""
    seen = f"; found by {seen_by} on rank {receiver}, whose after= holds both puts" if seen_by else ""
    return (
        f"jaxgin.put_signal at rank {senders[0]} of axis {_axis(names)}, peer rank {receiver}: the receiver never "
        f"consumed this rank's previous put into mailbox {box!r} before this one (puts of rank {senders[0]} waiting "
        f"there: 1, at most 1 allowed, this put makes 2){others}{seen}. Every put_signal needs a matching "
        "wait_signal or wait_signal_from on the receiver before the next put to it from the same sender; on a GPU "
        "this put waits for that credit and times out"
    )


def _put_misuse(box, names, size, me, peer, again) -> str:
    me, peer = int(me), int(peer)
    if not 0 <= peer < size:
        return _out_of_range("jaxgin.put_signal", "peer", peer, me, names, size, box)
    return _put_again(box, names, np.flatnonzero(again).tolist(), me)


def _checked_put(mailbox: Mailbox, names, size, peer, peer_is_traced, mail, arrived) -> Token:
    """The reference put's Token, after checking the traced peer and that no put of the same
    sender into this mailbox still waits at the receiver."""
    earlier = _followed_here(mailbox.name, names)
    if peer_is_traced or earlier:
        waiting = sum(p.pending for p in earlier) if earlier else arrived * 0
        again = (waiting > 0) & (arrived > 0)
        bad = (peer < 0) | (peer >= size) | jnp.any(again)
        describe = lambda *facts: _put_misuse(mailbox.name, names, size, *facts)
        ok = _check(bad, names, describe, peer, again)
        arrived = arrived + ok
        for p in earlier:  # a later wait on them runs this check first, even if nothing waits on this put
            p.pending = p.pending + ok
    token = Token(mailbox.name, (mail, arrived))
    _follow(token, names)
    return token


def _waiting(tokens: list[Token]) -> list[tuple[jax.Array, jax.Array, _TracedPut | None]]:
    """(mail, int32[axis size] of the senders whose put waits here, the put's record if this body
    follows it) for each distinct token."""
    here = get_opaque_trace_state()
    views, seen = [], []
    for token in tokens:
        if any(token.values[1] is s for s in seen):
            continue
        seen.append(token.values[1])
        record = _record_of(token)
        if record is not None and record.followed and record.trace == here:
            views.append((token.values[0], record.pending, record))
        else:
            if record is not None:
                record.followed = False
            views.append((token.values[0], token.values[1], None))
    return views


def _doubled(views) -> jax.Array | None:
    """Senders with a put waiting in two of these tokens that no put-time check compared."""
    doubled = None
    for i, (_, a, ra) in enumerate(views):
        for _, b, rb in views[i + 1 :]:
            if ra is None or rb is None:
                both = (a > 0) & (b > 0)
                doubled = both if doubled is None else doubled | both
    return doubled


def _wait_misuse(box, names, count, me, waiting, doubled) -> str:
    me = int(me)
    if doubled.any():
        return _put_again(box, names, np.flatnonzero(doubled).tolist(), me, "jaxgin.wait_signal")
    senders = np.flatnonzero(waiting).tolist()
    return (
        f"jaxgin.wait_signal at rank {me} of axis {_axis(names)}: waited for {count} puts into mailbox {box!r} but "
        f"only {len(senders)} arrived (from ranks {senders}): fewer senders put to this rank than the count, their "
        "tokens are not in after=, or an earlier wait took their puts. On a GPU this wait times out"
    )


def _checked_wait(mailbox: Mailbox, names, count: int, tokens: list[Token]) -> list:
    """(mail, mask) pairs for the reference wait, after checking that `count` puts wait here."""
    views = _waiting(tokens)
    waiting = sum(w for _, w, _ in views)
    doubled = _doubled(views)
    ok = 0
    if count > 0 or doubled is not None:
        doubled = waiting * 0 > 0 if doubled is None else doubled
        bad = (jnp.sum(waiting > 0) < count) | jnp.any(doubled)
        describe = lambda *facts: _wait_misuse(mailbox.name, names, count, *facts)
        ok = _check(bad, names, describe, waiting, doubled)
    for _, _, record in views:
        if record is not None:
            record.pending = record.pending * 0  # a wait takes every put that waits
    return [v for mail, w, _ in views for v in (mail, w + ok)]


def _wait_from_misuse(box, names, size, me, source, waiting, doubled) -> str:
    me, source = int(me), int(source)
    if not 0 <= source < size:
        return _out_of_range("jaxgin.wait_signal_from", "source", source, me, names, size, box)
    if doubled[source]:
        return _put_again(box, names, [source], me, "jaxgin.wait_signal_from")
    senders = np.flatnonzero(waiting).tolist()
    return (
        f"jaxgin.wait_signal_from at rank {me} of axis {_axis(names)}, peer rank {source}: that sender's next put "
        f"into mailbox {box!r} never arrived (puts of rank {source} waiting here: 0, needed: 1; ranks with a put "
        f"waiting here: {senders}): the sender never put to this rank, its token is not in after=, or an earlier "
        "wait took its put. On a GPU this wait times out"
    )


def _checked_wait_from(mailbox: Mailbox, names, size, source, tokens: list[Token]) -> list:
    """(mail, mask) pairs for the reference wait_signal_from, after checking the source and that
    its put waits here."""
    views = _waiting(tokens)
    waiting = sum(w for _, w, _ in views)
    doubled = _doubled(views)
    doubled = waiting * 0 > 0 if doubled is None else doubled
    index = jnp.clip(source, 0, size - 1)
    bad = (source < 0) | (source >= size) | (waiting[index] == 0) | doubled[index]
    describe = lambda *facts: _wait_from_misuse(mailbox.name, names, size, *facts)
    ok = _check(bad, names, describe, source, waiting, doubled)
    taken = jnp.arange(size) == source
    for _, _, record in views:
        if record is not None:
            record.pending = jnp.where(taken, 0, record.pending)
    return [v for mail, w, _ in views for v in (mail, w + ok)]


def _after_tokens(mailbox: Mailbox, after, op: str) -> list:
    tokens = [after] if isinstance(after, Token) else list(after) if isinstance(after, (list, tuple)) else None
    if not tokens or not all(isinstance(t, Token) for t in tokens):
        raise TypeError(f"{op}: after= needs the Token(s) returned by jaxgin.put_signal")
    for t in tokens:
        if t.mailbox != mailbox.name:
            raise ValueError(f"{op}: a token of mailbox {t.mailbox!r} was passed to wait on {mailbox.name!r}")
    return tokens


def wait_signal(mailbox: Mailbox, count: int, *, axis_name, after) -> jax.Array:
    """Waits until `count` puts arrived in this device's `mailbox`; returns [axis size, *shape]:
    row s holds what axis index s put (every put complete when `count` were), zeros elsewhere.

    `after`: the Token (or Tokens) of the put_signal calls this wait follows in the program.
    On GPUs the wait is bounded by the runtime timeout: if fewer than `count` puts arrive, the
    program fails with an error naming the mailbox's signals, the count and how many arrived. In
    reference mode the rows come from the tokens, and fewer than `count` puts waiting here (or two
    puts of one sender in `after`) raise JaxginError, naming the ranks and counts, when it runs.
    """
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"jaxgin.wait_signal: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, "jaxgin.wait_signal")
    size = axes_lib.axis_size(names, "jaxgin.wait_signal")
    axes_lib.require_shard_map(names, "jaxgin.wait_signal")
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 0 <= count <= size:
        raise ValueError(f"jaxgin.wait_signal: count must be an int in [0, {size}] (puts from distinct senders), got {count!r}")
    tokens = _after_tokens(mailbox, after, "jaxgin.wait_signal")
    state = runtime.current()
    if state.options.backend == "reference":
        values = _checked_wait(mailbox, names, int(count), tokens)
    else:
        values = [v for t in tokens for v in t.values]

    @_not_differentiable("jaxgin.wait_signal")
    def wait(*values):
        if state.options.backend == "reference":
            out = jnp.zeros((size, *mailbox.shape), mailbox.dtype)
            for mail, arrived in zip(values[0::2], values[1::2]):
                out = jnp.where(arrived.reshape((-1,) + (1,) * len(mailbox.shape)) > 0, mail, out)
            return out
        rows, *taken = wait_signal_p.bind(
            *values, axis_name=names, size=size, shape=mailbox.shape, dtype=mailbox.dtype, mailbox=mailbox.name,
            count=int(count),
        )
        if not taken:  # an empty payload: nothing to zero
            return rows
        return jnp.where(taken[0].reshape((-1,) + (1,) * len(mailbox.shape)) != 0, rows, jnp.zeros((), rows.dtype))

    return wait(*values)


def wait_signal_from(mailbox: Mailbox, source, *, axis_name, after) -> jax.Array:
    """Waits for the next put of the device at axis index `source` into this device's `mailbox` and
    returns its payload (the mailbox's shape and dtype). Puts of other senders stay in the mailbox
    for later waits.

    `source`: a Python int or a traced integer scalar; out of [0, axis size) on a GPU, the program
    fails with an error naming it. `after`: the Token(s) of the put_signal calls this wait follows.
    On GPUs the wait is bounded by the runtime timeout (the error names the sender). In reference
    mode the payload comes from the tokens, and a source with no put waiting here (or out of range)
    raises JaxginError, naming it, when it runs.
    """
    op = "jaxgin.wait_signal_from"
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"{op}: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, op)
    size = axes_lib.axis_size(names, op)
    axes_lib.require_shard_map(names, op)
    source = _axis_index_arg(source, size, op, "source", "sender")
    tokens = _after_tokens(mailbox, after, op)
    state = runtime.current()
    if state.options.backend == "reference":
        values = _checked_wait_from(mailbox, names, size, source, tokens)
    else:
        values = [v for t in tokens for v in t.values]

    @_not_differentiable(op)
    def wait(source, *values):
        if state.options.backend == "reference":
            out = jnp.zeros(mailbox.shape, mailbox.dtype)
            index = jnp.clip(source, 0, size - 1)  # out of range failed its check before this runs
            for mail, arrived in zip(values[0::2], values[1::2]):
                out = jnp.where(arrived[index] > 0, mail[index], out)
            return out
        return wait_signal_from_p.bind(
            source, *values, axis_name=names, size=size, shape=mailbox.shape, dtype=mailbox.dtype, mailbox=mailbox.name
        )

    return wait(source, *values)
