"""jaxgin's host transport: an NCCL RMA plugin that gives NCCL's GIN proxy backend a data path on
hosts without an RDMA NIC (CUDA IPC copies within a host, TCP between hosts).

NCCL loads it from the path in ``NCCL_RMA_PLUGIN`` when it first sets up its plugins, so the
variable must be set before the process creates its first NCCL communicator, XLA's included:
``jaxgin.initialize(gin_transport=...)`` does that, and ``python -m jaxgin.transport`` prints the
path for launch scripts. NCCL >= 2.30 loads RMA plugins; older NCCL ignores the variable.

Choices (``gin_transport`` / ``JAXGIN_GIN_TRANSPORT``):
  ``"auto"`` (default): the host transport when GIN is requested (``force_gin``) and this machine
      has no RDMA device; otherwise whatever NCCL finds.
  ``"host"``: always the host transport.
  ``"nic"``: never; GIN exists only where NCCL finds a NIC.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

from jaxgin import build as build_lib
from jaxgin import rdma, settings
from jaxgin.errors import JaxginError
from jaxgin.nccl import version_string

TRANSPORTS = ("auto", "host", "nic")
LIBRARY_NAME = "libjaxgin_transport.so"
# Compiled (the .cc files) and hashed into the cache key (all); transport_internal.h maps the plugin's files.
SOURCES = ("rma_api.h", "wire.h", "wire.cc", "device_memory.h", "device_memory.cc", "transport_internal.h",
           "support.cc", "faults.cc", "receive.cc", "send.cc", "connect.cc", "regions.cc", "plugin.cc", "exports.map")
# The linker version script among them: what it keeps local (see the file).
VERSION_SCRIPT = "exports.map"
MIN_NCCL = 23000  # NCCL_VERSION_CODE of 2.30.0, the first NCCL that loads RMA plugins


def sources_dir() -> Path:
    return build_lib.sources_dir() / "transport"


def build(*, cache_dir: Path | None = None) -> Path:
    """Compiles the plugin (host code only: g++ through nvcc, CUDA runtime linked statically) into
    the cache and returns its path. Needs no NCCL headers: the interface is declared in rma_api.h."""
    nvcc = build_lib.find_nvcc()
    root = sources_dir()
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    # -g: a crash report's offsets into the plugin resolve to lines (addr2line).
    flags = ["-std=c++17", "-O2", "-g", "-shared", "-Xcompiler=-fPIC,-fvisibility=hidden"]
    digest.update(build_lib.nvcc_version(nvcc).encode() + " ".join(flags).encode())
    cache_dir = Path(cache_dir) if cache_dir else build_lib.default_cache_dir()
    final = cache_dir / f"transport-{digest.hexdigest()[:20]}"
    library = final / LIBRARY_NAME
    with build_lib._locked(cache_dir / f"{final.name}.lock"):
        if library.exists():
            return library
        final.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=".transport-", dir=final)) / LIBRARY_NAME
        command = [str(nvcc), *flags, *(str(root / s) for s in SOURCES if s.endswith(".cc")), "-lpthread",
                   "-Xlinker", f"--version-script={root / VERSION_SCRIPT}", "-o", str(partial)]
        build_lib._run(command, root)
        partial.rename(library)
        partial.parent.rmdir()
    return library


def requested(gin_transport: str | None) -> str:
    """The validated request: the argument, else JAXGIN_GIN_TRANSPORT, else 'auto'."""
    source = "gin_transport"
    if gin_transport is None:
        gin_transport = settings.get("JAXGIN_GIN_TRANSPORT")
        source = "JAXGIN_GIN_TRANSPORT"
    if gin_transport not in TRANSPORTS:
        raise ValueError(f"{source}={gin_transport!r}: expected one of {TRANSPORTS}")
    return gin_transport


def choose(request: str, force_gin: bool, nccl_version: int) -> str:
    """'host' or 'nic': what the request means on this machine with this NCCL (a version code)."""
    too_old = nccl_version < MIN_NCCL
    if request == "host" and too_old:
        raise JaxginError(
            f"gin_transport='host' needs NCCL >= {version_string(MIN_NCCL)} (RMA plugins), but NCCL "
            f"{version_string(nccl_version)} is loaded; install nvidia-nccl-cu13>=2.30 or use gin_transport='nic'"
        )
    if request != "auto":
        return request
    # Without force_gin, GIN only carries traffic to other hosts; then a missing NIC is reported
    # by initialize() rather than papered over with TCP.
    return "host" if force_gin and not too_old and not rdma.devices() else "nic"


# Where the plugin's copies out of GPU memory run (JAXGIN_TRANSPORT_COPY_CONTEXT): "own", a CUDA
# context of the plugin's own, whose hardware queues hold nothing of XLA's; "shared", the
# application's context. See docs/guide.md ("The host transport").
COPY_CONTEXTS = ("own", "shared")

# What the plugin does with a put to a peer whose connection is gone (JAXGIN_TRANSPORT_PEER_LOSS):
# "drop" completes it; "fail" fails it, as a NIC's plugin does, which ends NCCL's GIN progress
# thread (what jaxgin.fault_watch then bounds). See peer_loss_mode in csrc/transport/support.cc.
PEER_LOSS_MODES = ("drop", "fail")

# The unkind mode's behaviours (JAXGIN_TRANSPORT_UNKIND: none, all or a comma list of these), in
# the order of kUnkindNames in csrc/transport/transport_internal.h, where each is explained; see
# docs/guide.md ("The unkind mode").
UNKIND_BEHAVIOURS = ("late_read", "reread", "early_completion", "weak_overtake", "pieces", "backpressure", "starve")
# Under `backpressure`, NCCL's GPU-to-proxy queue per (context, peer) holds this many descriptors
# (NCCL_GIN_PROXY_QUEUE_SIZE, unless set already; NCCL's own default is 32 x the plugin's maxRecvs).
UNKIND_PROXY_QUEUE_SIZE = 4


def unkind_behaviours() -> tuple[str, ...]:
    """The behaviours JAXGIN_TRANSPORT_UNKIND turns on (none when unset, empty or `none`)."""
    value = settings.get("JAXGIN_TRANSPORT_UNKIND") or "none"
    if value == "none":
        return ()
    if value == "all":
        return UNKIND_BEHAVIOURS
    names = tuple(value.split(","))
    unknown = [n for n in names if n not in UNKIND_BEHAVIOURS]
    if unknown:
        raise ValueError(f"JAXGIN_TRANSPORT_UNKIND={value!r}: {', '.join(map(repr, unknown))} is no behaviour; expected "
                         f"none, all or a comma list of {', '.join(UNKIND_BEHAVIOURS)}")
    return names


def enable(library: Path) -> None:
    """Points NCCL at the plugin. Refuses what would silently not work."""
    copy_context = settings.get("JAXGIN_TRANSPORT_COPY_CONTEXT")
    if copy_context and copy_context not in COPY_CONTEXTS:
        raise ValueError(f"JAXGIN_TRANSPORT_COPY_CONTEXT={copy_context!r}: expected one of {COPY_CONTEXTS} "
                         "(own, the default: the host transport copies in a CUDA context of its own)")
    peer_loss = settings.get("JAXGIN_TRANSPORT_PEER_LOSS")
    if peer_loss and peer_loss not in PEER_LOSS_MODES:
        raise ValueError(f"JAXGIN_TRANSPORT_PEER_LOSS={peer_loss!r}: expected one of {PEER_LOSS_MODES} "
                         "(drop, the default: a put to a peer that is gone completes without an error)")
    unkind = unkind_behaviours()
    current = os.environ.get("NCCL_RMA_PLUGIN")
    if current and Path(current).resolve() != library.resolve():
        raise JaxginError(
            f"gin_transport='host' would load {library} but NCCL_RMA_PLUGIN is already {current!r}; unset it or "
            "use gin_transport='nic' to keep that plugin"
        )
    stack = os.environ.get("NCCL_SET_STACK_SIZE")
    if stack not in (None, "1"):
        raise JaxginError(
            f"gin_transport='host' needs NCCL_SET_STACK_SIZE=1 (or unset), not {stack!r}: otherwise NCCL's first "
            "kernel launch grows the GPU's stack memory, which waits for the whole device while holding the CUDA "
            "driver lock that the transport's copies take, and a jaxgin kernel waiting for a peer's put then "
            "times out (docs/guide.md, \"GIN without an RDMA NIC\")"
        )
    os.environ["NCCL_SET_STACK_SIZE"] = "1"  # NCCL then sizes the stack when it creates jaxgin's communicator
    os.environ["NCCL_RMA_PLUGIN"] = str(library)
    if "backpressure" in unkind:
        os.environ.setdefault("NCCL_GIN_PROXY_QUEUE_SIZE", str(UNKIND_PROXY_QUEUE_SIZE))
    if not settings.get("JAXGIN_TRANSPORT_QUIET"):
        warnings.warn(
            "jaxgin: GIN traffic goes through the host transport (CUDA copies driven by NCCL's proxy thread, "
            "TCP across hosts), not an RDMA NIC: it works everywhere but is slower than LSA or a NIC. "
            "Set JAXGIN_TRANSPORT_QUIET=1 to silence this.",
            stacklevel=3,
        )


def _plugin_path(library: Path | str | None) -> str | None:
    """The plugin asked about: `library`, else the one NCCL_RMA_PLUGIN names (None if neither)."""
    path = library or os.environ.get("NCCL_RMA_PLUGIN")
    return str(path) if path else None


def counters(library: Path | str | None = None) -> dict[str, int]:
    """What the plugin loaded in this process moved so far (all communicators together)."""
    path = _plugin_path(library)
    if path is None:
        raise JaxginError("the host transport is not in use in this process (NCCL_RMA_PLUGIN is unset)")
    lib = ctypes.CDLL(path)
    # The names come from the plugin, which defines the counters: no second list to keep equal.
    lib.jaxgin_transport_counter_names.restype = ctypes.c_int
    lib.jaxgin_transport_counter_names.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]
    count = lib.jaxgin_transport_counter_names(None, 0)
    names = (ctypes.c_char_p * count)()
    lib.jaxgin_transport_counter_names(names, count)
    values = (ctypes.c_uint64 * count)()
    lib.jaxgin_transport_counters(values, count)
    return {name.decode(): int(value) for name, value in zip(names, values)}


# How every line the plugin logs begins (csrc/transport/support.cc, log_message); NCCL
# passes its warnings on in the error it returns.
MESSAGE_PREFIX = "jaxgin transport: "


def not_loaded_hint(gin_transport: str, error: str = "") -> str:
    """Why GIN may be missing although the host transport was asked for: NCCL reads NCCL_RMA_PLUGIN
    once, when the process creates its first communicator, which may have been XLA's (a jax.lax
    collective run before jaxgin.initialize()). '' when the plugin is loaded, was not asked for, or
    speaks in `error` itself: then it ran, and NCCL may have unloaded it since (NCCL counts the
    communicators that hold its GIN plugin, and a failed initialize() has freed its own), so its
    absence now says nothing."""
    path = os.environ.get("NCCL_RMA_PLUGIN")
    if gin_transport != "host" or not path or MESSAGE_PREFIX in error:
        return ""
    try:
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return ""
    except OSError:
        return (f". NCCL did not load jaxgin's host transport ({path}): NCCL loads its plugins once, when the process "
                "creates its first communicator, and one was created before jaxgin.initialize() (by an XLA collective?). "
                "Call jaxgin.initialize() before the first collective")


def lost_peers(library: Path | str | None = None) -> list[int]:
    """Ranks whose process the host transport saw end without a goodbye (their connection closed),
    in the order seen; empty when the transport is not in use in this process."""
    path = _plugin_path(library)
    if path is None or Path(path).name != LIBRARY_NAME:
        return []
    lib = ctypes.CDLL(path)
    capacity = lib.jaxgin_transport_lost_peers(None, 0)  # how many, then read them (at any world size)
    ranks = (ctypes.c_int * capacity)()
    count = lib.jaxgin_transport_lost_peers(ranks, capacity)
    return [int(r) for r in ranks[: min(count, capacity)]]


def lost_peer_lines(library: Path | str | None = None) -> list[str]:
    """A fault line per rank in lost_peers(): faults of waits that starved name whom they waited
    for, which may itself only have been waiting; these name the rank that went away."""
    return [f"the host transport saw rank {rank}'s process end (its connection closed without a goodbye): "
            f"rank {rank} died or its host became unreachable, and waits for it time out"
            for rank in lost_peers(library)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxgin.transport",
        description="Build jaxgin's host transport (an NCCL RMA plugin) and print the line that enables it.",
    )
    parser.add_argument("--cache-dir", type=Path)
    args = parser.parse_args(argv)
    print(f"export NCCL_RMA_PLUGIN={build(cache_dir=args.cache_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
