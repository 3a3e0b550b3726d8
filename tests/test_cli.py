"""The `reap` entry point: help, unknown commands, one-line errors with exit codes."""

import subprocess
import sys

from reap.cli import COMMANDS, _available


def test_help_lists_available_commands():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0
    for name in _available():
        assert name in out.stdout


def test_unknown_command_is_usage_error():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "nope"], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_every_available_command_has_help():
    for name in _available():
        out = subprocess.run([sys.executable, "-m", "reap.cli", name, "--help"],
                             capture_output=True, text=True)
        assert out.returncode == 0, (name, out.stderr[-500:])
        assert "usage: reap " + name in out.stdout


def test_registry_names_are_modules():
    assert all(m.startswith("reap.") for m, _ in COMMANDS.values())
