"""jaxgin asks CUDA for its maximum of hardware queues when imported, keeps a value the user set,
and says what a low one risks (jaxgin.hardware_queues says why)."""

import os
import subprocess
import sys

import pytest

from jaxgin import hardware_queues


def _imported_value(env_value):
    env = {k: v for k, v in os.environ.items() if k != hardware_queues.VARIABLE}
    if env_value is not None:
        env[hardware_queues.VARIABLE] = env_value
    code = "import os, jaxgin; print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_asks_for_every_queue():
    assert _imported_value(None) == "32"


def test_import_keeps_the_users_value():
    assert _imported_value("1") == "1"


@pytest.mark.parametrize("value, warns", [("32", False), ("1", True), ("8", True), ("many", True)])
def test_low_setting_warning(monkeypatch, value, warns):
    monkeypatch.setenv(hardware_queues.VARIABLE, value)
    warning = hardware_queues.low_setting_warning()
    if not warns:
        assert warning is None
    else:
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={value!r}" in warning and "set 32" in warning


def test_unset_is_not_low(monkeypatch):
    monkeypatch.delenv(hardware_queues.VARIABLE, raising=False)
    assert hardware_queues.low_setting_warning() is None
