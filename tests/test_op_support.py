"""jaxgin.op_support, what every op shares: the one placement cache and the heap's zero invariant
(a region is zeroed before the allocator hands it out again), on CPU with a fake CUDA runtime."""

import dataclasses
import types

import numpy as np
import pytest

import jaxgin
from jaxgin import op_support, runtime
from jaxgin.errors import JaxginError


class _ClearingRuntime:
    """Records what the heap clears; `fail` makes clearing fail as a barrier that timed out would,
    `faults` is what device_faults() says (a fault recorded before)."""

    def __init__(self, fail: Exception | None = None):
        self.cleared, self.fail, self.faults = [], fail, ""

    def heap_clear(self, offset, nbytes):
        if self.fail is not None:
            raise self.fail
        self.cleared.append((offset, nbytes))

    def destroy(self):
        pass

    def device_faults(self):
        return self.faults


@pytest.fixture
def cuda_state():
    """jaxgin in reference mode dressed up as the cuda backend, with a runtime that records clears."""
    jaxgin.initialize()
    state = runtime.current()
    state.options = dataclasses.replace(state.options, backend="cuda")
    state.runtime = _ClearingRuntime()
    yield state
    state.runtime = None
    jaxgin.finalize()


def test_placed_places_once_per_key_and_keeps_it():
    state = types.SimpleNamespace(placements={})
    calls = []

    def place(tag):
        calls.append(tag)
        return tag * 10

    assert op_support.placed(state, ("op", 1), lambda: place(1)) == 10
    assert op_support.placed(state, ("op", 1), lambda: place(2)) == 10  # kept: programs baked its offsets in
    assert op_support.placed(state, ("op", 2), lambda: place(3)) == 30
    assert calls == [1, 3]


def test_placement_does_not_clear(cuda_state):
    """A fresh placement is zero already; clearing it could erase what a faster peer put there."""
    a = op_support.placed(cuda_state, ("op",), lambda: op_support.heap_array(cuda_state, (64,), np.int64))
    assert a.shape == (64,) and a.dtype == np.int64 and a.nbytes == 512 and a.offset % 256 == 0
    assert cuda_state.runtime.cleared == []


def test_freeing_a_tritongin_buffer_zeroes_it_before_reuse(cuda_state):
    import tritongin

    heap_free = cuda_state.heap.available()
    buf = tritongin.empty((100,), "float32")
    buf.free()
    assert cuda_state.runtime.cleared == [(buf.offset, 400)]
    assert cuda_state.heap.available() == heap_free
    again = tritongin.empty((50,), "int32")
    assert again.offset == buf.offset  # the zeroed bytes are handed out again
    with pytest.raises(JaxginError, match="freed"):
        buf.free()


def test_a_region_that_cannot_be_zeroed_is_never_reused(cuda_state):
    """After a device fault nothing can be zeroed: free() says nothing more (the fault was raised
    where it happened) and keeps the region out of the allocator."""
    import tritongin

    buf = tritongin.empty((100,), "float32")
    heap_free = cuda_state.heap.available()
    cuda_state.runtime.faults = "wait timed out on rank 0"
    buf.free()
    assert cuda_state.runtime.cleared == [] and buf.freed
    assert cuda_state.heap.available() == heap_free  # kept out of the allocator
    cuda_state.runtime.faults = ""
    assert tritongin.empty((100,), "float32").offset != buf.offset


def test_a_free_that_fails_names_the_region_and_the_rule(cuda_state):
    """The zeroing waits for every rank (csrc/ffi/heap_free.cu); a peer that never frees ends it in
    the barrier's timeout, a device fault that free() raises naming the region and the order rule."""
    import tritongin
    from jaxgin import _jaxgin_ext as ext

    buf = tritongin.empty((100,), "float32")
    heap_free = cuda_state.heap.available()
    cuda_state.runtime.fail = ext.DeviceFaultError("barrier timed out after 10 s on rank 0")
    with pytest.raises(jaxgin.DeviceFault, match=rf"freeing heap bytes \[{buf.offset}, {buf.offset + 400}\) failed "
                       r"\(every rank frees its heap buffers in the same order.*barrier timed out"):
        buf.free()
    assert buf.freed and cuda_state.heap.available() == heap_free
    with pytest.raises(JaxginError, match="freed"):
        buf.free()


def test_lowering_for_kernels_in_reference_mode_names_the_op():
    jaxgin.initialize()
    try:
        assert op_support.kernel_state() is None
        with pytest.raises(JaxginError, match="jaxgin.put_signal: this program was traced for the cuda backend"):
            op_support.lowering_state("jaxgin.put_signal")
    finally:
        jaxgin.finalize()


class _InfoRuntime:
    def __init__(self, gin_contexts: int, lsa_size: int):
        self.info = {"gin_contexts": gin_contexts, "lsa_size": lsa_size}

    def device_info(self, index):
        return dict(self.info)


@pytest.mark.parametrize("gin_contexts, lsa_size, world, force_gin, expected", [
    (4, 2, 2, False, False),  # one host: every peer is an NVLink peer
    (4, 1, 2, False, True),  # two hosts of one GPU each
    (4, 4, 8, False, True),  # two hosts of four GPUs
    (4, 2, 2, True, True),  # one host, GIN forced
    (0, 1, 2, False, False),  # no GIN at all: nothing to stage puts for
])
def test_gin_in_job_says_whether_staging_areas_are_needed(gin_contexts, lsa_size, world, force_gin, expected):
    """The MoE kernels compile their GIN paths and place send areas only when some GPU of the job
    reaches another through GIN; every process must agree (heap offsets), so the answer depends on
    job-wide facts only."""
    state = types.SimpleNamespace(runtime=_InfoRuntime(gin_contexts, lsa_size), world_size=world,
                                  options=types.SimpleNamespace(force_gin=force_gin))
    assert op_support.gin_in_job(state) is expected
