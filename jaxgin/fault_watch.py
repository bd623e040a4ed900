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
    """Polls `read_faults()` (the fault lines, "" when none) on a daemon thread."""

    def __init__(self, read_faults: Callable[[], str], grace_s: float, poll_s: float = 0.25,
                 end_process: Callable[[int], None] = os._exit):
        self._read, self._grace, self._poll, self._end = read_faults, grace_s, poll_s, end_process
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
        seen_at = None
        while not self._stop.wait(self._poll):
            faults = self._read()
            if not faults:
                continue
            if seen_at is None:
                seen_at = time.monotonic()
                print(f"jaxgin: device fault recorded in this process:\n  {faults.strip()}", file=sys.stderr,
                      flush=True)
                continue
            if time.monotonic() - seen_at < self._grace:
                continue
            waiting = waiting_threads(exclude=threading.get_ident())
            if not waiting:
                continue
            stacks = "".join("".join(stack) for stack in waiting.values())
            print(f"jaxgin: {self._grace:g} s after the device fault above, a thread still waits for device results "
                  "that a CUDA context in error never delivers (XLA had queued the whole program before the "
                  f"kernel trapped); ending the process with exit code {FAULT_EXIT_CODE} instead of hanging. "
                  f"The waiting thread:\n{stacks}", file=sys.stderr, flush=True)
            self._end(FAULT_EXIT_CODE)
            return
