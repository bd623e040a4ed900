"""jaxgin's JAX ops in reference mode (CPU, 8 emulated devices): ppermute, all_to_all, mailboxes
(put_signal / wait_signal) and the heap's range allocator.

The oracle is jax.lax, computed in the same program on the same data: data movement must be
bit-exact. Every op runs on per-device data that differs from device to device, so an op that
moved nothing, moved the wrong rows or filled with garbage fails.
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin
from jaxgin import heap as heap_lib
from jaxgin.errors import JaxginError, NotInitializedError

from conftest import equations

SIZES = [2, 4, 8]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int8]


@pytest.fixture
def init():
    """jaxgin initialized (reference mode) for the test; conftest finalizes it afterwards."""
    jaxgin.initialize()
    assert jaxgin.info()["backend"] == "reference"


# ---------------------------------------------------------------------------------------------
# Helpers


def mesh_of(n: int, names=("x",), shape=None) -> Mesh:
    devices = np.array(jax.devices()[:n]).reshape(shape or (n,))
    return Mesh(devices, names)


def data(shape, dtype, seed: int = 0) -> np.ndarray:
    """Random values of `dtype` (all different per device when the leading axes index devices)."""
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        info = np.iinfo(np.dtype(dtype))
        return rng.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def run(mesh: Mesh, body, *arrays, jit: bool = True, check_vma: bool = True):
    """Runs body(*local arrays) on every device of `mesh`.

    Each array is a global [*mesh.devices.shape, *local shape] (device (i, j, ...) holds [i, j, ...]);
    body's outputs (any pytree) come back the same way, [*mesh shape, *local output shape].
    """
    k = mesh.devices.ndim
    spec = P(*mesh.axis_names)

    def wrapped(*local):
        out = body(*jax.tree.map(lambda v: v.reshape(v.shape[k:]), local))
        return jax.tree.map(lambda o: o.reshape((1,) * k + o.shape), out)

    fn = jax.shard_map(wrapped, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma)
    return (jax.jit(fn) if jit else fn)(*arrays)


def assert_same(got, want, what: str = ""):
    """Same dtype, shape and bits; `what` names the case in the failure message."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    bits = lambda a: np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    if not np.array_equal(bits(got), bits(want)):
        raise AssertionError(f"{what}: arrays differ:\ngot  {got}\nwant {want}")


def perms(n: int) -> dict[str, list[tuple[int, int]]]:
    rng = np.random.default_rng(n)
    return {
        "ring": [(i, (i + 1) % n) for i in range(n)],
        "reverse_ring": [(i, (i - 1) % n) for i in range(n)],
        "shift": [(i, i + 1) for i in range(n - 1)],  # device 0 receives zeros
        "single": [(n - 1, 0)],  # only device 0 receives
        "empty": [],
        "identity": [(i, i) for i in range(n)],
        "swap": [(i, i ^ 1) for i in range(n)],
        "random": list(enumerate(rng.permutation(n).tolist())),
    }


PERM_NAMES = list(perms(2))


def numpy_ppermute(x: np.ndarray, perm) -> np.ndarray:
    """x: [n, ...] per-device values; the independent expectation of ppermute."""
    out = np.zeros_like(x)
    for src, dst in perm:
        out[dst] = x[src]
    return out


# ---------------------------------------------------------------------------------------------
# ppermute


def test_ops_bind_jaxgin_primitives(init):
    """jaxgin.ppermute / all_to_all trace to jaxgin's primitives (not straight to jax.lax), so the
    comparisons below exercise jaxgin's abstract evaluation, transpose, batching and lowering."""
    mesh = mesh_of(4)
    body = lambda v: (jaxgin.ppermute(v, "x", [(0, 1)]), jaxgin.all_to_all(v, "x", 0, 0, tiled=True))
    fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    text = str(jax.make_jaxpr(fn)(jnp.zeros((16, 3))))
    assert "jaxgin_ppermute" in text and "jaxgin_all_to_all" in text
    assert not re.search(r"\bppermute\[", text) and not re.search(r"\ball_to_all\[", text)


@pytest.mark.parametrize("perm_name", PERM_NAMES)
@pytest.mark.parametrize("n", SIZES)
def test_ppermute_matches_lax(init, n, perm_name):
    """jaxgin.ppermute == jax.lax.ppermute (and the numpy expectation), bit for bit, for float32,
    bfloat16 and int8 (one program)."""
    perm = perms(n)[perm_name]
    xs = [data((n, 3, 37), dtype, seed=n + i) for i, dtype in enumerate(DTYPES)]
    body = lambda *vs: [(jaxgin.ppermute(v, "x", perm), jax.lax.ppermute(v, "x", perm)) for v in vs]
    for x, (got, want) in zip(xs, run(mesh_of(n), body, *xs)):
        assert_same(got, want)
        assert_same(got, numpy_ppermute(x, perm))


@pytest.mark.parametrize("shape", [(), (1,), (0, 4), (4, 0), (3, 37), (2, 3, 5), (1027,)], ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_ppermute_shapes(init, n, shape):
    """Scalars, 0-size and odd shapes: ring and a partial perm in one program."""
    ring, shift = perms(n)["ring"], perms(n)["shift"]

    def body(v):
        return [jaxgin.ppermute(v, "x", ring), jax.lax.ppermute(v, "x", ring),
                jaxgin.ppermute(v, "x", shift), jax.lax.ppermute(v, "x", shift)]

    x = data((n, *shape), jnp.float32, seed=1)
    got_ring, want_ring, got_shift, want_shift = run(mesh_of(n), body, x)
    assert_same(got_ring, want_ring)
    assert_same(got_shift, want_shift)
    assert_same(got_ring, numpy_ppermute(x, ring))


@pytest.mark.parametrize("n", SIZES)
def test_ppermute_pytree(init, n):
    """A pytree input: every leaf (each with its own dtype and shape) moves like lax's."""
    perm = perms(n)["random"]
    tree = {"a": data((n, 3, 5), jnp.float32, 1), "b": (data((n, 7), jnp.int8, 2), data((n,), jnp.bfloat16, 3))}
    got, want = run(mesh_of(n), lambda t: (jaxgin.ppermute(t, "x", perm), jax.lax.ppermute(t, "x", perm)), tree)
    assert jax.tree.structure(got) == jax.tree.structure(tree)
    jax.tree.map(assert_same, got, want)
    jax.tree.map(lambda g, x: assert_same(g, numpy_ppermute(x, perm)), got, tree)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("check_vma", [True, False], ids=["vma", "no_vma"])
def test_ppermute_eager_and_without_vma_checks(init, jit, check_vma):
    """Works under jit and in eager shard_map, with and without shard_map's varying-axes checks."""
    n = 4
    perm = perms(n)["ring"]
    x = data((n, 6), jnp.float32)
    got, want = run(mesh_of(n), lambda v: (jaxgin.ppermute(v, "x", perm), jax.lax.ppermute(v, "x", perm)), x,
                    jit=jit, check_vma=check_vma)
    assert_same(got, want)


MULTI_AXIS = [("a", "b"), ("b", "a"), "a", "b"]


@pytest.mark.parametrize("axis_name", [a for a in MULTI_AXIS if a != ("b", "a")], ids=str)
def test_ppermute_multi_axis_mesh(init, axis_name):
    """On a 2x4 mesh, over both axes (flattened like lax) or over one axis. (lax.ppermute refuses a
    tuple out of the mesh's axis order, so ('b', 'a') has no oracle here.)"""
    mesh = mesh_of(8, ("a", "b"), (2, 4))
    size = {"a": 2, "b": 4}
    n = int(np.prod([size[a] for a in axis_name])) if isinstance(axis_name, tuple) else size[axis_name]
    x = data((2, 4, 3, 5), jnp.float32, seed=7)
    for perm in perms(n).values():
        got, want = run(mesh, lambda v: (jaxgin.ppermute(v, axis_name, perm), jax.lax.ppermute(v, axis_name, perm)), x)
        assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# all_to_all

# (split_axis, concat_axis) on rank-3 local arrays, negative axes included.
AXES_PAIRS = [(0, 0), (0, 1), (1, 0), (2, 1), (1, 2), (2, 2), (-1, 0), (0, -1), (-3, -2), (-2, -2)]


def a2a_local_shape(n: int, split_axis: int, tiled: bool) -> tuple[int, ...]:
    shape = [2, 3, 5]
    shape[split_axis] = 2 * n if tiled else n
    return tuple(shape)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_matches_lax(init, n, tiled):
    """jaxgin.all_to_all == jax.lax.all_to_all (result shape and bits) for every (split_axis,
    concat_axis) of AXES_PAIRS and float32, bfloat16 and int8 (one program: compiling is the cost)."""
    cases = list(itertools.product(AXES_PAIRS, DTYPES))
    xs = [data((n, *a2a_local_shape(n, s, tiled)), dtype, seed=i) for i, ((s, _), dtype) in enumerate(cases)]

    def body(*vs):
        return [(jaxgin.all_to_all(v, "x", s, c, tiled=tiled), jax.lax.all_to_all(v, "x", s, c, tiled=tiled))
                for v, ((s, c), _) in zip(vs, cases)]

    for ((s, c), dtype), (got, want) in zip(cases, run(mesh_of(n), body, *xs)):
        assert_same(got, want, f"split_axis={s} concat_axis={c} {np.dtype(dtype).name}")


@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_numpy_expectation(init, n):
    """Independent of lax: tiled all_to_all over axis 0 is a block transpose of [sender, receiver]."""
    x = data((n, n * 3, 4), jnp.float32, seed=3)  # device s: n chunks of 3 rows, chunk r for device r
    got = run(mesh_of(n), lambda v: jaxgin.all_to_all(v, "x", 0, 0, tiled=True), x)
    want = x.reshape(n, n, 3, 4).transpose(1, 0, 2, 3).reshape(n, n * 3, 4)
    assert_same(got, want)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_shapes(init, n, tiled):
    """1-D inputs, 0-size dimensions next to the split axis, odd sizes."""
    k = 2 * n if tiled else n
    cases = [((k,), 0, 0), ((k, 0), 0, 1), ((0, k), 1, 0), ((k, 37), 0, 1), ((3, k, 1), 1, 2)]
    for shape, split_axis, concat_axis in cases:
        x = data((n, *shape), jnp.float32, seed=len(shape))

        def body(v):
            return (jaxgin.all_to_all(v, "x", split_axis, concat_axis, tiled=tiled),
                    jax.lax.all_to_all(v, "x", split_axis, concat_axis, tiled=tiled))

        got, want = run(mesh_of(n), body, x)
        assert_same(got, want)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("axis_name", MULTI_AXIS, ids=str)
def test_all_to_all_multi_axis_mesh(init, axis_name, tiled):
    """On a 2x4 mesh over both axes (a tuple, either order) or over one axis of it."""
    mesh = mesh_of(8, ("a", "b"), (2, 4))
    size = {"a": 2, "b": 4}
    n = int(np.prod([size[a] for a in axis_name])) if isinstance(axis_name, tuple) else size[axis_name]
    pairs = [(0, 0), (0, 1), (1, 0), (-1, -2)]
    xs = []
    for i, (split_axis, _) in enumerate(pairs):
        local = [3, 5]
        local[split_axis] = 2 * n if tiled else n
        xs.append(data((2, 4, *local), jnp.bfloat16, seed=i))

    def body(*vs):
        return [(jaxgin.all_to_all(v, axis_name, s, c, tiled=tiled), jax.lax.all_to_all(v, axis_name, s, c, tiled=tiled))
                for v, (s, c) in zip(vs, pairs)]

    for (s, c), (got, want) in zip(pairs, run(mesh, body, *xs)):
        assert_same(got, want, f"split_axis={s} concat_axis={c}")


# ---------------------------------------------------------------------------------------------
# Differentiation and batching


def _global_op(mesh: Mesh, op):
    """x [n * 3, 5] sharded over "x" -> op applied per device -> same layout."""
    return jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x"))


def _loss(fn, w):
    return lambda x: jnp.sum(jnp.sin(fn(x)) * w)


@pytest.mark.parametrize("perm_name", ["ring", "shift", "single", "random", "swap"])
@pytest.mark.parametrize("n", SIZES)
def test_ppermute_grad_and_jvp_match_lax(init, n, perm_name):
    """jax.grad / jax.jvp through jaxgin.ppermute equal those through lax's (asymmetric perms, so a
    transpose that did not invert the permutation would fail)."""
    perm = perms(n)[perm_name]
    mesh = mesh_of(n)
    ours = _global_op(mesh, lambda v: jaxgin.ppermute(v, "x", perm))
    theirs = _global_op(mesh, lambda v: jax.lax.ppermute(v, "x", perm))
    x, w, t = (data((n * 3, 5), jnp.float32, seed=s) for s in (1, 2, 3))
    grads = jax.jit(lambda x: (jax.grad(_loss(ours, w))(x), jax.grad(_loss(theirs, w))(x)))(x)
    np.testing.assert_allclose(*grads, rtol=1e-6, atol=1e-6)
    assert np.any(grads[0] != 0)
    jvps = jax.jit(lambda x, t: (jax.jvp(ours, (x,), (t,)), jax.jvp(theirs, (x,), (t,))))(x, t)
    jax.tree.map(assert_same, jvps[0], jvps[1])


def lax_all_to_all_tiled_only(u, axis_name, split_axis, concat_axis, tiled):
    """jax.lax.all_to_all, the untiled case (split != concat) written with tiled=True the way lax
    reduces it. A gradient oracle: lax's own transpose of that case fails in jax 0.11 ("Expected
    cotangent type float32[2,3,1,5] but got float32[2,1,3,5]"); the forward results are identical."""
    if tiled or split_axis % u.ndim == concat_axis % u.ndim:
        return jax.lax.all_to_all(u, axis_name, split_axis, concat_axis, tiled=tiled)
    split_axis, concat_axis = split_axis % u.ndim, concat_axis % u.ndim
    if split_axis < concat_axis:
        concat_axis += 1
    else:
        split_axis += 1
    u = jnp.expand_dims(u, concat_axis)
    return jnp.squeeze(jax.lax.all_to_all(u, axis_name, split_axis, concat_axis, tiled=True), split_axis)


@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_grad_matches_lax(init, n, tiled):
    """jax.grad and jax.jvp through jaxgin.all_to_all equal those through lax's, for several
    (split_axis, concat_axis) (one program)."""
    mesh = mesh_of(n)
    pairs = [(0, 0), (0, 1), (1, 0), (-1, 1), (2, 0)]
    xs = [data((n, *a2a_local_shape(n, s, tiled)), jnp.float32, seed=i) for i, (s, _) in enumerate(pairs)]
    ts = [data(x.shape, jnp.float32, seed=10 + i) for i, x in enumerate(xs)]

    def op(f, s, c):
        return lambda v: run(mesh, lambda u: f(u, "x", s, c, tiled), v, jit=False)

    ours_op = lambda u, name, s, c, tiled: jaxgin.all_to_all(u, name, s, c, tiled=tiled)
    lax_op = lambda u, name, s, c, tiled: jax.lax.all_to_all(u, name, s, c, tiled=tiled)
    ws = [data(jax.eval_shape(op(lax_op, s, c), x).shape, jnp.float32, seed=20 + i) for i, (x, (s, c)) in
          enumerate(zip(xs, pairs))]

    @jax.jit
    def everything(xs, ts):
        results = []
        for x, t, w, (s, c) in zip(xs, ts, ws, pairs):
            ours, theirs = op(ours_op, s, c), op(lax_all_to_all_tiled_only, s, c)
            results.append(((theirs(x), op(lax_op, s, c)(x)),
                            (jax.grad(_loss(ours, w))(x), jax.grad(_loss(theirs, w))(x)),
                            jax.jvp(ours, (x,), (t,)), jax.jvp(theirs, (x,), (t,))))
        return results

    for (s, c), result in zip(pairs, everything(xs, ts)):
        what = f"split_axis={s} concat_axis={c}"
        (oracle, lax_result), (g_ours, g_theirs), jvp_ours, jvp_theirs = result
        assert_same(oracle, lax_result, what)  # the oracle is lax's all_to_all
        np.testing.assert_allclose(g_ours, g_theirs, rtol=1e-6, atol=1e-6, err_msg=what)
        assert np.all(g_ours != 0), what
        jax.tree.map(lambda a, b: assert_same(a, b, what), jvp_ours, jvp_theirs)


def test_grad_inside_shard_map(init):
    """jax.grad taken inside shard_map (per-device loss) agrees with lax for both ops."""
    n = 4
    perm = perms(n)["shift"]

    def body(v, w):
        g1 = jax.grad(lambda u: jnp.sum(jnp.sin(jaxgin.ppermute(u, "x", perm)) * w))(v)
        g2 = jax.grad(lambda u: jnp.sum(jnp.sin(jax.lax.ppermute(u, "x", perm)) * w))(v)
        g3 = jax.grad(lambda u: jnp.sum(jnp.sin(jaxgin.all_to_all(u, "x", 0, 1, tiled=True)) * w.T))(v)
        g4 = jax.grad(lambda u: jnp.sum(jnp.sin(jax.lax.all_to_all(u, "x", 0, 1, tiled=True)) * w.T))(v)
        return g1, g2, g3, g4

    x, w = data((n, 8, 2), jnp.float32, 1), data((n, 8, 2), jnp.float32, 2)
    g1, g2, g3, g4 = run(mesh_of(n), body, x, w)
    np.testing.assert_allclose(g1, g2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(g3, g4, rtol=1e-6, atol=1e-6)
    assert not np.any(g1[n - 1]) and np.all(np.any(g1[: n - 1] != 0, axis=(1, 2)))  # device n-1 sends nothing


def test_ppermute_transpose_binds_the_inverse_permutation(init):
    """The transpose rule is jaxgin's own: the backward pass is a jaxgin_ppermute with the
    inverse perm (so on GPUs the cotangent also travels through jaxgin's exchange)."""
    perm = ((0, 1), (1, 2), (3, 0))
    fn = _global_op(mesh_of(4), lambda v: jaxgin.ppermute(v, "x", perm))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(fn(x)))))(jnp.ones((8, 2)))
    found = [eqn.params["perm"] for eqn in equations(jaxpr.jaxpr) if eqn.primitive.name == "jaxgin_ppermute"]
    assert perm in found and ((1, 0), (2, 1), (0, 3)) in found


@pytest.mark.parametrize("n", SIZES)
def test_linear_transpose_matches_lax(init, n):
    """jax.linear_transpose of both ops equals lax's."""
    mesh = mesh_of(n)
    perm = perms(n)["random"]
    x = data((n * 2 * n, 2 * n), jnp.float32, 1)  # local [2n, 2n]: tiled split on either axis
    pairs = [
        (lambda v: jaxgin.ppermute(v, "x", perm), lambda v: jax.lax.ppermute(v, "x", perm)),
        (lambda v: jaxgin.all_to_all(v, "x", 0, 1, tiled=True), lambda v: jax.lax.all_to_all(v, "x", 0, 1, tiled=True)),
        (lambda v: jaxgin.all_to_all(v, "x", 1, 0, tiled=True), lambda v: jax.lax.all_to_all(v, "x", 1, 0, tiled=True)),
    ]
    for ours, theirs in pairs:
        f, g = _global_op(mesh, ours), _global_op(mesh, theirs)
        c = data(jax.eval_shape(g, x).shape, jnp.float32, 3)
        (got,) = jax.linear_transpose(f, x)(c)
        (want,) = jax.linear_transpose(g, x)(c)
        assert_same(got, want)


@pytest.mark.parametrize("in_axes", [0, 1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_ppermute_vmap_matches_lax(init, n, in_axes):
    """vmap (any batch dimension) of ppermute inside shard_map equals lax's."""
    perm = perms(n)["random"]
    x = data((n, 3, 4, 5), jnp.float32, 9)

    def body(v):
        return (jax.vmap(lambda u: jaxgin.ppermute(u, "x", perm), in_axes=in_axes)(v),
                jax.vmap(lambda u: jax.lax.ppermute(u, "x", perm), in_axes=in_axes)(v))

    got, want = run(mesh_of(n), body, x)
    assert_same(got, want)


@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0), (-1, 0)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("in_axes, out_axes", [(0, 0), (1, 0), (2, 2), (0, 1)])
@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_vmap_matches_lax(init, n, in_axes, out_axes, tiled, split_axis, concat_axis):
    """vmap of all_to_all inside shard_map equals lax's, the batch dimension anywhere (the
    batching rule moves a leading batch dimension out of the exchanged position)."""
    local = (2 * n if tiled else n, 3) if split_axis in (0, -2) else (3, 2 * n if tiled else n)
    batched = list(local)
    batched.insert(in_axes, 4)
    x = data((n, *batched), jnp.int8, 12)

    def body(v):
        op = lambda f: jax.vmap(lambda u: f(u, "x", split_axis, concat_axis, tiled=tiled), in_axes=in_axes,
                                out_axes=out_axes)(v)
        return op(jaxgin.all_to_all), op(jax.lax.all_to_all)

    got, want = run(mesh_of(n), body, x)
    assert_same(got, want)


@pytest.mark.parametrize("op", ["ppermute", "all_to_all"])
def test_vmap_of_grad(init, op):
    """Batching composes with differentiation: vmap(grad(loss through jaxgin)) == lax's."""
    n = 4
    perm = perms(n)["ring"]
    ours = {"ppermute": lambda u: jaxgin.ppermute(u, "x", perm),
            "all_to_all": lambda u: jaxgin.all_to_all(jaxgin.ppermute(u, "x", perm), "x", 0, 0, tiled=True)}[op]
    theirs = {"ppermute": lambda u: jax.lax.ppermute(u, "x", perm),
              "all_to_all": lambda u: jax.lax.all_to_all(jax.lax.ppermute(u, "x", perm), "x", 0, 0, tiled=True)}[op]

    def body(v, w):
        def per_example(f):
            return jax.vmap(jax.grad(lambda u, ww: jnp.sum(jnp.sin(f(u)) * ww)))(v, w)

        return per_example(ours), per_example(theirs)

    x, w = data((n, 3, 8), jnp.float32, 1), data((n, 3, 8), jnp.float32, 2)
    got, want = run(mesh_of(n), body, x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(got != 0)


def test_ppermute_of_invariant_input_is_varying(init):
    """A device-invariant input: shard_map must refuse out_specs=P() as it does for lax (the
    result differs per device), instead of silently returning device 0's value."""
    mesh = mesh_of(4)
    with pytest.raises(ValueError, match="replicat"):
        jax.jit(jax.shard_map(lambda v: jax.lax.ppermute(jnp.ones(2), "x", [(0, 1)]), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))(jnp.zeros(4))
    with pytest.raises(ValueError, match="replicat"):
        jax.jit(jax.shard_map(lambda v: jaxgin.ppermute(jnp.ones(2), "x", [(0, 1)]), mesh=mesh,
                              in_specs=P("x"), out_specs=P()))(jnp.zeros(4))


@pytest.mark.parametrize("op", ["ppermute", "all_to_all"])
def test_grad_of_replicated_input_matches_lax(init, op):
    """Gradient w.r.t. an input replicated over the axis (in_specs=P()): the cotangents of every
    device must be summed, as with lax. With the invariant typing they are not (wrong gradient)."""
    n = 4
    mesh = mesh_of(n)
    ours_op = {"ppermute": lambda v: jaxgin.ppermute(v, "x", [(0, 1), (1, 2)]),
               "all_to_all": lambda v: jaxgin.all_to_all(v, "x", 0, 0, tiled=True)}[op]
    lax_op = {"ppermute": lambda v: jax.lax.ppermute(v, "x", [(0, 1), (1, 2)]),
              "all_to_all": lambda v: jax.lax.all_to_all(v, "x", 0, 0, tiled=True)}[op]
    x = data((n,), jnp.float32, 1)
    w = data((n * n,), jnp.float32, 2)
    grads = []
    for f in (ours_op, lax_op):
        fn = jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("x"))
        grads.append(jax.grad(lambda v: jnp.sum(jnp.sin(fn(v)) * w))(x))
    np.testing.assert_allclose(*grads, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Errors


def _trace(mesh: Mesh, body, local_shape=(8, 3), dtype=jnp.float32):
    """Traces (and compiles) body on `mesh`, raising what tracing raises."""
    x = jnp.zeros((mesh.devices.size, *local_shape), dtype).reshape(mesh.devices.shape + tuple(local_shape))
    return run(mesh, body, x)


@pytest.mark.parametrize("n", [4, 8])
def test_all_to_all_tiled_not_divisible(init, n):
    """tiled=True with a split axis not divisible by the axis size: ValueError naming the axis."""
    with pytest.raises(ValueError, match="not divisible") as excinfo:
        _trace(mesh_of(n), lambda v: jaxgin.all_to_all(v, "x", 1, 0, tiled=True), local_shape=(8, n + 1))
    assert f"x.shape[1] = {n + 1}" in str(excinfo.value) and f"axis size {n}" in str(excinfo.value)


@pytest.mark.parametrize("split_size", [2, 8, 0])
def test_all_to_all_untiled_wrong_size(init, split_size):
    """tiled=False needs x.shape[split_axis] == axis size."""
    with pytest.raises(ValueError, match="must equal the axis size 4"):
        _trace(mesh_of(4), lambda v: jaxgin.all_to_all(v, "x", 0, 1), local_shape=(split_size, 3))


@pytest.mark.parametrize("split_axis, concat_axis", [(2, 0), (-3, 0), (0, 2), (0, -3)])
def test_all_to_all_axis_out_of_range(init, split_axis, concat_axis):
    with pytest.raises(ValueError, match="out of range for an array of rank 2"):
        _trace(mesh_of(4), lambda v: jaxgin.all_to_all(v, "x", split_axis, concat_axis, tiled=True))


@pytest.mark.parametrize("split_axis", [1.0, "0", None])
def test_all_to_all_axis_must_be_int(init, split_axis):
    with pytest.raises(TypeError, match="split_axis must be an int"):
        _trace(mesh_of(4), lambda v: jaxgin.all_to_all(v, "x", split_axis, 0, tiled=True))


def test_all_to_all_of_a_scalar(init):
    with pytest.raises(ValueError, match="at least one dimension"):
        _trace(mesh_of(4), lambda v: jaxgin.all_to_all(v[0, 0], "x", 0, 0)[None, None])


@pytest.mark.parametrize("op", ["ppermute", "all_to_all", "put_signal", "wait_signal"])
def test_unbound_axis_name(init, op):
    """An axis name that is not bound: NameError naming it and pointing at shard_map."""
    box = jaxgin.Mailbox("test_unbound_axis_name", (8, 3), jnp.float32)
    token = None

    def body(v):
        nonlocal token
        if op == "ppermute":
            return jaxgin.ppermute(v, "nope", [(0, 1)])
        if op == "all_to_all":
            return jaxgin.all_to_all(v, "nope", 0, 0, tiled=True)
        token = jaxgin.put_signal(v, box, 0, axis_name="x" if op == "wait_signal" else "nope")
        return jaxgin.wait_signal(box, 1, axis_name="nope", after=token)[0]

    with pytest.raises(NameError, match="'nope'.*shard_map"):
        _trace(mesh_of(4), body)


def test_unbound_axis_name_outside_shard_map(init):
    """Called outside any shard_map (eager or jit): the same NameError."""
    with pytest.raises(NameError, match="'x' is not bound"):
        jaxgin.ppermute(jnp.ones(3), "x", [(0, 1)])
    with pytest.raises(NameError, match="'x' is not bound"):
        jax.jit(lambda v: jaxgin.all_to_all(v, "x", 0, 0))(jnp.ones(4))


def test_unbound_axis_of_a_tuple(init):
    """One unbound name in a tuple of axes is named."""
    with pytest.raises(NameError, match="'c'"):
        _trace(mesh_of(8, ("a", "b"), (2, 4)), lambda v: jaxgin.ppermute(v, ("a", "c"), [(0, 1)]))


def test_empty_axis_name(init):
    """Ops without a jax.lax counterpart refuse an empty axis_name (ppermute / all_to_all take it
    as lax does: tests/test_collectives.py)."""
    with pytest.raises(ValueError, match="at least one mesh axis"):
        _trace(mesh_of(4), lambda v: jaxgin.axis_route(()) + v[0, 0].astype(jnp.int32))


@pytest.mark.parametrize("op", ["ppermute", "all_to_all", "put_signal", "wait_signal"])
def test_ops_before_initialize(op):
    """Every op needs jaxgin.initialize(), on CPU too (so code moves to GPUs unchanged).

    conftest's autouse fixture finalizes jaxgin before and after every test, so the state the
    other tests expect comes back; the finally clause also leaves this process initialized-then-
    finalized in the same way if the assertion fails midway.
    """
    jaxgin.finalize()
    assert not jaxgin.is_initialized()
    box = jaxgin.Mailbox("test_ops_before_initialize", (8, 3), jnp.float32)

    def body(v):
        if op == "ppermute":
            return jaxgin.ppermute(v, "x", [(0, 1)])
        if op == "all_to_all":
            return jaxgin.all_to_all(v, "x", 0, 0, tiled=True)
        token = jaxgin.put_signal(v, box, 0, axis_name="x")
        return jaxgin.wait_signal(box, 1, axis_name="x", after=token)[0]

    try:
        with pytest.raises(NotInitializedError, match=r"jaxgin\.initialize\(\)"):
            _trace(mesh_of(4), body)
        jaxgin.initialize()
        _trace(mesh_of(4), body)  # the same program works once initialized
        jaxgin.finalize()
        with pytest.raises(NotInitializedError):  # and fails again after finalize (nothing stale cached)
            _trace(mesh_of(4), body)
    finally:
        jaxgin.finalize()


# ---------------------------------------------------------------------------------------------
# Mailboxes


def _mailbox_name(request) -> str:
    """A mailbox name unique to the test (names are process-global)."""
    return f"test_ops::{request.node.name}"


@pytest.mark.parametrize("n", SIZES)
def test_mailbox_ring_matches_ppermute(init, request, n):
    """put to the right neighbour, wait for one put: the left neighbour's row holds exactly what
    lax.ppermute delivers over the ring, every other row is zero."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3, 37), jnp.float32)
    ring = perms(n)["ring"]

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
        inbox = jaxgin.wait_signal(box, 1, axis_name="x", after=token)
        want_row = jax.lax.ppermute(v, "x", ring)
        want = jnp.zeros((n, 3, 37), v.dtype).at[(me - 1) % n].set(want_row)
        return inbox, inbox[(me - 1) % n], want, want_row

    x = data((n, 3, 37), jnp.float32, seed=n)
    inbox, left, want, want_row = run(mesh_of(n), body, x)
    assert inbox.shape == (n, n, 3, 37)
    assert_same(left, want_row)
    assert_same(inbox, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", SIZES)
def test_mailbox_two_neighbours(init, request, n, dtype):
    """Two puts per device (left and right), one wait on both tokens with count=2; scalar-free
    payloads of each dtype."""
    if n == 2:
        pytest.skip("left and right neighbour coincide on 2 devices")
    box = jaxgin.Mailbox(_mailbox_name(request), (5,), dtype)

    def body(v):
        me = jax.lax.axis_index("x")
        right = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
        left = jaxgin.put_signal(v, box, (me - 1) % n, axis_name="x")
        inbox = jaxgin.wait_signal(box, 2, axis_name="x", after=[right, left])
        return inbox, jax.lax.ppermute(v, "x", perms(n)["ring"]), jax.lax.ppermute(v, "x", perms(n)["reverse_ring"])

    x = data((n, 5), dtype, seed=2)
    inbox, from_left, from_right = run(mesh_of(n), body, x)
    for d in range(n):
        want = np.zeros((n, 5), x.dtype)
        want[(d - 1) % n] = np.asarray(from_left)[d]
        want[(d + 1) % n] = np.asarray(from_right)[d]
        assert_same(inbox[d], want)


@pytest.mark.parametrize("n", SIZES)
def test_mailbox_data_dependent_peer(init, request, n):
    """The destination is a traced int32 computed from data: each device sends to dest[me], a
    random permutation given as an input array."""
    box = jaxgin.Mailbox(_mailbox_name(request), (4,), jnp.int8)
    dest = np.random.default_rng(n).permutation(n).astype(np.int32)
    x = data((n, 4), jnp.int8, seed=5)

    def body(v, d):
        token = jaxgin.put_signal(v, box, d, axis_name="x")
        return jaxgin.wait_signal(box, 1, axis_name="x", after=token)

    inbox = np.asarray(run(mesh_of(n), body, x, dest))
    want = np.zeros((n, n, 4), np.int8)
    for s in range(n):
        want[dest[s], s] = x[s]
    assert_same(inbox, want)
    # The row of the sender equals lax.ppermute under the same permutation.
    got_rows = inbox[np.arange(n), np.argsort(dest)]
    want_rows = run(mesh_of(n), lambda v: jax.lax.ppermute(v, "x", list(enumerate(dest.tolist()))), x)
    assert_same(got_rows, want_rows)


def test_mailbox_python_int_peer(init, request):
    """A Python int peer: every device puts into device 2's mailbox, and every device takes what
    waits in its own with count=0 (device 2: every sender's row; the others: zeros). A count of n
    would be a misuse on the devices nobody put to (reference mode raises; a GPU times out)."""
    n = 4
    box = jaxgin.Mailbox(_mailbox_name(request), (2, 3), jnp.bfloat16)

    def body(v):
        token = jaxgin.put_signal(v, box, 2, axis_name="x")
        return jaxgin.wait_signal(box, 0, axis_name="x", after=token), jax.lax.all_gather(v, "x")

    x = data((n, 2, 3), jnp.bfloat16, 3)
    inbox, gathered = run(mesh_of(n), body, x)
    for d in range(n):
        assert_same(inbox[d], gathered[d] if d == 2 else np.zeros((n, 2, 3), x.dtype))


def test_mailbox_on_one_axis_of_a_2d_mesh(init, request):
    """Axis indices are positions along the named axis ('b' of a 2x4 mesh), not global ranks."""
    mesh = mesh_of(8, ("a", "b"), (2, 4))
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        me = jax.lax.axis_index("b")
        token = jaxgin.put_signal(v, box, (me + 1) % 4, axis_name="b")
        inbox = jaxgin.wait_signal(box, 1, axis_name="b", after=token)
        return inbox[(me - 1) % 4], jax.lax.ppermute(v, "b", perms(4)["ring"])

    got, want = run(mesh, body, data((2, 4, 3), jnp.float32, 4))
    assert_same(got, want)


def test_mailbox_reused_across_programs(init, request):
    """Declaring the same name with the same shape and dtype again is fine (equal mailboxes), and
    a second program can use it."""
    name = _mailbox_name(request)
    assert jaxgin.Mailbox(name, (4,), jnp.float32) == jaxgin.Mailbox(name, [4], np.float32)
    for shift in (1, 3):
        box = jaxgin.Mailbox(name, (4,), jnp.float32)

        def body(v):
            me = jax.lax.axis_index("x")
            token = jaxgin.put_signal(v, box, (me + shift) % 4, axis_name="x")
            return jaxgin.wait_signal(box, 1, axis_name="x", after=token)[(me - shift) % 4]

        x = data((4, 4), jnp.float32, shift)
        assert_same(run(mesh_of(4), body, x), numpy_ppermute(x, [(i, (i + shift) % 4) for i in range(4)]))


@pytest.mark.parametrize("n", SIZES)
def test_wait_signal_from_ring_matches_ppermute(init, request, n):
    """The ring with wait_signal_from(left neighbour): exactly lax.ppermute's result, one row."""
    box = jaxgin.Mailbox(_mailbox_name(request), (2, 9), jnp.bfloat16)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
        return jaxgin.wait_signal_from(box, (me - 1) % n, axis_name="x", after=token), jax.lax.ppermute(
            v, "x", perms(n)["ring"]
        )

    got, want = run(mesh_of(n), body, data((n, 2, 9), jnp.bfloat16, seed=n))
    assert got.shape == (n, 2, 9)
    assert_same(got, want)


@pytest.mark.parametrize("n", [4, 8])
def test_wait_signal_from_picks_one_sender(init, request, n):
    """Every device puts to both neighbours; wait_signal_from takes one given sender (traced)
    at a time: first the right neighbour's put, then the left one's, each equal to lax.ppermute's."""
    box = jaxgin.Mailbox(_mailbox_name(request), (6,), jnp.int32)
    x = data((n, 6), jnp.int32, seed=7)

    def body(v):
        me = jax.lax.axis_index("x")
        right = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
        left = jaxgin.put_signal(v + 1, box, (me - 1) % n, axis_name="x")
        from_right = jaxgin.wait_signal_from(box, (me + 1) % n, axis_name="x", after=[right, left])
        from_left = jaxgin.wait_signal_from(box, (me - 1) % n, axis_name="x", after=[right, left])
        return from_right, from_left, jax.lax.ppermute(v + 1, "x", perms(n)["reverse_ring"]), jax.lax.ppermute(
            v, "x", perms(n)["ring"]
        )

    from_right, from_left, want_right, want_left = run(mesh_of(n), body, x)
    assert_same(from_right, want_right)
    assert_same(from_left, want_left)


@pytest.mark.parametrize("source", [4, -1])
def test_wait_signal_from_int_source_out_of_range(init, request, source):
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        token = jaxgin.put_signal(v[0], box, 0, axis_name="x")
        return jaxgin.wait_signal_from(box, source, axis_name="x", after=token)[None]

    with pytest.raises(ValueError, match=rf"jaxgin.wait_signal_from: source={source} is out of range for an axis of size 4"):
        _trace(mesh_of(4), body)


@pytest.mark.parametrize("source", [1.5, "left", "vector"])
def test_wait_signal_from_bad_source_type(init, request, source):
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        token = jaxgin.put_signal(v[0], box, 0, axis_name="x")
        src = jnp.zeros(2, jnp.int32) if source == "vector" else source
        return jaxgin.wait_signal_from(box, src, axis_name="x", after=token)[None]

    with pytest.raises(TypeError, match="source must be a Python int or an integer scalar"):
        _trace(mesh_of(4), body)


def test_wait_signal_from_is_not_differentiable(init, request):
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def loss(u):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(u, box, (me + 1) % 4, axis_name="x")
        return jnp.sum(jaxgin.wait_signal_from(box, (me - 1) % 4, axis_name="x", after=token))

    with pytest.raises(JaxginError, match="not differentiable"):
        run(mesh_of(4), lambda v: jax.grad(loss)(v), data((4, 3), jnp.float32))


@pytest.mark.parametrize("payload, axis", [(0, 4), (13, 2), (8192, 4), (8193, 4), (1 << 20, 8)])
def test_mailbox_bytes_mirror(payload, axis):
    """The Python placement size equals the C++ layout: header, slots, staging, line slots."""
    from jaxgin.mailbox import mailbox_bytes

    slot = max(16, -(-payload // 16) * 16)
    line_slot = 16 * max(1, -(-payload // 8)) if payload <= 8192 else 0
    assert mailbox_bytes(payload, axis) == 256 + slot * (axis + 1) + line_slot * axis


def test_mailbox_properties(request):
    box = jaxgin.Mailbox(_mailbox_name(request), (3, 5), jnp.bfloat16)
    assert box.shape == (3, 5) and box.dtype == np.dtype(jnp.bfloat16) and box.nbytes == 30
    assert jaxgin.Mailbox(_mailbox_name(request) + "0", (0, 4), jnp.float32).nbytes == 0


def test_mailbox_redeclared_with_other_shape_or_dtype(request):
    name = _mailbox_name(request)
    jaxgin.Mailbox(name, (4,), jnp.float32)
    with pytest.raises(ValueError, match=r"declared with shape \(4,\) and dtype float32.*Use another name"):
        jaxgin.Mailbox(name, (5,), jnp.float32)
    with pytest.raises(ValueError, match="cannot be reused with shape"):
        jaxgin.Mailbox(name, (4,), jnp.int32)


@pytest.mark.parametrize("name, shape, error", [("", (1,), TypeError), (3, (1,), TypeError), ("neg", (2, -1), ValueError)])
def test_mailbox_bad_declaration(request, name, shape, error):
    if name == "neg":
        name = _mailbox_name(request)
    with pytest.raises(error):
        jaxgin.Mailbox(name, shape, jnp.float32)


@pytest.mark.parametrize("value", [np.zeros(5, np.float32), np.zeros(4, np.int32), np.zeros((1, 4), np.float32)],
                         ids=["shape", "dtype", "rank"])
def test_put_signal_mismatched_payload(init, request, value):
    """x must have the mailbox's shape and dtype: TypeError naming both."""
    box = jaxgin.Mailbox(_mailbox_name(request), (4,), jnp.float32)
    with pytest.raises(TypeError, match=re.escape(f"mailbox {box.name!r} holds float32[4]")):
        _trace(mesh_of(4), lambda v: jaxgin.put_signal(jnp.asarray(value), box, 0, axis_name="x").values[1][None])


@pytest.mark.parametrize("peer", [4, -1, 100])
def test_put_signal_int_peer_out_of_range(init, request, peer):
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)
    with pytest.raises(ValueError, match=rf"peer={peer} is out of range for an axis of size 4"):
        _trace(mesh_of(4), lambda v: jaxgin.put_signal(v[0], box, peer, axis_name="x").values[1][None])


@pytest.mark.parametrize("peer", [1.0, True, "peer", "vector", "float"])
def test_put_signal_bad_peer_type(init, request, peer):
    """peer must be a Python int or an integer scalar."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        p = {"vector": jnp.zeros(2, jnp.int32), "float": jnp.float32(1)}.get(peer, peer)
        return jaxgin.put_signal(v[0], box, p, axis_name="x").values[1][None]

    with pytest.raises(TypeError):
        _trace(mesh_of(4), body)


def test_put_signal_needs_a_mailbox(init):
    with pytest.raises(TypeError, match="must be a jaxgin.Mailbox"):
        _trace(mesh_of(4), lambda v: jaxgin.put_signal(v, "box", 0, axis_name="x"))


@pytest.mark.parametrize("count", [-1, 5, True, 1.0, "1"])
def test_wait_signal_count_out_of_range(init, request, count):
    """count must be an int in [0, axis size]."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        token = jaxgin.put_signal(v[0], box, 0, axis_name="x")
        return jaxgin.wait_signal(box, count, axis_name="x", after=token)

    with pytest.raises(ValueError, match=r"count must be an int in \[0, 4\]"):
        _trace(mesh_of(4), body)


def test_wait_signal_count_bounds_are_accepted(init, request):
    """0 and the axis size are valid counts (traced only: run, a count of 4 would be a misuse on
    the devices nobody put to)."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)
    mesh = mesh_of(4)
    for count in (0, 4):
        def body(v):
            token = jaxgin.put_signal(v[0, 0], box, 0, axis_name="x")
            return jaxgin.wait_signal(box, count, axis_name="x", after=token)[None]

        fn = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        jax.jit(fn).lower(jnp.zeros((4, 8, 3), jnp.float32))


@pytest.mark.parametrize("op", ["wait_signal", "wait_signal_from"])
def test_wait_signal_token_of_another_mailbox(init, request, op):
    a = jaxgin.Mailbox(_mailbox_name(request) + "a", (3,), jnp.float32)
    b = jaxgin.Mailbox(_mailbox_name(request) + "b", (3,), jnp.float32)

    def body(v):
        token = jaxgin.put_signal(v[0], a, 0, axis_name="x")
        if op == "wait_signal":
            return jaxgin.wait_signal(b, 1, axis_name="x", after=token)
        return jaxgin.wait_signal_from(b, 0, axis_name="x", after=token)[None]

    message = f"jaxgin.{op}: a token of mailbox {a.name!r} was passed to wait on {b.name!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        _trace(mesh_of(4), body)


@pytest.mark.parametrize("after", [[], "token", [None]], ids=["empty", "str", "list_of_none"])
def test_wait_signal_missing_token(init, request, after):
    """after= must hold put_signal's Token(s)."""
    box = jaxgin.Mailbox(_mailbox_name(request), (4,), jnp.float32)
    with pytest.raises(TypeError, match=r"after= needs the Token\(s\) returned by jaxgin.put_signal"):
        _trace(mesh_of(4), lambda v: jaxgin.wait_signal(box, 1, axis_name="x", after=after))


def test_wait_signal_without_after(init, request):
    """after= is required (keyword-only, no default)."""
    box = jaxgin.Mailbox(_mailbox_name(request), (4,), jnp.float32)
    with pytest.raises(TypeError, match="after"):
        _trace(mesh_of(4), lambda v: jaxgin.wait_signal(box, 1, axis_name="x"))


def test_wait_signal_needs_a_mailbox(init):
    with pytest.raises(TypeError, match="must be a jaxgin.Mailbox"):
        _trace(mesh_of(4), lambda v: jaxgin.wait_signal("box", 1, axis_name="x", after=[]))


def test_put_signal_cannot_be_vmapped(init, request):
    """vmap of put_signal must fail the same way on every backend (code moves to GPUs unchanged):
    the CUDA primitive's batching rule raises JaxginError('cannot be vmapped')."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v):
        token = jax.vmap(lambda u: jaxgin.put_signal(u, box, 0, axis_name="x").values[1])(v)
        return token

    with pytest.raises(JaxginError, match="cannot be vmapped"):
        run(mesh_of(4), body, data((4, 2, 3), jnp.float32))


@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_put_signal_is_not_differentiable(init, request, transform):
    """Differentiating through put_signal: JaxginError saying so and pointing at ppermute."""
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def loss(u):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(u, box, (me + 1) % 4, axis_name="x")
        return jnp.sum(jaxgin.wait_signal(box, 1, axis_name="x", after=token))

    def body(v):
        if transform == "grad":
            return jax.grad(loss)(v)
        return jax.jvp(loss, (v,), (jnp.ones_like(v),))[1][None]

    with pytest.raises(JaxginError, match="put_signal is not differentiable.*jaxgin.ppermute"):
        run(mesh_of(4), body, data((4, 3), jnp.float32))


def test_grad_of_other_inputs_through_a_mailbox_program(init, request):
    """What is not sent may be differentiated: grad w.r.t. a weight that multiplies the received
    data works and equals the received data (the same as with lax.ppermute)."""
    n = 4
    box = jaxgin.Mailbox(_mailbox_name(request), (3,), jnp.float32)

    def body(v, w):
        me = jax.lax.axis_index("x")

        def loss(ww):
            token = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
            return jnp.sum(jaxgin.wait_signal(box, 1, axis_name="x", after=token)[(me - 1) % n] * ww)

        return jax.grad(loss)(w), jax.lax.ppermute(v, "x", perms(n)["ring"])

    got, want = run(mesh_of(n), body, data((n, 3), jnp.float32, 1), data((n, 3), jnp.float32, 2))
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# heap.RangeAllocator


def test_allocator_first_fit_in_request_order():
    a = heap_lib.RangeAllocator(0, 100, what="bytes")
    assert [a.allocate(s) for s in (10, 20, 30)] == [0, 10, 30]
    assert a.available() == 40


def test_allocator_reuses_the_first_hole_that_fits():
    a = heap_lib.RangeAllocator(0, 100, what="bytes")
    x, y, z = a.allocate(10), a.allocate(10), a.allocate(10)
    a.free(y)
    assert a.allocate(20) == 30  # the hole [10, 20) is too small
    assert a.allocate(5) == 10  # first fit: the hole
    assert a.allocate(5) == 15  # the rest of the hole
    assert a.allocate(1) == 50
    assert (x, z) == (0, 20)


def test_allocator_merges_freed_neighbours():
    a = heap_lib.RangeAllocator(16, 116, what="bytes")
    blocks = [a.allocate(10) for _ in range(10)]
    assert blocks == list(range(16, 116, 10)) and a.available() == 0
    for i in (0, 2, 1, 9, 7, 8):  # frees out of order; [16, 46) and [86, 116) must merge
        a.free(blocks[i])
    assert a.available() == 60
    assert a.allocate(30) == 16
    assert a.allocate(30) == 86
    for i in (3, 4, 5, 6):
        a.free(blocks[i])
    a.free(16)
    a.free(86)
    assert a.available() == 100
    assert a.allocate(100) == 16  # everything merged back into one block


def test_allocator_alignment():
    """Sizes round up to the alignment, so every block starts aligned (from an aligned begin)."""
    a = heap_lib.RangeAllocator(0, 4096, what="bytes", alignment=256)
    offsets = [a.allocate(s) for s in (1, 256, 257, 100)]
    assert offsets == [0, 256, 512, 1024]
    assert a.available() == 4096 - 1280
    a.free(512)  # a 512-byte block (257 rounded up)
    assert a.allocate(300) == 512
    assert a.allocate(1) == 1280


def test_allocator_zero_size_keeps_alignment():
    """allocate(0) must not leave the next block misaligned."""
    a = heap_lib.RangeAllocator(0, 4096, what="bytes", alignment=256)
    a.allocate(0)
    assert a.allocate(16) % 256 == 0


def test_allocator_zero_size_blocks_are_distinct():
    a = heap_lib.RangeAllocator(0, 10, what="signals")
    assert a.allocate(0) != a.allocate(0)


def test_allocator_negative_size():
    with pytest.raises(ValueError, match="cannot allocate -1 signals"):
        heap_lib.RangeAllocator(0, 10, what="signals").allocate(-1)


def test_allocator_exhaustion_message():
    """Names the (aligned) size requested, what is free, the largest block, the total and the hint."""
    a = heap_lib.heap_allocator(4096, 4096 + 8 * 256)
    first = a.allocate(256)
    a.allocate(256)
    a.free(first)  # 1792 free, but the largest block is 1536
    with pytest.raises(JaxginError, match="out of symmetric heap bytes") as excinfo:
        a.allocate(1600)
    message = str(excinfo.value)
    assert "1792 requested" in message  # 1600 rounded up to the alignment
    assert "1792 free in total" in message and "largest free block 1536" in message and "of 2048" in message
    assert "pass a larger jaxgin.initialize(heap_size=...)" in message
    assert a.allocate(1536) == 4096 + 512


def test_signal_allocator_exhaustion_message():
    a = heap_lib.signal_allocator(8)
    assert [a.allocate(2) for _ in range(4)] == [0, 2, 4, 6]
    with pytest.raises(JaxginError, match=r"out of signals: 3 requested.*jaxgin\.initialize\(signal_count=\.\.\.\)"):
        a.allocate(3)


def test_heap_allocator_starts_at_the_user_offset(init):
    """The live heap allocator hands out offsets in [user area start, heap end), 256-aligned."""
    from jaxgin import runtime

    state = runtime.current()
    info = jaxgin.info()
    start = info["heap_bytes"] - info["heap_user_bytes"]
    offsets = [state.heap.allocate(s) for s in (1, 1000, 4096)]
    assert offsets[0] == start
    assert all(start <= o < info["heap_bytes"] and o % heap_lib.ALIGNMENT == 0 for o in offsets)
    assert len(set(offsets)) == 3
