"""Placement of jaxgin's buffers and signals in the symmetric heap.

Every rank must place a buffer at the same heap offset, because peers address it by offset. The
allocators here are deterministic (first fit, in request order), and every process of an SPMD job
makes the same requests in the same order (it traces the same program), so offsets agree without
any communication.

Free heap bytes are zero: the runtime clears the heap at initialize, and whoever frees a region
clears it first. Buffers that peers write before the owner runs (mailbox line slots, whose
flags any stale nonzero bytes could imitate) rely on that instead of clearing at placement, which
could erase a put that already arrived.
"""

from __future__ import annotations

import bisect

from jaxgin.errors import JaxginError

ALIGNMENT = 256  # every heap buffer starts on a 256-byte boundary (vector copies, NCCL puts)


class RangeAllocator:
    """First-fit allocator over the integer range [begin, end)."""

    def __init__(self, begin: int, end: int, *, what: str, alignment: int = 1, hint: str = ""):
        self.begin, self.end = begin, end
        self.what, self.alignment, self.hint = what, alignment, hint
        self._free: list[tuple[int, int]] = [(begin, end)]  # sorted, disjoint [start, stop)
        self._used: dict[int, int] = {}

    def allocate(self, size: int) -> int:
        if size < 0:
            raise ValueError(f"cannot allocate {size} {self.what}")
        size = max(self.alignment, -(-size // self.alignment) * self.alignment)  # distinct, aligned blocks
        for i, (start, stop) in enumerate(self._free):
            if stop - start >= size:
                self._free[i] = (start + size, stop)
                if start + size == stop:
                    del self._free[i]
                self._used[start] = size
                return start
        raise JaxginError(
            f"out of {self.what}: {size} requested, {self.available()} free in total, largest free block "
            f"{max((b - a for a, b in self._free), default=0)}, of {self.end - self.begin}{self.hint}"
        )

    def free(self, start: int) -> None:
        size = self._used.pop(start)
        i = bisect.bisect(self._free, (start, start + size))
        self._free.insert(i, (start, start + size))
        merged: list[tuple[int, int]] = []
        for a, b in self._free:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self._free = merged

    def available(self) -> int:
        return sum(b - a for a, b in self._free)


def heap_allocator(user_offset: int, heap_bytes: int) -> RangeAllocator:
    return RangeAllocator(
        user_offset,
        heap_bytes,
        what="symmetric heap bytes",
        alignment=ALIGNMENT,
        hint="; pass a larger jaxgin.initialize(heap_size=...)",
    )


def signal_allocator(signal_count: int) -> RangeAllocator:
    return RangeAllocator(0, signal_count, what="signals", hint="; pass a larger jaxgin.initialize(signal_count=...)")
