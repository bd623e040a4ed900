"""jaxgin: one-sided, device-initiated communication (NCCL GIN and LSA) for JAX and Triton.

Start with ``jaxgin.initialize()``; ``jaxgin.info()`` says what it runs on and
``jaxgin.selftest()`` checks an all-pairs exchange between every device.
"""

from jaxgin.errors import DeviceFault, JaxginError, NcclError, NotInitializedError, ToolchainError
from jaxgin.runtime import finalize, info, initialize, is_initialized
from jaxgin.diagnostics import SelftestReport, selftest

__version__ = "0.1.0"

__all__ = [
    "DeviceFault",
    "JaxginError",
    "NcclError",
    "NotInitializedError",
    "SelftestReport",
    "ToolchainError",
    "finalize",
    "info",
    "initialize",
    "is_initialized",
    "selftest",
]
