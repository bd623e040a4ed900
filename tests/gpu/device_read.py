"""Reads a few words of GPU memory into the host through the CUDA driver (kept free of pytest:
scenarios import it). The scenarios read jaxgin's device counters this way, so that no GPU test
needs a framework of its own (PyTorch) installed beside jax[cuda] to check what jaxgin did."""

import ctypes

import numpy as np

_cuda = None


def _driver():
    global _cuda
    if _cuda is None:
        _cuda = ctypes.CDLL("libcuda.so.1")
        _check(_cuda.cuInit(0), "cuInit")
    return _cuda


def _check(code: int, call: str) -> None:
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {code}")


def read(array, count: int | None = None) -> np.ndarray:
    """The first `count` elements (default all) of `array`, a jaxgin DeviceArray (a heap buffer on
    one GPU: SymmetricArray.local()), copied from the GPU's primary context, which is JAX's. Call
    it once the kernels that write it finished (jax.block_until_ready)."""
    cuda = _driver()
    out = np.zeros(int(np.prod(array.shape)) if count is None else count, array.dtype)
    device, context = ctypes.c_int(), ctypes.c_void_p()
    _check(cuda.cuDeviceGet(ctypes.byref(device), array.device), "cuDeviceGet")
    _check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    try:
        _check(cuda.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
        try:
            _check(cuda.cuMemcpyDtoH_v2(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_uint64(array.data_ptr()),
                                        ctypes.c_size_t(out.nbytes)), "cuMemcpyDtoH")
        finally:
            _check(cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p())), "cuCtxPopCurrent")
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(device)
    return out
