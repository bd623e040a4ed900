"""jaxgin.fused on CPU (reference mode, emulated devices) and its GPU kernels compiled and linked
for sm_90a without a GPU.

Reference mode computes the kernels' chunk placement in plain JAX, so comparing it with the
unfused jax.lax composition checks the placement logic (which chunk of x @ w goes where, for every
split/concat pair) and the custom_vjp backward rules against jax.grad of the composition.
Also: jaxgin.axis_route against the mesh, and argument errors.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import types
from dataclasses import replace as dataclasses_replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin
from jaxgin.fused import TileConfig

from conftest import (FakeRuntime, compile_for_sm90, equations, gpu_scenario, memory_operations,
                      registers_per_thread, stand_in_kernels, triton_interpreter_check)


@pytest.fixture
def init():
    jaxgin.initialize()
    assert jaxgin.info()["backend"] == "reference"


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("x",))


def _data(n, m, k, nn, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (n * m, k), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (k, nn), jnp.float32).astype(dtype)
    return x, w


def _close(a, b, tol):
    """Equal within `tol` of the largest magnitude (bfloat16 gradients round at every step)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1e-30), np.abs(a - b).max()


def _sm(mesh, f, out_spec=P("x")):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_spec))


A2A_CASES = [
    # n, m per device, k, n cols, split, concat
    (2, 8, 16, 6, 0, 0),
    (4, 12, 5, 8, 0, 1),
    (4, 3, 7, 12, 1, 0),
    (8, 16, 9, 16, 1, 1),
    (8, 8, 4, 24, -1, -2),
]


@pytest.mark.parametrize("n,m,k,nn,split,concat", A2A_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matmul_all_to_all_matches_lax(init, n, m, k, nn, split, concat, dtype):
    mesh = _mesh(n)
    x, w = _data(n, m, k, nn, dtype)
    prec = jax.lax.Precision.HIGHEST
    fused = _sm(mesh, lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", split_axis=split,
                                                                    concat_axis=concat, precision=prec))
    unfused = _sm(mesh, lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w, precision=prec), "x", split, concat,
                                                        tiled=True))
    got, want = fused(x, w), unfused(x, w)
    assert got.shape == want.shape and got.dtype == want.dtype
    # Per-chunk products may sum in another order than the whole product: rounding, not placement.
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)

    ct = jax.random.normal(jax.random.key(7), want.shape, jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
    g_fused = jax.grad(loss(fused), argnums=(0, 1))(x, w)
    g_unfused = jax.grad(loss(unfused), argnums=(0, 1))(x, w)
    for a, b in zip(g_fused, g_unfused):
        assert a.dtype == b.dtype
        _close(a, b, 1e-5 if dtype == jnp.float32 else 2e-2)


@pytest.mark.parametrize("n,m,k,nn", [(2, 4, 8, 6), (4, 5, 3, 7), (8, 2, 16, 4)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_all_gather_matmul_matches_lax(init, n, m, k, nn, dtype):
    mesh = _mesh(n)
    x, w = _data(n, m, k, nn, dtype, seed=1)
    prec = jax.lax.Precision.HIGHEST
    fused = _sm(mesh, lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", precision=prec))
    unfused = _sm(mesh, lambda x, w: jnp.matmul(jax.lax.all_gather(x, "x", tiled=True), w, precision=prec))
    got, want = fused(x, w), unfused(x, w)
    assert got.shape == (n * n * m, nn)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)

    ct = jax.random.normal(jax.random.key(3), want.shape, jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
    for a, b in zip(jax.grad(loss(fused), argnums=(0, 1))(x, w), jax.grad(loss(unfused), argnums=(0, 1))(x, w)):
        _close(a, b, 1e-5 if dtype == jnp.float32 else 2e-2)


RS_CASES = [
    # n, M, K per device, N, scatter_dimension
    (2, 8, 6, 5, 0),
    (4, 12, 3, 8, 1),
    (8, 16, 4, 9, 0),
    (4, 7, 5, 12, -1),
]


def _sm_k(mesh, f, rows: bool):
    """shard_map of f(x [M, K/n], w [K/n, N]) (K sharded), its result scattered along rows or columns."""
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "x"), P("x", None)),
                                 out_specs=P("x") if rows else P(None, "x")))


@pytest.mark.parametrize("n,m,k,nn,dim", RS_CASES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_matmul_reduce_scatter_matches_lax(init, n, m, k, nn, dim, dtype):
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(2), 2)
    x = jax.random.normal(keys[0], (m, n * k), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (n * k, nn), jnp.float32).astype(dtype)
    prec = jax.lax.Precision.HIGHEST
    rows = dim % 2 == 0
    fused = _sm_k(mesh, lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=dim,
                                                                         precision=prec), rows)
    unfused = _sm_k(mesh, lambda x, w: jax.lax.psum_scatter(jnp.matmul(x, w, precision=prec), "x",
                                                            scatter_dimension=dim % 2, tiled=True), rows)
    got, want = fused(x, w), unfused(x, w)
    assert got.shape == want.shape == (m, nn) and got.dtype == want.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    _close(got, want, tol)

    # The promised arithmetic: each GPU's partial rounded to the dtype, the owner's sum in float32
    # in source order, computed here on the host.
    parts = [np.asarray(jnp.matmul(x[:, s * k:(s + 1) * k], w[s * k:(s + 1) * k], precision=prec).astype(dtype))
             for s in range(n)]
    total = parts[0].astype(np.float32)
    for part in parts[1:]:
        total = total + part.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray(total).astype(dtype)))

    ct = jax.random.normal(jax.random.key(9), want.shape, jnp.float32)
    loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * ct)  # noqa: E731
    for a, b in zip(jax.grad(loss(fused), argnums=(0, 1))(x, w), jax.grad(loss(unfused), argnums=(0, 1))(x, w)):
        assert a.dtype == b.dtype
        _close(a, b, 1e-5 if dtype == jnp.float32 else 2e-2)


def test_varying_weights_get_their_own_gradient(init):
    # w sharded (varying) over the axis: each device's w only meets its own x, no summing.
    mesh = _mesh(4)
    x, _ = _data(4, 8, 6, 8, jnp.float32)
    ws = jax.random.normal(jax.random.key(5), (4 * 6, 8), jnp.float32)

    def run(f):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P("x")))
        return jax.grad(lambda x, w: jnp.sum(g(x, w) ** 2), argnums=(0, 1))(x, ws)

    prec = jax.lax.Precision.HIGHEST
    fused = run(lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", precision=prec))
    unfused = run(lambda x, w: jax.lax.all_to_all(jnp.matmul(x, w, precision=prec), "x", 0, 0, tiled=True))
    for a, b in zip(fused, unfused):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x"), ValueError, "not divide|does not divide"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w[:, :, None], axis_name="x"), ValueError, "2-D"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w[:3], axis_name="x"), ValueError, "K differs"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w.astype(jnp.float16), axis_name="x"), TypeError,
         "same dtype"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x.astype(jnp.int8), w.astype(jnp.int8), axis_name="x"),
         TypeError, "supported"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", split_axis=2), ValueError,
         "out of range"),
        (lambda x, w: jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", concat_axis=0.5), TypeError, "int"),
        (lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="nope"), NameError, "not bound"),
        (lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", method="cutlass"), ValueError,
         "method='cutlass'; use one of 'auto', 'chunked', 'triton', 'unfused'"),
        (lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", tiles=TileConfig(64, 64, 32)),
         ValueError, "pass method='triton' with it"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x"), ValueError,
         r"scatter_dimension=0 splits M = x.shape\[0\] = 6 into 4 chunks .* pad it to a multiple of 4"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=1), ValueError,
         r"splits N = w.shape\[1\] = 6 into 4 chunks"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=2), ValueError,
         "out of range"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=True), TypeError,
         "must be an int"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", method="nccl"), ValueError,
         "method='nccl'; use one of 'auto', 'chunked', 'triton', 'unfused'"),
        (lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", tiles=TileConfig(64, 64, 32)),
         ValueError, "pass method='triton' with it"),
    ],
    ids=["indivisible", "rank", "k", "dtypes", "int8", "axis", "float axis", "axis name", "method", "tiles",
         "rs rows", "rs columns", "rs dimension", "rs bool dimension", "rs method", "rs tiles"],
)
def test_bad_arguments_are_named(init, call, error, message):
    mesh = _mesh(4)
    x = jnp.ones((4 * 6, 8), jnp.float32)  # 6 rows per device: not divisible by 4
    w = jnp.ones((8, 6), jnp.float32)  # 6 columns: not divisible by 4 either
    with pytest.raises(error, match=message):
        _sm(mesh, call)(x, w)


class _FakeState:
    def __init__(self, world, infos, force_gin=False):
        self.world_size = world
        self.local_devices = list(range(len(infos)))
        self.runtime = FakeRuntime(infos)
        self.options = types.SimpleNamespace(force_gin=force_gin)


class _HeapOnlyState:
    """What the fused ops' GPU lowering reads of the runtime when it places buffers: heap and
    signal allocators and the placement cache."""

    def __init__(self):
        from jaxgin import heap

        self.heap = heap.heap_allocator(0, 1 << 34)
        self.signals = heap.signal_allocator(1024)
        self.placements = {}
        self.generation = 0
        # and, for routing across hosts (jaxgin.hosts), rank 1 of 4, on hosts of 2 GPUs
        self.world_size, self.local_devices = 4, [None]
        self.runtime = FakeRuntime([{"rank": 1, "lsa_rank": 1, "lsa_size": 2}])
        self.options = types.SimpleNamespace(force_gin=False)


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
@pytest.mark.parametrize("method", ["chunked", "triton"])
@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_gather_matmul"])
def test_gpu_path_follows_the_job(monkeypatch, op, method, gin):
    """Which implementation a fused op lowers to, and with what: in a job with GIN peers both
    methods run the Triton kernel with its GIN paths (the copy engine reaches NVLink peers only),
    with a signal per call parity and source (and row group), the GIN tile area and the copy-out
    programs; an NVLink-only job keeps the chunked method and a GIN-free Triton kernel."""
    import importlib

    from jaxgin import op_support
    from jaxgin.fused import _chunked, _common

    module = importlib.import_module(f"jaxgin.fused.{op}")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(module, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    calls = []
    monkeypatch.setattr(module, "triton_call", lambda kernel, *args, **kw: calls.append(("triton", args, kw)))
    monkeypatch.setattr(_chunked, op, lambda x, w, plan, *layout: calls.append(("chunked", (), {})))
    size, dtype = 4, jnp.bfloat16
    x, w = jnp.zeros((512, 256), dtype), jnp.zeros((256, 384), dtype)
    state = _HeapOnlyState()
    if op == "matmul_all_to_all":
        plan = module._Plan(("x",), size, 512, 384, 256, True, True, None, None, method)
    else:
        plan = module._Plan(("x",), size, 512, 384, 256, None, None, method)
    module._kernel(state, x, w, plan)
    ((kind, args, kw),) = calls
    assert kind == ("triton" if gin or method == "triton" else "chunked")
    if kind == "chunked":
        assert state.signals.available() == 1024
        return
    assert kw["GIN"] == int(gin)
    (buffers,) = state.placements.values()
    # the first of each op's candidates; all_gather_matmul's senders at 8 warps
    tiles = _common.FAMILIES["wide_first" if op == "matmul_all_to_all" else "gather"][2][0]
    assert (kw["BM"], kw["BN"], kw["BK"], kw["num_warps"]) == (tiles.block_m, tiles.block_n, tiles.block_k,
                                                                tiles.num_warps)
    assert op == "matmul_all_to_all" or tiles.num_warps == 8
    if op == "matmul_all_to_all":
        count = -(-512 // size // tiles.block_m) * -(-384 // tiles.block_n)  # tiles of one chunk
        assert kw["COPIERS"] == (_common.gin_copiers(size, count) if gin else 0)
        assert kw["grid"] == (size * count + size * kw["COPIERS"],)
        assert buffers.flags.shape == (size * count + size * gin,)
        _check_gin_tile_area(state, buffers, args, gin, size, count, tiles)
    else:
        groups = kw["G"]
        assert groups <= (module.GIN_GROUPS if gin else 32)
        assert groups * kw["GR"] >= 512 > (groups - 1) * kw["GR"]  # every row, once
        assert kw["GR"] % tiles.block_m == 0  # whole tile rows per group
        assert state.signals.available() == 1024 - 2 * size * groups * gin
        assert buffers.flags.shape == (size * groups,)
        assert args[7] == buffers.signals
        if gin:  # each rank's host, for the network entries
            assert np.asarray(args[3]).tolist() == [0, 0, 1, 1]
    assert buffers.state.shape == (3,)  # call counter, finished programs, start order


def _plan_of(module, op, size, m, k, n, method, dtype=jnp.bfloat16):
    if op == "matmul_all_to_all":
        return module._Plan(("x",), size, m, n, k, True, True, None, None, method)
    if op == "matmul_reduce_scatter":
        return module._Plan(("x",), size, m, n, k, True, None, None, method)
    return module._Plan(("x",), size, m, n, k, None, None, method)


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
@pytest.mark.parametrize("big", [False, True], ids=["short_matmul", "long_matmul"])
@pytest.mark.parametrize("method", ["auto", "chunked", "triton", "unfused"])
@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_gather_matmul", "matmul_reduce_scatter"])
def test_each_method_lowers_to_what_explain_says(monkeypatch, op, method, big, gin):
    """What a fused op runs on GPUs: "auto" takes the chunked call for a matmul of at least
    AUTO_CHUNKED_MIN_FLOP and XLA's composition below it, the Triton kernel in a job with GIN peers
    ("chunked" too); "triton" and "unfused" run as asked. jaxgin.fused.explain names the same
    method, with the matmul's size in its reason."""
    import importlib

    from jaxgin import op_support
    from jaxgin.fused import _chunked, _common

    module = importlib.import_module(f"jaxgin.fused.{op}")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(module, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    calls = []
    monkeypatch.setattr(module, "triton_call", lambda kernel, *args, **kw: calls.append("triton"))
    chunked = "reduce_scatter_partials" if op == "matmul_reduce_scatter" else op
    monkeypatch.setattr(_chunked, chunked, lambda x, w, plan, *layout: calls.append("chunked") or jnp.zeros((4, 128, 384)))
    unfused = "reference" if op == "matmul_reduce_scatter" else "unfused"
    monkeypatch.setattr(module, unfused, lambda x, w, plan: calls.append("unfused"))
    size, m, k, n = 4, 512, 256, 384
    flop = 2.0 * m * k * n * (size if op == "all_gather_matmul" else 1)
    # the threshold just above or at this matmul's size
    monkeypatch.setattr(_common, "AUTO_CHUNKED_MIN_FLOP", flop if big else flop * 1.01)
    module._kernel(_HeapOnlyState(), jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16),
                   _plan_of(module, op, size, m, k, n, method))
    if method in ("triton", "unfused"):
        expected = method
    elif gin:
        expected = "triton"
    else:
        expected = "chunked" if method == "chunked" or big else "unfused"
    assert calls == [expected]
    choice = jaxgin.fused.explain(op, (m, k), (k, n), axis_size=size, method=method, gin_in_job=gin)
    assert (choice.op, choice.asked, choice.method) == (f"jaxgin.fused.{op}", method, expected)
    if method == "auto" and not gin:
        assert f"the matmul is {flop / 1e9:.3g} GFLOP per device (bfloat16)" in choice.reason
    assert str(choice).startswith(f"jaxgin.fused.{op}: method={method!r} runs {expected!r}: ")


def test_auto_weighs_a_float32_matmul_by_its_precision():
    """A float32 matmul runs slower than a 16-bit one of the same size (tf32 at half the rate,
    IEEE float32 on CUDA cores), so auto takes the chunked method for it at fewer FLOP."""
    from jaxgin.fused import _common

    flop = _common.AUTO_CHUNKED_MIN_FLOP / 4  # 16-bit: unfused
    m, k, n = 1024, 1024, int(flop / (2 * 1024 * 1024))
    explain = jaxgin.fused.explain
    assert explain("matmul_all_to_all", (m, k), (k, n), "bfloat16", axis_size=4, gin_in_job=False).method == "unfused"
    assert explain("matmul_all_to_all", (m, k), (k, n), "float32", axis_size=4, gin_in_job=False).method == "unfused"
    assert explain("matmul_all_to_all", (m, k), (k, n), "float32", axis_size=4, precision=jax.lax.Precision.HIGH,
                   gin_in_job=False).method == "chunked"
    highest = explain("matmul_all_to_all", (m, k), (k, n), "float32", axis_size=4, precision="highest",
                      gin_in_job=False)
    assert highest.method == "chunked" and "in 16-bit terms" in highest.reason


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(op="matmul"), ValueError, "op='matmul'; use one of 'matmul_all_to_all', 'all_gather_matmul'"),
    (dict(x_shape=(8, 16, 2)), ValueError, r"x_shape \[8, 16, 2\] \(x \[M, K\] of this device\) and w_shape"),
    (dict(w_shape=(8, 4)), ValueError, "must be 2-D with the same K"),
    (dict(axis_size=0), ValueError, "axis_size must be a positive int"),
    (dict(dtype="int8"), TypeError, "dtype int8; supported: bfloat16, float16, float32"),
    (dict(method="fast"), ValueError, "method='fast'; use one of 'auto', 'chunked', 'triton', 'unfused'"),
])
def test_explain_names_a_bad_argument(kwargs, error, message):
    args = dict(op="matmul_all_to_all", x_shape=(8, 16), w_shape=(16, 4), axis_size=4) | kwargs
    op = args.pop("op")
    with pytest.raises(error, match=message):
        jaxgin.fused.explain(op, args.pop("x_shape"), args.pop("w_shape"), args.pop("dtype", "bfloat16"), **args)


def test_explain_without_a_runtime_assumes_no_gin_peers():
    """Outside a jaxgin runtime on GPUs (none started, or reference mode) explain says what an
    NVLink-only job would run."""
    choice = jaxgin.fused.explain("all_gather_matmul", (1024, 4096), (4096, 4096), axis_size=4)
    assert choice.method == "chunked" and "137 GFLOP per device" in choice.reason


@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_gather_matmul", "matmul_reduce_scatter"])
def test_the_unfused_method_equals_the_reference(op):
    """method="unfused" (XLA's matmul and collective, what auto runs for short matmuls) computes
    the op: the same values as the reference path on 4 CPU devices (float32, HIGHEST precision;
    matmul_reduce_scatter's unfused path is its reference, the same ordered sum)."""
    import importlib

    module = importlib.import_module(f"jaxgin.fused.{op}")
    mesh = _mesh(4)
    m, k, n = 16, 24, 8
    plan = dataclasses_replace(_plan_of(module, op, 4, m, k, n, "unfused"), precision=jax.lax.Precision.HIGHEST)
    key_x, key_w = jax.random.split(jax.random.key(5))
    specs = (P(None, "x"), P("x", None), P("x")) if op == "matmul_reduce_scatter" else (P("x"), P(), P("x"))
    shapes = ((m, 4 * k), (4 * k, n)) if op == "matmul_reduce_scatter" else ((4 * m, k), (k, n))
    x, w = jax.random.normal(key_x, shapes[0], jnp.float32), jax.random.normal(key_w, shapes[1], jnp.float32)
    run = lambda f: jax.jit(jax.shard_map(lambda x, w: f(x, w, plan), mesh=mesh, in_specs=specs[:2],  # noqa: E731
                                          out_specs=specs[2]))(x, w)
    unfused = module.reference if op == "matmul_reduce_scatter" else module.unfused
    np.testing.assert_allclose(np.asarray(run(unfused)), np.asarray(run(module.reference)), rtol=1e-5, atol=1e-5)
    lax = {"matmul_all_to_all": lambda x, w: jax.lax.all_to_all(x @ w, "x", 0, 0, tiled=True),
           "all_gather_matmul": lambda x, w: jax.lax.all_gather(x, "x", tiled=True) @ w,
           "matmul_reduce_scatter": lambda x, w: jax.lax.psum_scatter(x @ w, "x", scatter_dimension=0, tiled=True)}[op]
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(run(unfused)), np.asarray(run(lambda x, w, _: lax(x, w))),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
@pytest.mark.parametrize("rows", [True, False], ids=["scatter_rows", "scatter_columns"])
def test_matmul_reduce_scatter_lowers_to_its_kernel(monkeypatch, gin, rows):
    """matmul_reduce_scatter's GPU lowering: a partial program per (owner, tile), which also sums
    the tile where it is the own chunk's, or, in a job with GIN peers, a reducer per tile of the
    own chunk besides; a flag per (owner, tile), and in a job with GIN peers a ready flag and
    a claim word per source, the GIN tile area and a signal per (call parity, source)."""
    import importlib

    from jaxgin import op_support
    from jaxgin.fused import _common

    module = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(module, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    calls = []
    monkeypatch.setattr(module, "triton_call", lambda kernel, *args, **kw: calls.append((kernel, args, kw)))
    size, dtype = 4, jnp.bfloat16
    x, w = jnp.zeros((512, 256), dtype), jnp.zeros((256, 384), dtype)
    state = _HeapOnlyState()
    plan = module._Plan(("x",), size, 512, 384, 256, rows, None, None, "triton")
    module._kernel(state, x, w, plan)
    ((kernel, args, kw),) = calls
    from jaxgin.fused import _kernels

    assert kernel is _kernels.matmul_reduce_scatter_kernel
    tiles = _common.WIDE_FIRST_CANDIDATES[2][0]
    cm, cn = (512 // size, 384) if rows else (512, 384 // size)
    count = -(-cm // tiles.block_m) * -(-cn // tiles.block_n)
    assert (kw["CM"], kw["CN"], kw["SCATTER_ROWS"], kw["GIN"]) == (cm, cn, rows, int(gin))
    assert kw["REDUCE_SLABS"] == (1 if gin else 4)  # GIN keeps the whole-tile sum
    # NVLink only: the own chunk's programs sum (FOLD, no reducer programs); GIN: reducers after the partials
    assert kw["FOLD"] is (not gin)
    assert kw["grid"] == (size * count + count * gin,) and kw["out_shape"].shape == (cm, cn)
    (buffers,) = state.placements.values()
    assert buffers.exchange.shape == (2, size, cm, cn)
    assert buffers.flags.shape == (size * count + 2 * size * gin,)
    _check_gin_tile_area(state, buffers, args, gin, size, count, tiles)


@pytest.mark.parametrize("layout", ["chunk_per_peer", "peers_merged", "whole"])
@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
@pytest.mark.parametrize("rows", [True, False], ids=["scatter_rows", "scatter_columns"])
def test_matmul_reduce_scatter_chunked_sums_the_exchanged_partials(monkeypatch, gin, rows, layout):
    """method="chunked" in an NVLink-only job: one chunked custom call under the op's own name
    (its errors and faults name matmul_reduce_scatter) returning this GPU's chunk of every source's
    partial stacked by source, then their sum in float32 in source order, rounded once to the
    dtype. In a job with GIN peers the Triton kernel runs instead."""
    import importlib

    from jaxgin import op_support
    from jaxgin.fused import _chunked

    module = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(module, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    size, dtype = 4, jnp.bfloat16
    cm, cn = (512 // size, 384) if rows else (512, 384 // size)
    # Partials whose float32 sum in source order differs from a bfloat16 running sum.
    partials = (jnp.arange(size * cm * cn, dtype=jnp.float32).reshape(size * cm, cn) % 7 + 1000.0
                + 0.5 * jnp.arange(size * cm, dtype=jnp.float32)[:, None] % 3).astype(dtype)
    binds = []

    def bind(x, w, **params):
        binds.append(params)
        return partials

    monkeypatch.setattr(_chunked.chunked_matmul_p, "bind", bind)
    triton = []
    monkeypatch.setattr(module, "triton_call", lambda kernel, *args, **kw: triton.append(kernel))
    x, w = jnp.zeros((512, 256), dtype), jnp.zeros((256, 384), dtype)
    plan = module._Plan(("x",), size, 512, 384, 256, rows, None, None, "chunked")
    got = module._kernel(_HeapOnlyState(), x, w, plan, chunk_layout=layout)
    if gin:
        assert binds == [] and len(triton) == 1
        return
    ((params),) = binds
    assert triton == []
    assert params["op"] == "jaxgin.fused.matmul_reduce_scatter" and params["split_rows"] is rows
    assert params["layout"] == layout
    assert params["out_shape"] == (size * cm, cn) and params["size"] == size
    assert params["slot"] >= cm * cn * 2 and params["slot"] % 256 == 0
    stacked = partials.reshape(size, cm, cn).astype(jnp.float32)
    want = (((stacked[0] + stacked[1]) + stacked[2]) + stacked[3]).astype(dtype)
    assert got.shape == (cm, cn) and got.dtype == dtype
    assert jnp.array_equal(got, want)
    assert not jnp.array_equal(got, jnp.sum(partials.reshape(size, cm, cn), axis=0, dtype=dtype))


def test_every_chunked_target_has_its_handler_in_csrc():
    """Each chunked op's custom-call target names an exported handler that csrc defines, bound
    with the attributes its lowering passes (the reduce-scatter takes no concat_rows: its partials
    are always stacked by source)."""
    from jaxgin.ffi import op_table

    source = (Path(__file__).parents[1] / "csrc" / "ffi" / "chunked_matmul.cu").read_text()
    (family,) = [f for f in op_table.FAMILIES if f.name == "fused"]
    cublas = [t for t in family.targets if t.name != "jaxgin_triton_chunks"]
    for target in cublas:
        symbol = target.handlers["execute"]
        start = source.index(f"XLA_FFI_DEFINE_HANDLER_SYMBOL({symbol},")
        binding = source[start:source.index(";", start)]
        assert '"split_rows"' in binding if "all_gather" not in symbol else '"split_rows"' not in binding
        assert ('"concat_rows"' in binding) == ("all_to_all" in symbol), binding
        # every op's cuBLAS calls laid out by the op table's ChunkLayout code
        assert '"layout"' in binding, binding
    assert {op.name for t in cublas for op in t.ops} == {
        "jaxgin.fused.matmul_all_to_all", "jaxgin.fused.all_gather_matmul", "jaxgin.fused.matmul_reduce_scatter"}
    # the Triton layout's target: triton_call's attributes (an instantiate stage binding the same
    # ones loads the kernel), then the exchange's, which its lowering passes
    (triton,) = [t for t in family.targets if t.name == "jaxgin_triton_chunks"]
    assert not triton.capturable  # CUDA refused to update its recorded peer copy (chunked_matmul.cu)
    for stage in ("instantiate", "execute"):
        start = source.index(f"XLA_FFI_DEFINE_HANDLER_SYMBOL({triton.handlers[stage]},")
        assert "JAXGIN_TRITON_CHUNKS_ATTRS" in source[start:source.index(";", start)]
    attributes = source[source.index("#define JAXGIN_TRITON_CHUNKS_ATTRS"):source.index("jaxgin_ffi_triton_chunks_")]
    assert "JAXGIN_TRITON_KERNEL_ATTRS" in attributes  # triton_call's, from the header both include
    header = (Path(__file__).parents[1] / "csrc" / "ffi" / "triton_kernel.h").read_text()
    attributes += header[header.index("#define JAXGIN_TRITON_KERNEL_ATTRS"):]
    for name in ("cubin", "kernel_name", "grid", "num_warps", "shared_bytes", "params", "generation", "mesh_ranks",
                 "mesh_shape", "axes", "offset", "slot_bytes", "chunk_rows", "chunk_cols", "element_bytes",
                 "concat_rows", "reduce"):
        assert f'"{name}"' in attributes, name


def test_a_chunk_layout_is_named_from_the_op_table():
    """The chunked ops' `layout` attribute: the op table's ChunkLayout code for a known name, and a
    clear error naming the choices otherwise."""
    from jaxgin.ffi import op_table
    from jaxgin.fused import _chunked

    assert _chunked.CUBLAS_LAYOUTS == ("chunk_per_peer", "peers_merged", "whole")
    assert _chunked.LAYOUTS == _chunked.CUBLAS_LAYOUTS + ("triton_tiles",)
    assert [int(op_table.ChunkLayout[name.upper()]) for name in _chunked.CUBLAS_LAYOUTS] == [0, 1, 2]
    assert "enum ChunkLayout : int64_t { kChunkPerPeer = 0, kPeersMerged = 1, kWhole = 2 };" in op_table.header()
    with pytest.raises(ValueError,
                       match="chunk layout 'rows': expected one of chunk_per_peer, peers_merged, whole, triton_tiles"):
        _chunked._layout("rows")
    plan = types.SimpleNamespace(m=64, n=32, k=16)
    with pytest.raises(ValueError, match="all_gather_matmul: layout 'triton_tiles' computes chunks bound for peers"):
        _chunked.all_gather_matmul(jnp.zeros((64, 16)), jnp.zeros((16, 32)), plan, "triton_tiles")


@pytest.mark.parametrize("op", ["matmul_all_to_all", "matmul_reduce_scatter"])
@pytest.mark.parametrize("rows", [True, False], ids=["row_chunks", "column_chunks"])
def test_the_triton_tiles_layout_is_one_kernel_that_hands_chunks_over(monkeypatch, op, rows):
    """The chunked method's "triton_tiles" layout: one Triton kernel (matmul_chunks_kernel), a
    program per tile of every chunk, given a heap block of its own (the chunk slots, then its
    flags) and a zeroed counter per peer, in a custom call that tells the exchange the chunk's
    shape, where the own chunk goes and which op it serves; the reduce-scatter sums what it
    returns in source order."""
    import importlib

    from jaxgin import op_support, triton_op
    from jaxgin.fused import _chunked, _common, _kernels

    module = importlib.import_module(f"jaxgin.fused.{op}")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: False)
    monkeypatch.setattr("jaxgin.route.axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    size, dtype = 4, jnp.bfloat16
    x, w = jnp.zeros((512, 256), dtype), jnp.zeros((256, 384), dtype)
    cm, cn = (512 // size, 384) if rows else (512, 384 // size)
    reduce = op == "matmul_reduce_scatter"
    out_shape = (size * cm, cn) if reduce or rows else (cm, size * cn)
    partials = (jnp.arange(size * cm * cn, dtype=jnp.float32).reshape(out_shape) % 5 + 300.0).astype(dtype)
    lowered, binds = [], []

    def lowered_call(kernel, args, **kw):
        lowered.append((kernel, args, kw))
        call = triton_op.LoweredCall(list(args[:2]), [jax.ShapeDtypeStruct(out_shape, dtype)], {}, False, True,
                                     kw["out_shape"])
        return call

    def bind(*operands, **params):
        binds.append(params)
        return [partials]

    monkeypatch.setattr(triton_op, "lowered_call", lowered_call)
    monkeypatch.setattr(_chunked.triton_chunks_p, "bind", bind)
    state = _HeapOnlyState()
    if reduce:
        plan = module._Plan(("x",), size, 512, 384, 256, rows, None, None, "chunked")
    else:
        plan = module._Plan(("x",), size, 512, 384, 256, rows, rows, None, None, "chunked")
    got = module._kernel(state, x, w, plan, chunk_layout="triton_tiles")
    ((kernel, args, kw),) = lowered
    ((params),) = binds
    assert kernel is _kernels.matmul_chunks_kernel
    tiles = _common.WIDE_FIRST_CANDIDATES[2][0]
    assert kw["grid"] == (size * -(-cm // tiles.block_m) * -(-cn // tiles.block_n),)
    assert kw["out_shape"].shape == out_shape
    c = kw["constexprs"]
    assert (c["P"], c["CM"], c["CN"], c["SPLIT_ROWS"], c["CONCAT_ROWS"], c["OUT_N"]) == (
        size, cm, cn, rows, reduce or rows, out_shape[1])
    assert (c["BM"], c["BN"], c["BK"]) == (tiles.block_m, tiles.block_n, tiles.block_k)
    _x, _w, _route, slots, words, counters = args
    slot = params["slot_bytes"]
    assert slot >= cm * cn * 2 and slot % 256 == 0 and c["SLOT"] * 2 == slot
    assert slots.offset == params["offset"] and slots.nbytes == size * slot
    assert (_chunked.TRITON_TILES, tiles) in [key[-2:] for key in state.placements]  # not the cuBLAS layouts' block
    assert words.offset == params["offset"] + size * slot and words.shape == (2 * size,)
    assert counters.shape == (size,) and counters.dtype == np.int64
    assert (params["chunk_rows"], params["chunk_cols"], params["element_bytes"]) == (cm, cn, 2)
    assert params["concat_rows"] == int(reduce or rows) and params["reduce"] == int(reduce)
    assert params["op"] == f"jaxgin.fused.{op}" and params["names"] == ("x",)
    if reduce:
        stacked = partials.reshape(size, cm, cn).astype(jnp.float32)
        want = (((stacked[0] + stacked[1]) + stacked[2]) + stacked[3]).astype(dtype)
        assert jnp.array_equal(got, want)
    else:
        assert got is partials


def _check_gin_tile_area(state, buffers, args, gin, size, count, tiles):
    """A kernel that sends whole tiles: in a job with GIN peers a tile area [outgoing, incoming] x
    2 halves x peers x tiles and a signal per (call parity, source), passed as arguments 6 and 7;
    in an NVLink-only job neither (the exchange buffer stands in)."""
    assert state.signals.available() == 1024 - 2 * size * gin
    if gin:
        assert buffers.gin_area.shape == (2, 2, size, count, tiles.block_m * tiles.block_n)
        assert args[6] is buffers.gin_area and args[7] == buffers.signals
    else:
        assert buffers.gin_area is None and args[6] is buffers.exchange


def test_gin_copiers_fill_the_gpu_without_idle_programs():
    from jaxgin.fused import _common

    for size in (2, 4, 8, 64, 256):
        for tiles in (1, 3, 64, 4096):
            copiers = _common.gin_copiers(size, tiles)
            assert 1 <= copiers <= tiles  # at least one per source, never one without a tile
            assert size * copiers <= max(size, _common.GIN_COPY_PROGRAMS)


def test_tile_config_is_checked():
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        TileConfig(128, 96, 64)


def test_axis_route_follows_the_mesh(init):
    order = [3, 1, 0, 2, 7, 5, 6, 4]
    mesh = Mesh(np.array(jax.devices())[order].reshape(2, 4), ("a", "b"))
    rank = {d: r for r, d in enumerate(jax.devices())}
    grid = np.vectorize(lambda d: rank[d])(mesh.devices)

    def routes(axis):
        f = jax.shard_map(lambda: jaxgin.axis_route(axis)[None, None], mesh=mesh, in_specs=(), out_specs=P("a", "b"))
        return np.asarray(jax.jit(f)())

    along_b = routes("b")
    for i in range(2):
        for j in range(4):
            assert along_b[i, j, 0] == j
            assert list(along_b[i, j, 1:]) == list(grid[i])
    along_both = routes(("a", "b"))
    for i in range(2):
        for j in range(4):
            assert along_both[i, j, 0] == i * 4 + j
            assert list(along_both[i, j, 1:]) == list(grid.flat)


def test_axis_route_needs_every_axis_manual(init):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("a", "b"))
    f = jax.shard_map(lambda x: x + jaxgin.axis_route("a")[0], mesh=mesh, in_specs=P("a"), out_specs=P("a"),
                      axis_names={"a"})
    with pytest.raises(jaxgin.JaxginError, match="manual over every mesh axis"):
        jax.jit(f)(jnp.zeros((4,), jnp.int32))


def test_axis_route_over_a_vmap_axis(init):
    """A jax.vmap axis_name has no ranks: the error names it and says to use jax.shard_map
    (jaxgin/ffi/axes.py's require_shard_map, shared by ops that only exist between devices)."""
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    f = jax.shard_map(lambda v: jax.vmap(lambda u: u + jaxgin.axis_route("i")[0], axis_name="i")(v), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"), check_vma=False)
    with pytest.raises(jaxgin.JaxginError, match=r"axis_route: axis_name 'i' is bound by jax.vmap.*\('x',\).*jax.shard_map"):
        jax.jit(f)(jnp.zeros((8,), jnp.int32))


# ---------------------------------------------------------------------------------------------
# The GPU kernels, compiled and linked for sm_90a on this machine (no GPU needed).


def test_the_fused_kernels_tile_order_covers_every_tile_once_group_by_group():
    """_kernels._tile_coords, run by Triton's interpreter on this machine: the program numbers of a
    grid map onto its tiles one to one (no tile computed twice or never, ragged grids included), and
    each run of GROUP_M * TN numbers stays within one group of GROUP_M row tiles."""
    checked = triton_interpreter_check("tile_order")
    assert len(checked) == 6 and all(c["every_tile_once"] and c["groups_in_runs"] for c in checked), checked


def test_network_entry_on_the_device_follows_the_hosts_rule():
    """op_kernels.network_entry (which GPU of a host receives a sender's data over the network, for
    all_gather_matmul's forwarding), run by Triton's interpreter for every sender and destination,
    equals jaxgin.hosts.entries over six layouts (unsorted axes and an axis over some ranks
    included); each other host gets a sender's data at one GPU, and with equal hosts each GPU
    receives from one sender per host. host_place and host_size (MoE's relay rows) equal each
    index's place and count among its host's."""
    checked = triton_interpreter_check("network_entries")
    assert len(checked) == 6, checked
    assert all(c["equal"] and c["places_and_sizes"] and c["once_per_host"] and c["one_sender_per_host_each"]
               for c in checked), checked


def test_rank_hosts_follows_the_lsa_teams_and_names_a_layout_it_cannot_express():
    from jaxgin.errors import JaxginError
    from jaxgin.hosts import rank_hosts

    two = [{"rank": r, "lsa_rank": r % 2, "lsa_size": 2} for r in (2, 3)]
    assert rank_hosts(_FakeState(8, two), "op").tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rank_hosts(_FakeState(4, two, force_gin=True), "op").tolist() == [0, 1, 2, 3]  # every GPU alone
    with pytest.raises(JaxginError, match=r"op: .*equal GPU counts.*rank 2 is GPU 0 of a host of 2 in a job of 5"):
        rank_hosts(_FakeState(5, two), "op")
    shifted = [{"rank": 1, "lsa_rank": 0, "lsa_size": 2}]  # a host of 2 starting at rank 1
    with pytest.raises(JaxginError, match="rank 1 is GPU 0 of a host of 2"):
        rank_hosts(_FakeState(4, shifted), "op")


# The fused kernels' runtime pointer parameters (bfloat16), as the compile tests give them to Triton.
_ALL_TO_ALL_POINTERS = {"ctx": "*u8", "x": "*bf16", "w": "*bf16", "route": "*i32", "recv": "*bf16", "flags": "*i64",
                        "state": "*i64", "gin_tiles": "*bf16", "sig": "i32", "out": "*bf16"}
_REDUCE_SCATTER_POINTERS = {"ctx": "*u8", "x": "*bf16", "w": "*bf16", "route": "*i32", "partials": "*bf16",
                            "flags": "*i64", "state": "*i64", "gin_tiles": "*bf16", "sig": "i32", "out": "*bf16"}
_ALL_GATHER_POINTERS = {"ctx": "*u8", "x": "*bf16", "w": "*bf16", "route": "*i32", "hosts": "*i32", "gather": "*bf16",
                        "flags": "*i64", "state": "*i64", "sig": "i32", "out": "*bf16"}


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
def test_fused_kernels_compile_and_link_for_sm90a(toolchain, gin):
    from jaxgin.fused import _kernels
    from jaxgin.triton_device import link

    pointers = _ALL_TO_ALL_POINTERS
    a2a = compile_for_sm90(_kernels.matmul_all_to_all_kernel, pointers, num_warps=8, constexprs=dict(
        M=4096, N=2048, K=7168, P=4, CM=1024, CN=2048, SPLIT_ROWS=True, CONCAT_ROWS=True, OUT_N=2048,
        BM=128, BN=256, BK=64, GROUP_M=8, PRECISION="tf32", PARTS=7, INTERLEAVE=True, PULL=True,
        GIN=gin, COPIERS=32 * gin, XB=2, COPY_SLABS=0, MOVERS=0, MOVED=0))
    assert b"jaxgin_tt_wait_peer_flag" in a2a.asm["cubin"]  # the pull: waits on the producer's flag
    ag = compile_for_sm90(_kernels.all_gather_matmul_kernel, _ALL_GATHER_POINTERS, num_warps=8, constexprs=dict(
        ML=1024, N=2048, K=7168, P=4, G=8, GR=128, SENDERS=16, BM=128, BN=256, BK=64, GROUP_M=8, PRECISION="tf32",
        SEND_BM=32, SEND_BK=1024, GIN=gin, XB=2, BP=4))
    for kernel in (a2a, ag):
        ptx = kernel.asm["ptx"]
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        assert b"jaxgin_tt_set_flag" in kernel.asm["cubin"]  # linked with the device library
        assert "wgmma" in ptx  # Hopper tensor cores
        assert re.search(r"st\.global\.v4", ptx)  # 16-byte stores
        assert kernel.metadata.shared > 48 * 1024  # multi-stage pipeline (triton_call raises the limit)
        # The GIN paths (per-peer choice, puts, counted arrivals) are compiled in only when the job
        # has GIN peers (jaxgin.op_support.gin_in_job): an NVLink-only job runs the kernels it ran before.
        calls = set(link.library_calls(ptx))
        gin_calls = {"jaxgin_tt_gin_peer", "jaxgin_tt_put_signal", "jaxgin_tt_wait_arrivals"}
        assert (gin_calls <= calls) if gin else not (gin_calls & calls), calls


def test_all_gather_matmul_kernel_compiles_to_one_size_at_any_axis(toolchain):
    """The senders' loops over the other GPUs run at run time, so the kernel is the same size at
    any axis size (docs/measurements.md, twentieth session: unrolled, it grew with the axis)."""
    from jaxgin.fused import _kernels

    def size(p):
        return memory_operations(compile_for_sm90(_kernels.all_gather_matmul_kernel, _ALL_GATHER_POINTERS, num_warps=8,
                                                  constexprs=dict(ML=1024, N=2048, K=7168, P=p, G=8, GR=128, SENDERS=16,
                                                                  BM=128, BN=256, BK=64, GROUP_M=8, PRECISION="tf32",
                                                                  SEND_BM=32, SEND_BK=1024, GIN=1, XB=2, BP=p)))

    sizes = {p: size(p) for p in (2, 8)}
    assert sizes[8] == sizes[2] > 0, sizes


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
@pytest.mark.parametrize("warps", [8, 4])
def test_all_gather_matmul_kernel_leaves_room_for_two_programs_per_sm(toolchain, warps, gin):
    """128 x 128 x 64 tiles with 3 stages take 96 KiB of shared memory so that two programs share
    an SM; their registers must allow it too: at most 65536 / (2 x 32 x warps) per thread. The
    registers are the most any path of the kernel needs: the senders' copy blocks (32 x 1024, 128
    elements per thread, had made it 216 at 8 warps, one program per SM) count as much as the
    tile's accumulator, and so does device-library code compiled into it (the GIN put: 146 at 8
    warps uncapped), which the op's register cap (two_programs_registers, as the op compiles it)
    keeps within bounds."""
    import importlib

    from jaxgin.fused import _kernels
    from jaxgin.fused._common import two_programs_registers

    ag_module = importlib.import_module("jaxgin.fused.all_gather_matmul")
    tile = dict(BM=128, BN=128, BK=64, GROUP_M=8, PRECISION="tf32")
    kernel = compile_for_sm90(_kernels.all_gather_matmul_kernel, _ALL_GATHER_POINTERS, num_warps=warps, constexprs=dict(
        ML=2048, N=2048, K=7168, P=2, G=16, GR=128, SENDERS=ag_module.SENDERS, GIN=gin, XB=2, BP=2,
        SEND_BM=ag_module.send_rows(warps), SEND_BK=ag_module.SEND_COLUMNS, **tile),
        max_registers=two_programs_registers(TileConfig(128, 128, 64, 8, warps, 3), 2))
    tile_code = compile_for_sm90(_kernels.matmul_kernel, {"ctx": "*u8", "x": "*bf16", "w": "*bf16", "out": "*bf16"},
                                 num_warps=warps, constexprs=dict(M=4096, N=2048, K=7168, **tile))
    assert kernel.metadata.shared <= 228 * 1024 // 2
    assert registers_per_thread(kernel) <= 65536 // (2 * 32 * warps), registers_per_thread(kernel)
    assert registers_per_thread(kernel) <= registers_per_thread(tile_code) + 24


# Each fused kernel the benchmarks trace (benchmarks/fused.py --*-trace-only): its plain and traced
# forms, pointer parameters and constexprs at the first shape on 2 GPUs.
_TRACED_KERNELS = {
    "all_gather_matmul": ("all_gather_matmul_kernel", "all_gather_matmul_traced_kernel", "_ALL_GATHER_POINTERS",
                          dict(ML=2048, N=2048, K=7168, P=2, G=16, GR=128, SENDERS=16, BM=128, BN=128, BK=64,
                               GROUP_M=8, PRECISION="tf32", SEND_BM=8, SEND_BK=1024, GIN=0, XB=2, BP=2)),
    "matmul_all_to_all": ("matmul_all_to_all_kernel", "matmul_all_to_all_traced_kernel", "_ALL_TO_ALL_POINTERS",
                          dict(M=4096, N=2048, K=7168, P=2, CM=2048, CN=2048, SPLIT_ROWS=True, CONCAT_ROWS=True,
                               OUT_N=2048, BM=128, BN=128, BK=64, GROUP_M=8, PRECISION="tf32", PARTS=7,
                               INTERLEAVE=True, PULL=True, GIN=0, COPIERS=0, XB=2, COPY_SLABS=0, MOVERS=0, MOVED=0)),
    "matmul_reduce_scatter": ("matmul_reduce_scatter_kernel", "matmul_reduce_scatter_traced_kernel",
                              "_REDUCE_SCATTER_POINTERS",
                              dict(M=4096, N=2048, K=7168, P=2, CM=2048, CN=2048, SCATTER_ROWS=True, BM=128, BN=128,
                                   BK=64, GROUP_M=8, PRECISION="tf32", GIN=0, XB=2, LAG=0, WAIT_FIRST=False,
                                   REDUCE_SLABS=4, FOLD=True, PUSH=False)),
}


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
@pytest.mark.parametrize("op", sorted(_TRACED_KERNELS))
def test_fused_kernels_keep_their_matmul_pipelined(toolchain, op, gin, tmp_path):
    """ptxas serializes every wgmma of a function that calls an external function (advisory C7509:
    each asynchronous matmul waits for the one before), which slowed the fused kernels' matmul by a
    fifth while they called the device library compiled apart. Compiled in one module with the
    library, as the link step does, nothing is serialized; the kernel's PTX compiled alone, calls
    left external, shows what the check would catch."""
    from jaxgin.fused import _kernels
    from jaxgin.triton_device import link

    plain_name, _traced, pointers_name, constexprs = _TRACED_KERNELS[op]
    constexprs = dict(constexprs, GIN=gin, **({"COPIERS": 2} if op == "matmul_all_to_all" and gin else {}))
    kernel = compile_for_sm90(getattr(_kernels, plain_name), globals()[pointers_name], num_warps=8,
                              constexprs=constexprs)
    ptxas, release = link.ptxas()
    ptx = link.readable_ptx(kernel.asm["ptx"], release)
    assert link.library_calls(ptx) and "wgmma" in ptx
    _cubin, log = link.compile_module(link.one_module(ptx, link._library_ptx("sm_90a")), "sm_90a")
    assert "C7509" not in log, log
    (tmp_path / "kernel.ptx").write_text(ptx)
    apart = subprocess.run([str(ptxas), "-c", "-v", "--gpu-name=sm_90a", str(tmp_path / "kernel.ptx"), "-o",
                            str(tmp_path / "kernel.o")], capture_output=True, text=True, check=True)
    assert "C7509" in apart.stdout + apart.stderr


@pytest.mark.parametrize("op", sorted(_TRACED_KERNELS))
def test_traced_kernels_record_what_the_plain_ones_do_not(toolchain, op):
    """A fused op's traced kernel reads the GPU's timer and SM id and stores each program's record;
    the kernel the op runs has none of it, and the records cost the traced one few registers: it
    still fits two programs of 8 warps on an SM, as the plain kernel does."""
    from jaxgin.fused import _kernels

    plain_name, traced_name, pointers_name, constexprs = _TRACED_KERNELS[op]
    pointers = globals()[pointers_name]
    plain = compile_for_sm90(getattr(_kernels, plain_name), pointers, num_warps=8, constexprs=constexprs)
    traced = compile_for_sm90(getattr(_kernels, traced_name), dict(pointers, trace="*i32"), num_warps=8,
                              constexprs=constexprs)
    for register in ("%globaltimer", "%smid"):
        assert register in traced.asm["ptx"] and register not in plain.asm["ptx"]
    assert registers_per_thread(traced) <= 128


def test_a_traced_all_to_all_returns_its_records_beside_the_result(monkeypatch):
    """matmul_all_to_all._triton(trace=True): the traced kernel, a record of 16 int32 per program
    (movers included) beside the result; refused in a job with GIN peers (its copy-out programs
    are not traced)."""
    import importlib

    a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    from jaxgin.fused import _kernels

    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(a2a, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    calls = []
    monkeypatch.setattr(a2a, "triton_call", lambda kernel, *args, **kw: calls.append((kernel, kw)))
    size = 4
    x, w = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.bfloat16)
    plan = a2a._Plan(("x",), size, 512, 384, 256, True, True, None, None, "triton")
    a2a._triton(_HeapOnlyState(), x, w, plan, False, 7, True, True, trace=True)
    ((kernel, kw),) = calls
    count = -(-(512 // size) // kw["BM"]) * -(-384 // kw["BN"])
    result, records = kw["out_shape"]
    assert kernel is _kernels.matmul_all_to_all_traced_kernel
    assert result.shape == plan.out_shape and records.shape == (size * count, 16) and records.dtype == jnp.int32
    assert (kw["MOVERS"], kw["MOVED"]) == (0, 0)
    calls.clear()
    a2a._triton(_HeapOnlyState(), x, w, plan, False, 7, True, True, trace=True, movers=2)  # a record per mover too
    ((kernel, kw),) = calls
    assert kw["grid"] == (2 + size * count,) and kw["out_shape"][1].shape == (2 + size * count, 16)
    assert (kw["MOVERS"], kw["MOVED"]) == (2, 0)  # one wave: every program copies its own arrival
    with pytest.raises(ValueError, match="parts=3 leaves some out"):
        a2a._triton(_HeapOnlyState(), x, w, plan, False, 3, True, True, movers=2)
    with pytest.raises(ValueError, match="traced kernel runs over NVLink only"):
        a2a._triton(_HeapOnlyState(), x, w, plan, True, 7, True, True, trace=True)


@pytest.mark.parametrize(("fold", "push"), [(False, False), (True, False), (True, True)],
                         ids=["reducer_programs", "folded_reducers", "folded_pushed"])
@pytest.mark.parametrize("warps", [8, 4])
def test_matmul_reduce_scatter_kernel_leaves_room_for_two_programs_per_sm(toolchain, warps, fold, push):
    """As for all_gather_matmul: the exchange's 128 x 128 x 64 tiles share an SM two by two, so the
    reducers' sum, which is in the same kernel (in the same program as a partial when folded),
    must not need more registers than that allows (a whole-tile sum made it 175 at 8 warps, and
    255, the most there is, at 4)."""
    import importlib

    from jaxgin.fused import _kernels

    rs_module = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    pointers = _REDUCE_SCATTER_POINTERS
    kernel = compile_for_sm90(_kernels.matmul_reduce_scatter_kernel, pointers, num_warps=warps, constexprs=dict(
        M=4096, N=2048, K=7168, P=2, CM=2048, CN=2048, SCATTER_ROWS=True, BM=128, BN=128, BK=64, GROUP_M=8,
        PRECISION="tf32", GIN=0, XB=2, LAG=0, WAIT_FIRST=False, REDUCE_SLABS=rs_module.reduce_slabs(128, False),
        FOLD=fold, PUSH=push))
    assert registers_per_thread(kernel) <= min(65536 // (2 * 32 * warps), 240), registers_per_thread(kernel)


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
def test_matmul_reduce_scatter_kernel_compiles_and_links_for_sm90a(toolchain, gin):
    from jaxgin.fused import _kernels
    from jaxgin.triton_device import link

    pointers = _REDUCE_SCATTER_POINTERS
    kernel = compile_for_sm90(_kernels.matmul_reduce_scatter_kernel, pointers, num_warps=8, constexprs=dict(
        M=8192, N=4096, K=1024, P=4, CM=2048, CN=4096, SCATTER_ROWS=True, BM=128, BN=128, BK=64, GROUP_M=8,
        PRECISION="tf32", GIN=gin, XB=2, LAG=0, WAIT_FIRST=False, REDUCE_SLABS=4 - 3 * gin, FOLD=False, PUSH=False))
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"][:4] == b"\x7fELF" and "wgmma" in ptx
    calls = set(link.library_calls(ptx))
    assert {"jaxgin_tt_set_flag", "jaxgin_tt_wait_flag", "jaxgin_tt_wait_peer_flag", "jaxgin_tt_peer_delta"} <= calls
    gin_calls = {"jaxgin_tt_gin_peer", "jaxgin_tt_put_signal", "jaxgin_tt_wait_arrivals"}
    assert (gin_calls <= calls) if gin else not (gin_calls & calls), calls


@pytest.mark.parametrize("push", [False, True], ids=["pulled", "pushed"])
def test_folded_reduce_scatter_waits_on_peers_alone(toolchain, push):
    """FOLD, the NVLink default: the own chunk's partial is summed by the program that stored it,
    so nothing sets or waits on a local flag for it; the peers' partials are still flagged and
    waited for over NVLink. With PUSH a partial is stored and flagged in its owner's buffer, so
    the owner waits on local flags alone."""
    from jaxgin.fused import _kernels
    from jaxgin.triton_device import link

    pointers = _REDUCE_SCATTER_POINTERS
    kernel = compile_for_sm90(_kernels.matmul_reduce_scatter_kernel, pointers, num_warps=8, constexprs=dict(
        M=8192, N=4096, K=1024, P=4, CM=2048, CN=4096, SCATTER_ROWS=True, BM=128, BN=128, BK=64, GROUP_M=8,
        PRECISION="tf32", GIN=0, XB=2, LAG=0, WAIT_FIRST=False, REDUCE_SLABS=4, FOLD=True, PUSH=push))
    calls = set(link.library_calls(kernel.asm["ptx"]))
    assert {"jaxgin_tt_set_flag", "jaxgin_tt_peer_delta"} <= calls, calls
    if push:
        assert "jaxgin_tt_wait_flag" in calls and "jaxgin_tt_wait_peer_flag" not in calls, calls
    else:
        assert "jaxgin_tt_wait_peer_flag" in calls and "jaxgin_tt_wait_flag" not in calls, calls


@pytest.mark.parametrize(("lag", "wait_first"), [(4, False), (0, True), (16, True)])
def test_matmul_reduce_scatter_reducer_layouts_compile_for_sm90a(toolchain, lag, wait_first):
    """The reducer placements and orders benchmarks/fused.py --variants-only compares (LAG tiles of
    slack, every source waited for first) compile with the NVLink paths."""
    from jaxgin.fused import _kernels
    from jaxgin.triton_device import link

    pointers = _REDUCE_SCATTER_POINTERS
    kernel = compile_for_sm90(_kernels.matmul_reduce_scatter_kernel, pointers, num_warps=8, constexprs=dict(
        M=8192, N=4096, K=1024, P=4, CM=2048, CN=4096, SCATTER_ROWS=True, BM=128, BN=128, BK=64, GROUP_M=8,
        PRECISION="tf32", GIN=0, XB=2, LAG=lag, WAIT_FIRST=wait_first, REDUCE_SLABS=4, FOLD=False, PUSH=False))
    assert kernel.asm["cubin"][:4] == b"\x7fELF" and "wgmma" in kernel.asm["ptx"]
    assert {"jaxgin_tt_wait_flag", "jaxgin_tt_wait_peer_flag"} <= set(link.library_calls(kernel.asm["ptx"]))


@pytest.mark.parametrize("p", [2, 4, 8])
def test_folded_reducers_wait_only_for_lower_places(p):
    """matmul_reduce_scatter_kernel with FOLD, in plain Python: place q is tile q // P for owner
    (me + 1 + q % P) % P, so each GPU's own-chunk program of tile t is the last of t's places, and
    the P - 1 peer programs it waits for (tile t of this GPU's chunk, on each peer) sit below it."""
    tiles = 5
    for me in range(p):
        own = [q for q in range(p * tiles) if (me + 1 + q % p) % p == me]
        assert own == [t * p + p - 1 for t in range(tiles)]
        for t in range(tiles):
            for peer in set(range(p)) - {me}:
                (place,) = [q for q in range(p * tiles) if q // p == t and (peer + 1 + q % p) % p == me]
                assert place < t * p + p - 1


def test_folded_reducers_drop_the_reducer_programs(monkeypatch):
    """fold=True: a grid of the partials alone, FOLD given to the kernel; refused with GIN peers;
    the default folds in a job without them."""
    import importlib

    rs = importlib.import_module("jaxgin.fused.matmul_reduce_scatter")
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(rs, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    calls = []
    monkeypatch.setattr(rs, "triton_call", lambda kernel, *args, **kw: calls.append(kw))
    size = 4
    x, w = jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((256, 384), jnp.bfloat16)
    plan = rs._Plan(("x",), size, 512, 384, 256, True, None, None, "triton")
    for gin, fold in ((False, False), (False, True), (False, None), (True, None)):
        rs._triton(_HeapOnlyState(), x, w, plan, gin, 0, False, fold)
    count = -(-(512 // size) // calls[0]["BM"]) * -(-384 // calls[0]["BN"])
    # None (the op's default) folds where every peer is on NVLink
    assert [(kw["grid"], kw["FOLD"]) for kw in calls] == [
        ((size * count + count,), False), ((size * count,), True), ((size * count,), True), ((size * count + count,), False)]
    with pytest.raises(ValueError, match="folded reducers run over NVLink only"):
        rs._triton(_HeapOnlyState(), x, w, plan, True, 0, False, True)
    with pytest.raises(ValueError, match="push is an NVLink layout"):
        rs._triton(_HeapOnlyState(), x, w, plan, True, 0, False, False, True)
    rs._triton(_HeapOnlyState(), x, w, plan, False, 0, False, True, True)
    assert calls[-1]["PUSH"] is True and calls[-1]["FOLD"] is True
    # traced (the benchmark's records): folded only, a record of 16 int32 per program beside the result
    with pytest.raises(ValueError, match="only the folded kernel is traced"):
        rs._triton(_HeapOnlyState(), x, w, plan, False, 0, False, False, trace=True)
    rs._triton(_HeapOnlyState(), x, w, plan, False, 0, False, True, trace=True)
    result, records = calls[-1]["out_shape"]
    assert result.shape == (512 // size, 384) and records.shape == (size * count, 16) and records.dtype == jnp.int32


def test_reducer_places_cover_every_program_once():
    """matmul_reduce_scatter_kernel's start-order layout, in plain Python: for every LAG every
    partial and reducer has one place, and reducer t comes after the P partials of tile t (the
    deadlock-freedom argument) and after those of tile t + LAG where there is one."""
    def layout(pid, tiles, p, lag):
        q = pid - lag * p
        block, place = q // (p + 1), q % (p + 1)
        if pid < lag * p:
            return ("partial", pid)
        if block < tiles - lag and place < p:
            return ("partial", (block + lag) * p + place)
        return ("reduce", block if block < tiles - lag else tiles - lag + q - (tiles - lag) * (p + 1))

    for tiles, p in ((6, 2), (16, 4), (5, 8)):
        for lag in range(tiles + 1):
            order = [layout(pid, tiles, p, lag) for pid in range(tiles * p + tiles)]
            assert sorted(order) == sorted([("partial", i) for i in range(tiles * p)] +
                                           [("reduce", t) for t in range(tiles)]), (tiles, p, lag)
            where = {item: i for i, item in enumerate(order)}
            for t in range(tiles):
                assert all(where[("partial", t * p + s)] < where[("reduce", t)] for s in range(p))
                if t + lag < tiles:
                    assert where[("partial", (t + lag) * p + p - 1)] < where[("reduce", t)]


def test_own_kernels_ask_for_fma_fusion_by_name(monkeypatch):
    """jaxgin's kernels were measured with Triton's FMA fusion on, and Triton 3.9 warns that 3.10
    turns its default off: the fused ops (and MoE) ask for it by name, so their numerics do not
    follow the installed Triton; a user's triton_call leaves it to Triton unless told."""
    pytest.importorskip("triton")
    from jaxgin import triton_op as tc
    from jaxgin.fused import _common

    seen = {}
    monkeypatch.setattr(_common, "triton_call", lambda kernel, *args, **kwargs: seen.update(kwargs))
    _common.matmul(jnp.zeros((64, 32), jnp.float32), jnp.zeros((32, 48), jnp.float32), TileConfig(32, 32, 32))
    assert seen["enable_fp_fusion"] is tc.OWN_KERNELS_FP_FUSION is True
    assert tc.compile_options(8, 3, True) == {"num_warps": 8, "num_stages": 3, "enable_fp_fusion": True}
    assert tc.compile_options(8, 3, False)["enable_fp_fusion"] is False
    assert "enable_fp_fusion" not in tc.compile_options(8, 3)  # None: Triton's default


def test_fused_kernels_are_capped_where_two_programs_share_an_sm():
    """The fused kernels' register cap (Triton's maxnreg): 65536 / (2 x 32 x warps) where two
    programs fit by shared memory, none where one fills it (128 x 256 tiles: a cap of 128 would spill
    their accumulator) or where the cap is above 255."""
    from jaxgin import triton_op as tc
    from jaxgin.fused._common import two_programs_registers

    assert two_programs_registers(TileConfig(128, 128, 64, 8, 8, 3), 2) == 128
    assert two_programs_registers(TileConfig(128, 128, 32, 8, 8, 3), 4) == 128
    assert two_programs_registers(TileConfig(64, 128, 32, 8, 4, 4), 4) is None  # 256 > 255
    assert two_programs_registers(TileConfig(128, 256, 64, 8, 8, 3), 2) is None  # 144 KiB of buffers
    assert two_programs_registers(TileConfig(128, 128, 64, 8, 8, 4), 2) is None  # 128 KiB
    assert tc.compile_options(8, 3, None, 128) == {"num_warps": 8, "num_stages": 3, "maxnreg": 128}
    with pytest.raises(ValueError, match="max_registers must be between 24 and 255.*got 300"):
        jaxgin.triton_call(lambda: None, grid=(1,), out_shape=jax.ShapeDtypeStruct((1,), jnp.float32),
                           max_registers=300)


def _gpu_fused_scenarios():
    """tests/gpu/fused_scenarios.py, whose loop checks each call against a reference it computes
    without collectives (written_out_reference); the tests below check that oracle here."""
    return gpu_scenario("fused_scenarios")


def _oracle(scenarios, op, split, concat):
    import functools

    return functools.partial(scenarios.written_out_reference, op=op, split=split, concat=concat, product=jnp.matmul)


def _case_data(scenarios, n, case, seed=0):
    op, m, k, nn, dtype = case[:5]
    x_shape, w_shape = scenarios.global_shapes(op, n, m, k, nn)
    keys = jax.random.split(jax.random.key(seed), 2)
    return (jax.random.normal(keys[0], x_shape, jnp.float32).astype(dtype),
            jax.random.normal(keys[1], w_shape, jnp.float32).astype(dtype))


def _case_sm(scenarios, mesh, case, f, out_spec=None):
    x_spec, w_spec, result_spec = scenarios.specs(case[0], case[5] or 0)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(x_spec, w_spec),
                                 out_specs=result_spec if out_spec is None else out_spec))


@pytest.mark.parametrize("n", [1, 2, 8])
def test_gpu_loop_oracle_equals_the_collective_composition(init, n):
    """The GPU loop's collective-free reference, with XLA's matmul as the product, equals the
    unfused composition through XLA's collective bit for bit, in every case of the scenario (every
    split/concat pair, ragged chunks, all_gather_matmul), and matmul_reduce_scatter's reference
    mode (the same partials summed in the same order) for its cases."""
    from jaxgin import op_support

    scenarios = _gpu_fused_scenarios()
    mesh = _mesh(n)
    for case in scenarios.cases(n) + scenarios.reduce_scatter_cases(n):
        op, m, k, nn, dtype, split, concat = case
        oracle = _oracle(scenarios, op, split, concat)

        def both(x, w):
            ws = jax.lax.all_gather(*op_support.same_varying(("x",), w), "x")
            written_out = oracle(jax.lax.all_gather(x, "x"), ws, jax.lax.axis_index("x"))
            if op == "a2a":
                return written_out, jax.lax.all_to_all(jnp.matmul(x, w), "x", split, concat, tiled=True)
            if op == "rs":
                return written_out, jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=split)
            return written_out, jnp.matmul(jax.lax.all_gather(x, "x", tiled=True), w)

        result_spec = scenarios.specs(op, split or 0)[2]
        ours, collective = _case_sm(scenarios, mesh, case, both, (result_spec, result_spec))(
            *_case_data(scenarios, n, case))
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(collective), err_msg=str((op, m, split, concat)))


def _oracle_loop(scenarios, n, case, body=None):
    op, m, k, nn, dtype, split, concat = case
    if body is None:
        if op == "a2a":
            body = lambda x, w: jaxgin.fused.matmul_all_to_all(  # noqa: E731
                x, w, axis_name="x", split_axis=split, concat_axis=concat, method="chunked")
        elif op == "rs":
            body = lambda x, w: jaxgin.fused.matmul_reduce_scatter(x, w, axis_name="x", scatter_dimension=split)  # noqa: E731
        else:
            body = lambda x, w: jaxgin.fused.all_gather_matmul(x, w, axis_name="x", method="chunked")  # noqa: E731
    loop = lambda x, w: scenarios.loop_against_written_out(  # noqa: E731
        x, w, fused_body=body, reference=_oracle(scenarios, op, split, concat), calls=4, fold_every=2)
    return float(_case_sm(scenarios, _mesh(n), case, loop, P())(*_case_data(scenarios, n, case)))


@pytest.mark.parametrize("n", [2, 8])
def test_gpu_loop_agrees_with_the_ops_and_catches_a_misplaced_row(init, n):
    """The GPU scenario's loop over the reference-mode ops reports differences within rounding in
    every case; an op whose output rows are shifted by one shows as a difference of the data's own
    magnitude, and so does a reduce-scatter that drops one source's partial."""
    scenarios = _gpu_fused_scenarios()
    for case in scenarios.cases(n) + scenarios.reduce_scatter_cases(n):
        assert _oracle_loop(scenarios, n, case) <= (1e-5 if case[4] == jnp.float32 else 1e-2), case
    op, m, k, nn, dtype, split, concat = case = scenarios.cases(n)[0]
    shifted = lambda x, w: jnp.roll(  # noqa: E731
        jaxgin.fused.matmul_all_to_all(x, w, axis_name="x", split_axis=split, concat_axis=concat), 1, axis=0)
    assert _oracle_loop(scenarios, n, case, shifted) > 0.1
    rs = scenarios.reduce_scatter_cases(n)[0]
    # without the last source's partial: psum_scatter over the first n - 1 only
    short = lambda x, w: jax.lax.psum_scatter(  # noqa: E731
        jnp.where(jax.lax.axis_index("x") == n - 1, 0, jnp.matmul(x, w)), "x", scatter_dimension=rs[5], tiled=True)
    assert _oracle_loop(scenarios, n, rs, short) > 0.1


def test_senders_count_against_wide_tiles_where_they_spill_into_another_wave():
    """all_gather_matmul's grid is its senders and then the tiles. On 132 SMs at 4096 x 2048 the
    256 tiles of 128 x 256 (one program per SM) fill 2 waves, and 16 senders push them into a
    third; the 512 tiles of 128 x 128 (two per SM) keep their 2 waves. At 8192 x 4096 neither
    gains a wave."""
    from jaxgin.fused._common import programs_per_sm, sender_waves

    wide, square = TileConfig(128, 256, 64, 8, 8, 4), TileConfig(128, 128, 64, 8, 8, 3)
    assert (programs_per_sm(wide, 2), programs_per_sm(square, 2)) == (1, 2)
    assert sender_waves(wide, 4096, 2048, 2, 16, 132) == 1.5
    assert sender_waves(square, 4096, 2048, 2, 16, 132) == 1.0
    assert sender_waves(wide, 8192, 4096, 2, 16, 132) == 1.0
    assert sender_waves(square, 8192, 4096, 2, 16, 132) == 1.0
    assert sender_waves(wide, 4096, 2048, 2, 0, 132) == 1.0


def test_gather_tuning_weighs_each_candidates_time_by_its_sender_waves(monkeypatch, tmp_path):
    """The tuner times each candidate's matmul alone; for all_gather_matmul it takes the one whose
    time, scaled by sender_waves, is least: wide tiles 10 % faster alone lose at 4096 x 2048 (a
    third wave) and win at 8192 x 4096. The choice is keyed by the sender count too."""
    from jaxgin.fused import _common

    wide, square = TileConfig(128, 256, 64, 8, 8, 4), TileConfig(128, 128, 64, 8, 8, 3)
    monkeypatch.setattr(_common, "_cache_file", lambda: tmp_path / "fused-tiles.json")
    monkeypatch.setattr(_common, "_chosen", {})
    monkeypatch.setattr(_common, "_tuning_enabled", lambda: True)
    monkeypatch.setattr(_common, "time_matmul", lambda c, *a, **kw: 0.9 if c == wide else 1.0)
    monkeypatch.setattr(_common.op_support, "outside_trace", lambda f: f())
    device = types.SimpleNamespace(device_kind="H200", core_count=132)
    state = types.SimpleNamespace(local_devices=[device])
    assert wide in _common.GATHER_CANDIDATES[2] and square in _common.GATHER_CANDIDATES[2]
    assert _common.choose_tiles(state, 4096, 2048, 7168, jnp.bfloat16, "tf32", None, "gather", 16) == square
    assert _common.choose_tiles(state, 8192, 4096, 4096, jnp.bfloat16, "tf32", None, "gather", 16) == wide
    assert _common.choose_tiles(state, 4096, 2048, 7168, jnp.bfloat16, "tf32", None, "gather") == wide
    saved = json.loads((tmp_path / "fused-tiles.json").read_text())
    among = "among " + _common.candidates_fingerprint(_common.GATHER_CANDIDATES[2])
    assert all(k.endswith(among) for k in saved), saved
    assert sorted(k.split("|")[-2] for k in saved if "4096x2048" in k) == ["16 senders", "gather"]


def test_the_tuners_clock_kernel_stores_the_global_timer(toolchain):
    """The tuner times candidates between two stamps of the GPU's global timer (ns); each stamp is
    one 8-byte store of it."""
    from jaxgin.fused import _kernels

    kernel = compile_for_sm90(_kernels.clock_kernel, {"ctx": "*u8", "after": "*bf16", "stamp": "*i32"}, num_warps=1)
    ptx = kernel.asm["ptx"]
    assert "%globaltimer" in ptx and re.search(r"st\.global\.b64", ptx), ptx


def test_a_choice_tuned_among_other_candidates_is_tuned_again(monkeypatch, tmp_path):
    """The tile cache outlives a jaxgin upgrade: a choice saved while the candidate set was another
    one (here, before the few-rows tiles) is not taken, and the new set is timed."""
    from jaxgin.fused import _common

    small = _common.SMALL_M_CANDIDATES[0]
    old_set = tuple(c for c in _common.WIDE_FIRST_CANDIDATES[2] if c not in _common.SMALL_M_CANDIDATES)
    stale = (f"H200|512x2048x7168|bfloat16|tf32|wide_first|among {_common.candidates_fingerprint(old_set)}")
    (tmp_path / "fused-tiles.json").write_text(json.dumps({stale: dataclasses.asdict(old_set[1])}))
    monkeypatch.setattr(_common, "_cache_file", lambda: tmp_path / "fused-tiles.json")
    monkeypatch.setattr(_common, "_chosen", {})
    monkeypatch.setattr(_common, "_tuning_enabled", lambda: True)
    timed = []
    monkeypatch.setattr(_common, "time_matmul", lambda c, *a, **kw: timed.append(c) or (0.5 if c == small else 1.0))
    monkeypatch.setattr(_common.op_support, "outside_trace", lambda f: f())
    state = types.SimpleNamespace(local_devices=[types.SimpleNamespace(device_kind="H200", core_count=132)])
    assert _common.choose_tiles(state, 512, 2048, 7168, jnp.bfloat16, "tf32", None, "wide_first") == small
    assert timed == list(_common.WIDE_FIRST_CANDIDATES[2])
    assert len(json.loads((tmp_path / "fused-tiles.json").read_text())) == 2  # the stale entry is left alone


def _ptxas_log_with_the_library(kernel) -> str:
    """ptxas's log for a compiled kernel's PTX in one module with the device library, as the link
    step compiles it."""
    from jaxgin.triton_device import link

    release = link.ptxas()[1]
    return link.compile_module(link.one_module(link.readable_ptx(kernel.asm["ptx"], release),
                                               link._library_ptx("sm_90a")), "sm_90a")[1]


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
def test_all_to_all_copy_in_the_k_loop_decides_once_per_program(toolchain, gin):
    """COPY_SLABS: a program folds its copy-out into the K loop only if the arrival is flagged when
    it starts. The whole program must take one path (its wgmma run warpgroup-wide), so one thread
    reads the peer's flag (system-scope acquire) and the program reads the answer from shared
    memory after a barrier; the copy moves 32-bit words through L2 (.cg); the matmul stays
    pipelined in both paths, in the shared memory of the kernel without it. Without COPY_SLABS none
    of it is compiled in."""
    from jaxgin.fused import _kernels

    plain_name, _traced, pointers_name, constexprs = _TRACED_KERNELS["matmul_all_to_all"]
    kernel = compile_for_sm90(getattr(_kernels, plain_name), globals()[pointers_name], num_warps=8, num_stages=4,
                              constexprs=dict(constexprs, BN=256, GIN=gin, COPIERS=2 * gin, INTERLEAVE=False,
                                              COPY_SLABS=32))
    ptx = kernel.asm["ptx"]
    default = compile_for_sm90(getattr(_kernels, plain_name), globals()[pointers_name], num_warps=8, num_stages=4,
                               constexprs=dict(constexprs, BN=256, GIN=gin, COPIERS=2 * gin))
    # the op's kernel (COPY_SLABS = 0) has neither the check nor the second K loop; the copying
    # one needs no more shared memory (K = 7168 and 32 slabs once doubled it, past what a GPU allows)
    assert kernel.metadata.shared == default.metadata.shared
    assert "ld.global.sys.acquire" not in default.asm["ptx"]
    assert ptx.count("wgmma.mma_async") == 2 * default.asm["ptx"].count("wgmma.mma_async") > 0
    check = re.search(r"@(%p\d+) ld\.global\.sys\.acquire\.b64 (%rd\d+),[^\n]*\n(?:[^\n]*\n){0,4}?\s*@\1 st\.shared"
                      r"[^\n]*\2;[\s\S]{0,200}?bar\.sync", ptx)
    assert check, "the flag check is not one thread's acquire load broadcast through shared memory"
    assert "ld.global.cg.b32" in ptx or "ld.global.cg.v" in ptx
    log = _ptxas_log_with_the_library(kernel)
    assert "C7509" not in log, log


def test_all_to_all_copy_slabs_are_a_power_of_two_within_the_tile_and_the_k_loop():
    """_copy_slabs: what the kernel's COPY_SLABS gets for a requested count, and the errors that
    name why a layout cannot fold its copy-out."""
    import importlib

    a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    wide = TileConfig(128, 256, 64, 8, 8, 4)
    assert a2a._copy_slabs(0, True, wide, 7168, 2048, 2048, 2) == 0
    assert a2a._copy_slabs(32, True, wide, 7168, 2048, 2048, 2) == 32
    assert a2a._copy_slabs(32, True, wide, 256, 2048, 2048, 2) == 4  # 4 K steps
    assert a2a._copy_slabs(48, True, TileConfig(32, 64, 32), 7168, 2048, 2048, 4) == 32  # the tile's 32 rows
    assert a2a._copy_slabs(24, True, wide, 7168, 2048, 2048, 2) == 16
    with pytest.raises(ValueError, match="needs pull=True"):
        a2a._copy_slabs(32, False, wide, 7168, 2048, 2048, 2)
    with pytest.raises(ValueError, match="width 1025 .* must be even"):
        a2a._copy_slabs(32, True, wide, 7168, 1025, 2050, 2)
    assert a2a._copy_slabs(32, True, wide, 7168, 1025, 2050, 4) == 32  # float32 moves whole elements


def test_all_to_all_movers_take_every_arrival_before_the_last_wave():
    """_moved_arrivals: the arrivals the mover programs copy are those of the compute programs
    before the last wave (the SMs' program slots less the movers'), counted in program order for
    both orders; nothing to move when the grid is one wave; the errors name the conflicting
    option or the cap."""
    import importlib

    a2a = importlib.import_module("jaxgin.fused.matmul_all_to_all")
    wide = TileConfig(128, 256, 64, 8, 8, 4)  # one program per SM
    square = TileConfig(128, 128, 64, 8, 8, 3)  # two
    # 2 GPUs, 4096 rows, 128 x 256 tiles: 128 tiles a step, 256 programs, 128 in the last wave
    assert a2a._moved_arrivals(4, True, False, 0, wide, 2, 132, 2, 128, True) == 64  # programs 0..127: half copy
    assert a2a._moved_arrivals(4, True, False, 0, wide, 2, 132, 2, 128, False) == 0  # step 0 fills the first wave
    # 8192 rows: 512 tiles a step, 1024 programs; 896 before the last wave of 128
    assert a2a._moved_arrivals(4, True, False, 0, wide, 2, 132, 2, 512, True) == 448
    assert a2a._moved_arrivals(4, True, False, 0, wide, 2, 132, 2, 512, False) == 384
    # 4 GPUs: three of every four programs copy an arrival
    # (512 programs, 382 before the last wave of 130, 96 of them step 0)
    assert a2a._moved_arrivals(2, True, False, 0, wide, 2, 132, 4, 128, True) == 382 - 96
    assert a2a._moved_arrivals(4, True, False, 0, square, 2, 132, 2, 128, True) == 0  # 256 programs, 264 slots
    assert a2a._moved_arrivals(0, True, True, 32, wide, 2, 132, 2, 128, True) == 0  # no movers, nothing checked
    with pytest.raises(ValueError, match="need pull=True and no GPU on another host"):
        a2a._moved_arrivals(4, False, False, 0, wide, 2, 132, 2, 128, True)
    with pytest.raises(ValueError, match="need pull=True and no GPU on another host"):
        a2a._moved_arrivals(4, True, True, 0, wide, 2, 132, 2, 128, True)
    with pytest.raises(ValueError, match="movers and copy_slabs"):
        a2a._moved_arrivals(4, True, False, 32, wide, 2, 132, 2, 128, True)
    with pytest.raises(ValueError, match="movers must be 0 or more, got -1"):
        a2a._moved_arrivals(-1, True, False, 0, wide, 2, 132, 2, 128, True)
    with pytest.raises(ValueError, match="more than an eighth of the 132 program slots .* at most 16"):
        a2a._moved_arrivals(17, True, False, 0, wide, 2, 132, 2, 128, True)


def test_the_triton_tiles_kernel_keeps_its_matmul_pipelined(toolchain):
    """matmul_chunks_kernel (the chunked method's Triton layout) at the op's wide tiles: one hand-over
    (a flag set on the peer by the program that counts a chunk's last tile), bounded waits for the
    slot to be free and for the peers' hand-overs, and in one module with the library nothing
    spills and no wgmma is serialized."""
    from jaxgin.fused import _kernels

    pointers = {"ctx": "*u8", "x": "*bf16", "w": "*bf16", "route": "*i32", "slots": "*bf16", "words": "*i64",
                "counters": "*i64", "out": "*bf16"}
    kernel = compile_for_sm90(_kernels.matmul_chunks_kernel, pointers, num_warps=8, num_stages=4, constexprs=dict(
        N=2048, K=7168, P=2, CM=2048, CN=2048, SPLIT_ROWS=True, CONCAT_ROWS=True, OUT_N=2048, SLOT=2048 * 2048,
        BM=128, BN=256, BK=64, GROUP_M=8, PRECISION="tf32"))
    ptx = kernel.asm["ptx"]
    assert ptx.count("call.uni (retval0), jaxgin_tt_set_flag,") == 1 and "atom.global.gpu.acq_rel.add" in ptx
    # the free slot, and a peer's hand-over for each of the P = 2 indices (the own one skipped when it runs)
    assert ptx.count("call.uni (retval0), jaxgin_tt_wait_flag,") == 3
    log = _ptxas_log_with_the_library(kernel)
    assert "C7509" not in log, log
    assert " 0 bytes spill stores" in log, log


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "step_order"])
def test_all_to_all_movers_are_compiled_in_only_when_asked(toolchain, interleave):
    """MOVERS: the kernel gains the movers' loop (a second flagged pull and a second copy of an
    arrival's tile) without spills, serialized wgmma or more shared memory; with MOVERS = 0 none
    of it is compiled in."""
    from jaxgin.fused import _kernels

    plain_name, _traced, pointers_name, constexprs = _TRACED_KERNELS["matmul_all_to_all"]

    def compiled(movers, moved):
        return compile_for_sm90(getattr(_kernels, plain_name), globals()[pointers_name], num_warps=8, num_stages=4,
                                constexprs=dict(constexprs, BN=256, INTERLEAVE=interleave, MOVERS=movers,
                                                MOVED=moved))

    plain, moving = compiled(0, 0), compiled(4, 64)
    count = lambda kernel, text: kernel.asm["ptx"].count(text)  # noqa: E731
    assert count(moving, "jaxgin_tt_wait_peer_flag") == count(plain, "jaxgin_tt_wait_peer_flag") + 1
    assert count(moving, "ld.global.cg") == 2 * count(plain, "ld.global.cg") > 0
    assert moving.metadata.shared == plain.metadata.shared
    log = _ptxas_log_with_the_library(moving)
    assert "C7509" not in log, log
    assert " 0 bytes spill stores" in log, log


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
@pytest.mark.parametrize("op", ["matmul_all_to_all", "all_gather_matmul", "matmul_reduce_scatter"])
def test_fused_kernels_trace_as_pure_calls_inside_shard_map(monkeypatch, op, gin):
    """The fused ops' Triton kernels are pure jaxgin.triton_calls (no JAX effect). Inside
    shard_map they take the operands, which vary over the axis, beside the axis route, which does
    not: they trace with one varying type for their inputs, as jax.ffi.ffi_call casts them (on
    GPUs this failed when tracing before the cast: docs/measurements.md, thirty-sixth session).
    Nothing is compiled: the kernel is a stand-in."""
    import importlib

    from jaxgin import op_support

    module = importlib.import_module(f"jaxgin.fused.{op}")
    stand_in_kernels(monkeypatch, num_warps=8)
    monkeypatch.setenv("JAXGIN_FUSED_AUTOTUNE", "0")
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(module, "axis_route", lambda names: jnp.zeros((5,), jnp.int32))
    monkeypatch.setattr(op_support, "sm_count", lambda device: 132)
    size, m, k, n = 4, 512, 256, 384
    plan = _plan_of(module, op, size, m, k, n, "triton")
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    mapped = jax.shard_map(lambda x, w: module._kernel(_HeapOnlyState(), x, w, plan), mesh=mesh,
                           in_specs=(P("x"), P("x")), out_specs=P("x"))
    jaxpr = jax.make_jaxpr(mapped)(jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16))
    assert not jaxpr.effects
    (shard,) = [eqn for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "shard_map"]
    assert [eqn.primitive.name for eqn in equations(shard.params["jaxpr"])].count("jaxgin_triton_call") == 1
