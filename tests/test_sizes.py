"""jaxgin.sizes: the one parser of byte sizes, for initialize(heap_size=), JAXGIN_*_BYTES and every
size on the command line (python -m jaxgin.stress, the benchmarks, the examples, the tools)."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import cli, sizes, stress

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("256MiB", 256 << 20),
        ("2GiB", 2 << 30),
        ("2gib", 2 << 30),
        (" 16 KiB ", 16 << 10),
        ("64KiB", 64 << 10),
        ("64kib", 64 << 10),
        ("1 GiB", 1 << 30),
        ("1MB", 10**6),
        ("64KB", 64 * 10**3),
        ("1kb", 1000),
        ("3GB", 3 * 10**9),
        ("4096", 4096),
        ("4096B", 4096),
        ("4096 b", 4096),
        (4096, 4096),
        (1, 1),
    ],
)
def test_parse_size(value, expected):
    assert sizes.parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "lots", "1.5GiB", "-1", "-1MiB", "12 TiB", "GiB", "1 GiBs", "0x100", "1e6"])
def test_parse_size_rejects_bad_strings(value):
    with pytest.raises(ValueError, match="heap_size") as excinfo:
        sizes.parse_size(value)
    assert "KiB, MiB, GiB (powers of 1024) or KB, MB, GB (powers of 1000)" in str(excinfo.value)


@pytest.mark.parametrize("value", ["64K", "1 m", "2G"])
def test_parse_size_refuses_a_bare_prefix_and_says_why(value):
    with pytest.raises(ValueError, match="write KiB or KB"):
        sizes.parse_size(value)


@pytest.mark.parametrize("value", [0, -4096, "0", "0MiB"])
def test_parse_size_rejects_non_positive(value):
    with pytest.raises(ValueError, match="heap_size must be positive"):
        sizes.parse_size(value)


def test_parse_size_minimum_names_it():
    assert sizes.parse_size("8B", "--max-bytes", minimum=8) == 8
    with pytest.raises(ValueError, match=r"--max-bytes must be at least 8 bytes, got '4B' \(4 bytes\)"):
        sizes.parse_size("4B", "--max-bytes", minimum=8)


@pytest.mark.parametrize("value", [True, False, None, 1.5, b"1GiB"])
def test_parse_size_rejects_other_types(value):
    with pytest.raises(TypeError, match="heap_size"):
        sizes.parse_size(value)


def test_parse_size_names_the_argument():
    with pytest.raises(ValueError, match="block_size"):
        sizes.parse_size("big", name="block_size")


def test_argument_type_for_argparse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-bytes", type=sizes.argument("--max-bytes"))
    assert parser.parse_args(["--max-bytes", "64KiB"]).max_bytes == 64 << 10
    assert parser.parse_args(["--max-bytes", "1 GiB"]).max_bytes == 1 << 30
    with pytest.raises(argparse.ArgumentTypeError, match="--max-bytes='64K' is not a size"):
        sizes.argument("--max-bytes")("64K")


@pytest.mark.parametrize("text, expected", [("64KiB", 64 << 10), ("65536", 65536), ("16MB", 16 * 10**6)])
def test_stress_takes_sizes(text, expected):
    assert stress.parser().parse_args(["--max-bytes", text]).max_bytes == expected


def test_stress_default_max_bytes():
    assert stress.parser().parse_args([]).max_bytes == 64 << 20


def _run(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_stress_refuses_a_bad_size_naming_it():
    out = _run("-m", "jaxgin.stress", "--max-bytes", "64K")
    assert out.returncode == 2, out.stderr
    assert "argument --max-bytes: --max-bytes='64K' is not a size" in out.stderr


@pytest.mark.parametrize("script, option", [
    ("benchmarks/collectives.py", "--max-bytes"),
    ("tools/profile_latency.py", "--bytes"),
    ("examples/triton_lsa_bandwidth.py", None),
])
def test_scripts_parse_sizes_with_the_same_parser(script, option):
    """A bad size stops the script at argument parsing with parse_size's message; a good one passes
    parsing (the script then goes on to what this machine lacks, or runs)."""
    bad = [option, "64K"] if option else ["64K"]
    out = _run(script, *bad)
    if script.startswith("examples/triton") and not cli.installed("triton"):
        assert out.returncode == cli.EXIT_MISSING_DEPENDENCY, out.stderr
        return
    assert out.returncode == 2, out.stderr
    assert "'64K' is not a size" in out.stderr and "write KiB or KB" in out.stderr
    if option:  # the example with a good size would move data on GPUs, or compile here
        good = _run(script, option, "64KiB")
        assert "is not a size" not in good.stderr
        assert good.returncode in (0, cli.EXIT_TOO_FEW_GPUS), good.stderr
