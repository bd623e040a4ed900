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
# Targets XLA must run outside its command buffers: CUDA refuses to nest what they record (cuBLAS
# calls and peer copies on a second stream) in XLA's graphs; see csrc/ffi/chunked_matmul.cu.
NOT_IN_COMMAND_BUFFERS = frozenset({"jaxgin_matmul_all_to_all", "jaxgin_all_gather_matmul"})
# FFI state types: name -> (exported type-id getter, exported type-info getter)
STATE_TYPES = {
    "jaxgin_triton_kernel": ("jaxgin_ffi_triton_kernel_type_id", "jaxgin_ffi_triton_kernel_type_info"),
}

_registered_from: str | None = None
command_buffer_compatible = False  # whether XLA may capture jaxgin's custom calls into CUDA graphs
_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


def register(backend) -> None:
    global _registered_from, command_buffer_compatible
    if _registered_from == backend.path:
        return
    if _registered_from is not None:
        raise JaxginError(
            f"jaxgin's XLA custom calls are registered from {_registered_from}; this process cannot switch to "
            f"{backend.path} (another NCCL or build). Start a new process"
        )
    # The handlers enqueue only graph-safe work (no host synchronisation, expected values kept on
    # the device), so XLA may record them into command buffers and replay them; XLA needs to be
    # told at registration. The trait enum is not public API, so its absence is reported in info().
    try:
        from jax._src.lib import xla_client

        traits = {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
    except (ImportError, AttributeError):
        traits = {}
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
        jax.ffi.register_ffi_target(target, fn, platform="CUDA", **({} if target in NOT_IN_COMMAND_BUFFERS else traits))
    _registered_from = backend.path
    command_buffer_compatible = bool(traits)
