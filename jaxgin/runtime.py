"""jaxgin's lifetime in a process: initialize(), finalize(), info().

On GPUs, initialize() brings up, for every GPU this process drives, an NCCL communicator, a
symmetric heap registered as an NCCL window, an NCCL device communicator and the device-resident
context kernels receive. Ranks follow JAX's global device order (``jax.devices()``), so the
device at index i of a 1-D ``Mesh`` over ``jax.devices()`` is rank i. With several processes the
NCCL unique id travels through the ``jax.distributed`` key-value store.

On a CPU backend it selects the reference mode: no NCCL, and every jaxgin op lowers to pure JAX.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
import warnings
from typing import Any

import jax
from jax._src import distributed

from jaxgin import cupti as cupti_lib
from jaxgin import fault_watch as fault_watch_lib
from jaxgin import heap as heap_lib
from jaxgin import nccl as nccl_lib
from jaxgin import rdma, settings
from jaxgin.ffi import capture, op_table, targets
from jaxgin.errors import DeviceFault, JaxginError, NcclError, NotInitializedError, install_command
from jaxgin.sizes import parse_size

BACKENDS = ("cuda", "reference")
GIN_TYPES = {0: "none", 2: "proxy", 3: "gdaki", 4: "gpi", 5: "efa_gda"}
DEFAULT_HEAP_SIZE = "1GiB"
# DEFAULT_TIMEOUT_S, DEFAULT_MAX_QUEUED_CALLS and DEFAULT_CHANNEL_SLOT_BYTES are their settings'
# defaults (jaxgin.settings), parsed.
DEFAULT_TIMEOUT_S = float(settings.BY_NAME["JAXGIN_TIMEOUT"].default)
# $JAXGIN_MAX_QUEUED_CALLS's default and largest value (the op table's, which the C++ compiles with).
DEFAULT_MAX_QUEUED_CALLS = int(settings.BY_NAME["JAXGIN_MAX_QUEUED_CALLS"].default)
MAX_QUEUED_CALLS_LIMIT = op_table.CONSTANTS["max_queued_calls_limit"]
MIN_USER_HEAP_BYTES = 1 << 20  # below this no op has room for its buffers
@dataclasses.dataclass(frozen=True)
class ChannelShape:
    """The exchange channel behind ppermute / all_to_all: per ordered pair of ranks, `lanes`
    parallel streams with `slots` ring slots of `slot_bytes` each (in the receiver's heap)."""

    lanes: int
    slots: int
    slot_bytes: int


DEFAULT_CHANNEL_SLOTS = 2
DEFAULT_CHANNEL_SLOT_BYTES = parse_size(settings.BY_NAME["JAXGIN_CHANNEL_SLOT_BYTES"].default)


def default_channel_lanes(world_size: int) -> int:
    """Enough lanes that an all_to_all keeps ~64 CTAs sending (NVLink needs many SMs storing)."""
    target = 64 // max(1, world_size - 1)
    lanes = 1
    while lanes * 2 <= target:
        lanes *= 2
    return min(32, max(4, lanes))


def channel_shape(world_size: int) -> ChannelShape:
    """Defaults, overridable for tuning with JAXGIN_CHANNEL_LANES / JAXGIN_CHANNEL_SLOT_BYTES."""
    lanes = settings.get("JAXGIN_CHANNEL_LANES") or default_channel_lanes(world_size)
    slot = settings.get("JAXGIN_CHANNEL_SLOT_BYTES")
    try:
        lanes = int(lanes)
    except ValueError:
        raise ValueError(f"JAXGIN_CHANNEL_LANES={lanes!r} is not an integer") from None
    if not 1 <= lanes <= 64:
        raise ValueError(f"JAXGIN_CHANNEL_LANES={lanes} must be in [1, 64]")
    slot_bytes = parse_size(slot, "JAXGIN_CHANNEL_SLOT_BYTES")
    if slot_bytes % 16:
        raise ValueError(f"JAXGIN_CHANNEL_SLOT_BYTES={slot!r} must be a multiple of 16 bytes")
    return ChannelShape(lanes, DEFAULT_CHANNEL_SLOTS, slot_bytes)


# Small messages between NVLink peers travel as 16-byte lines (8 payload bytes, two flag copies);
# each sender has `slots` line slots of twice JAXGIN_LINE_MAX_BYTES at every receiver.
LINE_MAX_BYTES = op_table.CONSTANTS["line_max_bytes"]  # JAXGIN_LINE_MAX_BYTES in C++, from the op table
LINE_SLOT_BYTES = 2 * LINE_MAX_BYTES


def reserved_bytes(signal_count: int, barrier_slots: int, world_size: int = 1, channel: ChannelShape | None = None) -> int:
    """Heap bytes jaxgin keeps for itself: signal counters, the exchange channel's rings, GIN
    staging and line slots (mirrors jaxgin_reserved_bytes in C++)."""
    channel = channel or channel_shape(world_size)
    signals = signal_count + barrier_slots + 2 * world_size * channel.lanes
    signal_area = (signals * 8 + 4095) // 4096 * 4096
    rings = world_size * channel.lanes * channel.slots * channel.slot_bytes
    staging = world_size * channel.lanes * channel.slot_bytes
    lines = world_size * channel.slots * LINE_SLOT_BYTES
    return signal_area + rings + staging + lines


@dataclasses.dataclass(frozen=True)
class Options:
    heap_bytes: int
    signal_count: int
    barrier_slots: int
    force_gin: bool
    gin_transport: str  # as requested: 'auto', 'host' (jaxgin's NCCL RMA plugin) or 'nic'
    timeout_s: float
    backend: str
    channel: ChannelShape


FAULT_CLEANUP_COMPLETE = "all of NCCL's GPU memory"


@dataclasses.dataclass
class _State:
    options: Options
    devices: list[jax.Device]  # all devices, in rank order
    local_devices: list[jax.Device]  # this process's, in rank order
    generation: int
    nccl: nccl_lib.NcclInstall | None = None
    runtime: Any = None  # jaxgin._jaxgin_ext.Runtime on the cuda backend
    backend_lib: Any = None  # jaxgin._jaxgin_ext.Backend on the cuda backend
    runtime_backend_path: str | None = None
    heap: heap_lib.RangeAllocator | None = None  # user area of the symmetric heap
    signals: heap_lib.RangeAllocator | None = None  # user signals
    fault_watch: Any = None  # fault_watch.FaultWatch on the cuda backend
    placements: dict = dataclasses.field(default_factory=dict)  # op configuration -> its heap buffers (op_support.placed)
    gin_transport: str = "none"  # in use: 'host', 'nic', or 'none' in reference mode
    # What finalize() can return after a device fault: FAULT_CLEANUP_COMPLETE, or why only the heaps.
    fault_cleanup: str = FAULT_CLEANUP_COMPLETE
    # Whether calls lower to the targets XLA may record into command buffers, and why
    # (jaxgin.ffi.capture.policy); whether some program did.
    capture: tuple[bool, str] | None = None
    captured_lowered: bool = False

    @property
    def world_size(self) -> int:
        return len(self.devices)


_state: _State | None = None
_generation = 0
_backends: dict[str, Any] = {}


def _resolve_options(heap_size, signal_count, barrier_slots, force_gin, timeout, backend, gin_transport=None) -> Options:
    from jaxgin import transport as transport_lib  # see the note above initialize()

    if backend is None:
        backend = "cuda" if jax.default_backend() == "gpu" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS} or None (chosen from JAX's default backend)")
    if backend == "cuda" and jax.default_backend() != "gpu":
        raise JaxginError(
            f"backend='cuda' needs NVIDIA GPUs visible to JAX, but jax.default_backend() is "
            f"{jax.default_backend()!r}; install JAX's CUDA plugin ({install_command('cuda')}) or use "
            "backend='reference'"
        )
    if force_gin is None:
        force_gin = bool(settings.flag("JAXGIN_FORCE_GIN"))
    gin_transport = transport_lib.requested(gin_transport)
    if timeout is None:
        raw = settings.get("JAXGIN_TIMEOUT")
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"JAXGIN_TIMEOUT={raw!r} is not a number of seconds") from None
        source = "JAXGIN_TIMEOUT"
    else:
        source = "timeout"
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{source} must be a positive number of seconds, got {timeout!r}")
    for name, value in (("signal_count", signal_count), ("barrier_slots", barrier_slots)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
            raise ValueError(f"{name} must be an int in [1, 1048576], got {value!r}")
    heap_bytes = parse_size(heap_size)
    world = len(jax.devices())
    channel = channel_shape(world)
    reserved = reserved_bytes(signal_count, barrier_slots, world, channel)
    if heap_bytes < reserved + MIN_USER_HEAP_BYTES:
        raise ValueError(
            f"heap_size={heap_size!r} ({heap_bytes} bytes) is too small: jaxgin reserves {reserved} bytes of it for "
            f"{signal_count} signals, {barrier_slots} barrier slots and the exchange channel of {world} devices, "
            f"and needs {MIN_USER_HEAP_BYTES} more for data; use at least {reserved + MIN_USER_HEAP_BYTES} bytes"
        )
    return Options(
        heap_bytes, signal_count, barrier_slots, bool(force_gin), gin_transport, float(timeout), backend, channel
    )


def _extension():
    try:
        from jaxgin import _jaxgin_ext  # compiled at install; reference mode runs without it
    except ImportError as e:
        raise JaxginError(
            f"jaxgin's compiled extension is missing ({e}); reinstall jaxgin with: {install_command('cuda')}"
        ) from None
    return _jaxgin_ext


def load_backend(nccl: nccl_lib.NcclInstall, arch: str):
    """Builds (cached) and loads the CUDA backend for `nccl` and `arch`; loads once per process.

    JAXGIN_BACKEND may name a prebuilt libjaxgin_backend.so instead; the backend itself refuses
    to run when it was compiled against other NCCL headers than the loaded library's.
    """
    from jaxgin import build as build_lib  # see the note above initialize()

    path = settings.get("JAXGIN_BACKEND") or str(build_lib.build(nccl, arch).backend)
    if path not in _backends:
        try:
            _backends[path] = _extension().Backend(path)
        except RuntimeError as e:
            raise JaxginError(str(e)) from None
    return _backends[path]


def loaded_backends() -> list[str]:
    """The CUDA backend libraries this process has loaded (they stay loaded after finalize());
    empty where jaxgin ran only in reference mode."""
    return sorted(_backends)


def _unique_id(backend, generation: int, nccl_version: str) -> bytes:
    """NCCL's unique id, made by process 0 and shared through jax.distributed's key-value store,
    after every process agreed on the NCCL version (_agree_on_nccl)."""
    if jax.process_count() == 1:
        return backend.unique_id()
    client = distributed.global_state.client
    if client is None:
        raise JaxginError(
            f"JAX runs {jax.process_count()} processes but jax.distributed has no client; call "
            "jax.distributed.initialize() before jaxgin.initialize()"
        )
    timeout_ms = int(float(settings.get_as_set("JAXGIN_BOOTSTRAP_TIMEOUT")) * 1000)
    _agree_on_nccl(client, generation, jax.process_index(), nccl_version, timeout_ms)
    key = f"jaxgin/nccl_unique_id/{generation}"
    if jax.process_index() == 0:
        uid = backend.unique_id()
        client.key_value_set_bytes(key, uid)
        return uid
    return client.blocking_key_value_get_bytes(key, timeout_ms)


def _agree_on_nccl(client, generation: int, process_index: int, version: str, timeout_ms: int) -> None:
    """Every process must load the same NCCL: the device API's structures (ncclDevComm, windows)
    change between releases, so kernels built against one and a peer running another would
    misread each other. Process 0 publishes its version; the others compare before any
    communicator exists, and fail with both versions named."""
    key = f"jaxgin/nccl_version/{generation}"
    if process_index == 0:
        client.key_value_set_bytes(key, version.encode())
        return
    theirs = client.blocking_key_value_get_bytes(key, timeout_ms).decode()
    if theirs != version:
        raise NcclError(
            f"process {process_index} loaded NCCL {version} but process 0 loaded NCCL {theirs}; every process of a "
            "jaxgin job must load the same NCCL (install the same nvidia-nccl-cu13 version in every "
            "process's environment)"
        )


# jaxgin.build and jaxgin.transport are commands as well (python -m jaxgin.build): imported by
# `import jaxgin`, runpy would find them loaded before running them and warn, so they are imported
# where they are used.
def initialize(
    *,
    heap_size: int | str = DEFAULT_HEAP_SIZE,
    signal_count: int = 1024,
    barrier_slots: int = 256,
    force_gin: bool | None = None,
    timeout: float | None = None,
    backend: str | None = None,
    gin_transport: str | None = None,
) -> None:
    """Brings jaxgin up on every device of this process. Idempotent for the same arguments.

    Args:
      heap_size: symmetric heap per GPU (bytes or a string such as '512MiB'); every op's
        communication buffers live in it. Default 1GiB.
      signal_count: signals per GPU available to ops and kernels.
      barrier_slots: CTAs per kernel that may call the device-side barrier.
      force_gin: route every peer, same-host ones included, through GIN (tests the GIN path).
        Default from JAXGIN_FORCE_GIN. Fails when NCCL reports no GIN.
      gin_transport: what carries GIN traffic: 'nic' (NCCL's own backends, which need an RDMA
        NIC), 'host' (jaxgin's NCCL RMA plugin: CUDA IPC copies within a host, TCP across hosts;
        needs NCCL >= 2.30 and must be chosen before the process's first NCCL communicator) or
        'auto' ('host' when force_gin is set and there is no RDMA device, else 'nic'). Default
        from JAXGIN_GIN_TRANSPORT, else 'auto'. See jaxgin.transport.
      timeout: seconds any device-side wait may take before the program fails with an error
        naming the op, rank, peer and signal. Default from JAXGIN_TIMEOUT, else 30.
      backend: 'cuda' or 'reference'; default: 'cuda' when JAX's default backend is a GPU.

    With several processes, call jax.distributed.initialize() first; every process must call
    initialize() with the same arguments.
    """
    global _state, _generation
    options = _resolve_options(heap_size, signal_count, barrier_slots, force_gin, timeout, backend, gin_transport)
    if _state is not None:
        if _state.options == options:
            return
        raise JaxginError(
            f"jaxgin is already initialized with {_state.options}; call jaxgin.finalize() before initializing "
            f"again with {options}"
        )
    devices = list(jax.devices())
    local_devices = [d for d in devices if d.process_index == jax.process_index()]
    state = _State(options, devices, local_devices, _generation)
    # Settings the GPU path reads fail before anything is made, in reference mode too.
    grace_s = _fault_grace_s()
    _max_queued_calls()
    if options.backend == "cuda":
        from jaxgin import build as build_lib  # see the note above initialize()
        from jaxgin import transport as transport_lib

        state.nccl = nccl_lib.load()
        arch = build_lib.arch_for(local_devices[0].compute_capability)
        backend_lib = load_backend(state.nccl, arch)
        state.gin_transport = transport_lib.choose(options.gin_transport, options.force_gin, state.nccl.version)
        if state.gin_transport == "host":
            transport_lib.enable(transport_lib.build())
        ext = _extension()
        # The record of NCCL's allocations that lets a fault's cleanup return them (through CUPTI).
        record_vmm_calls = settings.get("JAXGIN_RECORD_NCCL_MEMORY") != "0"
        if record_vmm_calls:
            cupti_lib.load()
        state.runtime_backend_path = backend_lib.path
        uid = _unique_id(backend_lib, state.generation, state.nccl.version_string)
        try:
            state.runtime = ext.Runtime(
                backend_lib,
                world_size=len(devices),
                devices=[d.local_hardware_id for d in local_devices],
                ranks=[devices.index(d) for d in local_devices],
                unique_id=uid,
                heap_bytes=options.heap_bytes,
                signal_count=options.signal_count,
                barrier_slots=options.barrier_slots,
                force_gin=options.force_gin,
                timeout_ns=int(options.timeout_s * 1e9),
                channel_lanes=options.channel.lanes,
                channel_slots=options.channel.slots,
                channel_slot_bytes=options.channel.slot_bytes,
                generation=state.generation,
                record_vmm_calls=record_vmm_calls,
            )
        except RuntimeError as e:
            raise JaxginError(f"jaxgin.initialize() failed: {e}{transport_lib.not_loaded_hint(state.gin_transport, str(e))}") from None
        state.backend_lib = backend_lib
        unavailable = state.runtime.device_info(0)["vmm_ledger_unavailable"]
        if unavailable:
            state.fault_cleanup = f"the heaps only: NCCL's calls were not recorded, {unavailable}"

        targets.register(backend_lib)
        state.fault_watch = fault_watch_lib.FaultWatch(
            state.runtime.device_faults, grace_s, read_communicator_errors=state.runtime.communicator_errors,
            timeout_s=options.timeout_s).start()
        atexit.unregister(_report_faults_at_exit)  # once per process, however often initialize() runs
        atexit.register(_report_faults_at_exit)
    user_offset = reserved_bytes(options.signal_count, options.barrier_slots, len(devices), options.channel)
    if state.runtime is not None:
        user_offset = state.runtime.device_info(0)["user_offset"]
    state.heap = heap_lib.heap_allocator(user_offset, options.heap_bytes)
    state.signals = heap_lib.signal_allocator(options.signal_count)
    _generation += 1
    _state = state


def _fault_grace_s() -> float:
    """JAXGIN_FAULT_GRACE: seconds after a device fault before a process still waiting for device
    results is ended (see jaxgin.fault_watch); default 30."""
    raw = settings.get_as_set("JAXGIN_FAULT_GRACE")
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace > 0:
        raise JaxginError(f"JAXGIN_FAULT_GRACE must be a positive number of seconds, got {raw!r}")
    return grace


def _max_queued_calls() -> int:
    """JAXGIN_MAX_QUEUED_CALLS: how many jaxgin calls XLA's thread may queue ahead of the GPU per
    stream when NCCL's proxy GIN carries the puts (0: no limit). Read by the backend
    (csrc/ffi/launch_pacing.cu says why the limit exists); checked here so a bad value fails at
    initialize() rather than at the first call."""
    raw = settings.get("JAXGIN_MAX_QUEUED_CALLS")
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_QUEUED_CALLS_LIMIT:
        raise ValueError(
            f"JAXGIN_MAX_QUEUED_CALLS must be an integer from 0 to {MAX_QUEUED_CALLS_LIMIT}, got {raw!r}"
        )
    return int(raw)


def _report_faults_at_exit() -> None:
    """A process that ends with jaxgin initialized and device faults recorded says them on stderr:
    XLA reports a trapped jaxgin kernel only as a CUDA error, and a batch job may never have asked
    jaxgin.device_faults() why."""
    if _state is None or _state.runtime is None:
        return
    try:
        faults = device_faults()
    except Exception:  # the runtime is half torn down: nothing reliable to say
        return
    if faults:
        print("jaxgin: device faults recorded in this process:\n  " + "\n  ".join(faults), file=sys.stderr, flush=True)


def finalize() -> None:
    """Releases everything initialize() created (GPU memory, communicators). Safe to call twice.

    After a device fault (a jaxgin wait timed out, a peer died) the GPU's CUDA context is unusable
    for every library in the process; finalize() then aborts the communicators, resets the GPU,
    and releases what NCCL allocated as CUDA virtual memory itself (a reset leaves it, and NCCL
    cannot free it in a context in error): its buffers, this GPU's heap, and the mappings of the
    peers' heaps, so a dead peer's memory is not kept alive on its GPU. It knows those allocations
    from a record of NCCL's calls that initialize() takes through CUPTI; where CUPTI was unavailable
    (``jaxgin.info()["fault_cleanup"]`` says why), only the heaps come back and NCCL's buffers (about
    200 MiB measured on H200) stay until the process exits. It warns (RuntimeWarning): JAX cannot
    use that GPU again in this process, and JAX's own arrays on it (XLA allocates them as virtual
    memory as well) stay until the process exits. Exit after handling the error.

    The reset destroys the context under every library in the process, so it waits (up to 10 s)
    until no other thread of the process still runs: XLA may be finishing the faulted program on a
    thread of its own, and a reset under it crashed the process (SIGSEGV) where ranks shared CPU
    cores. If some thread keeps running, the GPU is not reset and finalize() raises JaxginError
    naming those threads: that GPU's memory then stays allocated until the process exits. No wait
    covers what XLA does later (its stream-status monitor polled a stream the reset had destroyed
    and crashed the process after finalize() returned), hence the advice to exit.

    In a job with GIN peers (other hosts, or ``force_gin``), finalize() is a collective: every
    process calls it, and each meets the others before releasing its heaps, since a peer's last
    puts and signals may still be on their way (a NIC fails a put into a released region). A peer
    that never calls it ends the meeting after the timeout (JAXGIN_TIMEOUT), like any device wait.

    Where XLA may have recorded jaxgin's calls into its command buffers (``info()["command_buffers"]``),
    finalize() clears JAX's caches: a recorded graph replays its calls without their handlers, so
    nothing would notice that the addresses it holds were released. A jitted function compiles again
    for the next runtime; a compiled object the caller keeps (``f.lower(x).compile()``) must not run
    after finalize()."""
    global _state
    state, _state = _state, None
    if state is not None and state.fault_watch is not None:
        state.fault_watch.stop()  # it reads the fault records that destroy() frees
    if state is not None and state.captured_lowered:
        # A program recorded into a CUDA graph replays its calls without their handlers, so none
        # would see that the context, heap and signals it was recorded with are gone: drop the
        # compiled programs (a jitted function compiles again for the next runtime).
        jax.clear_caches()
    if state is not None and state.runtime is not None:
        faults = _recorded_faults(state)
        unsettled = None if faults else _settle_before_release(state)
        if unsettled is not None:  # the meeting's bounded wait may have faulted the GPU
            faults = _recorded_faults(state)
        try:
            state.runtime.destroy()
        except RuntimeError as e:
            raise JaxginError(f"jaxgin.finalize() could not release everything: {e}") from None
        if faults:
            released = (
                "NCCL's allocations, the heaps among them, were released"
                if state.fault_cleanup == FAULT_CLEANUP_COMPLETE
                else f"jaxgin's heaps were released, but NCCL's own buffers stay allocated until the process exits "
                f"({state.fault_cleanup})"
            )
            warnings.warn(
                "jaxgin.finalize() after a device fault: the GPU's CUDA context was unusable, so it was reset to "
                f"release its memory and {released}; JAX cannot use this GPU again in this process, and XLA's "
                "threads may still touch the reset GPU and crash the process: exit once the error is handled. "
                "The fault: " + faults[0],
                RuntimeWarning,
                stacklevel=2,
            )
        elif unsettled is not None:
            warnings.warn(f"jaxgin.finalize(): {unsettled}; a peer's last puts to this rank may fail when they land",
                          RuntimeWarning, stacklevel=2)


def _recorded_faults(state: _State) -> list[str]:
    """The device faults the backend recorded on this process's GPUs, a line each."""
    return [line for line in state.runtime.device_faults().splitlines() if line]


def gin_in_job(state: _State) -> bool:
    """Whether some GPU of the job reaches some other through GIN (it spans hosts, or GIN is
    forced); the same answer in every process."""
    info = state.runtime.device_info(0)
    return info["gin_contexts"] > 0 and (state.options.force_gin or info["lsa_size"] < state.world_size)


def _settle_before_release(state: _State) -> str | None:
    """In a job with GIN peers, meets every rank before the heaps and signals are released: a
    peer's last puts and signals to this rank (a credit nobody waits for) may still be in flight
    after its kernels ended, and one landing in a released region fails on a NIC. Every process
    calls finalize(), so the meeting pairs up; one that never comes ends in the barrier's bounded
    wait (JAXGIN_TIMEOUT). None, or why the meeting failed."""
    try:
        if gin_in_job(state):
            call_backend(state.runtime.settle)
    except JaxginError as e:  # DeviceFault included
        return f"the meeting of every rank before releasing the heaps failed: {e}"
    return None


def is_initialized() -> bool:
    return _state is not None


def current() -> _State:
    """The live state; raises NotInitializedError naming the fix when there is none."""
    if _state is None:
        raise NotInitializedError(
            "jaxgin is not initialized: call jaxgin.initialize() first "
            "(after jax.distributed.initialize() when several processes run)"
        )
    return _state


def block_until_signal(signal: int, value: int, *, local_index: int = 0) -> None:
    """Blocks the host until this process's GPU `local_index` sees `signal` >= `value` (a raw
    device signal, for diagnostics and tests; jaxgin.wait_signal is the mailbox op inside jit).

    The wait runs on the device with the runtime's timeout; a timeout raises DeviceFault naming
    rank, signal and values (and leaves that GPU's CUDA context unusable, as any device fault).
    """
    state = current()
    if state.options.backend != "cuda":
        raise JaxginError("block_until_signal needs the cuda backend; in reference mode there are no device signals")
    call_backend(state.runtime.wait_signal, local_index, signal, value)


def device_faults() -> list[str]:
    """Device-side faults recorded on this process's GPUs (a timed-out wait, a peer index out of
    range), each naming op, rank, peer and signal. A jaxgin op that faults makes XLA report a CUDA
    error; this says why. After them, a line for each rank whose process the host transport saw
    end (the rank that died, where the faults above name ranks that were only waiting for it).
    Empty in reference mode or when nothing failed."""
    state = current()
    if state.runtime is None:
        return []
    from jaxgin import transport as transport_lib  # see the note above initialize()

    faults = _recorded_faults(state)
    # A peer that died shows on the survivors as waits that starve, each naming whom it waited
    # for; where the host transport saw which process ended, say so after them.
    return faults + transport_lib.lost_peer_lines() if faults else faults


def call_backend(method, *args):
    """Calls a method of the CUDA backend, raising DeviceFault for a kernel that failed on the
    device and JaxginError for any other backend error."""
    ext = _extension()
    try:
        return method(*args)
    except ext.DeviceFaultError as e:
        raise DeviceFault(str(e)) from None
    except RuntimeError as e:
        raise JaxginError(str(e)) from None


def info() -> dict[str, Any]:
    """What jaxgin runs on: backend, NCCL, GIN type, LSA team, ranks, heap, RDMA devices, and on
    GPUs what finalize() can return after a device fault (``fault_cleanup``) and whether XLA may
    record jaxgin's calls into its command buffers (``command_buffer_compatible``; why in
    ``command_buffers``: jaxgin.ffi.capture). In reference mode
    ``heap_allocated`` is False: no heap exists, and ``heap_bytes``, ``heap_user_bytes`` and
    ``channel`` are what ops are checked against, so they fail where a GPU's heap would be full."""
    state = current()
    o = state.options
    result: dict[str, Any] = {
        "backend": o.backend,
        "world_size": len(state.devices),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "heap_allocated": o.backend == "cuda",
        "heap_bytes": o.heap_bytes,
        "heap_user_bytes": o.heap_bytes - reserved_bytes(o.signal_count, o.barrier_slots, state.world_size, o.channel),
        "channel": dataclasses.asdict(o.channel),
        "signal_count": o.signal_count,
        "barrier_slots": o.barrier_slots,
        "force_gin": o.force_gin,
        "gin_transport": state.gin_transport,
        "timeout_s": o.timeout_s,
        "rdma_devices": rdma.devices(),
    }
    if o.backend == "reference":
        result.update(
            nccl_version=None,
            gin_type="none",
            lsa_team_size=None,
            local_devices=[{"device": str(d), "rank": state.devices.index(d)} for d in state.local_devices],
        )
        return result

    per_device = [state.runtime.device_info(i) for i in range(len(state.local_devices))]
    recorded, why = capture.policy(state)
    gin_types = {GIN_TYPES.get(d["gin_type"], str(d["gin_type"])) for d in per_device}
    result.update(
        nccl_version=state.nccl.version_string,
        nccl_library=str(state.nccl.library),
        gin_type=gin_types.pop() if len(gin_types) == 1 else sorted(gin_types),
        lsa_team_size=per_device[0]["lsa_size"],
        local_devices=[
            {
                "device": str(jax_device),
                "cuda_device": d["device"],
                "rank": d["rank"],
                "lsa_rank": d["lsa_rank"],
                "lsa_size": d["lsa_size"],
                "gin_contexts": d["gin_contexts"],
            }
            for jax_device, d in zip(state.local_devices, per_device)
        ],
        backend_library=state.runtime_backend_path,
        command_buffer_compatible=recorded,
        command_buffers=why,
        fault_cleanup=state.fault_cleanup,
    )
    return result
