"""The watch that turns the last hang a device fault can cause into an error.

A jaxgin kernel whose wait times out records the fault in host-mapped memory and traps. XLA learns
of it only through a CUDA call made after the trap. When XLA had already queued the whole program,
no such call comes: the program's completion waits for a host function, and CUDA never runs a
host function once the context is in error (cuLaunchHostFunc's documented behaviour). The caller
then waits in ``block_until_ready`` for good. This was measured in emulated-host worlds on one
H100 (2026-11-25): one rank at random, its main thread in ``block_until_ready`` and every XLA
thread idle, while its peers raised their faults.

The watch reads the fault records a few times a second. Once one appears, it prints the fault on
stderr at once. If, ``grace_s`` seconds later, a thread of the process is still waiting in JAX for
device results, it prints that thread's stack and ends the process with ``FAULT_EXIT_CODE``: the
user sees the named fault instead of a process that never ends. A program that got the exception
and moved on is left alone.

One hang has no device fault at all: NCCL's GIN progress thread ends at its first error (a NIC's
plugin reporting a broken connection), nothing drains the GPU's descriptor queues after that, and a
kernel that posts into a full one spins inside NCCL, where jaxgin's bounded waits never get to run.
So the watch also reads NCCL's asynchronous errors (``read_communicator_errors``). It prints the
first at once; if ``timeout_s + grace_s`` later no device wait has given up (each gives up within
``timeout_s`` when it runs) and a thread still waits for device results, it ends the process the
same way, naming NCCL's error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Callable

FAULT_EXIT_CODE = 75

# Where a thread waits for device results in JAX (jax/_src/api.py, array.py; multihost_utils). A
# thread still in one of these `grace_s` after a fault waits for a context in error, which answers
# at once or never.
WAITING_IN = frozenset({"block_until_ready", "try_to_block", "_single_device_array_to_np_array_did_copy",
                        "device_get", "process_allgather"})


def waiting_threads(exclude: int | None = None) -> dict[int, list[str]]:
    """Threads (id -> formatted stack) whose stack has a frame in WAITING_IN."""
    found = {}
    for ident, frame in sys._current_frames().items():
        if ident == exclude:
            continue
        stack = traceback.extract_stack(frame)
        if any(f.name in WAITING_IN for f in stack):
            found[ident] = traceback.format_list(stack)
    return found


class FaultWatch:
    """Polls `read_faults()` (the fault lines, "" when none) on a daemon thread; and, when given,
    `read_communicator_errors()` (NCCL's asynchronous errors, "" when none) until it reports one."""

    def __init__(self, read_faults: Callable[[], str], grace_s: float, poll_s: float = 0.25,
                 end_process: Callable[[int], None] = os._exit,
                 read_communicator_errors: Callable[[], str] | None = None, timeout_s: float = 0.0):
        self._read, self._grace, self._poll, self._end = read_faults, grace_s, poll_s, end_process
        self._read_nccl, self._timeout = read_communicator_errors, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxgin-fault-watch", daemon=True)

    def start(self) -> FaultWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the watch and waits for it (before the fault records are freed)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        seen_at = nccl_seen_at = None
        while not self._stop.wait(self._poll):
            faults = self._read()
            if not faults:
                if nccl_seen_at is None and self._read_nccl is not None and (errors := self._read_nccl()):
                    nccl_seen_at = time.monotonic()  # read no more: NCCL may log each query
                    print(f"jaxgin: NCCL reports an error in this process:\n  {errors.strip()}", file=sys.stderr,
                          flush=True)
                if nccl_seen_at is not None and time.monotonic() - nccl_seen_at >= self._timeout + self._grace:
                    if self._end_if_waiting(
                            f"{self._timeout + self._grace:g} s after NCCL's error above, no device-side wait of "
                            f"this process has given up (each gives up within {self._timeout:g} s when it runs), "
                            "so a kernel is held where jaxgin's bounds do not reach: most likely a GIN put posted "
                            "into a GPU-to-proxy queue that NCCL's stopped progress thread no longer drains. A "
                            "thread still waits for device results"):
                        return
                continue
            if seen_at is None:
                seen_at = time.monotonic()
                print(f"jaxgin: device fault recorded in this process:\n  {faults.strip()}", file=sys.stderr,
                      flush=True)
                continue
            if time.monotonic() - seen_at < self._grace:
                continue
            if self._end_if_waiting(
                    f"{self._grace:g} s after the device fault above, a thread still waits for device results "
                    "that a CUDA context in error never delivers (XLA had queued the whole program before the "
                    "kernel trapped)"):
                return

    def _end_if_waiting(self, why: str) -> bool:
        """Ends the process, saying `why`, if a thread waits for device results; whether it did."""
        waiting = waiting_threads(exclude=threading.get_ident())
        if not waiting:
            return False
        stacks = "".join("".join(stack) for stack in waiting.values())
        print(f"jaxgin: {why}; ending the process with exit code {FAULT_EXIT_CODE} instead of hanging. "
              f"The waiting thread:\n{stacks}", file=sys.stderr, flush=True)
        self._end(FAULT_EXIT_CODE)
        return True
