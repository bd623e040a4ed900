"""Finds the one NCCL library of the process and the headers that match it.

XLA's CUDA plugin loads ``libnccl.so.2`` from the ``nvidia-nccl-cu13`` package. jaxgin must use
that same library (two NCCLs in one process do not share communicators or memory registrations),
and must compile its device code against that library's own headers, because NCCL's device API
has no ABI stability across releases.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
from pathlib import Path

from jaxgin import nvidia_packages, settings
from jaxgin.errors import NcclError, install_command

MINIMUM_VERSION = 22800  # NCCL 2.28: the first release with the Device API (GIN and LSA)


@dataclasses.dataclass(frozen=True)
class NcclInstall:
    version: int  # NCCL_VERSION_CODE, e.g. 22809
    include_dir: Path
    library: Path | None  # None: headers only (compile checks without linking)

    @property
    def version_string(self) -> str:
        return version_string(self.version)


def version_string(code: int) -> str:
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def header_version(include_dir: Path) -> int:
    header = Path(include_dir) / "nccl.h"
    try:
        text = header.read_text()
    except OSError as e:
        raise NcclError(
            f"no NCCL headers at {include_dir} ({e.strerror}); set JAXGIN_NCCL_INCLUDE to the include "
            "directory of the NCCL that is loaded (nvidia-nccl-cu13 ships it as nvidia/nccl/include)"
        ) from None
    match = re.search(r"#define\s+NCCL_VERSION_CODE\s+(\d+)", text)
    if match is None:
        raise NcclError(f"{header} does not define NCCL_VERSION_CODE; is it an NCCL header?")
    return int(match.group(1))


def check_version(code: int, where: str) -> None:
    if code < MINIMUM_VERSION:
        raise NcclError(
            f"NCCL {version_string(code)} ({where}) is too old: jaxgin needs NCCL >= 2.28 for the "
            "NCCL Device API (GIN and LSA). Upgrade with: pip install -U 'nvidia-nccl-cu13>=2.28.9'"
        )


def loaded_libraries() -> list[Path]:
    """Every distinct libnccl mapped into this process."""
    found: list[Path] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            if "/libnccl.so" in path and Path(path) not in found:
                found.append(Path(path))
    return found


def packaged_library() -> Path | None:
    """libnccl.so.2 of the nvidia-nccl-cu13 package, which XLA's CUDA plugin loads."""
    return nvidia_packages.find("nccl/lib/libnccl.so.2")


def packaged_install() -> NcclInstall | None:
    """The nvidia-nccl-cu13 package's NCCL, headers included, without loading it."""
    library = packaged_library()
    if library is None:
        return None
    include_dir = library.parent.parent / "include"
    return NcclInstall(header_version(include_dir), include_dir, library)


def load() -> NcclInstall:
    """Loads (or finds already loaded) the process's NCCL and checks its version and headers."""
    loaded = loaded_libraries()
    if len(loaded) > 1:
        raise NcclError(
            "several NCCL libraries are loaded in this process: "
            + ", ".join(map(str, loaded))
            + ". jaxgin and XLA must share one; remove the extra NCCL from LD_LIBRARY_PATH / LD_PRELOAD"
        )
    library = loaded[0] if loaded else packaged_library()
    if library is None:
        raise NcclError(
            "no NCCL found: jaxgin uses the libnccl.so.2 of the nvidia-nccl-cu13 package that JAX's "
            f"CUDA plugin loads. Install it with: {install_command('cuda')}"
        )
    lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    code = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        raise NcclError(f"ncclGetVersion failed in {library}")
    check_version(code.value, str(library))
    include_dir = Path(settings.get("JAXGIN_NCCL_INCLUDE") or library.resolve().parent.parent / "include")
    headers = header_version(include_dir)
    if headers != code.value:
        raise NcclError(
            f"NCCL {version_string(code.value)} is loaded from {library} but the headers at {include_dir} "
            f"are NCCL {version_string(headers)}; point JAXGIN_NCCL_INCLUDE at the loaded NCCL's headers"
        )
    return NcclInstall(code.value, include_dir, library)
