"""Exceptions jaxgin raises. Each message names what was wrong and what would be right."""


class JaxginError(RuntimeError):
    """Base class of jaxgin's errors."""


class NotInitializedError(JaxginError):
    """A jaxgin operation ran before jaxgin.initialize()."""


class ToolchainError(JaxginError):
    """nvcc is missing, or compiling jaxgin's CUDA code failed (the message holds the full log)."""


class NcclError(JaxginError):
    """NCCL is missing, too old, or does not match its headers."""


class DeviceFault(JaxginError):
    """A device-side operation failed: a bounded wait timed out, or a peer was unreachable."""
