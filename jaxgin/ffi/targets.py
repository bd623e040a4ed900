"""Registration of the CUDA backend's XLA FFI handlers as custom-call targets (the targets, their
handler symbols and the FFI state types are the op table's: jaxgin/ffi/op_table.py). A capturable
target is registered twice: as itself, which XLA runs as its own step, and as its "_captured" twin
with XLA's command-buffer trait (jaxgin/ffi/capture.py says which one a call lowers to).

XLA keeps registrations for the life of the process, so they happen once; a second backend library
(another NCCL) in the same process cannot re-register the names and is refused.
"""

from __future__ import annotations

import ctypes

import jax
from jax._src.lib import xla_client  # the traits enum; jax.ffi passes its keyword through

from jaxgin.errors import JaxginError
from jaxgin.ffi import op_table

_registered_from: str | None = None
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
        _register(backend, target.name, target.handlers)
        if target.capturable:
            # XLA learns the trait from the handler itself and, on some versions, from here.
            _register(backend, target.captured_name, target.captured_handlers,
                      traits=xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE)
    _registered_from = backend.path


def _register(backend, name: str, symbols, **traits) -> None:
    handlers = {stage: jax.ffi.pycapsule(_HANDLER(backend.ffi_handler(s))) for stage, s in symbols.items()}
    # A handler with one stage registers as itself (XLA's execute stage); several as a dict.
    fn = handlers["execute"] if list(handlers) == ["execute"] else handlers
    jax.ffi.register_ffi_target(name, fn, platform="CUDA", **traits)
