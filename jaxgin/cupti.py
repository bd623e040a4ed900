"""CUPTI for the runtime's record of what NCCL maps while jaxgin sets it up
(csrc/runtime/vmm_ledger.h), which lets finalize() return all of NCCL's GPU memory after a fault.

The backend looks for CUPTI in the process first (JAX's profiler loads it), then on the library
path; this loads the ``nvidia-cuda-cupti`` package's library (JAX's CUDA plugin installs it) so it
is found without either."""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path


def packaged_library() -> Path | None:
    """libcupti.so.13 of the nvidia-cuda-cupti package, or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "cu13" / "lib" / "libcupti.so.13"
        if candidate.exists():
            return candidate
    return None


def load() -> Path | None:
    """Loads the packaged CUPTI into the process (global symbols, as the backend looks it up by
    name); returns its path, or None when the package is not installed or its library would not
    load (the backend then reports why the record is unavailable)."""
    library = packaged_library()
    if library is None:
        return None
    try:
        ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
    except OSError:
        return None
    return library
