"""jaxgin/settings holds every JAXGIN_* environment variable the library reads, and only those:
the C++ under csrc/ getenv()s only names the table gives to the native side, Python reads them
only through jaxgin.settings, every entry is read somewhere, and docs/guide.md's table is the
module's. Read from the sources (no import of the scanned modules)."""

import ast
import re
from pathlib import Path

import pytest

from jaxgin import runtime, settings
from jaxgin.sizes import parse_size

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_PACKAGE = ROOT / "jaxgin" / "settings"
NATIVE_SUFFIXES = {".cc", ".cu", ".h", ".cuh", ".cpp", ".hpp"}
# getenv, secure_getenv, std::getenv, and a name passed through a macro such as ENV("JAXGIN_X") is
# not used today; the pattern takes any call whose name ends in getenv.
_GETENV = re.compile(r"\b\w*getenv\s*\(\s*\"(JAXGIN_[A-Z0-9_]+)\"")
# Python calls that read a setting by name: jaxgin.settings' accessors.
ACCESSORS = {"get", "get_as_set", "flag"}
# Statements outside jaxgin/settings that touch the environment and name a JAXGIN_ string, with why.
ALLOWED_ENVIRONMENT_USES = {
    ("jaxgin/pairtest.py", "run"): "copies every NCCL_* / JAXGIN_* variable set into the pair test's "
                                       "report for `jaxgin.doctor` to show; it reads no one setting",
}


def native_reads(files: dict[str, str]) -> dict[str, list[str]]:
    """{variable: [file, ...]} for every getenv of a literal JAXGIN_ name in `files` ({path: text})."""
    found: dict[str, list[str]] = {}
    for path, text in files.items():
        for name in _GETENV.findall(text):
            found.setdefault(name, []).append(path)
    return found


def _native_sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace")
            for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in NATIVE_SUFFIXES}


def _python_sources() -> dict[str, str]:
    """Every library module but jaxgin/settings itself."""
    return {str(p.relative_to(ROOT)): p.read_text()
            for package in ("jaxgin", "tritongin") for p in sorted((ROOT / package).rglob("*.py"))
            if SETTINGS_PACKAGE not in p.parents}


def _own_expressions(statement: ast.stmt) -> list[ast.AST]:
    """The expressions of `statement` itself, not of the statements nested in its body."""
    return [child for child in ast.iter_child_nodes(statement) if not isinstance(child, ast.stmt)]


def environment_uses(files: dict[str, str]) -> list[tuple[str, str, int, str]]:
    """(file, enclosing function, line, statement) for each statement that touches `environ` or
    getenv and names a string starting with JAXGIN_: a read or write that bypasses jaxgin.settings."""
    found = []
    for path, text in files.items():
        tree = ast.parse(text)
        for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            body = function.body
            statements = [s for top in body for s in ast.walk(top) if isinstance(s, ast.stmt)
                          and not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
            for statement in statements:
                if _inside_nested_function(statement, function):
                    continue
                nodes = [n for e in _own_expressions(statement) for n in ast.walk(e)]
                touches = any(isinstance(n, ast.Attribute) and n.attr in ("environ", "getenv", "putenv")
                              or isinstance(n, ast.Name) and n.id in ("environ", "getenv", "putenv") for n in nodes)
                names_one = any(isinstance(n, ast.Constant) and isinstance(n.value, str)
                                and n.value.startswith("JAXGIN_") for n in nodes)
                if touches and names_one:
                    name = getattr(function, "name", "<module>")
                    found.append((path, name, statement.lineno, ast.unparse(statement).splitlines()[0]))
    return found


def _inside_nested_function(statement: ast.stmt, function: ast.AST) -> bool:
    """Whether `statement` belongs to a function defined inside `function` (counted there instead)."""
    for inner in ast.walk(function):
        if inner is not function and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(s is statement for s in ast.walk(inner)):
                return True
    return False


def accessor_reads(files: dict[str, str]) -> dict[str, list[str]]:
    """{variable: [file, ...]} for each `settings.get("JAXGIN_X")` (or get_as_set / flag) call,
    through any name jaxgin.settings is imported as."""
    found: dict[str, list[str]] = {}
    for path, text in files.items():
        tree = ast.parse(text)
        aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "jaxgin"
                   for a in n.names if a.name == "settings"}
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            f = call.func
            if (isinstance(f, ast.Attribute) and f.attr in ACCESSORS and isinstance(f.value, ast.Name)
                    and f.value.id in aliases and call.args and isinstance(call.args[0], ast.Constant)):
                found.setdefault(call.args[0].value, []).append(path)
    return found


NATIVE = native_reads(_native_sources())
PYTHON = accessor_reads(_python_sources())


def test_the_table_is_well_formed():
    names = [s.name for s in settings.SETTINGS]
    assert len(names) == len(set(names)) == len(settings.BY_NAME)
    for s in settings.SETTINGS:
        assert re.fullmatch(r"JAXGIN_[A-Z0-9_]+", s.name), s
        assert s.type in settings.TYPES and s.side in settings.SIDES, s
        assert s.meaning and "\n" not in s.meaning and "|" not in s.meaning and s.meaning.endswith("."), s
        assert not s.name.startswith("JAXGIN_TEST_"), f"{s.name}: tests' variables are not library settings"


def test_every_getenv_in_csrc_is_a_native_setting():
    assert NATIVE, "the scan found no getenv in csrc/: the pattern no longer matches the code"
    missing = {name: files for name, files in NATIVE.items()
               if name not in settings.BY_NAME or settings.BY_NAME[name].side == "python"}
    assert not missing, f"read by the C++ but not a native/both entry of jaxgin/settings: {missing}"


def test_every_python_read_is_a_python_setting():
    assert PYTHON, "the scan found no settings.get call: the pattern no longer matches the code"
    wrong = {name: files for name, files in PYTHON.items()
             if name not in settings.BY_NAME or settings.BY_NAME[name].side == "native"}
    assert not wrong, f"read through jaxgin.settings but not a python/both entry: {wrong}"


def test_every_entry_is_read_where_its_side_says():
    for s in settings.SETTINGS:
        if s.side in ("native", "both"):
            assert s.name in NATIVE, f"{s.name} says the C++ reads it, but no getenv in csrc/ does"
        if s.side in ("python", "both"):
            assert s.name in PYTHON, f"{s.name} says Python reads it, but no jaxgin.settings accessor call does"


def test_python_touches_the_environment_for_a_setting_only_through_jaxgin_settings():
    uses = environment_uses(_python_sources())
    unexplained = [u for u in uses if (u[0], u[1]) not in ALLOWED_ENVIRONMENT_USES]
    assert not unexplained, ("read JAXGIN_* settings with jaxgin.settings.get, or justify a write in "
                             f"ALLOWED_ENVIRONMENT_USES: {unexplained}")
    stale = set(ALLOWED_ENVIRONMENT_USES) - {(u[0], u[1]) for u in uses}
    assert not stale, f"allowed uses that no longer exist: {stale}"


def test_the_scans_catch_what_they_are_for():
    # A new getenv in the C++, a direct read in Python and a write for a child process are all found.
    assert native_reads({"x.cc": 'auto v = std::getenv("JAXGIN_NEW_KNOB");\nif (getenv( "JAXGIN_B" )) {}'}) == {
        "JAXGIN_NEW_KNOB": ["x.cc"], "JAXGIN_B": ["x.cc"]}
    source = ('import os\nfrom os import environ\n'
              'def f():\n    return os.environ.get("JAXGIN_TIMEOUT", "30")\n'
              'def g(env):\n    os.environ["JAXGIN_X"] = "1"\n    if "JAXGIN_Y" in environ:\n        pass\n'
              'Z = os.getenv("JAXGIN_Z")\n')
    assert [(f, line) for _, f, line, _ in environment_uses({"m.py": source})] == [
        ("<module>", 9), ("f", 4), ("g", 6), ("g", 7)]
    reads = accessor_reads({"m.py": 'from jaxgin import settings as s\nx = s.get("JAXGIN_A")\ny = s.flag("JAXGIN_B")\n'})
    assert reads == {"JAXGIN_A": ["m.py"], "JAXGIN_B": ["m.py"]}


def test_runtime_constants_are_the_table_defaults():
    assert float(settings.BY_NAME["JAXGIN_TIMEOUT"].default) == runtime.DEFAULT_TIMEOUT_S
    assert parse_size(settings.BY_NAME["JAXGIN_CHANNEL_SLOT_BYTES"].default) == runtime.DEFAULT_CHANNEL_SLOT_BYTES
    assert int(settings.BY_NAME["JAXGIN_MAX_QUEUED_CALLS"].default) == runtime.DEFAULT_MAX_QUEUED_CALLS


def test_accessors(monkeypatch):
    monkeypatch.delenv("JAXGIN_TIMEOUT", raising=False)
    assert settings.get("JAXGIN_TIMEOUT") == "30" and settings.get_as_set("JAXGIN_TIMEOUT") == "30"
    monkeypatch.setenv("JAXGIN_TIMEOUT", "")
    assert settings.get("JAXGIN_TIMEOUT") == "30" and settings.get_as_set("JAXGIN_TIMEOUT") == ""
    monkeypatch.setenv("JAXGIN_TIMEOUT", "7")
    assert settings.get("JAXGIN_TIMEOUT") == settings.get_as_set("JAXGIN_TIMEOUT") == "7"
    monkeypatch.delenv("JAXGIN_BACKEND", raising=False)
    assert settings.get("JAXGIN_BACKEND") is None
    for value, expected in (("", None), ("On", True), ("no", False)):
        monkeypatch.setenv("JAXGIN_FORCE_GIN", value)
        assert settings.flag("JAXGIN_FORCE_GIN") is expected
    monkeypatch.setenv("JAXGIN_FORCE_GIN", "maybe")
    with pytest.raises(ValueError, match=r"JAXGIN_FORCE_GIN='maybe': use 1/0"):
        settings.flag("JAXGIN_FORCE_GIN")
    with pytest.raises(KeyError, match="JAXGIN_NOT_A_SETTING is not a jaxgin setting"):
        settings.get("JAXGIN_NOT_A_SETTING")


def _guide_table() -> str:
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("\n## Settings (environment variables)\n", 1)
    assert len(section) == 2, "docs/guide.md has no '## Settings (environment variables)' section"
    body = section[1].split("\n## ", 1)[0]
    return "".join(line + "\n" for line in body.splitlines() if line.startswith("|"))


def test_the_guide_shows_the_table():
    assert _guide_table() == settings.markdown_table(), (
        "docs/guide.md's settings table differs from jaxgin/settings: paste `python -m jaxgin.settings` there")
