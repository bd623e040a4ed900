"""jaxgin.moe on CPU (reference mode, emulated devices) and its GPU kernels compiled and linked for
sm_90a without a GPU.

The dispatch layout is checked against a specification written here in numpy (which rows land on
which GPU, in which order, how many per expert, what is dropped), so the routing arithmetic the
kernels share with the reference is checked independently of it. moe_layer is checked against a
dense per-token computation (every expert's weights gathered), values and gradients in x,
router_logits, w1 and w2, under random and adversarial routing.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin

from conftest import (FakeRuntime, compile_for_sm90, equations, gpu_scenario, memory_operations, stand_in_kernels,
                      triton_interpreter_check)

SPEC = P("ep")


@pytest.fixture
def init():
    jaxgin.initialize()
    assert jaxgin.info()["backend"] == "reference"


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


def _logits(key, tokens, experts, routing, n):
    logits = jax.random.normal(key, (tokens, experts), jnp.float32)
    if routing == "one_expert":
        return logits.at[:, 3 % experts].add(100.0)
    if routing == "even_experts":  # odd experts get nothing
        return jnp.where(jnp.arange(experts) % 2 == 0, logits, -1e4)
    if routing == "last_gpu":
        return jnp.where(jnp.arange(experts) >= experts - experts // n, logits + 50.0, logits)
    return logits


def _dense(x, logits, w1, w2, top_k):
    weights, ids = jaxgin.moe.router(logits, top_k)
    h = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x, w1[ids], precision="highest"))
    y = jnp.einsum("tkf,tkfh->tkh", h, w2[ids], precision="highest")
    return jnp.sum(y * weights[..., None], axis=1)


def _params(n, tokens, hidden, ffn, experts, routing, seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32)
    logits = _logits(keys[1], n * tokens, experts, routing, n)
    w1 = jax.random.normal(keys[2], (experts, hidden, ffn), jnp.float32) / np.sqrt(hidden)
    w2 = jax.random.normal(keys[3], (experts, ffn, hidden), jnp.float32) / np.sqrt(ffn)
    ct = jax.random.normal(keys[4], (n * tokens, hidden), jnp.float32)
    return x, logits, w1, w2, ct


def _close(a, b, tol=2e-5, floor=1e-30):
    """Equal within `tol` of the largest magnitude, or of `floor` where that is smaller (a gradient
    that is zero mathematically, as the router's with top_k = 1, is rounding noise on both sides)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), floor), np.abs(a - b).max()


def _same_values_and_gradients(mesh, layer, dense, args, ct):
    """layer and its dense reference (each over the four sharded args) agree in value and in the
    gradient of <output, ct> with respect to every argument."""
    sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=SPEC)  # noqa: E731
    _close(jax.jit(sm(layer))(*args), jax.jit(sm(dense))(*args))
    loss = lambda f: (lambda *a: jnp.sum(sm(f)(*a[:4]) * a[4]))  # noqa: E731
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(*args, ct)
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(*args, ct)
    for g, w in zip(got, want):
        _close(g, w, 1e-4, floor=1e-2)


LAYER_CASES = [
    # devices, tokens per device, hidden, ffn, experts, top_k, routing
    (2, 12, 16, 8, 4, 2, "random"),
    (4, 10, 8, 6, 8, 1, "random"),
    (4, 9, 12, 4, 16, 8, "random"),
    (8, 6, 8, 4, 16, 3, "random"),
    (4, 8, 8, 4, 8, 1, "one_expert"),
    (4, 8, 8, 4, 8, 2, "even_experts"),
    (2, 16, 8, 4, 8, 4, "last_gpu"),
]


@pytest.mark.parametrize("n,tokens,hidden,ffn,experts,top_k,routing", LAYER_CASES)
def test_moe_layer_matches_dense_values_and_gradients(init, n, tokens, hidden, ffn, experts, top_k, routing):
    mesh = _mesh(n)
    x, logits, w1, w2, ct = _params(n, tokens, hidden, ffn, experts, routing)

    def layer(x, l, a, b):
        with jax.default_matmul_precision("highest"):
            return jaxgin.moe.moe_layer(x, l, a, b, top_k=top_k, axis_name="ep")

    def dense(x, l, a, b):
        return _dense(x, l, jax.lax.all_gather(a, "ep", tiled=True), jax.lax.all_gather(b, "ep", tiled=True), top_k)

    _same_values_and_gradients(mesh, layer, dense, (x, logits, w1, w2), ct)


def _spec_layout(x, ids, n, experts, capacity):
    """The documented layout, written plainly: on GPU d, rows grouped by local expert, within an
    expert by source GPU, within a source by (token, k); entries past `capacity` dropped."""
    tokens = x.shape[0] // n
    local = experts // n
    out = []
    for d in range(n):
        rows, counts = [], []
        for e in range(local):
            expert = d * local + e
            group = [x[s * tokens + t] for s in range(n) for t in range(tokens) for k in range(ids.shape[1])
                     if ids[s * tokens + t, k] == expert]
            counts.append(len(group))
            rows += group
        total = sum(counts)
        kept, budget = [], capacity
        for c in counts:
            kept.append(min(c, max(budget, 0)))
            budget -= c
        grouped = np.zeros((capacity, x.shape[1]), x.dtype)
        grouped[: min(total, capacity)] = np.array(rows[:capacity]).reshape(-1, x.shape[1])[: min(total, capacity)]
        out.append((grouped, np.array(kept), total - sum(kept)))
    return out


@pytest.mark.parametrize("n,tokens,experts,top_k,capacity,dtype", [
    (2, 7, 4, 2, None, jnp.float32),
    (4, 6, 8, 3, None, jnp.bfloat16),
    (4, 5, 16, 8, None, jnp.float32),
    (4, 8, 8, 2, 9, jnp.float32),  # capacity too small: entries dropped and counted
    (8, 3, 8, 1, None, jnp.float16),
    (2, 300, 8, 4, None, jnp.float32),  # 1200 entries per GPU: the routing's prefix counts span blocks
])
def test_dispatch_layout_follows_the_spec(init, n, tokens, experts, top_k, capacity, dtype):
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(tokens + experts), 3)
    x = (jnp.arange(n * tokens, dtype=jnp.float32)[:, None] * 10 + jax.random.normal(keys[0], (n * tokens, 6))).astype(dtype)
    logits = _logits(keys[1], n * tokens, experts, "random", n)
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(logits)
    cap = capacity or n * tokens * min(top_k, experts // n)

    def run(x, ids, w):
        sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep", capacity=capacity)
        back = jaxgin.moe.combine(sent.x, sent.handle)  # identity experts
        return sent.x, sent.expert_counts[None], sent.dropped[None], back

    grouped, counts, dropped, back = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(SPEC,) * 3,
                                                           out_specs=(SPEC,) * 4))(x, ids, weights)
    spec = _spec_layout(np.asarray(x), np.asarray(ids), n, experts, cap)
    grouped = np.asarray(grouped).reshape(n, cap, -1)
    for d, (want_rows, want_counts, want_dropped) in enumerate(spec):
        np.testing.assert_array_equal(grouped[d], want_rows)
        np.testing.assert_array_equal(np.asarray(counts)[d], want_counts)
        assert int(np.asarray(dropped)[d]) == want_dropped
    if capacity is None:
        # combine(dispatch(x)) with identity experts: each token's weights sum to 1
        _close(np.asarray(back, np.float32), np.asarray(x, np.float32), 1e-2 if dtype != jnp.float32 else 1e-6)
    else:
        assert int(np.asarray(dropped).sum()) > 0


def test_dispatch_and_combine_gradients_match_jax_grad_of_the_reference(init):
    """The custom_vjp rules (dispatch's backward is a combine, combine's a dispatch) against
    autodiff of a dense formulation: y[t] = sum_k w[t, k] * f(x[t]) with f applied at the expert."""
    n, tokens, experts, top_k = 4, 6, 8, 3
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (n * tokens, 5))
    scale = jax.random.normal(keys[1], (experts, 5))
    logits = jax.random.normal(keys[2], (n * tokens, experts))
    ct = jax.random.normal(keys[3], (n * tokens, 5))

    def moe(x, logits, scale):
        w, ids = jaxgin.moe.router(logits, top_k)
        sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep")
        local = experts // n
        expert_of_row = jnp.repeat(jnp.arange(local), sent.expert_counts, total_repeat_length=sent.x.shape[0])
        y = jnp.tanh(sent.x * scale[expert_of_row])
        return jaxgin.moe.combine(y, sent.handle)

    def dense(x, logits, scale):
        w, ids = jaxgin.moe.router(logits, top_k)
        every = jax.lax.all_gather(scale, "ep", tiled=True)
        return jnp.sum(w[..., None] * jnp.tanh(x[:, None, :] * every[ids]), axis=1)

    sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)  # noqa: E731
    _close(jax.jit(sm(moe))(x, logits, scale), jax.jit(sm(dense))(x, logits, scale))
    loss = lambda f: (lambda x, l, s, ct: jnp.sum(sm(f)(x, l, s) * ct))  # noqa: E731
    got = jax.jit(jax.grad(loss(moe), argnums=(0, 1, 2)))(x, logits, scale, ct)
    want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(x, logits, scale, ct)
    for g, w in zip(got, want):
        _close(g, w, 1e-5)


# ---------------------------------------------------------------------------------------------
# FP8 dispatch: e4m3 rows with a scale per 128 values, packed into the rows dispatch moves.


def test_fp8_rows_pack_and_unpack_bit_for_bit_and_halve_the_bytes():
    fp8 = jaxgin.moe.fp8
    x = jax.random.normal(jax.random.key(3), (5, 256)) * jnp.array([1e-3] * 128 + [300.0] * 128)
    x = x.at[2, :128].set(0.0)  # an all-zero block: scale 1, values 0
    q, scales = fp8.quantize(x)
    assert q.dtype == jnp.float8_e4m3fn and scales.shape == (5, 2) and float(scales[2, 0]) == 1.0
    # no value saturates: each block's largest magnitude lands in (224, 448], its scale a power of two
    block_max = np.asarray(jnp.max(jnp.abs(q.astype(jnp.float32)).reshape(5, 2, 128), axis=-1))
    assert ((block_max > fp8.E4M3_MAX / 2) & (block_max <= fp8.E4M3_MAX))[np.arange(5) != 2].all(), block_max
    mantissa, _ = np.frexp(np.asarray(scales))
    assert (mantissa == 0.5).all(), scales
    back = fp8.dequantize(q, scales, jnp.float32)
    assert float(jnp.max(jnp.abs(back - x) / jnp.maximum(jnp.abs(x), 1e-30))) < 2**-3  # 3 mantissa bits
    words = fp8.pack(q, scales)
    assert words.dtype == jnp.int16 and words.shape == (5, fp8.packed_width(256)) == (5, 132)
    q2, s2 = fp8.unpack(words, 256)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q2, jnp.uint8)),
                                  np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(s2), np.asarray(scales))
    zeros_q, zeros_s = fp8.unpack(jnp.zeros_like(words), 256)  # rows past the kept entries: zeros
    assert not np.asarray(fp8.dequantize(zeros_q, zeros_s, jnp.bfloat16).astype(jnp.float32)).any()
    # DeepSeek-V3's hidden size: 0.52x the bytes of a bfloat16 row
    assert fp8.packed_width(7168) * 2 / (7168 * 2) == pytest.approx(0.5156, abs=1e-4)


def test_fp8_quantize_scales_by_powers_of_two_and_rounds_once_to_nearest_even():
    """Scales are powers of two (so scaling is exact everywhere); fp8's e4m3 conversion equals ml_dtypes' (one rounding, ties to even) at every midpoint of
    two e4m3 values, one float32 step either side of it, every e4m3 value and a sweep of float32s,
    both signs; and past 464 or NaN gives NaN."""
    import ml_dtypes

    fp8 = jaxgin.moe.fp8
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    values = np.unique(np.abs(values[np.isfinite(values)]))
    midpoints = ((values[1:].astype(np.float64) + values[:-1]) / 2).astype(np.float32)
    sweep = np.arange(np.float32(2**-14).view(np.int32), np.float32(470).view(np.int32), 1009,
                      dtype=np.int32).view(np.float32)
    v = np.concatenate([midpoints, np.nextafter(midpoints, 0), np.nextafter(midpoints, 1e3), values,
                        np.nextafter(values, 0), np.nextafter(values, 1e3), sweep, [464, 465, np.inf, np.nan]])
    v = np.concatenate([v, -v]).astype(np.float32)
    want = v.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = np.asarray(jax.jit(fp8.e4m3_bits)(v))
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in wrong[:8]]
    # scales: the smallest power of two that keeps the block within 448, at and around its edges
    amax = np.concatenate([448 * 2.0 ** np.arange(-120, 120), np.float32(1.75) * 2.0 ** np.arange(-120, 120)])
    amax = np.concatenate([amax, np.nextafter(amax, 0), np.nextafter(amax, np.inf), [2.0**-130, 3e38]])
    amax = amax.astype(np.float32)
    scale, inverse = (np.asarray(a, np.float64) for a in jax.jit(fp8.power_of_two_scales)(amax))
    assert (scale * inverse == 1).all() and (np.frexp(scale)[0] == 0.5).all()
    assert (amax / scale <= 448).all() and (amax / (scale / 2) > 448)[amax > 2.0**-117].all()
    # just below the midpoint of 3 and 4 times 2^-9 (where the GPU run at 4096 tokens per GPU saw
    # XLA's quantize, dividing by a broadcast scale, and the kernel part): 3 times 2^-9
    witness = np.nextafter(np.float32(3.5 * 2**-9), np.float32(0))
    q, _ = fp8.quantize(jnp.full((1, 128), witness).at[0, 0].set(448.0))  # scale 1
    assert float(q[0, 1].astype(jnp.float32)) == 3 * 2**-9
    # no division anywhere: XLA compiles x / broadcast(s) as x * (1 / s), which is not IEEE division
    assert " divide(" not in jax.jit(fp8.quantize).lower(jnp.ones((4, 256))).compile().as_text()


def test_fp8_rounded_keeps_the_rounding_inside_jit():
    """fp8.rounded(x) is dequantize(quantize(x)) op by op (each op its own program, so nothing can
    fold the e4m3 round trip away), inside jit too, and differs from x."""
    fp8 = jaxgin.moe.fp8
    x = (jax.random.normal(jax.random.key(3), (8, 256), jnp.float32) * 3).astype(jnp.bfloat16)
    with jax.disable_jit():
        eager = fp8.dequantize(*fp8.quantize(x), x.dtype)
        eager32 = fp8.dequantize(*fp8.quantize(x), jnp.float32)
    for got, want in ((fp8.rounded(x), eager), (jax.jit(fp8.rounded)(x), eager),
                      (jax.jit(lambda v: fp8.rounded(v, jnp.float32))(x), eager32)):
        assert got.dtype == want.dtype and np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(eager, np.float32), np.asarray(x, np.float32))
    assert "optimization_barrier" in jax.jit(fp8.rounded).lower(x).as_text()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_fp8_dispatch_delivers_the_quantized_rows_in_the_same_layout(init, dtype):
    """dispatch(fp8=True).x is dispatch of dequantize(quantize(x)), bit for bit; counts, drops
    and combine behave as without fp8."""
    n, tokens, experts, top_k, hidden = 4, 6, 8, 3, 256
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(11), 2)
    x = (jax.random.normal(keys[0], (n * tokens, hidden)) * 4).astype(dtype)
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(_logits(keys[1], n * tokens, experts, "random", n))
    fp8 = jaxgin.moe.fp8

    def run(x, ids, w, quantized):
        sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep", capacity=12, fp8=quantized)
        return sent.x, sent.expert_counts[None], sent.dropped[None], jaxgin.moe.combine(sent.x, sent.handle)

    sm = lambda q: jax.jit(jax.shard_map(lambda *a: run(*a, q), mesh=mesh, in_specs=(SPEC,) * 3,  # noqa: E731
                                         out_specs=(SPEC,) * 4))
    got = sm(True)(x, ids, weights)
    rounded = jax.jit(fp8.rounded)(x)
    want = sm(False)(rounded, ids, weights)
    assert int(np.asarray(got[2]).sum()) > 0  # the capacity drops some entries: counted alike
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    assert not np.array_equal(np.asarray(rounded, np.float32), np.asarray(x, np.float32))  # it did round


def test_fp8_dispatch_gradients_pass_through_the_rounding(init):
    n, tokens, experts, top_k, hidden = 2, 4, 4, 2, 128
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (n * tokens, hidden))
    weights, ids = jax.jit(lambda l: jaxgin.moe.router(l, top_k))(_logits(keys[1], n * tokens, experts, "random", n))
    ct = jax.random.normal(keys[2], (n * tokens, hidden))

    def loss(quantized):
        def f(x, ids, w):
            sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep", fp8=quantized)
            return jaxgin.moe.combine(sent.x * 2.0, sent.handle)

        sm = jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC)
        return lambda x, w: jnp.sum(sm(x, ids, w) * ct)

    got = jax.jit(jax.grad(loss(True), argnums=(0, 1)))(x, weights)
    want = jax.jit(jax.grad(loss(False), argnums=(0, 1)))(x, weights)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # x: straight through
    _close(got[1], want[1], 0.1)  # weights: through the rounded rows the experts saw
    assert not np.array_equal(np.asarray(got[1]), np.asarray(want[1]))


def _call(f, n=4, tokens=4, hidden=8, experts=8):
    mesh = _mesh(n)
    x = jnp.ones((n * tokens, hidden))
    ids = jnp.zeros((n * tokens, 2), jnp.int32)
    w = jnp.ones((n * tokens, 2)) / 2
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=SPEC))(x, ids, w)


D = jaxgin.moe.dispatch
BAD_DISPATCH = [
    (lambda x, i, w: D(x, i, w, num_experts=6, axis_name="ep").x, ValueError, "multiple of the expert axis size 4"),
    (lambda x, i, w: D(x, i, w, num_experts=0, axis_name="ep").x, TypeError, "num_experts must be a positive int"),
    (lambda x, i, w: D(x, i.astype(jnp.float32), w, num_experts=8, axis_name="ep").x, TypeError, "topk_ids must be integers"),
    (lambda x, i, w: D(x, i, w[:, :1], num_experts=8, axis_name="ep").x, ValueError, "topk_weights has shape"),
    (lambda x, i, w: D(x, i[:2], w[:2], num_experts=8, axis_name="ep").x, ValueError, "tokens = x.shape"),
    (lambda x, i, w: D(x.astype(jnp.int8), i, w, num_experts=8, axis_name="ep").x, TypeError, "x has dtype int8"),
    (lambda x, i, w: D(x[0], i, w, num_experts=8, axis_name="ep").x, ValueError, r"x must be \[tokens, hidden\]"),
    (lambda x, i, w: D(x, i, w, num_experts=8, axis_name="ep", capacity=0).x, ValueError, "capacity must be a positive int"),
    (lambda x, i, w: D(x, i, w, num_experts=8, axis_name="ep", mode="fast").x, ValueError, "mode must be 'auto'"),
    (lambda x, i, w: D(x, i, w, num_experts=8, axis_name="nope").x, NameError, "'nope' is not bound"),
    (lambda x, i, w: jaxgin.moe.combine(D(x, i, w, num_experts=8, axis_name="ep").x[:3], D(x, i, w, num_experts=8, axis_name="ep").handle),
     ValueError, r"expert_out has shape \[3, 8\]; it must be \[capacity, hidden\]"),
    (lambda x, i, w: jaxgin.moe.combine(D(x, i, w, num_experts=8, axis_name="ep").x.astype(jnp.bfloat16),
                                        D(x, i, w, num_experts=8, axis_name="ep").handle), TypeError, "cast it"),
    (lambda x, i, w: jaxgin.moe.combine(x, {"not": "a handle"}), TypeError, "handle must be the .handle"),
    (lambda x, i, w: D(x, i, w, num_experts=8, axis_name="ep", fp8=True).x, ValueError,
     "fp8=True needs the hidden size to be a multiple of 128"),
    (lambda x, i, w: D(x, i, w, num_experts=8, axis_name="ep", fp8="e4m3").x, TypeError, "fp8 must be True or False"),
]


@pytest.mark.parametrize("call,error,message", BAD_DISPATCH)
def test_bad_dispatch_arguments_are_named(init, call, error, message):
    with pytest.raises(error, match=message):
        _call(call)


L = jaxgin.moe.moe_layer
BAD_LAYER = [
    (dict(w1=(2, 8, 4), w2=(2, 4, 8), logits=(4, 7)), "router_logits must be"),
    (dict(w1=(2, 8, 4), w2=(2, 5, 8), logits=(4, 8)), "w2"),
    (dict(w1=(2, 4), w2=(2, 4, 8), logits=(4, 8)), "w1 must be"),
    (dict(w1=(2, 8, 4), w2=(2, 4, 8), logits=(4, 8), top_k=9), r"top_k must be an int in \[1, 8\]"),
]


@pytest.mark.parametrize("shapes,message", BAD_LAYER)
def test_bad_layer_arguments_are_named(init, shapes, message):
    mesh = _mesh(4)
    x = jnp.ones((16, 8))
    logits = jnp.ones((16, shapes["logits"][1]))
    w1, w2 = jnp.ones((4 * shapes["w1"][0], *shapes["w1"][1:])), jnp.ones((4 * shapes["w2"][0], *shapes["w2"][1:]))
    f = lambda x, l, a, b: L(x, l, a, b, top_k=shapes.get("top_k", 2), axis_name="ep")  # noqa: E731
    with pytest.raises(ValueError, match=message):
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=SPEC))(x, logits, w1, w2)


def test_layer_reports_what_overflows_the_capacity(init):
    mesh = _mesh(2)
    x, logits, w1, w2, _ = _params(2, 8, 8, 4, 4, "last_gpu")
    def f(x, l, a, b):
        y, stats = L(x, l, a, b, top_k=2, axis_name="ep", capacity=5, return_stats=True)
        return y, stats["dropped"][None], stats["expert_counts"]

    y, dropped, counts = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC,) * 3))(
        x, logits, w1, w2)
    assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))
    # 16 tokens, every one with an entry on the last GPU (its logits are +50): at most 5 kept there
    assert int(dropped[1]) >= 16 - 5 and int(counts[2:].sum()) == 5


# ---------------------------------------------------------------------------------------------
# The GPU kernels, compiled and linked for sm_90a on this machine (no GPU needed).


def _relay_pointers(rows: str) -> dict:
    """The dispatch kernels' send and relay areas for dispatch across hosts (rows: staged rows' type)."""
    return dict(send_slot="*i32", send_n="*i32", relay_x=rows, relay_meta="*i32", relay_w="*fp32",
                relay_slot="*i32", relay_n="*i32")


def _dispatch_pointers(rows: str) -> dict:
    """dispatch_kernel's runtime parameters, bfloat16 x (rows: staged rows' type, "*i16" for fp8's
    packed words)."""
    return dict(ctx="*u8", x="*bf16", slot="*i32", before="*i32", meta="*i32", weights="*fp32",
                send_counts="*i32", route="*i32", hslot="*i32", hrows="*i32", hosts="*i32", stage_x=rows,
                stage_meta="*i32", stage_w="*fp32", stage_counts="*i32", stage_starts="*i32", flags="*i64",
                block_flags="*i64", state="*i64", send_x=rows, send_meta="*i32", send_w="*fp32", send_head="*i32",
                send_starts="*i32", data_ready="*i64", sig="i32", **_relay_pointers(rows), out_x="*bf16",
                out_pos="*i32", out_w="*fp32", out_expert_counts="*i32", out_rows="*i32", out_dropped="*i32")


# dispatch_routing_kernel's runtime parameters, bfloat16 rows
_ROUTING_DISPATCH_POINTERS = dict(
    ctx="*u8", x="*bf16", ids="*i32", weights="*fp32", route="*i32", stage_x="*bf16", stage_meta="*i32",
    stage_w="*fp32", stage_counts="*i32", stage_starts="*i32", flags="*i64", block_flags="*i64", state="*i64",
    send_x="*bf16", send_meta="*i32", send_w="*fp32", send_head="*i32", send_starts="*i32", data_ready="*i64",
    sig="i32", **_relay_pointers("*bf16"), out_x="*bf16", out_pos="*i32", out_w="*fp32", out_expert_counts="*i32",
    out_rows="*i32", out_dropped="*i32", slot="*i32", before="*i32", meta="*i32", dest="*i32", send_counts="*i32",
    masked="*i32")

# combine_kernel's runtime parameters, bfloat16 rows
_COMBINE_POINTERS = dict(ctx="*u8", y="*bf16", weights="*fp32", pos="*i32", rows="*i32", slot="*i32", route="*i32",
                         hslot="*i32", hosts="*i32", union_map="*i32", back="*bf16", flags="*i64", state="*i64",
                         send_back="*bf16", send_union="*bf16", send_map="*i32", map_recv="*i32", sig="i32",
                         out="*bf16")


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
def test_moe_kernels_compile_and_link_for_sm90a(toolchain, gin):
    from jaxgin.moe import _kernels  # Triton is optional: imported where the test runs
    from jaxgin.triton_device import link

    dispatch = compile_for_sm90(_kernels.dispatch_kernel, _dispatch_pointers("*bf16"), num_warps=8, num_stages=1,
                                constexprs=dict(T=4096, H=7168, K=8, P=4, EL=64, C=40960, BT=8, BH=1024, BK=8, BP=4,
                                                BE=128, BZ=16, BB=1024, NS=33, XB=2, GIN=gin, SW=7168, FP8=0, L=2))
    combine = compile_for_sm90(_kernels.combine_kernel, _COMBINE_POINTERS, num_warps=8, num_stages=1,
                               constexprs=dict(T=4096, H=7168, K=8, P=4, BT=8, BH=1024, BK=8, BP=4, XB=2, GIN=gin,
                                               L=2, MW=1 + 4096 * 2))
    for kernel in (dispatch, combine):
        cubin = kernel.asm["cubin"]
        assert cubin[:4] == b"\x7fELF"
        for symbol in (b"jaxgin_tt_set_flag", b"jaxgin_tt_wait_flag", b"jaxgin_tt_peer_delta"):
            assert symbol in cubin  # linked with the device library
        assert re.search(r"st\.global\.v4", kernel.asm["ptx"])  # 16-byte row stores, to peers included
        # The GIN paths (per-peer choice, puts, counted arrivals) are compiled in only when the job
        # has GIN peers: an NVLink-only job runs the kernels it ran before.
        calls = set(link.library_calls(kernel.asm["ptx"]))
        gin_calls = {"jaxgin_tt_gin_peer", "jaxgin_tt_put_signal", "jaxgin_tt_signal", "jaxgin_tt_wait_arrivals"}
        assert (gin_calls <= calls) if gin else not (gin_calls & calls), calls
    _rows_stored_16_bytes_at_a_time(dispatch)
    # the "all sent" / "all packed" counts are system-scope (they order stores before flags and puts)
    assert re.search(r"atom\.[a-z.]*sys", combine.asm["ptx"])
    if gin:
        assert re.search(r"atom\.[a-z.]*sys", dispatch.asm["ptx"])


@pytest.mark.parametrize("tokens", [128, 4096], ids=["low_latency", "high_throughput"])
def test_moe_kernels_compile_for_one_gpu(toolchain, tokens):
    """A one-GPU job's kernels, at the mode's presets: dispatch has no senders (NS = 0; Triton 3.6's
    lowering to LLVM failed on the sender code when NS was 0, so it is compiled out) and every axis
    vector has one element. Low latency routes inside the dispatch kernel."""
    from jaxgin.moe import _kernels, _routing, _routing_device
    from jaxgin.moe.exchange import _BLOCKS, _COMBINE_BLOCKS
    from jaxgin.op_support import pow2

    mode = _routing.LOW_LATENCY if tokens <= _routing.LOW_LATENCY_MAX_TOKENS else _routing.HIGH_THROUGHPUT
    bt, bh, warps, _ = _BLOCKS[mode]
    capacity = tokens * 8 * 5 // 4
    constexprs = dict(T=tokens, H=7168, K=8, P=1, EL=256, C=capacity, BT=bt, BH=bh, BK=8, BP=1, BE=512, BZ=16,
                      BB=pow2(-(-tokens // bt) + 1), NS=0, XB=2, GIN=0, SW=7168, FP8=0, L=1)
    if mode == _routing.LOW_LATENCY:
        routing = _routing_device.constexprs(tokens, 8, 1, 256)
        dispatch = compile_for_sm90(_kernels.dispatch_routing_kernel, _ROUTING_DISPATCH_POINTERS, num_warps=warps,
                                    num_stages=1, constexprs=constexprs | dict(SCAN=routing["SCAN"], BR=routing["BE"]))
    else:
        dispatch = compile_for_sm90(_kernels.dispatch_kernel, _dispatch_pointers("*bf16"), num_warps=warps,
                                    num_stages=1, constexprs=constexprs)
    cbt, cbh, cwarps = _COMBINE_BLOCKS[mode]
    combine = compile_for_sm90(_kernels.combine_kernel, _COMBINE_POINTERS, num_warps=cwarps, num_stages=1,
                               constexprs=dict(T=tokens, H=7168, K=8, P=1, BT=cbt, BH=cbh, BK=8, BP=1, XB=2, GIN=0,
                                               L=1, MW=1))
    for kernel in (dispatch, combine):
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
    _rows_stored_16_bytes_at_a_time(dispatch)


def _rows_stored_16_bytes_at_a_time(kernel):
    """No 1- or 2-byte stores: the staged rows (bfloat16 values, fp8's bytes) leave in 16-byte
    stores. The address a dispatch kernel stores a peer's rows at is picked out of a vector by a
    sum, which tells Triton nothing of its alignment; without tl.multiple_of the rows went out in
    stores of one element (st.global.b16 / .b8)."""
    narrow = re.findall(r"st\.global[\w.]*\.b(?:8|16)\b", kernel.asm["ptx"])
    assert not narrow, narrow[:4]


def test_moe_kernels_compile_to_one_size_at_any_axis(toolchain):
    """dispatch and combine loop over the axis's GPUs at run time, so their code is the same size
    at any axis size. Unrolled, they grew with the axis, and so did Triton's compile time
    (docs/measurements.md, twentieth session)."""
    from jaxgin.moe import _kernels

    def dispatch(p):
        return compile_for_sm90(_kernels.dispatch_kernel, _dispatch_pointers("*bf16"), num_warps=8, num_stages=1,
                                constexprs=dict(T=128, H=512, K=4, P=p, EL=64 // p, C=512 * p, BT=2, BH=512, BK=4,
                                                BP=p, BE=64, BZ=16, BB=128, NS=33, XB=2, GIN=1, SW=512, FP8=0, L=2))

    def combine(p):
        return compile_for_sm90(_kernels.combine_kernel, _COMBINE_POINTERS, num_warps=8, num_stages=1,
                                constexprs=dict(T=128, H=512, K=4, P=p, BT=2, BH=512, BK=4, BP=p, XB=2, GIN=1, L=2,
                                                MW=1 + 128 * 2))

    for build in (dispatch, combine):
        sizes = {p: memory_operations(build(p)) for p in (2, 8)}
        # combine's finish_call zeroes a counter word per GPU (one store each, unrolled)
        assert 0 < sizes[2] <= sizes[8] <= sizes[2] + (8 - 2), (build.__name__, sizes)


def test_the_kernels_placement_is_the_routings_placement():
    """The dispatch kernel's placers' arithmetic (_kernels._first_rows, _positions), run by Triton's
    interpreter on this machine, puts every received entry where _routing.placement does, for every
    receiving GPU, with capacities that keep everything and that drop, masked ids and one GPU."""
    checked = triton_interpreter_check("placement")
    assert len(checked) == 10 and all(c["equal"] for c in checked), checked
    assert any(c["dropped"] > 0 for c in checked) and all(c["landed"] > 0 for c in checked), checked


def test_the_kernels_fp8_rows_are_fp8s_rows_bit_for_bit():
    """The dispatch kernel's fp8 staging and placing (jaxgin.moe._fp8_device), run by Triton's
    interpreter on this machine: the staged words equal fp8.pack(*fp8.quantize(x)) and the placed
    rows fp8.rounded(x), for float32, bfloat16 and float16 rows, zero blocks, values down to e4m3's
    subnormals and up to rounding carries, hidden sizes that leave half a step of columns masked."""
    checked = triton_interpreter_check("fp8")
    assert len(checked) == 6, checked
    assert all(c["packed_equal"] and c["rounded_differs_from_x"] for c in checked), checked
    # rows: every case, except float16 under an interpreter older than Triton 3.9 (its float16
    # conversion is not the GPU's; the staged bytes above are still compared)
    assert all(c["rows_equal"] or (c["rows_equal"] is None and c["dtype"] == "float16") for c in checked), checked
    assert sum(c["rows_equal"] is True for c in checked) >= 4, checked


def test_the_routing_kernel_writes_routes_arrays_bit_for_bit():
    """The routing kernel GPUs run (_routing_device.py), run by Triton's interpreter on this machine:
    every array equals _routing.route's, for one to 48 programs, counting the earlier tokens
    themselves (one step) or from chunk counts (3 and 6 chunks, the last one whole or cut short),
    blocks cut short, masked ids, one GPU, top_k 1 to 8."""
    checked = triton_interpreter_check("routing")
    assert len(checked) == 9 and all(all(c["equal"].values()) for c in checked), checked
    assert any(c["masked_entries"] > 0 for c in checked) and max(c["programs"] for c in checked) == 48, checked
    assert sorted(c["chunks"] for c in checked if c["chunks"]) == [3, 6, 6], checked


def test_the_dispatch_kernels_own_routing_is_routes():
    """The routing dispatch_routing_kernel does itself (every program its token blocks, program 0
    the totals and block starts it sends first), run by Triton's interpreter on this machine:
    route()'s arrays, each GPU's counts row and the staging row where each block starts there, as
    program 0 computes them and as each block's sender does (where its rows start and end), for
    blocks of 2 and 8 tokens, masked ids, one GPU, experts all on one GPU, top_k 1 to 8."""
    checked = triton_interpreter_check("dispatch_routing")
    assert len(checked) == 6 and all(all(c["equal"].values()) for c in checked), checked
    assert sum(c["masked_entries"] > 0 for c in checked) == 2 and {c["block_tokens"] for c in checked} == {2, 8}, checked


@pytest.mark.parametrize("fp8", [0, 1], ids=["bf16_rows", "fp8_rows"])
def test_the_routing_dispatch_kernel_compiles_for_sm90a(toolchain, fp8):
    """dispatch_routing_kernel at DeepSeek-V3's low-latency shape (128 tokens, top-8 of 256 experts
    on 4 GPUs, exchange's blocks and warps), with and without fp8 rows: compiled, linked with the
    device library, its row stores 16 bytes wide. (Jobs with GIN peers route with route() and run
    dispatch_kernel: the host unions need its slots.)"""
    from jaxgin.moe import _kernels, _routing_device

    rows = "*i16" if fp8 else "*bf16"
    pointers = dict(ctx="*u8", x="*bf16", ids="*i32", weights="*fp32", route="*i32", stage_x=rows,
                    stage_meta="*i32", stage_w="*fp32", stage_counts="*i32", stage_starts="*i32", flags="*i64",
                    block_flags="*i64", state="*i64", send_x=rows, send_meta="*i32", send_w="*fp32",
                    send_head="*i32", send_starts="*i32", data_ready="*i64", sig="i32", **_relay_pointers(rows),
                    out_x="*bf16",
                    out_pos="*i32", out_w="*fp32", out_expert_counts="*i32", out_rows="*i32", out_dropped="*i32",
                    slot="*i32", before="*i32", meta="*i32", dest="*i32", send_counts="*i32", masked="*i32")
    routing = _routing_device.constexprs(128, 8, 4, 64)
    kernel = compile_for_sm90(_kernels.dispatch_routing_kernel, pointers, num_warps=4, num_stages=1, constexprs=dict(
        T=128, H=7168, K=8, P=4, EL=64, C=1280, BT=2, BH=1024, BK=8, BP=4, BE=128, BZ=16, BB=128, NS=64, XB=2,
        GIN=0, SW=jaxgin.moe.fp8.packed_width(7168) if fp8 else 7168, FP8=fp8, L=1, SCAN=routing["SCAN"],
        BR=routing["BE"]))
    assert kernel.asm["cubin"][:4] == b"\x7fELF"
    assert b"jaxgin_tt_wait_flag" in kernel.asm["cubin"]
    assert re.search(r"st\.global\.v4", kernel.asm["ptx"])
    _rows_stored_16_bytes_at_a_time(kernel)


def test_the_traced_routing_dispatch_kernel_records_each_step(toolchain):
    """dispatch_routing_traced_kernel (tools/profile_moe.py --trace-dispatch): the same kernel with
    8 int64 words per program written into its trace output and the GPU's global timer read at its
    steps; the untraced kernel reads no timer and writes no trace."""
    from jaxgin.moe import _kernels, _routing_device

    pointers = _ROUTING_DISPATCH_POINTERS
    routing = _routing_device.constexprs(128, 8, 2, 128)
    constexprs = dict(T=128, H=7168, K=8, P=2, EL=128, C=1280, BT=2, BH=4096, BK=8, BP=2, BE=256, BZ=16, BB=128,
                      NS=64, XB=2, GIN=0, SW=7168, FP8=0, L=1, SCAN=routing["SCAN"], BR=routing["BE"])
    plain = compile_for_sm90(_kernels.dispatch_routing_kernel, pointers, num_warps=8, num_stages=1,
                             constexprs=constexprs)
    traced = compile_for_sm90(_kernels.dispatch_routing_traced_kernel, pointers | dict(trace="*i32"), num_warps=8,
                              num_stages=1, constexprs=constexprs)
    assert "%globaltimer" not in plain.asm["ptx"]
    # start, counts posted (place 0), routed, counts seen, own work, zeroed, placed, end
    assert traced.asm["ptx"].count("%globaltimer") >= 8
    assert len(re.findall(r"st\.global(?:\.\w+)*\.b64", traced.asm["ptx"])) >= 8


@pytest.mark.parametrize("tokens, gpus, warps", [(128, 4, 4), (256, 8, 8), (4096, 2, 8)])
def test_the_routing_kernel_compiles_for_sm90a(toolchain, tokens, gpus, warps):
    """Routing at DeepSeek-V3's shapes (top-8 of 256 experts; 128 tokens on 4 GPUs, 256 on 8, the
    most dispatch routes inside its kernel, and 4096 on 2, from chunk counts), with exchange's
    warps: plain arithmetic, no library calls, no waits."""
    from jaxgin.moe import _routing_device

    pointers = dict(ctx="*u8", ids="*i32", chunk_bins="*i32", chunk_tokens="*i32", slot="*i32", before="*i32",
                    meta="*i32", dest_out="*i32", send_counts="*i32", masked="*i32")
    launch = _routing_device.constexprs(tokens, 8, gpus, 256 // gpus)
    chunked = tokens > _routing_device.SCAN_TOKENS
    assert _routing_device.num_warps(tokens) == warps
    kernels = [compile_for_sm90(_routing_device.route_kernel, pointers, num_warps=warps, num_stages=1,
                                constexprs=dict(launch, CHUNKS=int(chunked)))]
    if chunked:
        kernels.append(compile_for_sm90(
            _routing_device.chunk_counts_kernel, dict(ctx="*u8", ids="*i32", chunk_bins="*i32", chunk_tokens="*i32"),
            num_warps=warps, num_stages=1, constexprs=_routing_device.chunk_constexprs(launch)))
    for kernel in kernels:
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        assert "jaxgin_tt_" not in kernel.asm["ptx"]  # plain arithmetic: nothing from the device library


@pytest.mark.parametrize("gin", [0, 1], ids=["nvlink_only", "with_gin_paths"])
def test_the_dispatch_kernel_compiles_for_fp8_rows(toolchain, gin):
    """fp8=True: the dispatch kernel reads bfloat16 rows, stages them as e4m3 values and scales
    (jaxgin.moe.fp8's packed rows, 3696 16-bit words at DeepSeek-V3's hidden size) and places them
    dequantized: byte stores of the values, 16-byte row stores, the GPU's fp8 conversions, and no XLA
    program around it."""
    from jaxgin.moe import _kernels

    pointers = _dispatch_pointers("*i16")  # fp8's packed rows: 16-bit words
    packed = jaxgin.moe.fp8.packed_width(7168)
    kernel = compile_for_sm90(_kernels.dispatch_kernel, pointers, num_warps=4, num_stages=1, constexprs=dict(
        T=128, H=7168, K=8, P=4, EL=64, C=1280, BT=2, BH=1024, BK=8, BP=4, BE=128, BZ=16, BB=128, NS=8,
        XB=2, GIN=gin, SW=packed, FP8=1, L=2))
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"][:4] == b"\x7fELF"
    assert packed == 3696
    # quantizing as fp8.quantize does on XLA: exact products by powers of two, no division, no FMA,
    # no flushing of subnormals
    assert re.search(r"mul\.f32", ptx) and not re.search(r"\bdiv\.[a-z.]*f32", ptx)
    assert not re.search(r"\.ftz", ptx) and not re.search(r"\bfma\.", ptx)
    assert re.search(r"st\.global\.v4", ptx)
    # the GPU's own conversions, two values an instruction, not the interpreter's integer arithmetic:
    # to e4m3 (rounded to nearest even), back through f16, and the bfloat16 rows rounded by cvt.rn
    assert re.search(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx), "no hardware conversion to e4m3"
    assert re.search(r"cvt\.rn\.f16x2\.e4m3x2", ptx), "no hardware conversion from e4m3"
    assert re.search(r"cvt\.rn\.bf16x2\.f32|cvt\.rn\.bf16\.f32", ptx), "no hardware rounding to bfloat16"
    assert not re.search(r"0x43E80000|1139277824", ptx), "the interpreter's integer e4m3 path was compiled"
    _rows_stored_16_bytes_at_a_time(kernel)


def test_expert_ids_out_of_range_are_reported_not_sent(init):
    """An id outside [0, num_experts) (traced, so it cannot raise) is not delivered anywhere and is
    counted in the sender's `dropped`; the token's other entries are unaffected."""
    n, tokens, experts = 4, 4, 8
    mesh = _mesh(n)
    x = jnp.arange(n * tokens * 3, dtype=jnp.float32).reshape(n * tokens, 3)
    good = jnp.arange(n * tokens, dtype=jnp.int32) % experts
    ids = jnp.stack([good, jnp.where(jnp.arange(n * tokens) % 3 == 0, -1, experts)], axis=1).astype(jnp.int32)
    w = jnp.full((n * tokens, 2), 0.5)

    def run(x, ids, w):
        sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep")
        return sent.expert_counts[None], sent.dropped[None], jaxgin.moe.combine(sent.x, sent.handle)

    counts, dropped, back = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(SPEC,) * 3, out_specs=(SPEC,) * 3))(x, ids, w)
    np.testing.assert_array_equal(np.asarray(dropped), [tokens] * n)  # one bad entry per token
    assert int(np.asarray(counts).sum()) == n * tokens  # only the good entries arrived
    _close(back, 0.5 * x, 1e-6)  # the bad entry contributes nothing


# ---------------------------------------------------------------------------------------------
# Masked entries (expert id -1 or >= num_experts, whole tokens routed nowhere): legal input that
# means "no expert". Checked against jax.grad of dense formulations that skip those entries.


def _mask_ids(ids, experts, masked_token):
    """ids with entries masked in every way: token index t (of this shard) with t % 5 == masked_token
    routed nowhere (all -1); else entry 0 of every third token -1, the last entry of every fourth
    token an id >= experts (experts itself, or larger), entry 1 of every seventh token -7."""
    t = jnp.arange(ids.shape[0])[:, None]
    k = jnp.arange(ids.shape[1])[None, :]
    ids = jnp.where((t % 3 == 0) & (k == 0), -1, ids)
    ids = jnp.where((t % 4 == 1) & (k == ids.shape[1] - 1), experts + (t % 3) * 1000, ids)
    ids = jnp.where((t % 7 == 2) & (k == 1), -7, ids)
    return jnp.where(t % 5 == masked_token, -1, ids).astype(jnp.int32)


def _valid(ids, experts):
    return (ids >= 0) & (ids < experts)


MASKED_CASES = [
    # devices, tokens per device, experts, top_k, which tokens (index % 5) are routed nowhere
    (4, 6, 8, 3, 2),
    (2, 10, 4, 2, 0),
    (8, 5, 16, 4, 4),
    (1, 7, 4, 2, 1),
]


@pytest.mark.parametrize("n,tokens,experts,top_k,masked_token", MASKED_CASES)
def test_masked_ids_dispatch_and_combine_values_and_gradients(init, n, tokens, experts, top_k, masked_token):
    """dispatch -> a per-expert function -> combine with masked entries, against jax.grad of
    y[t] = sum over t's valid entries k of w[t, k] * tanh(x[t] * scale[ids[t, k]]): values and
    gradients in x, the routing weights (0 exactly for masked entries) and the expert parameters."""
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(experts * 7 + top_k), 5)
    hidden = 5
    x = jax.random.normal(keys[0], (n * tokens, hidden))
    scale = jax.random.normal(keys[1], (experts, hidden))
    picked = jax.vmap(lambda key: jax.random.choice(key, experts, (top_k,), replace=False))(
        jax.random.split(keys[2], n * tokens)).astype(jnp.int32)
    ids = jax.jit(jax.shard_map(lambda i: _mask_ids(i, experts, masked_token), mesh=mesh, in_specs=SPEC,
                                out_specs=SPEC))(picked)
    w = jax.random.uniform(keys[3], (n * tokens, top_k), minval=0.1, maxval=1.0)
    ct = jax.random.normal(keys[4], (n * tokens, hidden))
    valid = np.asarray(_valid(ids, experts))
    assert (~valid).any(axis=1).sum() > n and (~valid).all(axis=1).sum() >= n  # every kind of mask occurs

    def moe(x, ids, w, scale):
        sent = jaxgin.moe.dispatch(x, ids, w, num_experts=experts, axis_name="ep")
        local = experts // n
        expert_of_row = jnp.repeat(jnp.arange(local), sent.expert_counts, total_repeat_length=sent.x.shape[0])
        mine = jax.lax.dynamic_slice_in_dim(scale, jax.lax.axis_index("ep") * local, local)  # scale: replicated
        return jaxgin.moe.combine(jnp.tanh(sent.x * mine[expert_of_row]), sent.handle)

    def dense(x, ids, w, scale):
        keep = _valid(ids, experts)
        f = jnp.tanh(x[:, None, :] * scale[jnp.clip(ids, 0, experts - 1)])
        return jnp.sum(jnp.where(keep, w, 0.0)[..., None] * f, axis=1)

    sm = lambda f: jax.shard_map(f, mesh=mesh, in_specs=(SPEC, SPEC, SPEC, P()), out_specs=SPEC)  # noqa: E731
    got = jax.jit(sm(moe))(x, ids, w, scale)
    _close(got, jax.jit(sm(dense))(x, ids, w, scale), 1e-6)
    np.testing.assert_array_equal(np.asarray(got)[~valid.any(axis=1)], 0.0)  # routed nowhere: zeros
    loss = lambda f: (lambda x, ids, w, s, ct: jnp.sum(sm(f)(x, ids, w, s) * ct))  # noqa: E731
    dx, dw, dscale = jax.jit(jax.grad(loss(moe), argnums=(0, 2, 3)))(x, ids, w, scale, ct)
    want_dx, want_dw, want_dscale = jax.jit(jax.grad(loss(dense), argnums=(0, 2, 3)))(x, ids, w, scale, ct)
    _close(dx, want_dx, 1e-5)
    _close(dw, want_dw, 1e-5)
    _close(dscale, want_dscale, 1e-5)
    np.testing.assert_array_equal(np.asarray(dw)[~valid], 0.0)  # masked weights: exactly 0
    np.testing.assert_array_equal(np.asarray(dx)[~valid.any(axis=1)], 0.0)
    assert np.abs(np.asarray(dw)[valid]).min() > 0  # the valid ones are really exercised


@pytest.mark.parametrize("n,tokens,experts,top_k,masked_token", MASKED_CASES[:3])
def test_masked_ids_through_the_layer_values_and_gradients(init, n, tokens, experts, top_k, masked_token):
    """moe_layer's pipeline (router, dispatch, the layer's expert FFN on ragged_dot, combine) with
    masked entries in the router's ids, against jax.grad of the dense per-token layer that skips
    them: values and gradients in x, router_logits (through the routing weights), w1 and w2."""
    from jaxgin.moe.layer import expert_ffn

    mesh = _mesh(n)
    x, logits, w1, w2, ct = _params(n, tokens, 8, 6, experts, "random", seed=top_k)

    def layer(x, l, a, b):
        weights, ids = jaxgin.moe.router(l, top_k)
        ids = _mask_ids(ids, experts, masked_token)
        sent = jaxgin.moe.dispatch(x, ids, weights, num_experts=experts, axis_name="ep")
        with jax.default_matmul_precision("highest"):
            return jaxgin.moe.combine(expert_ffn(sent.x, a, b, sent.expert_counts, jax.nn.silu), sent.handle)

    def dense(x, l, a, b):
        weights, ids = jaxgin.moe.router(l, top_k)
        ids = _mask_ids(ids, experts, masked_token)
        a, b = jax.lax.all_gather(a, "ep", tiled=True), jax.lax.all_gather(b, "ep", tiled=True)
        safe = jnp.clip(ids, 0, experts - 1)
        h = jax.nn.silu(jnp.einsum("th,tkhf->tkf", x, a[safe], precision="highest"))
        y = jnp.einsum("tkf,tkfh->tkh", h, b[safe], precision="highest")
        return jnp.sum(y * jnp.where(_valid(ids, experts), weights, 0.0)[..., None], axis=1)

    _same_values_and_gradients(mesh, layer, dense, (x, logits, w1, w2), ct)


# ---------------------------------------------------------------------------------------------
# Argument errors of moe_layer: top_k's type, weights sharded the wrong way.


def _layer_call(mesh, top_k=2, **kwargs):
    return jax.jit(jax.shard_map(lambda x, l, a, b: L(x, l, a, b, top_k=top_k, axis_name="ep", **kwargs),
                                 mesh=mesh, in_specs=(SPEC,) * 4, out_specs=SPEC))


@pytest.mark.parametrize("top_k", [np.int64(2), np.int32(2), np.uint8(2), np.array(2)])
def test_layer_takes_any_integer_top_k(init, top_k):
    mesh = _mesh(2)
    x, logits, w1, w2, _ = _params(2, 4, 8, 4, 4, "random")
    np.testing.assert_array_equal(np.asarray(_layer_call(mesh, top_k=top_k)(x, logits, w1, w2)),
                                  np.asarray(_layer_call(mesh, top_k=2)(x, logits, w1, w2)))


@pytest.mark.parametrize("top_k,error,message", [
    (True, TypeError, r"top_k must be an integer .* in \[1, 4\] .* got True of type bool"),
    (np.bool_(True), TypeError, r"top_k must be an integer .* of type bool"),
    (2.0, TypeError, r"top_k must be an integer .* got 2\.0 of type float"),
    (np.float32(2), TypeError, r"top_k must be an integer .* of type float32"),
    ("2", TypeError, r"top_k must be an integer .* got '2' of type str"),
    (np.int64(0), ValueError, r"top_k must be an int in \[1, 4\] \(the number of experts\), got 0"),
    (5, ValueError, r"top_k must be an int in \[1, 4\] \(the number of experts\), got 5"),
])
def test_layer_refuses_top_k_that_is_not_an_integer_in_range(init, top_k, error, message):
    x, logits, w1, w2, _ = _params(2, 4, 8, 4, 4, "random")
    with pytest.raises(error, match=message):
        _layer_call(_mesh(2), top_k=top_k)(x, logits, w1, w2)


@pytest.mark.parametrize("w1_spec,w2_spec,w1_experts,message", [
    (P(), P(), 8, r"w1 holds all 8 experts on every device \(replicated over the expert axis\); each of the 4 devices "
                  r"must hold 8 / 4 = 2 of them, w1 \[2, \.\.\.\]: shard w1 over the expert axis 'ep' along its first "
                  r"dimension \(shard_map in_specs P\('ep'\)\)"),
    (SPEC, P(), 8, r"w2 holds all 8 experts on every device .* shard w2 over the expert axis 'ep'"),
    (SPEC, SPEC, 16, r"w1 holds 4 experts on this device, but router_logits has 8 experts over an expert axis of "
                     r"size 4, so each device must hold 2: shard w1"),
])
def test_layer_blames_weights_sharded_the_wrong_way(init, w1_spec, w2_spec, w1_experts, message):
    mesh = _mesh(4)
    x, logits = jnp.ones((16, 8)), jnp.ones((16, 8))
    w1, w2 = jnp.ones((w1_experts, 8, 4)), jnp.ones((8, 4, 8))
    f = lambda x, l, a, b: L(x, l, a, b, top_k=2, axis_name="ep")  # noqa: E731
    with pytest.raises(ValueError, match=message) as raised:
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(SPEC, SPEC, w1_spec, w2_spec), out_specs=SPEC))(x, logits, w1, w2)
    assert "router_logits must" not in str(raised.value)  # the logits are right


# ---------------------------------------------------------------------------------------------
# Drops are never silent: moe_layer warns at run time when a capacity below the worst case drops
# entries (unless return_stats=True hands the counts over), and compiles no check otherwise.


def _layer_warnings(f, *args):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = jax.block_until_ready(f(*args))
        jax.effects_barrier()
    return out, [str(w.message) for w in caught if str(w.message).startswith("jaxgin.moe.moe_layer:")]


def test_layer_warns_how_many_entries_a_small_capacity_dropped(init):
    mesh = _mesh(2)
    x, logits, w1, w2, _ = _params(2, 8, 8, 4, 4, "last_gpu")
    stats = jax.jit(jax.shard_map(
        lambda x, l, a, b: (lambda y, s: (y, s["dropped"][None], s["expert_counts"].sum()[None]))(
            *L(x, l, a, b, top_k=2, axis_name="ep", capacity=5, return_stats=True)),
        mesh=mesh, in_specs=(SPEC,) * 4, out_specs=(SPEC,) * 3))
    want_y, dropped, kept = stats(x, logits, w1, w2)
    _, quiet = _layer_warnings(stats, x, logits, w1, w2)
    assert quiet == []  # return_stats=True: the caller has the counts
    dropped, kept = np.asarray(dropped), np.asarray(kept)
    assert dropped[1] > 0  # every token has an entry on the last GPU

    y, messages = _layer_warnings(_layer_call(mesh, capacity=5), x, logits, w1, w2)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))  # the warning changes nothing else
    want = [f"jaxgin.moe.moe_layer: {dropped[d]} of {dropped[d] + kept[d]} routed entries at expert-axis index {d} "
            f"did not fit capacity=5 and were dropped, which changes the output. Pass capacity >= "
            f"{dropped[d] + kept[d]} (what this call needed there) or capacity=None (the worst case, 32 rows, never "
            f"drops), or return_stats=True to get the counts instead of this warning."
            for d in range(2) if dropped[d] > 0]
    assert sorted(messages) == sorted(want)

    # under jax.grad the forward pass warns the same way
    loss = jax.jit(jax.grad(lambda *a: jnp.sum(_layer_call(mesh, capacity=5)(*a)), argnums=(0, 2)))
    _, messages = _layer_warnings(loss, x, logits, w1, w2)
    assert sorted(messages) == sorted(want)


def test_layer_without_drops_stays_quiet_and_checks_only_when_it_could_drop(init):
    mesh = _mesh(2)
    x, logits, w1, w2, _ = _params(2, 8, 8, 4, 4, "random")
    need = jax.jit(jax.shard_map(
        lambda *a: (lambda y, s: (s["dropped"] + s["expert_counts"].sum())[None])(
            *L(*a, top_k=2, axis_name="ep", return_stats=True)), mesh=mesh, in_specs=(SPEC,) * 4, out_specs=SPEC))
    rows = int(np.asarray(need(x, logits, w1, w2)).max())
    assert rows < 32  # the worst case: 2 GPUs x 8 tokens x min(2, 2) entries
    for capacity in (None, 32, 100, rows):
        f = _layer_call(mesh, capacity=capacity)
        _, messages = _layer_warnings(f, x, logits, w1, w2)
        assert messages == [], capacity
        # nothing can drop (capacity None or >= the worst case): no check at all in the program
        assert ("callback" in f.lower(x, logits, w1, w2).as_text()) == (capacity == rows), capacity


def _gpu_moe_scenarios():
    """tests/gpu/moe_scenarios.py, whose 500-call loop checks each call against a reference it
    computes without collectives (whole_view_reference); the tests below check that oracle here."""
    return gpu_scenario("moe_scenarios")


def _loop(scenarios, n, case, calls=2):
    """The GPU scenario's loop for `case` on n devices: [calls that differed, combine difference]."""
    name, tokens, hidden, ffn, experts, top_k, dtype, capacity, mode, routing = case
    mesh = _mesh(n)
    keys = jax.random.split(jax.random.key(tokens), 2)
    x = jax.random.normal(keys[0], (n * tokens, hidden), jnp.float32).astype(dtype)
    logits = scenarios._logits(keys[1], n * tokens, experts, routing)
    loop = lambda x, logits: scenarios._loop_against_whole_view(  # noqa: E731
        x, logits, calls=calls, top_k=top_k, experts=experts, routing=routing, capacity=capacity, mode=mode,
        fold_every=1)
    f = jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(SPEC, SPEC), out_specs=P()))
    return [float(v) for v in f(x, logits)]


@pytest.mark.parametrize("n", [1, 2, 8])
def test_gpu_loop_oracle_equals_the_collective_reference(init, n):
    """Where dispatch and combine are the collective reference itself (reference mode), the GPU
    loop's collective-free reference agrees with them exactly, in every case of the scenario
    (masked ids, a capacity that drops, experts nobody picks, top_k 1 to 8)."""
    scenarios = _gpu_moe_scenarios()
    for case in scenarios.cases(n):
        assert _loop(scenarios, n, case) == [0.0, 0.0], case[0]


def test_gpu_loop_oracle_catches_a_misplaced_row_and_a_wrong_sum(init, monkeypatch):
    """The oracle is not blind: grouped rows shifted by one count as a differing dispatch, and a
    combine that is off by 1 shows as a difference of 1."""
    import dataclasses

    scenarios = _gpu_moe_scenarios()
    case = scenarios.cases(4)[0]
    dispatch, combine = jaxgin.moe.dispatch, jaxgin.moe.combine
    monkeypatch.setattr(jaxgin.moe, "dispatch",
                        lambda *a, **k: (lambda d: dataclasses.replace(d, x=jnp.roll(d.x, 1, axis=0)))(dispatch(*a, **k)))
    assert _loop(scenarios, 4, case)[0] == 1.0
    monkeypatch.setattr(jaxgin.moe, "dispatch", dispatch)
    monkeypatch.setattr(jaxgin.moe, "combine", lambda *a, **k: combine(*a, **k) + 1)
    wrong, difference = _loop(scenarios, 4, case)
    assert wrong == 0.0 and difference == 1.0


def test_gpu_exact_check_compares_the_handles_routing(init, monkeypatch):
    """The GPU scenario's one-call check (moe_scenarios._against_reference) also compares the routing
    dispatch hands to combine (on GPUs its own kernel's) with route()'s: all 7 comparisons hold on
    the reference, and a handle whose slot is off fails only the last."""
    import dataclasses

    scenarios = _gpu_moe_scenarios()
    name, tokens, hidden, ffn, experts, top_k, dtype, capacity, mode, routing = scenarios.cases(2)[0]
    mesh = _mesh(2)
    keys = jax.random.split(jax.random.key(3), 2)
    x = jax.random.normal(keys[0], (2 * tokens, hidden), jnp.float32).astype(dtype)
    logits = scenarios._logits(keys[1], 2 * tokens, experts, routing)

    def same():
        check = lambda x, l: scenarios._against_reference(x, l, top_k=top_k, experts=experts,  # noqa: E731
                                                          routing=routing, capacity=capacity, mode=mode)[0]
        return np.asarray(jax.jit(jax.shard_map(check, mesh=mesh, in_specs=(SPEC, SPEC), out_specs=SPEC))(x, logits))

    assert same().shape == (2, 7) and same().all()
    dispatch = jaxgin.moe.dispatch

    def slot_off(*a, **k):
        d = dispatch(*a, **k)
        route = dataclasses.replace(d.handle.route, slot=d.handle.route.slot.at[0, 0].add(1))
        return dataclasses.replace(d, handle=dataclasses.replace(d.handle, route=route))

    monkeypatch.setattr(jaxgin.moe, "dispatch", slot_off)
    assert same()[:, :6].all() and not same()[:, 6].any()


@pytest.mark.parametrize("n", [2, 4])
def test_gpu_fp8_check_passes_on_the_reference_and_catches_a_wrong_row(init, n, monkeypatch):
    """The GPU scenario's fp8 check (moe_scenarios._fp8_exact) holds where dispatch is the
    collective reference, and fails when fp8 dispatch delivers other bits than its rounded rows."""
    import dataclasses

    scenarios = _gpu_moe_scenarios()
    mesh = _mesh(n)
    exact = {"values_differing": 0, "counts_differing_gpus": 0}
    assert scenarios._fp8_exact(mesh) == {"low_latency": exact, "high_throughput": exact}
    dispatch = jaxgin.moe.dispatch

    def off_by_one_ulp(*a, **k):
        d = dispatch(*a, **k)
        if not k.get("fp8"):
            return d
        bits = jax.lax.bitcast_convert_type(d.x, jnp.int16)
        return dataclasses.replace(d, x=jax.lax.bitcast_convert_type(bits.at[0, 0].add(1), d.x.dtype))

    monkeypatch.setattr(jaxgin.moe, "dispatch", off_by_one_ulp)
    one_per_gpu = {"values_differing": n, "counts_differing_gpus": 0}  # row 0 of every GPU's block
    assert scenarios._fp8_exact(mesh) == {"low_latency": one_per_gpu, "high_throughput": one_per_gpu}


def test_gpu_routing_kernel_check_passes_on_the_reference_and_catches_a_wrong_rank(init, monkeypatch):
    """The GPU scenario's routing check (moe_scenarios._routing_kernel_exact) holds where dispatch
    routes with XLA's route() itself, and names the arrays that differ when the routing is off."""
    import dataclasses

    scenarios = _gpu_moe_scenarios()
    checked = scenarios._routing_kernel_exact()
    assert len(checked) == 5 and all(all(c["equal"].values()) for c in checked), checked
    assert sum(c["masked_entries"] > 0 for c in checked) == 2, checked
    route = scenarios._device_route

    def one_rank_off(ids, plan):
        got, masked = route(ids, plan)
        return dataclasses.replace(got, meta=got.meta.at[0, 0, 0].add(1)), masked

    monkeypatch.setattr(scenarios, "_device_route", one_rank_off)
    for c in scenarios._routing_kernel_exact():
        assert [name for name, same in c["equal"].items() if not same] == ["meta"], c


def test_layer_with_fp8_dispatch_is_the_layer_on_the_rounded_rows(init):
    """moe_layer(fp8=True) equals moe_layer on x rounded to e4m3 rows (values), and its gradients
    are finite and close to those without fp8."""
    n, tokens, hidden, ffn, experts, top_k = 2, 4, 128, 16, 4, 2
    mesh = _mesh(n)
    x, logits, w1, w2, _ = _params(n, tokens, hidden, ffn, experts, "random")
    fp8 = jaxgin.moe.fp8
    rounded = fp8.rounded(x)
    layer = lambda q: _layer_call(mesh, top_k=top_k, fp8=q)  # noqa: E731
    np.testing.assert_array_equal(np.asarray(layer(True)(x, logits, w1, w2)),
                                  np.asarray(layer(False)(rounded, logits, w1, w2)))
    sm = lambda q: jax.shard_map(lambda *a: L(*a, top_k=top_k, axis_name="ep", fp8=q), mesh=mesh,  # noqa: E731
                                 in_specs=(SPEC,) * 4, out_specs=SPEC)
    grads = [jax.jit(jax.grad(lambda *a, q=q: jnp.sum(sm(q)(*a) ** 2), argnums=(0, 2)))(x, logits, w1, w2)
             for q in (True, False)]
    for g8, g in zip(*grads):
        assert np.isfinite(np.asarray(g8)).all()
        _close(g8, g, 0.1)


@pytest.mark.parametrize("hosts", [[0, 0, 1, 1], [0, 1, 2, 3], [1, 1, 0, 0, 2, 2, 0, 1]])
def test_host_union_rows_each_token_once_per_host_in_token_order(hosts):
    """_routing.host_union, what dispatch across hosts sends to each other host: a token has a row
    in the union of d's host exactly when it goes to some GPU there, rows numbered in token order
    from 0 and the same for every GPU of the host, and the row count per host is what goes there."""
    from jaxgin.moe import _routing

    rng = np.random.default_rng(len(hosts))
    t, p = 37, len(hosts)
    goes = rng.random((t, p)) < 0.3
    slot = np.where(goes, np.cumsum(goes, axis=0) - goes, -1).astype(np.int32)
    hslot, hrows = _routing.host_union(jnp.asarray(slot), jnp.asarray(hosts, jnp.int32))
    hslot, hrows = np.asarray(hslot), np.asarray(hrows)
    for d in range(p):
        there = np.any(goes[:, [e for e in range(p) if hosts[e] == hosts[d]]], axis=1)
        assert np.array_equal(hslot[:, d] >= 0, there)
        assert hslot[there, d].tolist() == list(range(int(there.sum())))
        assert hrows[d] == there.sum()


@pytest.mark.parametrize(("hosts", "me"), [([0, 0, 1, 1], 1), ([0, 1, 2, 3], 2), ([0, 0, 0, 1, 1, 1], 4),
                                           ([1, 1, 0, 0, 2, 2], 0)])
def test_union_maps_tell_each_entry_where_its_hosts_partials_lie(hosts, me):
    """exchange._union_maps, what combine across hosts sends each other host's network entry for
    this GPU (jaxgin.hosts.entries): under the entry's axis index, the union's row count, then for
    each union row (token order) the token's staging row on each GPU of that host, by its place
    there (-1 where that GPU has none)."""
    from jaxgin.hosts import entries
    from jaxgin.moe import _routing, exchange

    rng = np.random.default_rng(me + len(hosts))
    t, p = 29, len(hosts)
    per_host = max(np.bincount(hosts))
    goes = rng.random((t, p)) < 0.3
    slot = np.where(goes, np.cumsum(goes, axis=0) - goes, -1).astype(np.int32)
    route = _routing.SourceRoute(jnp.asarray(slot), None, None, None, None)
    axis_hosts = jnp.asarray(hosts, jnp.int32)
    hslot, hrows = _routing.host_union(route.slot, axis_hosts)
    maps = np.asarray(exchange._union_maps(route, hslot, hrows, axis_hosts, jnp.int32(me), per_host))
    assert maps.shape == (p, exchange._map_words(_Plan(t), per_host))
    entry = entries(hosts)
    for host in set(hosts) - {hosts[me]}:
        members = [d for d in range(p) if hosts[d] == host]
        e = entry[me, members[0]]
        tokens = [i for i in range(t) if goes[i, members].any()]
        assert maps[e, 0] == len(tokens)
        table = maps[e, 1:1 + len(tokens) * per_host].reshape(len(tokens), per_host)
        for u, i in enumerate(tokens):
            assert table[u, :len(members)].tolist() == slot[i, members].tolist()


def _Plan(tokens):
    import types

    return types.SimpleNamespace(tokens=tokens)


class _LoweringState:
    """What exchange's GPU lowering reads of the runtime: heap and signal allocators, the placement
    cache, the SM count, and the hosts (rank 1 of 4 on hosts of 2 GPUs)."""

    def __init__(self):
        import types

        from jaxgin import heap

        self.heap = heap.heap_allocator(0, 1 << 36)
        self.signals = heap.signal_allocator(1024)
        self.placements = {}
        self.generation = 0
        self.world_size = 4
        self.local_devices = [types.SimpleNamespace(core_count=132)]
        self.runtime = FakeRuntime([{"rank": 1, "lsa_rank": 1, "lsa_size": 2}])
        self.options = types.SimpleNamespace(force_gin=False)


def _lowering_dispatch(monkeypatch, gin: bool):
    """exchange.dispatch_routing_kernel lowered at 64 tokens on rank 1 of 4 (hosts of 2 GPUs), with
    triton_call recording its launches [(kernel, args, out_shape, kw)] and returning zeros, and the
    routing kernels (_routing_device.route_alone) recording their calls [plan] and returning
    route()'s arrays, which they equal (test_the_routing_kernel_writes_routes_arrays_bit_for_bit):
    (the launches, a call of it taking its keyword arguments, the ids, the plan, the routings)."""
    from jaxgin import op_support
    from jaxgin.moe import _routing, _routing_device, exchange

    p, t, h, k, el = 4, 64, 256, 2, 2
    plan = _routing.Plan(("ep",), p, t, h, k, el, p * t * k, "bfloat16", _routing.LOW_LATENCY)
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(exchange, "axis_route", lambda names: jnp.asarray([1, 0, 1, 2, 3], jnp.int32))
    calls = []

    def fake_call(kernel, *args, out_shape, **kw):
        calls.append((kernel, args, out_shape, kw))
        return [jnp.zeros(o.shape, o.dtype) for o in out_shape]

    monkeypatch.setattr(exchange, "triton_call", fake_call)
    routed = []

    def fake_route(topk_ids, plan):
        routed.append(plan)
        return _routing.route(topk_ids, plan)

    monkeypatch.setattr(_routing_device, "route_alone", fake_route)
    ids = jax.random.randint(jax.random.key(3), (t, k), 0, p * el)
    x, w = jnp.ones((t, h), jnp.bfloat16), jnp.ones((t, k), jnp.float32)

    def dispatch(**kw):
        return exchange.dispatch_routing_kernel(_LoweringState(), x, w, ids, plan, **kw)

    return calls, dispatch, ids, plan, routed


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
def test_dispatch_lowering_across_hosts_sends_host_unions(monkeypatch, gin):
    """What dispatch launches on GPUs at 64 tokens: in an NVLink-only job the kernel that routes
    itself, with no relay areas; in a job with GIN peers the routing kernels then dispatch_kernel,
    given each rank's host, route()'s slots' per-host unions (_routing.host_union along the axis's
    hosts) and relay areas with a row of metadata per GPU of a host (2 here)."""
    pytest.importorskip("triton")
    from jaxgin.moe import _kernels, _routing

    calls, dispatch, ids, plan, routed = _lowering_dispatch(monkeypatch, gin)
    p, t, k = plan.size, plan.tokens, plan.top_k
    dispatch()
    ((kernel, args, _, kw),) = calls
    assert routed == ([plan] if gin else [])
    assert kernel is (_kernels.dispatch_kernel if gin else _kernels.dispatch_routing_kernel)
    assert kw["GIN"] == int(gin) and kw["L"] == (2 if gin else 1)
    if not gin:
        return
    route, _ = _routing.route(ids, plan)
    hslot, hrows, hosts = args[7], args[8], args[9]
    assert np.asarray(hosts).tolist() == [0, 0, 1, 1]
    want_slot, want_rows = _routing.host_union(route.slot, jnp.asarray([0, 0, 1, 1], jnp.int32))
    assert np.array_equal(hslot, want_slot) and np.array_equal(hrows, want_rows)
    buffers = args[10:]  # exchange._dispatch_launch's order: 15 buffers, then send_slot, send_n, relay_*
    relay_meta, relay_slot = buffers[15 + 3], buffers[15 + 5]
    assert relay_meta.shape == (2, p, 2, t, k) and relay_slot.shape == (2, p, 2, t)


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
def test_dispatch_lowering_traced_returns_the_kernels_records(monkeypatch, gin):
    """trace=True (tools/profile_moe.py --trace-dispatch) launches the traced twin of the kernel that
    would run (the routing kernel, or dispatch_kernel where the routing kernels run before it) with a
    record of 16 int32 per program as its last output, and returns it last, after the untraced
    call's outputs."""
    pytest.importorskip("triton")
    from jaxgin.moe import _kernels

    calls, dispatch, _, _, _ = _lowering_dispatch(monkeypatch, gin)
    plain = dispatch()
    outs = dispatch(trace=True)
    (plain_kernel, plain_args, plain_shape, plain_kw), (kernel, args, out_shape, kw) = calls
    assert kernel is (_kernels.dispatch_traced_kernel if gin else _kernels.dispatch_routing_traced_kernel)
    assert plain_kernel is (_kernels.dispatch_kernel if gin else _kernels.dispatch_routing_kernel)
    assert len(args) == len(plain_args) and kw == plain_kw and out_shape[:-1] == plain_shape
    assert out_shape[-1].shape == (kw["grid"][0], 16) and out_shape[-1].dtype == jnp.int32
    assert len(outs) == len(plain) + 1 and outs[-1].shape == (kw["grid"][0], 16)


@pytest.mark.parametrize("gin", [False, True], ids=["nvlink_only_job", "job_with_gin_peers"])
def test_moe_kernels_trace_as_pure_calls_inside_shard_map(monkeypatch, gin):
    """The MoE kernels are pure jaxgin.triton_calls (no JAX effect, so a jitted MoE layer keeps
    JAX's fast dispatch). Inside shard_map they take arrays that vary over the expert axis (the
    rows, the ids) beside ones that do not (the axis route): they trace with one varying type for
    their inputs, as jax.ffi.ffi_call casts them. On GPUs this failed when tracing before the cast
    (docs/measurements.md, thirty-sixth session). Nothing is compiled: the kernels are stand-ins."""
    pytest.importorskip("triton")
    from jaxgin import op_support
    from jaxgin.moe import _routing, exchange

    stand_in_kernels(monkeypatch)
    monkeypatch.setattr(op_support, "gin_in_job", lambda state: gin)
    monkeypatch.setattr(exchange, "axis_route", lambda names: jnp.asarray([1, 0, 1, 2, 3], jnp.int32))
    p, t, h, k, el = 4, 64, 256, 2, 2
    plan = _routing.Plan(("ep",), p, t, h, k, el, p * t * k, "bfloat16", _routing.LOW_LATENCY)
    ids = jax.random.randint(jax.random.key(3), (t, k), 0, p * el)
    x, w = jnp.ones((t, h), jnp.bfloat16), jnp.ones((t, k), jnp.float32)

    def pair(x, w, ids):
        state = _LoweringState()
        grouped, positions, weights, _, rows, _, route, _ = exchange.dispatch_routing_kernel(state, x, w, ids, plan)
        return exchange.combine_kernel(state, grouped, weights, positions, rows, route, plan)

    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    mapped = jax.shard_map(pair, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")), out_specs=P("ep"))
    jaxpr = jax.make_jaxpr(mapped)(x, w, ids)
    assert not jaxpr.effects
    calls = [eqn.primitive.name for eqn in equations(jaxpr.jaxpr) if eqn.primitive.name == "jaxgin_triton_call"]
    assert len(calls) == (3 if gin else 2), calls  # with GIN peers the routing kernel runs first
