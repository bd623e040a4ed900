"""The "Done when" bars of issues 44, 45, 48 and 54, read off one machine's benchmark
results (benchmarks/results/<machine>/), so that whether a round met them is a command, not a
reading of JSON by hand.

    python3 tools/acceptance.py benchmarks/results/4xh100 [--json OUT]

Per bar: the measured figure, the bar, and PASS, FAIL or MISSING; MISSING says which file or field
is absent and which command writes it. The bars compare figures "from one run", so every ratio is
taken from one file. Where two files can hold a bar's figures (collectives.json or latency.json;
fused.json's sweep or fused_sweep.json) the first that decides it is used, and the row names it.
Bars that are test outcomes read gpu-round.json's tests: PASS when every test the bar names passed
(a test run twice counts by its last run), FAIL when one failed, MISSING when none ran or one was
skipped or never started. Bars no file records (CI green) are left out. --json OUT writes the same
rows as a list of {"issue", "bar", "figure", "status", "source", "detail"}.

Exit status 0 whatever the bars say; 2 when the directory does not exist.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

PASS, FAIL, MISSING = "PASS", "FAIL", "MISSING"
ISSUE_SHAPES = ((4096, 7168, 2048), (8192, 4096, 4096))  # M x K x N of issues 44 and 54
MiB = 1 << 20

# The command that writes each file the bars read: tools/gpu_round.py's steps, or the round's test
# that records it (tests/gpu's `record`).
WRITTEN_BY = {
    "fused.json": "python3 tools/gpu_round.py bench fused [benchmarks/fused.py --out DIR]",
    "fused_sweep.json": "python3 tools/gpu_round.py bench fused_sweep [benchmarks/fused.py --sweep-only]",
    "collectives.json": "python3 tools/gpu_round.py bench collectives [benchmarks/collectives.py --out DIR]",
    "latency.json": "python3 tools/gpu_round.py bench latency [benchmarks/collectives.py --max-bytes 64KiB "
                    "--name latency]",
    "moe.json": "python3 tools/gpu_round.py bench moe [benchmarks/moe.py --out DIR; with NCCL EP's pair: "
                "bench nccl_ep moe_with_nccl_ep]",
    "tritongin_bandwidth_2gpu.json": "python3 tools/gpu_round.py run -k test_peer_ptr_bandwidth "
                                     "[tests/gpu/test_tritongin_gpu.py records it]",
    "gpu-round.json": "python3 tools/gpu_round.py run [or start, then wait]",
}


class Missing(Exception):
    """A figure a bar needs is not in the file; the message says which."""


@dataclass
class Bar:
    issue: int
    text: str
    files: tuple[str, ...]  # where its figures may be, in order of preference
    judge: Callable[[dict], tuple]  # the loaded file -> (figure, status, detail); raises Missing
    unit: str = "x"


@dataclass
class Row:
    issue: int
    bar: str
    figure: float | str | None
    status: str
    source: str
    detail: str


def at_least(figure: float, bar: float, detail: str) -> tuple:
    return figure, PASS if figure >= bar else FAIL, detail


def at_most(figure: float, bar: float, detail: str) -> tuple:
    return figure, PASS if figure <= bar else FAIL, detail


def number(mapping, key: str, where: str) -> float:
    """mapping[key] as a float, or Missing naming the key and where it was looked for."""
    value = mapping.get(key) if isinstance(mapping, dict) else None
    if value is None:
        raise Missing(f"{where} has no {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN: not measured
        raise Missing(f"{where}: {key} is {value!r}, not a measured number")
    return float(value)


def measured(row: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """Those of `keys` that `row` holds as measured numbers."""
    found = {}
    for key in keys:
        try:
            found[key] = number(row, key, "")
        except Missing:
            pass
    return found


def rows_of(data, key: str) -> list[dict]:
    rows = data.get(key) if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise Missing(f"no {key} list")
    return [row for row in rows if isinstance(row, dict)]


def shape_text(shape) -> str:
    return "x".join(map(str, shape))


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def listed(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


# benchmarks/fused.py: one row per M x K x N in "shapes", its ratios XLA's time over jaxgin's.

def fused_row(data, shape) -> dict:
    for row in rows_of(data, "shapes"):
        if (row.get("m"), row.get("k"), row.get("n")) == tuple(shape):
            return row
    raise Missing(f"no shapes row for {shape_text(shape)}")


def pallas_docs_shape(data) -> tuple[int, int, int]:
    """all_gather_matmul at the shape JAX's Pallas collective matmul documents: 1024 rows per
    shard, K = N = 4096 (fused.json's M is the gathered rows)."""
    return 1024 * int(number(data, "devices", "the file")), 4096, 4096


def fused_ratio(shape, key: str, bar: float) -> Callable:
    def judge(data):
        value = number(fused_row(data, shape), key, shape_text(shape))
        return at_least(value, bar, f"{key} = {value:.3f}")
    return judge


def triton_all_to_all_over_matmul(shape) -> Callable:
    def judge(data):
        row, where = fused_row(data, shape), shape_text(shape)
        fused, matmul = number(row, "triton_all_to_all_us", where), number(row, "xla_matmul_us", where)
        return at_most(fused / matmul, 1.05, f"triton_all_to_all_us {fused:.1f} / xla_matmul_us {matmul:.1f}")
    return judge


def reduce_scatter_over_plain(shape) -> Callable:
    """The faster jaxgin method against XLA's psum_scatter(x @ w), as fused.py's windowed ratio
    also takes the faster one."""
    def judge(data):
        row = fused_row(data, shape)
        ratios = measured(row, ("reduce_scatter_speedup", "triton_reduce_scatter_speedup"))
        if not ratios:
            raise Missing(f"{shape_text(shape)} has no reduce_scatter_speedup")
        best = max(ratios, key=ratios.get)
        return at_least(ratios[best], 1.3, f"{best} = {ratios[best]:.3f}")
    return judge


def windowed_why(row: dict, op: str) -> str:
    """Why fused.json's row has no ratio against XLA's windowed einsum for `op`."""
    if not any(key.startswith("windowed") for key in row):
        return "no windowed einsum rows at this shape (fused.py times it at the issue's shapes only)"
    wrong = [key for key in row if key.startswith("windowed") and key.endswith(f"{op}_wrong_result")]
    if wrong and all(row[key] for key in wrong):
        return f"XLA's windowed einsum gave wrong results (windowed*_{op}_wrong_result): no baseline"
    return f"no right windowed einsum result for {op}"


def reduce_scatter_over_windowed(shape) -> Callable:
    def judge(data):
        row = fused_row(data, shape)
        if "reduce_scatter_vs_windowed" not in row:
            raise Missing(f"{shape_text(shape)} has no reduce_scatter_vs_windowed: "
                          + windowed_why(row, "matmul_reduce_scatter"))
        value = number(row, "reduce_scatter_vs_windowed", shape_text(shape))
        return at_least(value, 1.1, f"reduce_scatter_vs_windowed = {value:.3f}")
    return judge


def all_gather_over_strongest(shape=None) -> Callable:
    """all_gather_matmul against the faster of the right baselines the row has: XLA's windowed
    einsum and JAX's Pallas kernel (each ratio is the baseline's time over jaxgin's faster method,
    so the lower ratio is the faster baseline). shape None: the Pallas docs' shape."""
    def judge(data):
        at = shape or pallas_docs_shape(data)
        row = fused_row(data, at)
        ratios = measured(row, ("all_gather_vs_windowed", "all_gather_vs_pallas"))
        absent = []
        if "all_gather_vs_windowed" not in ratios:
            absent.append(windowed_why(row, "all_gather_matmul"))
        if "all_gather_vs_pallas" not in ratios:
            absent.append("Pallas: " + str(row.get("pallas_all_gather_matmul_error", "no pallas rows"))[:200])
        if not ratios:
            raise Missing(f"{shape_text(at)} has no all_gather_vs_windowed or all_gather_vs_pallas: "
                          + "; ".join(absent))
        strongest = min(ratios, key=ratios.get)
        return at_least(ratios[strongest], 1.1, "; ".join([f"{strongest} = {ratios[strongest]:.3f}", *absent]))
    return judge


def default_method_on_the_sweep(data):
    # fused.json keeps the sweep under "sweep" (empty after --shapes-only); fused_sweep.json
    # (--sweep-only) keeps it as its "shapes"
    rows = rows_of(data, "sweep" if isinstance(data, dict) and "sweep" in data else "shapes")
    if not rows:
        raise Missing("an empty sweep (fused.py ran with --shapes-only)")
    ratios = {row.get("m"): number(row, "speedup_vs_unfused", f"sweep row M = {row.get('m')}") for row in rows}
    worst = min(ratios, key=ratios.get)
    return at_least(ratios[worst], 1.0, f"speedup_vs_unfused lowest at M = {worst} of M = "
                                        f"{', '.join(map(str, ratios))}")


def nvlink_store_over_peer_copy(data):
    ratio = number(data, "ratio_to_plain_copy", "the file")
    detail = (f"best Triton store {data.get('best_triton_GBs')} GB/s ({data.get('best_variant')}) over the peer "
              f"copy's {data.get('plain_peer_copy_GBs')} GB/s, {size_text(int(number(data, 'bytes', 'the file')))}")
    if data.get("copy_correct") is not True:
        return ratio, FAIL, "the copies were wrong (copy_correct); " + detail
    return at_least(ratio, 0.95, detail)


# benchmarks/collectives.py: one row per op and bytes per device in "results".

def collective_row(data, op: str, nbytes: int) -> dict:
    for row in rows_of(data, "results"):
        if row.get("op") == op and row.get("bytes_per_device") == nbytes:
            return row
    raise Missing(f"no {op} row at {size_text(nbytes)}")


def speedup_at_8_bytes(op: str) -> Callable:
    def judge(data):
        row = collective_row(data, op, 8)
        value = number(row, "speedup", f"{op} at 8 B")
        xla, ours = number(row, "xla_us", f"{op} at 8 B"), number(row, "jaxgin_us", f"{op} at 8 B")
        return at_least(value, 3.0, f"XLA {xla:.1f} us / jaxgin {ours:.1f} us")
    return judge


def over_the_kernel_chain(op: str) -> Callable:
    """jaxgin's op at 8 B over the ring exchange kernel chained in a CUDA graph, which collectives.py
    times in the same run beside the ppermute rows only."""
    def judge(data):
        ours = number(collective_row(data, op, 8), "jaxgin_us", f"{op} at 8 B")
        chain = number(collective_row(data, "ppermute", 8), "kernel_graph_us", "ppermute at 8 B")
        return at_most(ours / chain, 1.3, f"jaxgin {ours:.1f} us / kernel chain in a graph {chain:.1f} us")
    return judge


def speedup_at_every_size(op: str, bar: float, up_to: int) -> Callable:
    """op's speedup at every size up to `up_to` (the mailbox pairs' rows time XLA's ppermute as their
    XLA side): FAIL where one is below the bar, MISSING where all pass but the file stops short."""
    def judge(data):
        sizes = {row["bytes_per_device"]: row for row in rows_of(data, "results")
                 if row.get("op") == op and isinstance(row.get("bytes_per_device"), int)
                 and row["bytes_per_device"] <= up_to}
        ratios = {nbytes: number(row, "speedup", f"{op} at {size_text(nbytes)}") for nbytes, row in sizes.items()}
        if not ratios:
            raise Missing(f"no {op} rows")
        worst = min(ratios, key=ratios.get)
        detail = f"lowest at {size_text(worst)}; measured {size_text(min(ratios))} to {size_text(max(ratios))}"
        if ratios[worst] >= bar and max(ratios) < up_to:
            return ratios[worst], MISSING, f"{detail}, not up to {size_text(up_to)}"
        return at_least(ratios[worst], bar, detail)
    return judge


def handler_calls(data):
    calls = {(row.get("op"), row.get("bytes_per_device")): number(row, "handler_calls_per_op", f"{row.get('op')} row")
             for row in rows_of(data, "results")}
    if not calls:
        raise Missing("no rows")
    (op, nbytes), most = max(calls, key=calls.get), max(calls.values())
    return at_most(most, 0.1, f"most at {op} {size_text(nbytes)}; XLA_FLAGS={data.get('xla_flags')!r}")


# benchmarks/moe.py: one row per token count in "results" (rows with --blocks are comparisons).

def moe_row(data, tokens: int) -> dict:
    for row in rows_of(data, "results"):
        if row.get("tokens") == tokens and row.get("blocks") is None:
            return row
    raise Missing(f"no results row for {tokens} tokens")


def pair_at_128_tokens(data):
    value = number(moe_row(data, 128).get("times_us"), "jaxgin_pair", "times_us at 128 tokens")
    return at_most(value, 50.0, "times_us.jaxgin_pair")


def against_nccl_ep(data):
    row = moe_row(data, 128)
    if not isinstance(row.get("nccl_ep"), dict):
        raise Missing("no nccl_ep beside the 128-token row: NCCL EP's pair joins moe.json when moe.py runs "
                      "after nccl_ep.py in one round (python3 tools/gpu_round.py bench nccl_ep moe_with_nccl_ep)")
    value = number(row, "speedup_vs_nccl_ep", "the 128-token row")
    return at_least(value, 1.5, f"NCCL EP's pair {row['nccl_ep'].get('pair_us')} us over jaxgin_pair's "
                                f"{(row.get('times_us') or {}).get('jaxgin_pair')} us")


def share_of_the_ceiling(part: str) -> Callable:
    def judge(data):
        ceiling = number(data, "peer_copy_GBps", "the file")
        rate = number(moe_row(data, 4096).get("effective_GBps"), part, "effective_GBps at 4096 tokens")
        return at_least(rate / ceiling, 0.9, f"{rate:.1f} of the peer copy's {ceiling:.1f} GB/s")
    return judge


def fp8_dispatch(data):
    checked = [row for row in rows_of(data, "results") if isinstance(row.get("fp8"), dict)]
    if not checked:
        raise Missing("no fp8 entry in any results row (moe.py predates fp8 dispatch, or the hidden size is not "
                      "a multiple of 128)")
    times = {row.get("tokens"): number(row.get("times_us"), "jaxgin_dispatch_fp8", f"times_us at {row.get('tokens')}")
             for row in checked}
    detail = ", ".join(f"{tokens} tokens {us:.1f} us" for tokens, us in times.items())
    figure = next(iter(times.values()))  # the first token count's time (128: low latency); the rest in detail
    inexact = [str(row.get("tokens")) for row in checked if row["fp8"].get("exact_against_its_reference") is not True]
    if inexact:
        return figure, FAIL, f"not exact against its reference at {', '.join(inexact)} tokens; {detail}"
    return figure, PASS, f"exact against its reference; {detail}"


# tools/gpu_round.py's summary: {"tests": [{"name", "outcome", ...}], "not_run": ["name: why", ...]}.

def tests_pass(pattern: str) -> Callable:
    def judge(data):
        last, runs = {}, {}
        for test in rows_of(data, "tests"):
            name = str(test.get("name"))
            if re.search(pattern, name):
                last[name], runs[name] = test.get("outcome"), runs.get(name, 0) + 1
        never = [name for name in (str(entry).split(": ", 1)[0] for entry in data.get("not_run") or [])
                 if re.search(pattern, name) and name not in last]
        what = f"tests matching {pattern}" if pattern else "tests"
        if not last and not never:
            raise Missing(f"no {what}")
        failed = sorted(name for name, outcome in last.items() if outcome in ("failed", "error"))
        unpassed = sorted(name for name, outcome in last.items() if outcome not in ("passed", "failed", "error"))
        figure = f"{sum(outcome == 'passed' for outcome in last.values())}/{len(last) + len(never)} passed"
        if failed:
            return figure, FAIL, f"failed: {listed(failed)}"
        if unpassed or never:
            return figure, MISSING, f"skipped or never started: {listed(unpassed + never)}"
        again = sum(count > 1 for count in runs.values())
        return figure, PASS, f"{len(last)} {what}" + (f"; {again} ran again, their last run counts" if again else "")
    return judge


FUSED, MOE, ROUND = ("fused.json",), ("moe.json",), ("gpu-round.json",)
COLLECTIVES = ("collectives.json", "latency.json")  # latency.json: the same rows up to 64 KiB
SWEEP = ("fused.json", "fused_sweep.json")
BARS = [
    # 44: Triton kernels at cuBLAS speed
    *(Bar(44, f"Triton tile code >= 0.95x cuBLAS at {shape_text(s)}", FUSED,
          fused_ratio(s, "triton_vs_xla_matmul", 0.95)) for s in ISSUE_SHAPES),
    *(Bar(44, f'method="triton" matmul_all_to_all >= 1.35x XLA\'s unfused composition at {shape_text(s)}', FUSED,
          fused_ratio(s, "triton_speedup_vs_unfused", 1.35)) for s in ISSUE_SHAPES),
    *(Bar(44, f'method="triton" matmul_all_to_all <= 1.05x the matmul alone at {shape_text(s)}', FUSED,
          triton_all_to_all_over_matmul(s)) for s in ISSUE_SHAPES),
    *(Bar(44, f'method="triton" all_gather_matmul >= 1.5x XLA at {shape_text(s)}', FUSED,
          fused_ratio(s, "triton_all_gather_speedup", 1.5)) for s in ISSUE_SHAPES),
    Bar(44, "the default method never below 1.0x XLA on the sweep", SWEEP, default_method_on_the_sweep),
    Bar(44, "a Triton kernel's 1 GiB NVLink store >= 0.95x the peer copy", ("tritongin_bandwidth_2gpu.json",),
        nvlink_store_over_peer_copy),
    Bar(44, "the fused and tritongin emulated and mixed-mesh GPU tests pass", ROUND,
        tests_pass(r"test_(fused|tritongin)_gpu\.py::.*(emulated_hosts|mixed_mesh)"), ""),
    # 45: the JAX ops faster than XLA at every size, captured in CUDA graphs
    *(Bar(45, f"{op} at 8 B >= 3x XLA", COLLECTIVES, speedup_at_8_bytes(op)) for op in ("ppermute", "all_to_all")),
    *(Bar(45, f"{op} at 8 B <= 1.3x the kernel chained in a CUDA graph", COLLECTIVES, over_the_kernel_chain(op))
      for op in ("ppermute", "all_to_all")),
    *(Bar(45, f"{op} >= 1.1x XLA at every size, 8 B to 512 MiB", COLLECTIVES,
          speedup_at_every_size(op, 1.1, 512 * MiB)) for op in ("ppermute", "all_to_all")),
    *(Bar(45, f"put_signal + {wait} >= 1.5x XLA's ppermute at every size <= 16 MiB", COLLECTIVES,
          speedup_at_every_size(op, 1.5, 16 * MiB))
      for op, wait in (("put_wait", "wait_signal"), ("put_wait_from", "wait_signal_from"))),
    Bar(45, "jaxgin calls captured: handler calls per op ~0 (<= 0.1) in every row", COLLECTIVES, handler_calls, ""),
    Bar(45, "the ops' GPU tests under command buffers pass", ROUND,
        tests_pass(r"test_ops_gpu\.py::.*command_buffers"), ""),
    Bar(45, "the verification round passes, every test", ROUND, tests_pass(""), ""),
    # 48: MoE dispatch / combine against the real peers
    Bar(48, "128 tokens: dispatch then combine back to back <= 50 us", MOE, pair_at_128_tokens, " us"),
    Bar(48, "128 tokens: the pair >= 1.5x NCCL EP's pair in the same run", MOE, against_nccl_ep),
    *(Bar(48, f"4096 tokens: {part} >= 90 % of the peer-copy ceiling", MOE, share_of_the_ceiling(part))
      for part in ("dispatch", "combine")),
    Bar(48, "FP8 dispatch exact against its reference, with its time", MOE, fp8_dispatch, " us"),
    Bar(48, "the MoE emulated and mixed-mesh GPU tests pass", ROUND,
        tests_pass(r"test_moe_gpu\.py::.*(emulated_hosts|mixed_mesh)"), ""),
    # 54: matmul + reduce_scatter, and both halves against JAX's own best
    *(Bar(54, f"matmul_reduce_scatter >= 1.3x the plain composition at {shape_text(s)}", FUSED,
          reduce_scatter_over_plain(s)) for s in ISSUE_SHAPES),
    *(Bar(54, f"matmul_reduce_scatter >= 1.1x XLA's windowed einsum at {shape_text(s)}", FUSED,
          reduce_scatter_over_windowed(s)) for s in ISSUE_SHAPES),
    *(Bar(54, f"all_gather_matmul >= 1.1x the faster of windowed einsum and Pallas at {shape_text(s)}", FUSED,
          all_gather_over_strongest(s)) for s in ISSUE_SHAPES),
    Bar(54, "all_gather_matmul >= 1.1x the faster of windowed einsum and Pallas at the Pallas docs' shape", FUSED,
        all_gather_over_strongest()),
    Bar(54, "matmul_reduce_scatter's emulated and mixed-mesh GPU tests pass", ROUND,
        tests_pass(r"test_fused_gpu\.py::test_matmul_reduce_scatter.*(emulated_hosts|mixed_mesh)"), ""),
]


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise Missing(f"not readable as JSON ({type(e).__name__}: {e})") from e


def decide(bar: Bar, directory: Path, loaded: dict) -> Row:
    """The bar against the first of its files that decides it; else MISSING, with each file's reason
    and the command that writes it."""
    reasons, shown = [], None  # shown: the first file present, and the figure it had if any
    for name in bar.files:
        path = directory / name
        if not path.is_file():
            reasons.append(f"no {name} here; written by: {WRITTEN_BY[name]}")
            continue
        try:
            if name not in loaded:
                loaded[name] = load(path)
            figure, status, detail = bar.judge(loaded[name])
        except Missing as e:
            figure, status, detail = None, MISSING, str(e)
        except (LookupError, TypeError, ValueError, ArithmeticError, AttributeError) as e:
            # a layout no judge expected (a file of another vintage): a row that says so, not a crash
            figure, status, detail = None, MISSING, f"unexpected layout ({type(e).__name__}: {e})"
        if status != MISSING:
            return Row(bar.issue, bar.text, figure, status, name, detail)
        reasons.append(f"{name}: {detail}; written by: {WRITTEN_BY[name]}")
        shown = shown or (name, figure)
    source, figure = shown or (bar.files[0], None)
    return Row(bar.issue, bar.text, figure, MISSING, source, " | ".join(reasons))


def report(directory: Path) -> list[Row]:
    """One row per bar of BARS, in its order."""
    if not directory.is_dir():
        raise FileNotFoundError(f"no results directory {directory}")
    loaded: dict = {}
    return [decide(bar, directory, loaded) for bar in BARS]


def provenance(path: Path) -> str:
    """What a file says about the run that wrote it (machine, code, date), to judge "one run on the
    code being resolved"."""
    try:
        data = load(path)
    except Missing as e:
        return str(e)
    keys = ("devices", "device_kind", "device", "machine", "library_commit", "commit", "date", "jax", "nccl")
    found = [f"{key} {data[key]}" for key in keys if isinstance(data, dict) and isinstance(data.get(key), (str, int))]
    return ", ".join(found) or "no machine or commit recorded"


def figure_text(row: Row, unit: str) -> str:
    if isinstance(row.figure, float):
        return f"{row.figure:.2f}{unit}"
    return "-" if row.figure is None else str(row.figure)


def print_report(directory: Path, rows: list[Row]) -> None:
    print(f"Done-when bars of issues 44, 45, 48, 54 against {directory} (the bars ask for a 4-GPU machine)")
    for name in sorted({row.source for row in rows if (directory / row.source).is_file()}):
        print(f"  {name}: {provenance(directory / name)}")
    for bar, row in zip(BARS, rows):
        print(f"{row.issue}  {row.status:7s}  {figure_text(row, bar.unit):>14s}  {row.bar}")
        # a MISSING row's detail names each file it looked for
        print(" " * 28 + (row.detail if row.status == MISSING else f"{row.source}: {row.detail}"))
    counts = {status: sum(row.status == status for row in rows) for status in (PASS, FAIL, MISSING)}
    print(", ".join(f"{status} {count}" for status, count in counts.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="a machine's results, e.g. benchmarks/results/4xh100")
    parser.add_argument("--json", type=Path, metavar="OUT", help="also write the rows to OUT as JSON")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"no results directory {args.directory}")
    rows = report(args.directory)
    print_report(args.directory, rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
