"""jaxgin.mailbox in reference mode (CPU, emulated devices): the protocol checks and Mailbox's
arguments.

Every misuse that faults on a GPU (a wait that finds fewer puts than its count, a
wait_signal_from whose sender has no put waiting, a second put before the receiver's wait, a
traced peer or source out of range) must fail when the program runs, with a message naming the
op, the mailbox, the ranks and the counts; correct programs must still equal jax.lax.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin

N = 4


@pytest.fixture(autouse=True)
def drain_failed_callbacks():
    """A program whose check raised leaves its error with JAX, which raises it once more at the
    next jax.effects_barrier() (JAX does so for every failed callback); take it here so that it
    does not surface in a later, unrelated test."""
    yield
    try:
        jax.effects_barrier()
    except Exception:
        pass


@pytest.fixture
def init():
    jaxgin.initialize()
    assert jaxgin.info()["backend"] == "reference"


def box_for(request, shape=(3,), dtype=jnp.float32) -> jaxgin.Mailbox:
    return jaxgin.Mailbox(f"test_mailbox::{request.node.name}", shape, dtype)


def run(body, x, n: int = N):
    """body(local [*shape]) on n devices under jit + shard_map; outputs come back [n, ...]."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))

    def wrapped(v):
        return jax.tree.map(lambda o: o[None], body(v[0]))

    fn = jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    return jax.tree.map(np.asarray, fn(x))


def misuse(body, x, n: int = N) -> str:
    """The message of the error running body raises (it must raise)."""
    with pytest.raises(jax.errors.JaxRuntimeError) as excinfo:
        run(body, x, n)
    text = str(excinfo.value)
    assert "JaxginError: " in text, text
    return text.split("JaxginError: ")[-1]


def values(n: int = N, shape=(3,)):
    return jnp.arange(n * int(np.prod(shape)), dtype=jnp.float32).reshape(n, *shape) + 1


# ---------------------------------------------------------------------------------------------
# Correct programs still equal lax


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_equals_ppermute(init, request, n):
    box = box_for(request, (5,))

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % n, axis_name="x")
        got = jaxgin.wait_signal(box, 1, axis_name="x", after=token)[(me - 1) % n]
        return got, jax.lax.ppermute(v, "x", [(i, (i + 1) % n) for i in range(n)])

    got, want = run(body, values(n, (5,)), n)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, np.asarray(values(n, (5,))))  # data moved


def test_rounds_in_a_loop_equal_ppermute(init, request):
    """put then wait, again and again (fori_loop): each wait frees the slot for the next put."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")

        def step(_, v):
            token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
            return jaxgin.wait_signal_from(box, (me - 1) % N, axis_name="x", after=token)

        twice = step(0, step(0, v))  # two rounds in one body: the second put follows a wait
        return jax.lax.fori_loop(0, 3, step, v), twice

    looped, twice = run(body, values())
    np.testing.assert_array_equal(looped, np.roll(np.asarray(values()), 3, axis=0))
    np.testing.assert_array_equal(twice, np.roll(np.asarray(values()), 2, axis=0))


# ---------------------------------------------------------------------------------------------
# Misuses: each raises naming the op, the mailbox, ranks and counts


def test_wait_for_more_puts_than_arrive(init, request):
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        return jaxgin.wait_signal(box, 2, axis_name="x", after=token)

    message = misuse(body, values())
    assert message.startswith(f"jaxgin.wait_signal at rank 0 of axis 'x': waited for 2 puts into mailbox {box.name!r}")
    assert "but only 1 arrived (from ranks [3])" in message and "On a GPU this wait times out" in message


def test_wait_twice_on_one_put(init, request):
    """The first wait took the put; the second finds nothing (on a GPU it times out)."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        first = jaxgin.wait_signal(box, 1, axis_name="x", after=token)
        return first + jaxgin.wait_signal(box, 1, axis_name="x", after=token)

    message = misuse(body, values())
    assert "jaxgin.wait_signal at rank 0" in message and "waited for 1 puts" in message
    assert "only 0 arrived (from ranks [])" in message and "an earlier wait took their puts" in message


def test_wait_signal_from_a_source_that_never_puts(init, request):
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        return jaxgin.wait_signal_from(box, (me + 1) % N, axis_name="x", after=token)  # the right one never puts here

    message = misuse(body, values())
    assert message.startswith(
        f"jaxgin.wait_signal_from at rank 0 of axis 'x', peer rank 1: that sender's next put into mailbox {box.name!r} "
        "never arrived (puts of rank 1 waiting here: 0, needed: 1; ranks with a put waiting here: [3])"
    ), message


@pytest.mark.parametrize("waits", ["one wait", "two waits"])
def test_second_put_before_the_receivers_wait(init, request, waits):
    """Two puts from each sender into the same receiver's mailbox before its wait: on a GPU the
    second waits for the receiver's credit and times out; here it fails at that put."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        first = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        second = jaxgin.put_signal(v * 2, box, (me + 1) % N, axis_name="x")
        if waits == "one wait":
            return jaxgin.wait_signal(box, 1, axis_name="x", after=[first, second])
        return jaxgin.wait_signal(box, 1, axis_name="x", after=first) + jaxgin.wait_signal(box, 1, axis_name="x", after=second)

    message = misuse(body, values())
    assert message.startswith(
        f"jaxgin.put_signal at rank 3 of axis 'x', peer rank 0: the receiver never consumed this rank's previous put "
        f"into mailbox {box.name!r} before this one (puts of rank 3 waiting there: 1, at most 1 allowed, this put makes 2)"
    ), message
    assert "on a GPU this put waits for that credit and times out" in message


def test_second_put_found_by_the_wait_when_the_puts_come_from_other_bodies(init, request):
    """Tokens made in another traced body (here returned from inner jits): the wait that gets both
    still sees the two puts of one sender."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        put = jax.jit(lambda u: jaxgin.put_signal(u, box, (me + 1) % N, axis_name="x"))
        return jaxgin.wait_signal(box, 1, axis_name="x", after=[put(v), put(v * 2)])

    message = misuse(body, values())
    assert message.startswith("jaxgin.put_signal at rank 3 of axis 'x', peer rank 0: the receiver never consumed")
    assert "found by jaxgin.wait_signal on rank 0, whose after= holds both puts" in message


@pytest.mark.parametrize("op, index", [("put_signal", 4), ("wait_signal_from", -1)])
def test_traced_index_out_of_range(init, request, op, index):
    """A traced peer / source out of range on one device (rank 1): the GPU's wording."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        bad = jnp.where(me == 1, index, (me + 1) % N)
        if op == "put_signal":
            return jaxgin.wait_signal(box, 0, axis_name="x", after=jaxgin.put_signal(v, box, bad, axis_name="x"))
        token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        return jaxgin.wait_signal_from(box, jnp.where(me == 1, index, (me - 1) % N), axis_name="x", after=token)

    message = misuse(body, values())
    name = "peer" if op == "put_signal" else "source"
    assert message.startswith(
        f"jaxgin.{op} at rank 1 of axis 'x': {name} index {index} is out of range: the mesh axis has 4 devices, "
        f"so it must be in [0, 4) (mailbox {box.name!r}"
    ), message


def test_put_left_unconsumed_is_not_an_error(init, request):
    """A GPU does not fault on a put no wait takes (only a later put to that receiver would wait
    for it), so neither does reference mode."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, (me + 1) % N, axis_name="x")
        return token.values[1]

    arrived = run(body, values())
    np.testing.assert_array_equal(arrived, np.roll(np.eye(N, dtype=np.int32), -1, axis=1))  # row d: from d - 1


def test_a_misuse_on_one_device_stops_every_device(init, request):
    """Only rank 2 waits for a put that never comes; the others go on to a collective. All stop
    together (no device is left waiting for rank 2 in the all_gather) and the error names rank 2."""
    box = box_for(request)

    def body(v):
        me = jax.lax.axis_index("x")
        token = jaxgin.put_signal(v, box, jnp.where(me == 1, 1, (me + 1) % N), axis_name="x")
        got = jaxgin.wait_signal(box, 1, axis_name="x", after=token)
        return jax.lax.all_gather(got, "x")

    message = misuse(body, values())
    assert message.startswith("jaxgin.wait_signal at rank 2 of axis 'x': waited for 1 puts"), message
    assert "only 0 arrived" in message


STARVED_WAIT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import jaxgin

jaxgin.initialize()
box = jaxgin.Mailbox("ring", shape=(8,), dtype=jnp.float32)

def step(block):
    me = jax.lax.axis_index("x")
    token = jaxgin.put_signal(block[0], box, peer=(me + 1) % 4, axis_name="x")
    return jaxgin.wait_signal(box, count=2, axis_name="x", after=token)[None]

f = jax.jit(jax.shard_map(step, mesh=Mesh(np.array(jax.devices()), ("x",)), in_specs=P("x"), out_specs=P("x")))
if sys.argv[1] == "caught":
    try:
        np.asarray(f(jnp.zeros((4, 8))))
    except jax.errors.JaxRuntimeError:
        print("caught")
else:
    np.asarray(f(jnp.zeros((4, 8))))
"""
STARVED_MESSAGE = ("jaxgin.wait_signal at rank 0 of axis 'x': waited for 2 puts into mailbox 'ring' but only 1 "
                   "arrived (from ranks [3])")


def _starve(how: str):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, "-c", STARVED_WAIT, how], capture_output=True, text=True, timeout=300,
                          env=env)


def test_a_starved_wait_ending_the_program_says_so_once():
    """Every device raises the check's error, and JAX would log each and raise it again at exit:
    the user sees it once, as the JaxRuntimeError that ended the program, naming the mailbox."""
    out = _starve("uncaught")
    assert out.returncode == 1
    assert out.stderr.count(STARVED_MESSAGE) == 1, out.stderr
    assert "jax.pure_callback failed" not in out.stderr and "atexit" not in out.stderr, out.stderr
    assert out.stderr.rstrip().splitlines()[-1].startswith(f"JaxginError: {STARVED_MESSAGE}"), out.stderr


def test_a_starved_wait_caught_and_left_is_said_at_exit_in_one_line():
    """A program that caught the error and never called jax.effects_barrier() hears of it once more
    at exit (JAX raises it there): one line, not a traceback."""
    out = _starve("caught")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "caught\n"
    assert out.stderr.startswith(f"jaxgin: a program failed a reference-mode check: {STARVED_MESSAGE}"), out.stderr
    assert len(out.stderr.splitlines()) == 1, out.stderr


# ---------------------------------------------------------------------------------------------
# Mailbox arguments


def test_int_shape_is_a_1d_shape(request):
    box = jaxgin.Mailbox(f"test_mailbox::{request.node.name}", shape=8, dtype=jnp.float32)
    assert box.shape == (8,) and box.nbytes == 32
    assert jaxgin.Mailbox(box.name, (8,), jnp.float32) == box


@pytest.mark.parametrize(
    "shape, error, says",
    [("8", TypeError, "got str '8'"), ((2, 1.5), TypeError, "1.5 is not an int"), (None, TypeError, "got NoneType"),
     ((2, -1), ValueError, "negative dimension")],
)
def test_bad_shape_names_shape(request, shape, error, says):
    with pytest.raises(error, match=re.escape(says)) as excinfo:
        jaxgin.Mailbox(f"test_mailbox::{request.node.name}", shape, jnp.float32)
    assert "shape must be an int or a sequence of non-negative ints" in str(excinfo.value)


@pytest.mark.parametrize("dtype", ["not-a-dtype", object, str])
def test_bad_dtype_names_dtype_and_choices(request, dtype):
    with pytest.raises(TypeError, match="dtype must be a numeric or bool dtype such as jnp.float32"):
        jaxgin.Mailbox(f"test_mailbox::{request.node.name}", (4,), dtype)


@pytest.mark.parametrize("op", ["put_signal", "wait_signal", "wait_signal_from"])
def test_mailbox_ops_over_a_vmap_axis_say_to_use_shard_map(op):
    """A vmap axis name is not a set of devices: the ops refuse it while tracing, naming shard_map."""
    box = jaxgin.Mailbox(f"vmap_{op}", (4,), jnp.float32)

    def body(v):
        if op == "put_signal":
            return jaxgin.put_signal(v, box, peer=0, axis_name="v")
        if op == "wait_signal":
            return jaxgin.wait_signal(box, 1, axis_name="v", after=())
        return jaxgin.wait_signal_from(box, 0, axis_name="v", after=())

    with pytest.raises(jaxgin.JaxginError, match=rf"jaxgin\.{op}: axis_name 'v' is bound by jax\.vmap.*jax\.shard_map"):
        jax.vmap(body, axis_name="v")(jnp.zeros((2, 4), jnp.float32))
