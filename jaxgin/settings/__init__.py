"""Every ``JAXGIN_*`` environment variable jaxgin reads, in one table, and the one way Python reads them.

``SETTINGS`` lists each variable with its type, the default the code uses when it is unset, which
side reads it (``python``: this package; ``native``: the C++ under csrc/ through getenv; ``both``)
and what it means. Python code reads a setting with ``settings.get(name)`` (``get_as_set`` where an
empty value is an error rather than "unset", ``flag`` for a yes/no setting); other readers parse
and check the text themselves, so their error messages keep their own context.
tests/test_settings.py holds the table equal to what the code reads, and docs/guide.md's
"Settings (environment variables)" table equal to what ``python -m jaxgin.settings`` prints (a package so that the command, its __main__, is not a module
``import jaxgin`` already loaded: runpy would warn about a second copy).

Imports nothing but the standard library: every layer of jaxgin reads settings.
"""

from __future__ import annotations

import dataclasses
import os

TYPES = ("str", "int", "float", "bool", "path", "size")
SIDES = ("python", "native", "both")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    type: str  # one of TYPES: how the readers parse the text
    default: str | None  # the text the code falls back to when unset; None: unset has its own meaning (see `meaning`)
    side: str  # one of SIDES
    meaning: str


SETTINGS: tuple[Setting, ...] = (
    # Initialization and the runtime (jaxgin/runtime.py).
    Setting("JAXGIN_TIMEOUT", "float", "30", "python",
            "Seconds a device-side wait lasts before it fails naming the op, rank, peer and signal "
            "(`initialize(timeout=)` overrides it)."),
    Setting("JAXGIN_FORCE_GIN", "bool", None, "python",
            "1/true/yes/on: GIN carries traffic to every peer, not only to other hosts; unset or empty: off "
            "(`initialize(force_gin=)` overrides it)."),
    Setting("JAXGIN_GIN_TRANSPORT", "str", "auto", "python",
            "What carries GIN: `auto`, `nic` or `host` (jaxgin's host transport); `initialize(gin_transport=)` "
            "overrides it."),
    Setting("JAXGIN_CHANNEL_LANES", "int", None, "python",
            "Parallel lanes per ordered pair of ranks in the exchange channel, 1 to 64; unset: from the world "
            "size (4 to 32)."),
    Setting("JAXGIN_CHANNEL_SLOT_BYTES", "size", "256KiB", "python",
            "Bytes of one exchange channel ring slot, a multiple of 16."),
    Setting("JAXGIN_BOOTSTRAP_TIMEOUT", "float", "300", "python",
            "Seconds a process of a multi-process job waits for process 0's NCCL version and unique id."),
    Setting("JAXGIN_BACKEND", "path", None, "python",
            "A prebuilt libjaxgin_backend.so to load; unset: the one built (and cached) for the loaded NCCL."),
    Setting("JAXGIN_RECORD_NCCL_MEMORY", "bool", "1", "python",
            "0: do not record NCCL's allocations through CUPTI (a fault's cleanup then returns only the heaps)."),
    Setting("JAXGIN_FAULT_GRACE", "float", "30", "python",
            "Seconds after a device fault before a process still waiting for device results is ended."),
    Setting("JAXGIN_GIN_CONTEXTS", "int", "4", "native",
            "GIN contexts (queues to every peer) asked of NCCL, 1 to 64; NCCL may grant another number "
            "(`jaxgin.info()['gin_contexts']` says which)."),
    Setting("JAXGIN_COMMAND_BUFFERS", "bool", "1", "python",
            "0: jaxgin's calls stay out of XLA's command buffers (each runs as its own step); 1: XLA may record "
            "them into its CUDA graphs where that is safe (`jaxgin.info()['command_buffers']` says whether, and why)."),
    Setting("JAXGIN_MAX_QUEUED_CALLS", "int", "8", "both",
            "How many jaxgin calls XLA's thread may queue ahead of the GPU per stream under NCCL's proxy GIN, "
            "0 to 65536 (0: no limit)."),
    # Building the native code (jaxgin/build.py, jaxgin/nccl.py, jaxgin/triton_device/link.py).
    Setting("JAXGIN_CACHE_DIR", "path", None, "python",
            "Where built libraries are cached; unset: `$XDG_CACHE_HOME/jaxgin`, else `~/.cache/jaxgin`."),
    Setting("JAXGIN_NVCC", "path", None, "python",
            "The nvcc to build with; unset: `$CUDA_HOME`, `$CUDA_PATH`, `PATH`, then PyPI's nvidia-cuda-nvcc."),
    Setting("JAXGIN_BUILD_PROGRESS", "bool", "1", "python", "0: no build progress lines on stderr."),
    Setting("JAXGIN_NCCL_INCLUDE", "path", None, "python",
            "The loaded NCCL's headers; unset: the `include` directory beside its library's directory."),
    # Kernels (jaxgin/fused, jaxgin/moe).
    Setting("JAXGIN_FUSED_AUTOTUNE", "bool", "1", "python",
            "0, false or no: the fused ops take their first tile candidate instead of timing them."),
    Setting("JAXGIN_MOE_BLOCKS", "str", None, "python",
            "`tokens,hidden,warps,senders`: overrides the MoE block presets for tuning: dispatch's, and "
            "combine's first three (each kernel has its own preset)."),
    # The host transport (jaxgin/transport.py, csrc/transport/).
    Setting("JAXGIN_TRANSPORT_QUIET", "bool", None, "python",
            "Any non-empty value: no warning when GIN goes through the host transport."),
    Setting("JAXGIN_TRANSPORT_COPY_CONTEXT", "str", "own", "both",
            "Where the host transport's copies out of GPU memory run: `own` (a CUDA context of its own) or "
            "`shared` (the application's)."),
    Setting("JAXGIN_TRANSPORT_PEER_LOSS", "str", "drop", "both",
            "What the host transport does with a put to a peer whose connection is gone: `drop` (complete it, so "
            "NCCL's GIN progress runs on) or `fail` (complete it with an error, as a NIC's plugin does: NCCL's GIN "
            "progress thread then ends)."),
    Setting("JAXGIN_TRANSPORT_CONNECT_TIMEOUT", "float", "300", "native",
            "Seconds the host transport waits for peers to connect and register, for a free staging buffer, and "
            "for a peer to read what it sends (then the peer counts as gone)."),
    Setting("JAXGIN_TRANSPORT_ADDR", "str", None, "native",
            "The IPv4 address peers on other hosts reach this one at; unset: the first up, non-loopback "
            "interface's."),
    Setting("JAXGIN_TRANSPORT_HOST_ID", "str", None, "native",
            "This host's identity for the host transport (processes with different ids treat each other as "
            "other hosts); unset: host name and boot id."),
    Setting("JAXGIN_TRANSPORT_TCP", "bool", None, "native", "1, true or yes: every peer over TCP, same host or not."),
    Setting("JAXGIN_TRANSPORT_REQUEUE_MS", "int", "200", "native",
            "Milliseconds a staged copy may sit on its stream before it is queued again on another (0: never)."),
    Setting("JAXGIN_TRANSPORT_STALL_REPORT_S", "float", "10", "native",
            "Seconds a put may wait for its copy out of GPU memory before the host transport says so on stderr."),
    Setting("JAXGIN_TRANSPORT_DEBUG", "bool", None, "native",
            "Set: the host transport's log lines go to stderr when NCCL gives it no logger."),
    Setting("JAXGIN_TRANSPORT_TRACE", "bool", None, "native",
            "Set: one stderr line per host transport request and delivery (debugging only)."),
    Setting("JAXGIN_TRANSPORT_UNKIND", "str", "none", "both",
            "The host transport's unkind mode (what NCCL's GIN rules allow a NIC to do): `none`, `all` or a comma "
            "list of `late_read`, `reread`, `early_completion`, `weak_overtake`, `pieces`, `backpressure`, "
            "`starve`."),
    Setting("JAXGIN_TRANSPORT_SEED", "int", "1", "native",
            "Seed of the unkind mode's random choices (mixed with the rank and the RMA context)."),
    Setting("JAXGIN_TRANSPORT_UNKIND_DELAY_US", "int", "2000", "native",
            "The unkind mode's longest delay of a late read, a late delivery or a held completion, in microseconds."),
    # The fake CUDA driver the host transport's tests run on (csrc/transport/fake_cuda.cc).
    Setting("JAXGIN_FAKE_CUDA_DELAY_US", "int", "30", "native",
            "Tests' fake CUDA only: the longest random pause, in microseconds, before a stream runs its work."),
    Setting("JAXGIN_FAKE_CUDA_COPY_MS", "int", "0", "native",
            "Tests' fake CUDA only: milliseconds every fake copy takes (a copy held up on the GPU)."),
    Setting("JAXGIN_FAKE_CUDA_ADDS", "bool", None, "native",
            "Tests' fake CUDA only: 1 offers stream atomic adds (both ways of applying a signal get tested)."),
    Setting("JAXGIN_FAKE_CUDA_PUSH_FAILS", "bool", None, "native",
            "Tests' fake CUDA only: 1 makes cuCtxPushCurrent fail (CUDA torn down under the transport)."),
    Setting("JAXGIN_FAKE_CUDA_OUT_OF_MEMORY", "str", None, "native",
            "Tests' fake CUDA only: the calls (comma-separated, e.g. `cuCtxCreate,cudaHostAlloc`) that fail as "
            "out of memory."),
)

BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def _setting(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a jaxgin setting; add it to SETTINGS in jaxgin/settings/__init__.py") from None


def get(name: str) -> str | None:
    """`name`'s value in the environment; its default when unset or empty (None where it has none)."""
    return os.environ.get(name) or _setting(name).default


def get_as_set(name: str) -> str | None:
    """`name`'s value in the environment, an empty value included (its reader refuses one); its
    default when unset."""
    return os.environ.get(name, _setting(name).default)


def flag(name: str) -> bool | None:
    """A yes/no setting: True for 1/true/yes/on, False for 0/false/no/off (any case), None when
    unset or empty; anything else is refused."""
    value = get(name)
    if value is None or value == "":
        return None
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r}: use 1/0, true/false, yes/no or on/off")


def markdown_table() -> str:
    """The table docs/guide.md shows (regenerate it with ``python -m jaxgin.settings``)."""
    rows = ["| Variable | Default | Read by | Meaning |", "| --- | --- | --- | --- |"]
    for s in SETTINGS:
        default = "unset" if s.default is None else f"`{s.default}`"
        rows.append(f"| `{s.name}` | {default} | {s.side} | {s.meaning} |")
    return "\n".join(rows) + "\n"

