"""jaxgin's lifetime (initialize / info / finalize) and argument checking, in reference mode (CPU)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax
import pytest

import jaxgin
from jaxgin import runtime
from jaxgin.errors import JaxginError, NotInitializedError, install_command


def test_cpu_has_eight_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


def test_initialize_picks_reference_on_cpu():
    assert not jaxgin.is_initialized()
    jaxgin.initialize()
    assert jaxgin.is_initialized()
    assert jaxgin.info()["backend"] == "reference"
    # what the GPU tests' results say they ran on: no CUDA backend in reference mode
    assert runtime.loaded_backends() == []


def test_blocking_on_a_raw_signal_needs_the_cuda_backend():
    jaxgin.initialize()
    with pytest.raises(JaxginError, match="block_until_signal needs the cuda backend"):
        runtime.block_until_signal(5, 1)


def test_info_fields():
    jaxgin.initialize(heap_size="64MiB", signal_count=100, barrier_slots=20, timeout=5)
    info = jaxgin.info()
    assert info["backend"] == "reference"
    assert info["world_size"] == 8
    assert info["process_index"] == 0
    assert info["process_count"] == 1
    assert info["gin_type"] == "none"
    assert info["nccl_version"] is None
    assert info["lsa_team_size"] is None
    assert info["force_gin"] is False
    assert info["timeout_s"] == 5.0
    assert info["signal_count"] == 100
    assert info["barrier_slots"] == 20
    assert info["heap_allocated"] is False  # reference mode checks ops against heap_bytes, allocates none
    assert info["heap_bytes"] == 64 << 20
    channel = runtime.channel_shape(8)
    assert info["channel"] == {"lanes": channel.lanes, "slots": channel.slots, "slot_bytes": channel.slot_bytes}
    reserved = runtime.reserved_bytes(100, 20, 8, channel)  # the exchange channel spans all 8 devices
    assert info["heap_user_bytes"] == info["heap_bytes"] - reserved
    assert runtime.current().options.channel == channel
    assert isinstance(info["rdma_devices"], list)
    assert [d["rank"] for d in info["local_devices"]] == list(range(8))
    assert [d["device"] for d in info["local_devices"]] == [str(d) for d in jax.devices()]
    json.dumps(info)  # python -m jaxgin.info prints it as JSON


def test_info_defaults(monkeypatch):
    monkeypatch.delenv("JAXGIN_CHANNEL_LANES", raising=False)
    monkeypatch.delenv("JAXGIN_CHANNEL_SLOT_BYTES", raising=False)
    jaxgin.initialize()
    info = jaxgin.info()
    assert info["heap_bytes"] == runtime.parse_size(runtime.DEFAULT_HEAP_SIZE) == 1 << 30
    assert info["signal_count"] == 1024
    assert info["barrier_slots"] == 256
    assert info["timeout_s"] == runtime.DEFAULT_TIMEOUT_S
    assert info["heap_user_bytes"] == (1 << 30) - runtime.reserved_bytes(1024, 256, 8)
    assert info["channel"] == {
        "lanes": runtime.default_channel_lanes(8),
        "slots": runtime.DEFAULT_CHANNEL_SLOTS,
        "slot_bytes": runtime.DEFAULT_CHANNEL_SLOT_BYTES,
    }


@pytest.mark.parametrize("world", [1, 2, 8])
@pytest.mark.parametrize("signals, slots", [(1, 1), (511, 1), (512, 0), (1024, 256), (1 << 20, 1 << 20)])
def test_reserved_bytes(signals, slots, world):
    """Reserved = page-rounded signal counters (user signals, barrier slots and two per channel lane
    per peer), then the channel's rings (lanes x slots x slot_bytes per peer), GIN staging and the
    line slots (slots x 16 KiB per peer)."""
    channel = runtime.ChannelShape(lanes=4, slots=2, slot_bytes=4096)
    reserved = runtime.reserved_bytes(signals, slots, world, channel)
    rings, staging, lines = world * 4 * 2 * 4096, world * 4 * 4096, world * 2 * 16384
    signal_area = reserved - rings - staging - lines
    counters = signals + slots + 2 * world * 4
    assert signal_area % 4096 == 0
    assert counters * 8 <= signal_area < counters * 8 + 4096


def test_reserved_bytes_grows_with_the_channel():
    base = runtime.ChannelShape(lanes=4, slots=2, slot_bytes=1 << 16)
    reserved = runtime.reserved_bytes(1024, 256, 8, base)
    wider = runtime.reserved_bytes(1024, 256, 8, dataclasses.replace(base, lanes=8))
    bigger = runtime.reserved_bytes(1024, 256, 8, dataclasses.replace(base, slot_bytes=1 << 17))
    assert wider - reserved == 8 * 4 * 3 * (1 << 16)  # 4 more lanes per peer: 2 ring slots + 1 staging each
    assert bigger - reserved == 8 * 4 * 3 * (1 << 16)
    assert runtime.reserved_bytes(1024, 256, 16, base) > reserved  # more peers, more rings


def test_reserved_bytes_default_channel(monkeypatch):
    """Without a channel argument, reserved_bytes uses channel_shape(world_size) (and its env)."""
    monkeypatch.delenv("JAXGIN_CHANNEL_LANES", raising=False)
    monkeypatch.delenv("JAXGIN_CHANNEL_SLOT_BYTES", raising=False)
    for world in (1, 2, 8):
        assert runtime.reserved_bytes(1024, 256, world) == runtime.reserved_bytes(
            1024, 256, world, runtime.channel_shape(world))
    default = runtime.reserved_bytes(1024, 256, 8)
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", "1")
    assert runtime.reserved_bytes(1024, 256, 8) < default


@pytest.mark.parametrize(
    "world, lanes",
    [(1, 32), (2, 32), (3, 32), (4, 16), (5, 16), (8, 8), (9, 8), (16, 4), (17, 4), (32, 4), (64, 4), (1024, 4)],
)
def test_default_channel_lanes(world, lanes):
    assert runtime.default_channel_lanes(world) == lanes


@pytest.mark.parametrize("world", range(1, 130))
def test_default_channel_lanes_properties(world):
    """A power of two in [4, 32], the largest that keeps lanes x peers <= 64 (the CTAs of an
    all_to_all) unless clamped at 4."""
    lanes = runtime.default_channel_lanes(world)
    peers = max(1, world - 1)
    assert 4 <= lanes <= 32 and lanes & (lanes - 1) == 0
    assert lanes * peers <= 64 or lanes == 4
    assert 2 * lanes * peers > 64 or lanes == 32


def test_channel_shape_defaults(monkeypatch):
    monkeypatch.delenv("JAXGIN_CHANNEL_LANES", raising=False)
    monkeypatch.delenv("JAXGIN_CHANNEL_SLOT_BYTES", raising=False)
    assert runtime.channel_shape(8) == runtime.ChannelShape(
        runtime.default_channel_lanes(8), runtime.DEFAULT_CHANNEL_SLOTS, runtime.DEFAULT_CHANNEL_SLOT_BYTES)
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", "")  # empty means unset
    monkeypatch.setenv("JAXGIN_CHANNEL_SLOT_BYTES", "")
    assert runtime.channel_shape(2).lanes == runtime.default_channel_lanes(2)
    assert runtime.channel_shape(2).slot_bytes == runtime.DEFAULT_CHANNEL_SLOT_BYTES


@pytest.mark.parametrize("lanes, slot, expected", [("1", "16", (1, 16)), ("64", "64KiB", (64, 65536)),
                                                   ("7", "1MiB", (7, 1 << 20)), (" 3 ", "4096B", (3, 4096))])
def test_channel_shape_from_environment(monkeypatch, lanes, slot, expected):
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", lanes)
    monkeypatch.setenv("JAXGIN_CHANNEL_SLOT_BYTES", slot)
    shape = runtime.channel_shape(8)
    assert (shape.lanes, shape.slot_bytes) == expected
    assert shape.slots == runtime.DEFAULT_CHANNEL_SLOTS


@pytest.mark.parametrize(
    "value, message",
    [("many", "is not an integer"), ("4.0", "is not an integer"), ("0x8", "is not an integer"),
     ("0", r"must be in \[1, 64\]"), ("-4", r"must be in \[1, 64\]"), ("65", r"must be in \[1, 64\]")],
)
def test_channel_shape_bad_lanes(monkeypatch, value, message):
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", value)
    with pytest.raises(ValueError, match="JAXGIN_CHANNEL_LANES") as excinfo:
        runtime.channel_shape(8)
    assert re.search(message, str(excinfo.value))


@pytest.mark.parametrize(
    "value, message",
    [("lots", "is not a size"), ("0", "must be positive"), ("24", "multiple of 16"), ("1000B", "multiple of 16"),
     ("1kb", "multiple of 16")],
)
def test_channel_shape_bad_slot_bytes(monkeypatch, value, message):
    monkeypatch.delenv("JAXGIN_CHANNEL_LANES", raising=False)
    monkeypatch.setenv("JAXGIN_CHANNEL_SLOT_BYTES", value)
    with pytest.raises(ValueError, match="JAXGIN_CHANNEL_SLOT_BYTES") as excinfo:
        runtime.channel_shape(8)
    assert message in str(excinfo.value)


def test_initialize_rejects_bad_channel_environment(monkeypatch):
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", "100")
    with pytest.raises(ValueError, match="JAXGIN_CHANNEL_LANES=100"):
        jaxgin.initialize()
    assert not jaxgin.is_initialized()


def test_channel_from_environment_in_info(monkeypatch):
    """The environment shapes the channel initialize() reserves, and info() reports it."""
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", "2")
    monkeypatch.setenv("JAXGIN_CHANNEL_SLOT_BYTES", "32KiB")
    jaxgin.initialize(heap_size="64MiB")
    info = jaxgin.info()
    assert info["channel"] == {"lanes": 2, "slots": runtime.DEFAULT_CHANNEL_SLOTS, "slot_bytes": 32 << 10}
    channel = runtime.ChannelShape(2, runtime.DEFAULT_CHANNEL_SLOTS, 32 << 10)
    assert info["heap_user_bytes"] == (64 << 20) - runtime.reserved_bytes(1024, 256, 8, channel)


def test_channel_change_needs_finalize(monkeypatch):
    """The channel is part of the options: initializing again with another one is refused."""
    monkeypatch.delenv("JAXGIN_CHANNEL_LANES", raising=False)
    jaxgin.initialize()
    monkeypatch.setenv("JAXGIN_CHANNEL_LANES", "1")
    with pytest.raises(JaxginError, match=r"finalize\(\)"):
        jaxgin.initialize()
    assert jaxgin.info()["channel"]["lanes"] == runtime.default_channel_lanes(8)


def test_initialize_is_idempotent_for_same_arguments():
    jaxgin.initialize(heap_size="256MiB", timeout=10)
    state = runtime.current()
    jaxgin.initialize(heap_size="256MiB", timeout=10)
    jaxgin.initialize(heap_size=256 << 20, timeout=10.0)  # the same options, spelled differently
    assert runtime.current() is state


def test_initialize_with_other_arguments_needs_finalize():
    jaxgin.initialize(heap_size="256MiB")
    with pytest.raises(JaxginError, match=r"finalize\(\)"):
        jaxgin.initialize(heap_size="512MiB")
    assert jaxgin.info()["heap_bytes"] == 256 << 20  # the first initialization is still in force


def test_finalize_then_initialize():
    jaxgin.initialize(heap_size="256MiB")
    jaxgin.finalize()
    assert not jaxgin.is_initialized()
    jaxgin.finalize()  # twice is fine
    jaxgin.initialize(heap_size="512MiB")
    assert jaxgin.info()["heap_bytes"] == 512 << 20


def test_finalize_drops_compiled_programs_only_after_recorded_calls(monkeypatch):
    """A graph XLA recorded replays jaxgin's calls without their handlers, so nothing would see that
    finalize() released what it holds: finalize() clears JAX's caches then, and only then."""
    from jaxgin import runtime

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    jaxgin.initialize()
    jaxgin.finalize()
    assert cleared == []
    jaxgin.initialize()
    runtime.current().captured_lowered = True  # what jaxgin.ffi.capture.target_for sets on GPUs
    jaxgin.finalize()
    assert cleared == [True]


def test_info_before_initialize():
    with pytest.raises(NotInitializedError, match=r"call jaxgin\.initialize\(\)"):
        jaxgin.info()
    assert issubclass(NotInitializedError, JaxginError)


def test_info_after_finalize():
    jaxgin.initialize()
    jaxgin.finalize()
    with pytest.raises(NotInitializedError, match=r"jaxgin\.initialize\(\)"):
        jaxgin.info()


def test_selftest_before_initialize():
    with pytest.raises(NotInitializedError, match=r"jaxgin\.initialize\(\)"):
        jaxgin.selftest()


def test_initialize_rejects_bad_heap_size():
    with pytest.raises(ValueError, match="heap_size"):
        jaxgin.initialize(heap_size="a lot")
    assert not jaxgin.is_initialized()


def test_heap_too_small_names_the_minimum():
    with pytest.raises(ValueError, match="too small") as excinfo:
        jaxgin.initialize(heap_size=4096)
    message = str(excinfo.value)
    assert "heap_size=4096" in message
    reserved = runtime.reserved_bytes(1024, 256, 8)  # signals and the channel of all 8 devices
    assert f"reserves {reserved} bytes" in message and "exchange channel of 8 devices" in message
    minimum = int(re.search(r"at least (\d+) bytes", message).group(1))
    assert minimum == reserved + runtime.MIN_USER_HEAP_BYTES
    assert not jaxgin.is_initialized()
    jaxgin.initialize(heap_size=minimum)  # the size it names is enough
    assert jaxgin.info()["heap_user_bytes"] == runtime.MIN_USER_HEAP_BYTES
    jaxgin.finalize()
    with pytest.raises(ValueError, match="too small"):  # and one byte less is not
        jaxgin.initialize(heap_size=minimum - 1)


def test_heap_exactly_reserved_is_too_small():
    reserved = runtime.reserved_bytes(16, 16, 8)
    with pytest.raises(ValueError, match="too small"):
        jaxgin.initialize(heap_size=reserved, signal_count=16, barrier_slots=16)


def test_cuda_backend_on_cpu():
    with pytest.raises(JaxginError) as excinfo:
        jaxgin.initialize(backend="cuda")
    message = str(excinfo.value)
    assert f"install JAX's CUDA plugin ({install_command('cuda')})" in message  # the README's command
    assert "backend='reference'" in message
    assert "'cpu'" in message  # names what JAX runs on
    assert not jaxgin.is_initialized()


def test_explicit_reference_backend():
    jaxgin.initialize(backend="reference")
    assert jaxgin.info()["backend"] == "reference"


@pytest.mark.parametrize("backend", ["gpu", "nccl", "Reference", ""])
def test_bad_backend_name(backend):
    with pytest.raises(ValueError, match="backend=") as excinfo:
        jaxgin.initialize(backend=backend)
    assert "'cuda'" in str(excinfo.value) and "'reference'" in str(excinfo.value)
    assert not jaxgin.is_initialized()


@pytest.mark.parametrize("timeout", [0, -1, -0.5, math.nan])
def test_bad_timeout(timeout):
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        jaxgin.initialize(timeout=timeout)
    assert not jaxgin.is_initialized()


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("JAXGIN_TIMEOUT", "2.5")
    jaxgin.initialize()
    assert jaxgin.info()["timeout_s"] == 2.5
    jaxgin.finalize()
    jaxgin.initialize(timeout=7)  # the argument wins over the environment
    assert jaxgin.info()["timeout_s"] == 7.0


@pytest.mark.parametrize("value", ["-1", "eight", " 8", "8 ", "1.5", "65537", "\u00b2"])
def test_bad_max_queued_calls_is_named_at_initialize(monkeypatch, value):
    """The launch-pacing depth the GPU path reads is checked by initialize() in reference mode too,
    naming the variable, the allowed range and the value."""
    monkeypatch.setenv("JAXGIN_MAX_QUEUED_CALLS", value)
    with pytest.raises(ValueError, match="JAXGIN_MAX_QUEUED_CALLS must be an integer from 0 to 65536") as excinfo:
        jaxgin.initialize()
    assert repr(value) in str(excinfo.value)
    assert not jaxgin.is_initialized()


@pytest.mark.parametrize("value, expected", [("", 8), ("0", 0), ("1", 1), ("65536", 65536)])
def test_max_queued_calls_values(monkeypatch, value, expected):
    monkeypatch.setenv("JAXGIN_MAX_QUEUED_CALLS", value)
    assert runtime._max_queued_calls() == expected
    jaxgin.initialize()
    assert jaxgin.is_initialized()


@pytest.mark.parametrize("name", ["signal_count", "barrier_slots"])
@pytest.mark.parametrize("value", [0, -1, True, 1.0, "8", (1 << 20) + 1])
def test_bad_signal_and_slot_counts(name, value):
    with pytest.raises(ValueError, match=name):
        jaxgin.initialize(**{name: value})


@pytest.mark.parametrize(
    "value, expected",
    [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("false", False), ("No", False),
     ("off", False), ("", False)],
)
def test_force_gin_from_environment(monkeypatch, value, expected):
    monkeypatch.setenv("JAXGIN_FORCE_GIN", value)
    jaxgin.initialize()
    assert jaxgin.info()["force_gin"] is expected


def test_force_gin_unset(monkeypatch):
    monkeypatch.delenv("JAXGIN_FORCE_GIN", raising=False)
    jaxgin.initialize()
    assert jaxgin.info()["force_gin"] is False


@pytest.mark.parametrize("value", ["maybe", "2", "enabled", " 1"])
def test_force_gin_bad_environment_value(monkeypatch, value):
    monkeypatch.setenv("JAXGIN_FORCE_GIN", value)
    with pytest.raises(ValueError, match="JAXGIN_FORCE_GIN") as excinfo:
        jaxgin.initialize()
    assert repr(value) in str(excinfo.value)
    assert not jaxgin.is_initialized()


def test_force_gin_argument_wins_over_environment(monkeypatch):
    monkeypatch.setenv("JAXGIN_FORCE_GIN", "maybe")  # not even read when the argument is given
    jaxgin.initialize(force_gin=True)
    assert jaxgin.info()["force_gin"] is True
    jaxgin.finalize()
    monkeypatch.setenv("JAXGIN_FORCE_GIN", "1")
    jaxgin.initialize(force_gin=False)
    assert jaxgin.info()["force_gin"] is False


def test_info_command_on_cpu():
    """``python -m jaxgin.info`` prints one JSON document (the environment and info()), nothing on
    stderr, and exits 0 on CPU; in reference mode it says that no heap exists and where the
    number of CPU devices comes from (here 2, from the XLA_FLAGS it is given)."""
    devices = 2
    result = subprocess.run([sys.executable, "-m", "jaxgin.info"], capture_output=True, text=True,
                            env={**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"},
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert set(report) == {"environment", "info", "reference_mode"}
    assert report["environment"]["jax_backend"] == "cpu" and report["environment"]["jax_devices"] == devices
    info = report["info"]
    assert info["backend"] == "reference" and info["world_size"] == devices
    assert info["heap_allocated"] is False
    assert f"{devices} CPU device(s)" in report["reference_mode"]
    assert "no heap allocated" in report["reference_mode"]
    assert "--xla_force_host_platform_device_count=N" in report["reference_mode"]


def test_info_command_reports_what_stopped_initialize():
    """A failing initialize() still ends in one JSON document, its message under "error" (and on
    stderr), exit status 1."""
    result = subprocess.run([sys.executable, "-m", "jaxgin.info"], capture_output=True, text=True,
                            env={**os.environ, "JAXGIN_TIMEOUT": "soon"}, timeout=300)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert set(report) == {"environment", "error"}
    assert "JAXGIN_TIMEOUT='soon'" in report["error"] and report["error"] in result.stderr


def test_cupti_already_in_the_process_is_not_loaded_twice(monkeypatch, tmp_path):
    """A CUPTI that JAX or a toolkit put in the process is the one the runtime uses: the packaged
    copy is loaded only when there is none (two copies would each hold their own state)."""
    from jaxgin import cupti

    mapped = tmp_path / "libcupti.so.13"
    monkeypatch.setattr(cupti, "loaded_library", lambda: mapped)
    monkeypatch.setattr(cupti, "packaged_library", lambda: pytest.fail("the packaged CUPTI was looked up"))
    assert cupti.load() == mapped
    monkeypatch.setattr(cupti, "loaded_library", lambda: None)
    monkeypatch.setattr(cupti, "packaged_library", lambda: None)
    assert cupti.load() is None
    monkeypatch.setattr(cupti, "packaged_library", lambda: tmp_path / "libcupti.so.13")  # not a library
    assert cupti.load() is None


def test_capturable_targets_are_registered_twice_and_the_rest_once(monkeypatch):
    """Every target is registered without XLA's command-buffer trait under its own name; a
    capturable one also as its "_captured" twin with the trait and the twin handler symbols (the
    execute stage's; instantiate is shared). The chunked fused ops have no twin."""
    from jax._src.lib import xla_client

    from jaxgin.ffi import op_table, targets

    class FakeBackend:
        path = "/fake/libjaxgin_backend.so"

        def ffi_handler(self, symbol):
            return symbol

        def ffi_address(self, symbol):
            return 0x2000 + len(symbol)

    registered = {}
    monkeypatch.setattr(targets, "_registered_from", None)
    monkeypatch.setattr(targets, "_HANDLER", lambda address: address)
    monkeypatch.setattr(jax.ffi, "pycapsule", lambda x: x)
    monkeypatch.setattr(jax.ffi, "register_ffi_type", lambda *a, **k: None)
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, fn, platform, **kwargs: registered.setdefault(name, (fn, platform, kwargs)))
    targets.register(FakeBackend())
    capturable = [t for t in op_table.targets() if t.capturable]
    assert {t.name for t in capturable} == {"jaxgin_exchange", "jaxgin_put_signal", "jaxgin_wait_signal",
                                            "jaxgin_wait_signal_from", "jaxgin_triton_call"}
    assert set(registered) == {t.name for t in op_table.targets()} | {t.name + "_captured" for t in capturable}
    for target in op_table.targets():
        fn, platform, kwargs = registered[target.name]
        assert platform == "CUDA" and "traits" not in kwargs, (target.name, kwargs)
        if target.capturable:
            fn, platform, kwargs = registered[target.name + "_captured"]
            assert kwargs == {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
            symbols = fn if isinstance(fn, dict) else {"execute": fn}
            assert symbols["execute"] == target.handlers["execute"] + "_captured"
            assert symbols.get("instantiate") == target.handlers.get("instantiate")
