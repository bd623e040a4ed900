"""tools/acceptance.py: the issues' "Done when" bars read off a machine's results, on the committed
files and on small files written here (CPU only, no jaxgin)."""

import importlib.util
import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
spec = importlib.util.spec_from_file_location("acceptance", ROOT / "tools" / "acceptance.py")
acceptance = importlib.util.module_from_spec(spec)
sys.modules["acceptance"] = acceptance
spec.loader.exec_module(acceptance)
PASS, FAIL, MISSING = acceptance.PASS, acceptance.FAIL, acceptance.MISSING
TILE_CODE = "Triton tile code >= 0.95x cuBLAS at {}"
MiB = 1 << 20


def rows_by_bar(directory: Path) -> dict:
    return {row.bar: row for row in acceptance.report(directory)}


def write(directory: Path, name: str, content) -> None:
    (directory / name).write_text(content if isinstance(content, str) else json.dumps(content))


def test_tile_code_against_cublas_is_what_the_committed_fused_json_holds():
    # whatever run the committed file holds (it is re-measured): the figure is the file's own ratio,
    # judged against the bar
    rows = rows_by_bar(RESULTS / "4xh100")
    held = {(r["m"], r["k"], r["n"]): r for r in json.loads((RESULTS / "4xh100" / "fused.json").read_text())["shapes"]}
    for shape in acceptance.ISSUE_SHAPES:
        row = rows[TILE_CODE.format("x".join(map(str, shape)))]
        assert (row.source, row.issue) == ("fused.json", 44)
        assert row.figure == held[shape]["triton_vs_xla_matmul"]
        assert row.status == (PASS if row.figure >= 0.95 else FAIL)


def test_what_files_cannot_decide_is_missing_with_the_reason(tmp_path):
    write(tmp_path, "latency.json", {"results": [{"op": "ppermute", "bytes_per_device": size, "speedup": 1.5}
                                                 for size in (8, 4096, 65536)]})
    write(tmp_path, "moe.json", {"peer_copy_GBps": 400.0, "results": [{"tokens": 128, "times_us": {"jaxgin_pair": 60}}]})
    shape = {"m": 4096, "k": 7168, "n": 2048, "windowed_matmul_reduce_scatter_wrong_result": True}
    write(tmp_path, "fused.json", {"devices": 4, "shapes": [shape]})
    missing = {bar: row.detail for bar, row in rows_by_bar(tmp_path).items() if row.status == MISSING}
    store = missing["a Triton kernel's 1 GiB NVLink store >= 0.95x the peer copy"]
    assert "no tritongin_bandwidth_2gpu.json here" in store and "-k test_peer_ptr_bandwidth" in store
    every_size = missing["ppermute >= 1.1x XLA at every size, 8 B to 512 MiB"]
    assert "no collectives.json here" in every_size and "bench collectives" in every_size
    assert "measured 8 B to 64 KiB, not up to 512 MiB" in every_size
    assert "no fp8 entry" in missing["FP8 dispatch exact against its reference, with its time"]
    nccl_ep = missing["128 tokens: the pair >= 1.5x NCCL EP's pair in the same run"]
    assert "no nccl_ep beside the 128-token row" in nccl_ep and "bench nccl_ep moe_with_nccl_ep" in nccl_ep
    assert "wrong results" in missing["matmul_reduce_scatter >= 1.1x XLA's windowed einsum at 4096x7168x2048"]
    assert "no shapes row for 8192x4096x4096" in missing["matmul_reduce_scatter >= 1.1x XLA's windowed einsum at "
                                                         "8192x4096x4096"]
    assert rows_by_bar(tmp_path)["128 tokens: dispatch then combine back to back <= 50 us"].status == FAIL


def test_an_absent_file_is_missing_naming_the_command_that_writes_it(tmp_path):
    passing_results(tmp_path)
    for name in ("collectives.json", "moe.json", "tritongin_bandwidth_2gpu.json", "gpu-round.json"):
        (tmp_path / name).unlink()
    for bar, row in zip(acceptance.BARS, acceptance.report(tmp_path)):
        if "fused.json" in bar.files:
            assert row.status == PASS, row
            continue
        assert row.status == MISSING and row.figure is None, row
        for name in bar.files:
            assert f"no {name} here" in row.detail and acceptance.WRITTEN_BY[name] in row.detail, row
    moe = rows_by_bar(tmp_path)["128 tokens: dispatch then combine back to back <= 50 us"]
    assert "python3 tools/gpu_round.py bench moe" in moe.detail


@pytest.mark.parametrize("content", [
    "not json {", "[]", "{}", "NaN", '{"shapes": null, "results": {}, "tests": 5, "sweep": "M", "devices": "four"}',
    {"devices": 4, "shapes": [{"m": 4096, "k": 7168, "n": 2048, "triton_vs_xla_matmul": "fast", "xla_matmul_us": 0}],
     "sweep": [{"m": 512}], "results": [None, {"op": "ppermute", "bytes_per_device": 8, "speedup": None},
                                        {"tokens": 128, "times_us": None, "fp8": {}}],
     "tests": [{"name": None}, 3], "not_run": [None], "ratio_to_plain_copy": float("nan")},
])
def test_files_of_another_layout_are_missing_never_an_error(tmp_path, content):
    for name in acceptance.WRITTEN_BY:
        write(tmp_path, name, content)
    for row in acceptance.report(tmp_path):
        assert row.status == MISSING, row
        assert "unexpected layout" not in row.detail, row  # every judge names what it did not find


def test_an_older_file_without_a_field_names_the_field(tmp_path):
    write(tmp_path, "fused.json", {"devices": 4, "shapes": [{"m": 4096, "k": 7168, "n": 2048}]})
    rows = rows_by_bar(tmp_path)
    assert rows[TILE_CODE.format("4096x7168x2048")].detail.startswith("fused.json: 4096x7168x2048 has no "
                                                                        "triton_vs_xla_matmul")
    assert "no shapes row for 8192x4096x4096" in rows[TILE_CODE.format("8192x4096x4096")].detail


def passing_results(directory: Path) -> None:
    """The smallest files in which every bar a file can decide is met."""
    shapes = [{"m": m, "k": k, "n": n, "triton_vs_xla_matmul": 0.97, "triton_speedup_vs_unfused": 1.4,
               "triton_all_to_all_us": 100.0, "xla_matmul_us": 99.0, "triton_all_gather_speedup": 1.6,
               "reduce_scatter_speedup": 1.0, "triton_reduce_scatter_speedup": 1.35, "reduce_scatter_vs_windowed": 1.2,
               "all_gather_vs_windowed": 1.15, "all_gather_vs_pallas": 1.2} for m, k, n in acceptance.ISSUE_SHAPES]
    shapes.append({"m": 4096, "k": 4096, "n": 4096, "all_gather_vs_pallas": 1.12})
    write(directory, "fused.json", {"devices": 4, "shapes": shapes,
                                    "sweep": [{"m": m, "speedup_vs_unfused": 1.01} for m in (512, 1024, 8192)]})
    sizes = [8 << (3 * i) for i in range(9)] + [512 * MiB]  # 8 B ... 128 MiB, 512 MiB
    results = [{"op": op, "bytes_per_device": size, "speedup": 3.5, "xla_us": 14.0, "jaxgin_us": 4.0,
                "handler_calls_per_op": 0.0} for op in ("ppermute", "all_to_all") for size in sizes]
    results += [{"op": op, "bytes_per_device": size, "speedup": 1.6, "handler_calls_per_op": 0.05}
                for op in ("put_wait", "put_wait_from") for size in sizes if size <= 64 * MiB]
    results[0]["kernel_graph_us"] = 3.5
    write(directory, "collectives.json", {"devices": 4, "results": results})
    write(directory, "moe.json", {"devices": 4, "peer_copy_GBps": 400.0, "results": [
        {"tokens": 128, "blocks": None, "times_us": {"jaxgin_pair": 45.0, "jaxgin_dispatch_fp8": 30.0},
         "fp8": {"exact_against_its_reference": True}, "nccl_ep": {"pair_us": 72.0}, "speedup_vs_nccl_ep": 1.6},
        {"tokens": 4096, "blocks": None, "times_us": {"jaxgin_dispatch_fp8": 300.0},
         "effective_GBps": {"dispatch": 365.0, "combine": 380.0}, "fp8": {"exact_against_its_reference": True}}]})
    write(directory, "tritongin_bandwidth_2gpu.json", {"devices": 2, "bytes": 1 << 30, "ratio_to_plain_copy": 0.96,
                                                       "copy_correct": True})
    write(directory, "gpu-round.json", {"tests": [{"name": name, "outcome": "passed"} for name in (
        "test_fused_gpu.py::test_fused_ops_emulated_hosts[plain-2]",
        "test_tritongin_gpu.py::test_standalone_exchanges_emulated_hosts[2]",
        "test_ops_gpu.py::test_iterations[command_buffers-4]",
        "test_moe_gpu.py::test_moe_mixed_mesh_emulated_hosts[plain]",
        "test_fused_gpu.py::test_matmul_reduce_scatter_mixed_mesh_emulated_hosts")], "not_run": []})


def test_results_that_meet_the_bars_pass(tmp_path):
    passing_results(tmp_path)
    rows = acceptance.report(tmp_path)
    assert [row.bar for row in rows if row.status != PASS] == []
    figures = {row.bar: row.figure for row in rows}
    assert figures[TILE_CODE.format("8192x4096x4096")] == 0.97
    assert figures["ppermute at 8 B <= 1.3x the kernel chained in a CUDA graph"] == pytest.approx(4.0 / 3.5)
    assert figures["4096 tokens: dispatch >= 90 % of the peer-copy ceiling"] == pytest.approx(365 / 400)
    assert figures["matmul_reduce_scatter >= 1.3x the plain composition at 4096x7168x2048"] == 1.35  # the faster method
    # the faster of the two baselines is the one with the lower ratio
    assert figures["all_gather_matmul >= 1.1x the faster of windowed einsum and Pallas at 4096x7168x2048"] == 1.15
    assert figures["the ops' GPU tests under command buffers pass"] == "1/1 passed"


def test_a_figure_just_past_a_bar_fails_it(tmp_path):
    passing_results(tmp_path)
    fused = json.loads((tmp_path / "fused.json").read_text())
    fused["shapes"][1]["triton_vs_xla_matmul"] = 0.949
    fused["shapes"][0]["triton_all_to_all_us"] = 1.051 * fused["shapes"][0]["xla_matmul_us"]
    fused["sweep"][1]["speedup_vs_unfused"] = 0.99
    write(tmp_path, "fused.json", fused)
    moe = json.loads((tmp_path / "moe.json").read_text())
    moe["results"][1]["fp8"]["exact_against_its_reference"] = False
    moe["results"][0]["speedup_vs_nccl_ep"] = 1.49
    write(tmp_path, "moe.json", moe)
    failed = {row.bar: row for row in acceptance.report(tmp_path) if row.status == FAIL}
    assert failed.keys() == {TILE_CODE.format("8192x4096x4096"),
                             'method="triton" matmul_all_to_all <= 1.05x the matmul alone at 4096x7168x2048',
                             "the default method never below 1.0x XLA on the sweep",
                             "FP8 dispatch exact against its reference, with its time",
                             "128 tokens: the pair >= 1.5x NCCL EP's pair in the same run"}
    assert "lowest at M = 1024" in failed["the default method never below 1.0x XLA on the sweep"].detail
    assert "not exact against its reference at 4096 tokens" in failed["FP8 dispatch exact against its reference, "
                                                                      "with its time"].detail


def test_sizes_short_of_the_bar_are_missing_until_one_fails(tmp_path):
    def ppermute(speedups):
        return {"results": [{"op": "ppermute", "bytes_per_device": size, "speedup": s} for size, s in speedups.items()]}

    bar = "ppermute >= 1.1x XLA at every size, 8 B to 512 MiB"
    write(tmp_path, "latency.json", ppermute({8: 2.0, 4096: 1.5, 65536: 1.2}))
    row = rows_by_bar(tmp_path)[bar]
    assert (row.status, row.source, row.figure) == (MISSING, "latency.json", 1.2)
    assert "not up to 512 MiB" in row.detail and "no collectives.json here" in row.detail
    write(tmp_path, "latency.json", ppermute({8: 2.0, 4096: 1.05, 65536: 1.2}))
    row = rows_by_bar(tmp_path)[bar]
    assert (row.status, row.source, row.figure) == (FAIL, "latency.json", 1.05)
    assert "lowest at 4 KiB" in row.detail
    # collectives.json comes first: its figures, never a mix with latency.json's
    write(tmp_path, "collectives.json", ppermute({8: 1.3, 512 * MiB: 1.15}))
    row = rows_by_bar(tmp_path)[bar]
    assert (row.status, row.source, row.figure) == (PASS, "collectives.json", 1.15)


FAILED_4 = "failed: T::emulated_hosts[4]"


@pytest.mark.parametrize("tests, not_run, status, figure, detail", [
    ([("emulated_hosts[2]", "failed"), ("emulated_hosts[2]", "passed")], [], PASS, "1/1", "1 ran again"),
    ([("emulated_hosts[2]", "passed"), ("emulated_hosts[4]", "failed")], [], FAIL, "1/2", FAILED_4),
    ([("emulated_hosts[2]", "passed"), ("emulated_hosts[4]", "error")], [], FAIL, "1/2", FAILED_4),
    ([("emulated_hosts[2]", "skipped")], [], MISSING, "0/1", "skipped or never started: T::emulated_hosts[2]"),
    ([("emulated_hosts[2]", "passed")], ["emulated_hosts[8]: not started by the deadline"], MISSING, "1/2",
     "skipped or never started: T::emulated_hosts[8]"),
    ([("single_process[2]", "passed")], [], MISSING, None, "no tests matching"),
])
def test_round_outcomes(tmp_path, tests, not_run, status, figure, detail):
    """A bar read from gpu-round.json: a test run again counts by its last run; one failed fails the
    bar; one skipped or never started, or none at all, leaves it undecided."""
    name = "test_moe_gpu.py::test_moe_{}"
    write(tmp_path, "gpu-round.json", {"tests": [{"name": name.format(t), "outcome": outcome} for t, outcome in tests],
                                       "not_run": [name.format(entry) for entry in not_run]})
    row = rows_by_bar(tmp_path)["the MoE emulated and mixed-mesh GPU tests pass"]
    assert row.status == status, row
    assert row.figure == (figure and f"{figure} passed")
    assert detail.replace("T::", name.format("")) in row.detail, row


@pytest.mark.parametrize("machine", sorted(p.name for p in RESULTS.iterdir() if p.is_dir()))
def test_every_committed_machine_reads_without_surprises(machine):
    rows = acceptance.report(RESULTS / machine)
    assert len(rows) == len(acceptance.BARS)
    for row in rows:
        assert row.status in (PASS, FAIL, MISSING)
        assert "unexpected layout" not in row.detail, row  # the judges know every vintage committed
        assert row.figure is None or isinstance(row.figure, str) or math.isfinite(row.figure)


def test_the_command_line_prints_every_bar_and_writes_the_same_rows_as_json(tmp_path):
    out = tmp_path / "rows.json"
    results = tmp_path / "4xh100"
    results.mkdir()
    passing_results(results)
    write(results, "fused.json", {"devices": 4, "shapes": []})  # every fused bar MISSING
    done = subprocess.run([sys.executable, "tools/acceptance.py", str(results), "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr  # the verdicts do not set the exit status
    assert all(bar.text in done.stdout for bar in acceptance.BARS)
    fused = sum("fused.json" in bar.files for bar in acceptance.BARS)
    assert done.stdout.splitlines()[-1] == f"PASS {len(acceptance.BARS) - fused}, FAIL 0, MISSING {fused}"
    written = json.loads(out.read_text())
    assert written == [asdict(row) for row in acceptance.report(results)]
    assert set(written[0]) == {"issue", "bar", "figure", "status", "source", "detail"}


def test_a_directory_that_does_not_exist_is_an_error_naming_it(tmp_path):
    absent = tmp_path / "5xh100"
    done = subprocess.run([sys.executable, "tools/acceptance.py", str(absent)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert f"no results directory {absent}" in done.stderr and "Traceback" not in done.stderr
    with pytest.raises(FileNotFoundError, match="5xh100"):
        acceptance.report(absent)
