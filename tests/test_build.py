"""Compiling jaxgin's CUDA code with nvcc, on a machine without a GPU.

Builds run against every NCCL at hand: the nvidia-nccl-cu13 package's, plus each root listed in
JAXGIN_EXTRA_NCCL_ROOTS (os.pathsep-separated; a root holds include/nccl.h and, optionally,
lib/libnccl.so.2). Tests that need nvcc skip without one, unless JAXGIN_REQUIRE_NVCC=1 (CI).
Each (NCCL, arch) is built once per module and shared by the tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxgin import build, nccl
from jaxgin.errors import NcclError, ToolchainError, install_command
from jaxgin.ffi import op_table

ARCH = "sm_90a"
EM_CUDA = 190  # ELF e_machine of NVIDIA cubins
HEADER = Path(build.__file__).resolve().parent.parent / "csrc" / "device" / "jaxgin_device.h"


def declared_functions() -> list[str]:
    """Every device function csrc/device/jaxgin_device.h declares."""
    text = HEADER.read_text()
    names = re.findall(r"^\s*__device__\s+(?:const\s+)?\w+[\s*]+(jaxgin_\w+)\s*\(", text, flags=re.MULTILINE)
    return sorted(set(names))


def _installs() -> list[nccl.NcclInstall]:
    """The NCCLs to build against, one per version (first seen wins)."""
    found: list[nccl.NcclInstall] = []
    packaged = nccl.packaged_install()
    if packaged is not None:
        found.append(packaged)
    for root in filter(None, os.environ.get("JAXGIN_EXTRA_NCCL_ROOTS", "").split(os.pathsep)):
        include, library = Path(root) / "include", Path(root) / "lib" / "libnccl.so.2"
        install = nccl.NcclInstall(nccl.header_version(include), include, library if library.exists() else None)
        if all(install.version != other.version for other in found):
            found.append(install)
    return found


INSTALLS = _installs()


def _id(install: nccl.NcclInstall) -> str:
    return f"nccl{install.version_string}" + ("" if install.library else "-headers")


@pytest.fixture(scope="module", params=INSTALLS, ids=[_id(i) for i in INSTALLS])
def built(request, nvcc):
    """(install, artifacts, seconds the build took), built once per NCCL for this module."""
    install = request.param
    start = time.monotonic()
    artifacts = build.build(install, ARCH, cache_dir=build.default_cache_dir())
    return install, artifacts, time.monotonic() - start


def test_there_is_an_nccl_to_build_against(packaged_nccl):
    assert INSTALLS and INSTALLS[0] == packaged_nccl
    assert packaged_nccl.version >= nccl.MINIMUM_VERSION
    assert packaged_nccl.include_dir.joinpath("nccl.h").is_file()


def test_header_declares_the_device_api():
    names = declared_functions()
    for name in ("jaxgin_rank", "jaxgin_world_size", "jaxgin_put_signal", "jaxgin_signal", "jaxgin_wait_signal",
                 "jaxgin_barrier", "jaxgin_peer_ptr", "jaxgin_flush"):
        assert name in names
    assert len(names) >= 10


def test_ptx_defines_every_declared_function(built):
    install, artifacts, _ = built
    ptx = artifacts.ptx.read_text()
    assert re.search(rf"^\.target\s+{ARCH}\b", ptx, flags=re.MULTILINE), "PTX is not for " + ARCH
    missing = [
        name
        for name in declared_functions()
        if not re.search(rf"^\.visible\s+\.func\s+(?:\([^)]*\)\s*)?{name}\s*\(", ptx, flags=re.MULTILINE)
    ]
    assert not missing, f"{artifacts.ptx} (NCCL {install.version_string}) lacks definitions of {missing}"



def ptx_function(ptx: str, name: str) -> str:
    """The PTX text of function `name`, up to the next function or kernel."""
    start = re.search(rf"^\.visible\s+\.func\s+(?:\([^)]*\)\s*)?{name}\s*\(", ptx, flags=re.MULTILINE)
    assert start, f"no function {name}"
    end = re.search(r"^(?:\.visible|\.weak|\.extern)?\s*\.(?:func|entry)\b", ptx[start.end():], flags=re.MULTILINE)
    return ptx[start.start():start.end() + (end.start() if end else len(ptx))]


# NCCL's GIN backends other than GDAKI, switched off (gin_device_common.h): ncclGin then reaches
# GDAKI alone.
GDAKI_ALONE = ["-DNCCL_GIN_PROXY_ENABLE=0", "-DNCCL_GIN_GPI_ENABLE=0", "-DNCCL_GIN_EFA_GDA_ENABLE=0"]
SYSTEM_RELEASE = re.compile(r"^\s*(?:fence\.(?:acq_rel|release|sc)\.sys|membar\.sys)\s*;", flags=re.MULTILINE)


@pytest.mark.parametrize("install", INSTALLS, ids=[_id(i) for i in INSTALLS])
def test_signals_release_at_system_scope_over_gdaki(install, nvcc, tmp_path):
    """Issue 51, risk 1: jaxgin_signal and jaxgin_barrier order the CTA's earlier writes before
    their signal at system scope, so NVLink stores through jaxgin_peer_ptr are visible to whoever
    sees the signal, also when it goes through GIN. NCCL's GDAKI backend on its own releases at
    GPU scope only (gin_gdaki.h), so the library fences itself. Read in the device library's PTX
    compiled for GDAKI alone: with NCCL's proxy backend in, the proxy's own system-scope release
    (it always makes one) would be there either way."""
    root = build.sources_dir()
    build.write_generated(tmp_path)
    out = tmp_path / "jaxgin_device_gdaki.ptx"
    build._run(build._base_command(nvcc, install, ARCH, root, tmp_path) + GDAKI_ALONE
               + ["-ptx", str(root / build.DEVICE_LIBRARY_SOURCE), "-o", str(out)], tmp_path)
    ptx = out.read_text()
    for name in ("jaxgin_signal", "jaxgin_barrier"):
        assert SYSTEM_RELEASE.search(ptx_function(ptx, name)), (
            f"{name} (NCCL {install.version_string}, GDAKI alone) has no system-scope release fence")

def test_cubin_is_a_cuda_elf_with_every_function(built):
    _, artifacts, _ = built
    data = artifacts.cubin.read_bytes()
    assert data[:4] == b"\x7fELF", f"{artifacts.cubin} is not an ELF file"
    assert int.from_bytes(data[18:20], "little") == EM_CUDA
    for name in declared_functions():
        assert name.encode() + b"\0" in data, f"{name} is not a symbol of {artifacts.cubin}"


def test_backend_library(built):
    install, artifacts, _ = built
    if install.library is None:
        assert artifacts.backend is None
        assert not (artifacts.directory / "libjaxgin_backend.so").exists()
        return
    data = artifacts.backend.read_bytes()
    assert data[:4] == b"\x7fELF" and int.from_bytes(data[16:18], "little") == 3  # ET_DYN: a shared library


def _source_backend_abi() -> int:
    text = (build.sources_dir() / "runtime" / "backend_api.h").read_text()
    return int(re.search(r"^#define\s+JAXGIN_BACKEND_ABI\s+(\d+)", text, flags=re.MULTILINE).group(1))


def test_extension_matches_the_sources():
    """The installed extension speaks the backend ABI of these sources: after a change of the C ABI
    (csrc/runtime/backend_api.h) the extension must be rebuilt, or no backend built from the
    sources loads. Needs no nvcc."""
    from jaxgin import _jaxgin_ext as ext

    assert ext.BACKEND_ABI == _source_backend_abi(), (
        f"the installed jaxgin extension ({ext.__file__}) has backend ABI {ext.BACKEND_ABI} but the sources "
        f"define {_source_backend_abi()}: it is stale; reinstall it with `pip install -e .` from the checkout"
    )


def test_backend_reports_nccl_versions(built):
    """The backend loads without a GPU and reports the NCCL it runs with and was compiled against.

    Runs in a subprocess: a process can hold only one libnccl.so.2, and each install has its own.
    """
    install, artifacts, _ = built
    if install.library is None:
        pytest.skip(f"NCCL {install.version_string} at {install.include_dir} has headers only")
    code = (
        "import sys; from jaxgin import _jaxgin_ext as ext; "
        "b = ext.Backend(sys.argv[1]); assert b.path == sys.argv[1]; print(*b.nccl_versions())"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(artifacts.backend)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded, compiled = map(int, result.stdout.split())
    assert (loaded, compiled) == (install.version, install.version)


_SETTLE_PROBE = """
import ctypes, sys, threading
from jaxgin import _jaxgin_ext as ext
ext.Backend(sys.argv[1])  # loads the backend with the NCCL it was built against
backend = ctypes.CDLL(sys.argv[1])
settled = backend.jaxgin_other_threads_settled
settled.argtypes = [ctypes.c_int32, ctypes.c_char_p, ctypes.c_uint64]
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_void_p
libc.pthread_setname_np.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
libc.memchr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
stop, nccl_stop, ids = threading.Event(), threading.Event(), []
def spin(event):
    ids.append(threading.get_native_id())
    while not event.is_set():
        pass
def spin_natively(event):  # outside the GIL (ctypes lets it go), so the Python spinner keeps running
    libc.pthread_setname_np(libc.pthread_self(), b"NCCL GIN 0")
    ids.append(threading.get_native_id())
    memory = ctypes.create_string_buffer(64 << 20)
    while not event.is_set():
        libc.memchr(memory, 1, len(memory))
nccl = threading.Thread(target=spin_natively, args=(nccl_stop,))  # as NCCL's progress thread after an abort
nccl.start()
while len(ids) < 1:
    pass
worker = threading.Thread(target=spin, args=(stop,))
worker.start()
while len(ids) < 2:
    pass
out = ctypes.create_string_buffer(4096)
busy = settled(300, out, len(out)), out.value.decode()
stop.set()
worker.join()
after = settled(2000, out, len(out))
nccl_stop.set()
nccl.join()
print(ids[1], busy[0], after, repr(busy[1]))
"""


def test_a_broken_gpu_is_reset_only_once_the_other_threads_sleep(built):
    """The wait before finalize() resets a GPU after a fault (csrc/runtime/thread_settle.h): a
    thread that still runs (as XLA's did, finishing the faulted program, when a reset under it
    crashed the process) holds it back until the timeout and is named; once it ended, the wait
    returns at once, though a thread named as NCCL's (which may poll host memory after an abort)
    still spins. Needs no GPU."""
    install, artifacts, _ = built
    if install.library is None:
        pytest.skip(f"NCCL {install.version_string} at {install.include_dir} has headers only")
    result = subprocess.run([sys.executable, "-c", _SETTLE_PROBE, str(artifacts.backend)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tid, while_spinning, after, busy = result.stdout.split(maxsplit=3)
    assert while_spinning == "0" and f"({tid})" in busy and "NCCL" not in busy, result.stdout
    assert after == "1", result.stdout  # NCCL's thread still spins: it does not hold the reset back


_TABLE_PROBE = """
import ctypes, json, sys
lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int64(); constants = {}
for name in json.loads(sys.argv[2]):
    assert lib.jaxgin_constant(name.encode(), ctypes.byref(v)) == 0, name
    constants[name] = v.value
assert lib.jaxgin_constant(b"no_such_constant", ctypes.byref(v)) == -1
symbols = {name: hasattr(lib, name) for name in json.loads(sys.argv[3])}
print(json.dumps([constants, symbols]))
"""


def test_backend_compiled_the_op_table(built):
    """The build renders jaxgin/ffi/op_table.py into the header its sources compile with: each
    cache entry keeps the header it used, which is the table's, and the backend exports the
    table's constants with the table's values and every handler under the table's name."""
    install, artifacts, _ = built
    for entry in {artifacts.directory, artifacts.ptx.parent}:
        assert (entry / build.GENERATED_DIR / op_table.HEADER).read_text() == op_table.header()
    if install.library is None:
        pytest.skip(f"NCCL {install.version_string} at {install.include_dir} has headers only")
    symbols = [s for target in op_table.targets() for s in op_table.handler_symbols(target)]
    symbols += [s for family in op_table.FAMILIES for state in family.state_types for s in (state.type_id, state.type_info)]
    result = subprocess.run([sys.executable, "-c", _TABLE_PROBE, str(artifacts.backend), json.dumps(list(op_table.CONSTANTS)),
                             json.dumps(symbols)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    constants, exported = json.loads(result.stdout)
    assert constants == dict(op_table.CONSTANTS)
    assert exported == {symbol: True for symbol in symbols}


def test_every_compile_sees_the_generated_header_and_the_tables_sources(tmp_path, nvcc, packaged_nccl):
    """Every nvcc command has the build directory's generated/ on its include path, the backend
    compiles exactly the table's sources, and the table is part of the cache key."""
    root = build.sources_dir()
    include = f"-I{tmp_path / build.GENERATED_DIR}"
    (device,) = build._device_library_commands(nvcc, packaged_nccl, ARCH, root, tmp_path)
    compiles, (link,) = build._backend_commands(nvcc, packaged_nccl, ARCH, root, tmp_path)
    for command in device + compiles:
        assert include in command, command
    assert [next(p for p in c if p.endswith(".cu")) for c in compiles] == [str(root / s) for s in op_table.sources()]
    assert build.BACKEND_SOURCES == op_table.sources()
    assert build.write_generated(tmp_path).read_text() == op_table.header()


def test_cache_key_follows_the_op_table(monkeypatch, nvcc, packaged_nccl):
    root = build.sources_dir()
    key = build.cache_key(packaged_nccl, ARCH, nvcc, root)
    monkeypatch.setattr(op_table, "header", lambda: "// another table\n")
    assert build.cache_key(packaged_nccl, ARCH, nvcc, root) != key


def test_python_reserved_heap_bytes_equal_the_backend_ones(built):
    """The heap layout jaxgin reserves for itself is computed on both sides (Python checks heap sizes
    before a backend exists); the backend's jaxgin_reserved_heap_bytes is the definition."""
    install, artifacts, _ = built
    if install.library is None:
        pytest.skip(f"NCCL {install.version_string} at {install.include_dir} has headers only")
    from jaxgin import runtime

    configs = [(signals, slots, world, lanes, ring_slots, slot_bytes)
               for signals, slots in ((1, 1), (511, 0), (1024, 256), (1 << 20, 1 << 20))
               for world in (1, 2, 8, 64)
               for lanes, ring_slots, slot_bytes in ((1, 2, 4096), (4, 2, 256 << 10), (64, 3, 1 << 20))]
    code = (
        "import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); f = lib.jaxgin_reserved_heap_bytes\n"
        "f.restype = ctypes.c_uint64\n"
        "f.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint64]\n"
        "for line in sys.stdin: print(f(*map(int, line.split())))"
    )
    result = subprocess.run([sys.executable, "-c", code, str(artifacts.backend)], capture_output=True, text=True,
                            timeout=120, input="".join(" ".join(map(str, c)) + "\n" for c in configs))
    assert result.returncode == 0, result.stderr
    backend = [int(v) for v in result.stdout.split()]
    python = [runtime.reserved_bytes(s, b, w, runtime.ChannelShape(lanes, slots, slot_bytes))
              for s, b, w, lanes, slots, slot_bytes in configs]
    assert backend == python


def test_artifacts_layout(built):
    """The device library has a cache entry of its own, which the backend's entry (where there is a
    library to link against) does not repeat: Triton's link step needs only the former."""
    install, artifacts, _ = built
    library = artifacts.ptx.parent
    assert artifacts.cubin.parent == library
    for entry in (artifacts.directory, library):
        assert entry.parent == build.default_cache_dir()
        assert entry.name.startswith(f"nccl{install.version_string}-{ARCH}-")
        assert (entry / "complete").exists()
    assert build.device_library(install, ARCH) == dataclasses.replace(artifacts, directory=library, backend=None)
    if install.library is None:
        assert artifacts.directory == library
    else:
        assert artifacts.directory != library
        assert sorted(p.name for p in artifacts.directory.iterdir()) == ["complete", "generated", build.BACKEND_LIBRARY]
        assert sorted(p.name for p in library.iterdir()) == ["complete", "generated", "jaxgin_device.cubin",
                                                             "jaxgin_device.ptx"]
    # No staging directories are left behind.
    assert not [p for p in artifacts.directory.parent.iterdir() if p.name.startswith(".")]


def test_second_build_hits_the_cache(built, monkeypatch):
    install, first, _ = built
    real_run = subprocess.run
    calls = []

    def run(command, *args, **kwargs):
        calls.append(list(command))
        if list(command)[1:] == ["--version"]:  # the cache key includes nvcc's version
            return real_run(command, *args, **kwargs)
        raise AssertionError(f"a cached build ran {command}")

    monkeypatch.setattr(subprocess, "run", run)
    start = time.monotonic()
    again = build.build(install, ARCH, cache_dir=build.default_cache_dir())
    elapsed = time.monotonic() - start
    assert again == first
    assert all(c[1:] == ["--version"] for c in calls)
    assert elapsed < 5, f"a cached build took {elapsed:.1f} s"


def _copy_sources(tmp_path: Path) -> Path:
    root = tmp_path / "src" / "csrc"
    shutil.copytree(build.sources_dir(), root)
    return root


def test_cache_key_follows_the_sources(tmp_path, nvcc, packaged_nccl):
    original = build.sources_dir()
    copy = _copy_sources(tmp_path)
    key = build.cache_key(packaged_nccl, ARCH, nvcc, original)
    assert build.cache_key(packaged_nccl, ARCH, nvcc, copy) == key  # where the sources lie does not matter
    header = copy / "device" / "jaxgin_device.h"
    header.write_text(header.read_text() + "\n// changed\n")
    changed = build.cache_key(packaged_nccl, ARCH, nvcc, copy)
    assert changed != key
    impl = sorted((copy / "device" / "impl").glob("*.h"))[0]
    impl.write_text(impl.read_text() + "\n")
    assert build.cache_key(packaged_nccl, ARCH, nvcc, copy) not in (key, changed)
    new_file = copy / "kernels" / "extra.cu"
    before = build.cache_key(packaged_nccl, ARCH, nvcc, copy)
    new_file.write_text("// a new source file\n")
    assert build.cache_key(packaged_nccl, ARCH, nvcc, copy) != before


def test_cache_key_follows_arch_and_nccl(nvcc, packaged_nccl, tmp_path):
    root = build.sources_dir()
    key = build.cache_key(packaged_nccl, ARCH, nvcc, root)
    assert build.cache_key(packaged_nccl, ARCH, nvcc, root) == key  # deterministic
    assert build.cache_key(packaged_nccl, "sm_100a", nvcc, root) != key
    headers_only = nccl.NcclInstall(packaged_nccl.version, packaged_nccl.include_dir, None)
    assert build.cache_key(headers_only, ARCH, nvcc, root) != key


def test_compile_error_reports_command_and_compiler_output(tmp_path, monkeypatch, nvcc, packaged_nccl):
    root = _copy_sources(tmp_path)
    library = root / "device" / "library.cu"
    text = library.read_text()
    marker = '#include "jaxgin_device.h"\n'
    assert marker in text
    library.write_text(text.replace(marker, marker + "int jaxgin_injected_error = ;\n", 1))
    monkeypatch.setattr(build, "sources_dir", lambda: root)
    headers_only = nccl.NcclInstall(packaged_nccl.version, packaged_nccl.include_dir, None)  # two quick commands
    with pytest.raises(ToolchainError) as excinfo:
        build.build(headers_only, ARCH, cache_dir=tmp_path / "cache")
    message = str(excinfo.value)
    assert str(nvcc) in message and f"-arch={ARCH}" in message and str(library) in message  # the command
    assert "error" in message and "library.cu(" in message  # the compiler's own diagnostic, with its line
    assert "expected an expression" in message
    # A failed build leaves nothing that a later build could take for a finished one.
    cache = tmp_path / "cache"
    assert not [p for p in cache.iterdir() if p.is_dir()]


def test_no_nvcc(tmp_path, monkeypatch):
    for var in ("JAXGIN_NVCC", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(build.nvidia_packages, "roots", list)  # no nvidia-* wheel installed
    with pytest.raises(ToolchainError, match=re.escape(f"Install it with: {install_command('cuda')} (or pip")):
        build.find_nvcc()


def test_nvcc_from_environment_wins(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.9'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("JAXGIN_NVCC", str(fake))
    assert build.find_nvcc() == fake
    assert build.nvcc_version(fake) == "Cuda compilation tools, release 99.9"
    monkeypatch.delenv("JAXGIN_NVCC")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert build.find_nvcc() == fake


def test_cupti_headers_are_found_beside_nvcc_or_reported(tmp_path, monkeypatch):
    """The runtime includes cupti.h: a toolkit's own copy wins; without one, and without PyPI's
    nvidia-cuda-cupti, the build says what to install."""
    nvcc = tmp_path / "toolkit" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("")
    monkeypatch.setattr(build.nvidia_packages, "roots", list)  # no nvidia-* wheel installed
    with pytest.raises(ToolchainError, match=re.escape(f"{install_command('cuda')} (or pip install nvidia-cuda-cupti)")):
        build.cupti_include_dir(nvcc)
    headers = tmp_path / "toolkit" / "targets" / "x86_64-linux" / "include"
    headers.mkdir(parents=True)
    (headers / "cupti.h").write_text("")
    assert build.cupti_include_dir(nvcc) == headers


def test_failing_nvcc_version(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(ToolchainError, match="broken"):
        build.nvcc_version(fake)


def test_nccl_too_old():
    with pytest.raises(NcclError, match=r"2\.28") as excinfo:
        nccl.check_version(22703, "x")
    assert "2.27.3" in str(excinfo.value) and "(x)" in str(excinfo.value)
    nccl.check_version(nccl.MINIMUM_VERSION, "x")  # 2.28.0 is new enough


def test_build_refuses_old_nccl_headers(tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_VERSION_CODE 22703\n")
    version = nccl.header_version(include)
    assert version == 22703
    old = nccl.NcclInstall(version, include, None)
    assert old.version_string == "2.27.3"
    with pytest.raises(NcclError, match=r"NCCL >= 2\.28"):
        build.build(old, ARCH, cache_dir=tmp_path / "cache")


def test_header_version_errors(tmp_path):
    with pytest.raises(NcclError, match="JAXGIN_NCCL_INCLUDE"):
        nccl.header_version(tmp_path / "nowhere")
    (tmp_path / "nccl.h").write_text("// not NCCL\n")
    with pytest.raises(NcclError, match="NCCL_VERSION_CODE"):
        nccl.header_version(tmp_path)


@pytest.mark.parametrize(
    "capability, arch", [("9.0", "sm_90a"), ("8.0", "sm_80"), ("8.6", "sm_86"), ("10.0", "sm_100a"), ("12.0", "sm_120a")]
)
def test_arch_for(capability, arch):
    assert build.arch_for(capability) == arch


def _headers_only(packaged_nccl) -> nccl.NcclInstall:
    return nccl.NcclInstall(packaged_nccl.version, packaged_nccl.include_dir, None)


def _write_output(command, cwd):
    """Stands in for build._run: writes the file nvcc would (the compiles themselves are the
    `built` fixture's, shared by the session; no test compiles the device library again)."""
    Path(command[command.index("-o") + 1]).write_bytes(b"\x7fELF")


def test_build_reports_progress_on_stderr(tmp_path, capfd, monkeypatch, nvcc, packaged_nccl):
    """A build that compiles says what, where it caches it, and each step with the seconds elapsed;
    stdout stays clean. The lazy first-use build (initialize() on GPUs) is this same function."""
    monkeypatch.setattr(build, "_run", _write_output)
    artifacts = build.build(_headers_only(packaged_nccl), ARCH, cache_dir=tmp_path / "cache")
    out, err = capfd.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert all(re.match(r"jaxgin build \[ *\d+ s\] ", line) for line in lines), lines
    assert f"for NCCL {packaged_nccl.version_string}, {ARCH} with {nvcc}: 2 nvcc steps" in lines[0]
    assert str(tmp_path / "cache") in lines[0]
    # a slow machine may add "still compiling" lines between the steps
    steps = sorted(line.split("] ", 1)[1] for line in lines[1:-1] if "still compiling" not in line)
    assert steps == ["1/2 device/library.cu -> cubin", "2/2 device/library.cu -> ptx"] or \
        steps == ["1/2 device/library.cu -> ptx", "2/2 device/library.cu -> cubin"], lines
    assert lines[-1].endswith(f"done: {artifacts.directory}")
    build.build(_headers_only(packaged_nccl), ARCH, cache_dir=tmp_path / "cache")
    assert capfd.readouterr().err == ""  # a cached build says nothing


def test_build_says_what_is_still_compiling(tmp_path, capfd, monkeypatch, nvcc, packaged_nccl):
    """Nothing finished for HEARTBEAT_S seconds: a line names the steps still running (three at
    most, then how many more) and how many wait for a CPU."""
    monkeypatch.setattr(build, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(build, "_run", lambda command, cwd: time.sleep(0.4))
    monkeypatch.setattr(build, "compile_jobs", lambda: 2)
    build.build(_headers_only(packaged_nccl), ARCH, cache_dir=tmp_path / "cache")
    err = capfd.readouterr().err
    assert "still compiling device/library.cu -> cubin, device/library.cu -> ptx\n" in err
    stage = [["nvcc", "-c", f"/src/csrc/kernels/k{i}.cu", "-o", f"/o/k{i}.o"] for i in range(5)]
    build._run_stage(stage, Path("/src/csrc"), build._Progress(True), 0, 5, jobs=5)
    err = capfd.readouterr().err
    assert "still compiling kernels/k0.cu, kernels/k1.cu, kernels/k2.cu and 2 more\n" in err
    assert "5/5 kernels/k" in err
    build._run_stage(stage, Path("/src/csrc"), build._Progress(True), 0, 5, jobs=2)
    err = capfd.readouterr().err
    assert "still compiling kernels/k0.cu, kernels/k1.cu (3 waiting)\n" in err
    assert "5/5 kernels/k" in err


def test_compiles_run_one_per_cpu_and_stop_at_the_first_failure(monkeypatch):
    """No more nvcc processes than CPUs at once (more only contend for them), and a failed step
    cancels the steps not yet started instead of compiling on for nothing."""
    import threading

    lock, running, most, started = threading.Lock(), [0], [0], []

    def run(command, cwd):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            started.append(command[2])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        if command[2].endswith("k1.cu"):
            raise ToolchainError("k1.cu does not compile")

    monkeypatch.setattr(build, "_run", run)
    stage = [["nvcc", "-c", f"/src/csrc/kernels/k{i}.cu", "-o", f"/o/k{i}.o"] for i in range(8)]
    with pytest.raises(ToolchainError, match="k1.cu does not compile"):
        build._run_stage(stage, Path("/src/csrc"), build._Progress(False), 0, 8, jobs=2)
    assert most[0] == 2
    assert len(started) < len(stage), started  # k1's failure stopped the rest
    assert build.compile_jobs() == len(os.sched_getaffinity(0))


def test_build_progress_can_be_switched_off(tmp_path, capfd, monkeypatch, nvcc, packaged_nccl):
    monkeypatch.setattr(build, "_run", lambda command, cwd: None)
    monkeypatch.setenv("JAXGIN_BUILD_PROGRESS", "0")
    build.build(_headers_only(packaged_nccl), ARCH, cache_dir=tmp_path / "quiet")
    assert capfd.readouterr().err == ""
    build.build(_headers_only(packaged_nccl), ARCH, cache_dir=tmp_path / "loud", progress=True)
    assert "jaxgin build [" in capfd.readouterr().err


@pytest.mark.parametrize("arch, virtual", [("sm_90a", "compute_90a"), ("sm_80", "compute_80"), ("sm_100a", "compute_100a")])
def test_backend_sources_compile_for_one_virtual_arch(tmp_path, arch, virtual, nvcc, packaged_nccl):
    """Each backend source goes through nvcc's device pass once, for the GPU's own arch: with
    -arch=sm_90a nvcc also compiled a portable compute_90 PTX that the linked backend never holds
    (its device code is one sm_90 ELF either way), a quarter of every compile's CPU time."""
    compiles, (link,) = build._backend_commands(nvcc, packaged_nccl, arch, build.sources_dir(), tmp_path)
    for command in compiles:
        assert f"-gencode=arch={virtual},code=[{arch},{virtual}]" in command
        assert not [part for part in command if part.startswith("-arch")], command
    assert f"-arch={arch}" in link


def test_step_names():
    root = Path("/src/csrc")
    assert build._step_name(["nvcc", "-c", "/src/csrc/kernels/exchange.cu", "-o", "/o/kernels_exchange.o"],
                            root) == "kernels/exchange.cu"
    assert build._step_name(["nvcc", "-ptx", "/src/csrc/device/library.cu", "-o", "/o/jaxgin_device.ptx"],
                            root) == "device/library.cu -> ptx"
    assert build._step_name(["nvcc", "-shared", "/o/a.o", "-o", "/o/libjaxgin_backend.so"],
                            root) == "link libjaxgin_backend.so"


def test_prebuild_command_reports_progress(tmp_path, packaged_nccl):
    """python -m jaxgin.build: progress on stderr while it compiles, the artifacts on stdout, and
    no warning. An nvcc that writes its outputs stands in for the real one, which the `built`
    fixture runs."""
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n"
                    "[ \"$1\" = --version ] && { echo 'Cuda compilation tools, release 13.0, V13.0.88'; exit 0; }\n"
                    "while [ $# -gt 0 ]; do [ \"$1\" = -o ] && echo compiled > \"$2\"; shift; done\n")
    fake.chmod(0o755)
    result = subprocess.run(
        [sys.executable, "-m", "jaxgin.build", "--arch", ARCH, "--nccl-include", str(packaged_nccl.include_dir),
         "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAXGIN_BUILD_PROGRESS": "1", "JAXGIN_NVCC": str(fake)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert all(line.startswith("jaxgin build [") for line in lines), result.stderr  # no warning either
    assert f"compiling jaxgin's device library for NCCL {packaged_nccl.version_string}, {ARCH} with {fake}" in lines[0]
    assert "2/2 device/library.cu" in result.stderr
    assert "jaxgin_device.ptx" in result.stdout and "jaxgin build" not in result.stdout
