"""tritongin's device functions: communication from inside ``@triton.jit`` kernels.

    import tritongin.language as tgl
    tgl.put_signal(ctx, dst, src, nbytes, peer, signal)

They are defined, with their thread semantics, memory ordering and faults, in
``jaxgin.triton_device.language`` (jaxgin's own Triton kernels use them too); this module is their
public name.
"""

from jaxgin.triton_device import language as _language
from jaxgin.triton_device.language import *  # noqa: F403  (the names of _language.__all__)

__all__ = list(_language.__all__)
