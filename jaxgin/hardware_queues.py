"""CUDA's hardware work queues per GPU context, and why jaxgin asks for all of them.

CUDA feeds a context's streams to the GPU through a few hardware queues (8 by default,
``CUDA_DEVICE_MAX_CONNECTIONS``, at most 32), assigning streams to them in turn as they are made.
Work in one queue starts in order, whatever its stream. When NCCL's proxy GIN backend carries the
puts through jaxgin's host transport, the transport's copy and signal streams must run while a
jaxgin kernel on XLA's stream spins for the very put they apply. If one of them shares a queue with
XLA's stream, and XLA already queued the next op behind the spinning kernel, the transport's work
waits behind that op, which waits for the kernel: the put never lands and the wait times out.
Seen on one H100 with emulated hosts (2026-11-25): a 4 MiB mailbox put and a selftest barrier
signal stuck at world 2, where the streams happened to share a queue.

More queues make sharing unlikely (XLA, NCCL and the transport make far fewer than 32 streams per
context at the worlds tested). The variable is read once, when CUDA makes the context, so it is
set when jaxgin is imported: a program that imports jaxgin before JAX touches its GPUs gets it.
A value the user set is kept; ``initialize()`` warns when it is low and the host transport is in
use.
"""

import os

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
WANTED = 32  # CUDA's maximum


def apply_default() -> None:
    """Asks for CUDA's maximum number of hardware queues unless the user chose a number."""
    os.environ.setdefault(VARIABLE, str(WANTED))


def low_setting_warning() -> str | None:
    """A warning for initialize() when the variable asks for fewer than WANTED queues, else None."""
    raw = os.environ.get(VARIABLE)
    try:
        queues = int(raw) if raw is not None else WANTED
    except ValueError:
        queues = 8  # CUDA ignores a value it cannot read
    if queues >= WANTED:
        return None
    return (
        f"{VARIABLE}={raw!r}: with fewer than {WANTED} CUDA hardware queues, jaxgin's host transport may share one "
        f"with XLA's stream, and a put that a spinning jaxgin kernel waits for can then wait behind XLA's next op "
        f"until the kernel times out. Unset it (jaxgin sets {WANTED} when imported before JAX uses the GPU) or set "
        f"{WANTED}."
    )


apply_default()
