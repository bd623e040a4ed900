"""What one jaxgin.triton_call costs inside a jit (with its JAX side effect, and with pure=True),
beside one XLA fusion: chains of STEPS dependent calls of a 16-element kernel (nothing for the GPU
to do), wall clock per call, the best of --repeats. What it shows is the fixed cost a call adds on
the host and between kernels (the launch, XLA's custom-call step, its command buffers as XLA_FLAGS
set them), the floor under every jaxgin op at small sizes. Beside it, the GPU's span of one
profiled run of each chain (first kernel start to last end) per call: where the wall clock per
call is above it, the chain waits for the host; and what the host's threads spent that time on
(the most costly event names of one profiled run, less the profiler's own). Also each step alone
as a program called 500 times back to back: the host's cost of one call of a jitted function
holding it. And how many jaxgin handlers ran per call of the triton_call chain in its first calls:
50 where XLA launches each call, 0 once XLA replays a recorded command buffer.

    python tools/call_overhead.py [--repeats 20] [--out DIR]

Writes DIR/call_overhead.json ({"device", "jax", "xla_flags", "steps", "us_per_call": {"xla_fusion",
"triton_call", "triton_call_pure"}, "device_us_per_call": the GPU's span per call,
"host_events": per chain, [name, count, summed us] of its costliest host events,
"one_step_program_us_per_call": the same three, "triton_call_handler_runs": [runs in each of the
first calls]}). Needs an NVIDIA GPU visible to JAX and Triton (pip install -e ".[cuda]"); without
them it says so and exits with status 4 or 3 (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import jaxgin
from jaxgin import cli

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import best_seconds, device_step_seconds, handler_runs, host_event_totals  # noqa: E402

STEPS = 50


def _plus_one_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def plus_one(ctx, a, out, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out + i, tl.load(a + i) + 1)

    return plus_one


def measure(repeats: int) -> dict:
    kernel = _plus_one_kernel()
    a = jnp.zeros((16,), jnp.int32)
    steps = {
        # the barrier keeps each step a fusion of its own (XLA fuses an elementwise chain into one)
        "xla_fusion": lambda a: jax.lax.optimization_barrier(a * 3 + 1),
        "triton_call": lambda a: jaxgin.triton_call(kernel, a, grid=(1,), out_shape=a, N=16),
        # no JAX effect: the program keeps JAX's fast dispatch path (as jaxgin's own kernels do)
        "triton_call_pure": lambda a: jaxgin.triton_call(kernel, a, grid=(1,), out_shape=a, N=16, pure=True),
    }
    times, device, host, dispatch, runs = {}, {}, {}, {}, None
    for name, step in steps.items():
        dispatch[name] = dispatch_seconds(jax.jit(step), a) * 1e6
        print(f"  {name:12s} {dispatch[name]:7.2f} us per call of a one-step program", flush=True)
        chain = jax.jit(lambda a, step=step: jax.lax.fori_loop(0, STEPS, lambda _, v: step(v), a, unroll=True))
        if name == "triton_call":  # before the timing's warm-up calls: XLA records its graphs in the first
            runs = handler_runs(chain, a, calls=4)
            print(f"  triton_call handler runs in the first calls: {runs}", flush=True)
        times[name] = best_seconds(chain, a, repeats=repeats) / STEPS * 1e6
        _, per_step = device_step_seconds(chain, a, steps=STEPS)
        device[name] = per_step * 1e6
        print(f"  {name:12s} {times[name]:7.2f} us per call, {device[name]:.2f} us of the GPU's span", flush=True)
        host[name] = [row for row in host_event_totals(chain, a, top=25)
                      if not row[0].startswith(("$profiler", "$contextlib"))][:15]  # less the profiler's own
        for event, count, us in host[name][:6]:
            print(f"    host: {event[:70]:70s} x{count:<4d} {us:9.1f} us", flush=True)
    return times, device, host, dispatch, runs


def dispatch_seconds(f, a, calls: int = 500, repeats: int = 5) -> float:
    """Seconds per call of a one-step program called `calls` times back to back (JAX dispatches
    asynchronously; the GPU work is too small to hold the host back): the host's cost of a call."""
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = f(a)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    cli.require_gpus(__file__, 1, "it times jaxgin.triton_call on it")
    cli.require(__file__, "triton", why="the kernel it calls", install='-e ".[cuda]"')
    cli.run(__file__, jaxgin.initialize)
    times, device, host, dispatch, runs = measure(args.repeats)
    report = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, xla_flags=os.environ.get("XLA_FLAGS", ""),
                  steps=STEPS, us_per_call=times, device_us_per_call=device, host_events=host,
                  one_step_program_us_per_call=dispatch,
                  triton_call_handler_runs=runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "call_overhead.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
