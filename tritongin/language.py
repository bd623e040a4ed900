"""tritongin's device functions: communication from inside ``@triton.jit`` kernels.

    import tritongin.language as tgl
    tgl.put_signal(ctx, dst, src, nbytes, peer, signal)

They are defined, with their thread semantics, memory ordering and faults, in
``jaxgin.triton.language`` (jaxgin's own Triton kernels use them too); this module is their public
name.
"""

from jaxgin.triton.language import (
    barrier,
    flush,
    peer_ptr,
    put_signal,
    rank,
    read_signal,
    set_flag,
    signal,
    wait_arrivals,
    wait_flag,
    wait_peer_flag,
    wait_signal,
    world_size,
)

__all__ = [
    "barrier",
    "flush",
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
