"""Where a small message's time goes: benchmarks/collectives.py's chains (8 B per device, N
dependent ops in one jit) traced with JAX's profiler. Prints, for the first GPU, each chain's span
per op, the device events of one op from the middle (start offset, duration, name) and each name's
total, so launch gaps can be told from kernel time; how many jaxgin handlers ran in each of the first
calls (XLA recording its graphs again runs them); with --host, what XLA's threads did meanwhile.

    python tools/profile_latency.py [--bytes 8] [--ops ppermute,put_wait_from,put_wait,self_copy] [--host]

Needs 2 or more NVIDIA GPUs visible to JAX (pip install -e ".[cuda]"); without them it says so and
exits with status 4 (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxgin
from jaxgin import cli, sizes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "benchmarks"))
from collectives import _array, make_ops
from profile_moe import host_report, report
from timing import device_events, device_windows, handler_calls, handler_runs, host_events

STEPS = 50
HANDLER_COUNT_CALLS = 6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=sizes.argument("--bytes"), default=8,
                        help="message per device, e.g. 8, 4KiB (default 8)")
    parser.add_argument("--ops", default="ppermute,put_wait_from,put_wait,self_copy")
    parser.add_argument("--out", default=None)
    parser.add_argument("--host", action="store_true",
                        help="also what the host's threads did during the profiled call (XLA's launches, "
                             "jaxgin's handlers), beside the GPU's events")
    args = parser.parse_args()
    cli.require_gpus(__file__, 2, "it profiles benchmarks/collectives.py's chains between them")
    cli.run(__file__, jaxgin.initialize)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    implementations = make_ops(mesh.size)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="profile-latency-"))
    x = _array(mesh, args.bytes, mesh.size)
    for op in args.ops.split(","):
        for label, fn in zip(("xla", "jaxgin"), implementations[op]):
            def body(v, fn=fn):
                v = v[0]
                for _ in range(STEPS):
                    v = fn(v)
                return v[None]

            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            runs = handler_runs(f, x, calls=HANDLER_COUNT_CALLS)
            where = out / f"{op}_{label}"
            before = handler_calls()
            with jax.profiler.trace(str(where), create_perfetto_trace=True):
                jax.block_until_ready(f(x))
            title = f"{op} ({label}), {args.bytes} B, {mesh.size} GPUs"
            events = device_events(where)
            report(title, events, STEPS)
            print(f"   jaxgin handler calls in each of the first {HANDLER_COUNT_CALLS} calls: {runs}; "
                  f"in the profiled one: {handler_calls() - before}")
            windows = device_windows(where)
            t0 = min(start for start, _ in windows.values())
            print("   each GPU's first start and last end, us from the earliest start: "
                  + ", ".join(f"GPU {gpu} {(start - t0) * 1e6:.1f} - {(end - t0) * 1e6:.1f}"
                              for gpu, (start, end) in sorted(windows.items())))
            if args.host:
                host_report(events, host_events(where))
    jaxgin.finalize()


if __name__ == "__main__":
    main()
