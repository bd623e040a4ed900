"""Exceptions jaxgin raises. Each message names what was wrong and what would be right."""

from pathlib import Path


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


def install_command(extras: str) -> str:
    """The pip command that adds `extras` ('cuda', 'cuda,torch') to this jaxgin: the README's
    ``pip install -e ".[cuda]"`` with the checkout jaxgin runs from in place of '.', so it works from
    any directory. jaxgin installs from a checkout, not from a package index."""
    checkout = Path(__file__).resolve().parents[1]
    if (checkout / "pyproject.toml").is_file():
        return f'pip install -e "{checkout}[{extras}]"'
    return f'pip install -e ".[{extras}]" in a checkout of jaxgin'
