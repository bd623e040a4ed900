"""tritongin: communication from inside ``@triton.jit`` kernels through jaxgin's device library.

The device library (csrc/device/jaxgin_device.h) is built against the NCCL in use as relocatable
PTX and cubin; ``device_library()`` returns them for linking into Triton kernels.
"""

from __future__ import annotations

from jaxgin import build as _build
from jaxgin import nccl as _nccl


def device_library(arch: str = "sm_90a") -> _build.Artifacts:
    """Builds (cached) the device library for `arch` against the NCCL jaxgin would load."""
    return _build.build(_nccl.load(), arch)


__all__ = ["device_library"]
