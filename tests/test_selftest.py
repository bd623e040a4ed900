"""jaxgin.selftest() in reference mode, and the stamp arithmetic it shares with the device kernel."""

from __future__ import annotations

import importlib

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
