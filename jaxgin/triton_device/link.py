"""The link step: Triton's PTX + jaxgin's device library -> one cubin, through nvJitLink.

A kernel that calls tritongin's device functions leaves them as external calls in its PTX, which
Triton's own ptxas stage cannot resolve. ``install()`` adds a Triton stages hook that replaces the
``cubin`` stage of exactly those kernels (their PTX names a ``jaxgin_`` function) by an nvJitLink
link against the device library built for the NCCL in use; every other kernel keeps Triton's stage
untouched. The hook chains to whatever hook was installed before it.

Why nvJitLink and a cubin of the library (not LLVM bitcode through Triton's ``extern_libs``): the
library is compiled by nvcc against NCCL's headers, and nvcc's NVVM IR is not Triton's LLVM.

Triton caches compiled kernels by a key it computes before any stage runs, so the identity of the
library linked in (NCCL, nvcc, sources) reaches that key through tritongin's device functions
themselves (see ``language.py``): a kernel that calls them can never be served a cubin linked
against another NCCL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import re
import subprocess
import threading
from pathlib import Path

from jaxgin import build as _build
from jaxgin import nccl as _nccl
from jaxgin import nvidia_packages, settings
from jaxgin.errors import ToolchainError

# nvJitLink's C interface (nvJitLink.h); tests/test_tritongin.py checks these against the header.
NVJITLINK_SUCCESS = 0
NVJITLINK_INPUT_CUBIN = 1
NVJITLINK_INPUT_PTX = 2

# Device functions of the library are named jaxgin_*; an undefined one in Triton's PTX is what marks
# a kernel to be linked.
_EXTERN_CALL = re.compile(r"^\s*\.extern\s+\.func\s+(?:\([^)]*\)\s*)?(jaxgin_\w+)", re.MULTILINE)


def library_calls(ptx: str) -> list[str]:
    """Names of device-library functions that `ptx` calls but does not define."""
    return sorted(set(_EXTERN_CALL.findall(ptx)))


def _cuda_release(nvcc: Path) -> tuple[int, int]:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise ToolchainError(f"cannot read the CUDA release of {nvcc}:\n{out.stdout}{out.stderr}")
    return int(match.group(1)), int(match.group(2))


def _nvjitlink_candidates(nvcc: Path) -> list[Path]:
    candidates: list[Path] = []
    if settings.get("JAXGIN_NVJITLINK"):
        candidates.append(Path(settings.get("JAXGIN_NVJITLINK")))
    # The toolkit nvcc came from first: its nvJitLink reads what its nvcc wrote.
    toolkit = nvcc.resolve().parent.parent
    for lib_dir in (toolkit / "lib64", toolkit / "lib"):
        candidates.extend(sorted(lib_dir.glob("libnvJitLink.so*"), reverse=True))
    for root in nvidia_packages.roots():
        for sub in ("cu13/lib", "nvjitlink/lib"):
            candidates.extend(sorted((root / sub).glob("libnvJitLink.so*"), reverse=True))
    found = ctypes.util.find_library("nvJitLink")
    if found:
        candidates.append(Path(found))
    return candidates


class NvJitLink:
    """libnvJitLink loaded through ctypes."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        self._lib = lib
        major, minor = ctypes.c_uint(), ctypes.c_uint()
        if lib.nvJitLinkVersion(ctypes.byref(major), ctypes.byref(minor)) != NVJITLINK_SUCCESS:
            raise ToolchainError(f"nvJitLinkVersion failed in {path}")
        self.version = (major.value, minor.value)
        lib.nvJitLinkCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint32, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvJitLinkAddData.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        lib.nvJitLinkComplete.argtypes = [ctypes.c_void_p]
        for name in ("nvJitLinkGetLinkedCubinSize", "nvJitLinkGetErrorLogSize", "nvJitLinkGetInfoLogSize"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for name in ("nvJitLinkGetLinkedCubin", "nvJitLinkGetErrorLog", "nvJitLinkGetInfoLog"):
            getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.nvJitLinkDestroy.argtypes = [ctypes.POINTER(ctypes.c_void_p)]

    def _log(self, handle: ctypes.c_void_p, kind: str) -> str:
        size = ctypes.c_size_t()
        if getattr(self._lib, f"nvJitLinkGet{kind}LogSize")(handle, ctypes.byref(size)) != NVJITLINK_SUCCESS:
            return ""
        buffer = ctypes.create_string_buffer(size.value + 1)
        getattr(self._lib, f"nvJitLinkGet{kind}Log")(handle, buffer)
        return buffer.value.decode(errors="replace")

    def link(self, arch: str, inputs: list[tuple[int, bytes, str]]) -> bytes:
        """Links (input type, data, name) inputs for `arch` (such as sm_90a) into a cubin."""
        options = (ctypes.c_char_p * 1)(f"-arch={arch}".encode())
        handle = ctypes.c_void_p()
        status = self._lib.nvJitLinkCreate(ctypes.byref(handle), 1, options)
        if status != NVJITLINK_SUCCESS:
            raise ToolchainError(f"nvJitLinkCreate(-arch={arch}) failed with status {status} ({self.path})")
        try:
            for kind, data, name in inputs:
                status = self._lib.nvJitLinkAddData(handle, kind, data, len(data), name.encode())
                if status != NVJITLINK_SUCCESS:
                    raise ToolchainError(
                        f"nvJitLink rejected {name} (status {status}, {self.path}):\n{self._log(handle, 'Error')}"
                    )
            status = self._lib.nvJitLinkComplete(handle)
            if status != NVJITLINK_SUCCESS:
                raise ToolchainError(
                    f"linking a Triton kernel with jaxgin's device library failed (nvJitLink status {status}, "
                    f"{self.path}):\n{self._log(handle, 'Error')}"
                )
            size = ctypes.c_size_t()
            self._lib.nvJitLinkGetLinkedCubinSize(handle, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self._lib.nvJitLinkGetLinkedCubin(handle, cubin)
            return cubin.raw
        finally:
            self._lib.nvJitLinkDestroy(ctypes.byref(handle))


@functools.cache
def nvjitlink() -> NvJitLink:
    """The nvJitLink to link with: one at least as new as the nvcc that built the device library
    (nvJitLink cannot read PTX or cubins of a newer CUDA)."""
    nvcc = _build.find_nvcc()
    needed = _cuda_release(nvcc)
    seen = []
    for candidate in _nvjitlink_candidates(nvcc):
        try:
            linker = NvJitLink(candidate)
        except (OSError, AttributeError, ToolchainError) as error:
            seen.append(f"{candidate}: {error}")
            continue
        if linker.version >= needed:
            return linker
        seen.append(f"{candidate}: version {linker.version[0]}.{linker.version[1]}")
    raise ToolchainError(
        f"tritongin links Triton kernels with nvJitLink, which must be at least as new as the nvcc that "
        f"compiles jaxgin's device library ({nvcc}, CUDA {needed[0]}.{needed[1]}); found "
        + ("; ".join(seen) if seen else "none")
        + f". Install it with: pip install 'nvidia-nvjitlink>={needed[0]}.{needed[1]}' (or set JAXGIN_NVJITLINK "
        "to a libnvJitLink.so of that CUDA release or newer)"
    )


@functools.cache
def library_key() -> str:
    """Identity of the device library kernels are linked with: NCCL, nvcc, nvJitLink, sources.
    Part of every tritongin kernel's Triton cache key."""
    nccl = _nccl.load()
    nvcc = _build.find_nvcc()
    digest = hashlib.sha256()
    for part in (
        _build.cache_key(nccl, "any-arch", nvcc, _build.sources_dir()),
        str(nvjitlink().version),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


@functools.cache
def _library_cubin(arch: str) -> bytes:
    """The device library's cubin, read once per process and arch (a build lookup hashes every
    source and runs nvcc; one NCCL per process, as library_key assumes too)."""
    return _build.device_library(_nccl.load(), arch).cubin.read_bytes()


def newest_ptx_isa(cuda: tuple[int, int]) -> tuple[int, int]:
    """The newest PTX ISA version a CUDA release's tools read (CUDA 12.9: 8.8, 13.0: 9.0)."""
    major, minor = cuda
    if major >= 13:
        return 9 + (major - 13), minor
    if major == 12:
        return 8, minor - 1 if minor >= 6 else minor
    raise ToolchainError(f"tritongin needs nvJitLink from CUDA 12 or newer, found {major}.{minor}")


_PTX_VERSION = re.compile(r"^(\s*\.version\s+)(\d+)\.(\d+)", re.MULTILINE)


def readable_ptx(ptx: str, linker: tuple[int, int]) -> str:
    """`ptx` declaring a PTX ISA version that nvJitLink of CUDA `linker` reads. Triton stamps the
    newest version its own ptxas knows (Triton 3.9: 9.4, from CUDA 13.4) over code generated for
    an older ISA (LLVM's features stop at 9.0 there); a GPU machine's nvJitLink may be older (CUDA
    13.0 reads up to 9.0). Lowered only down to what the linker reads: an instruction newer than
    that still fails the link, naming itself."""
    match = _PTX_VERSION.search(ptx)
    newest = newest_ptx_isa(linker)
    if match is None or (int(match.group(2)), int(match.group(3))) <= newest:
        return ptx
    return _PTX_VERSION.sub(lambda m: f"{m.group(1)}{newest[0]}.{newest[1]}", ptx, count=1)


def link_kernel(ptx: str, arch: str) -> bytes:
    """Triton's PTX of one kernel + the device library -> cubin for `arch`."""
    linker = nvjitlink()
    return linker.link(
        arch,
        [
            (NVJITLINK_INPUT_PTX, readable_ptx(ptx, linker.version).encode() + b"\0", "triton_kernel.ptx"),
            (NVJITLINK_INPUT_CUBIN, _library_cubin(arch), "jaxgin_device.cubin"),
        ],
    )


def _arch_of(ptx: str) -> str:
    match = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, flags=re.MULTILINE)
    if match is None:
        raise ToolchainError("Triton's PTX has no .target line; cannot tell which GPU to link for")
    return match.group(1)


def _linking_cubin_stage(triton_stage):
    def stage(src, metadata):
        if not library_calls(src):
            return triton_stage(src, metadata)
        return link_kernel(src, _arch_of(src))

    return stage


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Adds the link step to Triton's pipeline (once per process), chained after any earlier hook."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from triton import knobs  # Triton is optional: the rest of this module (nvJitLink, the library) works without it

        previous = knobs.runtime.add_stages_inspection_hook

        def hook(*args):
            # Newer Triton also calls the hook with no arguments, for a (key, hash) pair it adds to
            # every kernel's cache key. tritongin adds nothing there (its kernels carry the library
            # identity in their own key), so other kernels keep their keys; an earlier hook's pair
            # is passed through.
            if not args:
                return previous() if previous is not None else ("", "")
            if previous is not None:
                previous(*args)
            _backend, stages, _options, _language, _capability = args
            if "cubin" in stages:
                stages["cubin"] = _linking_cubin_stage(stages["cubin"])

        knobs.runtime.add_stages_inspection_hook = hook
        _installed = True
