"""RDMA devices that rdma-core's libibverbs sees: what NCCL's GDAKI and proxy GIN backends need."""

from __future__ import annotations

import ctypes
import ctypes.util


def devices() -> list[str]:
    """Names of the RDMA devices (e.g. ['mlx5_0']); [] when libibverbs or a NIC is absent."""
    name = ctypes.util.find_library("ibverbs") or "libibverbs.so.1"
    try:
        verbs = ctypes.CDLL(name)
    except OSError:
        return []
    verbs.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    verbs.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    verbs.ibv_get_device_name.restype = ctypes.c_char_p
    verbs.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    verbs.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    count = ctypes.c_int(0)
    listing = verbs.ibv_get_device_list(ctypes.byref(count))
    if not listing:
        return []
    try:
        return [verbs.ibv_get_device_name(listing[i]).decode() for i in range(count.value)]
    finally:
        verbs.ibv_free_device_list(listing)
