"""Randomized stress of jaxgin's JAX ops against jax.lax, for the reliability tests.

    python -m jaxgin.stress --ops 10000 [--seed S] [--max-bytes 64MiB]

Runs a random sequence of ppermute (random permutations), all_to_all and put_signal + wait exchanges
(random peers; wait_signal or wait_signal_from), with message sizes from 0 B up to `max_bytes` per
device, several dtypes, and data that changes every op. Each op is one jitted program that computes
jaxgin's result and jax.lax's on the same data and counts differing elements on the device, so a
mismatch anywhere is caught without copying results to the host. Reports the ops run, mismatches,
and the device memory in use after one warm-up pass (so compilation is not counted as growth), after
a first run of the sequence and after each of two replays of its start; a pool may reach a new
high-water mark once, but a leak grows at every replay, so growth over the last replay is a leak. On GPUs this exercises the CUDA kernels (and, under XLA command buffers,
graph replay); in reference mode it checks the reference lowering and this harness itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxgin
from jaxgin import runtime, sizes

DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)
MAILBOX_MAX_BYTES = 1 << 20  # mailboxes keep n + 1 slots of their size in the heap


def _sizes(max_bytes: int) -> list[int]:
    """Per-device message sizes: 0, a few odd small ones, then powers of 4 up to max_bytes."""
    sizes = [0, 8, 24, 1000, 4096]
    s = 1 << 14
    while s <= max_bytes:
        sizes.append(s)
        s <<= 2
    if sizes[-1] != max_bytes and max_bytes > 4096:
        sizes.append(max_bytes)
    return [b for b in sizes if b <= max_bytes]


def _local(step, n: int, rows: int, cols: int, dtype):
    """Data that differs per device and per op, made on the device from the op counter."""
    me = jax.lax.axis_index("x")
    i = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0) * cols + jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    v = (i * 7 + me * 1009 + step * 31) % 251 - 125
    return v.astype(dtype)


def _mismatches(a, b):
    return jnp.sum(a != b, dtype=jnp.int32)


class Stress:
    """The menu of programs (compiled once each) and the random choice among them."""

    def __init__(self, mesh: Mesh, max_bytes: int, seed: int):
        self.jaxgin = jaxgin
        self.mesh = mesh
        self.n = n = mesh.size
        self.rng = np.random.default_rng(seed)
        self.sizes = _sizes(max_bytes)
        ring = [(i, (i + 1) % n) for i in range(n)]
        shuffled = [(i, int(d)) for i, d in enumerate(np.random.default_rng(seed + 1).permutation(n))]
        self.perms = [ring, [(d, s) for s, d in ring], shuffled, [(0, n - 1)]]
        self.programs: dict[tuple, object] = {}
        self.boxes: dict[tuple, object] = {}
        self.ops = {"ppermute": 0, "all_to_all": 0, "put_wait": 0}

    def _shape(self, nbytes: int, dtype, multiple: int) -> tuple[int, int]:
        """[rows, cols] of about nbytes with rows a multiple of `multiple` (0 bytes: no rows)."""
        elements = nbytes // np.dtype(dtype).itemsize
        if elements == 0:
            return (0, 4)
        cols = min(elements, 1024)
        rows = max(1, elements // cols)
        rows = max(multiple, rows // multiple * multiple)
        return rows, cols

    def _program(self, key):
        if key in self.programs:
            return self.programs[key]
        op, nbytes, dtype, extra = key
        jaxgin, n = self.jaxgin, self.n
        if op == "ppermute":
            perm = self.perms[extra]
            rows, cols = self._shape(nbytes, dtype, 1)

            def body(step):
                v = _local(step, n, rows, cols, dtype)
                return _mismatches(jaxgin.ppermute(v, "x", perm), jax.lax.ppermute(v, "x", perm))[None]
        elif op == "all_to_all":
            rows, cols = self._shape(nbytes, dtype, n)

            def body(step):
                v = _local(step, n, rows, cols, dtype)
                ours = jaxgin.all_to_all(v, "x", 0, 0, tiled=True)
                return _mismatches(ours, jax.lax.all_to_all(v, "x", 0, 0, tiled=True))[None]
        else:  # put_wait: every device puts to (me + shift) % n, a permutation whatever the shift;
            # extra = 0 waits with wait_signal (one row of the inbox), 1 with wait_signal_from
            rows, cols = self._shape(min(nbytes, MAILBOX_MAX_BYTES), dtype, 1)
            box_key = (rows, cols, np.dtype(dtype).name)
            if box_key not in self.boxes:
                self.boxes[box_key] = jaxgin.Mailbox(f"stress_{rows}x{cols}_{box_key[2]}", (rows, cols), dtype)
            box = self.boxes[box_key]

            def body(step):
                v = _local(step, n, rows, cols, dtype)
                me = jax.lax.axis_index("x")
                shift = step % (n - 1) + 1 if n > 1 else step * 0
                token = jaxgin.put_signal(v, box, peer=((me + shift) % n).astype(jnp.int32), axis_name="x")
                source = ((me - shift) % n).astype(jnp.int32)
                if extra:
                    got = jaxgin.wait_signal_from(box, source, axis_name="x", after=token)
                else:
                    got = jaxgin.wait_signal(box, 1, axis_name="x", after=token)[source]
                expected = jax.lax.all_gather(v, "x")[source]
                return _mismatches(got, expected)[None]

        f = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P(), out_specs=P("x")))
        self.programs[key] = f
        return f

    def menu(self) -> list[tuple]:
        """Every (op, size, dtype) once; the permutations rotate over the menu so each is used."""
        keys = []
        for i, nbytes in enumerate(self.sizes):
            for j, dtype in enumerate(DTYPES):
                keys += [("ppermute", nbytes, dtype, (i + j) % len(self.perms)), ("all_to_all", nbytes, dtype, 0),
                         ("put_wait", nbytes, dtype, (i + j) % 2)]
        return keys

    def run(self, ops: int, check_every: int = 200) -> dict:
        """`ops` random programs; by_op counts every op run since warm-up, this_run this call's."""
        keys = self.menu()
        total = jnp.zeros((self.n,), jnp.int32, device=NamedSharding(self.mesh, P("x")))
        # The sum and the reset below compiled before any program runs: over jaxgin's host
        # transport, XLA loading a program while a jaxgin program runs can stall both.
        total = jax.block_until_ready((total + total) * 0)
        mismatches, this_run = 0, dict.fromkeys(self.ops, 0)
        for i in range(ops):
            key = keys[self.rng.integers(len(keys))]
            self.ops[key[0]] += 1
            this_run[key[0]] += 1
            total = total + self._program(key)(jnp.int32(i))
            if (i + 1) % check_every == 0 or i + 1 == ops:
                mismatches += int(np.asarray(_host(total)).sum())
                total = total * 0
        return {"ops": ops, "mismatches": mismatches, "by_op": dict(self.ops), "this_run": this_run}


def _host(x):
    if jax.process_count() == 1:
        return np.asarray(x)
    # the gather compiles a program of its own: the programs behind x finish first (see run())
    return multihost_utils.process_allgather(jax.block_until_ready(x), tiled=True)


def memory_in_use() -> dict:
    """Memory in use on this process's GPUs. `device`: total - free from the CUDA driver, which
    counts jaxgin's heap, NCCL's buffers and XLA's pool alike; `xla`: bytes XLA's allocator holds
    for live arrays, where it reports them. None where unknown (reference mode on CPU)."""
    state = runtime._state
    device = None
    if state is not None and state.backend_lib is not None:
        device = 0
        for d in jax.local_devices():
            free, total = state.backend_lib.device_memory(d.local_hardware_id)
            device += total - free
    xla = 0
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_in_use" not in stats:
            xla = None
            break
        xla += int(stats["bytes_in_use"])
    return {"device": device, "xla": xla}


def stress(mesh: Mesh, ops: int, *, seed: int = 0, max_bytes: int = 64 << 20) -> dict:
    """Warms every program up once, then runs `ops` random ones; see the module docstring."""
    s = Stress(mesh, max_bytes, seed)
    start = time.perf_counter()
    for key in s.menu():  # compile everything and run it once: not counted as growth
        jax.block_until_ready(s._program(key)(jnp.int32(0)))
    warm_s = time.perf_counter() - start
    s.ops = dict.fromkeys(s.ops, 0)
    # Memory is sampled after warm-up, after the first run and after each replay of its start. The
    # first run may raise a pool's high-water mark (more results in flight than during warm-up), and
    # so may a replay, once (+4 MiB in the first replay under command buffers, 2 x H200, NCCL
    # 2.32.3); a leak grows at every replay, so what the last replay adds is a leak.
    before = memory_in_use()
    start = time.perf_counter()
    replay = copy.deepcopy(s.rng)
    replayed = ops // 3
    runs = [s.run(ops - 2 * replayed)]
    samples = [memory_in_use()]
    for _ in range(2):
        s.rng = copy.deepcopy(replay)
        runs.append(s.run(replayed))
        samples.append(memory_in_use())
    result = {"ops": ops, "mismatches": sum(r["mismatches"] for r in runs), "by_op": runs[-1]["by_op"],
              "by_op_runs": [r["this_run"] for r in runs]}
    result.update(
        memory_after_first_run=samples[0],
        memory_after_first_replay=samples[1],
        programs=len(s.programs),
        sizes=s.sizes,
        dtypes=[np.dtype(d).name for d in DTYPES],
        warmup_seconds=round(warm_s, 2),
        seconds=round(time.perf_counter() - start, 2),
        memory_before=before,
        memory_after=samples[2],
        devices=mesh.size,
        processes=jax.process_count(),
    )
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxgin.stress", description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-bytes", type=sizes.argument("--max-bytes"), default=64 << 20,
                   help="largest message per device, e.g. 65536, 64KiB, 16MiB (default 64MiB)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    jaxgin.initialize()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    result = stress(mesh, args.ops, seed=args.seed, max_bytes=args.max_bytes)
    print(json.dumps(result))
    jaxgin.finalize()
    return 0 if result["mismatches"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
