"""jaxgin vs XLA's collectives, same process, same data, timed inside one jit.

    python benchmarks/collectives.py [--out DIR] [--max-bytes 512MiB] [--ops ppermute,all_to_all,put_wait,put_wait_from]

Needs 2 or more NVIDIA GPUs visible to JAX in this process (pip install -e ".[cuda]"); without
them it says so and exits with status 4 (jaxgin.cli). matplotlib, if installed, draws the plot.

XLA_FLAGS apply to both implementations alike. XLA records jaxgin's custom calls into CUDA graphs
where jaxgin allows it (jaxgin.info()["command_buffers"]; JAXGIN_COMMAND_BUFFERS=0 keeps them out),
as with XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL"; its own NCCL collectives
stay outside. `handler_calls_per_op` in every row says which happened, counted in one run after
the timed ones (0: replayed from a graph); XLA records a program's graphs in its first runs
(`recording_calls_per_op`, the handlers those ran). With --donate every run takes the previous
run's result, donated, so it finds the same buffers (as a training loop that donates its state does).

For every op and message size (bytes per device, 8 B to --max-bytes) it compiles one program per
implementation that applies the op N times in a chain (each op consumes the previous result, so
they cannot overlap or be removed), runs it a few times and keeps the best. Time per op = program
time / N, with N large enough that one dispatch is noise. Checks that jaxgin's result equals XLA's
before timing. Beside every row: the launch floor (a chain of empty kernels, on a stream and in a
CUDA graph), and from 16 MiB on the copy engines' time for what the op moves: XLA's ppermute or
all_to_all with its peer copies on the copy engines (COPY_ENGINE_FLAG), in a process of its own. Writes
collectives.json and collectives.png (if matplotlib is installed; otherwise
`python benchmarks/plot.py collectives.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxgin
from jaxgin import cli, sizes
from timing import WARMUP_CALLS, best_seconds, best_seconds_threaded, device_step_seconds, handler_calls


def chain_length(nbytes: int) -> int:
    if nbytes <= 1 << 20:
        return 200
    if nbytes <= 16 << 20:
        return 50
    return 10


def _array(mesh, nbytes: int, n: int):
    dtype = np.float32 if nbytes % (4 * n) == 0 else np.uint8
    count = nbytes // np.dtype(dtype).itemsize
    host = (np.arange(mesh.size * count) % 251).astype(dtype).reshape(mesh.size, count)
    return jax.device_put(host, NamedSharding(mesh, P("x")))


OPS = ("ppermute", "self_copy", "all_to_all", "put_wait", "put_wait_from")
# The copy engines' time for what an op moves: XLA's own ppermute and all_to_all with peer copies on
# the copy engines instead of NCCL's kernels. XLA reads its flags once per process, so they are
# timed in a process of their own (--copy-engine-child), with the same chains as every row.
COPY_ENGINE_FLAG = "--xla_gpu_use_memcpy_local_p2p=true"
# The copy engines' figures start here: below it a copy's fixed costs, not its bytes, set its time.
COPY_ENGINE_MIN_BYTES = 16 << 20
# The copy engines' program that moves what each op moves: ring ops one neighbour's whole buffer,
# all_to_all a slice to every peer.
COPY_ENGINE_PROGRAM = {"ppermute": "ppermute", "put_wait": "ppermute", "put_wait_from": "ppermute", "all_to_all": "all_to_all"}


def _chain_program(mesh, fn, steps: int, donated: bool = False):
    """fn applied `steps` times in one jitted program over the mesh's "x" axis, each step on the
    previous one's result (so they cannot overlap or be removed)."""
    def body(v):
        v = v[0]
        for _ in range(steps):
            v = fn(v)
        return v[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                   donate_argnums=(0,) if donated else ())


def _expected(op: str, host: np.ndarray) -> np.ndarray:
    """One ring ppermute (device i receives device i - 1's buffer) or one tiled all_to_all (device i
    receives slice i of every device's buffer, by source) of `host`, [devices, elements]."""
    n = host.shape[0]
    if op == "ppermute":
        return np.roll(host, 1, axis=0)
    return host.reshape(n, n, -1).transpose(1, 0, 2).reshape(n, -1)


def copy_engine_child(programs: list[str], sizes_: list[int], repeats: int) -> list[dict]:
    """In a process started with COPY_ENGINE_FLAG: per program ("ppermute", "all_to_all") and size,
    XLA's chain time per op and whether one op's result is right."""
    assert COPY_ENGINE_FLAG in os.environ.get("XLA_FLAGS", ""), "run through copy_engine_times"
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    ops = {"ppermute": lambda v: jax.lax.ppermute(v, "x", ring),
           "all_to_all": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True)}
    rows = []
    for op in programs:
        fn = ops[op]
        for nbytes in sizes_:
            x = _array(mesh, nbytes, n)
            steps = chain_length(nbytes)
            equal = bool(np.array_equal(np.asarray(_chain_program(mesh, fn, 1)(x)), _expected(op, np.asarray(x))))
            seconds = best_seconds(_chain_program(mesh, fn, steps), x, repeats=repeats) / steps
            rows.append({"op": op, "bytes_per_device": nbytes, "seconds": seconds, "equal": equal})
    return rows


def copy_engine_times(programs: list[str], sizes_: list[int], repeats: int) -> dict:
    """{(program, bytes per device): seconds} from a child process (copy_engine_child), or
    {"error": why} when it fails or moves wrong bytes: rows then have no copy-engine figure, and
    the report says why."""
    sizes_ = [b for b in sizes_ if b >= COPY_ENGINE_MIN_BYTES]
    if not sizes_ or not programs:
        return {}
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {COPY_ENGINE_FLAG}".strip(),
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # beside this process's preallocated memory
    command = [sys.executable, __file__, "--copy-engine-child", ",".join(map(str, sizes_)), "--ops", ",".join(programs),
               "--repeats", str(repeats)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        return {"error": f"{' '.join(command[1:])} with XLA_FLAGS+={COPY_ENGINE_FLAG} exited {done.returncode}: "
                         + done.stderr.strip()[-2000:]}
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    wrong = [f"{r['op']} at {r['bytes_per_device']} B" for r in rows if not r["equal"]]
    if wrong:
        return {"error": "the copy engines' programs moved wrong bytes: " + ", ".join(wrong)}
    return {(r["op"], r["bytes_per_device"]): r["seconds"] for r in rows}


def make_ops(n: int):
    ring = [(i, (i + 1) % n) for i in range(n)]
    boxes = {}

    def box_for(shape, dtype):
        key = (shape, np.dtype(dtype).name)
        if key not in boxes:
            boxes[key] = jaxgin.Mailbox(f"bench_{len(boxes)}_{shape}_{key[1]}", shape, dtype)
        return boxes[key]

    def put_wait(v):
        box = box_for(v.shape, v.dtype)
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, peer=(me + 1) % n, axis_name="x")
        return jaxgin.wait_signal(box, 1, axis_name="x", after=token)[(me - 1) % n]

    def put_wait_from(v):
        box = box_for(v.shape, v.dtype)
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, peer=(me + 1) % n, axis_name="x")
        return jaxgin.wait_signal_from(box, (me - 1) % n, axis_name="x", after=token)

    identity = [(i, i) for i in range(n)]
    return {
        "ppermute": (lambda v: jax.lax.ppermute(v, "x", ring), lambda v: jaxgin.ppermute(v, "x", ring)),
        # The floor of any one-kernel custom call in this harness: jaxgin's ppermute to itself
        # (XLA's dispatch of the call, one launch, a local copy, no communication).
        "self_copy": (lambda v: jax.lax.ppermute(v, "x", identity), lambda v: jaxgin.ppermute(v, "x", identity)),
        "all_to_all": (
            lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True),
            lambda v: jaxgin.all_to_all(v, "x", 0, 0, tiled=True),
        ),
        "put_wait": (lambda v: jax.lax.ppermute(v, "x", ring), put_wait),
        # The same ring waiting for the left neighbour only (no [n, ...] inbox, no row selection).
        "put_wait_from": (lambda v: jax.lax.ppermute(v, "x", ring), put_wait_from),
    }


# Rows up to this size are also profiled: each chain's steady cost per op on the device, apart from
# the run's fixed costs (the graph's launch, the GPUs' start skew), which a chain of small ops feels.
DEVICE_CYCLE_MAX_BYTES = 16 << 20


def run(ops: list[str], max_bytes: int, repeats: int, donate: bool = False) -> dict:
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size
    implementations = make_ops(n)
    sizes = [8]
    while sizes[-1] * 8 <= max_bytes:
        sizes.append(sizes[-1] * 8)
    for extra in (64 << 10, 128 << 20, 512 << 20):
        if extra <= max_bytes and extra not in sizes:
            sizes.append(extra)
    sizes.sort()
    results = []
    rt = jaxgin.runtime.current().runtime
    # Empty kernels in a chain: the launch floor, raw and in a CUDA graph (beside every row).
    floor = {"empty_kernel_stream_us": max(rt.exchange_latency(0, 200, False)),
             "empty_kernel_graph_us": max(rt.exchange_latency(0, 200, True))}
    copy_engines = copy_engine_times(sorted({COPY_ENGINE_PROGRAM[op] for op in ops if op in COPY_ENGINE_PROGRAM}),
                                     sizes, repeats)
    if "error" in copy_engines:
        print(f"no copy-engine figures: {copy_engines['error']}", flush=True)
    for op in ops:
        xla_op, jaxgin_op = implementations[op]
        for nbytes in sizes:
            if (op.startswith("put_wait") and nbytes > 64 << 20) or (op == "self_copy" and nbytes > 64 << 10):
                continue
            x = _array(mesh, nbytes, n)
            steps = chain_length(nbytes)

            xla_f = _chain_program(mesh, xla_op, steps, donate)
            ours_f = _chain_program(mesh, jaxgin_op, steps, donate)
            one_x, one_ours = _chain_program(mesh, xla_op, 1), _chain_program(mesh, jaxgin_op, 1)
            equal = bool(np.array_equal(np.asarray(one_x(x)), np.asarray(one_ours(x))))

            def timed(f):
                if donate:
                    return best_seconds_threaded(f, x.copy(), repeats=repeats) / steps
                return best_seconds(f, x, repeats=repeats) / steps

            t_xla = timed(xla_f)
            calls_before = handler_calls()
            t_ours = timed(ours_f)
            timed_calls = handler_calls() - calls_before
            calls_before = handler_calls()
            jax.block_until_ready(ours_f(x.copy() if donate else x))  # one more, after the timed runs
            steady_calls = handler_calls() - calls_before
            row = {
                "op": op,
                "bytes_per_device": nbytes,
                "chain": steps,
                "xla_us": t_xla * 1e6,
                "jaxgin_us": t_ours * 1e6,
                "speedup": t_xla / t_ours,
                "xla_GBps": nbytes / t_xla / 1e9,
                "jaxgin_GBps": nbytes / t_ours / 1e9,
                "equal": equal,
                # Host-side custom-call handler runs per op executed in one run after the timed
                # ones (0 when XLA replays a CUDA graph), and in the warm-up and timed runs together
                # less the steady ones (the runs in which XLA recorded its graphs).
                "handler_calls_per_op": steady_calls / (steps * n),
                "recording_calls_per_op": (timed_calls - steady_calls * (WARMUP_CALLS + repeats)) / (steps * n),
                **floor,
            }
            if nbytes <= DEVICE_CYCLE_MAX_BYTES and not donate:
                for side, f in (("xla", xla_f), ("jaxgin", ours_f)):
                    cycle, span = device_step_seconds(f, x, steps=steps)
                    row[f"{side}_device_span_us"] = span * 1e6
                    row[f"{side}_device_cycle_us"] = None if cycle is None else cycle * 1e6
                if row["xla_device_cycle_us"] and row["jaxgin_device_cycle_us"]:
                    row["device_cycle_speedup"] = row["xla_device_cycle_us"] / row["jaxgin_device_cycle_us"]
            if op == "ppermute" and nbytes <= 64 << 20:
                # The same ring exchange without XLA: kernel chain on raw streams and as a CUDA graph.
                row["kernel_stream_us"] = max(rt.exchange_latency(nbytes, 200, False))
                row["kernel_graph_us"] = max(rt.exchange_latency(nbytes, 200, True))
                if nbytes <= 8192:
                    # The generic exchange kernel on the same chain: what the line exchange saves.
                    row["generic_kernel_graph_us"] = max(rt.exchange_latency(nbytes, 200, True, generic_kernel=True))
            engines = copy_engines.get((COPY_ENGINE_PROGRAM.get(op), nbytes))
            if engines is not None:
                row["copy_engine_us"] = engines * 1e6
                row["jaxgin_vs_copy_engine"] = engines / t_ours
            results.append(row)
            print(
                f"{op:10s} {nbytes:>11d} B  xla {row['xla_us']:9.1f} us  jaxgin {row['jaxgin_us']:9.1f} us  "
                f"x{row['speedup']:6.2f}  {row['jaxgin_GBps']:7.1f} GB/s  {'ok' if equal else 'MISMATCH'}"
                f"  calls/op {row['handler_calls_per_op']:.2f}"
                + (f"  raw {row['kernel_stream_us']:.1f} / graph {row['kernel_graph_us']:.1f} us" if "kernel_graph_us" in row else "")
                + (f" (generic kernel {row['generic_kernel_graph_us']:.1f} us)" if "generic_kernel_graph_us" in row else "")
                + (f"  copy engines {row['copy_engine_us']:.1f} us" if "copy_engine_us" in row else "")
                + (f"  device cycle xla {row['xla_device_cycle_us']:.1f} / jaxgin {row['jaxgin_device_cycle_us']:.1f} us"
                   f" x{row['device_cycle_speedup']:.2f}" if "device_cycle_speedup" in row else ""),
                flush=True,
            )
    return {
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "jaxgin_info": {k: v for k, v in jaxgin.info().items() if k in ("nccl_version", "gin_type", "lsa_team_size", "channel",
                                                                     "command_buffer_compatible", "command_buffers")},
        "timing": "best of %d runs of one jitted chain of N ops, divided by N" % repeats
                  + (" (each run donating its input, the previous run's result)" if donate else ""),
        "device_cycle": "up to %d MiB, one more run of each chain profiled: GPU 0's span / N (device_span_us) and "
                        "the median time from one op's start to the next's (device_cycle_us): an op's steady "
                        "cost, without the run's fixed costs" % (DEVICE_CYCLE_MAX_BYTES >> 20),
        "donated": donate,
        "bytes_per_device": "size of each device's input buffer (all_to_all sends (n-1)/n of it to peers)",
        "copy_engine": "from %d MiB: XLA's ppermute (ring ops) or all_to_all moving the same bytes with %s (peer "
                       "copies on the copy engines), timed as the rows in a process of its own"
                       % (COPY_ENGINE_MIN_BYTES >> 20, COPY_ENGINE_FLAG),
        "copy_engine_error": copy_engines.get("error"),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--max-bytes", type=sizes.argument("--max-bytes", minimum=8), default=512 << 20,
                        help="largest message per device, e.g. 64KiB, 512MiB (default 512MiB)")
    parser.add_argument("--ops", default="ppermute,all_to_all,put_wait,put_wait_from")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--name", default="collectives", help="output file stem")
    parser.add_argument("--donate", action="store_true",
                        help="each timed run donates its input, the previous run's result: the same buffers every "
                             "run, so XLA replays its command buffers without updating them")
    parser.add_argument("--copy-engine-child", metavar="BYTES,...", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.copy_engine_child:
        for row in copy_engine_child(args.ops.split(","), [int(b) for b in args.copy_engine_child.split(",")],
                                     args.repeats):
            print(json.dumps(row), flush=True)
        return
    unknown = sorted(set(args.ops.split(",")) - set(OPS))
    if unknown:
        parser.error(f"--ops: unknown {', '.join(unknown)}; choose from {', '.join(OPS)}")
    cli.require_gpus(__file__, 2, "it times jaxgin's collectives against XLA's between them")
    cli.run(__file__, jaxgin.initialize, heap_size=os.environ.get("JAXGIN_BENCH_HEAP", "2GiB"))
    report = run(args.ops.split(","), args.max_bytes, args.repeats, args.donate)
    args.out.mkdir(parents=True, exist_ok=True)
    report["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    try:
        from plot import plot  # benchmarks/plot.py
    except ImportError:
        sys.path.insert(0, str(Path(__file__).parent))
        from plot import plot
    try:
        print(f"wrote {plot(path)}")
    except ImportError as e:
        print(f"no plot ({e}); run: python benchmarks/plot.py {path}")
    jaxgin.finalize()


if __name__ == "__main__":
    main()
