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

import numpy as np

from jaxgin import runtime
from jaxgin.errors import JaxginError

# DLPack type codes (dlpack.h: kDLInt, kDLUInt, kDLFloat, kDLBfloat, kDLBool).
_DLPACK_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}
_DLPACK_BFLOAT = 4


def _cuda_state(what: str):
    state = runtime.current()
    if state.runtime is None:
        raise JaxginError(
            f"tritongin.{what} needs jaxgin on GPUs (jaxgin.initialize() on the cuda backend); jaxgin runs in "
            f"{state.options.backend} mode here, where Triton kernels cannot run"
        )
    return state


def _local_index(state, device) -> int:
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
        raise ValueError(
            f"{device} is not one of this process's jaxgin devices {state.local_devices}"
        ) from None


def _dtype(dtype) -> np.dtype:
    try:
        import jax.numpy as jnp

        return np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"not a dtype: {dtype!r}") from None


def _dlpack_code(dtype: np.dtype) -> tuple[int, int]:
    if dtype.name == "bfloat16":
        return _DLPACK_BFLOAT, 16
    if dtype.kind not in _DLPACK_CODES:
        raise TypeError(f"heap buffers hold numbers or booleans; {dtype} has no DLPack type")
    return _DLPACK_CODES[dtype.kind], dtype.itemsize * 8


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
    index = _local_index(state, device)
    info = state.runtime.device_info(index)
    return Context(info["context"], info["device"])


class DeviceArray:
    """One GPU's view of a heap buffer: a Triton pointer argument and a DLPack array."""

    def __init__(self, owner: SymmetricArray, address: int, device: int):
        from jaxgin import _jaxgin_ext

        self.owner, self.address, self.device = owner, address, device
        self.shape, self.dtype = owner.shape, owner.dtype
        code, bits = _dlpack_code(owner.dtype)
        self._dlpack = _jaxgin_ext.device_array(address, list(owner.shape), code, bits, device, self)

    def data_ptr(self) -> int:
        self.owner._check_live()
        return self.address

    def __dlpack__(self, *args, **kwargs):
        self.owner._check_live()
        return self._dlpack.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._dlpack.__dlpack_device__()

    def __repr__(self) -> str:
        return f"tritongin.DeviceArray({self.shape}, {self.dtype}, CUDA device {self.device})"


@dataclasses.dataclass(eq=False)
class SymmetricArray:
    """A buffer at the same offset of every rank's symmetric heap."""

    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    nbytes: int
    generation: int
    freed: bool = False

    def _check_live(self) -> None:
        if self.freed:
            raise JaxginError("this heap buffer was freed")
        state = runtime.current()
        if state.generation != self.generation:
            raise JaxginError("this heap buffer belongs to a jaxgin runtime that was finalized; allocate it again")

    def local(self, device=None) -> DeviceArray:
        """This buffer on one of this process's GPUs (default the first)."""
        self._check_live()
        state = runtime.current()
        index = _local_index(state, device)
        info = state.runtime.device_info(index)
        return DeviceArray(self, info["heap_base"] + self.offset, info["device"])

    def free(self) -> None:
        """Returns the bytes to the heap (every rank must free in the same order it allocated)."""
        self._check_live()
        runtime.current().heap.free(self.offset)
        self.freed = True


def empty(shape, dtype) -> SymmetricArray:
    """Allocates an uninitialised heap buffer of `shape` and `dtype` on every local GPU."""
    state = _cuda_state("empty")
    shape = (int(shape),) if np.isscalar(shape) else tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    dtype = _dtype(dtype)
    _dlpack_code(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    offset = state.heap.allocate(nbytes)
    return SymmetricArray(shape, dtype, offset, nbytes, state.generation)


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
