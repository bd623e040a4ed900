"""Diagnostics: an all-pairs exchange that checks jaxgin end to end on the devices it runs on.

Every rank sends a stamped block to every rank (itself included) and checks each received word,
for several rounds with new data each round. On GPUs it runs a kernel of the device library
(put with signal, direct NVLink stores through peer pointers, signals, bounded waits, barrier);
in reference mode the same exchange goes through ``jax.lax.all_to_all``.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxgin import op_support, runtime
# Default seeds: a new one per call, and the same sequence in every process of a job (each
# receiver recomputes what its senders stamped, so all processes must agree on the seed).
_default_seeds = itertools.count(0x5EED0001)


@dataclasses.dataclass(frozen=True)
class SelftestReport:
    path: str  # 'lsa', 'gin', 'lsa+gin' or 'reference'
    world_size: int
    rounds: int
    block_bytes: int
    mismatches: dict[tuple[int, int], int]  # (receiver rank, sender rank) -> wrong 32-bit words

    @property
    def ok(self) -> bool:
        return not self.mismatches


def stamps(seed: int, round_: int, sender, receiver, word) -> np.ndarray:
    """The value of each 32-bit word; same arithmetic as the device kernel (uint32 wrap-around)."""
    u = lambda v: np.asarray(v, dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    x = (
        u(seed)
        ^ (u(round_) * np.uint64(0x9E3779B1) & mask)
        ^ (u(sender) * np.uint64(0x85EBCA77) & mask)
        ^ (u(receiver) * np.uint64(0xC2B2AE3D) & mask)
        ^ (u(word) * np.uint64(0x27D4EB2F) & mask)
    )
    x ^= x >> np.uint64(15)
    x = x * np.uint64(0x2C1B3C6D) & mask
    x ^= x >> np.uint64(12)
    return x.astype(np.uint32)


def _path(info: dict) -> str:
    if info["force_gin"]:
        return "gin"
    lsa = info["lsa_team_size"]
    return "lsa" if lsa == info["world_size"] else "lsa+gin"


def _reference_exchange(state, rounds: int, block_bytes: int, seed: int) -> dict[tuple[int, int], int]:
    devices = state.devices
    world, words = len(devices), block_bytes // 4
    mesh = Mesh(np.array(devices), ("ranks",))
    exchange = jax.jit(
        jax.shard_map(
            lambda v: jax.lax.all_to_all(v, "ranks", 0, 0, tiled=True), mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")
        )
    )
    r, p, w = np.meshgrid(np.arange(world), np.arange(world), np.arange(words), indexing="ij")
    mismatches: dict[tuple[int, int], int] = {}
    for round_ in range(rounds):
        send = stamps(seed, round_, r, p, w).reshape(world * world, words)  # row r*world+p: r -> p
        received = exchange(jax.device_put(send, NamedSharding(mesh, P("ranks"))))
        expected = stamps(seed, round_, p, r, w)  # [receiver, sender, word]
        # Each process checks the receivers it holds, as on GPUs (with several processes the
        # other rows are not addressable here).
        for shard in received.addressable_shards:
            first = (shard.index[0].start or 0) // world
            block = np.asarray(shard.data).reshape(-1, world, words)  # [receiver, sender, word]
            wrong = (block != expected[first : first + len(block)]).sum(axis=2)
            for k, sender in zip(*np.nonzero(wrong)):
                key = (first + int(k), int(sender))
                mismatches[key] = mismatches.get(key, 0) + int(wrong[k, sender])
    return mismatches


def selftest(rounds: int = 10, block_bytes: int = 64 * 1024, seed: int | None = None) -> SelftestReport:
    """Runs the exchange on every device of the job and reports mismatching words per pair.

    Every process of a job must call it with the same arguments (the default seed is a per-call
    sequence that is the same in every process).

    Needs 2 x world_size x block_bytes of heap on GPUs. Raises DeviceFault when a device-side
    wait times out (for example when another process of the job did not call selftest()).
    """
    state = runtime.current()
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    if not isinstance(block_bytes, int) or block_bytes <= 0 or block_bytes % 16:
        raise ValueError(f"block_bytes must be a positive multiple of 16, got {block_bytes!r}")
    if seed is None:
        seed = next(_default_seeds) & 0xFFFFFFFF
    elif not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 32:
        raise ValueError(f"seed must be an int in [0, 2**32) (the kernel stamps 32-bit words), got {seed!r}")
    world = len(state.devices)
    if state.options.backend == "reference":
        return SelftestReport("reference", world, rounds, block_bytes, _reference_exchange(state, rounds, block_bytes, seed))
    # Heap and signals come from the same allocators as mailboxes, so a selftest never overlaps
    # a live op; the kernel leaves its signals paired with their consumed counts when it returns.
    nbytes = 2 * world * block_bytes
    offset = state.heap.allocate(nbytes)
    try:
        signal_base = state.signals.allocate(2 * world)
    except Exception:
        state.heap.free(offset)
        raise
    try:
        counts = runtime.call_backend(state.runtime.selftest_exchange, rounds, block_bytes, seed, offset, signal_base)
    finally:
        try:
            op_support.release(state, offset, nbytes)
        finally:
            state.signals.free(signal_base)
    mismatches = {}
    for local, device in enumerate(state.local_devices):
        receiver = state.devices.index(device)
        for sender in range(world):
            if counts[local * world + sender]:
                mismatches[(receiver, sender)] = counts[local * world + sender]
    return SelftestReport(_path(runtime.info()), world, rounds, block_bytes, mismatches)
