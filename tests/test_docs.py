"""What the README and docs/api.md state that the code can check: the README's two commands are
the ones CI runs and its install line picks an extra that exists, and every signature api.md gives
is the code's (names, order, keyword-only markers, defaults)."""

import ast
import importlib
import inspect
import re
import tomllib
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()


def readme_commands() -> list[str]:
    """The README's indented command lines (its "Two commands")."""
    return [line.strip() for line in README.splitlines() if line.startswith("    pip install")]


def test_readme_has_two_commands_and_ci_runs_its_test_command():
    install, test = readme_commands()
    assert install.endswith("&& python examples/quickstart.py")
    test_command = test.split(" && ")[1]
    assert test_command.startswith("python -m pytest tests")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'"$venv_python" -m {test_command.removeprefix("python -m ")}\n' in ci


def test_readme_install_line_picks_an_extra_that_exists():
    install, _ = readme_commands()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    picked = re.fullmatch(r'pip install -e "\.\[\$\(nvidia-smi -L >/dev/null 2>&1 && echo (\w+) \|\| echo (\w+)\)\]" '
                          r"&& python examples/quickstart\.py", install)
    assert picked, install
    gpu, cpu = picked.groups()
    assert gpu == "cuda" and "jax[cuda13]>=0.11,<0.13" in extras[gpu]
    assert cpu in extras and extras[cpu] == []  # JAX alone: no CUDA plugin to fail on a machine without GPUs


def _documented() -> list[tuple[str, str]]:
    """(name, parameters) of every signature api.md gives, in headings and in its class table."""
    found = re.findall(r"^### `((?:jaxgin|tritongin)\.[\w.]+)\((.*)\)(?: -> [^`]+)?`", API, flags=re.MULTILINE)
    found += re.findall(r"^\| `((?:jaxgin|tritongin)\.[\w.]+)\((.*?)\)` \|", API, flags=re.MULTILINE)
    return found


def _resolve(name: str):
    module, *attributes = name.split(".")
    obj = importlib.import_module(module)
    for attribute in attributes:
        obj = getattr(obj, attribute)
    return obj


def _parameters_of_text(text: str) -> list[tuple[str, str, object]]:
    args = ast.parse(f"def f({text}): pass").body[0].args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + args.defaults
    found = [(a.arg, "positional", d) for a, d in zip(positional, defaults)]
    found += [(args.vararg.arg, "*args", None)] if args.vararg else []
    found += [(a.arg, "keyword-only", d) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    found += [(args.kwarg.arg, "**kwargs", None)] if args.kwarg else []
    return [(name, kind, None if d is None else eval(ast.unparse(d), {"jax": jax})) for name, kind, d in found]


_KINDS = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
          inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.KEYWORD_ONLY: "keyword-only",
          inspect.Parameter.VAR_KEYWORD: "**kwargs"}


def test_api_md_gives_signatures():
    names = [name for name, _ in _documented()]
    assert len(names) >= 30 and "tritongin.SymmetricArray" in names and "jaxgin.initialize" in names


@pytest.mark.parametrize("name, text", _documented(), ids=[name for name, _ in _documented()])
def test_api_md_signature_is_the_codes(name, text):
    code = [(p.name, _KINDS[p.kind], None if p.default is inspect.Parameter.empty else p.default)
            for p in inspect.signature(_resolve(name)).parameters.values()]
    assert _parameters_of_text(text) == code


DESIGN = re.sub(r"^```.*?^```", "", (ROOT / "docs" / "design.md").read_text(), flags=re.MULTILINE | re.DOTALL)
CSRC_LAYERS = ("device/", "runtime/", "kernels/", "ffi/", "ext/", "transport/")
TOP_LEVEL = ("csrc/", "jaxgin/", "tritongin/", "tests/", "tools/", "benchmarks/", "docs/", "examples/")


def _design_path(token: str) -> Path | None:
    """The file or directory of this tree a backticked token of design.md names, or None (csrc/'s
    layers may be named without csrc/; other relative names, such as impl/, are not read)."""
    if re.fullmatch(r"[\w./-]+", token) is None or not token.startswith(TOP_LEVEL + CSRC_LAYERS):
        return None
    return ROOT / "csrc" / token if token.startswith(CSRC_LAYERS) else ROOT / token


def test_design_md_names_paths_that_exist():
    tokens = [t for t in re.findall(r"`([^`]+)`", DESIGN) if _design_path(t) is not None]
    assert "csrc/device/jaxgin_inline.h" in tokens  # the scan reads the page's paths
    missing = sorted({t for t in tokens if not _design_path(t).exists()})
    assert not missing, f"docs/design.md names paths that do not exist: {missing}"


def _ppermute_steps() -> list[str]:
    section = DESIGN.split("### A call, file by file: `jaxgin.ppermute`\n", 1)[1].split("\n## ", 1)[0]
    return re.split(r"\n(?=\d\. )", section)


@pytest.mark.parametrize("step", _ppermute_steps(), ids=lambda s: s.split(",")[0].split(":")[0][:24])
def test_design_md_ppermute_names_what_its_files_hold(step):
    """Each step of the worked example names functions and symbols that the files it names hold."""
    paths = [_design_path(t) for t in re.findall(r"`([^`]+)`", step)]
    files = [f for p in paths if p is not None for f in ([p] if p.is_file() else sorted(p.glob("*.*")))]
    text = "\n".join(f.read_text() for f in files)
    names = [t.split(".")[-1] for t in re.findall(r"`([A-Za-z_][\w.]*)`", step)
             if not t.startswith(("jax.", "jaxgin.")) and "/" not in t and not t.endswith((".h", ".cu", ".py", ".cc"))]
    assert files and names, step
    absent = [n for n in names if re.search(rf"\b{re.escape(n)}\b", text) is None]
    assert not absent, f"not in {[str(f.relative_to(ROOT)) for f in files]}: {absent}"
