"""tritongin.device_library(): the device library as PTX and cubin for linking into Triton kernels.

Builds against the NCCL jaxgin would load (the nvidia-nccl-cu13 package's); needs nvcc and skips
without it, unless JAXGIN_REQUIRE_NVCC=1. Shares the session's build cache with test_build.py.
"""

from __future__ import annotations

import re

import tritongin
from jaxgin import build


def test_device_library(nvcc, packaged_nccl):
    artifacts = tritongin.device_library("sm_90a")
    assert artifacts.ptx.is_file()
    assert artifacts.cubin.is_file()
    assert artifacts.directory.parent == build.default_cache_dir()
    assert artifacts.directory.name.startswith(f"nccl{packaged_nccl.version_string}-sm_90a-")
    ptx = artifacts.ptx.read_text()
    assert re.search(r"^\.visible\s+\.func\s+(?:\([^)]*\)\s*)?jaxgin_put_signal\s*\(", ptx, flags=re.MULTILINE)
    assert artifacts.cubin.read_bytes()[:4] == b"\x7fELF"
    assert artifacts.backend is not None and artifacts.backend.is_file()
