"""Compiles jaxgin's CUDA code with nvcc against the headers of the NCCL loaded at run time.

NCCL's device API has no ABI stability across releases (struct layouts change between 2.28 and
2.32), so the device library, the kernels and the host runtime that fills their structs are all
built here, on the user's machine, against the exact NCCL in use, for the running GPU's arch.
NVRTC is not an option: it ignores trailing packed/aligned attributes in NCCL's headers and
silently changes struct layouts. Results are cached on disk, keyed by NCCL version, arch, nvcc
and a hash of the sources.

Outputs, in two cache entries:
  jaxgin_device.ptx     the device library as relocatable PTX, compiled into Triton kernels with
                        their own PTX (device_library(): all that Triton-only work needs, such as
                        compiling tritongin kernels on a machine without a GPU)
  jaxgin_device.cubin   the same compiled alone: ptxas's check, at build time, that every function
                        of the library compiles for the arch
  libjaxgin_backend.so  host runtime + kernels + device library, linked against NCCL's library
                        (loaded by jaxgin itself; build() makes both entries)
  generated/jaxgin_op_table.h  in each entry: the C++ header rendered from jaxgin/ffi/op_table.py
                        that its sources compiled with (op tags, targets' handlers, preload hooks,
                        attribute codes, constants); the table is part of the cache key

Pre-build (for example in a container image) with ``python -m jaxgin.build``.

A build that compiles (a cache miss: the first use on a machine, or after an upgrade of NCCL,
nvcc or jaxgin) takes minutes, so it reports its progress on stderr, a few short lines: what it
compiles and where it caches it, each step as it finishes, what is still compiling when nothing
finished for HEARTBEAT_S seconds, and the total time. JAXGIN_BUILD_PROGRESS=0 silences it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.ffi

from jaxgin import nccl as nccl_lib
from jaxgin import nvidia_packages, settings
from jaxgin.errors import ToolchainError, install_command
from jaxgin.ffi import op_table

# Every csrc file compiled into the backend: the rows of the op table, each op family's slice.
BACKEND_SOURCES = op_table.sources()
DEVICE_LIBRARY_SOURCE = "device/library.cu"
BACKEND_LIBRARY = "libjaxgin_backend.so"
COMMON_FLAGS = ("-std=c++17", "-O3", "-rdc=true", "-Xcompiler=-fPIC,-fvisibility=hidden")
# Where a build writes what it generates from jaxgin/ffi/op_table.py (op_table.HEADER), inside its
# own directory (kept in the cache entry: the header that build compiled with); every nvcc command
# has it on its include path.
GENERATED_DIR = "generated"
HEARTBEAT_S = 20.0  # a progress line at least this often while a build compiles


def sources_dir() -> Path:
    """csrc/ inside an installed wheel, or at the root of a source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parent / "csrc"):
        if (candidate / DEVICE_LIBRARY_SOURCE).exists():
            return candidate
    raise ToolchainError(f"jaxgin's CUDA sources are missing (looked in {here / 'csrc'} and {here.parent / 'csrc'})")


def default_cache_dir() -> Path:
    if settings.get("JAXGIN_CACHE_DIR"):
        return Path(settings.get("JAXGIN_CACHE_DIR"))
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxgin"


def arch_for(compute_capability: str) -> str:
    """'9.0' -> 'sm_90a': the arch-specific target, since the build is for the running GPU."""
    major, minor = (int(part) for part in str(compute_capability).split("."))
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def find_nvcc() -> Path:
    """nvcc from $JAXGIN_NVCC, $CUDA_HOME / $CUDA_PATH, PATH, or PyPI's nvidia-cuda-nvcc."""
    candidates: list[Path] = []
    if settings.get("JAXGIN_NVCC"):
        candidates.append(Path(settings.get("JAXGIN_NVCC")))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    candidates += [root / "cu13" / "bin" / "nvcc" for root in nvidia_packages.roots()]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ToolchainError(
        "jaxgin compiles its device code with nvcc against the NCCL in use, and found no nvcc "
        "(looked at $JAXGIN_NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH and PyPI's nvidia-cuda-nvcc). "
        f"Install it with: {install_command('cuda')} (or pip install nvidia-cuda-nvcc), or set CUDA_HOME to a CUDA "
        "toolkit"
    )


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ToolchainError(f"{nvcc} --version failed:\n{out.stdout}{out.stderr}")
    return out.stdout.strip().splitlines()[-1]


def cupti_include_dir(nvcc: Path) -> Path:
    """Where cupti.h is (the runtime records NCCL's allocations through CUPTI's callback API):
    beside nvcc's own headers in a CUDA toolkit, else PyPI's nvidia-cuda-cupti."""
    toolkit = nvcc.resolve().parent.parent
    candidates = [toolkit / "include", *sorted(toolkit.glob("targets/*/include"))]
    candidates += [root / "cu13" / "include" for root in nvidia_packages.roots()]
    for candidate in candidates:
        if (candidate / "cupti.h").is_file():
            return candidate
    raise ToolchainError(
        f"jaxgin's runtime includes CUPTI's headers and found no cupti.h (looked in {', '.join(map(str, candidates))}). "
        f"Install them with: {install_command('cuda')} (or pip install nvidia-cuda-cupti)"
    )


@dataclasses.dataclass(frozen=True)
class Artifacts:
    directory: Path  # the backend's cache entry, or the device library's where there is no backend
    backend: Path | None  # None for the device library alone (device_library(), or NCCL headers without a library)
    ptx: Path  # the device library's, in its own cache entry
    cubin: Path


def _source_digest(root: Path) -> str:
    digest = hashlib.sha256()
    # csrc/ext is the Python extension, built at install time: not part of the CUDA build.
    sources = (p for p in root.rglob("*") if p.suffix in (".h", ".cu", ".cuh") and p.relative_to(root).parts[0] != "ext")
    for path in sorted(sources):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def xla_ffi_include_dir() -> Path:
    """XLA's FFI headers, shipped with jaxlib (the handlers in csrc/ffi are compiled against them)."""
    return Path(jax.ffi.include_dir())


def _xla_ffi_digest() -> str:
    api = xla_ffi_include_dir() / "xla" / "ffi" / "api"
    digest = hashlib.sha256()
    for path in sorted(api.glob("*.h")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(nccl: nccl_lib.NcclInstall, arch: str, nvcc: Path, root: Path) -> str:
    digest = hashlib.sha256()
    for part in (
        _source_digest(root),
        op_table.header(),
        _xla_ffi_digest(),
        str(nccl.version),
        str(nccl.include_dir.resolve()),
        str(nccl.library.resolve()) if nccl.library else "no-library",
        arch,
        nvcc_version(nvcc),
        " ".join(COMMON_FLAGS),
        _gpu_code(arch),
    ):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:20]


def _run(command: list[str], cwd: Path) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ToolchainError(
            "compiling jaxgin's CUDA code failed.\ncommand: "
            + " ".join(command)
            + f"\nexit status {result.returncode}; full compiler output:\n{result.stdout}{result.stderr}"
        )


def _base_command(nvcc: Path, nccl: nccl_lib.NcclInstall, arch: str, root: Path, out: Path) -> list[str]:
    return [str(nvcc), *COMMON_FLAGS, f"-arch={arch}", f"-I{nccl.include_dir}", f"-I{root}", f"-I{out / GENERATED_DIR}"]


def write_generated(out: Path) -> Path:
    """Writes the header generated from the op table into build directory `out`; returns its path."""
    path = out / GENERATED_DIR / op_table.HEADER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(op_table.header())
    return path


def _device_library_commands(nvcc: Path, nccl: nccl_lib.NcclInstall, arch: str, root: Path,
                             out: Path) -> list[list[list[str]]]:
    """The device library alone, as PTX and as a relocatable cubin: one stage of two commands. Its
    registers are not capped here: a kernel compiled with its PTX caps itself (the fused kernels'
    two_programs_registers)."""
    base = _base_command(nvcc, nccl, arch, root, out)
    library = str(root / DEVICE_LIBRARY_SOURCE)
    return [[base + ["-ptx", library, "-o", str(out / "jaxgin_device.ptx")],
             base + ["-cubin", library, "-o", str(out / "jaxgin_device.cubin")]]]


def _gpu_code(arch: str) -> str:
    """nvcc's target for the backend's objects: `arch`'s machine code and PTX. -arch=sm_90a also
    compiles every source a second time, to a portable compute_90 PTX, which a build for the
    running GPU never loads: a quarter of each compile's CPU time."""
    virtual = "compute_" + arch.removeprefix("sm_")
    return f"-gencode=arch={virtual},code=[{arch},{virtual}]"


def _backend_commands(nvcc: Path, nccl: nccl_lib.NcclInstall, arch: str, root: Path,
                      out: Path) -> list[list[list[str]]]:
    """The backend library: every source compiled (one stage, compile_jobs() at a time), then one link."""
    base = [_gpu_code(arch) if part == f"-arch={arch}" else part
            for part in _base_command(nvcc, nccl, arch, root, out)]
    base += [f"-I{xla_ffi_include_dir()}", f"-I{cupti_include_dir(nvcc)}"]
    objects = [str(out / (source.replace("/", "_").removesuffix(".cu") + ".o")) for source in BACKEND_SOURCES]
    compile_stage = [base + ["-c", str(root / source), "-o", obj] for source, obj in zip(BACKEND_SOURCES, objects)]
    lib_dir = nccl.library.resolve().parent
    link = (
        [str(nvcc), f"-arch={arch}", "-shared", *objects]
        + [f"-L{lib_dir}", "-l:libnccl.so.2", "-ldl", f"-Xlinker=-rpath,{lib_dir}", "-o", str(out / BACKEND_LIBRARY)]
    )
    return [compile_stage, [link]]


def _step_name(command: list[str], root: Path) -> str:
    """What one nvcc command makes, for progress lines: 'kernels/exchange.cu', 'device/library.cu
    -> ptx', 'link libjaxgin_backend.so'."""
    output = Path(command[command.index("-o") + 1]).name
    if "-shared" in command:
        return f"link {output}"
    source = next(Path(part) for part in command if part.endswith(".cu"))
    name = str(source.relative_to(root)) if source.is_relative_to(root) else source.name
    return f"{name} -> {output.rsplit('.', 1)[-1]}" if "-c" not in command else name


class _Progress:
    """Progress lines of one build on stderr, each with the seconds since it started."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"jaxgin build [{time.monotonic() - self.start:5.0f} s] {text}", file=sys.stderr, flush=True)


def compile_jobs() -> int:
    """How many nvcc commands run at once: one per CPU this process may use. More only contend: on
    2 CPUs the full build took 231 s of CPU time with the backend's 20 compiles started together,
    186 s two at a time."""
    return len(os.sched_getaffinity(0))


def _run_stage(stage: list[list[str]], root: Path, progress: _Progress, done: int, total: int,
               jobs: int | None = None) -> int:
    """Runs one stage's commands, `jobs` (default compile_jobs()) at a time, reporting each as it
    finishes and, when nothing finished for HEARTBEAT_S seconds, what is still running; returns the
    steps done so far. The first failure cancels the commands not yet started."""
    with concurrent.futures.ThreadPoolExecutor(min(len(stage), jobs or compile_jobs())) as pool:
        names = {pool.submit(_run, c, root): _step_name(c, root) for c in stage}
        pending = set(names)
        try:
            while pending:
                finished, pending = concurrent.futures.wait(pending, timeout=HEARTBEAT_S,
                                                            return_when=concurrent.futures.FIRST_COMPLETED)
                for future in finished:
                    future.result()
                    done += 1
                    progress(f"{done}/{total} {names[future]}")
                if not finished:
                    running = sorted(names[f] for f in pending if f.running())
                    more = f" and {len(running) - 3} more" if len(running) > 3 else ""
                    waiting = f" ({len(pending) - len(running)} waiting)" if len(pending) > len(running) else ""
                    progress(f"still compiling {', '.join(running[:3])}{more}{waiting}")
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return done


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several processes of one job may build at once
        yield


def _cached(nccl: nccl_lib.NcclInstall, arch: str, commands, what: str, cache_dir: Path, *, verbose: bool,
            progress: bool) -> Path:
    """The cache entry that `commands` (nvcc, nccl, arch, root, out) -> stages fill, compiled under a
    lock unless it is complete; returns its directory."""
    nvcc = find_nvcc()
    root = sources_dir()
    name = f"nccl{nccl.version_string}-{arch}-{cache_key(nccl, arch, nvcc, root)}"
    final = cache_dir / name
    with _locked(cache_dir / f"{name}.lock"):
        if (final / "complete").exists():
            return final
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
        try:
            write_generated(staging)
            stages = commands(nvcc, nccl, arch, root, staging)
            total = sum(len(stage) for stage in stages)
            report = _Progress(progress)
            report(f"compiling {what} for NCCL {nccl.version_string}, {arch} with {nvcc}: {total} nvcc steps, once "
                   f"per NCCL, nvcc and jaxgin version (cached in {cache_dir})")
            done = 0
            for stage in stages:
                if verbose:
                    for command in stage:
                        print(" ".join(command), file=sys.stderr)
                done = _run_stage(stage, root, report, done, total)
            report(f"done: {final}")
            for obj in staging.glob("*.o"):
                obj.unlink()
            (staging / "complete").write_text(f"nvcc: {nvcc}\n")
            shutil.rmtree(final, ignore_errors=True)
            staging.rename(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _progress_default(progress: bool | None) -> bool:
    return settings.get("JAXGIN_BUILD_PROGRESS") != "0" if progress is None else progress


def device_library(nccl: nccl_lib.NcclInstall, arch: str, *, cache_dir: Path | None = None, verbose: bool = False,
                   progress: bool | None = None) -> Artifacts:
    """Builds (or finds in the cache) the device library alone for `nccl`'s headers and `arch`: what
    linking a Triton kernel needs, two nvcc steps where the backend takes twenty-one more. Its
    cache entry does not depend on NCCL's library, so build() shares it."""
    nccl_lib.check_version(nccl.version, str(nccl.include_dir))
    headers = dataclasses.replace(nccl, library=None)
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    directory = _cached(headers, arch, _device_library_commands, "jaxgin's device library", cache_dir,
                        verbose=verbose, progress=_progress_default(progress))
    return Artifacts(directory, None, directory / "jaxgin_device.ptx", directory / "jaxgin_device.cubin")


def build(nccl: nccl_lib.NcclInstall, arch: str, *, cache_dir: Path | None = None, verbose: bool = False,
          progress: bool | None = None) -> Artifacts:
    """Builds (or finds in the cache) jaxgin's CUDA code for `nccl` and `arch`: the device library
    and, when `nccl` has a library, the backend linked against it. A build that compiles reports its
    progress on stderr unless `progress` is False (default: on, unless JAXGIN_BUILD_PROGRESS=0);
    `verbose` also prints the nvcc commands."""
    nccl_lib.check_version(nccl.version, str(nccl.include_dir))
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    options = {"cache_dir": cache_dir, "verbose": verbose, "progress": _progress_default(progress)}
    library = device_library(nccl, arch, **options)
    if nccl.library is None:
        return library
    backend = _cached(nccl, arch, _backend_commands, "jaxgin's CUDA backend", **options)
    return dataclasses.replace(library, directory=backend, backend=backend / BACKEND_LIBRARY)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxgin.build",
        description="Pre-build jaxgin's CUDA backend and device library into the cache.",
    )
    parser.add_argument("--arch", help="target such as sm_90a (default: the first visible GPU's)")
    parser.add_argument("--nccl-include", type=Path, help="NCCL include dir (default: the NCCL jaxgin would load)")
    parser.add_argument("--nccl-library", type=Path, help="libnccl.so.2 to link the backend against")
    parser.add_argument("--cache-dir", type=Path, help=f"default: {default_cache_dir()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the nvcc commands")
    args = parser.parse_args(argv)
    if args.nccl_include:
        nccl = nccl_lib.NcclInstall(nccl_lib.header_version(args.nccl_include), args.nccl_include, args.nccl_library)
    else:
        nccl = nccl_lib.load()
    arch = args.arch
    if arch is None:
        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            parser.error("no GPU visible to JAX: pass --arch (for example --arch sm_90a)")
        arch = arch_for(gpus[0].compute_capability)
    artifacts = build(nccl, arch, cache_dir=args.cache_dir, verbose=args.verbose)
    print(f"NCCL {nccl.version_string} ({nccl.include_dir}), {arch}:")
    for path in (artifacts.backend, artifacts.ptx, artifacts.cubin):
        if path is not None:
            print(f"  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
