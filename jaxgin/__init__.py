"""jaxgin: one-sided, device-initiated communication (NCCL GIN and LSA) for JAX and Triton.

Start with ``jaxgin.initialize()``; ``jaxgin.info()`` says what it runs on and
``jaxgin.selftest()`` checks an all-pairs exchange between every device. Inside ``jax.shard_map``:
``jaxgin.ppermute`` / ``jaxgin.all_to_all`` replace jax.lax's, and ``jaxgin.put_signal`` /
``jaxgin.wait_signal`` / ``jaxgin.wait_signal_from`` with a ``jaxgin.Mailbox`` give split-phase one-sided communication. ``jaxgin.triton_call`` runs a Triton kernel that
communicates itself (``tritongin``) as one XLA op (``jaxgin.axis_route`` gives it the ranks of its
axis peers); ``jaxgin.fused`` has matmuls fused with their all_to_all / all_gather, ``jaxgin.moe``
expert-parallel MoE dispatch / combine and a MoE layer.
"""

from jaxgin.errors import DeviceFault, JaxginError, NcclError, NotInitializedError, ToolchainError
from jaxgin.runtime import device_faults, finalize, info, initialize, is_initialized
from jaxgin.diagnostics import SelftestReport, selftest
from jaxgin.collectives import all_to_all, ppermute
from jaxgin.mailbox import Mailbox, Token, put_signal, wait_signal, wait_signal_from
from jaxgin.triton_op import triton_call
from jaxgin.route import axis_route
from jaxgin import fused, moe

__version__ = "0.1.0"

__all__ = [
    "DeviceFault",
    "JaxginError",
    "Mailbox",
    "NcclError",
    "NotInitializedError",
    "SelftestReport",
    "Token",
    "ToolchainError",
    "all_to_all",
    "axis_route",
    "fused",
    "moe",
    "device_faults",
    "finalize",
    "info",
    "initialize",
    "is_initialized",
    "ppermute",
    "put_signal",
    "selftest",
    "triton_call",
    "wait_signal",
    "wait_signal_from",
]
