"""jaxgin/ffi/op_table.py is the one place that names what both languages need of an op family:
the header the build renders from it says everything the rows say, each row names its own slice
(files that exist, handlers and preload hooks defined there), and csrc and the Python ops spell
none of it by hand again. Needs no nvcc (tests/test_build.py compiles the header)."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from jaxgin.ffi import op_table

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
HEADER = op_table.header()


def _csrc_files() -> dict[str, str]:
    return {str(p.relative_to(CSRC)): p.read_text() for p in sorted(CSRC.rglob("*"))
            if p.suffix in (".h", ".cu", ".cuh", ".cc") and p.parts[len(CSRC.parts)] != "ext"}


def _backend_files() -> dict[str, str]:
    """The files the backend compiles: the rows' sources and every header under csrc (the
    transport plugin and the extension are built on their own)."""
    return {path: text for path, text in _csrc_files().items()
            if path in op_table.sources() or (path.endswith(".h") and not path.startswith("transport/"))}


def _enum(name: str) -> dict[str, int]:
    body = re.search(rf"enum {name} : \w+ \{{(.*?)\}};", HEADER, flags=re.DOTALL).group(1)
    return {m: int(v) for m, v in re.findall(r"(\w+) = (\d+)", body)}


def test_header_declares_every_op_tag_in_table_order():
    assert _enum("jaxgin_op_tag") == {f"JAXGIN_OP_{op.tag}": i for i, op in enumerate(op_table.tags())}
    names = dict(re.findall(r'case (JAXGIN_OP_\w+): return "([^"]*)";', HEADER))
    assert names == {f"JAXGIN_OP_{op.tag}": op.name for op in op_table.tags()}
    # The values fault records hold today (a build writes and reads its own, but keep them still).
    assert [op.tag for op in op_table.tags()][:5] == ["DEVICE_CALL", "BARRIER", "SELFTEST", "PPERMUTE", "ALL_TO_ALL"]


def test_header_declares_every_handler_and_state_type_exported():
    declared = re.findall(r'^__attribute__\(\(visibility\("default"\)\)\) \S+ (\w+)\(', HEADER, flags=re.MULTILINE)
    symbols = [s for target in op_table.targets() for s in op_table.handler_symbols(target)]
    symbols += [s for family in op_table.FAMILIES for state in family.state_types for s in (state.type_id, state.type_info)]
    assert declared == symbols
    assert "jaxgin_ffi_exchange_captured" in symbols and "jaxgin_ffi_triton_execute_captured" in symbols
    assert "jaxgin_ffi_triton_instantiate_captured" not in symbols and "jaxgin_ffi_matmul_all_to_all_captured" not in symbols


def test_header_lists_every_preload_hook_and_constant():
    hooks = [hook for family in op_table.FAMILIES for hook in family.preload]
    assert re.findall(r"^cudaError_t (\w+)\(\);", HEADER, flags=re.MULTILINE) == hooks
    assert re.findall(r'\{"(\w+)", &(\w+)\},', HEADER) == [(hook, hook) for hook in hooks]
    defines = dict(re.findall(r"^#define (JAXGIN_\w+) (\d+)u$", HEADER, flags=re.MULTILINE))
    assert {k: int(v) for k, v in defines.items()} == {
        f"JAXGIN_{name.upper()}": value for family in op_table.FAMILIES for name, value in family.constants.items()}
    exported = {name: int(value) for name, value in re.findall(r'\{"(\w+)", (-?\d+)\},', HEADER)}
    assert exported == dict(op_table.CONSTANTS)


def test_header_declares_the_attribute_codes_as_the_handlers_spell_them():
    assert _enum("ExchangeKind") == {"kPpermute": 0, "kAllToAll": 1}
    assert _enum("ParamKind") == {f"k{''.join(p.capitalize() for p in m.name.split('_'))}": int(m)
                                  for m in op_table.ParamKind}
    assert op_table.CONSTANTS["exchange_kind_all_to_all"] == 1 and op_table.CONSTANTS["param_kind_null_pointer"] == 7


def test_header_follows_the_table(monkeypatch):
    """A changed row changes the header (and so the build's cache key, which includes it)."""
    assert op_table.header() == HEADER  # deterministic
    last = op_table.FAMILIES[-1]
    extra = op_table.Target("jaxgin_extra", {"execute": "jaxgin_ffi_extra"}, (op_table.Op("jaxgin.extra", "EXTRA"),))
    monkeypatch.setattr(op_table, "FAMILIES", op_table.FAMILIES[:-1] + (
        dataclasses.replace(last, constants={"an_extra_constant": 3}, targets=last.targets + (extra,)),))
    changed = op_table.header()
    assert "#define JAXGIN_AN_EXTRA_CONSTANT 3u" in changed
    assert f"  JAXGIN_OP_EXTRA = {len(op_table.tags()) - 1},  // jaxgin.extra" in changed
    assert "XLA_FFI_Error* jaxgin_ffi_extra(XLA_FFI_CallFrame* call_frame);" in changed


def test_names_are_unique():
    tags = [op.tag for op in op_table.tags()]
    ops = [op.name for family in op_table.FAMILIES for op in family.all_ops()]
    targets = [target.name for target in op_table.targets()]
    symbols = [s for target in op_table.targets() for s in op_table.handler_symbols(target)]
    targets += [target.captured_name for target in op_table.targets() if target.capturable]
    hooks = [hook for family in op_table.FAMILIES for hook in family.preload]
    constants = [name for family in op_table.FAMILIES for name in family.constants]
    families = [family.name for family in op_table.FAMILIES]
    for names in (tags, ops, targets, symbols, hooks, constants, families, list(op_table.sources())):
        assert len(names) == len(set(names)), names
    assert len(op_table.CONSTANTS) == len(constants) + sum(len(c) for f in op_table.FAMILIES for c in f.codes)
    for target in op_table.targets():
        assert set(target.handlers) in ({"execute"}, {"instantiate", "execute"}), target


def test_every_row_names_its_own_slice():
    """A row's files exist, its handlers and preload hooks are defined in its own csrc files, and
    csrc has no source, handler or hook that no row names."""
    files = _csrc_files()
    for family in op_table.FAMILIES:
        for module in family.python:
            assert (ROOT / module).is_file(), (family.name, module)
        for source in family.sources:
            assert source in files, (family.name, source)
        text = "".join(files[source] for source in family.sources)
        for target in family.targets:
            for symbol in target.handlers.values():
                # A capturable target's execute handler is defined with its twin by one macro (csrc/ffi/common.h).
                twin = target.capturable and symbol == target.handlers["execute"]
                definition = "JAXGIN_FFI_CAPTURABLE_HANDLER" if twin else "XLA_FFI_DEFINE_HANDLER_SYMBOL"
                assert re.search(rf"{definition}\({symbol},", text), (family.name, symbol)
        for state in family.state_types:
            for symbol in (state.type_id, state.type_info):
                assert re.search(rf'extern "C" void\* {symbol}\(void\) \{{', text), (family.name, symbol)
        for hook in family.preload:
            assert re.search(rf"^cudaError_t (jaxgin::)?{hook}\(\) \{{", text, flags=re.MULTILINE), (family.name, hook)
    # Every CUDA source, handler and preload hook is some row's: one the table left out would not
    # be compiled, registered or called.
    unclaimed = [p for p in files if p.endswith(".cu") and p not in op_table.sources()]
    assert not unclaimed, f"csrc files no row of jaxgin/ffi/op_table.py compiles: {unclaimed}"
    everything = "".join(files.values())
    handlers = {s for target in op_table.targets() for s in op_table.handler_symbols(target)}
    defined = set(re.findall(r"^XLA_FFI_DEFINE_HANDLER_SYMBOL\((\w+),", everything, flags=re.MULTILINE))
    for symbol in re.findall(r"^JAXGIN_FFI_CAPTURABLE_HANDLER\((\w+),", everything, flags=re.MULTILINE):
        defined |= {symbol, symbol + op_table.CAPTURED_SUFFIX}
    assert defined == handlers
    hooks = {hook for family in op_table.FAMILIES for hook in family.preload}
    assert set(re.findall(r"^cudaError_t (?:jaxgin::)?(preload_\w+)\(\) \{", everything, flags=re.MULTILINE)) == hooks


def test_target_of():
    assert op_table.target_of("jaxgin.ppermute").name == op_table.target_of("jaxgin.all_to_all").name == "jaxgin_exchange"
    assert op_table.target_of("jaxgin.triton_call").name == "jaxgin_triton_call"
    assert op_table.target_of("jaxgin.ppermute").captured_name == "jaxgin_exchange_captured"
    with pytest.raises(KeyError, match="jaxgin.no_such_op"):
        op_table.target_of("jaxgin.no_such_op")


# What csrc used to spell by hand and now takes from the generated header.
_HAND_COPIES = {
    "an op tag's value": re.compile(r"\bJAXGIN_OP_\w+\s*=\s*\d"),
    "a table constant's definition": re.compile(
        r"#define\s+JAXGIN_(?:" + "|".join(n.upper() for n in op_table.CONSTANTS) + r")\b"
        # a C++ alias of one (kMaxExchangePeers) given a literal instead of JAXGIN_MAX_EXCHANGE_PEERS
        r"|\bconstexpr\s+\w+\s+k(?:" + "|".join(op_table._camel(n) for n in op_table.CONSTANTS) + r")\s*=\s*[\d(]"),
    "a handler's or state getter's declaration": re.compile(r"(?:XLA_FFI_Error\*|void\*)\s+jaxgin_ffi_\w+\([^)]*\)\s*;"),
    "a preload hook's declaration": re.compile(r"cudaError_t\s+(?:jaxgin::)?preload_\w+\(\)\s*;"),
    "an attribute code's definition": re.compile(r"\benum\s+(?:" + "|".join(
        c.__name__ for f in op_table.FAMILIES for c in f.codes) + r")\b"),
    "a tagged op's name": re.compile("|".join(re.escape(f'"{op.name}"') for op in op_table.tags())),
}


def test_csrc_spells_none_of_the_table_by_hand():
    found = [f"{path}: {what}: {m.group(0)!r}" for path, text in _backend_files().items()
             for what, pattern in _HAND_COPIES.items() for m in pattern.finditer(text)]
    assert not found, "\n".join(found)


def test_the_scan_would_see_a_hand_copy():
    assert _HAND_COPIES["an op tag's value"].search("  JAXGIN_OP_PPERMUTE = 3,")
    assert _HAND_COPIES["a table constant's definition"].search("#define JAXGIN_LINE_MAX_BYTES 8192u")
    assert _HAND_COPIES["a table constant's definition"].search("constexpr int kMaxExchangePeers = 64;")
    assert _HAND_COPIES["a handler's or state getter's declaration"].search(
        'extern "C" JAXGIN_API XLA_FFI_Error* jaxgin_ffi_put(XLA_FFI_CallFrame* call_frame);')
    assert _HAND_COPIES["a preload hook's declaration"].search("cudaError_t preload_mailbox_kernels();")
    assert _HAND_COPIES["an attribute code's definition"].search("enum ExchangeKind : int64_t { kPpermute = 0 };")
    assert _HAND_COPIES["a tagged op's name"].search('return "jaxgin.put_signal";')
    assert "ffi/mailbox.cu" in _backend_files() and "kernels/mailbox.h" in _backend_files()


def test_python_names_no_target_by_hand():
    """The op modules find their custom-call target through op_table.target_of; no module but the
    table holds a target's name as a string."""
    names = {target.name for target in op_table.targets()}
    found = []
    for path in sorted((ROOT / "jaxgin").rglob("*.py")):
        if path == ROOT / "jaxgin" / "ffi" / "op_table.py":
            continue
        tree = ast.parse(path.read_text())
        # A JAX primitive may share its target's name: Primitive("jaxgin_put_signal") names the op in jaxprs.
        primitive_names = {id(call.args[0]) for call in ast.walk(tree) if isinstance(call, ast.Call) and call.args
                           and getattr(call.func, "id", getattr(call.func, "attr", None)) == "Primitive"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in primitive_names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, found
