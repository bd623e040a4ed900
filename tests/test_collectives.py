"""jaxgin.ppermute / jaxgin.all_to_all as drop-ins for jax.lax's (jaxgin/collectives.py): what lax
accepts inside shard_map jaxgin accepts with the same result, what lax refuses jaxgin refuses with
the same exception type, and where lax is not the oracle (outside shard_map, unbound names) the
error says what to do.

Cases follow how JAX tests its own collectives: pytrees of mixed leaves, perms given every way lax
takes them, axis_index_groups, collectives over a vmap axis_name, unbound names. Every result is
compared with jax.lax's in the same program on per-device data that differs from device to device.
"""

from __future__ import annotations

import collections
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin
from jaxgin.errors import JaxginError


@pytest.fixture
def init():
    jaxgin.initialize()
    assert jaxgin.info()["backend"] == "reference"


def mesh_of(n: int, names=("x",), shape=None) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(shape or (n,)), names)


def data(shape, dtype=jnp.float32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):
        return rng.integers(-100, 100, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def run(mesh: Mesh, body, *arrays, check_vma: bool = True):
    """body(*local arrays) on every device; arrays and outputs are [*mesh shape, *local shape]."""
    k = mesh.devices.ndim
    spec = P(*mesh.axis_names)

    def wrapped(*local):
        out = body(*jax.tree.map(lambda v: v.reshape(v.shape[k:]), local))
        return jax.tree.map(lambda o: o.reshape((1,) * k + o.shape), out)

    return jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=check_vma))(*arrays)


def assert_same(got, want, what: str = ""):
    got, want = np.asarray(got), np.asarray(want)
    assert (got.dtype, got.shape) == (want.dtype, want.shape), (what, got.dtype, got.shape, want.dtype, want.shape)
    if not np.array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
        raise AssertionError(f"{what}: arrays differ:\ngot  {got}\nwant {want}")


def assert_trees_same(got, want, what: str = ""):
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    jax.tree.map(lambda g, w: assert_same(g, w, what), got, want)


def raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # the point is to compare what lax and jaxgin raise
        return e
    return None


def assert_both_refuse(ours, theirs, *, same_type: bool = True) -> BaseException:
    """Both calls raise; with same_type, exceptions of the same type. Returns jaxgin's."""
    mine, lax_error = raised(ours), raised(theirs)
    assert lax_error is not None, "jax.lax accepted the input (the case is wrong)"
    assert mine is not None, f"jaxgin accepted what jax.lax refuses with {type(lax_error).__name__}: {lax_error}"
    if same_type:
        assert type(mine) is type(lax_error), (mine, lax_error)
    return mine


# ---------------------------------------------------------------------------------------------
# Signatures


@pytest.mark.parametrize("name", ["ppermute", "all_to_all"])
def test_signature_is_lax(name):
    """Same parameter names, kinds (positional / keyword-only) and defaults as jax.lax's."""
    ours = inspect.signature(getattr(jaxgin, name)).parameters
    theirs = inspect.signature(getattr(jax.lax, name)).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [(p.name, p.kind, p.default) for p in theirs.values()]


# ---------------------------------------------------------------------------------------------
# Pytrees

Pair = collections.namedtuple("Pair", "left right")


def mixed_tree(n: int, split: int):
    """Leaves of different ranks, dtypes and containers (dict, tuple, list, namedtuple, None);
    every leaf has `split` rows on axis 0 and on its last axis."""
    return {
        "a": data((n, split, 3, split), jnp.float32, 1),
        "b": (data((n, split), jnp.int32, 2), [data((n, split, 4, split), jnp.bfloat16, 3)]),
        "c": Pair(data((n, split, split), jnp.float32, 4), None),
    }


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ppermute_pytree_matches_lax(init, n):
    perm = [(i, (3 * i + 1) % n) for i in range(n) if i != 1]
    tree = mixed_tree(n, 5)
    got, want = run(mesh_of(n), lambda t: (jaxgin.ppermute(t, "x", perm), jax.lax.ppermute(t, "x", perm)), tree)
    assert_trees_same(got, want)
    assert not all(np.array_equal(g, t) for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(tree)))


@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, -1), (-1, 0), (-1, -1)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_pytree_matches_lax(init, n, tiled, split_axis, concat_axis):
    """A pytree maps over its leaves; axes count in each leaf's own rank (-1 is a different
    dimension for each leaf)."""
    tree = mixed_tree(n, 2 * n if tiled else n)

    def body(t):
        return (jaxgin.all_to_all(t, "x", split_axis, concat_axis, tiled=tiled),
                jax.lax.all_to_all(t, "x", split_axis, concat_axis, tiled=tiled))

    got, want = run(mesh_of(n), body, tree)
    assert_trees_same(got, want, f"split_axis={split_axis} concat_axis={concat_axis}")


def test_all_to_all_pytree_binds_jaxgin_per_leaf(init):
    """Every leaf goes through jaxgin's primitive (a pytree is not handed to lax)."""
    fn = jax.shard_map(lambda t: jaxgin.all_to_all(t, "x", 0, 0, tiled=True), mesh=mesh_of(4),
                       in_specs=P("x"), out_specs=P("x"))
    text = str(jax.make_jaxpr(fn)({"a": jnp.zeros((16, 2)), "b": [jnp.zeros((16,))]}))
    assert text.count("jaxgin_all_to_all") == 2 and not re.search(r"\ball_to_all\[", text)


# ---------------------------------------------------------------------------------------------
# perm: accepted and refused like lax


ACCEPTED_PERMS = {
    "list_of_lists": lambda n: [[i, (i + 1) % n] for i in range(n)],
    "tuple_of_tuples": lambda n: tuple((i, (i + 2) % n) for i in range(n)),
    "negative": lambda n: [(0, -1), (-1, 0)] + ([(1, -2)] if n > 2 else []),
    "negative_full_range": lambda n: [(-n, n - 1), (n - 1, -n)],
    "numpy_ints": lambda n: [(np.int64(0), np.int32(n - 1)), (np.int8(1), np.uint16(0))],
    "bools": lambda n: [(True, False), (False, True)],
    "empty": lambda n: [],
    "empty_tuple": lambda n: (),
}


@pytest.mark.parametrize("name", list(ACCEPTED_PERMS))
@pytest.mark.parametrize("n", [2, 4, 8])
def test_perm_accepted_like_lax(init, n, name):
    perm = ACCEPTED_PERMS[name](n)
    x = data((n, 3, 2), jnp.float32, n)
    got, want = run(mesh_of(n), lambda v: (jaxgin.ppermute(v, "x", perm), jax.lax.ppermute(v, "x", perm)), x)
    assert_same(got, want, name)


REFUSED_PERMS = {
    "zip": lambda: zip(range(4), [1, 2, 3, 0]),
    "generator": lambda: ((i, (i + 1) % 4) for i in range(4)),
    "numpy_array": lambda: np.array([[0, 1], [1, 0]]),
    "map": lambda: map(tuple, [[0, 1], [1, 0]]),
    "none": lambda: None,
    "string": lambda: "01",
    "not_pairs": lambda: [0, 1],
    "triple": lambda: [(0, 1, 2)],
    "single": lambda: [(0,)],
    "floats": lambda: [(0.0, 1.0)],
    "strings": lambda: [("0", "1")],
    "out_of_range": lambda: [(0, 4)],
    "source_out_of_range": lambda: [(4, 0)],
    "negative_out_of_range": lambda: [(0, -5)],
    "duplicate_source": lambda: [(0, 1), (0, 2)],
    "duplicate_destination": lambda: [(0, 1), (2, 1)],
    "duplicate_after_wrap": lambda: [(0, 1), (-4, 2)],
    "duplicate_in_a_permutation": lambda: [(0, 1), (1, 0), (2, 3), (3, 2), (0, 3)],
}


@pytest.mark.parametrize("name", list(REFUSED_PERMS))
def test_perm_refused_like_lax(init, name):
    """lax refuses these (some only when compiling); jaxgin refuses them while tracing, with the
    same exception type and a message that names perm."""
    mesh = mesh_of(4)
    x = jnp.zeros((4, 3))
    error = assert_both_refuse(lambda: run(mesh, lambda v: jaxgin.ppermute(v, "x", REFUSED_PERMS[name]()), x),
                               lambda: run(mesh, lambda v: jax.lax.ppermute(v, "x", REFUSED_PERMS[name]()), x))
    assert "jaxgin.ppermute" in str(error) and "perm" in str(error)
    traced = raised(lambda: jax.make_jaxpr(jax.shard_map(lambda v: jaxgin.ppermute(v, "x", REFUSED_PERMS[name]()),
                                                         mesh=mesh, in_specs=P("x"), out_specs=P("x")))(x))
    assert type(traced) is type(error), "jaxgin must refuse it while tracing, before compiling"


def test_iterator_perm_error_says_to_materialize(init):
    with pytest.raises(TypeError, match=r"perm must be a list or a tuple.*got zip.*list\(\.\.\.\)"):
        run(mesh_of(4), lambda v: jaxgin.ppermute(v, "x", zip(range(4), range(4))), jnp.zeros((4, 2)))


def test_negative_perm_binds_wrapped_indices(init):
    """Negative indices reach the primitive (and the CUDA kernel) as indices in [0, size)."""
    fn = jax.shard_map(lambda v: jaxgin.ppermute(v, "x", [(0, -1), (-1, 0)]), mesh=mesh_of(4),
                       in_specs=P("x"), out_specs=P("x"))
    assert "perm=((0, 3), (3, 0))" in str(jax.make_jaxpr(fn)(jnp.zeros((4, 2))))


@pytest.mark.parametrize("axis_name", [("a", "b"), "b"], ids=str)
def test_negative_perm_multi_axis_matches_lax(init, axis_name):
    """Negative indices over a flattened pair of mesh axes wrap over the product size."""
    n = 8 if isinstance(axis_name, tuple) else 4
    perm = [(i, -1 - i) for i in range(n)]
    x = data((2, 4, 3), jnp.float32, 5)
    got, want = run(mesh_of(8, ("a", "b"), (2, 4)),
                    lambda v: (jaxgin.ppermute(v, axis_name, perm), jax.lax.ppermute(v, axis_name, perm)), x)
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# all_to_all axes given like lax


@pytest.mark.parametrize("split_axis", [np.int64(1), np.int32(-1), True], ids=repr)
def test_all_to_all_axis_index_types_like_lax(init, split_axis):
    """split_axis / concat_axis go through operator.index, as in lax: numpy integers and bools."""
    x = data((4, 3, 8), jnp.float32, 2)
    body = lambda v: (jaxgin.all_to_all(v, "x", split_axis, 0, tiled=True),
                      jax.lax.all_to_all(v, "x", split_axis, 0, tiled=True))
    got, want = run(mesh_of(4), body, x)
    assert_same(got, want)


@pytest.mark.parametrize("split_axis, concat_axis, tiled, local",
                         [(1.0, 0, True, (8, 3)), ("0", 0, True, (8, 3)), (np.bool_(True), 0, True, (3, 8)),
                          (2, 0, True, (8, 3)), (0, -3, True, (8, 3)),
                          (1, 0, True, (8, 3)), (0, 1, False, (8, 3)), (0, 0, False, ())],
                         ids=["float", "str", "numpy_bool", "split_out_of_range", "concat_out_of_range", "not_divisible",
                              "untiled_wrong_size", "scalar"])
def test_all_to_all_refused_like_lax(init, split_axis, concat_axis, tiled, local):
    x = jnp.zeros((4, *local))

    def call(f):
        return lambda: run(mesh_of(4), lambda v: f(v, "x", split_axis, concat_axis, tiled=tiled)[None], x)

    assert_both_refuse(call(jaxgin.all_to_all), call(jax.lax.all_to_all))


# ---------------------------------------------------------------------------------------------
# axis_index_groups

GROUPS_4 = {
    "pairs": [[0, 1], [2, 3]],
    "pairs_reordered": [[3, 0], [1, 2]],
    "strided": [[0, 2], [1, 3]],
    "one_group": [[0, 1, 2, 3]],
    "one_group_reordered": [[3, 1, 0, 2]],
    "singletons": [[0], [1], [2], [3]],
}


@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0), (-1, -1)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
@pytest.mark.parametrize("groups", list(GROUPS_4))
def test_axis_index_groups_match_lax(init, groups, tiled, split_axis, concat_axis):
    axis_index_groups = GROUPS_4[groups]
    k = len(axis_index_groups[0])
    local = [3, 5]
    local[split_axis] = 3 * k if tiled else k
    x = data((4, *local), jnp.float32, 6)

    def body(v):
        return (jaxgin.all_to_all(v, "x", split_axis, concat_axis, axis_index_groups=axis_index_groups, tiled=tiled),
                jax.lax.all_to_all(v, "x", split_axis, concat_axis, axis_index_groups=axis_index_groups, tiled=tiled))

    got, want = run(mesh_of(4), body, x)
    assert_same(got, want, f"{groups} split_axis={split_axis} concat_axis={concat_axis}")


@pytest.mark.parametrize("axis_name, groups", [
    ("x", [[0, 5, 2, 7], [1, 4, 3, 6]]),
    ("x", [[7, 6], [5, 4], [0, 1], [3, 2]]),
    (("a", "b"), [[0, 5], [1, 4], [2, 7], [3, 6]]),
    (("b", "a"), [[0, 5], [1, 4], [2, 7], [3, 6]]),
    (("b", "a"), [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("b", [[0, 3], [1, 2]]),
], ids=str)
def test_axis_index_groups_match_lax_on_8_devices(init, axis_name, groups):
    """Group indices count over the flattened axis_name in the order given, as in lax."""
    mesh = mesh_of(8, ("x",)) if axis_name == "x" else mesh_of(8, ("a", "b"), (2, 4))
    k = len(groups[0])
    x = data((*mesh.devices.shape, 2 * k, 3), jnp.int32, 7)

    def body(v):
        return (jaxgin.all_to_all(v, axis_name, 0, 1, axis_index_groups=groups, tiled=True),
                jax.lax.all_to_all(v, axis_name, 0, 1, axis_index_groups=groups, tiled=True))

    got, want = run(mesh, body, x)
    assert_same(got, want)


def test_axis_index_groups_bind_jaxgin_primitives(init):
    """Grouped exchanges travel through jaxgin's primitives: one all_to_all for one group, one
    ppermute per group position otherwise (never lax's all_to_all)."""
    def jaxpr_text(groups):
        fn = jax.shard_map(lambda v: jaxgin.all_to_all(v, "x", 0, 0, axis_index_groups=groups, tiled=True),
                           mesh=mesh_of(8), in_specs=P("x"), out_specs=P("x"))
        return str(jax.make_jaxpr(fn)(jnp.zeros((64, 2))))

    several = jaxpr_text([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert several.count("jaxgin_ppermute") == 3 and "jaxgin_all_to_all" not in several
    assert not re.search(r"\ball_to_all\[", several)
    one = jaxpr_text([[7, 6, 5, 4, 3, 2, 1, 0]])
    assert one.count("jaxgin_all_to_all") == 1 and "jaxgin_ppermute" not in one


@pytest.mark.parametrize("groups", ["pairs_reordered", "one_group_reordered"])
def test_axis_index_groups_grad_matches_lax(init, groups):
    axis_index_groups = GROUPS_4[groups]
    w = data((4, 8, 3), jnp.float32, 9)

    def body(v, ww):
        def loss(f):
            return lambda u: jnp.sum(jnp.sin(f(u, "x", 0, 1, axis_index_groups=axis_index_groups, tiled=True)) * ww)

        return jax.grad(loss(jaxgin.all_to_all))(v), jax.grad(loss(jax.lax.all_to_all))(v)

    got, want = run(mesh_of(4), body, data((4, 8, 3), jnp.float32, 8), w.reshape(4, 8 // len(axis_index_groups[0]),
                                                                                   3 * len(axis_index_groups[0])))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(got != 0)


@pytest.mark.parametrize("groups, error", [
    ([[0, 1], [1, 3]], ValueError),  # an index twice, one missing
    ([[0, 1], [2, 4]], ValueError),  # out of range
    ([[0, 1, 2], [3]], ValueError),  # groups of different sizes
    ([[0.0, 1.0], [2.0, 3.0]], TypeError),
], ids=["overlap", "out_of_range", "uneven", "floats"])
def test_axis_index_groups_refused_like_lax(init, groups, error):
    x = jnp.zeros((4, 12, 3))

    def call(f):
        return lambda: run(mesh_of(4), lambda v: f(v, "x", 0, 0, axis_index_groups=groups, tiled=True), x)

    mine = assert_both_refuse(call(jaxgin.all_to_all), call(jax.lax.all_to_all))
    assert isinstance(mine, error) and "axis_index_groups" in str(mine)


def test_axis_index_groups_must_cover_the_axis(init):
    """Groups that cover only part of the axis: lax passes them to XLA, which fails compiling;
    jaxgin refuses them while tracing with a ValueError that names them."""
    x = jnp.zeros((4, 8, 3))
    call = lambda f: lambda: run(mesh_of(4), lambda v: f(v, "x", 0, 0, axis_index_groups=[[0, 1]], tiled=True), x)
    mine = assert_both_refuse(call(jaxgin.all_to_all), call(jax.lax.all_to_all), same_type=False)
    assert isinstance(mine, ValueError) and "axis_index_groups must cover all indices" in str(mine)


# ---------------------------------------------------------------------------------------------
# An empty axis_name (an axis of size 1 for lax)


@pytest.mark.parametrize("perm", [[(0, 0)], [], [(-1, 0)]], ids=str)
def test_ppermute_empty_axis_name_like_lax(init, perm):
    x = data((4, 3), jnp.float32, 1)
    got, want = run(mesh_of(4), lambda v: (jaxgin.ppermute(v, (), perm), jax.lax.ppermute(v, (), perm)), x)
    assert_same(got, want)


@pytest.mark.parametrize("tiled, local", [(True, (6, 2)), (False, (1, 2))], ids=["tiled", "untiled"])
def test_all_to_all_empty_axis_name_like_lax(init, tiled, local):
    x = data((4, *local), jnp.float32, 2)
    body = lambda v: (jaxgin.all_to_all(v, (), 0, 1, tiled=tiled), jax.lax.all_to_all(v, (), 0, 1, tiled=tiled))
    got, want = run(mesh_of(4), body, x)
    assert_same(got, want)


# ---------------------------------------------------------------------------------------------
# Outside shard_map: a vmap axis_name


VMAP_PERMS = {"ring": [(i, (i + 1) % 4) for i in range(4)], "negative": [(0, -3), (-1, 0), (1, 2), (2, 3)],
              "identity": [(i, i) for i in range(4)]}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("perm", list(VMAP_PERMS))
def test_ppermute_over_vmap_axis_matches_lax(init, perm, jit):
    """No shard_map at all: over a vmap axis_name jaxgin gives lax's result (it used to fail with
    an internal 'pvary should be called under jax.shard_map')."""
    x = {"u": data((4, 3), jnp.float32, 1), "v": [data((4,), jnp.int32, 2)]}
    ours = jax.vmap(lambda t: jaxgin.ppermute(t, "i", VMAP_PERMS[perm]), axis_name="i")
    theirs = jax.vmap(lambda t: jax.lax.ppermute(t, "i", VMAP_PERMS[perm]), axis_name="i")
    if jit:
        ours, theirs = jax.jit(ours), jax.jit(theirs)
    assert_trees_same(ours(x), theirs(x))


@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0)])
@pytest.mark.parametrize("tiled", [True, False], ids=["tiled", "untiled"])
def test_all_to_all_over_vmap_axis_matches_lax(init, tiled, split_axis, concat_axis):
    local = [3, 3]
    local[split_axis] = 8 if tiled else 4
    x = data((4, *local), jnp.float32, 3)
    op = lambda f: jax.vmap(lambda v: f(v, "i", split_axis, concat_axis, tiled=tiled), axis_name="i")(x)
    assert_same(op(jaxgin.all_to_all), op(jax.lax.all_to_all))


def test_vmap_axis_inside_shard_map_matches_lax(init):
    """A vmap axis_name nested in shard_map (check_vma=False; lax itself fails in its varying-axes
    check otherwise): lax's result for the vmap axis, jaxgin's exchange for the mesh axis."""
    n = 4
    perm = [(0, 1), (1, 0)]
    x = data((n, 2, 3), jnp.float32, 4)

    def body(v):
        over_i = lambda f: jax.vmap(lambda u: f(u, "i", perm), axis_name="i")(v)
        over_x = lambda f: jax.vmap(lambda u: f(u, "x", [(i, (i + 1) % n) for i in range(n)]), axis_name="i")(v)
        return over_i(jaxgin.ppermute), over_i(jax.lax.ppermute), over_x(jaxgin.ppermute), over_x(jax.lax.ppermute)

    a, b, c, d = run(mesh_of(n), body, x, check_vma=False)
    assert_same(a, b)
    assert_same(c, d)


def test_vmap_axis_inside_checking_shard_map_says_what_to_do(init):
    """Where lax fails with a bare AssertionError (a vmap axis inside a shard_map that checks
    varying axes), jaxgin raises an error that says how to run it."""
    body = lambda f: lambda v: jax.vmap(lambda u: f(u, "i", [(0, 1), (1, 0)]), axis_name="i")(v)
    x = jnp.zeros((4, 2, 3))
    mine = assert_both_refuse(lambda: run(mesh_of(4), body(jaxgin.ppermute), x),
                              lambda: run(mesh_of(4), body(jax.lax.ppermute), x), same_type=False)
    assert isinstance(mine, JaxginError) and "check_vma=False" in str(mine) and "'i'" in str(mine)


def test_partial_perm_over_vmap_axis(init):
    """lax's vmap rule only takes full permutations (an AssertionError otherwise); jaxgin refuses
    with a ValueError that names perm and points at shard_map."""
    x = jnp.zeros((4, 3))
    call = lambda f: lambda: jax.vmap(lambda v: f(v, "i", [(0, 1)]), axis_name="i")(x)
    mine = assert_both_refuse(call(jaxgin.ppermute), call(jax.lax.ppermute), same_type=False)
    assert isinstance(mine, ValueError) and "perm" in str(mine) and "jax.shard_map" in str(mine)


def test_axis_index_groups_over_vmap_axis(init):
    """lax has no axis_index_groups over a vmap axis either; jaxgin says NotImplementedError,
    naming it."""
    x = jnp.zeros((4, 4))
    call = lambda f: lambda: jax.vmap(lambda v: f(v, "i", 0, 0, axis_index_groups=[[0, 1], [2, 3]]), axis_name="i")(x)
    mine = assert_both_refuse(call(jaxgin.all_to_all), call(jax.lax.all_to_all), same_type=False)
    assert isinstance(mine, NotImplementedError) and "axis_index_groups" in str(mine)


# ---------------------------------------------------------------------------------------------
# Unbound axis names


@pytest.mark.parametrize("op", ["ppermute", "all_to_all"])
def test_unbound_axis_lists_the_bound_ones(init, op):
    """NameError naming the unbound axis and listing those bound (lax: a NameError for all_to_all,
    a bare AssertionError for ppermute)."""
    mesh = mesh_of(8, ("a", "b"), (2, 4))
    call = {"ppermute": lambda m: lambda v: m.ppermute(v, ("a", "c"), [(0, 1)]),
            "all_to_all": lambda m: lambda v: m.all_to_all(v, ("a", "c"), 0, 0, tiled=True)}[op]
    x = jnp.zeros((2, 4, 8, 3))
    mine = assert_both_refuse(lambda: run(mesh, call(jaxgin), x), lambda: run(mesh, call(jax.lax), x),
                              same_type=op == "all_to_all")
    assert isinstance(mine, NameError)
    assert "axis_name 'c' is not bound" in str(mine) and "bound axis names here: 'a', 'b'" in str(mine)
    assert "jax.shard_map" in str(mine)


def test_unbound_axis_inside_vmap_lists_it(init):
    with pytest.raises(NameError, match=r"'x' is not bound.*bound axis names here: 'i'"):
        jax.vmap(lambda v: jaxgin.ppermute(v, "x", [(0, 1)]), axis_name="i")(jnp.zeros((4, 3)))


def test_no_axis_bound_at_all(init):
    """Outside shard_map and vmap: NameError saying nothing is bound and to use jax.shard_map."""
    for call in (lambda: jaxgin.ppermute(jnp.ones(3), "x", [(0, 1)]),
                 lambda: jax.jit(lambda v: jaxgin.all_to_all(v, "x", 0, 0))(jnp.ones(4))):
        with pytest.raises(NameError, match=r"'x' is not bound \(nothing binds 'x' here; no axis name is bound "
                                            r"here\).*jax\.shard_map"):
            call()


def test_mesh_axis_not_manual_in_this_shard_map(init):
    """A mesh axis the shard_map is not manual over: the message says so (lax: NameError too)."""
    mesh = mesh_of(8, ("a", "b"), (2, 4))

    def call(f):
        fn = jax.shard_map(lambda v: f(v, "b", 0, 0, tiled=True), mesh=mesh, in_specs=P("a"), out_specs=P("a"),
                           axis_names={"a"})
        return lambda: jax.jit(fn)(jnp.zeros((8, 4)))

    mine = assert_both_refuse(call(jaxgin.all_to_all), call(jax.lax.all_to_all))
    assert "'b' is an axis of the mesh ('a', 'b') but the enclosing jax.shard_map is not manual over it" in str(mine)
    assert "bound axis names here: 'a'" in str(mine)


def test_mailbox_ops_share_the_unbound_axis_message(init):
    """put_signal / wait_signal take their axis check from jaxgin/ffi/axes.py: the same message."""
    box = jaxgin.Mailbox("test_collectives::unbound", (3,), jnp.float32)
    with pytest.raises(NameError, match=r"jaxgin.put_signal: axis_name 'y' is not bound.*bound axis names here: 'x'"):
        run(mesh_of(4), lambda v: jaxgin.put_signal(v[0], box, 0, axis_name="y").values[0][None], jnp.zeros((4, 1, 3)))
