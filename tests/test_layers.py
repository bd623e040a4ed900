"""The import structure docs/design.md describes: tritongin sits on top of jaxgin (jaxgin never
imports it), module-level imports between jaxgin's and tritongin's modules form no cycle, and a
function-local import says why it is not at the top. Read from the sources (no import runs),
except where a command or a missing package is run as a user meets them."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxgin", "tritongin")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The project modules an import statement names (`from a import b` names a.b when that is a
    module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] in PACKAGES]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([base] if base else []))
    if base.split(".")[0] not in PACKAGES:
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(module: str) -> tuple[list[str], list[tuple[int, str, bool]]]:
    """(project modules imported at module level, [(line, imported, justified)] inside functions).
    A function-local import is justified when a comment on its line, or on another local import of
    the same function, says why."""
    path = MODULES[module]
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    is_package = path.name == "__init__.py"
    top = [m for node in tree.body for m in _imported(node, module, is_package)]
    for node in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level count as top level
        if isinstance(node, (ast.If, ast.Try)):
            for inner in ast.walk(node):
                top += _imported(inner, module, is_package)
    local = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
        justified = any("#" in lines[n.lineno - 1] for n in imports)
        local += [(n.lineno, ast.unparse(n), justified) for n in imports]
    return top, local


def test_jaxgin_never_imports_tritongin():
    offenders = []
    for m in MODULES:
        if m.split(".")[0] != "jaxgin":
            continue
        top, local = _imports(m)
        offenders += [(m, "module level", t) for t in top if "tritongin" in t]
        offenders += [(m, line, t) for line, t, _ in local if "tritongin" in t]
    assert not offenders, offenders


def test_module_level_imports_form_no_cycle():
    graph = {m: sorted({t for t in _imports(m)[0] if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


def test_function_local_imports_say_why():
    unexplained = [f"{MODULES[m].relative_to(ROOT)}:{line}: {text}" for m in MODULES
                   for line, text, justified in _imports(m)[1] if not justified]
    assert not unexplained, "\n".join(unexplained)


def test_the_checks_see_imports():
    """The scan finds what it must (so the tests above cannot pass by reading nothing)."""
    top, local = _imports("jaxgin.runtime")
    assert "jaxgin.heap" in top and "jaxgin.errors" in top
    assert any("_jaxgin_ext" in text for _, text, _ in local)
    assert "jaxgin.triton_device.language" in _imports("tritongin.language")[0]


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, env=env)


COMMANDS = [m for m, path in MODULES.items() if 'if __name__ == "__main__":' in path.read_text()]


def test_import_jaxgin_leaves_its_commands_unimported():
    """`python -m jaxgin.build` (and every other `python -m jaxgin.X`) runs that module as __main__
    after importing jaxgin; had `import jaxgin` imported it, runpy would warn about a second copy."""
    assert {"jaxgin.build", "jaxgin.transport", "jaxgin.info"} <= set(COMMANDS)
    out = _python("-c", "import sys, jaxgin; print(sorted(m for m in sys.modules if m.startswith('jaxgin.')))")
    assert out.returncode == 0, out.stderr
    loaded = eval(out.stdout)
    assert "jaxgin.runtime" in loaded and "jaxgin.mailbox" in loaded  # the scan reads what import jaxgin loads
    assert not set(COMMANDS) & set(loaded), loaded


def test_a_command_starts_without_a_warning():
    out = _python("-m", "jaxgin.build", "--help")
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m jaxgin.build"), out.stderr
    assert out.stderr == "", out.stderr


def test_tritongin_language_without_triton_says_what_to_install():
    """Triton is optional: importing tritongin works without it, tritongin.language says what to
    install (the README's command, from this checkout) instead of a bare ModuleNotFoundError."""
    from jaxgin.errors import install_command

    code = ("import sys; sys.modules['triton'] = None\n"
            "import tritongin\n"
            "try:\n"
            "    import tritongin.language\n"
            "except ModuleNotFoundError as e:\n"
            "    print(e.name); print(e)\n")
    out = _python("-c", code)
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.splitlines()
    assert name == "triton"
    assert message == (f"tritongin.language needs Triton, which is not installed: {install_command('cuda')} "
                       "(or pip install 'triton>=3.6')")
