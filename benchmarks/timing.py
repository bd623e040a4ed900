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


def best_seconds_threaded(f, x, *, repeats: int) -> float:
    """best_seconds for a program that donates its one argument and returns an array like it: each
    call takes the previous call's result, so the program finds the same buffers at every call
    (XLA then replays its recorded command buffers as they are, with no update for moved buffers,
    as in a training loop that donates its state)."""
    x = jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x = jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - start)
    return best


def after(a, b):
    """`a` with its first element moved by 0 * b's first element, which XLA cannot prove to be
    zero: the next call, fed with the result, waits for the call that made `b`, and no call is
    loop-invariant (XLA hoists those out of the loop: a matmul of constant operands ran once in a
    loop of 50 with jax 0.12). `b` passes an optimization barrier, so that XLA cannot narrow the
    work that makes it to the one element read."""
    import jax.numpy as jnp

    b = jax.lax.optimization_barrier(b)
    moved = a.reshape(-1)[0].astype(jnp.float32) + b.reshape(-1)[0].astype(jnp.float32) * 0
    return a.at[(0,) * a.ndim].set(moved.astype(a.dtype))
