"""Shared setup of jaxgin's test suite.

The suite runs on CPU (reference mode) with 8 emulated devices. JAX reads its platform and XLA
flags when it is first imported, so they are set here, before any test module imports jax. GPU
tests (tests/gpu) run their work in subprocesses with their own environment.
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_COUNT_FLAG not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_COUNT_FLAG}".strip()

# Builds land in one cache per test session (shared by every test and the subprocesses they run),
# unless the caller points JAXGIN_CACHE_DIR somewhere on purpose.
_SESSION_CACHE: str | None = None
if not os.environ.get("JAXGIN_CACHE_DIR"):
    _SESSION_CACHE = tempfile.mkdtemp(prefix="jaxgin-test-cache-")
    os.environ["JAXGIN_CACHE_DIR"] = _SESSION_CACHE

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
    library), nvJitLink (linking it in). Returns the packaged NCCL install."""
    pytest.importorskip("triton")
    from jaxgin.errors import ToolchainError
    from jaxgin.triton import link

    try:
        link.nvjitlink()
    except ToolchainError as e:
        require(f"needs nvJitLink: {e}")
    return packaged_nccl


def compile_for_sm90(kernel, signature: dict, constexprs: dict | None = None, num_warps: int = 4,
                     num_stages: int = 3):
    """`kernel` compiled by Triton for sm_90a on this machine (no GPU needed), through
    jaxgin.triton_call's own compile step as it compiles jaxgin's kernels (pointers marked 16-byte
    aligned, FMA fusion asked for). `signature` names the runtime parameters; `constexprs` binds
    the rest."""
    from jaxgin.triton_call import OWN_KERNELS_FP_FUSION, _compile

    constexprs = constexprs or {}
    signature = dict(signature) | {name: "constexpr" for name in constexprs if name not in signature}
    return _compile(kernel, signature, constexprs, num_warps, num_stages, (9, 0), OWN_KERNELS_FP_FUSION)


def gpu_scenario(name: str):
    """tests/gpu/<name>.py as a module: the GPU scenarios' collective-free loop oracles are checked
    on CPU against the collective references (tests/test_fused.py, tests/test_moe.py)."""
    import importlib
    import sys
    from pathlib import Path

    gpu_tests = str(Path(__file__).with_name("gpu"))
    if gpu_tests not in sys.path:
        sys.path.insert(0, gpu_tests)
    return importlib.import_module(name)
