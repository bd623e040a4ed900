"""Which registration a jaxgin call lowers to: the twin XLA may record into command buffers, or the
one XLA runs as its own step (jaxgin/ffi/capture.py). The GPU side (recorded calls, results equal
to jax.lax's, handler calls per op) is tests/gpu/test_ops_gpu.py's."""

from __future__ import annotations

import types

import pytest

from jaxgin.ffi import capture

MODE = "--xla_gpu_command_buffer_scheduling_mode"
OLD = "--xla_gpu_graph_enable_concurrent_region"


@pytest.mark.parametrize("flags, found", [
    ("", None),
    ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1", None),
    (f"{MODE}=LHS", None),
    (f"{MODE}=SERIALIZE", None),
    (f"{MODE}=CONCURRENT", f"{MODE}=CONCURRENT"),
    (f"{MODE}=concurrent_regions", f"{MODE}=concurrent_regions"),
    (f"{MODE}=1", f"{MODE}=1"),
    (f"{MODE}=CONCURRENT {MODE}=LHS", None),  # the last setting counts
    (f"{MODE}=LHS {MODE}=CONCURRENT", f"{MODE}=CONCURRENT"),
    (f"{OLD}=true", f"{OLD}=true"),
    (OLD, OLD),
    (f"{OLD}=false", None),
    (f"{OLD}=false --xla_gpu_enable_command_buffer=", None),
])
def test_the_flags_that_let_xla_run_graph_commands_side_by_side(flags, found):
    assert capture.concurrent_flag(flags) == found


def test_the_decision_and_its_reason():
    assert capture.decide(enabled=None, xla_flags="", proxy_gin_peers=False)[0] is True
    assert capture.decide(enabled=True, xla_flags=f"{MODE}=SERIALIZE", proxy_gin_peers=False)[0] is True
    off, why = capture.decide(enabled=False, xla_flags="", proxy_gin_peers=False)
    assert not off and "JAXGIN_COMMAND_BUFFERS=0" in why
    off, why = capture.decide(enabled=None, xla_flags=f"{MODE}=CONCURRENT", proxy_gin_peers=False)
    assert not off and f"{MODE}=CONCURRENT" in why and "exchange channel" in why
    off, why = capture.decide(enabled=None, xla_flags="", proxy_gin_peers=True)
    assert not off and "proxy" in why


def _state(*, gin_contexts=0, lsa_size=2, world=2, gin_type=0, force_gin=False):
    device = {"gin_contexts": gin_contexts, "lsa_size": lsa_size, "gin_type": gin_type}
    return types.SimpleNamespace(
        capture=None, captured_lowered=False, world_size=world, options=types.SimpleNamespace(force_gin=force_gin),
        runtime=types.SimpleNamespace(device_info=lambda i: device))


@pytest.mark.parametrize("case, captured", [
    (dict(), True),  # NVLink only
    (dict(gin_contexts=4, gin_type=2), True),  # NCCL's proxy GIN exists but no peer uses it
    (dict(gin_contexts=4, gin_type=2, lsa_size=1), False),  # other hosts through the proxy
    (dict(gin_contexts=4, gin_type=2, force_gin=True), False),
    (dict(gin_contexts=4, gin_type=3, lsa_size=1), True),  # GDAKI: the GPU rings the NIC itself
])
def test_each_op_lowers_to_the_twin_where_the_job_allows(monkeypatch, case, captured):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAXGIN_COMMAND_BUFFERS", raising=False)
    state = _state(**case)
    names = {op: capture.target_for(op, state) for op in
             ("jaxgin.ppermute", "jaxgin.all_to_all", "jaxgin.put_signal", "jaxgin.wait_signal",
              "jaxgin.wait_signal_from", "jaxgin.triton_call")}
    assert all(name.endswith("_captured") == captured for name in names.values()), names
    assert state.captured_lowered is captured
    assert capture.target_for("jaxgin.fused.matmul_all_to_all", state) == "jaxgin_matmul_all_to_all"


def test_one_decision_per_runtime(monkeypatch):
    """Every program of a runtime lowers to the same targets: the decision is made once."""
    monkeypatch.delenv("JAXGIN_COMMAND_BUFFERS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "")
    state = _state()
    assert capture.target_for("jaxgin.ppermute", state) == "jaxgin_exchange_captured"
    monkeypatch.setenv("XLA_FLAGS", f"{MODE}=CONCURRENT")
    monkeypatch.setenv("JAXGIN_COMMAND_BUFFERS", "0")
    assert capture.target_for("jaxgin.ppermute", state) == "jaxgin_exchange_captured"
    fresh = _state()
    assert capture.target_for("jaxgin.ppermute", fresh) == "jaxgin_exchange"
    assert "JAXGIN_COMMAND_BUFFERS=0" in capture.policy(fresh)[1]
    monkeypatch.setenv("JAXGIN_COMMAND_BUFFERS", "maybe")
    with pytest.raises(ValueError, match="JAXGIN_COMMAND_BUFFERS='maybe'"):
        capture.policy(_state())
