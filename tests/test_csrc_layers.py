"""The layers of csrc/ that docs/design.md describes, read from the #include lines of every source
as tests/test_layers.py reads Python's imports (nothing is compiled):

- each directory is a layer and includes only the layers it sits on: the runtime sits below the
  ops (it includes no kernel or FFI header), kernels reach the device library only through its
  public headers (csrc/device/*.h; csrc/device/impl/ is private to it), the extension only the
  backend's C ABI, the transport plugin nothing of the others;
- NCCL's, XLA's and nanobind's headers are included only by the layers that own them;
- host code (the runtime, the FFI handlers, kernels' launcher headers, the device library's data
  layouts and C API headers) never reaches NCCL's device functions, through any chain of includes.

A failure names the including file and line, what it includes and the rule."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
SUFFIXES = (".h", ".cu", ".cuh", ".cc")
INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)

# Which layers (or single files) each layer may include, and why. A layer is a directory of csrc/;
# "device" is the device library's public headers (csrc/device/*.h), "device/impl" its private part.
MAY_INCLUDE: dict[str, tuple[set[str], str]] = {
    "device/impl": ({"device/impl"}, "the device library's private part sits on NCCL alone"),
    "device": ({"device", "device/impl"}, "the device library sits on NCCL alone"),
    "runtime": ({"runtime", "device"}, "the runtime sits below the ops: it knows the device library's public "
                "headers, no kernel and no FFI handler (ops keep their state in its OpState slots)"),
    "kernels": ({"kernels", "device"}, "kernels reach the device library (and NCCL) only through its public headers"),
    "ffi": ({"ffi", "kernels", "runtime", "device"}, "FFI handlers and the C ABI that launches kernels sit on "
            "the kernels, the runtime and the device library's public headers"),
    "ext": ({"runtime/backend_api.h"}, "the extension is built without CUDA (CMakeLists.txt) and reaches the "
            "backend through its C ABI alone"),
    "transport": ({"transport"}, "the transport plugin is a library of its own, loaded by NCCL"),
}

# Outside headers, by the start of their name (the first that matches decides), and the layers
# that own them.
THIRD_PARTY: dict[str, tuple[set[str], str]] = {
    "nccl_device": ({"device/impl"}, "NCCL's device API is the device library's alone"),
    "nccl": ({"device/impl", "runtime"}, "NCCL's host API is the runtime's (the context's types embed NCCL's)"),
    "xla/": ({"ffi"}, "XLA's FFI API is the FFI handlers'"),
    "nanobind/": ({"ext"}, "nanobind is the extension's"),
}

# What brings NCCL's device functions (NCCL's own umbrella header).
NCCL_DEVICE_FUNCTIONS = "<nccl_device.h>"
# Headers that host code includes: they must not bring NCCL's device functions with them.
HOST_SIDE_HEADERS = ("device/jaxgin_types.h", "device/jaxgin_device.h", "device/jaxgin_triton.h")
HOST_SIDE_LAYERS = ("runtime", "ffi", "ext", "transport")

# Includes that break a rule today, each with the reason it stays for now. An entry that is no
# longer needed fails too (test_exceptions_are_still_needed), so the list only shrinks.
EXCEPTIONS: dict[tuple[str, str], str] = {}


def layer_of(path: str) -> str:
    """The layer of a path relative to csrc/ ("device/impl/put__funcs.h" -> "device/impl")."""
    parts = path.split("/")
    if parts[:2] == ["device", "impl"]:
        return "device/impl"
    return parts[0] if len(parts) > 1 else ""


def sources(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in SUFFIXES)


def includes(root: Path, path: str) -> list[tuple[int, str]]:
    """(line, target) of every #include of csrc/`path`: a project file relative to csrc/ (quoted and
    found beside the includer or under csrc/, as nvcc's -I<csrc> finds it), else "<name>"."""
    text = (root / path).read_text()
    found = []
    for match in INCLUDE.finditer(text):
        quote, name = match.groups()
        line = text.count("\n", 0, match.start()) + 1
        target = f"<{name}>"
        if quote == '"':
            for base in ((root / path).parent, root):
                candidate = (base / name).resolve()
                if candidate.is_file() and candidate.is_relative_to(root.resolve()):
                    target = candidate.relative_to(root.resolve()).as_posix()
                    break
        found.append((line, target))
    return found


def _edge_rule(path: str, target: str) -> str | None:
    """Why `path` may not include `target`, or None when it may."""
    source_layer = layer_of(path)
    if target.startswith("<"):
        name = target[1:-1]
        for prefix, (owners, why) in THIRD_PARTY.items():
            if name.startswith(prefix):
                return None if source_layer in owners else f"only {', '.join(sorted(owners))} may include {prefix}*: {why}"
        return None
    allowed, why = MAY_INCLUDE[source_layer]
    if target in allowed or layer_of(target) in allowed:
        return None
    return f"{source_layer} may include only {', '.join(sorted(allowed))}: {why}"


def _is_host_side(path: str) -> bool:
    layer = layer_of(path)
    return layer in HOST_SIDE_LAYERS or path in HOST_SIDE_HEADERS or (layer == "kernels" and path.endswith(".h"))


def _chain_to_nccl_device(path: str, graph: dict[str, list[tuple[int, str]]]) -> list[str] | None:
    """The include chain from `path` to NCCL's device functions ("csrc/file:line includes X" steps), or None."""
    seen = {path}
    frontier = [(path, [])]
    while frontier:
        current, chain = frontier.pop(0)
        for line, target in graph.get(current, []):
            step = chain + [f"csrc/{current}:{line} includes {target}"]
            if target == NCCL_DEVICE_FUNCTIONS:
                return step
            if target in graph and target not in seen:
                seen.add(target)
                frontier.append((target, step))
    return None


def violations(root: Path, exceptions: dict[tuple[str, str], str] = EXCEPTIONS) -> list[str]:
    """Every include under `root` (a csrc/ tree) that breaks a rule, as "csrc/file:line: ...". An
    include that brings NCCL's device functions into host code is named where it leaves host code
    (a host header that brings them is named, not every file that includes it)."""
    files = sources(root)
    graph = {path: includes(root, path) for path in files}
    found = []
    for path in files:
        if layer_of(path) not in MAY_INCLUDE:
            found.append(f"csrc/{path}: in no layer (MAY_INCLUDE lists them): place it in one")
            continue
        for line, target in graph[path]:
            rule = _edge_rule(path, target)
            if rule:
                if (path, target) not in exceptions:
                    found.append(f"csrc/{path}:{line}: includes {target}: {rule}")
                continue
            if _is_host_side(path) and not _is_host_side(target):
                chain = [NCCL_DEVICE_FUNCTIONS] if target == NCCL_DEVICE_FUNCTIONS else _chain_to_nccl_device(target, graph)
                if chain:
                    found.append(f"csrc/{path}:{line}: includes {target}: host code reaches NCCL's device functions "
                                 f"(only the device library and kernels compile them): {' -> '.join(chain)}")
    return found


def test_csrc_layers_hold():
    assert not violations(CSRC), "\n".join(violations(CSRC))


def test_exceptions_are_still_needed():
    for (path, target), why in EXCEPTIONS.items():
        assert _edge_rule(path, target), f"{path} -> {target} breaks no rule: drop it from EXCEPTIONS"
        assert target in [t for _, t in includes(CSRC, path)], f"csrc/{path} no longer includes {target}: " \
                                                                 "drop it from EXCEPTIONS"
        assert why


def test_the_scan_sees_includes():
    """The scan finds what it must (so the rules above cannot hold by reading nothing)."""
    files = sources(CSRC)
    assert {"runtime/runtime.cu", "kernels/exchange.cu", "device/impl/put__funcs.h", "ext/extension.cc",
            "transport/plugin.cc"} <= set(files)
    assert {layer_of(f) for f in files} == set(MAY_INCLUDE)
    assert "kernels/exchange.h" in [t for _, t in includes(CSRC, "ffi/collectives.cu")]
    assert "<nccl_device.h>" in [t for _, t in includes(CSRC, "device/impl/transport__funcs.h")]
    assert "<xla/ffi/api/ffi.h>" in [t for _, t in includes(CSRC, "ffi/common.h")]  # quoted, found outside csrc/
    chain = _chain_to_nccl_device("kernels/exchange.cu", {p: includes(CSRC, p) for p in files})
    assert chain and chain[0].startswith("csrc/kernels/exchange.cu:") and chain[-1].endswith("<nccl_device.h>")


PLANTED = [
    # (file, line to add, what the failure must say)
    ("runtime/runtime.h", '#include "../kernels/exchange.h"', "runtime may include only device, runtime"),
    ("runtime/heap_release.cu", '#include "../ffi/common.h"', "runtime may include only device, runtime"),
    # the runtime reaches the op families' kernels only through the op table's preload hooks
    ("runtime/runtime.cu", '#include "../kernels/exchange.h"', "runtime may include only device, runtime"),
    ("kernels/mailbox.cu", '#include "../device/impl/put__funcs.h"', "kernels may include only device, kernels"),
    ("ffi/collectives.cu", "#include <nccl_device.h>", "only device/impl may include nccl_device*"),
    ("transport/wire.cc", "#include <nccl.h>", "only device/impl, runtime may include nccl*"),
    ("ext/extension.cc", '#include "../runtime/runtime.h"', "ext may include only runtime/backend_api.h"),
    ("kernels/exchange.h", '#include "../device/jaxgin_inline.h"', "host code reaches NCCL's device functions"),
    ("device/jaxgin_types.h", '#include "impl/put__funcs.h"', "host code reaches NCCL's device functions"),
]


@pytest.mark.parametrize("path,planted,message", PLANTED, ids=[p for p, _, _ in PLANTED])
def test_a_planted_violation_fails(tmp_path, path, planted, message):
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    source = root / path
    lines = source.read_text().splitlines(keepends=True)
    at = next(i for i, text in enumerate(lines) if text.startswith("#include")) + 1
    source.write_text("".join(lines[:at] + [planted + "\n"] + lines[at:]))
    found = violations(root)
    assert len(found) == 1, found
    assert found[0].startswith(f"csrc/{path}:{at + 1}: includes ") and message in found[0], found[0]


def test_a_new_directory_needs_a_layer(tmp_path):
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    (root / "ops").mkdir()
    (root / "ops" / "new.cu").write_text('#include "../runtime/runtime.h"\n')
    assert violations(root) == ["csrc/ops/new.cu: in no layer (MAY_INCLUDE lists them): place it in one"]


def test_an_exception_lets_its_include_pass(tmp_path):
    """The allow-list mechanism works (it is empty today: the op table's preload hooks took the
    runtime's last kernel include away)."""
    root = tmp_path / "csrc"
    shutil.copytree(CSRC, root)
    source = root / "runtime" / "runtime.cu"
    source.write_text('#include "../kernels/exchange.h"\n' + source.read_text())
    assert violations(root) and not violations(root, exceptions={("runtime/runtime.cu", "kernels/exchange.h"): "why"})