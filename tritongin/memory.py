"""What a standalone Triton kernel launch needs from jaxgin: the context, heap buffers, signals.

    ctx = tritongin.context()                       # this process's GPU (or context(device))
    buf = tritongin.empty((1024,), "float32")       # same heap offset on every rank
    sig = tritongin.signals(1)                      # signal ids, the same on every rank
    ring[(1,)](ctx, buf.local(), sig.base, ...)     # Triton sees *u8, *fp32, int

Heap buffers and signal ids are symmetric: every rank must allocate them in the same order (as an
SPMD program does), so a peer can be addressed by the same offset and id. ``local()`` views are
DLPack arrays (``torch.from_dlpack``, ``cupy.from_dlpack``, ``jax.dlpack``) and are valid until
``free()`` or ``jaxgin.finalize()``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxgin import runtime
from jaxgin.errors import JaxginError
# The heap arrays themselves live in jaxgin.op_support (fused and moe keep their buffers in them too).
from jaxgin.op_support import DeviceArray, SymmetricArray, dlpack_code, heap_array, local_index

__all__ = ["Context", "DeviceArray", "SignalRange", "SymmetricArray", "context", "empty", "signals"]


def _cuda_state(what: str):
    state = runtime.current()
    if state.runtime is None:
        raise JaxginError(
            f"tritongin.{what} needs jaxgin on GPUs (jaxgin.initialize() on the cuda backend); jaxgin runs in "
            f"{state.options.backend} mode here, where Triton kernels cannot run"
        )
    return state


def _dtype(dtype) -> np.dtype:
    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"not a dtype: {dtype!r}") from None


class Context:
    """The jaxgin context of one GPU, as a kernel argument (Triton types it ``*u8``)."""

    dtype = np.dtype(np.uint8)

    def __init__(self, address: int, device: int):
        self.address, self.device = address, device

    def data_ptr(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"tritongin.Context(CUDA device {self.device}, 0x{self.address:x})"


def context(device=None) -> Context:
    """The context to pass to a kernel running on `device` (a jax.Device or local index; default the
    first of this process's GPUs)."""
    state = _cuda_state("context")
    index = local_index(state, device)
    info = state.runtime.device_info(index)
    return Context(info["context"], info["device"])


def empty(shape, dtype) -> SymmetricArray:
    """Allocates a heap buffer of `shape` and `dtype` on every local GPU, at the same offset on every
    rank; it reads zero until written (freeing zeroes a buffer before its bytes are reused)."""
    state = _cuda_state("empty")
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    dtype = _dtype(dtype)
    dlpack_code(dtype)
    return heap_array(state, shape, dtype)


@dataclasses.dataclass(eq=False)
class SignalRange:
    """Signal ids [base, base + count), the same on every rank."""

    base: int
    count: int
    generation: int
    freed: bool = False

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.count:
            raise IndexError(f"signal {i} of a range of {self.count}")
        return self.base + i

    def free(self) -> None:
        if self.freed:
            raise JaxginError("these signals were freed")
        state = runtime.current()
        if state.generation == self.generation:
            state.signals.free(self.base)
        self.freed = True


def signals(count: int = 1) -> SignalRange:
    """Reserves `count` signal ids. Signals are counters that only grow; ``wait_arrivals`` counts what
    it consumed, so a fresh range needs no reset."""
    state = _cuda_state("signals")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return SignalRange(state.signals.allocate(count), count, state.generation)
