"""jaxgin.selftest() in reference mode, and the stamp arithmetic it shares with the device kernel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgin

from jaxgin import diagnostics as selftest_lib

MASK = 0xFFFFFFFF


def c_stamp(seed: int, round_: int, sender: int, receiver: int, word: int) -> int:
    """csrc/kernels/selftest_exchange.cu's stamp(), in plain Python ints with uint32 wrap-around."""
    x = (
        (seed & MASK)
        ^ (round_ * 0x9E3779B1 & MASK)
        ^ (sender * 0x85EBCA77 & MASK)
        ^ (receiver * 0xC2B2AE3D & MASK)
        ^ (word * 0x27D4EB2F & MASK)
    )
    x ^= x >> 15
    x = x * 0x2C1B3C6D & MASK
    x ^= x >> 12
    return x


CASES = [
    (0, 0, 0, 0, 0),
    (1, 0, 0, 0, 0),
    (0, 1, 2, 3, 4),
    (0xFFFFFFFF, 9, 7, 7, 16383),
    (0xDEADBEEF, 3, 1, 6, 12345),
    (0x12345678, 1000, 511, 1023, (1 << 32) - 1),
    (42, (1 << 31) + 5, 255, 128, 1 << 20),
]


@pytest.mark.parametrize("case", CASES)
def test_stamps_match_the_c_hash(case):
    got = selftest_lib.stamps(*case)
    assert got.dtype == np.uint32
    assert int(got) == c_stamp(*case)


def test_stamps_vectorized_match_the_c_hash():
    rng = np.random.default_rng(0)
    seed = 0xA5A5A5A5
    rounds = rng.integers(0, 1 << 20, 200)
    senders = rng.integers(0, 4096, 200)
    receivers = rng.integers(0, 4096, 200)
    words = rng.integers(0, 1 << 32, 200, dtype=np.uint64)
    got = selftest_lib.stamps(seed, rounds, senders, receivers, words)
    assert got.shape == (200,) and got.dtype == np.uint32
    expected = [c_stamp(seed, int(r), int(s), int(p), int(w)) for r, s, p, w in zip(rounds, senders, receivers, words)]
    assert got.tolist() == expected


def test_stamps_differ_per_pair_and_round():
    words = np.arange(16)
    blocks = {(r, s, p): selftest_lib.stamps(7, r, s, p, words).tobytes() for r in range(3) for s in range(4) for p in range(4)}
    assert len(set(blocks.values())) == len(blocks)


@pytest.mark.parametrize("rounds, block_bytes", [(1, 16), (3, 4096), (2, 64 * 1024), (5, 48)])
def test_reference_selftest_passes(rounds, block_bytes):
    jaxgin.initialize()
    report = jaxgin.selftest(rounds=rounds, block_bytes=block_bytes, seed=1234)
    assert report.ok, report.mismatches
    assert report.mismatches == {}
    assert report.path == "reference"
    assert report.world_size == 8
    assert report.rounds == rounds
    assert report.block_bytes == block_bytes


def test_reference_selftest_defaults_and_random_seed():
    jaxgin.initialize()
    report = jaxgin.selftest()
    assert report.ok and report.path == "reference" and report.world_size == 8
    assert report.rounds == 10 and report.block_bytes == 64 * 1024


CORRUPT_RECEIVER, CORRUPT_SENDER, CORRUPT_WORDS = 5, 2, 3


def _corrupting_all_to_all(original):
    """all_to_all that flips a bit in CORRUPT_WORDS words of the block CORRUPT_SENDER sends to
    CORRUPT_RECEIVER, on the receiving side, and leaves every other block alone."""

    def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=False, **kwargs):
        out = original(x, axis_name, split_axis, concat_axis, tiled=tiled, **kwargs)
        assert tiled and split_axis == 0 and concat_axis == 0 and out.ndim == 2  # the exchange's layout
        blocks = out.shape[0]
        mask = jnp.zeros(out.shape, out.dtype)
        mask = mask.at[CORRUPT_SENDER % blocks, :CORRUPT_WORDS].set(1)  # row s: the block from sender s
        here = jax.lax.axis_index(axis_name) == CORRUPT_RECEIVER
        return jnp.where(here, out ^ mask, out)

    return all_to_all


def test_selftest_reports_corrupted_pair(monkeypatch):
    jaxgin.initialize()
    monkeypatch.setattr(jax.lax, "all_to_all", _corrupting_all_to_all(jax.lax.all_to_all))
    rounds = 3
    report = jaxgin.selftest(rounds=rounds, block_bytes=256, seed=99)
    assert not report.ok
    assert report.mismatches == {(CORRUPT_RECEIVER, CORRUPT_SENDER): rounds * CORRUPT_WORDS}
    monkeypatch.undo()
    assert jaxgin.selftest(rounds=1, block_bytes=256, seed=99).ok


def test_selftest_detects_a_checker_that_expects_other_data(monkeypatch):
    """The checker compares against stamps(); if the expectation were off, every pair mismatches."""
    jaxgin.initialize()
    original = selftest_lib.stamps
    calls = []

    def stamps(seed, round_, sender, receiver, word):
        calls.append(round_)
        values = original(seed, round_, sender, receiver, word)
        # The second call of each round computes the expectation: shift it for every pair.
        return values ^ np.uint32(1) if len(calls) % 2 == 0 else values

    monkeypatch.setattr(selftest_lib, "stamps", stamps)
    words = 64 // 4
    report = jaxgin.selftest(rounds=2, block_bytes=64, seed=5)
    assert report.mismatches == {(r, s): 2 * words for r in range(8) for s in range(8)}


@pytest.mark.parametrize("rounds", [0, -1, 1.0, "3", None])
def test_bad_rounds(rounds):
    jaxgin.initialize()
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        jaxgin.selftest(rounds=rounds)


@pytest.mark.parametrize("block_bytes", [0, 10, 8, -16, 17, 16.0])
def test_bad_block_bytes(block_bytes):
    jaxgin.initialize()
    with pytest.raises(ValueError, match="block_bytes must be a positive multiple of 16"):
        jaxgin.selftest(block_bytes=block_bytes)


# ---------------------------------------------------------------------------------------------
# The CUDA path's bookkeeping, with a stand-in for the extension's Runtime (no GPU needed):
# selftest() places its buffers through the same heap and signal allocators as mailboxes, passes
# them to Runtime.selftest_exchange(rounds, block_bytes, seed, heap_offset, signal_base), maps the
# per-(receiver, sender) counts it returns to mismatches, and gives heap and signals back.


class _FakeRuntime:
    def __init__(self, world, fail=None, counts=None, clear_fails=None, gin_contexts=0, settle_fails=None):
        self.world, self.fail, self.counts, self.calls = world, fail, counts, []
        self.clear_fails, self.cleared = clear_fails, []
        # finalize(): a job with GIN peers meets every rank (settle) before releasing (destroy)
        self.gin_contexts, self.settle_fails, self.events = gin_contexts, settle_fails, []

    def device_info(self, local_index):
        return {"gin_contexts": self.gin_contexts, "lsa_size": 1 if self.gin_contexts else self.world}

    def settle(self):
        self.events.append("settle")
        if self.settle_fails is not None:
            fault, error = self.settle_fails
            self.faults = fault
            raise error

    def heap_clear(self, offset, nbytes):
        if self.clear_fails is not None:
            raise self.clear_fails
        self.cleared.append((offset, nbytes))

    def selftest_exchange(self, rounds, block_bytes, seed, heap_offset, signal_base):
        self.calls.append(dict(rounds=rounds, block_bytes=block_bytes, seed=seed, heap_offset=heap_offset,
                               signal_base=signal_base))
        if self.fail is not None:
            raise self.fail
        return self.counts if self.counts is not None else [0] * (self.world * self.world)

    def destroy(self):  # jaxgin.finalize() releases the runtime
        self.events.append("destroy")

    faults = ""

    def device_faults(self):  # finalize() reads them first
        return self.faults


@pytest.fixture
def fake_cuda(monkeypatch):
    """jaxgin initialized in reference mode, then dressed up as the cuda backend with a fake runtime."""
    import dataclasses

    from jaxgin import runtime

    jaxgin.initialize(signal_count=64)
    state = runtime.current()
    state.options = dataclasses.replace(state.options, backend="cuda")
    monkeypatch.setattr(runtime, "info", lambda: {"force_gin": False, "lsa_team_size": 8, "world_size": 8})

    def install(**kwargs):
        state.runtime = _FakeRuntime(len(state.devices), **kwargs)
        return state

    return install


def test_cuda_selftest_places_and_frees_its_buffers(fake_cuda):
    state = fake_cuda()
    heap_free, signals_free = state.heap.available(), state.signals.available()
    report = jaxgin.selftest(rounds=3, block_bytes=4096, seed=77)
    assert report.ok and report.path == "lsa" and report.world_size == 8
    (call,) = state.runtime.calls
    assert (call["rounds"], call["block_bytes"], call["seed"]) == (3, 4096, 77)
    assert call["heap_offset"] >= state.heap.begin and call["heap_offset"] % 256 == 0
    assert call["heap_offset"] + 2 * 8 * 4096 <= state.options.heap_bytes
    assert 0 <= call["signal_base"] and call["signal_base"] + 2 * 8 <= state.options.signal_count
    assert (state.heap.available(), state.signals.available()) == (heap_free, signals_free)  # given back
    assert state.runtime.cleared == [(call["heap_offset"], 2 * 8 * 4096)]  # zeroed first (see jaxgin/heap.py)
    jaxgin.selftest(rounds=1, block_bytes=16, seed=1)  # and reused by the next call
    assert state.runtime.calls[1]["heap_offset"] == call["heap_offset"]
    assert state.runtime.calls[1]["signal_base"] == call["signal_base"]


def test_cuda_selftest_does_not_overlap_live_mailboxes(fake_cuda):
    """Buffers already placed (a mailbox, say) are not handed to the selftest."""
    state = fake_cuda()
    taken = state.heap.allocate(1000)
    signals = state.signals.allocate(10)
    jaxgin.selftest(rounds=1, block_bytes=64, seed=2)
    (call,) = state.runtime.calls
    assert call["heap_offset"] >= taken + 1000
    assert call["signal_base"] >= signals + 10


def test_cuda_selftest_maps_counts_to_pairs(fake_cuda):
    counts = [0] * 64
    counts[5 * 8 + 2] = 7  # receiver 5, sender 2
    counts[0 * 8 + 7] = 1
    fake_cuda(counts=counts)
    report = jaxgin.selftest(rounds=1, block_bytes=64, seed=3)
    assert report.mismatches == {(5, 2): 7, (0, 7): 1} and not report.ok


@pytest.mark.parametrize("fault", ["device", "other"])
def test_cuda_selftest_frees_on_failure(fake_cuda, fault):
    """A failing exchange raises jaxgin's error (DeviceFault for a device fault) and still gives
    heap and signals back."""
    from jaxgin import _jaxgin_ext as ext

    error = ext.DeviceFaultError("wait timed out") if fault == "device" else RuntimeError("bad offset")
    state = fake_cuda(fail=error)
    heap_free, signals_free = state.heap.available(), state.signals.available()
    expected = jaxgin.DeviceFault if fault == "device" else jaxgin.JaxginError
    with pytest.raises(expected, match="wait timed out|bad offset"):
        jaxgin.selftest(rounds=1, block_bytes=64, seed=4)
    assert (state.heap.available(), state.signals.available()) == (heap_free, signals_free)


def test_cuda_selftest_keeps_a_region_it_cannot_clear(fake_cuda):
    """Free heap must be zero (mailbox line slots rely on it): when clearing fails (the device
    faulted in it), selftest raises that, the region is never handed out again, and the signals
    still come back."""
    from jaxgin import _jaxgin_ext as ext

    state = fake_cuda(clear_fails=ext.DeviceFaultError("context lost"))
    heap_free, signals_free = state.heap.available(), state.signals.available()
    with pytest.raises(jaxgin.DeviceFault, match=r"freeing heap bytes .* failed .*context lost"):
        jaxgin.selftest(rounds=1, block_bytes=64, seed=6)
    assert state.heap.available() == heap_free - 2 * 8 * 64  # the 1 KiB it used stays taken
    assert state.signals.available() == signals_free
    state.runtime.clear_fails = None
    jaxgin.selftest(rounds=1, block_bytes=64, seed=7)
    assert state.runtime.calls[1]["heap_offset"] != state.runtime.calls[0]["heap_offset"]


def test_cuda_selftest_out_of_signals_frees_the_heap(fake_cuda):
    """When the signals run out, the heap block taken first is given back and the error names
    the fix."""
    state = fake_cuda()
    state.signals.allocate(state.signals.available() - 3)
    heap_free = state.heap.available()
    with pytest.raises(jaxgin.JaxginError, match=r"out of signals.*signal_count"):
        jaxgin.selftest(rounds=1, block_bytes=64, seed=5)
    assert state.heap.available() == heap_free
    assert state.runtime.calls == []


@pytest.mark.parametrize(
    ("fault_cleanup", "released"),
    [
        (None, "NCCL's allocations, the heaps among them, were released"),
        (
            "the heaps only: NCCL's calls were not recorded, cuptiSubscribe failed",
            (
                "jaxgin's heaps were released, but NCCL's own buffers stay allocated until the process exits "
                "(the heaps only: NCCL's calls were not recorded, cuptiSubscribe failed)"
            ),
        ),
    ],
    ids=["recorded", "heaps_only"],
)
def test_finalize_after_a_device_fault_warns_that_the_gpu_was_reset(fake_cuda, fault_cleanup, released):
    """finalize() reads the recorded faults before releasing (the record lives in the context it
    resets) and says what happened to the GPU and its memory, naming the fault."""
    state = fake_cuda()
    if fault_cleanup is not None:
        state.fault_cleanup = fault_cleanup
    state.runtime.faults = "device-side wait timed out after 5 s at rank 0\n"
    with pytest.warns(RuntimeWarning, match=re.escape(f"was reset to release its memory and {released};")
                      + ".*crash the process: exit once the error is handled.*device-side wait timed out"):
        jaxgin.finalize()
    assert not jaxgin.is_initialized()


def test_finalize_without_faults_is_quiet(fake_cuda, recwarn):
    fake_cuda()
    jaxgin.finalize()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


@pytest.mark.parametrize("gin_contexts", [0, 4], ids=["nvlink_only_job", "job_with_gin_peers"])
def test_finalize_meets_every_rank_before_releasing_in_a_gin_job(fake_cuda, recwarn, gin_contexts):
    """In a job with GIN peers finalize() meets every rank (Runtime.settle) before releasing the
    heaps: a peer's last signals (a credit nobody waits for) may still be in flight, and one that
    lands in a released region fails. An NVLink-only job has nothing in flight and does not meet."""
    state = fake_cuda(gin_contexts=gin_contexts)
    runtime = state.runtime
    jaxgin.finalize()
    assert runtime.events == (["settle", "destroy"] if gin_contexts else ["destroy"])
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_finalize_after_a_fault_does_not_meet(fake_cuda):
    """After a device fault the context is unusable: no meeting, straight to the reset."""
    state = fake_cuda(gin_contexts=4)
    runtime = state.runtime
    runtime.faults = "device-side wait timed out after 5 s at rank 0\n"
    with pytest.warns(RuntimeWarning, match="device-side wait timed out"):
        jaxgin.finalize()
    assert runtime.events == ["destroy"]


def test_a_meeting_that_times_out_resets_and_names_the_fault(fake_cuda):
    """A peer that never calls finalize(): the meeting's bounded wait faults this GPU, which is
    then reset like after any fault, the warning naming the barrier's timeout."""
    from jaxgin.errors import DeviceFault

    fault = "device-side wait timed out after 60 s at rank 0 (CUDA device 0), CTA 0, in jaxgin barrier, peer rank 1"
    state = fake_cuda(gin_contexts=4, settle_fails=(fault + "\n", DeviceFault("finalize(): the barrier failed")))
    runtime = state.runtime
    with pytest.warns(RuntimeWarning, match=r"was reset to release its memory.*The fault: " + re.escape(fault)):
        jaxgin.finalize()
    assert runtime.events == ["settle", "destroy"] and not jaxgin.is_initialized()


def test_a_meeting_that_fails_without_a_fault_says_so(fake_cuda):
    """A meeting refused before it started (too few barrier slots): released normally, with a
    warning that names why the peers' last puts may fail."""
    from jaxgin.errors import JaxginError

    state = fake_cuda(gin_contexts=8, settle_fails=("", JaxginError("only 4 barrier slots exist")))
    runtime = state.runtime
    with pytest.warns(RuntimeWarning, match="meeting of every rank before releasing the heaps failed: only 4 barrier "
                                            "slots exist; a peer's last puts to this rank may fail"):
        jaxgin.finalize()
    assert runtime.events == ["settle", "destroy"]
