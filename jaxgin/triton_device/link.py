"""The link step: Triton's PTX + jaxgin's device library -> one cubin, compiled whole by ptxas.

A kernel that calls tritongin's device functions leaves them as external calls in its PTX, which
Triton's own ptxas stage cannot resolve. ``install()`` adds a Triton stages hook that replaces the
``cubin`` stage of exactly those kernels (their PTX names a ``jaxgin_`` function): the kernel's PTX
and the device library's PTX (built by nvcc for the NCCL in use) become one module, which the
ptxas of nvcc's toolkit compiles as a whole program. Every other kernel keeps Triton's stage
untouched. The hook chains to whatever hook was installed before it.

Why one module and not a link against a compiled library: ptxas serializes every asynchronous
matmul (wgmma) of a function that calls an external function (its advisory C7509), and the fused
matmul kernels lost about a fifth of their matmul speed to it. In one module the library's
functions are known to ptxas, which inlines or calls them without serializing.
Why the toolkit's ptxas: the library's PTX comes from that toolkit's nvcc, whose PTX ISA Triton's
own ptxas may not read. Why not LLVM bitcode through Triton's ``extern_libs``: the library is
compiled by nvcc against NCCL's headers, and nvcc's NVVM IR is not Triton's LLVM.

Triton caches compiled kernels by a key it computes before any stage runs, so the identity of the
library compiled in (NCCL, nvcc, sources, this link scheme) reaches that key through tritongin's
device functions themselves (see ``language.py``): a kernel that calls them can never be served a
cubin built against another NCCL.
"""

from __future__ import annotations

import functools
import hashlib
import re
import subprocess
import tempfile
import threading
from pathlib import Path

from jaxgin import build as _build
from jaxgin import nccl as _nccl
from jaxgin.errors import ToolchainError

# A whole declaration of an external function (return parameter, name, parameter list). Device
# functions of the library are named jaxgin_*; an undefined one in Triton's PTX is what marks a
# kernel to be linked.
LIBRARY_PREFIX = "jaxgin_"
_EXTERN_DECLARATION = re.compile(r"^[ \t]*\.extern\s+\.func\s+(?:\([^)]*\)\s*)?(\w+)\s*\([^)]*\)\s*;[ \t]*\n?",
                                 re.MULTILINE)
_MODULE_HEADER = re.compile(r"^[ \t]*\.(version|target|address_size)\s+([^\s/]+)[^\n]*\n?", re.MULTILINE)
# Module-scope data private to a module (strings, tables nvcc names $str, __unnamed_1, ...): the
# library's get names of their own so that they cannot clash with the kernel's.
_PRIVATE_GLOBAL = re.compile(r"^[ \t]*\.global\s[^\n=;]*?([A-Za-z_$%][\w$]*)\s*(?:\[[^\]]*\])?\s*[=;]", re.MULTILINE)
# Bumped when the way kernels are linked changes: part of every tritongin kernel's cache key.
LINK_SCHEME = "one-module-ptxas-1"


def library_calls(ptx: str) -> list[str]:
    """Names of device-library functions that `ptx` calls but does not define."""
    return sorted({name for name in _EXTERN_DECLARATION.findall(ptx) if name.startswith(LIBRARY_PREFIX)})


def _cuda_release(tool: Path) -> tuple[int, int]:
    out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, check=False)
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if out.returncode != 0 or match is None:
        raise ToolchainError(f"cannot read the CUDA release of {tool}:\n{out.stdout}{out.stderr}")
    return int(match.group(1)), int(match.group(2))


@functools.cache
def ptxas() -> tuple[Path, tuple[int, int]]:
    """The ptxas that compiles linked kernels, the one beside the nvcc that builds the device
    library (it reads what that nvcc writes), and its CUDA release."""
    nvcc = _build.find_nvcc()
    path = nvcc.resolve().parent / "ptxas"
    if not path.is_file():
        raise ToolchainError(
            f"tritongin compiles kernels that call jaxgin's device library with the ptxas of the toolkit whose nvcc "
            f"builds the library ({nvcc}), and {path.parent} has no ptxas. Install a complete toolkit there (PyPI's "
            "nvidia-cuda-nvcc has both), or point JAXGIN_NVCC or CUDA_HOME at one")
    return path, _cuda_release(path)


@functools.cache
def library_key() -> str:
    """Identity of the device library kernels are linked with: NCCL, nvcc, ptxas, sources and the
    link scheme. Part of every tritongin kernel's Triton cache key."""
    nccl = _nccl.load()
    nvcc = _build.find_nvcc()
    digest = hashlib.sha256()
    for part in (
        _build.cache_key(nccl, "any-arch", nvcc, _build.sources_dir()),
        str(ptxas()[1]),
        LINK_SCHEME,
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


@functools.cache
def _library_ptx(arch: str) -> str:
    """The device library's PTX, read once per process and arch (a build lookup hashes every
    source and runs nvcc; one NCCL per process, as library_key assumes too)."""
    return _build.device_library(_nccl.load(), arch).ptx.read_text()


def newest_ptx_isa(cuda: tuple[int, int]) -> tuple[int, int]:
    """The newest PTX ISA version a CUDA release's tools read (CUDA 12.9: 8.8, 13.0: 9.0)."""
    major, minor = cuda
    if major >= 13:
        return 9 + (major - 13), minor
    if major == 12:
        return 8, minor - 1 if minor >= 6 else minor
    raise ToolchainError(f"tritongin needs a ptxas from CUDA 12 or newer, found {major}.{minor}")


_PTX_VERSION = re.compile(r"^(\s*\.version\s+)(\d+)\.(\d+)", re.MULTILINE)


def readable_ptx(ptx: str, release: tuple[int, int]) -> str:
    """`ptx` declaring a PTX ISA version that ptxas of CUDA `release` reads. Triton stamps the
    newest version its own ptxas knows (Triton 3.9: 9.4, from CUDA 13.4) over code generated for
    an older ISA (LLVM's features stop at 9.0 there); a GPU machine's toolkit may be older (CUDA
    13.0 reads up to 9.0). Lowered only down to what ptxas reads: an instruction newer than that
    still fails the compile, naming itself."""
    match = _PTX_VERSION.search(ptx)
    newest = newest_ptx_isa(release)
    if match is None or (int(match.group(2)), int(match.group(3))) <= newest:
        return ptx
    return _PTX_VERSION.sub(lambda m: f"{m.group(1)}{newest[0]}.{newest[1]}", ptx, count=1)


def _header(ptx: str, what: str) -> dict[str, str]:
    found = {name: value for name, value in _MODULE_HEADER.findall(ptx)}
    missing = {"version", "target", "address_size"} - found.keys()
    if missing:
        raise ToolchainError(f"{what} has no .{' / .'.join(sorted(missing))} line; cannot combine it into one module")
    return found


def one_module(kernel_ptx: str, library_ptx: str) -> str:
    """One PTX module: the library's functions, then the kernel, whose declarations of them are
    dropped. The newer of the two ISA versions heads it; the targets must agree."""
    kernel, library = _header(kernel_ptx, "the kernel's PTX"), _header(library_ptx, "the device library's PTX")
    for field in ("target", "address_size"):
        if kernel[field] != library[field]:
            raise ToolchainError(
                f"the kernel's PTX is for .{field} {kernel[field]} and the device library's for {library[field]}: "
                "build the library for the kernel's target (jaxgin.build.arch_for of the GPU it runs on)")
    version = max((kernel["version"], library["version"]), key=lambda v: tuple(map(int, v.split("."))))
    kernel_body = _EXTERN_DECLARATION.sub(
        lambda m: "" if m.group(1).startswith(LIBRARY_PREFIX) else m.group(0), _MODULE_HEADER.sub("", kernel_ptx))
    declared = set(_EXTERN_DECLARATION.findall(kernel_body))
    library_body = _EXTERN_DECLARATION.sub(lambda m: "" if m.group(1) in declared else m.group(0),
                                           _MODULE_HEADER.sub("", library_ptx))
    private = sorted(set(_PRIVATE_GLOBAL.findall(library_body)), key=len, reverse=True)
    if private:
        names = re.compile(r"(?<![\w$%])(" + "|".join(map(re.escape, private)) + r")(?![\w$])")
        library_body = names.sub(lambda m: "jaxgin_library_" + m.group(1), library_body)
    return (f".version {version}\n.target {kernel['target']}\n.address_size {kernel['address_size']}\n\n"
            f"// jaxgin's device library\n{library_body}\n// the Triton kernel\n{kernel_body}")


def compile_module(module: str, arch: str, options: tuple[str, ...] = ()) -> tuple[bytes, str]:
    """`module` (whole PTX, nothing external but CUDA's own) -> (cubin, ptxas's log), with the
    toolkit's ptxas. A failed compile raises, keeping the module for the command it names."""
    path, _release = ptxas()
    work = Path(tempfile.mkdtemp(prefix="jaxgin-link-"))
    source, cubin = work / "kernel.ptx", work / "kernel.cubin"
    source.write_text(module)
    command = [str(path), *options, "-v", f"--gpu-name={arch}", str(source), "-o", str(cubin)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ToolchainError(
            "compiling a Triton kernel with jaxgin's device library failed.\ncommand: " + " ".join(command)
            + f"\nexit status {result.returncode}; ptxas's output:\n{result.stdout}{result.stderr}")
    data = cubin.read_bytes()
    source.unlink()
    cubin.unlink()
    work.rmdir()
    return data, result.stdout + result.stderr


def ptxas_options(fp_fusion: bool = True, extra: str | None = None) -> tuple[str, ...]:
    """The options Triton's own ptxas stage would pass for a kernel compiled with these options
    (line info; no fused multiply-add when fp fusion is off; the kernel's ptx_options)."""
    return ("-lineinfo", *(() if fp_fusion else ("--fmad=false",)), *(extra.split() if extra else ()))


def link_kernel(ptx: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """Triton's PTX of one kernel + the device library -> cubin for `arch`."""
    _path, release = ptxas()
    return compile_module(one_module(readable_ptx(ptx, release), _library_ptx(arch)), arch, options)[0]


def _arch_of(ptx: str) -> str:
    match = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, flags=re.MULTILINE)
    if match is None:
        raise ToolchainError("Triton's PTX has no .target line; cannot tell which GPU to link for")
    return match.group(1)


def _linking_cubin_stage(triton_stage, options):
    def stage(src, metadata):
        if not library_calls(src):
            return triton_stage(src, metadata)
        return link_kernel(src, _arch_of(src), ptxas_options(getattr(options, "enable_fp_fusion", True),
                                                             getattr(options, "ptx_options", None)))

    return stage


_install_lock = threading.Lock()
_installed = False


def install() -> None:
    """Adds the link step to Triton's pipeline (once per process), chained after any earlier hook."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from triton import knobs  # Triton is optional: the rest of this module (ptxas, the library) works without it

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
            _backend, stages, options, _language, _capability = args
            if "cubin" in stages:
                stages["cubin"] = _linking_cubin_stage(stages["cubin"], options)

        knobs.runtime.add_stages_inspection_hook = hook
        _installed = True
