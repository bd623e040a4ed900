"""Fused matmul + communication (jaxgin.fused) vs XLA's unfused composition, same process, same data.

    python benchmarks/fused.py [--out DIR] [--dtype bfloat16] [--sweep 512,1024,2048,4096,8192]

Needs 2 or more NVIDIA GPUs visible to JAX in this process, 1 for --chunking-only, and Triton
(both from pip install -e ".[cuda]"); without them it says so and exits with status 4 (too few
GPUs) or 3 (a missing package), as every script here does (jaxgin.cli).

Per device and per shape (M x K x N, x [M, K] @ w [K, N]):
  xla_matmul            x @ w (cuBLAS through XLA)
  triton_matmul         the fused all_to_all's tile code alone (same tile configuration)
  xla_matmul_all_to_all jax.lax.all_to_all(x @ w, tiled) in one jit
  fused_all_to_all      jaxgin.fused.matmul_all_to_all (the default method, "auto": chunked or
                        unfused by the matmul's size; *_default_method says which ran and why)
  triton_all_to_all     the same op, method="triton"
and for all_gather_matmul (M = rows after the gather, each device holding M / devices):
  xla_all_gather_matmul jax.lax.all_gather(x, tiled) @ w in one jit
  fused_all_gather      jaxgin.fused.all_gather_matmul (the default method)
  triton_all_gather     the same op, method="triton"
  pallas_all_gather_matmul  JAX's Pallas Mosaic GPU collective matmul (all_gather_lhs_matmul), its
                        fastest right configuration of PALLAS_CONFIGS, or why it could not run;
                        also at its documented shape (1024 rows per shard, K = N = 4096); in a job
                        of one process per GPU of its own (--pallas-only is such a process), the
                        layout it runs in
and for matmul_reduce_scatter (each device: x [M, K] @ w [K, N], a partial product; result M / devices rows):
  xla_matmul_reduce_scatter jax.lax.psum_scatter(x @ w, tiled) in one jit
  fused_reduce_scatter      jaxgin.fused.matmul_reduce_scatter (the default method, "auto")
  triton_reduce_scatter     the same op, method="triton"

Beside them, XLA's own partitioning of the two tensor-parallel matmuls (jit with shardings, no
shard_map) with its windowed einsum on, on several streams (windowed_*) and on one
(windowed_one_stream_*), each in a process of its own since XLA reads its flags at start
(WINDOWED_EINSUM_FLAGS; --gspmd-only is that process):
  windowed_all_gather_matmul     x [M, K] sharded by rows @ w [K, N * devices] sharded by columns
  windowed_matmul_reduce_scatter x [M, K * devices] @ w [K * devices, N], both sharded along K,
                                 the result sharded by rows
A form whose result is wrong keeps its time, marked *_wrong_result, and gets no ratio; the ratios
take the fastest right one. The same programs under XLA's default flags (gspmd_default_*) are the
control for that check, never a baseline. --windowed-only runs these processes alone.

Timing: one jitted fori_loop of STEPS calls, each call's input depending on the previous output
(a one-element update of x, the same for every variant, so XLA can neither hoist nor overlap the
calls); best of REPEATS runs / STEPS. Results are checked against XLA's before timing. Writes
fused.json and fused.png (matplotlib, if installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxgin
from jaxgin import cli
from jaxgin.fused import _common
from timing import after, best_seconds, device_event_totals, device_windows_seconds

STEPS = 20
ISSUE_SHAPES = [(4096, 7168, 2048), (8192, 4096, 4096)]
# all_gather_matmul also at the shape JAX's Pallas collective matmul documents: 1024 rows per
# shard, K = N = 4096 (M below is the gathered rows: 1024 x devices).
PALLAS_DOCS_ROWS_PER_SHARD, PALLAS_DOCS_K, PALLAS_DOCS_N = 1024, 4096, 4096
# XLA's collective matmuls: all-gather + dot and dot + reduce-scatter decomposed into loops of
# collective-permutes overlapped with partial dots, whatever their size, on several streams or one
# (the multi-stream form gave wrong results on 4 x H100 with jax 0.11.2). Row keys' prefix -> flags.
WINDOWED_EINSUM_FLAGS = {
    "windowed": "--xla_gpu_threshold_for_windowed_einsum_mib=0 --xla_gpu_multi_streamed_windowed_einsum=true",
    "windowed_one_stream": "--xla_gpu_threshold_for_windowed_einsum_mib=0",
}
# The same programs under XLA's default flags (no windowed einsum): a control for the check that
# calls a windowed result wrong. Never a baseline (fastest_right_windowed reads the prefixes above).
GSPMD_CONTROL_FLAGS = {"gspmd_default": ""}


# (x, w, result) partition specs: x sharded by rows and w whole, or (reduce-scatter) both
# sharded along K and the result by rows.
ROWS = (P("x"), P(), P("x"))
K_SHARDED = (P(None, "x"), P("x", None), P("x"))


def _operands(mesh, keys, m: int, k: int, n: int, dtype, specs=ROWS):
    """Random x and w placed by `specs`: x [M * devices, K] by rows and w [K, N] whole (ROWS), or
    x [M, K * devices] and w [K * devices, N], both sharded along K (K_SHARDED)."""
    d = mesh.size
    x_shape, w_shape = ((d * m, k), (k, n)) if specs is ROWS else ((m, d * k), (d * k, n))
    return (jax.device_put(jax.random.normal(keys[0], x_shape, dtype), NamedSharding(mesh, specs[0])),
            jax.device_put(jax.random.normal(keys[1], w_shape, dtype), NamedSharding(mesh, specs[1])))


def xla_matmul_all_to_all(x, w):
    """XLA's unfused composition of matmul_all_to_all (split and concat by rows)."""
    return jax.lax.all_to_all(x @ w, "x", 0, 0, tiled=True)


def xla_all_gather_matmul(x, w):
    """XLA's unfused composition of all_gather_matmul (the shards gathered by rows, then one matmul)."""
    return jax.lax.all_gather(x, "x", tiled=True) @ w


def xla_matmul_reduce_scatter(x, w):
    """XLA's unfused composition of matmul_reduce_scatter (scattered by rows)."""
    return jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)


def _chain(mesh, op, specs=ROWS, check_vma=True):
    def body(x, w):
        def step(_, x):
            return after(x, op(x, w))  # call i + 1 waits for call i

        # Unrolled: a device-side loop would sync its predicate to the host every iteration and
        # leave the GPU idle for that time in every variant alike.
        return jax.lax.fori_loop(0, STEPS, step, x, unroll=True)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs[:2], out_specs=specs[0], check_vma=check_vma))


def _chain_times(mesh, op, args, specs, repeats: int) -> dict:
    """The chain of STEPS calls timed two ways, per call: `us` by the host's clock around the whole
    program (best of `repeats`, as every other row here); `device_us` as GPU 0's span from its first
    kernel to its last in one run (JAX's profiler), without the launch and the final wait that the
    host's clock adds once per run. `gpu_windows_us`: in that run, each GPU's first start and last
    end, in us from the earliest start (whole run, not per call): how much later each GPU began."""
    chain = _chain(mesh, op, specs)
    windows = device_windows_seconds(chain, *args)
    start, end = windows[min(windows)]
    return {"us": best_seconds(chain, *args, repeats=repeats) / STEPS * 1e6,
            "device_us": (end - start) / STEPS * 1e6,
            "gpu_windows_us": [[round(s * 1e6, 1), round(e * 1e6, 1)] for _, (s, e) in sorted(windows.items())]}


def _once(mesh, op, specs=ROWS, check_vma=True):
    return jax.jit(jax.shard_map(op, mesh=mesh, in_specs=specs[:2], out_specs=specs[2], check_vma=check_vma))


# A baseline whose result is further than this from float32's (relative to the largest value) is
# wrong, not imprecise: bf16 sums over K = 7168 stay below 0.006. Its time is kept, never a ratio.
WRONG_RESULT = 0.05


# JAX's own collective matmul (Pallas Mosaic GPU, f16 / bf16): a few of its tuning configurations
# (tile_m, tile_n, wg_dimension); the fastest right one is the baseline.
PALLAS_CONFIGS = ((128, 128, "M"), (128, 128, "N"), (256, 128, "N"), (128, 64, "M"))


def pallas_all_gather_matmul(mesh, xs, w, expected, repeats: int, rel=None) -> dict:
    """jax.experimental.pallas.ops.gpu.collective_matmul_mgpu.all_gather_lhs_matmul on the same
    operands as all_gather_matmul (x's rows sharded, w whole on every GPU): its fastest right
    configuration's time, or why it could not run (the import, the process layout, the dtype).
    `expected`: XLA's result, or a function that makes it; `rel`: how far a result is from it
    (default _rel, which reads whole arrays: one process)."""
    rel_to = rel or _rel
    try:
        from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as pallas_cm
    except Exception as e:  # noqa: BLE001 - an optional baseline: say why it is missing
        return {"pallas_all_gather_matmul_error": f"{type(e).__name__}: {e}"}
    best, errors = None, []
    for tile_m, tile_n, wg in PALLAS_CONFIGS:
        name = f"tile_m={tile_m},tile_n={tile_n},wg_dimension={wg}"
        try:
            config = pallas_cm.TuningConfig(tile_m=tile_m, tile_n=tile_n, tile_k=64, max_concurrent_steps=4,
                                            grid_tile_width=4, wg_dimension=pallas_cm.MatmulDimension[wg])

            def op(x, w, config=config):
                return pallas_cm.all_gather_lhs_matmul(x, w, "x", config=config, dtype=x.dtype)

            result = _once(mesh, op, check_vma=False)(xs, w)
            expected = expected() if callable(expected) else expected
            rel = rel_to(result, expected)
            if rel > WRONG_RESULT:
                errors.append(f"{name}: result {rel:.3g} of the largest value away from XLA's")
                continue
            us = best_seconds(_chain(mesh, op, check_vma=False), xs, w, repeats=repeats) / STEPS * 1e6
        except Exception as e:  # noqa: BLE001 - a configuration the kernel refuses (shared memory, layout)
            errors.append(f"{name}: {_why(e)}")
            continue
        if best is None or us < best["pallas_all_gather_matmul_us"]:
            best = {"pallas_all_gather_matmul_us": us, "pallas_all_gather_matmul_rel_err": rel,
                    "pallas_all_gather_matmul_config": name}
    return best or {"pallas_all_gather_matmul_error": "; ".join(errors)}


def _why(e: Exception) -> str:
    """An exception in a line: its type and message, or where it was raised when it has none."""
    import traceback

    if str(e):
        return f"{type(e).__name__}: {str(e)[:300]}"
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno} ({frame.line})"


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def measure(mesh, m: int, k: int, n: int, dtype, repeats: int, kinds, device_spans: bool = False) -> dict:
    """Every op of `kinds` and its XLA baseline, chained (_chain). `device_spans`: each also timed
    on the device (_chain_times), and the ratios again from those times (`*_device` keys)."""
    devices = mesh.size
    state = jaxgin.runtime.current()
    precision = _common.dot_precision(dtype, None)
    # triton_matmul: the tile code of the fused all_to_all (and reduce-scatter) alone, in those ops' configuration.
    tiles = _common.choose_tiles(state, m, n, k, dtype, precision, None, "wide_first")
    keys = jax.random.split(jax.random.key(m + k + n))
    x, w = _operands(mesh, keys, m, k, n, dtype)
    row = {"m": m, "k": k, "n": n, "dtype": np.dtype(dtype).name, "tiles": tiles.__dict__}

    def time_op(name, op, args, specs=ROWS):
        if device_spans:
            for key, value in _chain_times(mesh, op, args, specs, repeats).items():
                row[f"{name}_{key}"] = value
        else:
            row[f"{name}_us"] = best_seconds(_chain(mesh, op, specs), *args, repeats=repeats) / STEPS * 1e6

    # what the default method (auto) runs for each op timed here (fused_*), and why
    shapes = {"all_to_all": ("matmul_all_to_all", (m, k)), "all_gather": ("all_gather_matmul", (m // devices, k)),
              "reduce_scatter": ("matmul_reduce_scatter", (m, k))}
    for kind in kinds:
        op, x_shape = shapes[kind]
        row[f"{kind}_default_method"] = str(jaxgin.fused.explain(op, x_shape, (k, n), dtype, axis_size=devices))
    ops = {
        "xla_matmul": lambda x, w: x @ w,
        "triton_matmul": lambda x, w: _common.matmul(x, w, tiles, precision),
    }
    if "all_to_all" in kinds:
        ops["xla_matmul_all_to_all"] = xla_matmul_all_to_all
        ops["fused_all_to_all"] = lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x")
        ops["triton_all_to_all"] = lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", method="triton")
        expected = _once(mesh, ops["xla_matmul_all_to_all"])(x, w)
        row["all_to_all_rel_err"] = _rel(_once(mesh, ops["fused_all_to_all"])(x, w), expected)
        row["triton_all_to_all_rel_err"] = _rel(_once(mesh, ops["triton_all_to_all"])(x, w), expected)
    if "all_gather" in kinds and m % devices == 0:
        fused_ag = importlib.import_module("jaxgin.fused.all_gather_matmul")
        shard = (m // devices, k)
        xs = jax.device_put(jax.random.normal(keys[0], (m, k), dtype), NamedSharding(mesh, P("x")))
        gather_ops = {
            "xla_all_gather_matmul": xla_all_gather_matmul,
            "fused_all_gather": lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x"),
            "triton_all_gather": lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", method="triton"),
        }
        expected = _once(mesh, gather_ops["xla_all_gather_matmul"])(xs, w)
        row["all_gather_rel_err"] = _rel(_once(mesh, gather_ops["fused_all_gather"])(xs, w), expected)
        row["triton_all_gather_rel_err"] = _rel(_once(mesh, gather_ops["triton_all_gather"])(xs, w), expected)
        for name, op in gather_ops.items():
            time_op(name, op, (xs, w))
        row["all_gather_shard"] = list(shard)
        # the Triton kernel's tiles, as the op chose them (gather family, weighed by its senders)
        row["triton_all_gather_tiles"] = _common.choose_tiles(state, m, n, k, dtype, precision, None, "gather",
                                                              fused_ag.SENDERS).__dict__
    if "reduce_scatter" in kinds and m % devices == 0:
        xr, wr = _operands(mesh, keys, m, k, n, dtype, K_SHARDED)
        rs_ops = {
            "xla_matmul_reduce_scatter": xla_matmul_reduce_scatter,
            "fused_reduce_scatter": lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x"),
            "triton_reduce_scatter": lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x",
                                                                                      method="triton"),
        }
        expected = _once(mesh, rs_ops["xla_matmul_reduce_scatter"], K_SHARDED)(xr, wr)
        for name, prefix in (("fused_reduce_scatter", "reduce_scatter"), ("triton_reduce_scatter", "triton_reduce_scatter")):
            row[f"{prefix}_rel_err"] = _rel(_once(mesh, rs_ops[name], K_SHARDED)(xr, wr), expected)
        for name, op in rs_ops.items():
            time_op(name, op, (xr, wr), K_SHARDED)
    if "all_to_all" in kinds:
        # XLA's composition once more, after jaxgin's: where the default runs that very composition
        # (method "unfused"), the ratio of the two XLA timings is the run's own spread.
        ops["xla_matmul_all_to_all_again"] = xla_matmul_all_to_all
    for name, op in ops.items():
        time_op(name, op, (x, w))
    if "all_to_all" in kinds:
        row["xla_all_to_all_first_over_again"] = row["xla_matmul_all_to_all_us"] / row["xla_matmul_all_to_all_again_us"]
    flops = 2 * m * k * n
    row["xla_matmul_TFLOPs"] = flops / row["xla_matmul_us"] / 1e6
    row["triton_matmul_TFLOPs"] = flops / row["triton_matmul_us"] / 1e6
    row.update(_ratios(row, ""))
    if device_spans:
        row.update(_ratios(row, "_device"))
    print(json.dumps(row), flush=True)
    return row


def _ratios(row: dict, timing: str) -> dict:
    """measure()'s ratios from the times `{name}{timing}_us` ("" the chain per call by the host's
    clock, "_device" by GPU 0's span), named with `timing` appended; XLA's composition over jaxgin's."""
    t = lambda name: row[f"{name}{timing}_us"]  # noqa: E731
    out = {"triton_vs_xla_matmul": t("xla_matmul") / t("triton_matmul")}
    if "fused_all_to_all_us" in row:
        xla = min(t("xla_matmul_all_to_all"), t("xla_matmul_all_to_all_again"))  # XLA's better timing
        out.update(speedup_vs_unfused=xla / t("fused_all_to_all"),
                   fused_over_matmul=t("fused_all_to_all") / t("xla_matmul"),
                   triton_speedup_vs_unfused=xla / t("triton_all_to_all"))
    if "fused_all_gather_us" in row:
        out.update(all_gather_speedup=t("xla_all_gather_matmul") / t("fused_all_gather"),
                   triton_all_gather_speedup=t("xla_all_gather_matmul") / t("triton_all_gather"))
    if "fused_reduce_scatter_us" in row:
        out.update(reduce_scatter_speedup=t("xla_matmul_reduce_scatter") / t("fused_reduce_scatter"),
                   triton_reduce_scatter_speedup=t("xla_matmul_reduce_scatter") / t("triton_reduce_scatter"))
    return {f"{name}{timing}": value for name, value in out.items()}


def gspmd(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """The per-device shapes of measure()'s all_gather_matmul and matmul_reduce_scatter, written as
    XLA partitions them itself (global arrays with shardings), each checked against the shard_map
    composition: with WINDOWED_EINSUM_FLAGS that is XLA's windowed einsum."""
    devices = mesh.size
    sharded = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    keys = jax.random.split(jax.random.key(m + k + n))
    row = {"m": m, "k": k, "n": n, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    cases = {
        # x rows sharded (m / devices each) @ w columns sharded: the all_gather_matmul pattern
        "windowed_all_gather_matmul": ((m, k), sharded("x", None), (k, devices * n), sharded(None, "x"),
                                       sharded(None, "x")),
        # x and w sharded along K, the result by rows: the matmul_reduce_scatter pattern
        "windowed_matmul_reduce_scatter": ((m, devices * k), sharded(None, "x"), (devices * k, n),
                                           sharded("x", None), sharded("x", None)),
    }
    for name, (x_shape, x_sharding, w_shape, w_sharding, out_sharding) in cases.items():
        x = jax.device_put(jax.random.normal(keys[0], x_shape, dtype), x_sharding)
        w = jax.device_put(jax.random.normal(keys[1], w_shape, dtype), w_sharding)

        def chain(x, w, out_sharding=out_sharding, x_sharding=x_sharding):
            def step(_, x):
                y = jax.lax.with_sharding_constraint(x @ w, out_sharding)
                x = after(x, y)
                return jax.lax.with_sharding_constraint(x, x_sharding)

            return jax.lax.fori_loop(0, STEPS, step, x, unroll=True)

        once = jax.jit(lambda x, w, out_sharding=out_sharding: jax.lax.with_sharding_constraint(x @ w, out_sharding))
        row[f"{name}_rel_err"] = _rel(once(x, w), jnp.matmul(np.asarray(x, np.float32), np.asarray(w, np.float32)))
        row[f"{name}_us"] = best_seconds(jax.jit(chain), x, w, repeats=repeats) / STEPS * 1e6
        row[f"{name}_hlo_has_windowed_loop"] = "while" in once.lower(x, w).compile().as_text()
        if row[f"{name}_rel_err"] > WRONG_RESULT:
            row[f"{name}_wrong_result"] = True
            print(f"{name} at {m} x {k} x {n}: XLA's result is {row[f'{name}_rel_err']:.3g} of the largest value "
                  "away from float32's: no ratio against it", file=sys.stderr, flush=True)
    print(json.dumps(row), flush=True)
    return row


def all_gather_shapes(devices: int) -> list[tuple[int, int, int]]:
    """(M, K, N) of every all_gather_matmul row: the issue's shapes and the Pallas docs' one."""
    return ISSUE_SHAPES + [(PALLAS_DOCS_ROWS_PER_SHARD * devices, PALLAS_DOCS_K, PALLAS_DOCS_N)]


def pallas_job(args) -> None:
    """--pallas-only: this process's part of a job of one process per GPU (the layout JAX's Mosaic
    GPU collective matmul runs in): pallas_all_gather_matmul at all_gather_shapes, checked against
    XLA's all_gather then matmul; process 0 writes fused_pallas.json."""
    from jax.experimental import multihost_utils

    process, count, coordinator = args.pallas_only.split(",", 2)
    jax.distributed.initialize(coordinator, int(count), int(process))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    dtype = jnp.dtype(args.dtype)

    def rel(a, b) -> float:  # _rel over every process's shards
        ours = [np.abs(np.asarray(x.data, np.float64) - np.asarray(y.data, np.float64)).max()
                for x, y in zip(a.addressable_shards, b.addressable_shards)]
        scale = [np.abs(np.asarray(y.data, np.float64)).max() for y in b.addressable_shards]
        both = multihost_utils.process_allgather(np.array([max(ours), max(scale)]))
        return float(np.max(both[..., 0]) / max(np.max(both[..., 1]), 1e-30))

    rows = []
    for m, k, n in all_gather_shapes(mesh.size):
        rng = np.random.default_rng(m + k + n)  # the same operands in every process
        host_x, host_w = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        xs = jax.make_array_from_callback((m, k), NamedSharding(mesh, P("x")), lambda i: host_x[i])
        w = jax.make_array_from_callback((k, n), NamedSharding(mesh, P()), lambda i: host_w[i])
        expected = lambda xs=xs, w=w: _once(mesh, xla_all_gather_matmul)(xs, w)  # noqa: E731
        row = {"m": m, "k": k, "n": n, **pallas_all_gather_matmul(mesh, xs, w, expected, args.repeats, rel)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if jax.process_index() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_pallas.json").write_text(json.dumps({"processes": mesh.size, "shapes": rows}, indent=1))


def pallas_in_own_processes(args, gpus: int, timeout: float = 900) -> dict[tuple[int, int, int], dict]:
    """pallas_job in `gpus` processes, one GPU each, before this process holds the GPUs: its row
    keys per (M, K, N) of all_gather_shapes, or for every shape why the job could not run."""
    import socket
    import subprocess

    out = args.out / "pallas"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [g for g in named.split(",") if g.strip()] if named else [str(g) for g in range(gpus)]
    procs = [subprocess.Popen([sys.executable, __file__, "--pallas-only", f"{i},{gpus},127.0.0.1:{port}",
                               "--out", str(out), "--dtype", args.dtype, "--repeats", str(args.repeats)],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": visible[i]}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(gpus)]
    try:
        ended = [p.communicate(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        ended = [p.communicate() for p in procs]
    summary = out / "fused_pallas.json"
    if all(p.returncode == 0 for p in procs) and summary.is_file():
        return {(r["m"], r["k"], r["n"]): {k: v for k, v in r.items() if k not in ("m", "k", "n")}
                for r in json.loads(summary.read_text())["shapes"]}
    failed = next(i for i, p in enumerate(procs) if p.returncode != 0) if any(p.returncode for p in procs) else 0
    why = (f"the job of one process per GPU failed (exit codes {[p.returncode for p in procs]}); process "
           f"{failed}: {ended[failed][1].strip()[-600:]}")
    return {shape: {"pallas_all_gather_matmul_error": why} for shape in all_gather_shapes(gpus)}


def gspmd_in_own_processes(args) -> list[dict]:
    """gspmd() at the issue's shapes under each of WINDOWED_EINSUM_FLAGS and GSPMD_CONTROL_FLAGS, each
    in a child process (XLA reads its flags once; before this process holds the GPUs), merged per
    shape with the keys' "windowed" replaced by the flags' prefix."""
    import subprocess

    merged = [{} for _ in ISSUE_SHAPES]
    for prefix, flags in {**WINDOWED_EINSUM_FLAGS, **GSPMD_CONTROL_FLAGS}.items():
        out = args.out / f"gspmd_{prefix}"
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()}
        subprocess.run([sys.executable, __file__, "--gspmd-only", "--out", str(out), "--dtype", args.dtype,
                        "--repeats", str(args.repeats)], env=env, check=True)
        for row, found in zip(merged, json.loads((out / "fused_gspmd.json").read_text())["shapes"]):
            row.update({prefix + key[len("windowed"):]: value for key, value in found.items()
                        if key.startswith("windowed")})
    return merged


def fastest_right_windowed(row: dict, op: str) -> float | None:
    """The fastest of XLA's windowed-einsum forms of `op` ("all_gather_matmul",
    "matmul_reduce_scatter") in `row` whose result was right; None if none was."""
    times = [row[f"{prefix}_{op}_us"] for prefix in WINDOWED_EINSUM_FLAGS
             if f"{prefix}_{op}_us" in row and not row.get(f"{prefix}_{op}_wrong_result")]
    return min(times, default=None)


def breakdown(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """Where matmul_all_to_all's time goes: the same kernel with parts of the exchange switched
    off (results are then wrong; only the timing is of interest)."""
    fused_a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")  # the module, not the function
    state = jaxgin.runtime.current()
    x, w = _operands(mesh, jax.random.split(jax.random.key(1)), m, k, n, dtype)
    names = {0: "matmul only (same kernel)", 1: "+ remote tile stores", 3: "+ flags", 7: "+ copy-out (the op)"}
    row = {"m": m, "k": k, "n": n}
    for parts, name in names.items():
        def op(x, w, parts=parts):
            plan = fused_a2a._Plan(("x",), mesh.size, x.shape[0], w.shape[1], x.shape[1], True, True, None, None,
                                   "triton")
            return fused_a2a._kernel(state, x, w, plan, parts)

        row[name] = best_seconds(_chain(mesh, op), x, w, repeats=repeats) / STEPS * 1e6
    print(json.dumps(row), flush=True)
    return row


CHUNKS = (1, 2, 4, 8)


def chunking(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """What splitting a matmul into row chunks costs, the communication aside: method="chunked"
    multiplies M / P rows per peer, one cuBLAS call each. Per chunk count c: one M / c-row matmul
    (cuBLAS through XLA, and the Triton tile code with its own tuned tiles) times c, over the
    whole M-row matmul; consecutive calls on one stream neither overlap nor wait on each other."""
    row = {"m": m, "k": k, "n": n, "chunks": {}}
    for c in CHUNKS:
        if m % c:
            continue
        one = measure(mesh, m // c, k, n, dtype, repeats, ())
        row["chunks"][c] = {"rows": m // c, "xla_matmul_us": one["xla_matmul_us"] * c,
                            "triton_matmul_us": one["triton_matmul_us"] * c, "tiles": one["tiles"]}
    whole = row["chunks"][1]
    for c, r in row["chunks"].items():
        r["xla_over_whole"] = r["xla_matmul_us"] / whole["xla_matmul_us"]
        r["triton_over_xla_whole"] = r["triton_matmul_us"] / whole["xla_matmul_us"]
    print(json.dumps(row), flush=True)
    return row


VARIANT_TILES = (
    _common.TileConfig(128, 256, 64, 8, 8, 4),  # one program per SM (192 KiB of pipeline buffers)
    _common.TileConfig(128, 128, 64, 8, 8, 3),  # two per SM: one computes while the other stores
    _common.TileConfig(128, 128, 64, 8, 4, 3),
)
# name: matmul_all_to_all._kernel's layout arguments
VARIANT_LAYOUTS = {
    "push": dict(interleave=False, pull=False), "push interleaved": dict(interleave=True, pull=False),
    "pull": dict(interleave=False, pull=True), "pull interleaved": dict(interleave=True, pull=True),
    "pull, copy in the K loop": dict(interleave=False, pull=True, copy_slabs=32),
    "pull interleaved, 4 movers": dict(interleave=True, pull=True, movers=4),
}


def variants(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """matmul_all_to_all's kernel under each tile configuration and exchange layout (program order,
    push or pull; see _kernels.matmul_all_to_all_kernel), each checked against XLA, next to the
    same kernel's matmul alone and XLA's unfused composition."""
    fused_a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    state = jaxgin.runtime.current()
    x, w = _operands(mesh, jax.random.split(jax.random.key(2)), m, k, n, dtype)
    expected = _once(mesh, xla_matmul_all_to_all)(x, w)
    row = {"m": m, "k": k, "n": n,
           "xla_matmul_all_to_all_us": best_seconds(_chain(mesh, xla_matmul_all_to_all), x, w, repeats=repeats) / STEPS * 1e6,
           "xla_matmul_us": best_seconds(_chain(mesh, lambda x, w: x @ w), x, w, repeats=repeats) / STEPS * 1e6, "tiles": {}}
    for tiles in VARIANT_TILES:
        plan = fused_a2a._Plan(("x",), mesh.size, m, n, k, True, True, None, tiles, "triton")
        times = {}

        def matmul_only(x, w, plan=plan):
            return fused_a2a._kernel(state, x, w, plan, 0)

        times["matmul only"] = best_seconds(_chain(mesh, matmul_only), x, w, repeats=repeats) / STEPS * 1e6
        for name, layout in VARIANT_LAYOUTS.items():
            def op(x, w, plan=plan, layout=layout):
                return fused_a2a._kernel(state, x, w, plan, 7, **layout)

            rel = _rel(_once(mesh, op)(x, w), expected)
            t = best_seconds(_chain(mesh, op), x, w, repeats=repeats) / STEPS * 1e6
            times[name] = {"us": t, "rel_err": rel, "speedup_vs_unfused": row["xla_matmul_all_to_all_us"] / t}
        row["tiles"][str(dataclasses.astuple(tiles))] = times
        print(json.dumps({"m": m, "tiles": dataclasses.astuple(tiles), **times}), flush=True)
    row["reduce_scatter"] = reduce_scatter_variants(mesh, m, k, n, dtype, repeats)
    return row


# all_gather_matmul's Triton kernel: programs that push the shard, and tile configurations.
GATHER_SENDERS = (16, 32, 64)
WIDE_TILES = _common.TileConfig(128, 256, 64, 8, 8, 4)  # one program per SM
GATHER_TILES = (
    _common.TileConfig(128, 128, 64, 8, 8, 3),  # two programs per SM
    WIDE_TILES,  # senders have SMs to themselves
)


def _gather_operands(mesh, seed: int, m: int, k: int, n: int, dtype):
    """all_gather_matmul's operands as measure() lays them out: x [M, K] sharded by rows (M / devices
    each), w [K, N] whole on every GPU."""
    keys = jax.random.split(jax.random.key(seed))
    return (jax.device_put(jax.random.normal(keys[0], (m, k), dtype), NamedSharding(mesh, P("x"))),
            jax.device_put(jax.random.normal(keys[1], (k, n), dtype), NamedSharding(mesh, P())))


def gather_variants(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """all_gather_matmul's Triton kernel (M gathered rows, M / devices per device) under each count
    of sending programs and tile configuration, each checked against XLA's all_gather then matmul,
    next to that composition, the default method and the Triton tile code alone on the gathered
    rows."""
    fused_ag = importlib.import_module("jaxgin.fused.all_gather_matmul")
    state = jaxgin.runtime.current()
    xs, w = _gather_operands(mesh, 4, m, k, n, dtype)
    expected = _once(mesh, xla_all_gather_matmul)(xs, w)
    fused = lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x")  # noqa: E731
    row = {"m": m, "k": k, "n": n, "shard": [m // mesh.size, k],
           "xla_all_gather_matmul_us": best_seconds(_chain(mesh, xla_all_gather_matmul), xs, w,
                                                    repeats=repeats) / STEPS * 1e6,
           "fused_all_gather_us": best_seconds(_chain(mesh, fused), xs, w, repeats=repeats) / STEPS * 1e6,
           "tiles": {}}
    precision = _common.dot_precision(dtype, None)
    whole, _ = _operands(mesh, jax.random.split(jax.random.key(4)), m, k, n, dtype)  # [M, K] on every device
    for tiles in GATHER_TILES:
        def tile_code(x, w, tiles=tiles):
            return _common.matmul(x, w, tiles, precision)

        times = {"tile code alone, gathered rows": best_seconds(_chain(mesh, tile_code), whole, w,
                                                                repeats=repeats) / STEPS * 1e6}
        for senders in GATHER_SENDERS:
            plan = fused_ag._Plan(("x",), mesh.size, m // mesh.size, n, k, None, tiles, "triton")

            def op(x, w, plan=plan, senders=senders):
                return fused_ag._triton(state, x, w, plan, False, senders)

            rel = _rel(_once(mesh, op)(xs, w), expected)
            t = best_seconds(_chain(mesh, op), xs, w, repeats=repeats) / STEPS * 1e6
            times[f"senders={senders}"] = {"us": t, "rel_err": rel,
                                           "speedup_vs_unfused": row["xla_all_gather_matmul_us"] / t}
        row["tiles"][str(dataclasses.astuple(tiles))] = times
        print(json.dumps({"m": m, "tiles": dataclasses.astuple(tiles), **times}), flush=True)
    return row


def _spread_from(t0):
    """For traced records: a function giving the min, median and max of ns timestamps, in us from t0."""
    def spread(values):
        values = (np.asarray(values) - t0) / 1e3
        return {"min": round(float(values.min()), 1), "median": round(float(np.median(values)), 1),
                "max": round(float(values.max()), 1)} if len(values) else {}

    return spread


def _median_us(durations) -> float | None:
    """The median of ns durations, in us."""
    return round(float(np.median(durations)) / 1e3, 1) if len(durations) else None


def _traced_records(mesh, call, args, in_specs, repeats: int) -> np.ndarray:
    """Every GPU's program records [GPUs, programs, 8] (int64) from the last of a few calls of a
    traced kernel's `call` (returning (out, trace)), so it ran compiled with its buffers touched."""
    traced = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=(P("x"), P("x"))))
    for _ in range(max(repeats, 2)):
        _, trace = traced(*args)
    return np.asarray(trace).reshape(mesh.size, -1, 16).view(np.int64)


def _trace_summary(records: np.ndarray, shards: int) -> dict:
    """One GPU's records of a traced all_gather_matmul call (_kernels._trace_program: start, tile,
    waits ended, end, SM per program) over `shards` sources, in us from the first program's start."""
    start, tile, waited, end, sm = (records[:, i] for i in range(5))
    t0 = start.min()
    us = _spread_from(t0)
    senders, tiles = tile < 0, tile >= 0
    per_shard = (tile[tiles].max() + 1) // shards if tiles.any() else 0  # own shard's tiles first
    own, peer = tiles & (tile < per_shard), tiles & (tile >= per_shard)
    return {
        "span_us": round(float((end.max() - t0) / 1e3), 1),
        "senders_done_us": us(waited[senders]),
        "own_tiles_start_us": us(start[own]), "own_tiles_end_us": us(end[own]),
        "peer_tiles_start_us": us(start[peer]), "peer_tiles_waits_end_us": us(waited[peer]),
        "peer_tiles_end_us": us(end[peer]),
        "tile_compute_us_median": _median_us(end[tiles] - waited[tiles]),
        "peer_tile_wait_us_median": _median_us(waited[peer] - start[peer]),
        **_sm_occupancy(start, end, sm),
    }


def _sm_occupancy(start, end, sm) -> dict:
    """The most programs one SM ran at once, and how many SMs ran any, from per-program records."""
    events = sorted([(t, 1, m) for t, m in zip(start, sm)] + [(t, -1, m) for t, m in zip(end, sm)])
    running, most = {}, 0
    for _, step, m in events:
        running[m] = running.get(m, 0) + step
        most = max(most, running[m])
    return {"most_programs_at_once_on_one_sm": most, "sms_used": int(len(set(sm.tolist())))}


def gather_trace(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """all_gather_matmul's Triton kernel with a record per program (start, waits ended, end, SM;
    _kernels.all_gather_matmul_traced_kernel) from one call after warm-up, per tile configuration:
    when the senders finish, when the peer's tiles can start, how long a tile computes, how many
    programs share an SM. The raw records of GPU 0 are kept."""
    fused_ag = importlib.import_module("jaxgin.fused.all_gather_matmul")
    state = jaxgin.runtime.current()
    xs, w = _gather_operands(mesh, 5, m, k, n, dtype)
    row = {"m": m, "k": k, "n": n, "shard": [m // mesh.size, k], "tiles": {}}
    for tiles in GATHER_TILES:
        plan = fused_ag._Plan(("x",), mesh.size, m // mesh.size, n, k, None, tiles, "triton")
        per_gpu = _traced_records(mesh, lambda x, w, plan=plan: fused_ag._triton(state, x, w, plan, False, trace=True),
                                  (xs, w), (P("x"), P()), repeats)
        key = str(dataclasses.astuple(tiles))
        row["tiles"][key] = {"gpus": [_trace_summary(g, mesh.size) for g in per_gpu],
                             "gpu0_records": per_gpu[0, :, :5].tolist()}
        print(json.dumps({"m": m, "tiles": dataclasses.astuple(tiles), **row["tiles"][key]["gpus"][0]}), flush=True)

        def chain(x, w, plan=plan):  # as _chain times the op, keeping every call's records
            records = []
            for _ in range(STEPS):
                out, trace = fused_ag._triton(state, x, w, plan, False, trace=True)
                x = after(x, out)
                records.append(trace)
            return x, jnp.stack(records)

        chained = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=(P("x"), P()), out_specs=(P("x"), P("x"))))
        for _ in range(max(repeats, 2)):
            _, traces = chained(xs, w)
        calls = np.asarray(traces).reshape(mesh.size, STEPS, -1, 16).view(np.int64)  # [GPUs, calls, programs, 8]
        row["tiles"][key]["chained"] = {"gpus": [_chain_summary(g) for g in calls],
                                        # the same chain timed as every other row here (host clock, whole jit)
                                        "timed_per_call_us": round(best_seconds(chained, xs, w, repeats=repeats)
                                                                   / STEPS * 1e6, 1),
                                        "call_starts_gpu1_minus_gpu0_us": [
                                            round(float(d) / 1e3, 1)
                                            for d in (calls[-1, :, :, 0].min(1) - calls[0, :, :, 0].min(1))]}
        print(json.dumps({"m": m, "tiles": dataclasses.astuple(tiles), "chained": row["tiles"][key]["chained"]}),
              flush=True)
    return row


def _chain_summary(calls: np.ndarray) -> dict:
    """One GPU's records of consecutive traced calls [calls, programs, 8]: each call's span (first
    program's start to last program's end) and the gap before the next call's first program, in us."""
    start, end = calls[:, :, 0].min(1), calls[:, :, 3].max(1)
    spans, gaps = (end - start) / 1e3, (start[1:] - end[:-1]) / 1e3
    med = lambda v: round(float(np.median(v)), 1)  # noqa: E731
    return {"calls": len(calls), "span_us_median": med(spans), "gap_us_median": med(gaps),
            "gap_us_max": round(float(gaps.max()), 1), "per_call_us": med(np.diff(start) / 1e3),
            "spans_us": [round(float(s), 1) for s in spans], "gaps_us": [round(float(g), 1) for g in gaps]}


# matmul_reduce_scatter's reducers: tiles of slack behind the partials they wait for (LAG; "all"
# puts every reducer after every partial) and whether one waits for every source before loading.
REDUCER_LAGS = (0, 2, 8, 32, "all")


def reduce_scatter_variants(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """matmul_reduce_scatter's kernel under each reducer placement and order, each checked against
    the reference's reduction order, next to XLA's matmul then psum_scatter."""
    fused_rs = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    state = jaxgin.runtime.current()
    x, w = _operands(mesh, jax.random.split(jax.random.key(3)), m, k, n, dtype, K_SHARDED)
    plan = fused_rs._Plan(("x",), mesh.size, m, n, k, True, None, None, "triton")
    expected = _once(mesh, lambda x, w: fused_rs.reference(x, w, plan), K_SHARDED)(x, w)
    row = {"xla_matmul_reduce_scatter_us": best_seconds(_chain(mesh, xla_matmul_reduce_scatter, K_SHARDED), x, w,
                                                        repeats=repeats) / STEPS * 1e6, "layouts": {}}
    # each layout: its plan and its arguments to the op's _kernel
    layouts = {f"lag={lag}{', wait first' if wait_first else ''}":
               (plan, dict(lag=1 << 30 if lag == "all" else lag, wait_first=wait_first, fold=False))
               for lag in REDUCER_LAGS for wait_first in (False, True)}
    layouts["folded"] = (plan, dict(fold=True))  # no reducer programs, the op's default: the own chunk's programs sum
    layouts["folded, push"] = (plan, dict(fold=True, push=True))  # partials stored into their owner's buffer
    # the folded kernel on 128 x 256 tiles, one program per SM (matmul_all_to_all's fastest)
    layouts["folded, 128 x 256"] = (dataclasses.replace(plan, tiles=WIDE_TILES), dict(fold=True))
    # the cuBLAS-per-chunk method, for scale (its layouts: chunked_layouts)
    layouts["chunked"] = (dataclasses.replace(plan, method="chunked"), {})
    for name, (layout_plan, kwargs) in layouts.items():
        def op(x, w, layout_plan=layout_plan, kwargs=kwargs):
            return fused_rs._kernel(state, x, w, layout_plan, **kwargs)

        rel = _rel(_once(mesh, op, K_SHARDED)(x, w), expected)
        t = best_seconds(_chain(mesh, op, K_SHARDED), x, w, repeats=repeats) / STEPS * 1e6
        row["layouts"][name] = {"us": t, "rel_err": rel, "speedup_vs_unfused": row["xla_matmul_reduce_scatter_us"] / t}
        print(json.dumps({"m": m, "reduce_scatter": name, **row["layouts"][name]}), flush=True)
    return row


def _reduce_scatter_trace_summary(records: np.ndarray, shards: int) -> dict:
    """One GPU's records of a traced folded matmul_reduce_scatter call (_kernels._matmul_reduce_scatter's
    TRACE: start, place, waits ended, end, SM, matmul ended), in us from the first program's start.
    Programs of the peers' chunks compute, store and flag; those of the own chunk compute, store,
    wait for the peers' partials of their tile and sum them (their `reduce` includes the loads)."""
    start, place, waited, end, sm, computed = (records[:, i] for i in range(6))
    t0 = start.min()
    us = _spread_from(t0)
    own = place % shards == shards - 1
    peers = ~own
    return {
        "span_us": round(float((end.max() - t0) / 1e3), 1),
        "peer_chunks": {"start_us": us(start[peers]), "end_us": us(end[peers]),
                        "matmul_us_median": _median_us(computed[peers] - start[peers]),
                        "store_and_flag_us_median": _median_us(waited[peers] - computed[peers])},
        "own_chunk": {"start_us": us(start[own]), "end_us": us(end[own]),
                      "matmul_us_median": _median_us(computed[own] - start[own]),
                      "store_and_wait_us_median": _median_us(waited[own] - computed[own]),
                      "reduce_us_median": _median_us(end[own] - waited[own])},
        **_sm_occupancy(start, end, sm),
    }


def reduce_scatter_trace(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """matmul_reduce_scatter's folded Triton kernel (the default), its partials pulled and pushed,
    with a record per program (_kernels.matmul_reduce_scatter_traced_kernel) from one call after
    warm-up: how long the matmul, the stores and flags, the waits for peers' partials and the sums
    take, and when each kind of program ends. The raw records of GPU 0 are kept."""
    fused_rs = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    state = jaxgin.runtime.current()
    x, w = _operands(mesh, jax.random.split(jax.random.key(3)), m, k, n, dtype, K_SHARDED)
    plan = fused_rs._Plan(("x",), mesh.size, m, n, k, True, None, None, "triton")
    row = {"m": m, "k": k, "n": n, "layouts": {}}
    for name, push in (("folded", False), ("folded, push", True)):
        def call(x, w, push=push):
            return fused_rs._triton(state, x, w, plan, False, 0, False, fold=True, push=push, trace=True)

        per_gpu = _traced_records(mesh, call, (x, w), K_SHARDED[:2], repeats)
        row["layouts"][name] = {"gpus": [_reduce_scatter_trace_summary(g, mesh.size) for g in per_gpu],
                                "gpu0_records": per_gpu[0, :, :6].tolist()}
        print(json.dumps({"m": m, "reduce_scatter": name, **row["layouts"][name]["gpus"][0]}), flush=True)
    return row


def _all_to_all_trace_summary(records: np.ndarray, shards: int, interleave: bool = True) -> dict:
    """One GPU's records of a traced matmul_all_to_all call (_kernels._matmul_all_to_all's TRACE:
    start, place, waits ended, end, SM, matmul ended, stored), in us from the first program's start.
    The op's programs are tile-major (place = tile * shards + step; without `interleave` step-major,
    place = step * tiles + tile): step `shards - 1` computes a tile of this GPU's own chunk, the
    others a tile for a peer (stored here and flagged: the peer pulls it); every step after the
    first then waits for the arrival of its tile from a peer and copies it out (`copy` includes the
    load over NVLink; a copy folded into the K loop shows no wait and is in `matmul`; one that a
    mover made shows neither, and the movers' records, at negative places, say when they ended)."""
    t0 = records[:, 0].min()
    us = _spread_from(t0)
    moving = records[:, 1] < 0  # movers (MOVERS) hold negative places
    movers = {"movers": {"count": int(moving.sum()), "end_us": us(records[moving, 3])}} if moving.any() else {}
    records = records[~moving]
    start, place, waited, end, sm, computed, stored = (records[:, i] for i in range(7))
    step = place % shards if interleave else place // (len(records) // shards)
    own, sending, copying = step == shards - 1, step != shards - 1, step > 0
    return {
        "span_us": round(float((end.max() - t0) / 1e3), 1),
        "matmul_us_median": _median_us(computed - start),
        "sending": {"end_us": us(end[sending]), "store_and_flag_us_median": _median_us(stored[sending] - computed[sending])},
        "own_chunk": {"end_us": us(end[own]), "store_us_median": _median_us(stored[own] - computed[own])},
        "copy_out": {"wait_us_median": _median_us(waited[copying] - stored[copying]),
                     "copy_us_median": _median_us(end[copying] - waited[copying]), "end_us": us(end[copying])},
        **_sm_occupancy(start, end, sm),
        **movers,
    }


# How many row slabs the traced step-order kernel splits a folded copy-out into: fewer slabs are
# loaded more K steps before they are stored.
TRACE_COPY_SLABS = (4, 8, 16, 32)
# How many mover programs copy the arrivals of every wave but the last (MOVERS): one SM pushes
# about 38 GB/s to a peer, and the arrivals need 51-88 GB/s spread over the matmul.
TRACE_MOVERS = (2, 4, 8)


def all_to_all_trace(mesh, m: int, k: int, n: int, dtype, repeats: int) -> dict:
    """matmul_all_to_all's Triton kernel (the op's layout) with a record per program
    (_kernels.matmul_all_to_all_traced_kernel) from one call after warm-up, per part of the
    exchange switched on (PARTS, as the breakdown), pulled (the op) and pushed: how long the
    matmul, the stores and flags, the waits for arrivals and the copies out take; and the whole
    exchange with movers copying the arrivals of every wave but the last (MOVERS), and in step
    order, plain and with each copy-out folded into its program's K loop where its arrival is
    ready (COPY_SLABS). The raw records of GPU 0 are kept."""
    fused_a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    state = jaxgin.runtime.current()
    x, w = _operands(mesh, jax.random.split(jax.random.key(m + k + n)), m, k, n, dtype)
    plan = fused_a2a._Plan(("x",), mesh.size, m, n, k, True, True, None, None, "triton")
    row = {"m": m, "k": k, "n": n, "parts": {}}
    op, push, step_order = dict(interleave=True, pull=True), dict(interleave=True, pull=False), \
        dict(interleave=False, pull=True)
    layouts = [("matmul only", 0, op), ("+ remote tile stores", 1, op), ("+ flags", 3, op), ("the op", 7, op),
               *((f"the op, {n} movers", 7, dict(op, movers=n)) for n in TRACE_MOVERS),
               ("push: + remote tile stores", 1, push), ("push: + flags", 3, push), ("push: all parts", 7, push),
               ("step order", 7, step_order),
               *((f"step order, copy in the K loop in {n} slabs", 7, dict(step_order, copy_slabs=n))
                 for n in TRACE_COPY_SLABS)]
    for name, parts, layout in layouts:
        def call(x, w, parts=parts, layout=layout):
            return fused_a2a._triton(state, x, w, plan, False, parts, trace=True, **layout)

        per_gpu = _traced_records(mesh, call, (x, w), (P("x"), P()), repeats)
        row["parts"][name] = {"gpus": [_all_to_all_trace_summary(g, mesh.size, layout["interleave"]) for g in per_gpu],
                              "gpu0_records": per_gpu[0, :, :7].tolist()}
        print(json.dumps({"m": m, "all_to_all": name, **row["parts"][name]["gpus"][0]}), flush=True)
    return row


# The chunked method's layouts (how the peers' chunks are split into cuBLAS calls) with the ops
# each shape times: matmul_all_to_all over the sweep (K = 7168, N = 2048; the default is below
# XLA's composition up to M = 2048), all three at the issue's shapes, all_gather_matmul at the
# Pallas docs' shape.
LAYOUT_OPS = ("all_to_all", "all_gather", "reduce_scatter")
CHUNKED_LAYOUT_SHAPES = [
    *(((m, 7168, 2048), ("all_to_all",)) for m in (512, 1024, 2048)),
    *((shape, LAYOUT_OPS) for shape in ISSUE_SHAPES),
    ((8192, 7168, 2048), ("all_to_all",)),
    ((PALLAS_DOCS_ROWS_PER_SHARD, PALLAS_DOCS_K, PALLAS_DOCS_N), ("all_gather",)),
]


def chunked_layouts(mesh, m: int, k: int, n: int, dtype, repeats: int, ops=LAYOUT_OPS, layouts=None,
                    device_spans: bool = False, tiles=None) -> dict:
    """The chunked ops named by `ops` (method="chunked") under each chunk layout (`layouts`, default
    jaxgin.fused._chunked.LAYOUTS; the ops use the first; all_gather_matmul has no "triton_tiles"),
    each checked against XLA, next to XLA's unfused compositions and its matmul alone; with
    `device_spans`, every chain also timed on the device (_chain_times) with GPU 0's kernels and
    copies per call by name (`events`: count and us per call); `tiles`, the "triton_tiles" layout's
    TileConfig (default: the ops' tuned choice). Also
    matmul alone. M rows per device: x [M, K] by rows for matmul_all_to_all, a shard of M rows for
    all_gather_matmul (M * devices gathered), x [M, K] per device sharded along K for
    matmul_reduce_scatter. Where matmul_reduce_scatter's time goes: the exchange of partials alone
    and XLA's sum of them alone."""
    from jaxgin.fused import _chunked

    fused_a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    fused_ag = importlib.import_module("jaxgin.fused.all_gather_matmul")
    fused_rs = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    state = jaxgin.runtime.current()
    devices = mesh.size
    keys = jax.random.split(jax.random.key(m + k + n))
    x, w = _operands(mesh, keys, m, k, n, dtype)
    xr, wr = _operands(mesh, keys, m, k, n, dtype, K_SHARDED)
    a2a_plan = fused_a2a._Plan(("x",), devices, m, n, k, True, True, None, tiles, "chunked")
    ag_plan = fused_ag._Plan(("x",), devices, m, n, k, None, None, "chunked")
    rs_plan = fused_rs._Plan(("x",), devices, m, n, k, True, None, tiles, "chunked")

    def timed(op, a, b, specs=ROWS, into=None):
        if device_spans and into is not None:
            into.update(_chain_times(mesh, op, (a, b), specs, repeats))
            events, timeline = device_event_totals(_chain(mesh, op, specs), a, b)
            into["events"] = {name[:80]: {"count": e["count"] / STEPS, "us": e["seconds"] / STEPS * 1e6}
                              for name, e in sorted(events.items(), key=lambda item: -item[1]["seconds"])}
            into["timeline"] = [[name[:40], *rest] for name, *rest in timeline]  # GPU 0's run of STEPS calls
            return into["us"]
        return best_seconds(_chain(mesh, op, specs), a, b, repeats=repeats) / STEPS * 1e6

    compositions = {"all_to_all": (xla_matmul_all_to_all, x, w, ROWS), "all_gather": (xla_all_gather_matmul, x, w, ROWS),
                    "reduce_scatter": (xla_matmul_reduce_scatter, xr, wr, K_SHARDED)}
    row = {"m": m, "k": k, "n": n}
    if _chunked.TRITON_TILES in (layouts or _chunked.LAYOUTS):  # the Triton layout's tiles (the ops' tuned choice)
        row["triton_tiles"] = _common.choose_tiles(state, m, n, k, dtype, _common.dot_precision(dtype, None), tiles,
                                                   "wide_first").__dict__

    def device_times(name):  # where a baseline's device times go (with device_spans)
        return row.setdefault(name, {}) if device_spans else None

    row["xla_matmul_us"] = timed(lambda x, w: x @ w, x, w, into=device_times("xla_matmul"))
    expected = {}
    for op in ops:
        fn, a, b, specs = compositions[op]
        row[f"xla_{XLA_NAMES[op]}_us"] = timed(fn, a, b, specs, into=device_times(f"xla_{XLA_NAMES[op]}"))
        expected[op] = _once(mesh, fn, specs)(a, b)
        row[op] = {}

    def record(op, layout, fn, a, b, specs=ROWS):
        times = {}
        t = timed(fn, a, b, specs, into=times)
        row[op][layout] = {"us": t, "rel_err": _rel(_once(mesh, fn, specs)(a, b), expected[op]),
                           "speedup_vs_unfused": row[f"xla_{XLA_NAMES[op]}_us"] / t, **times}
        if device_spans:
            row[op][layout]["device_speedup_vs_unfused"] = row[f"xla_{XLA_NAMES[op]}"]["device_us"] / times["device_us"]

    rs = "reduce_scatter" in ops and m % devices == 0
    for layout in layouts or _chunked.LAYOUTS:
        if "all_to_all" in ops:
            record("all_to_all", layout,
                   lambda x, w, layout=layout: fused_a2a._kernel(state, x, w, a2a_plan, chunk_layout=layout), x, w)
        if "all_gather" in ops and layout in _chunked.CUBLAS_LAYOUTS:
            record("all_gather", layout,
                   lambda x, w, layout=layout: fused_ag._kernel(state, x, w, ag_plan, chunk_layout=layout), x, w)
        if rs:
            record("reduce_scatter", layout,
                   lambda x, w, layout=layout: fused_rs._kernel(state, x, w, rs_plan, chunk_layout=layout),
                   xr, wr, K_SHARDED)
        print(json.dumps({"m": m, "k": k, "n": n, "layout": layout, **{op: row[op].get(layout) for op in ops}}),
              flush=True)
    if rs:
        cm, cn = rs_plan.chunk
        stacked = jax.device_put(jax.random.normal(keys[0], (devices * devices, cm, cn), dtype),
                                 NamedSharding(mesh, P("x")))
        row["reduce_scatter_parts"] = {
            "exchange_only_us": timed(lambda x, w: _chunked.reduce_scatter_partials(x, w, rs_plan), xr, wr, K_SHARDED),
            # the partials of every source stacked [devices, cm, cn] on each device, w unused
            "sum_only_us": timed(lambda s, _: fused_rs.reduce_in_order(s, dtype), stacked, wr,
                                 (P("x"), K_SHARDED[1])),
        }
        if _chunked.TRITON_TILES in (layouts or _chunked.LAYOUTS):
            row["reduce_scatter_parts"]["exchange_only_triton_tiles_us"] = timed(
                lambda x, w: _chunked.reduce_scatter_partials(x, w, rs_plan, _chunked.TRITON_TILES, state), xr, wr,
                K_SHARDED)
        print(json.dumps({"m": m, "k": k, "n": n, "reduce_scatter_parts": row["reduce_scatter_parts"]}), flush=True)
    return row


# chunked_layouts' ops -> the name of XLA's composition in its row ("xla_<name>_us")
XLA_NAMES = {"all_to_all": "matmul_all_to_all", "all_gather": "all_gather_matmul",
             "reduce_scatter": "matmul_reduce_scatter"}


def plot(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    sweep = [r for r in report["sweep"]]
    ms = [r["m"] for r in sweep]
    for key, label in (("xla_matmul_us", "XLA x @ w"), ("triton_matmul_us", "tile code alone"),
                       ("xla_matmul_all_to_all_us", "XLA x @ w, all_to_all"), ("fused_all_to_all_us", "jaxgin chunked"),
                       ("triton_all_to_all_us", "jaxgin Triton")):
        axes[0].plot(ms, [r[key] for r in sweep], "o-", label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel(f"M per device (K={sweep[0]['k']}, N={sweep[0]['n']})")
    axes[0].set_ylabel("time per call (us)")
    axes[0].set_title(f"matmul_all_to_all, {report['devices']} x {report['device_kind']}")
    axes[0].grid(True, which="both", alpha=0.3)
    axes[0].legend()
    shapes = report["shapes"]
    labels = [f"{r['m']}x{r['k']}x{r['n']}" for r in shapes]
    keys = [("xla_matmul_all_to_all_us", "XLA a2a"), ("fused_all_to_all_us", "chunked a2a"),
            ("triton_all_to_all_us", "Triton a2a"), ("xla_all_gather_matmul_us", "XLA ag"),
            ("fused_all_gather_us", "chunked ag"), ("triton_all_gather_us", "Triton ag"), ("xla_matmul_us", "XLA x @ w")]
    width = 0.8 / len(keys)
    for i, (key, label) in enumerate(keys):
        axes[1].bar([j + i * width for j in range(len(shapes))], [r.get(key, 0) for r in shapes], width, label=label)
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], labels)
    axes[1].set_ylabel("time per call (us)")
    axes[1].set_title("issue shapes (per device; ag: M gathered)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# The --*-only modes that measure one thing and write it alone (main's `only` table), with their
# help: any of them replaces the full run.
SINGLE_MEASURE_MODES = {
    "chunking_only": "only the matmuls alone (cuBLAS, Triton) over 1/2/4/8 row chunks of the issue's shapes "
                     "(fused_chunking.json; one GPU is enough)",
    "variants_only": "only matmul_all_to_all under each tile configuration and exchange layout, and "
                     "matmul_reduce_scatter under each reducer layout (fused_variants.json)",
    "reduce_scatter_variants_only": "only matmul_reduce_scatter's Triton kernel under each reducer layout, folded "
                                    "reducers included (fused_reduce_scatter_variants.json)",
    "gather_variants_only": "only all_gather_matmul's Triton kernel under each count of sending programs and tile "
                            "configuration (fused_gather_variants.json)",
    "gather_trace_only": "only all_gather_matmul's Triton kernel with a record per program (when senders finish, "
                         "when tiles wait and compute, programs per SM; fused_gather_trace.json)",
    "reduce_scatter_trace_only": "only matmul_reduce_scatter's folded Triton kernel with a record per program "
                                 "(matmul, stores and flags, waits, sums; fused_reduce_scatter_trace.json)",
    "all_to_all_trace_only": "only matmul_all_to_all's Triton kernel with a record per program, per part of the "
                             "exchange (matmul, stores and flags, waits, copies out; fused_all_to_all_trace.json)",
    "chunked_layouts_only": "only the chunked method of the three fused ops under each chunk layout, with the "
                            "reduce-scatter's exchange and sum apart, at CHUNKED_LAYOUT_SHAPES "
                            "(fused_chunked_layouts.json)",
    "chunked_triton_only": "only matmul_all_to_all and matmul_reduce_scatter's chunked method at the issue's "
                           "shapes, its chunks computed by cuBLAS (chunk_per_peer) and by one Triton kernel of "
                           "128 x 256 tiles (triton_tiles), the exchange and sum apart, and all_gather_matmul's "
                           "(cuBLAS), timed on the device too (fused_chunked_triton.json)",
    "sweep_only": "only the sweep of matmul_all_to_all (--sweep; the default method, recorded per row, and the "
                  "Triton kernel against XLA's composition; fused_sweep.json)",
    "gspmd_only": "only XLA's own partitioning of the tensor-parallel matmuls, under the XLA_FLAGS given "
                  "(fused_gspmd.json; the full run starts this under each of WINDOWED_EINSUM_FLAGS)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sweep", default="512,1024,2048,4096,8192", help="M per device, K=7168, N=2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--breakdown-only", action="store_true", help="only the breakdown of matmul_all_to_all")
    parser.add_argument("--shapes-only", action="store_true", help="only the issue's shapes (no breakdown or sweep)")
    for mode, help_text in SINGLE_MEASURE_MODES.items():
        parser.add_argument(f"--{mode.replace('_', '-')}", action="store_true", help=help_text)
    parser.add_argument("--windowed-only", action="store_true",
                        help="only XLA's windowed einsum and its control (XLA's default flags), each in a process of "
                             "its own, at the issue's shapes (fused_windowed.json)")
    parser.add_argument("--no-windowed", action="store_true", help="without XLA's windowed einsum baseline")
    parser.add_argument("--no-pallas", action="store_true", help="without JAX's Pallas collective matmul baseline")
    parser.add_argument("--pallas-only", metavar="PROCESS,COUNT,HOST:PORT",
                        help="only the Pallas baseline, as process PROCESS of a job of COUNT, one GPU each "
                             "(fused_pallas.json; the full run starts this job itself)")
    args = parser.parse_args()
    if args.pallas_only:
        pallas_job(args)
        return
    if args.windowed_only:
        cli.require_gpus(__file__, 2, "XLA partitions the matmuls over them", through_jax=False)
        rows = [{"m": m, "k": k, "n": n, **found} for (m, k, n), found in zip(ISSUE_SHAPES, gspmd_in_own_processes(args))]
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fused_windowed.json").write_text(json.dumps({"shapes": rows}, indent=1))
        print(json.dumps(rows))
        return
    need, what = ((1, "it times cuBLAS and the fused ops' Triton tile code on them") if args.chunking_only else
                  (2, "it times jaxgin.fused against XLA's matmul and collectives between them"))
    windowed, pallas = [], {}
    full = not (args.breakdown_only or any(getattr(args, mode) for mode in SINGLE_MEASURE_MODES))
    if full and not (args.no_windowed and args.no_pallas):
        # XLA's windowed einsum and JAX's Pallas kernel first, in processes of their own, before
        # this one holds the GPUs
        gpus = cli.require_gpus(__file__, need, what, through_jax=False)
        windowed = [] if args.no_windowed else gspmd_in_own_processes(args)
        pallas = {} if args.no_pallas else pallas_in_own_processes(args, gpus)
    cli.require_gpus(__file__, need, what)
    cli.require(__file__, "triton", why="the fused ops' kernels and tile code", install='-e ".[cuda]"')
    cli.run(__file__, jaxgin.initialize, heap_size=os.environ.get("JAXGIN_BENCH_HEAP", "4GiB"))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    dtype = jnp.dtype(args.dtype)
    # Modes that measure one thing and write it alone: (measure, file, extra keys, the calls'
    # (shape, extra arguments); the issue's shapes unless they name theirs).
    kind = {"device_kind": jax.devices()[0].device_kind, "jax": jax.__version__}
    issue_shapes = [(shape, ()) for shape in ISSUE_SHAPES]
    only = {
        "chunking_only": (chunking, "fused_chunking.json", kind, issue_shapes),
        "gspmd_only": (gspmd, "fused_gspmd.json", {}, issue_shapes),
        "variants_only": (variants, "fused_variants.json", {}, issue_shapes),
        "gather_variants_only": (gather_variants, "fused_gather_variants.json", kind, issue_shapes),
        "reduce_scatter_variants_only": (reduce_scatter_variants, "fused_reduce_scatter_variants.json", kind,
                                         issue_shapes),
        "gather_trace_only": (gather_trace, "fused_gather_trace.json", kind, issue_shapes),
        "reduce_scatter_trace_only": (reduce_scatter_trace, "fused_reduce_scatter_trace.json", kind, issue_shapes),
        "all_to_all_trace_only": (all_to_all_trace, "fused_all_to_all_trace.json", kind, issue_shapes),
        "chunked_layouts_only": (chunked_layouts, "fused_chunked_layouts.json", kind,
                                 [(shape, (ops,)) for shape, ops in CHUNKED_LAYOUT_SHAPES]),
        "chunked_triton_only": (chunked_layouts, "fused_chunked_triton.json", kind,
                                [(shape, (LAYOUT_OPS, ("chunk_per_peer", "triton_tiles"), True,
                                          WIDE_TILES)) for shape, _ in issue_shapes]),
        "sweep_only": (measure, "fused_sweep.json", kind,
                       [((int(m), 7168, 2048), (("all_to_all",),)) for m in args.sweep.split(",")]),
    }
    assert only.keys() == SINGLE_MEASURE_MODES.keys(), "SINGLE_MEASURE_MODES names the modes of `only`"
    for mode, (measure_one, name, extra, calls) in only.items():
        if getattr(args, mode):
            rows = [measure_one(mesh, *shape, dtype, args.repeats, *more) for shape, more in calls]
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / name).write_text(json.dumps({"devices": mesh.size, **extra, "shapes": rows}, indent=1))
            jaxgin.finalize()
            return
    parts = [] if args.shapes_only else [breakdown(mesh, m, k, n, dtype, args.repeats) for m, k, n in ISSUE_SHAPES]
    if args.breakdown_only:
        jaxgin.finalize()
        return
    # the rows the issues judge, also timed on the device
    shapes = [measure(mesh, m, k, n, dtype, args.repeats, ("all_to_all", "all_gather", "reduce_scatter"),
                      device_spans=True) for m, k, n in ISSUE_SHAPES]
    shapes.append(measure(mesh, *all_gather_shapes(mesh.size)[-1], dtype, args.repeats, ("all_gather",),
                          device_spans=True))
    for row in shapes:  # JAX's Pallas kernel beside all_gather_matmul, from its own job
        row.update(pallas.get((row["m"], row["k"], row["n"]), {}))
        if "pallas_all_gather_matmul_us" in row and "fused_all_gather_us" in row:
            row["all_gather_vs_pallas"] = row["pallas_all_gather_matmul_us"] / min(row["fused_all_gather_us"],
                                                                                   row["triton_all_gather_us"])
    for row, xla_own in zip(shapes, windowed):  # the same shapes, XLA's windowed einsum beside
        row.update(xla_own)
        windowed_rs, windowed_ag = (fastest_right_windowed(row, op) for op in ("matmul_reduce_scatter", "all_gather_matmul"))
        if "fused_reduce_scatter_us" in row and windowed_rs is not None:
            row["reduce_scatter_vs_windowed"] = windowed_rs / min(row["fused_reduce_scatter_us"],
                                                                  row["triton_reduce_scatter_us"])
        if "fused_all_gather_us" in row and windowed_ag is not None:
            row["all_gather_vs_windowed"] = windowed_ag / min(row["fused_all_gather_us"], row["triton_all_gather_us"])
    sweep = [] if args.shapes_only else [
        measure(mesh, int(m), 7168, 2048, dtype, args.repeats, ("all_to_all",)) for m in args.sweep.split(",")]
    report = {
        "devices": mesh.size,
        "device_kind": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "nccl": jaxgin.info().get("nccl_version"),
        "timing": f"best of {args.repeats} runs of one jitted loop of {STEPS} dependent calls, divided by {STEPS}; "
                  f"*_device_us (the issue's shapes): GPU 0's span of one run of the same loop (JAX's profiler), "
                  f"divided by {STEPS}; *_gpu_windows_us: each GPU's first start and last end in that run, in us "
                  f"from the earliest",
        "shapes": shapes,
        "sweep": sweep,
        "breakdown": parts,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "fused.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    try:
        if sweep:
            print(f"wrote {plot(report, path.with_suffix('.png'))}")
    except ImportError as e:
        print(f"no plot ({e})")
    jaxgin.finalize()


if __name__ == "__main__":
    main()
