"""GPU scenarios for jaxgin's JAX ops, each run in a fresh process by tests/gpu/test_ops_gpu.py.

    python tests/gpu/ops_scenarios.py NAME                   # one process, all visible GPUs
    python tests/gpu/ops_scenarios.py NAME RANK N ADDR       # one of N processes, one GPU each

Every check compares jaxgin's result with jax.lax's inside the same jitted program. Each scenario
prints one JSON line prefixed with RESULT: that the test asserts on.
"""

import os
import sys
import time

import job


def _setup(argv, before_initialize=None):
    """jax (one process per GPU when argv is `RANK WORLD ADDR`) and an initialized jaxgin;
    `before_initialize()` runs once JAX holds its GPUs and jaxgin does not yet."""
    import jax

    job.join(argv)
    import jaxgin

    if before_initialize is not None:
        jax.devices()  # creates the CUDA contexts
        before_initialize()

    jaxgin.initialize(heap_size=os.environ.get("JAXGIN_TEST_HEAP", "2GiB"))
    return jax, jaxgin


def _mesh(jax):
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()), ("x",))


def _global(jax, mesh, shape, dtype, seed):
    """A global array [n * shape[0], ...] sharded over the mesh, same values in every process."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    rng = np.random.default_rng(seed)
    full_shape = (mesh.size * shape[0],) + tuple(shape[1:])
    if np.dtype(dtype).kind in "iu":
        host = rng.integers(-100, 100, size=full_shape).astype(dtype)
    else:
        host = rng.standard_normal(full_shape).astype(np.float32).astype(dtype)
    return jax.make_array_from_callback(full_shape, NamedSharding(mesh, P("x")), lambda idx: host[idx])


def _all_equal(jax, mesh, fn, *args):
    """Runs fn (returning pairs of (jaxgin, lax) arrays) under shard_map+jit; True when equal."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    def body(*xs):
        pairs = fn(*xs)
        ok = jnp.array(True)
        for a, b in pairs:
            ok &= jnp.array_equal(a, b)
        return ok[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * len(args), out_specs=P("x")))
    return f, lambda *a: bool(job.gathered(f(*a)).all())


def correctness(argv):
    """ppermute / all_to_all / put+wait against jax.lax, several shapes and dtypes, gradients."""
    jax, jaxgin = _setup(argv)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(jax)
    n = mesh.size
    checks = {}
    perms = {
        "ring": [(i, (i + 1) % n) for i in range(n)],
        "reverse_ring": [(i, (i - 1) % n) for i in range(n)],
        "partial": [(0, n - 1)] if n > 1 else [(0, 0)],
        "identity": [(i, i) for i in range(n)],
        "swap_pairs": [(i, i ^ 1) for i in range(n)] if n % 2 == 0 else [(0, 0)],
    }
    # 8 KiB is the largest message sent as lines (JAXGIN_LINE_MAX_BYTES for f32), 8 KiB + 16 the ring.
    shapes = {"8B": (1, 2), "4KiB": (1, 1024), "8KiB": (1, 2048), "8KiB+16": (1, 2052), "odd": (3, 37), "1MiB": (256, 1024), "40MiB": (10, 1 << 20), "empty": (0, 4)}
    dtypes = {"f32": jnp.float32, "bf16": jnp.bfloat16, "int8": jnp.int8}
    seed = 0
    for pname, perm in perms.items():
        for sname, shape in shapes.items():
            for dname, dtype in dtypes.items():
                if sname == "40MiB" and dname != "f32":
                    continue
                seed += 1
                x = _global(jax, mesh, shape, dtype, seed)
                _, run = _all_equal(jax, mesh, lambda v: [(jaxgin.ppermute(v, "x", perm), jax.lax.ppermute(v, "x", perm))], x)
                checks[f"ppermute/{pname}/{sname}/{dname}"] = run(x)
    layouts = [(0, 0, True), (1, 0, True), (0, 1, True), (1, 1, True), (0, 1, False), (1, 0, False), (2, 0, False)]
    for split, concat, tiled in layouts:
        for dname, dtype in dtypes.items():
            for sname, per in {"small": 2, "large": 4096}.items():
                seed += 1
                if tiled:
                    shape = (n * 2, n * 3, per) if split < 2 else (2, 3, n * per)
                else:
                    shape = [2, 3, per]
                    shape[split] = n
                local = tuple(shape)
                x = _global(jax, mesh, local, dtype, seed)
                fn = lambda v, s=split, c=concat, t=tiled: [
                    (jaxgin.all_to_all(v, "x", s, c, tiled=t), jax.lax.all_to_all(v, "x", s, c, tiled=t))
                ]
                try:
                    _, run = _all_equal(jax, mesh, fn, x)
                    checks[f"all_to_all/{split}{concat}{'t' if tiled else ''}/{sname}/{dname}"] = run(x)
                except Exception as e:  # a shape lax itself rejects is not a jaxgin failure
                    checks[f"all_to_all/{split}{concat}{'t' if tiled else ''}/{sname}/{dname}"] = f"error: {e}"[:300]
    # 128 MiB per device all_to_all (the benchmark size) once for correctness.
    x = _global(jax, mesh, (n * 8, 4 << 20 >> 3), jnp.float32, 999)
    _, run = _all_equal(jax, mesh, lambda v: [(jaxgin.all_to_all(v, "x", 0, 0, tiled=True), jax.lax.all_to_all(v, "x", 0, 0, tiled=True))], x)
    checks["all_to_all/128MiB"] = run(x)

    # Gradients: jaxgin's transposes against lax's.
    ring = perms["ring"]
    w = _global(jax, mesh, (4, 8 * n), jnp.float32, 4242)
    x = _global(jax, mesh, (4, 8 * n), jnp.float32, 4243)

    def loss(op):
        def f(x, w):
            y = jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)
            return jnp.sum(jnp.sin(y) * w)
        return jax.jit(jax.grad(f))

    for name, ours, theirs in (
        ("ppermute", lambda v: jaxgin.ppermute(v, "x", ring), lambda v: jax.lax.ppermute(v, "x", ring)),
        ("all_to_all", lambda v: jaxgin.all_to_all(v, "x", 1, 1, tiled=True), lambda v: jax.lax.all_to_all(v, "x", 1, 1, tiled=True)),
    ):
        a, b = job.gathered(loss(ours)(x, w)), job.gathered(loss(theirs)(x, w))
        checks[f"grad/{name}"] = bool(np.allclose(a, b, rtol=1e-6, atol=1e-6))

    # Split phase: the ring with put_signal / wait_signal equals ppermute; data-dependent peer.
    box = jaxgin.Mailbox("ring", (64,), jnp.float32)

    def ring_put(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0], box, peer=(me + 1) % n, axis_name="x")
        inbox = jaxgin.wait_signal(box, 1, axis_name="x", after=token)
        return [(inbox[(me - 1) % n][None], jax.lax.ppermute(v, "x", ring)), (inbox.sum(0)[None], v[0][None] * 0 + jax.lax.ppermute(v, "x", ring))]

    x = _global(jax, mesh, (1, 64), jnp.float32, 77)
    _, run = _all_equal(jax, mesh, ring_put, x)
    checks["put_signal/ring"] = all(run(x) for _ in range(3))

    box2 = jaxgin.Mailbox("data_dependent", (16,), jnp.int32)

    def traced_peer(v, s):
        me = jax.lax.axis_index("x")
        # A data-dependent shift, made the same on every device (pmax) so the puts form a permutation.
        k = jax.lax.pmax(s[0, 0] % n, "x")
        token = jaxgin.put_signal(v[0], box2, peer=((me + k) % n).astype(jnp.int32), axis_name="x")
        inbox = jaxgin.wait_signal(box2, 1, axis_name="x", after=token)
        expected = jnp.zeros((n, 16), jnp.int32)
        src = (me - k) % n
        expected = expected.at[src].set(jax.lax.all_gather(v[0], "x")[src])
        return [(inbox, expected)]

    x = _global(jax, mesh, (1, 16), jnp.int32, 78)
    # Every shift, up and down again: most calls take another sender's row than the call before, so
    # a row the wait did not take must read zero even where the last call wrote a payload.
    shifts = [jax.make_array_from_callback((n, 1), x.sharding, lambda idx, k=k: np.full((n, 1), k, np.int32)[idx])
              for k in list(range(n)) + list(range(n))[::-1]]
    _, run = _all_equal(jax, mesh, traced_peer, x, shifts[0])
    checks["put_signal/traced_peer"] = all([run(x, s) for s in shifts])

    # Mailboxes of every size class: empty, odd bytes, the largest line payload (8 KiB), the
    # smallest slot payload (8 KiB + 16) and a put split over several CTAs (256 KiB + 16). Each
    # payload is what the previous wait returned, so the puts into a slot follow the waits that
    # free it: the ring via wait_signal, the ring again via wait_signal_from, then self + right
    # neighbour with count=2. Three runs: the slots and flags are reused.
    mailbox_sizes = {"empty": ((0,), jnp.float32), "13B": ((13,), jnp.int8), "8KiB": ((2048,), jnp.float32),
                     "8KiB+16": ((2052,), jnp.float32), "256KiB+16": ((65540,), jnp.float32)}
    for sname, (shape, dtype) in mailbox_sizes.items():
        sized = jaxgin.Mailbox(f"sizes_{sname}", shape, dtype)

        def three_ways(v, sized=sized):
            me = jax.lax.axis_index("x")
            left, right = (me - 1) % n, (me + 1) % n
            a = jaxgin.wait_signal(sized, 1, axis_name="x", after=jaxgin.put_signal(v[0], sized, right, axis_name="x"))[left]
            want_a = jax.lax.ppermute(v[0], "x", ring)
            b = jaxgin.wait_signal_from(sized, left, axis_name="x", after=jaxgin.put_signal(a, sized, right, axis_name="x"))
            want_b = jax.lax.ppermute(want_a, "x", ring)
            if n == 1:  # no second sender: self and right neighbour are one device
                return [(a, want_a), (b, want_b)]
            to_self = jaxgin.put_signal(b, sized, me, axis_name="x")
            to_right = jaxgin.put_signal(b, sized, right, axis_name="x")
            c = jaxgin.wait_signal(sized, 2, axis_name="x", after=[to_self, to_right])
            return [(a, want_a), (b, want_b), (c[me], want_b), (c[left], jax.lax.ppermute(want_b, "x", ring))]

        x = _global(jax, mesh, (1, *shape), dtype, 80)
        _, run = _all_equal(jax, mesh, three_ways, x)
        checks[f"mailbox/{sname}"] = all(run(x) for _ in range(3))

    # Mixing with XLA's own NCCL collectives in one program.
    def mixed(v):
        a = jax.lax.psum(v, "x")
        b = jaxgin.ppermute(a, "x", ring)
        c = jax.lax.all_gather(b, "x", tiled=True)
        d = jaxgin.all_to_all(c, "x", 0, 0, tiled=True)
        e = jax.lax.ppermute(d, "x", ring)
        ref = jax.lax.all_to_all(jax.lax.all_gather(jax.lax.ppermute(a, "x", ring), "x", tiled=True), "x", 0, 0, tiled=True)
        return [(e, jax.lax.ppermute(ref, "x", ring))]

    x = _global(jax, mesh, (4, 256), jnp.float32, 79)
    _, run = _all_equal(jax, mesh, mixed, x)
    checks["mixed_with_xla_collectives"] = all(run(x) for _ in range(20))
    failed = [k for k, v in checks.items() if v is not True]
    job.report({"devices": n, "processes": jax.process_count(), "checks": len(checks), "failed": failed,
               "details": {k: checks[k] for k in failed}})
    jaxgin.finalize()


# Back-to-back calls of `iterations` (the long chain is the soak tier's: job.by_tier).
ITERATIONS = job.by_tier(100, 1000)
# Runs of `graph_replay`'s program.
REPLAY_RUNS = job.by_tier(50, 200)


# jaxgin calls per device in one iteration of `iterations`: 3 exchanges, 2 puts, 2 waits.
OPS_PER_ITERATION = 7


def iterations(argv):
    """ITERATIONS back-to-back calls with changing data; optional CUDA-graph replay (command
    buffers). `mismatches`: failed checks summed over devices and iterations; `iterations`: the
    calls that ran."""
    jax, jaxgin = _setup(argv)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(jax)
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    box = jaxgin.Mailbox("iter", (256,), jnp.float32)  # lines (1 KiB)
    big = jaxgin.Mailbox("iter_big", (4096,), jnp.float32)  # the slot path (16 KiB)

    def step(v, i):
        v = v + i.astype(v.dtype)  # new data every call
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0, :256], box, peer=(me + 1) % n, axis_name="x")
        a = jaxgin.ppermute(v, "x", ring)
        b = jaxgin.all_to_all(v, "x", 0, 0, tiled=True)
        c = jaxgin.ppermute(v[1, :16] * 2, "x", ring)  # a line message between ring ones on the same pairs
        inbox = jaxgin.wait_signal(box, 1, axis_name="x", after=token)
        from_left = jaxgin.wait_signal_from(big, (me - 1) % n, axis_name="x",
                                            after=jaxgin.put_signal(v[2] - 1, big, (me + 1) % n, axis_name="x"))
        ok = jnp.array_equal(a, jax.lax.ppermute(v, "x", ring))
        ok &= jnp.array_equal(from_left, jax.lax.ppermute(v[2] - 1, "x", ring))
        ok &= jnp.array_equal(b, jax.lax.all_to_all(v, "x", 0, 0, tiled=True))
        ok &= jnp.array_equal(c, jax.lax.ppermute(v[1, :16] * 2, "x", ring))
        ok &= jnp.array_equal(inbox[(me - 1) % n], jax.lax.ppermute(v[0, :256], "x", ring))
        return ok[None]

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    x = _global(jax, mesh, (n * 4, 4096), jnp.float32, 1)
    calls_before = _ffi_calls(jaxgin)
    # Per device, the iterations whose checks failed, counted on the device and gathered once (a
    # gather per iteration would dominate a multi-process run). The first call finishes before the
    # counting programs are compiled, and the last before the gather's: over the host transport,
    # XLA loading a program while a jaxgin program runs can stall both (docs/guide.md).
    count = jax.jit(lambda failed, ok: failed + (~ok).astype(jnp.int32))
    ok = jax.block_until_ready(f(x, jnp.int32(0)))
    failed = jax.block_until_ready(count(jnp.zeros_like(ok, dtype=jnp.int32), ok))
    ran = 1
    start = time.perf_counter()
    for i in range(1, ITERATIONS):
        failed = count(failed, f(x, jnp.int32(i)))
        ran += 1
    bad = int(job.gathered(failed).sum())
    elapsed = time.perf_counter() - start
    calls = {k: v - calls_before[k] for k, v in _ffi_calls(jaxgin).items()}
    job.report({"devices": n, "processes": jax.process_count(), "iterations": ran, "mismatches": bad,
               "seconds": elapsed, "ffi_calls": calls, "xla_flags": os.environ.get("XLA_FLAGS", ""),
               "ops_per_iteration": OPS_PER_ITERATION * len(jax.local_devices()),
               "captured": jaxgin.info()["command_buffer_compatible"],
               "command_buffers": jaxgin.info()["command_buffers"]})
    jaxgin.finalize()


def collective_behind_a_wait(argv):
    """The process's first XLA collective launched while a jaxgin wait still waits for its put:
    the put waits behind a matmul, the wait behind the put, and the all_gather takes the wait's
    result. Over the host transport the wait needs the plugin's copy, so a launch that waits for
    the device (NCCL's first, growing the stack, unless NCCL sized it at initialize) would hold
    it until jaxgin's timeout. `equal`: every rank got its left neighbour's payload."""
    jax, jaxgin = _setup(argv)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = _mesh(jax)
    n = mesh.size
    box = jaxgin.Mailbox("behind_a_wait", (1024,), jnp.float32)

    def body(a, b):
        me = jax.lax.axis_index("x")
        payload = (a @ b)[0, :1024] / a.shape[1] + me.astype(jnp.float32)  # a millisecond of matmul first
        token = jaxgin.put_signal(payload, box, peer=(me + 1) % n, axis_name="x")
        got = jaxgin.wait_signal(box, 1, axis_name="x", after=token)[(me - 1) % n]
        pairs = jax.lax.all_gather(jnp.stack([got, payload]), "x")  # [n, 2, 1024], after the wait
        return jnp.array_equal(pairs[:, 0], jnp.roll(pairs[:, 1], 1, axis=0))[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    a = _global(jax, mesh, (4096, 4096), jnp.float32, 7)
    ones = np.ones((4096, 4096), np.float32)
    b = jax.make_array_from_callback(ones.shape, NamedSharding(mesh, P()), lambda idx: ones[idx])
    start = time.perf_counter()
    equal = bool(job.gathered(jax.block_until_ready(f(a, b))).all())
    job.report({"devices": n, "processes": jax.process_count(), "equal": equal,
                "seconds": time.perf_counter() - start,
                "nccl_set_stack_size": os.environ.get("NCCL_SET_STACK_SIZE")})
    jaxgin.finalize()


COMMAND_BUFFER_FLAGS = "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"


def iterations_graphs(argv):
    """iterations() with XLA command buffers (CUDA graphs) on: its step has jaxgin calls without a
    data dependency between them (a put beside two ppermutes and an all_to_all), which must still
    run in program order when XLA records them into one graph."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip()
    iterations(argv)


def graph_replay(argv):
    """With XLA command buffers on, a program of jaxgin ops between fusions stays right as data
    changes; `handler_calls` counts the exchange handler's runs (XLA replaying a recorded graph
    runs none; jaxgin/ffi/capture.py says when calls are recorded)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + COMMAND_BUFFER_FLAGS).strip()
    jax, jaxgin = _setup(argv)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(jax)
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    ops_per_run = 6

    def body(ours):
        def f(v):
            v = v * 3 + 1  # a fusion: the ops below read XLA temporaries, not the parameter
            for _ in range(ops_per_run // 2):
                v = (jaxgin.ppermute(v, "x", ring) if ours else jax.lax.ppermute(v, "x", ring)) * 2
                v = (jaxgin.all_to_all(v, "x", 0, 0, tiled=True) if ours else jax.lax.all_to_all(v, "x", 0, 0, tiled=True)) - 1
            return v
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    ours, reference = body(True), body(False)
    runs, bad = REPLAY_RUNS, 0
    inputs = [_global(jax, mesh, (n * 2, 512), jnp.float32, seed) for seed in range(8)]
    jax.block_until_ready(ours(inputs[0]))
    before = _ffi_calls(jaxgin)
    for i in range(runs):
        x = inputs[i % len(inputs)]  # new data every run, from a few distinct buffers
        bad += int(not np.array_equal(job.gathered(ours(x)), job.gathered(reference(x))))
    calls = _ffi_calls(jaxgin)["exchange"] - before["exchange"]
    executed = runs * ops_per_run * len(jax.local_devices())
    job.report({"devices": n, "runs": runs, "mismatches": bad, "ops_executed": executed,
               "handler_calls": calls, "xla_flags": os.environ["XLA_FLAGS"],
               "captured": jaxgin.info()["command_buffer_compatible"],
               "command_buffers": jaxgin.info()["command_buffers"]})
    jaxgin.finalize()


def _ffi_calls(jaxgin):
    from jaxgin import runtime

    return runtime.current().backend_lib.ffi_calls()


def _expect_fault(argv, body, shape, dtype_name="float32"):
    """Runs body (under shard_map + jit) once with a 2 s timeout; prints how long until the
    program failed, the error and the device faults. The process exits without teardown."""
    os.environ["JAXGIN_TIMEOUT"] = "2"
    jax, jaxgin = _setup(argv)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(jax)
    f = jax.jit(jax.shard_map(lambda v: body(jax, jaxgin, mesh.size, v), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = _global(jax, mesh, shape, getattr(jnp, dtype_name), 3)
    compiled = f.lower(x).compile()  # so the time below is the run's alone
    start = time.perf_counter()
    error = ""
    try:
        jax.block_until_ready(compiled(x))
    except Exception as e:  # XLA reports the trapped kernel as a CUDA error
        error = f"{type(e).__name__}: {e}"[:500]
    elapsed = time.perf_counter() - start
    faults = jaxgin.device_faults()
    job.report({"seconds": elapsed, "error": error, "faults": faults})
    job.exit_together("expect_fault")
    os._exit(0)  # the CUDA context is gone; skip teardown


def timeout(argv):
    """A wait for more puts than anyone sends fails with a named error instead of hanging."""

    def starve(jax, jaxgin, n, v):
        box = jaxgin.Mailbox("starved", (8,), v.dtype)
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0], box, peer=(me + 1) % n, axis_name="x")
        return jaxgin.wait_signal(box, 2, axis_name="x", after=token)[None]  # only one put comes

    _expect_fault(argv, starve, (1, 8))


def timeout_from(argv):
    """wait_signal_from a sender that never puts (everyone puts to itself) fails naming it."""

    def starve(jax, jaxgin, n, v):
        box = jaxgin.Mailbox("starved_from", (8,), v.dtype)
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0], box, peer=me, axis_name="x")
        return jaxgin.wait_signal_from(box, (me + 1) % n, axis_name="x", after=token)[None]

    _expect_fault(argv, starve, (1, 8))


def peer_out_of_range(argv):
    """A traced put_signal peer outside the axis (computed from data) fails naming the index."""

    def bad_peer(jax, jaxgin, n, v):
        box = jaxgin.Mailbox("bad_peer", (8,), v.dtype)
        peer = (v[0, 0] * 0).astype("int32") + n + 3  # n + 3, known only at run time
        token = jaxgin.put_signal(v[0], box, peer=peer, axis_name="x")
        return jaxgin.wait_signal(box, 1, axis_name="x", after=token)

    _expect_fault(argv, bad_peer, (1, 8))


def source_out_of_range(argv):
    """A traced wait_signal_from source below 0 fails naming the index."""

    def bad_source(jax, jaxgin, n, v):
        box = jaxgin.Mailbox("bad_source", (8,), v.dtype)
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v[0], box, peer=(me + 1) % n, axis_name="x")
        source = (v[0, 0] * 0).astype("int32") - 2
        return jaxgin.wait_signal_from(box, source, axis_name="x", after=token)[None]

    _expect_fault(argv, bad_source, (1, 8))


def _starved_fused(argv, op):
    """A fused op (method="chunked": auto would take XLA's composition for so small a matmul) that
    only axis index 0 calls: its wait for the other's chunk fails naming it."""

    def starve(jax, jaxgin, n, v):
        import jax.numpy as jnp

        w = jnp.ones((v.shape[1], 8), v.dtype)
        x = jnp.concatenate([v] * n)  # n rows: one chunk row per destination

        def run(x):
            return getattr(jaxgin.fused, op)(x, w, axis_name="x", method="chunked")[:n]

        def skip(x):
            return jnp.zeros((n, 8), x.dtype) + x[:1, :1] * 0

        return jax.lax.cond(jax.lax.axis_index("x") == 0, run, skip, x)

    _expect_fault(argv, starve, (1, 8))


def starved_matmul_all_to_all(argv):
    _starved_fused(argv, "matmul_all_to_all")


def starved_all_gather_matmul(argv):
    _starved_fused(argv, "all_gather_matmul")


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2:])
