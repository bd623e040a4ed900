"""Shared setup of jaxgin's test suite.

The suite runs on CPU (reference mode) with 8 emulated devices. JAX reads its platform and XLA
flags when it is first imported, so they are set here, before any test module imports jax. GPU
tests (tests/gpu) run their work in subprocesses with their own environment.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
# XLA compiling the suite's programs is most of its time (0.6 s a program in the MoE tests); LLVM at
# -O0 takes 30% less for them, and the programs' results are the same: the suite checks what they
# compute, not how fast the CPU code runs. A level the caller sets wins.
_FLAGS = {"--xla_force_host_platform_device_count": "8", "--xla_backend_optimization_level": "0"}
_given = os.environ.get("XLA_FLAGS", "").split()
_named = {flag.split("=")[0] for flag in _given}
os.environ["XLA_FLAGS"] = " ".join(_given + [f"{name}={value}" for name, value in _FLAGS.items() if name not in _named])

# Builds land in one cache per test session, unless the caller points JAXGIN_CACHE_DIR somewhere on
# purpose: shared by every test, by the subprocesses they run, and by pytest-xdist's workers, which
# inherit the variable from the process that made the cache (pytest itself, which also removes it),
# so that no test compiles what another already compiled. Triton's kernels go there too: every
# session compiles as on a fresh machine, and the user's own Triton cache is left alone.
_SESSION_CACHE: str | None = None
if not os.environ.get("JAXGIN_CACHE_DIR"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jaxgin-test-cache-")
    os.environ["JAXGIN_CACHE_DIR"] = _SESSION_CACHE
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_SESSION_CACHE, "triton"))

import pytest  # noqa: E402

REQUIRE_NVCC_VAR = "JAXGIN_REQUIRE_NVCC"
# A GPU test (tests/gpu) that skips fails instead under this setting, with the skip's reason: a GPU
# round on a machine that has everything (GPUs, NCCL >= 2.30, PyTorch) must run every test.
REQUIRE_GPU_VAR = "JAXGIN_TEST_REQUIRE_GPU"
GPU_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")


def nvcc_required() -> bool:
    """True when tests that need nvcc (and NCCL's headers) must fail instead of skipping (CI)."""
    return os.environ.get(REQUIRE_NVCC_VAR, "") == "1"


def skip_or_fail(reason: str) -> None:
    """Skips the current test, or fails it when JAXGIN_REQUIRE_NVCC=1."""
    if nvcc_required():
        pytest.fail(f"{reason} (and {REQUIRE_NVCC_VAR}=1 makes this a failure, not a skip)", pytrace=False)
    pytest.skip(f"{reason} (set {REQUIRE_NVCC_VAR}=1 to make this a failure)")


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler for `-n`: tests go to whichever worker is free, except that the
    tests of a module with a module-scoped fixture (a build, a compiled plugin) all go to one
    worker. xdist gives every worker its own module fixtures, and a second worker would compile the
    same thing again, or wait on the build cache's lock while the first one compiles. Those modules
    are handed out first: they hold the longest compiles."""
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class OneWorkerPerModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if _has_module_fixture(root / module) else nodeid

    return OneWorkerPerModuleFixture(config, log)


_MODULE_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope=[\"']module[\"']")


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.suffix == ".py" and _MODULE_FIXTURE.search(path.read_text()) is not None


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


def pytest_collection_finish(session):
    """With JAXGIN_ROUND_PLAN=FILE: what each collected GPU test needs, for tools/gpu_round.py
    (tests/gpu/round_plan.py), after -k and the like."""
    plan = os.environ.get("JAXGIN_ROUND_PLAN")
    if plan:
        import sys

        if GPU_TESTS not in sys.path:
            sys.path.insert(0, GPU_TESTS)
        import round_plan

        round_plan.write(plan, [item for item in session.items if str(item.path).startswith(GPU_TESTS)])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if (report.skipped and os.environ.get(REQUIRE_GPU_VAR) == "1" and not hasattr(report, "wasxfail")
            and str(item.path).startswith(GPU_TESTS)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, and {REQUIRE_GPU_VAR}=1 demands that every GPU test runs: {reason}"


@pytest.fixture(autouse=True)
def _finalize_jaxgin():
    """Every test starts and ends with jaxgin finalized."""
    import jaxgin

    jaxgin.finalize()
    yield
    jaxgin.finalize()


@pytest.fixture(scope="session")
def require():
    """``require(reason)`` skips the test, or fails it under JAXGIN_REQUIRE_NVCC=1."""
    return skip_or_fail


@pytest.fixture(scope="session")
def nvcc():
    """nvcc's path; skips the test when there is none (fails under JAXGIN_REQUIRE_NVCC=1)."""
    from jaxgin import build
    from jaxgin.errors import ToolchainError

    try:
        return build.find_nvcc()
    except ToolchainError as e:
        skip_or_fail(f"needs nvcc: {e}")


@pytest.fixture(scope="session")
def packaged_nccl():
    """The nvidia-nccl-cu13 package's NCCL; skips when absent (fails under JAXGIN_REQUIRE_NVCC=1)."""
    from jaxgin import nccl

    install = nccl.packaged_install()
    if install is None:
        skip_or_fail("needs the nvidia-nccl-cu13 package (pip install -e '.[test]')")
    return install


@pytest.fixture(scope="session")
def toolchain(nvcc, packaged_nccl, require):
    """What compiling tritongin kernels here needs: Triton, nvcc and NCCL's headers (the device
    library), the ptxas beside nvcc (compiling kernels with it). Returns the packaged NCCL install."""
    pytest.importorskip("triton")
    from jaxgin.errors import ToolchainError
    from jaxgin.triton_device import link

    try:
        link.ptxas()
    except ToolchainError as e:
        require(f"needs ptxas: {e}")
    return packaged_nccl


class FakeRuntime:
    """A runtime extension that answers only device_info (rank, lsa_rank, lsa_size per local GPU):
    what the ops' GPU lowering reads of the hosts (jaxgin.hosts.rank_hosts)."""

    def __init__(self, infos):
        self.infos = infos

    def device_info(self, i):
        return self.infos[i]


def sm90_runtime(monkeypatch) -> None:
    """jaxgin.triton_call's view of the runtime, here as on an sm_90 GPU: a stand-in state (calls
    not recorded into command buffers; generation 0, as the tests' stand-in op states, so their heap
    buffers are live) and no device library link step."""
    import types

    from jaxgin import triton_op
    from jaxgin.triton_device import link

    device = types.SimpleNamespace(compute_capability="9.0")
    state = types.SimpleNamespace(runtime=object(), local_devices=[device], generation=0,
                                  capture=(False, "a stand-in runtime"), captured_lowered=False)
    monkeypatch.setattr(triton_op.runtime, "current", lambda: state)
    monkeypatch.setattr(link, "install", lambda: None)


def stand_in_kernels(monkeypatch, num_warps: int = 4) -> None:
    """jaxgin.triton_call traced here as on an sm_90 GPU (sm90_runtime), every kernel a stand-in
    (nothing is compiled): enough for make_jaxpr of a program that calls jaxgin's Triton kernels."""
    import types

    from jaxgin import triton_op

    sm90_runtime(monkeypatch)
    compiled = types.SimpleNamespace(asm={"cubin": b"\x7fELF"}, metadata=types.SimpleNamespace(
        name="stand_in", shared=0, num_warps=num_warps, num_ctas=1, global_scratch_size=0))
    monkeypatch.setattr(triton_op, "_compile", lambda *a, **k: compiled)


def equations(jaxpr):
    """Every equation of `jaxpr`, those of the jaxprs nested in its equations' parameters (shard_map's,
    jit's, a ClosedJaxpr's) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                yield from equations(inner)


def compile_for_sm90(kernel, signature: dict, constexprs: dict | None = None, num_warps: int = 4,
                     num_stages: int = 3, max_registers: int | None = None):
    """`kernel` compiled by Triton for sm_90a on this machine (no GPU needed), through
    jaxgin.triton_call's own compile step as it compiles jaxgin's kernels (pointers marked 16-byte
    aligned, FMA fusion asked for). `signature` names the runtime parameters; `constexprs` binds
    the rest; `max_registers` as triton_call's."""
    from jaxgin.triton_op import OWN_KERNELS_FP_FUSION, _compile

    constexprs = constexprs or {}
    signature = dict(signature) | {name: "constexpr" for name in constexprs if name not in signature}
    return _compile(kernel, signature, constexprs, num_warps, num_stages, (9, 0), OWN_KERNELS_FP_FUSION,
                    max_registers=max_registers)


def registers_per_thread(kernel) -> int:
    """The registers per thread ptxas gave a compiled kernel's entry function: the largest
    EIATTR_REGCOUNT record in the cubin's .nv.info sections (a linked device function has its own,
    smaller, record)."""
    import struct

    cubin = kernel.asm["cubin"]
    (section_table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)

    def section(i):  # name offset, type, flags, address, offset, size, link, info, align, entry size
        return struct.unpack_from("<IIQQQQIIQQ", cubin, section_table + i * entry_size)

    names = section(names_index)[4]
    counts = []
    for i in range(count):
        name_at, _, _, _, offset, size, *_ = section(i)
        if not cubin[names + name_at:].startswith(b".nv.info"):
            continue
        at = offset
        while at < offset + size:  # records: format, attribute, then a payload by format
            form, attribute = cubin[at], cubin[at + 1]
            if form == 0x04:  # sized payload
                (length,) = struct.unpack_from("<H", cubin, at + 2)
                if attribute == 0x2F:  # EIATTR_REGCOUNT: symbol index, registers
                    counts.append(struct.unpack_from("<II", cubin, at + 4)[1])
                at += 4 + length
            elif form in (0x01, 0x02, 0x03):  # no payload, 1-byte or 2-byte value
                at += {0x01: 2, 0x02: 4, 0x03: 4}[form]
            else:
                raise AssertionError(f"unknown .nv.info record format {form:#x}")
    assert counts, "no register count in the cubin"
    return max(counts)


def memory_operations(kernel) -> int:
    """Loads, stores and atomics in a compiled kernel's Triton IR: its size as the compiler's
    layout passes see it (their time grows faster than it)."""
    return len(re.findall(r"\btt\.(?:load|store|atomic_\w+)\b", kernel.asm["ttir"]))


def triton_interpreter_check(name: str) -> list[dict]:
    """The cases tests/triton_interpreter.py checked for `name` (fp8, placement, tile_order): it
    runs jaxgin's pure Triton device functions in Triton's interpreter, in a process of its own."""
    pytest.importorskip("triton")
    script = Path(__file__).with_name("triton_interpreter.py")
    done = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def gpu_scenario(name: str):
    """tests/gpu/<name>.py as a module: the GPU scenarios' collective-free loop oracles are checked
    on CPU against the collective references (tests/test_fused.py, tests/test_moe.py)."""
    import importlib
    import sys

    gpu_tests = str(Path(__file__).with_name("gpu"))
    if gpu_tests not in sys.path:
        sys.path.insert(0, gpu_tests)
    return importlib.import_module(name)
