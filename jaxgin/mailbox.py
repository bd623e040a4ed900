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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from jaxgin import runtime
from jaxgin.errors import JaxginError
from jaxgin.ffi import axes as axes_lib

MAILBOX_HEADER_BYTES = 256  # mirrors kMailboxHeaderBytes in csrc/kernels/mailbox.h
MAX_AXIS_SIZE = 64  # mirrors kMaxExchangePeers

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

    def __init__(self, name: str, shape: Sequence[int], dtype):
        if not isinstance(name, str) or not name:
            raise TypeError(f"Mailbox name must be a non-empty str, got {name!r}")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"Mailbox {name!r}: shape {shape} has a negative dimension")
        dtype = np.dtype(dtype)
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


@wait_signal_p.def_abstract_eval
def _wait_abstract(*tokens, axis_name, size, shape, dtype, **_):
    # Same varying-axes type as the tokens (what arrives differs per device, as they do).
    return tokens[0].update(shape=(size, *shape), dtype=jnp.dtype(dtype), weak_type=False)


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
    """Heap offset and first signal of a mailbox on this runtime (placed on first use)."""
    key = (box_name, size)
    placed = state.mailboxes.get(key)
    if placed is None:
        if size > MAX_AXIS_SIZE:
            raise JaxginError(f"jaxgin mailboxes support axes of at most {MAX_AXIS_SIZE} devices, got {size}")
        offset = state.heap.allocate(mailbox_bytes(payload_bytes, size))
        signal_base = state.signals.allocate(2 * size)
        state.runtime.heap_clear(offset, MAILBOX_HEADER_BYTES)  # local bookkeeping starts at zero
        placed = state.mailboxes[key] = (offset, signal_base, payload_bytes)
    if placed[2] != payload_bytes:
        raise JaxginError(f"mailbox {box_name!r} is placed for {placed[2]} bytes per slot, not {payload_bytes}")
    return placed[0], placed[1]


def _cuda_state(op: str):
    state = runtime.current()
    if state.options.backend != "cuda":
        raise JaxginError(f"{op}: this program was traced for the cuda backend but jaxgin now runs in reference mode")
    return state


def _lower_put(ctx, x, peer, *, axis_name, size, mailbox, payload_bytes):
    state = _cuda_state("jaxgin.put_signal")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.put_signal")
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering("jaxgin_put_signal", has_side_effect=True)(
        ctx, x, peer, offset=np.int64(offset), signal_base=np.int64(signal_base), **attrs
    )


def _lower_wait(ctx, *tokens, axis_name, size, shape, dtype, mailbox, count):
    state = _cuda_state("jaxgin.wait_signal")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.wait_signal")
    payload_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering("jaxgin_wait_signal", has_side_effect=True)(
        ctx, *tokens, offset=np.int64(offset), signal_base=np.int64(signal_base), count=np.int64(count), **attrs
    )


def _lower_wait_from(ctx, source, *tokens, axis_name, size, shape, dtype, mailbox):
    state = _cuda_state("jaxgin.wait_signal_from")
    attrs = axes_lib.lowering_attributes(ctx, axis_name, state, "jaxgin.wait_signal_from")
    payload_bytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    offset, signal_base = _placement(state, mailbox, payload_bytes, size)
    return jax.ffi.ffi_lowering("jaxgin_wait_signal_from", has_side_effect=True)(
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
    """
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"jaxgin.put_signal: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, "jaxgin.put_signal")
    size = axes_lib.axis_size(names, "jaxgin.put_signal")
    x = jnp.asarray(x)
    if x.shape != mailbox.shape or x.dtype != mailbox.dtype:
        raise TypeError(
            f"jaxgin.put_signal: x is {x.dtype}{list(x.shape)} but mailbox {mailbox.name!r} holds "
            f"{mailbox.dtype}{list(mailbox.shape)}; every sender and receiver of a mailbox uses its shape and dtype"
        )
    peer = _axis_index_arg(peer, size, "jaxgin.put_signal", "peer", "destination")
    state = runtime.current()

    @_not_differentiable("jaxgin.put_signal")
    def put(x, peer):
        if state.options.backend == "reference":
            return _reference_put(_unbatchable_p.bind(x, op="jaxgin.put_signal"), peer, names)
        return (
            put_signal_p.bind(x, peer, axis_name=names, size=size, mailbox=mailbox.name, payload_bytes=mailbox.nbytes),
        )

    return Token(mailbox.name, tuple(put(x, peer)))


def _reference_put(x, peer, names):
    # Everyone's data and destination, then keep what was sent to me: the mail of this round.
    sent = jax.lax.all_gather(x, names)
    destinations = jax.lax.all_gather(peer, names)
    arrived = destinations == jax.lax.axis_index(names)
    mail = jnp.where(arrived.reshape((-1,) + (1,) * x.ndim), sent, jnp.zeros_like(sent))
    return mail, arrived.astype(jnp.int32)


def _after_tokens(mailbox: Mailbox, after, op: str) -> list:
    tokens = [after] if isinstance(after, Token) else list(after) if isinstance(after, (list, tuple)) else None
    if not tokens or not all(isinstance(t, Token) for t in tokens):
        raise TypeError(f"{op}: after= needs the Token(s) returned by jaxgin.put_signal")
    for t in tokens:
        if t.mailbox != mailbox.name:
            raise ValueError(f"{op}: a token of mailbox {t.mailbox!r} was passed to wait on {mailbox.name!r}")
    return [v for t in tokens for v in t.values]


def wait_signal(mailbox: Mailbox, count: int, *, axis_name, after) -> jax.Array:
    """Waits until `count` puts arrived in this device's `mailbox`; returns [axis size, *shape]:
    row s holds what axis index s put (every put complete when `count` were), zeros elsewhere.

    `after`: the Token (or Tokens) of the put_signal calls this wait follows in the program.
    On GPUs the wait is bounded by the runtime timeout: if fewer than `count` puts arrive, the
    program fails with an error naming the mailbox's signals, the count and how many arrived. In
    reference mode the rows come from the tokens and `count` is not enforced.
    """
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"jaxgin.wait_signal: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, "jaxgin.wait_signal")
    size = axes_lib.axis_size(names, "jaxgin.wait_signal")
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 0 <= count <= size:
        raise ValueError(f"jaxgin.wait_signal: count must be an int in [0, {size}] (puts from distinct senders), got {count!r}")
    values = _after_tokens(mailbox, after, "jaxgin.wait_signal")
    state = runtime.current()

    @_not_differentiable("jaxgin.wait_signal")
    def wait(*values):
        if state.options.backend == "reference":
            out = jnp.zeros((size, *mailbox.shape), mailbox.dtype)
            for mail, arrived in zip(values[0::2], values[1::2]):
                out = jnp.where(arrived.reshape((-1,) + (1,) * len(mailbox.shape)) > 0, mail, out)
            return out
        return wait_signal_p.bind(
            *values, axis_name=names, size=size, shape=mailbox.shape, dtype=mailbox.dtype, mailbox=mailbox.name,
            count=int(count),
        )

    return wait(*values)


def wait_signal_from(mailbox: Mailbox, source, *, axis_name, after) -> jax.Array:
    """Waits for the next put of the device at axis index `source` into this device's `mailbox` and
    returns its payload (the mailbox's shape and dtype). Puts of other senders stay in the mailbox
    for later waits.

    `source`: a Python int or a traced integer scalar; out of [0, axis size) on a GPU, the program
    fails with an error naming it. `after`: the Token(s) of the put_signal calls this wait follows.
    On GPUs the wait is bounded by the runtime timeout (the error names the sender). In reference
    mode the payload comes from the tokens; a sender that did not put gives zeros.
    """
    op = "jaxgin.wait_signal_from"
    if not isinstance(mailbox, Mailbox):
        raise TypeError(f"{op}: mailbox must be a jaxgin.Mailbox, got {type(mailbox).__name__}")
    names = axes_lib.axis_names(axis_name, op)
    size = axes_lib.axis_size(names, op)
    source = _axis_index_arg(source, size, op, "source", "sender")
    values = _after_tokens(mailbox, after, op)
    state = runtime.current()

    @_not_differentiable(op)
    def wait(source, *values):
        if state.options.backend == "reference":
            out = jnp.zeros(mailbox.shape, mailbox.dtype)
            valid = (source >= 0) & (source < size)  # out of range: nothing arrives, as no sender has it
            index = jnp.clip(source, 0, size - 1)
            for mail, arrived in zip(values[0::2], values[1::2]):
                out = jnp.where(valid & (arrived[index] > 0), mail[index], out)
            return out
        return wait_signal_from_p.bind(
            source, *values, axis_name=names, size=size, shape=mailbox.shape, dtype=mailbox.dtype, mailbox=mailbox.name
        )

    return wait(source, *values)
