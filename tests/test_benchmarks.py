"""benchmarks/ and tools/ on a machine without GPUs: each says, in one line on stderr, that it needs
GPUs and how many, and exits with jaxgin.cli.EXIT_TOO_FEW_GPUS, before touching jaxgin or JAX's
devices for real work (no traceback)."""

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import cli

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def _on_cpu_devices(code: str, devices: int):
    """`code` run by Python in the repo root with JAX on `devices` CPU devices."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("script, args, gpus", [
    ("benchmarks/collectives.py", [], 2),
    ("benchmarks/collectives.py", ["--max-bytes", "64KiB", "--ops", "ppermute"], 2),
    ("benchmarks/fused.py", [], 2),
    ("benchmarks/fused.py", ["--chunking-only"], 1),
    ("benchmarks/moe.py", [], 1),
    ("benchmarks/nccl_ep.py", [], 2),
    ("tools/call_overhead.py", [], 1),
    ("tools/profile_latency.py", [], 2),
    ("tools/profile_launch_skew.py", [], 2),
    ("tools/probe_triton_histogram.py", [], 1),
    ("tools/probe_stack_limit.py", [], 1),
    ("tools/profile_moe.py", [], 1),
    ("tools/transport_smoke.py", [], 1),
    ("tools/tune_triton_matmul.py", [], 1),
])
def test_without_gpus_says_how_many_it_needs(script, args, gpus, tmp_path):
    out = _run(script, *args, "--out", str(tmp_path))
    assert out.returncode == cli.EXIT_TOO_FEW_GPUS, (out.returncode, out.stdout, out.stderr)
    needed = "an NVIDIA GPU" if gpus == 1 else f"{gpus} or more NVIDIA GPUs"
    assert out.stderr.startswith(f"{Path(script).name}: needs {needed} ("), out.stderr
    assert out.stderr.rstrip().endswith("there are none here"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout == ""
    assert not list(tmp_path.iterdir())  # no half-written results


@pytest.mark.parametrize("script", ["benchmarks/collectives.py", "benchmarks/fused.py", "benchmarks/moe.py",
                                    "benchmarks/nccl_ep.py", "benchmarks/plot.py"])
def test_help_is_the_whole_docstring(script):
    """--help shows the script's docstring as written, not its first line cut mid-sentence: what
    the script does, what it needs and, for every benchmark, how many GPUs."""
    out = _run(script, "--help")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    doc = ast.get_docstring(ast.parse((ROOT / script).read_text()))
    for line in doc.splitlines():
        assert line.rstrip() in out.stdout, line
    if script != "benchmarks/plot.py":
        assert re.search(r"(1|2) or more NVIDIA GPUs|2 NVIDIA GPUs", out.stdout), out.stdout


def test_driver_count_without_jax(monkeypatch):
    """Scripts that run PyTorch or Triton directly count the CUDA driver's GPUs."""
    monkeypatch.setattr(cli, "cuda_gpu_count", lambda: 1)
    with pytest.raises(SystemExit) as excinfo:
        cli.require_gpus("bench.py", 2, "it times things", through_jax=False)
    assert excinfo.value.code == cli.EXIT_TOO_FEW_GPUS
    assert cli.require_gpus("bench.py", 1, "it times things", through_jax=False) == 1


def test_driver_gpus_without_jax_plugin_message(monkeypatch, capsys):
    monkeypatch.setattr(cli, "cuda_gpu_count", lambda: 2)
    with pytest.raises(SystemExit):
        cli.require_gpus("bench.py", 2, "it times things")
    err = capsys.readouterr().err
    assert err.startswith("bench.py: needs 2 or more NVIDIA GPUs (it times things); the CUDA driver shows 2 but "
                          "JAX runs on 'cpu'")
    assert 'pip install -e ".[cuda]"' in err


def test_the_copy_engine_programs_move_what_each_op_moves():
    """collectives.py's copy-engine figures on CPU devices, through its child process: the ring and
    all_to_all programs checked against their expected bytes and timed, none below
    COPY_ENGINE_MIN_BYTES, and each op matched to the program that moves what it moves."""
    out = _on_cpu_devices(
        "import sys; sys.path.insert(0, 'benchmarks'); import collectives as c\n"
        "big = c.COPY_ENGINE_MIN_BYTES\n"
        "times = c.copy_engine_times(['all_to_all', 'ppermute'], [big // 2, big], 1)\n"
        "print(sorted(c.copy_engine_times(['ppermute'], [big], 1)))\n"
        "print(sorted(times), all(t > 0 for t in times.values()))\n"
        "print(sorted(c.COPY_ENGINE_PROGRAM.items()))", 2)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().split("\n")
    assert lines[-3] == "[('ppermute', 16777216)]", out.stdout  # only the programs asked for
    assert lines[-2] == "[('all_to_all', 16777216), ('ppermute', 16777216)] True", out.stdout
    assert lines[-1] == ("[('all_to_all', 'all_to_all'), ('ppermute', 'ppermute'), ('put_wait', 'ppermute'), "
                         "('put_wait_from', 'ppermute')]")


def test_a_copy_engine_program_that_moves_wrong_bytes_is_reported(monkeypatch):
    """A wrong result from the child process gives no copy-engine figures and says which program
    was wrong; so does a child that fails."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    collectives = importlib.import_module("collectives")
    rows = [{"op": "ppermute", "bytes_per_device": 1 << 24, "seconds": 1e-4, "equal": True},
            {"op": "all_to_all", "bytes_per_device": 1 << 24, "seconds": 1e-4, "equal": False}]
    done = subprocess.CompletedProcess([], 0, "\n".join(json.dumps(r) for r in rows) + "\n", "")
    monkeypatch.setattr(collectives.subprocess, "run", lambda *a, **k: done)
    assert collectives.copy_engine_times(["all_to_all", "ppermute"], [1 << 24], 1) == {
        "error": "the copy engines' programs moved wrong bytes: all_to_all at 16777216 B"}
    failed = subprocess.CompletedProcess([], 1, "", "Unknown flag in XLA_FLAGS")
    monkeypatch.setattr(collectives.subprocess, "run", lambda *a, **k: failed)
    assert collectives.copy_engine_times(["ppermute"], [1 << 24], 1)["error"].endswith("exited 1: Unknown flag in XLA_FLAGS")
    assert collectives.copy_engine_times(["ppermute"], [1 << 20], 1) == {}  # nothing to time below COPY_ENGINE_MIN_BYTES
    assert collectives.copy_engine_times([], [1 << 24], 1) == {}  # self_copy alone: no program moves its bytes


def test_plot_without_matplotlib_or_report():
    out = _run("benchmarks/plot.py")
    assert out.returncode == 2 and "required: report" in out.stderr
    if not cli.installed("matplotlib"):
        out = _run("benchmarks/plot.py", "benchmarks/results/2xh200/collectives.json")
        assert out.returncode == cli.EXIT_MISSING_DEPENDENCY
        assert out.stderr == "plot.py: needs matplotlib (it draws the plot), which is not installed: pip install matplotlib\n"


def test_require_names_the_module_and_the_pip_command(capsys):
    cli.require("x.py", "json", why="never missing", install="nothing")
    with pytest.raises(SystemExit) as excinfo:
        cli.require("x.py", "jaxgin_no_such_module.sub", why="a test", install='-e ".[cuda]"')
    assert excinfo.value.code == cli.EXIT_MISSING_DEPENDENCY
    assert capsys.readouterr().err == ('x.py: needs jaxgin_no_such_module.sub (a test), which is not installed: '
                                       'pip install -e ".[cuda]"\n')


def test_a_windowed_einsum_baseline_with_a_wrong_result_gets_no_ratio(monkeypatch, capsys):
    """XLA's windowed einsum gave results 1.3x the largest value away from float32's on 4 x H100
    (jax 0.11.2): its time is kept and marked, never turned into a speedup (fused.gspmd on 4 CPU
    devices, the comparison made to fail)."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import jax, numpy as np, jax.numpy as jnp, fused;"
            "from jax.sharding import Mesh; fused.STEPS = 1; fused._rel = lambda a, b: 1.3;"
            "row = fused.gspmd(Mesh(np.array(jax.devices()), ('x',)), 64, 32, 16, jnp.float32, 1);"
            "print('WRONG', row['windowed_all_gather_matmul_wrong_result'], row['windowed_matmul_reduce_scatter_wrong_result'])")
    out = _on_cpu_devices(code, 4)
    assert "WRONG True True" in out.stdout, out.stderr[-2000:]
    assert "no ratio against it" in out.stderr


def test_the_chunked_layouts_mode_times_every_layout_of_the_three_ops():
    """fused.chunked_layouts: each of the chunked method's layouts of matmul_all_to_all,
    all_gather_matmul (not "triton_tiles") and matmul_reduce_scatter reaches the op's kernel by name, is checked against
    XLA's composition and gets a ratio to it; the reduce-scatter's exchange and sum are timed
    apart (4 CPU devices, the ops' kernels and the exchange stood in for by their references)."""
    code = (
        "import sys, json; sys.path.insert(0, 'benchmarks'); import jax, numpy as np, jax.numpy as jnp, jaxgin, fused;"
        "import importlib; a2a, ag, rs = (importlib.import_module(f'jaxgin.fused.{m}') for m in"
        " ('matmul_all_to_all', 'all_gather_matmul', 'matmul_reduce_scatter'));"
        "from jaxgin.fused import _chunked;"
        "from jax.sharding import Mesh; fused.STEPS = 1; seen = [];"
        "a2a._kernel = lambda state, x, w, plan, chunk_layout: (seen.append(('a2a', chunk_layout)), a2a.reference(x, w, plan))[1];"
        "ag._kernel = lambda state, x, w, plan, chunk_layout: (seen.append(('ag', chunk_layout)), ag.reference(x, w, plan))[1];"
        "rs._kernel = lambda state, x, w, plan, chunk_layout: (seen.append(('rs', chunk_layout)), rs.reference(x, w, plan))[1];"
        "_chunked.reduce_scatter_partials = lambda x, w, plan, layout='chunk_per_peer', state=None:"
        " (seen.append(('rs', 'exchange, ' + layout)),"
        " jax.lax.all_to_all(rs.partial_chunks(x @ w, plan), 'x', 0, 0, tiled=True))[1];"
        "jaxgin.initialize();"
        "row = fused.chunked_layouts(Mesh(np.array(jax.devices()), ('x',)), 64, 32, 16, jnp.float32, 1);"
        "print('ROW', json.dumps({op: {k: v['rel_err'] < 1e-5 and v['speedup_vs_unfused'] > 0 for k, v in row[op].items()}"
        " for op in ('all_to_all', 'all_gather', 'reduce_scatter')}), json.dumps(sorted(row['reduce_scatter_parts'])),"
        " all(v > 0 for v in row['reduce_scatter_parts'].values()), sorted(set(seen)))")
    out = _on_cpu_devices(code, 4)
    line = next((x for x in out.stdout.splitlines() if x.startswith("ROW ")), None)
    assert line is not None, out.stderr[-2000:]
    cublas = ("chunk_per_peer", "peers_merged", "whole")
    layouts = {"all_to_all": cublas + ("triton_tiles",), "all_gather": cublas, "reduce_scatter": cublas + ("triton_tiles",)}
    assert json.loads(line[4:line.index("} [") + 1]) == {op: dict.fromkeys(names, True)
                                                         for op, names in layouts.items()}, line
    assert '["exchange_only_triton_tiles_us", "exchange_only_us", "sum_only_us"] True' in line, line
    ops = sorted((short, layout) for short, op in (("a2a", "all_to_all"), ("ag", "all_gather"), ("rs", "reduce_scatter"))
                 for layout in layouts[op])
    exchanges = [("rs", "exchange, chunk_per_peer"), ("rs", "exchange, triton_tiles")]
    assert line.endswith(str(sorted(ops + exchanges))), line


def test_the_windowed_processes_include_the_default_flags_control(tmp_path, monkeypatch):
    """gspmd_in_own_processes: one child per windowed-einsum flag set and one under XLA's default
    flags, each row key renamed by its prefix; the control is never taken as the baseline."""
    import subprocess
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fused
    finally:
        sys.path.pop(0)
    flags_seen = []

    def child(cmd, env, check):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        flags_seen.append(env["XLA_FLAGS"])
        wrong = "windowed_einsum" in env["XLA_FLAGS"]
        rows = [{"windowed_matmul_reduce_scatter_us": 100.0 + len(flags_seen),
                 **({"windowed_matmul_reduce_scatter_wrong_result": True} if wrong else {})} for _ in fused.ISSUE_SHAPES]
        (out / "fused_gspmd.json").write_text(json.dumps({"shapes": rows}))

    monkeypatch.setattr(subprocess, "run", child)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    rows = fused.gspmd_in_own_processes(types.SimpleNamespace(out=tmp_path, dtype="bfloat16", repeats=1))
    assert flags_seen == [f"--xla_dump_to=/tmp/x {f}" for f in fused.WINDOWED_EINSUM_FLAGS.values()] + ["--xla_dump_to=/tmp/x"]
    assert rows[0]["gspmd_default_matmul_reduce_scatter_us"] == 103.0
    assert "gspmd_default_matmul_reduce_scatter_wrong_result" not in rows[0]
    assert fused.fastest_right_windowed(rows[0], "matmul_reduce_scatter") is None


def test_the_windowed_ratio_takes_the_fastest_right_form():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fused
    finally:
        sys.path.pop(0)
    row = {"windowed_matmul_reduce_scatter_us": 500.0, "windowed_matmul_reduce_scatter_wrong_result": True,
           "windowed_one_stream_matmul_reduce_scatter_us": 700.0, "windowed_all_gather_matmul_us": 800.0,
           "windowed_all_gather_matmul_wrong_result": True}
    assert fused.fastest_right_windowed(row, "matmul_reduce_scatter") == 700.0
    assert fused.fastest_right_windowed(row, "all_gather_matmul") is None


def test_the_pallas_baseline_says_why_it_cannot_run_instead_of_failing_the_benchmark():
    """On this CPU machine JAX's Mosaic GPU kernel cannot run: the row says why, and the other
    baselines go on (fused.pallas_all_gather_matmul on 2 CPU devices)."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import jax, numpy as np, jax.numpy as jnp, fused;"
            "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P;"
            "mesh = Mesh(np.array(jax.devices()), ('x',));"
            "xs = jax.device_put(jnp.ones((256, 64), jnp.bfloat16), NamedSharding(mesh, P('x')));"
            "w = jax.device_put(jnp.ones((64, 128), jnp.bfloat16), NamedSharding(mesh, P()));"
            "row = fused.pallas_all_gather_matmul(mesh, xs, w, None, 1); print('ROW', sorted(row), row)")
    out = _on_cpu_devices(code, 2)
    assert "ROW ['pallas_all_gather_matmul_error']" in out.stdout, (out.stdout[-2000:], out.stderr[-2000:])


def test_the_pallas_baseline_runs_in_a_job_of_one_process_per_gpu(tmp_path, monkeypatch):
    """JAX's Mosaic GPU collective matmul runs with one device per process: fused.py starts such a
    job (--pallas-only) and takes each shape's row from it; here, on CPU, each row says why the
    kernel could not run, and a job that fails says which process and why."""
    import types

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fused
    finally:
        sys.path.pop(0)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    args = types.SimpleNamespace(out=tmp_path, dtype="bfloat16", repeats=1)
    rows = fused.pallas_in_own_processes(args, 2, timeout=240)
    assert sorted(rows) == sorted(fused.all_gather_shapes(2)), rows
    assert json.loads((tmp_path / "pallas" / "fused_pallas.json").read_text())["processes"] == 2
    for row in rows.values():  # the job ran; the kernel itself cannot run on CPU
        assert set(row) == {"pallas_all_gather_matmul_error"} and row["pallas_all_gather_matmul_error"], rows
    args.dtype, args.out = "no_such_dtype", tmp_path / "failing"
    rows = fused.pallas_in_own_processes(args, 2, timeout=240)
    assert all("the job of one process per GPU failed (exit codes [1, 1]); process 0" in r["pallas_all_gather_matmul_error"]
               and "no_such_dtype" in r["pallas_all_gather_matmul_error"] for r in rows.values()), rows


def test_check_fp8_agrees_with_its_numpy_oracle_on_cpu(tmp_path):
    """tools/check_fp8.py on CPU (the reference dispatch): fp8.quantize, fp8.rounded and dispatch's
    rows equal the numpy / ml_dtypes oracle value for value, and it says so in its JSON."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "tools/check_fp8.py", "--tokens", "16,40", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, (out.stdout, out.stderr)
    report = json.loads((tmp_path / "check_fp8.json").read_text())
    assert [case["tokens"] for case in report["cases"]] == [16, 40]
    for case in report["cases"]:
        assert case["values"] == case["tokens"] * 7168
        assert case["xla_scale_mismatches"] == case["xla_value_mismatches"] == 0, case
        assert case["rounded_mismatches"] == case["dispatch_mismatches"] == 0, case


def _benchmark_module(name: str):
    """benchmarks/NAME.py, imported as the benchmarks import each other (their folder on sys.path)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def _perfetto_trace(where: Path) -> None:
    """A trace as jax.profiler.trace(..., create_perfetto_trace=True) writes it: GPU 0 with a
    stream line and an "XLA Ops" line repeating its kernels, GPU 1, and the host."""
    import gzip

    meta = lambda ph, name, pid, tid=0, value="": dict(ph=ph, name=name, pid=pid, tid=tid, args=dict(name=value))  # noqa: E731
    kernel = lambda name, pid, tid, ts, dur: dict(ph="X", name=name, pid=pid, tid=tid, ts=ts, dur=dur)  # noqa: E731
    events = [
        meta("M", "process_name", 1, value="/host:CPU"), meta("M", "process_name", 7, value="/device:GPU:0"),
        meta("M", "process_name", 8, value="/device:GPU:1"),
        meta("M", "thread_name", 7, 1, "Stream #13(Compute)"), meta("M", "thread_name", 7, 2, "XLA Ops"),
        meta("M", "thread_name", 8, 1, "Stream #13(Compute)"),
        kernel("python", 1, 0, 0.0, 500.0),
        kernel("route_kernel", 7, 1, 110.0, 6.5), kernel("dispatch_kernel", 7, 1, 100.0, 9.0),
        kernel("dispatch_kernel", 7, 1, 118.0, 12.0), kernel("fusion", 7, 2, 100.0, 40.0),
        kernel("dispatch_kernel", 8, 1, 90.0, 80.0),
    ]
    where.mkdir(parents=True)
    with gzip.open(where / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_device_windows_give_each_gpus_first_start_and_last_end(tmp_path):
    """timing.device_windows: per GPU of the trace, its stream events' first start and last end
    (seconds on the trace's clock), the XLA-op line and the host left out."""
    timing = _benchmark_module("timing")
    _perfetto_trace(tmp_path / "run")
    windows = timing.device_windows(tmp_path / "run")
    assert windows.keys() == {0, 1}
    assert windows[0] == pytest.approx((100e-6, 130e-6)) and windows[1] == pytest.approx((90e-6, 170e-6))
    with pytest.raises(RuntimeError, match="no trace under"):
        timing.device_windows(tmp_path / "empty")


def test_device_span_reads_the_first_gpus_streams_only(tmp_path):
    """The benchmarks' device span (timing.device_events, span_seconds): GPU 0's stream events in
    start order, not its XLA-op line, GPU 1 or the host; the span from the first start to the
    latest end, in seconds; a trace without device events is an error, not a zero."""
    timing = _benchmark_module("timing")
    _perfetto_trace(tmp_path / "run")
    events = timing.device_events(tmp_path / "run")
    assert [(e["name"], e["ts"]) for e in events] == [("dispatch_kernel", 100.0), ("route_kernel", 110.0),
                                                      ("dispatch_kernel", 118.0)]
    assert timing.span_seconds(events) == pytest.approx(30e-6)
    with pytest.raises(RuntimeError, match="no device events"):
        timing.span_seconds([])
    with pytest.raises(RuntimeError, match="no trace under"):
        timing.device_events(tmp_path / "empty")


def test_step_cycle_is_the_median_start_to_start_of_a_kernel_once_per_step():
    """timing.step_cycle_seconds: a chain's steady cost per step, clocked by the kernel that runs
    once a step (or every k-th start of one that runs k times), so one step's long wait and the
    run's prologue do not move it; a trace with nothing that recurs per step gives None."""
    timing = _benchmark_module("timing")
    event = lambda name, ts: dict(name=name, ts=float(ts), dur=1.0)  # noqa: E731
    steps = 10
    events = [event("prologue", 0)]
    for i in range(steps):
        late = 30 if i >= 5 else 0  # a late peer held step 5 back, and every step after it
        events += [event("put", 100 + i * 10 + late), event("wait", 102 + i * 10 + late)]
    events.sort(key=lambda e: e["ts"])
    assert timing.step_cycle_seconds(events, steps) == pytest.approx(10e-6)
    twice = [event("nccl", i * 4) for i in range(2 * steps)]  # two launches a step, a step every 8 us
    assert timing.step_cycle_seconds(twice, steps) == pytest.approx(8e-6)
    assert timing.step_cycle_seconds([event("nccl", 0), event("nccl", 5)], steps) is None


def test_hierarchical_report_rebuilds_the_committed_file_from_its_records(tmp_path):
    """tools/hierarchical_report.py turns the mixed-mesh records of a round into hierarchical.json:
    from the records committed beside it, it writes the committed file again, and there every
    all_gather_matmul case sent exactly the per-host minimum (half of per-GPU sending on hosts of
    two), and MoE dispatch and combine within 1.05x of it (their metadata) at worlds 4 and 8, both
    modes, plain and under command buffers, where per-GPU sending would have been above 1.3x (2
    hosts) and 1.1x (4 hosts of 2, where fewer of a token's experts share a host)."""
    results = ROOT / "benchmarks" / "results" / "2xh200"
    out = tmp_path / "hierarchical.json"
    done = _run("tools/hierarchical_report.py", str(results), "--out", str(out))
    assert done.returncode == 0, done.stderr
    cases = json.loads(out.read_text())["cases"]
    assert cases == json.loads((results / "hierarchical.json").read_text())["cases"]
    gathers = [c for c in cases if c["op"] == "all_gather_matmul"]
    assert {(c["world"], c["hosts"]) for c in gathers} == {(4, 2), (8, 4)}
    assert all(c["network_bytes"] == c["host_minimum_bytes"] == c["rank_minimum_bytes"] / 2 for c in gathers), gathers
    moe = [c for c in cases if c["op"].startswith("moe.")]
    assert {c["op"] for c in moe} == {"moe.dispatch", "moe.combine"}, moe
    assert {(c["world"], c["hosts"], c["mode"], c["command_buffers"]) for c in moe} == {
        (world, hosts, mode, captured) for world, hosts in ((4, 2), (8, 4))
        for mode in ("low_latency", "high_throughput") for captured in (False, True)}
    assert all(1.0 <= c["network_to_host_minimum"] <= 1.05 for c in moe), moe
    assert all(c["rank_to_host_minimum"] > (1.3 if c["hosts"] == 2 else 1.1) for c in moe), moe
    empty = _run("tools/hierarchical_report.py", str(tmp_path), "--out", str(tmp_path / "none.json"))
    assert empty.returncode != 0 and "no mixed-mesh traffic records" in empty.stderr, empty.stderr
    old = tmp_path / "before" / "mixed_moe_check_plain_4ranks.json"  # dispatch once per GPU, no combine fields
    old.parent.mkdir()
    old.write_text(json.dumps({"processes": [{"processes": 4, "traffic": [{"dispatch": {"bytes": 1, "puts": 1}}]}]}))
    refused = _run("tools/hierarchical_report.py", str(old.parent), "--out", str(tmp_path / "old.json"))
    assert refused.returncode != 0 and f"{old}: a record from before" in refused.stderr, refused.stderr


def _fused_bench_json(code: str):
    """The JSON that `code` (which imports benchmarks/fused.py) prints last, run on CPU."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_chain_times_give_the_host_clock_and_the_device_span_per_call():
    """fused._chain_times: a chain of 20 calls (built and compiled once for both timings) taking 5 ms
    by the host's clock and spanning 4 ms on GPU 0 gives 250 and 200 us per call, and each GPU's
    window of the run (GPU 1 began 0.3 ms later); _ratios then reads either timing (XLA's time
    over jaxgin's), named by it."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import fused;"
            "built = [];"
            "fused._chain = lambda mesh, op, specs: built.append(op) or 'chain';"
            "fused.best_seconds = lambda chain, *args, repeats: {'chain': 5e-3}[chain];"
            "fused.device_windows_seconds = lambda chain, *args: {'chain': {0: (0.0, 4e-3), 1: (3e-4, 4.5e-3)}}[chain];"
            "t = fused._chain_times(None, 'op', (), None, 3);"
            "assert built == ['op'], built;"
            "row = {'xla_matmul_us': 100, 'triton_matmul_us': 125, 'xla_matmul_device_us': 90,"
            "       'triton_matmul_device_us': 100, 'xla_all_gather_matmul_us': 300, 'fused_all_gather_us': 200,"
            "       'triton_all_gather_us': 250, 'xla_all_gather_matmul_device_us': 280,"
            "       'fused_all_gather_device_us': 140, 'triton_all_gather_device_us': 200};"
            "print(json.dumps([t, fused._ratios(row, ''), fused._ratios(row, '_device')]))")
    times, chain, device = _fused_bench_json(code)
    assert times.pop("gpu_windows_us") == [[0.0, 4000.0], [300.0, 4500.0]]
    assert times == pytest.approx({"us": 250.0, "device_us": 200.0})
    assert chain == pytest.approx({"triton_vs_xla_matmul": 0.8, "all_gather_speedup": 1.5,
                                   "triton_all_gather_speedup": 1.2})
    assert device == pytest.approx({"triton_vs_xla_matmul_device": 0.9, "all_gather_speedup_device": 2.0,
                                    "triton_all_gather_speedup_device": 1.4})


def test_chained_traced_calls_report_each_span_and_the_gap_before_the_next():
    """fused._chain_summary on three consecutive calls of two programs each (start, tile, waits
    ended, end; ns): spans 100 / 150 / 100 us, gaps of 20 and 50 us between one call's last end
    and the next call's first start."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import numpy as np, fused;"
            "c = np.zeros((3, 2, 8), np.int64);"
            "c[0, :, 0], c[0, :, 3] = [0, 10_000], [90_000, 100_000];"
            "c[1, :, 0], c[1, :, 3] = [120_000, 130_000], [270_000, 200_000];"
            "c[2, :, 0], c[2, :, 3] = [320_000, 330_000], [400_000, 420_000];"
            "print(json.dumps(fused._chain_summary(c)))")
    summary = _fused_bench_json(code)
    assert summary["spans_us"] == [100.0, 150.0, 100.0] and summary["span_us_median"] == 100.0
    assert summary["gaps_us"] == [20.0, 50.0] and summary["gap_us_max"] == 50.0
    assert summary["gap_us_median"] == 35.0 and summary["per_call_us"] == 160.0 and summary["calls"] == 3


def test_a_traced_all_gather_call_is_summarized_from_its_program_records():
    """fused._trace_summary on records as the traced kernel writes them (start, tile, waits ended,
    end, SM; ns): two senders, two own tiles, two peer tiles whose waits end when the senders are
    done, on SMs 0-1. Times come out in us from the first start; an SM that held a sender and a
    tile at once counts two programs."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import numpy as np, fused;"
            "r = np.array([[1000, -1, 90000, 90000, 0], [1000, -1, 95000, 95000, 1],"
            "              [2000, 0, 2000, 100000, 0], [2000, 1, 2000, 101000, 1],"
            "              [100000, 2, 120000, 220000, 0], [101000, 3, 125000, 230000, 1]]);"
            "print(json.dumps(fused._trace_summary(r, 2)))")
    summary = _fused_bench_json(code)
    assert summary["span_us"] == 229.0
    assert summary["senders_done_us"] == {"min": 89.0, "median": 91.5, "max": 94.0}
    assert summary["own_tiles_end_us"]["max"] == 100.0
    assert summary["peer_tiles_waits_end_us"] == {"min": 119.0, "median": 121.5, "max": 124.0}
    assert summary["peer_tile_wait_us_median"] == 22.0
    assert summary["tile_compute_us_median"] == 99.5
    assert summary["most_programs_at_once_on_one_sm"] == 2 and summary["sms_used"] == 2


def test_a_traced_folded_reduce_scatter_call_is_summarized_from_its_program_records():
    """fused._reduce_scatter_trace_summary on records as the traced folded kernel writes them
    (start, place, waits ended, end, SM, matmul ended; ns) for two sources: places 0 and 2 are
    tiles of the peer's chunk (their `waits ended` is when their flag was set), 1 and 3 of the own
    chunk (stored, waited for the peer's partial, summed). Times come out in us."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import numpy as np, fused;"
            "r = np.array([[0, 0, 110000, 110000, 0, 100000], [0, 1, 130000, 140000, 1, 100000],"
            "              [0, 2, 114000, 114000, 2, 100000], [10000, 3, 150000, 170000, 0, 120000]]);"
            "print(json.dumps(fused._reduce_scatter_trace_summary(r, 2)))")
    summary = _fused_bench_json(code)
    assert summary["span_us"] == 170.0
    assert summary["peer_chunks"]["matmul_us_median"] == 100.0
    assert summary["peer_chunks"]["store_and_flag_us_median"] == 12.0
    assert summary["own_chunk"]["matmul_us_median"] == 105.0
    assert summary["own_chunk"]["store_and_wait_us_median"] == 30.0
    assert summary["own_chunk"]["reduce_us_median"] == 15.0
    assert summary["own_chunk"]["end_us"] == {"min": 140.0, "median": 155.0, "max": 170.0}
    assert summary["most_programs_at_once_on_one_sm"] == 2 and summary["sms_used"] == 3


def test_every_single_measure_mode_of_the_fused_bench_is_a_flag():
    """benchmarks/fused.py --help lists each of SINGLE_MEASURE_MODES (which replace the full run) as
    a --*-only flag."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import fused;"
            "print(json.dumps(sorted(fused.SINGLE_MEASURE_MODES)))")
    modes = _fused_bench_json(code)
    shown = subprocess.run([sys.executable, "benchmarks/fused.py", "--help"], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout
    assert "sweep_only" in modes and "all_to_all_trace_only" in modes
    for mode in modes:
        assert f"--{mode.replace('_', '-')}" in shown, mode


def test_a_traced_all_to_all_call_is_summarized_from_its_program_records():
    """fused._all_to_all_trace_summary on records as the traced kernel writes them (start, place,
    waits ended, end, SM, matmul ended, stored; ns) for two sources: places 0 and 2 compute tiles
    for the peer (stored here and flagged), 1 and 3 tiles of the own chunk, which then wait for the
    peer's tile and copy it out."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import numpy as np, fused;"
            "r = np.array([[0, 0, 104000, 104000, 0, 100000, 104000], [0, 1, 110000, 120000, 1, 100000, 101000],"
            "              [0, 2, 106000, 106000, 2, 100000, 106000], [5000, 3, 120000, 132000, 0, 110000, 112000]]);"
            "print(json.dumps(fused._all_to_all_trace_summary(r, 2)))")
    summary = _fused_bench_json(code)
    assert summary["span_us"] == 132.0 and summary["matmul_us_median"] == 100.0
    assert summary["sending"]["store_and_flag_us_median"] == 5.0
    assert summary["own_chunk"]["store_us_median"] == 1.5
    assert summary["copy_out"]["wait_us_median"] == 8.5 and summary["copy_out"]["copy_us_median"] == 11.0
    assert summary["copy_out"]["end_us"] == {"min": 120.0, "median": 126.0, "max": 132.0}
    assert summary["most_programs_at_once_on_one_sm"] == 2 and summary["sms_used"] == 3


def test_a_traced_all_to_all_call_with_movers_keeps_their_records_apart():
    """The movers' records (negative places, written after the programs') are counted apart: the
    programs' figures are those of the same call without them, and the movers say when they ended."""
    code = ("import sys, json; sys.path.insert(0, 'benchmarks'); import numpy as np, fused;"
            "r = np.array([[0, 0, 104000, 104000, 0, 100000, 104000], [0, 1, 110000, 120000, 1, 100000, 101000],"
            "              [0, 2, 106000, 106000, 2, 100000, 106000], [5000, 3, 120000, 132000, 0, 110000, 112000],"
            "              [0, -1, 0, 140000, 4, 0, 0], [1000, -2, 1000, 90000, 5, 0, 0]]);"
            "print(json.dumps(fused._all_to_all_trace_summary(r, 2)))")
    summary = _fused_bench_json(code)
    assert summary["span_us"] == 132.0 and summary["copy_out"]["wait_us_median"] == 8.5
    assert summary["sms_used"] == 3
    assert summary["movers"] == {"count": 2, "end_us": {"min": 90.0, "median": 115.0, "max": 140.0}}


def test_nccl_eps_pair_joins_the_moe_row_of_its_token_count(tmp_path):
    """moe.py --nccl-ep: the committed nccl_ep.json (2 x H200, 128 tokens) beside jaxgin's rows, its
    slowest rank's pair over jaxgin_pair; only the row of its token count gets it."""
    moe = _benchmark_module("moe")
    committed = ROOT / "benchmarks" / "results" / "2xh200" / "nccl_ep.json"
    held = json.loads(committed.read_text())
    anchor = moe.nccl_ep_anchor(committed, hidden=7168, experts=256, top_k=8, devices=2)
    assert (anchor["tokens"], anchor["pair_us"]) == (128, held["worst"]["pair_us"])
    assert anchor["pair_graph_us"] == held["worst"]["pair_graph_us"] and anchor["library"] == held["library"]
    rows = [{"tokens": 128, "times_us": {"jaxgin_pair": 50.0}}, {"tokens": 4096, "times_us": {"jaxgin_pair": 400.0}},
            {"tokens": 128, "times_us": {}}]
    moe.with_nccl_ep(rows, anchor)
    assert rows[0]["speedup_vs_nccl_ep"] == pytest.approx(held["worst"]["pair_us"] / 50.0)
    assert rows[0]["nccl_ep"] is anchor and "nccl_ep" not in rows[1]
    assert rows[2]["speedup_vs_nccl_ep"] is None  # no pair timed (--only without jaxgin_pair)


def test_an_nccl_ep_file_of_other_shapes_is_refused_naming_them(tmp_path):
    moe = _benchmark_module("moe")
    committed = ROOT / "benchmarks" / "results" / "2xh200" / "nccl_ep.json"
    with pytest.raises(ValueError, match=r"hidden 7168 \(this run: 4096\); devices 2 \(this run: 4\)"):
        moe.nccl_ep_anchor(committed, hidden=4096, experts=256, top_k=8, devices=4)
    with pytest.raises(ValueError, match="not readable"):
        moe.nccl_ep_anchor(tmp_path / "absent.json", hidden=7168, experts=256, top_k=8, devices=2)
    (tmp_path / "other.json").write_text(json.dumps({"hidden": 7168, "experts": 256, "top_k": 8, "devices": 2}))
    with pytest.raises(ValueError, match="no tokens or worst.pair_us"):
        moe.nccl_ep_anchor(tmp_path / "other.json", hidden=7168, experts=256, top_k=8, devices=2)
