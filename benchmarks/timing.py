"""How every benchmark here times a jitted program: one warm-up call (compilation), then the best
of `repeats` calls, each waited for. Programs put their N dependent calls inside one jit, so the
time is device time, and callers divide by N."""

from __future__ import annotations

import time

import jax


def best_seconds(f, *args, repeats: int) -> float:
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        best = min(best, time.perf_counter() - start)
    return best
