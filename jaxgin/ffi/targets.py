"""Registration of the CUDA backend's XLA FFI handlers as custom-call targets (the targets, their
handler symbols and the FFI state types are the op table's: jaxgin/ffi/op_table.py).

XLA keeps registrations for the life of the process, so they happen once; a second backend library
(another NCCL) in the same process cannot re-register the names and is refused.
"""

from __future__ import annotations

import ctypes

import jax

from jaxgin.errors import JaxginError
from jaxgin.ffi import op_table

# No target is marked command-buffer compatible, so XLA runs every jaxgin call as its own step on
# its stream, in program order, and records only the code around them into CUDA graphs. Inside a
# command buffer XLA orders commands by the buffers they share and nothing else: XLA's thunk dump
# of a step with several jaxgin calls showed calls without a data dependency as parallel graph
# nodes. jaxgin's calls share the exchange channel's signals and counters, which assume one call
# at a time. The fused ops also nest work that CUDA refuses to record as a child graph (cuBLAS
# calls and peer copies on a second stream; csrc/ffi/chunked_matmul.cu).
_registered_from: str | None = None
# Whether XLA may capture jaxgin's custom calls into CUDA graphs (reported by jaxgin.info()): no,
# see above.
command_buffer_compatible = False
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


def register(backend) -> None:
    global _registered_from
    if _registered_from == backend.path:
        return
    if _registered_from is not None:
        raise JaxginError(
            f"jaxgin's XLA custom calls are registered from {_registered_from}; this process cannot switch to "
            f"{backend.path} (another NCCL or build). Start a new process"
        )
    for family in op_table.FAMILIES:
        for state in family.state_types:
            registration = {
                "type_id": jax.ffi.pycapsule(backend.ffi_address(state.type_id)),
                "type_info": jax.ffi.pycapsule(backend.ffi_address(state.type_info)),
            }
            jax.ffi.register_ffi_type(state.name, registration, platform="CUDA")
    for target in op_table.targets():
        handlers = {stage: jax.ffi.pycapsule(_HANDLER(backend.ffi_handler(s))) for stage, s in target.handlers.items()}
        # A handler with one stage registers as itself (XLA's execute stage); several as a dict.
        fn = handlers["execute"] if list(handlers) == ["execute"] else handlers
        # No traits: not COMMAND_BUFFER_COMPATIBLE (see above).
        jax.ffi.register_ffi_target(target.name, fn, platform="CUDA")
    _registered_from = backend.path
