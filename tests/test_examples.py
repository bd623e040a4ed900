"""examples/ on a machine without GPUs, run as a newcomer runs them (subprocesses): the JAX examples
run the reference path and check themselves; the Triton ones compile and link their kernel for
sm_90a; a missing package ends any of them with one line naming it and the pip command
(jaxgin.cli.EXIT_MISSING_DEPENDENCY), never a traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import cli
from jaxgin.errors import NcclError, ToolchainError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))


def _env():
    # The examples set their own XLA_FLAGS (4 virtual CPU devices), as they do for a user.
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _run(script, *args):
    """The example as a newcomer runs it; it must end without a warning or a traceback on stderr
    (a first Triton example may report the device library's build there)."""
    out = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=_env())
    noise = [line for line in out.stderr.splitlines() if not line.startswith("jaxgin build [")]
    assert not noise, out.stderr
    return out


def _run_without(module, script):
    """`script` with `module` made unimportable, as in an environment without it."""
    code = (f"import runpy, sys; sys.modules[{module!r}] = None; sys.argv = [{script!r}]; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=_env())


def test_every_example_says_what_it_needs():
    for name in EXAMPLES:
        doc = (ROOT / "examples" / name).read_text().split('"""')[1]
        assert "Needs" in doc and 'pip install -e ' in doc, name


def test_quickstart_on_cpu():
    out = _run("quickstart.py")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "on 4 cpu devices: backend=reference, no NCCL, no heap allocated" in lines[0]
    assert "MiB" not in lines[0]  # reference mode allocates no heap, so it prints no heap size
    assert lines[1].startswith("exchange OK over the reference path")
    assert lines[2].startswith("JAX ops OK on 4 devices")


def test_fused_example_on_cpu():
    out = _run("fused_matmul_all_to_all.py")
    assert out.returncode == 0, out.stderr
    assert "matmul_all_to_all vs lax.all_to_all(x @ w): max relative difference" in out.stdout
    assert "no GPUs: ran jaxgin's reference path" in out.stdout


def test_moe_example_on_cpu():
    out = _run("moe_layer.py")
    assert out.returncode == 0, out.stderr
    assert "CPU devices (reference path)" in out.stdout and "jaxgin.moe.moe_layer" in out.stdout


@pytest.mark.parametrize("script, kernel", [("triton_ring_put.py", "ring_put"), ("triton_lsa_bandwidth.py", "push")])
def test_triton_examples_compile_and_link_without_gpus(toolchain, script, kernel):
    out = _run(script)
    assert out.returncode == 0, out.stderr
    assert f"compiled {kernel} and linked it with jaxgin's device library for sm_90a" in out.stdout
    assert "cubin" in out.stdout


@pytest.mark.parametrize("script", ["examples/triton_ring_put.py", "examples/triton_lsa_bandwidth.py"])
def test_triton_examples_without_triton_say_so(script):
    out = _run_without("triton", script)
    assert out.returncode == cli.EXIT_MISSING_DEPENDENCY, (out.stdout, out.stderr)
    assert out.stderr == (f"{Path(script).name}: needs triton (the kernel is a Triton kernel), which is not "
                          'installed: pip install -e ".[cuda]"\n')
    assert out.stdout == ""


@pytest.mark.parametrize("error", [ToolchainError, NcclError])
def test_missing_toolchain_ends_the_script_with_its_message(error, capsys):
    def main():
        raise error("found no nvcc. Install it with: pip install 'jaxgin[cuda]'")

    with pytest.raises(SystemExit) as excinfo:
        cli.run("examples/quickstart.py", main)
    assert excinfo.value.code == cli.EXIT_MISSING_DEPENDENCY
    assert capsys.readouterr().err == "quickstart.py: found no nvcc. Install it with: pip install 'jaxgin[cuda]'\n"
    assert cli.run("x.py", lambda a, b=0: a + b, 1, b=2) == 3
