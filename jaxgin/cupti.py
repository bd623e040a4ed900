"""CUPTI for the runtime's record of what NCCL maps while jaxgin sets it up
(csrc/runtime/vmm_ledger.h), which lets finalize() return all of NCCL's GPU memory after a fault.

The backend looks for CUPTI in the process first (JAX's profiler loads it), then on the library
path; this loads the ``nvidia-cuda-cupti`` package's library (JAX's CUDA plugin installs it) so it
is found without either."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from jaxgin import nvidia_packages


def packaged_library() -> Path | None:
    """libcupti.so.13 of the nvidia-cuda-cupti package, or None."""
    return nvidia_packages.find("cu13/lib/libcupti.so.13")


def loaded_library() -> Path | None:
    """The libcupti mapped into this process already (JAX's profiler, a CUDA toolkit's), or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and "/libcupti.so" in fields[-1]:
                return Path(fields[-1])
    return None


def load() -> Path | None:
    """Makes sure a CUPTI is in the process: the one already loaded, else the packaged one (global
    symbols, as the backend looks it up by name; never a second copy beside another). Returns its
    path, or None when there is none or it would not load (the backend then reports why the record
    is unavailable)."""
    already = loaded_library()
    if already is not None:
        return already
    library = packaged_library()
    if library is None:
        return None
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        return None
    return library
