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
