"""What jaxgin's errors tell a user to install: the README's command, `pip install -e ".[cuda]"`,
with the checkout jaxgin runs from in place of '.', so that it works from any directory."""

from pathlib import Path

from jaxgin import errors
from jaxgin.errors import install_command

ROOT = Path(__file__).resolve().parents[1]


def test_install_command_names_this_checkout():
    assert install_command("cuda") == f'pip install -e "{ROOT}[cuda]"'
    assert install_command("cuda,torch") == f'pip install -e "{ROOT}[cuda,torch]"'


def test_install_command_outside_a_checkout(monkeypatch, tmp_path):
    """Installed without -e, jaxgin's files are not in its checkout: the command says where to run."""
    monkeypatch.setattr(errors, "__file__", str(tmp_path / "site-packages" / "jaxgin" / "errors.py"))
    assert install_command("cuda") == 'pip install -e ".[cuda]" in a checkout of jaxgin'
