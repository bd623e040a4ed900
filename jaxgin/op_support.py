"""What every jaxgin op shares: the layer directly above the runtime (jaxgin.runtime) and below the
ops (collectives, mailbox, route, triton_call, fused, moe) and tritongin's memory helpers.

- Which backend an op lowers to: ``kernel_state`` (None in reference mode), ``lowering_state``
  (a program traced for kernels that now lowers in reference mode is an error), ``by_backend``;
  whether the job has GIN peers at all (``gin_in_job``).
- JAX typing and autodiff plumbing: ``same_varying``, ``differentiable``.
- Heap arrays: ``SymmetricArray`` (a buffer at the same offset of every GPU's symmetric heap),
  ``heap_array``, ``release``, and ``placed``, the one cache of what ops keep in the heap.
- ``outside_trace``: JAX work (tuning) away from the caller's trace.
- ``pow2``: the power-of-two block sizes the ops' Triton kernels take.

The heap's zero invariant, which lets a placement skip clearing: the runtime zeroes the whole heap
before any peer learns its address, and ``release`` zeroes a region before the allocator may hand
it out again, so a region is zero on every GPU when it is placed. Clearing at placement would be
wrong, not just slow: a peer that placed it first may already have written into it (a line put, a
handoff word), and nothing orders the two without a barrier.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import jax
import numpy as np

from jaxgin import runtime
from jaxgin.errors import JaxginError, install_command

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Backend dispatch


def kernel_state():
    """The live state when ops lower to kernels (the cuda backend), None in reference mode."""
    state = runtime.current()
    return state if state.options.backend == "cuda" else None


def lowering_state(op: str):
    """The state while an op lowers to its kernel. A program traced while jaxgin ran on GPUs can be
    lowered again after jaxgin was initialized in reference mode: say so instead of emitting a call
    to a kernel that is not there."""
    state = runtime.current()
    if state.options.backend != "cuda":
        raise JaxginError(f"{op}: this program was traced for the cuda backend but jaxgin now runs in reference mode")
    return state


def by_backend(reference, kernel):
    """f(*args): kernel(state, *args) when ops lower to kernels, else reference(*args)."""

    def forward(*args):
        state = kernel_state()
        return reference(*args) if state is None else kernel(state, *args)

    return forward


def gin_in_job(state) -> bool:
    """Whether some GPU of the job reaches some other through GIN (it spans hosts, or GIN is
    forced). Every process gets the same answer, so what ops place in the heap because of it
    (staging areas for puts) stays at the same offsets everywhere; which peers of a given GPU go
    through GIN is decided per peer on the device (``tritongin.language.gin_peer``)."""
    return runtime.gin_in_job(state)


def require_tritongin(op: str) -> None:
    """Ops whose GPU kernels are Triton kernels say what to install when Triton is missing."""
    try:
        import triton  # noqa: F401  (optional: only the GPU kernels of some ops need it)
    except ImportError:
        raise JaxginError(f"{op} on GPUs needs Triton: {install_command('cuda')}") from None


# ---------------------------------------------------------------------------------------------
# Typing and autodiff


def same_varying(names, *arrays):
    """The arrays typed as varying over `names` and over every axis any of them varies over: what
    a collective returns differs per device even when its input is the same everywhere, and
    shard_map / autodiff must know (a replicated type would let out_specs=P() pick one device's
    value and skip summing cotangents); a custom_vjp sees one varying type for inputs, outputs
    and cotangents. Arrays outside shard_map's type checking come back as they are."""
    axes = set(names)
    for a in arrays:
        aval = jax.typeof(a)
        manual = getattr(aval, "manual_axis_type", None)
        axes |= set(manual.varying if manual is not None else getattr(aval, "vma", ()) or ())
    out = []
    for a in arrays:
        aval = jax.typeof(a)
        manual = getattr(aval, "manual_axis_type", None)
        have = manual.varying if manual is not None else getattr(aval, "vma", None)
        if have is None:
            out.append(a)
            continue
        missing = tuple(n for n in sorted(axes, key=str) if n not in have)
        out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
    return out


def differentiable(reference, kernel, backward):
    """An op as op(x, w, plan): forward through kernel(state, x, w, plan) on GPUs or
    reference(x, w, plan) in reference mode, gradients from backward(plan, x, w, ct) -> (dx, dw).
    Both modes share the custom_vjp, so the CPU tests exercise the backward rules the GPUs use."""

    forward = by_backend(reference, kernel)
    op = jax.custom_vjp(forward, nondiff_argnums=(2,))
    op.defvjp(lambda x, w, plan: (forward(x, w, plan), (x, w)), lambda plan, saved, ct: backward(plan, *saved, ct))
    return op


def outside_trace(fn):
    """fn() run where no JAX trace is active. Tuning happens while the user's program is traced,
    and every jax operation there would be staged into that program; JAX's trace state is per
    thread, so a fresh thread runs and times real kernels."""
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    worker = threading.Thread(target=run, name="jaxgin-outside-trace")
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


# ---------------------------------------------------------------------------------------------
# Heap arrays

# DLPack type codes (dlpack.h: kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool).
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}
_DLPACK_BFLOAT = 4


def dlpack_code(dtype: np.dtype) -> tuple[int, int]:
    """(DLPack type code, bits) of a heap array's dtype; TypeError for dtypes DLPack cannot carry."""
    if dtype.name == "bfloat16":
        return _DLPACK_BFLOAT, 16
    if dtype.kind not in _DLPACK_CODES:
        raise TypeError(f"heap buffers hold numbers or booleans; {dtype} has no DLPack type")
    return _DLPACK_CODES[dtype.kind], dtype.itemsize * 8


def sm_count(device) -> int:
    """The device's multiprocessors (JAX's core_count), 132 (an H100 / H200) where JAX gives none."""
    return int(getattr(device, "core_count", 0) or 132)


def local_index(state, device) -> int:
    """The index among this process's jaxgin GPUs of `device` (an index or a jax Device; None: 0)."""
    count = len(state.local_devices)
    if device is None:
        return 0
    if isinstance(device, int):
        if not 0 <= device < count:
            raise ValueError(f"device index {device} is out of range: this process has {count} jaxgin GPU(s)")
        return device
    try:
        return state.local_devices.index(device)
    except ValueError:
        raise ValueError(f"{device} is not one of this process's jaxgin devices {state.local_devices}") from None


class DeviceArray:
    """One GPU's view of a heap buffer: a Triton pointer argument and a DLPack array."""

    def __init__(self, owner: SymmetricArray, address: int, device: int):
        from jaxgin import _jaxgin_ext  # the compiled extension exists only once jaxgin was built for GPUs

        self.owner, self.address, self.device = owner, address, device
        self.shape, self.dtype = owner.shape, owner.dtype
        code, bits = dlpack_code(owner.dtype)
        self._dlpack = _jaxgin_ext.device_array(address, list(owner.shape), code, bits, device, self)

    def data_ptr(self) -> int:
        self.owner.check_live()
        return self.address

    def __dlpack__(self, *args, **kwargs):
        self.owner.check_live()
        return self._dlpack.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._dlpack.__dlpack_device__()

    def __repr__(self) -> str:
        return f"tritongin.DeviceArray({self.shape}, {self.dtype}, CUDA device {self.device})"


class SymmetricArray:
    """A buffer at the same offset of every rank's symmetric heap."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, offset: int, nbytes: int, generation: int):
        self.shape, self.dtype, self.offset, self.nbytes, self.generation = shape, dtype, offset, nbytes, generation
        self.freed = False

    def __repr__(self) -> str:
        return f"SymmetricArray(shape={self.shape}, dtype={self.dtype}, offset={self.offset}, nbytes={self.nbytes})"

    def check_live(self) -> None:
        if self.freed:
            raise JaxginError("this heap buffer was freed")
        if runtime.current().generation != self.generation:
            raise JaxginError("this heap buffer belongs to a jaxgin runtime that was finalized; allocate it again")

    def local(self, device=None) -> DeviceArray:
        """This buffer on one of this process's GPUs (default the first)."""
        self.check_live()
        state = runtime.current()
        info = state.runtime.device_info(local_index(state, device))
        return DeviceArray(self, info["heap_base"] + self.offset, info["device"])

    def free(self) -> None:
        """Returns the bytes to the heap, zeroed. On GPUs every rank frees its buffers in the same
        order: the call waits for this process's GPU work and for every peer's puts to this rank."""
        self.check_live()
        try:
            release(runtime.current(), self.offset, self.nbytes)
        finally:
            self.freed = True


def heap_array(state, shape, dtype) -> SymmetricArray:
    """A heap array of `shape` and `dtype`: the same offset on every GPU, zero until written."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return SymmetricArray(shape, dtype, state.heap.allocate(nbytes), nbytes, state.generation)


def release(state, offset: int, nbytes: int) -> None:
    """Zeroes a heap region and returns it to the allocator (the zero invariant above). On GPUs a
    collective: every rank frees its regions in the same order, and the zeroing waits until every
    put any peer made to this rank has landed and every rank's GPU work is done, so no late put
    makes free bytes nonzero (csrc/ffi/heap_free.cu). After a device fault nothing can be zeroed:
    the region is never handed out again. A free that fails itself (a peer that never frees)
    raises, naming the region."""
    if _faulted(state):
        return
    try:
        runtime.call_backend(state.runtime.heap_clear, offset, nbytes)
    except JaxginError as e:  # DeviceFault included, and kept as such
        raise type(e)(f"freeing heap bytes [{offset}, {offset + nbytes}) failed (every rank frees its heap "
                      f"buffers in the same order, after the programs that use them): {e}") from None
    state.heap.free(offset)


def _faulted(state) -> bool:
    """Whether a device fault was recorded on this process's GPUs (their CUDA contexts are unusable)."""
    try:
        return bool(runtime.call_backend(state.runtime.device_faults))
    except JaxginError:
        return True


def placed(state, key, place: Callable[[], T]) -> T:
    """What `place()` put in the heap for `key` (an op and its configuration), placed on first use
    and kept for the life of the runtime: the heap offsets and signal ids are part of every
    compiled program that uses them. Every process places in the same order (it traces the same
    program), so the offsets agree without communication, and a fresh placement is zero (see the
    module docstring), so nothing needs clearing or a barrier."""
    cache = state.placements
    if key not in cache:
        cache[key] = place()
    return cache[key]


# ---------------------------------------------------------------------------------------------
# Kernel launch sizes


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the Triton block that covers n items."""
    return 1 << max(0, int(n - 1).bit_length())
