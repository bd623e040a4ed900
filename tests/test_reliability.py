"""Issue 7's CPU parts: the randomized stress harness (jaxgin.stress) in reference mode, and proof
that it catches a wrong result. The GPU runs (10,000 ops with and without command buffers, a peer
that dies) are in tests/gpu/test_reliability_gpu.py."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxgin
from jaxgin import stress


@pytest.fixture
def mesh4():
    jaxgin.initialize()
    return Mesh(np.array(jax.devices()[:4]), ("x",))


def test_random_ops_equal_lax_in_reference_mode(mesh4):
    result = stress.stress(mesh4, 300, seed=7, max_bytes=64 << 10)
    assert result["ops"] == 300 and result["mismatches"] == 0, result
    assert all(count > 0 for count in result["by_op"].values()), result["by_op"]
    assert result["sizes"][0] == 0 and result["sizes"][-1] == 64 << 10
    # the replays run the first run's ops again (memory growth over the last is then a leak, not a
    # new high-water mark); 300 ops: three runs of 100
    first, replay, last = result["by_op_runs"]
    assert first == replay == last and sum(first.values()) == 100, result["by_op_runs"]


@pytest.mark.parametrize("broken", ["ppermute", "all_to_all", "wait_signal"])
def test_stress_catches_a_wrong_result(mesh4, monkeypatch, broken):
    """A harness that cannot fail proves nothing: swap in an op that is wrong and count mismatches."""
    original = getattr(jaxgin, broken)

    def wrong(*args, **kwargs):
        out = original(*args, **kwargs)
        return out + 1 if out.size else out  # every element off (empty messages stay correct)

    monkeypatch.setattr(jaxgin, broken, wrong)
    result = stress.stress(mesh4, 200, seed=3, max_bytes=4096)
    assert result["mismatches"] > 0, result


def test_sizes_cover_zero_to_max():
    assert stress._sizes(64 << 20) == [0, 8, 24, 1000, 4096, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24,
                                       1 << 26]
    assert stress._sizes(5000) == [0, 8, 24, 1000, 4096, 5000]


class _FakeKeyValueStore:
    """The two calls of jax.distributed's client that the NCCL agreement uses."""

    def __init__(self):
        self.values: dict[str, bytes] = {}

    def key_value_set_bytes(self, key, value):
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self.values[key]


def test_processes_with_different_nccl_are_refused():
    from jaxgin import runtime
    from jaxgin.errors import NcclError

    store = _FakeKeyValueStore()
    runtime._agree_on_nccl(store, 3, 0, "2.28.9", 1000)
    runtime._agree_on_nccl(store, 3, 1, "2.28.9", 1000)  # the same version: fine
    with pytest.raises(NcclError, match=r"process 2 loaded NCCL 2\.32\.3 but process 0 loaded NCCL 2\.28\.9"):
        runtime._agree_on_nccl(store, 3, 2, "2.32.3", 1000)
