"""Registration of the CUDA backend's XLA FFI handlers as custom-call targets.

XLA keeps registrations for the life of the process, so they happen once; a second backend library
(another NCCL) in the same process cannot re-register the names and is refused.
"""

from __future__ import annotations

import ctypes

import jax

from jaxgin.errors import JaxginError

# custom-call target name -> exported handler symbol in libjaxgin_backend.so
TARGETS = {
    "jaxgin_exchange": "jaxgin_ffi_exchange",
    "jaxgin_put_signal": "jaxgin_ffi_put",
    "jaxgin_wait_signal": "jaxgin_ffi_wait",
    "jaxgin_wait_signal_from": "jaxgin_ffi_wait_from",
    "jaxgin_matmul_all_to_all": "jaxgin_ffi_matmul_all_to_all",
    "jaxgin_all_gather_matmul": "jaxgin_ffi_all_gather_matmul",
    # jaxgin.triton_call loads its kernel once per executable (instantiate), then launches.
    "jaxgin_triton_call": {"instantiate": "jaxgin_ffi_triton_instantiate", "execute": "jaxgin_ffi_triton_execute"},
}
# No target is marked command-buffer compatible, so XLA runs every jaxgin call as its own step on
# its stream, in program order, and records only the code around them into CUDA graphs. Inside a
# command buffer XLA orders commands by the buffers they share and nothing else: XLA's thunk dump
# of a step with several jaxgin calls showed calls without a data dependency as parallel graph
# nodes. jaxgin's calls share the exchange channel's signals and counters, which assume one call
# at a time. The fused ops also nest work that CUDA refuses to record as a child graph (cuBLAS
# calls and peer copies on a second stream; csrc/ffi/chunked_matmul.cu).
# FFI state types: name -> (exported type-id getter, exported type-info getter)
STATE_TYPES = {
    "jaxgin_triton_kernel": ("jaxgin_ffi_triton_kernel_type_id", "jaxgin_ffi_triton_kernel_type_info"),
}

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
    for name, (type_id, type_info) in STATE_TYPES.items():
        registration = {
            "type_id": jax.ffi.pycapsule(backend.ffi_address(type_id)),
            "type_info": jax.ffi.pycapsule(backend.ffi_address(type_info)),
        }
        jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    for target, symbols in TARGETS.items():
        if isinstance(symbols, str):
            fn = jax.ffi.pycapsule(_HANDLER(backend.ffi_handler(symbols)))
        else:
            fn = {stage: jax.ffi.pycapsule(_HANDLER(backend.ffi_handler(s))) for stage, s in symbols.items()}
        # No traits: not COMMAND_BUFFER_COMPATIBLE (see above).
        jax.ffi.register_ffi_target(target, fn, platform="CUDA")
    _registered_from = backend.path
