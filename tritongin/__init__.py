"""tritongin: communication from inside ``@triton.jit`` kernels through jaxgin's device library.

    import tritongin
    import tritongin.language as tgl     # rank, world_size, put_signal, signal, wait_signal,
                                         # wait_arrivals, read_signal, flush, barrier, peer_ptr

Kernels are plain ``@triton.jit`` kernels that take the jaxgin context as an argument. Importing
``tritongin.language`` adds the link step to Triton (see ``jaxgin.triton_device.link``): kernels
that call these functions are linked with the device library built for the NCCL in use; other
kernels are compiled exactly as before. Launch them standalone with ``tritongin.context()`` and
heap buffers from ``tritongin.empty``, or inside jax.jit with ``jaxgin.triton_call``.
"""

from __future__ import annotations

from jaxgin import build as _build
from jaxgin import nccl as _nccl
from tritongin.memory import Context, DeviceArray, SignalRange, SymmetricArray, context, empty, signals


def device_library(arch: str = "sm_90a") -> _build.Artifacts:
    """Builds (cached) the device library for `arch` against the NCCL jaxgin would load: its PTX
    and cubin, what tritongin links into kernels (no backend: ``backend`` is None)."""
    return _build.device_library(_nccl.load(), arch)


__all__ = [
    "Context",
    "DeviceArray",
    "SignalRange",
    "SymmetricArray",
    "context",
    "device_library",
    "empty",
    "signals",
]
