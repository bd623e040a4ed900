"""What jaxgin's scripts (examples/, benchmarks/, tools/) share on the command line: a missing
Python package, a missing toolchain or too few GPUs ends a script with one line on stderr that says
what is missing and how to get it, never with a traceback, and with an exit status that says which:

  EXIT_MISSING_DEPENDENCY (3)  a package or toolchain the script needs is not installed
                               (the line holds the pip command), or the CUDA build failed
                               (the line is followed by the compiler's output)
  EXIT_TOO_FEW_GPUS (4)        the script measures or runs something on NVIDIA GPUs and this
                               machine, or JAX, shows fewer than it needs (the line says how many)

The checks of a node or a job (python -m jaxgin.doctor, python -m jaxgin.pairtest) end with 0
when all is well, and otherwise with:

  EXIT_DEGRADED (5)            it works, but slower or with a known risk (each named)
  EXIT_NOT_READY (6)           it fails or would fail (each cause named, with its fix)

Sizes on the command line go through jaxgin.sizes (``type=sizes.argument("--max-bytes")``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

from jaxgin.errors import NcclError, ToolchainError

EXIT_MISSING_DEPENDENCY = 3
EXIT_TOO_FEW_GPUS = 4
EXIT_DEGRADED = 5
EXIT_NOT_READY = 6


def stop(script: str, message: str, status: int):
    """Ends the script: `script: message` on stderr, exit status `status`."""
    print(f"{Path(script).name}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(status)


def installed(module: str) -> bool:
    """Whether `module` (dotted names too) can be imported, without importing it; a module blocked
    in sys.modules (set to None) counts as missing."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # a missing or blocked parent package of a dotted name
        return False


def require(script: str, module: str, *, why: str, install: str) -> None:
    """Ends the script (EXIT_MISSING_DEPENDENCY) unless `module` is installed; `install` is what
    to pass to pip, e.g. '-e ".[cuda]"'."""
    if not installed(module):
        stop(script, f"needs {module} ({why}), which is not installed: pip install {install}",
             EXIT_MISSING_DEPENDENCY)


def cuda_gpu_count() -> int:
    """NVIDIA GPUs the CUDA driver shows this process (CUDA_VISIBLE_DEVICES applies); 0 where there
    is no driver. Needs no framework, so it also answers where JAX has no CUDA plugin."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def require_gpus(script: str, count: int, what: str, *, through_jax: bool = True) -> int:
    """Ends the script (EXIT_TOO_FEW_GPUS) unless `count` NVIDIA GPUs are there; returns how many
    are. With `through_jax` they must be JAX's devices (the script runs JAX on them), else the CUDA
    driver's (the script uses PyTorch or Triton directly). `what` says what the script does with them."""
    if through_jax:
        import jax  # only here: scripts that drive GPUs through PyTorch or Triton never start JAX

        gpus = sum(d.platform == "gpu" for d in jax.devices())
        if gpus >= count:
            return gpus
        driver = cuda_gpu_count() if gpus == 0 else 0
        if driver > 0:
            seen = (f"the CUDA driver shows {driver} but JAX runs on {jax.default_backend()!r} (its CUDA plugin is "
                    'missing): pip install -e ".[cuda]"')
        else:
            seen = f"JAX sees {gpus}" if gpus else "there are none here"
    else:
        driver = cuda_gpu_count()
        if driver >= count:
            return driver
        seen = f"the CUDA driver shows {driver}" if driver else "there are none here"
    needed = "an NVIDIA GPU" if count == 1 else f"{count} or more NVIDIA GPUs"
    stop(script, f"needs {needed} ({what}); {seen}", EXIT_TOO_FEW_GPUS)


def run(script: str, main, *args, **kwargs):
    """Calls main(*args, **kwargs); a missing or failing toolchain (nvcc, NCCL, ptxas, CUPTI: jaxgin's
    ToolchainError and NcclError, whose messages name the pip command) ends the script with its
    message instead of a traceback (EXIT_MISSING_DEPENDENCY)."""
    try:
        return main(*args, **kwargs)
    except (ToolchainError, NcclError) as e:
        stop(script, str(e), EXIT_MISSING_DEPENDENCY)
