"""The `reap` entry point: help, unknown commands, one-line errors with exit codes."""

import subprocess
import sys

import pytest

from reap.cli import COMMANDS, _available, build_parser


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


def test_every_available_command_has_help(capsys):
    """In-process (a subprocess each would import torch a dozen times)."""
    for name in _available():
        with pytest.raises(SystemExit) as exit_:
            build_parser(only=name).parse_args([name, "--help"])
        assert exit_.value.code == 0, name
        assert "usage: reap " + name in capsys.readouterr().out


def test_registry_names_are_modules():
    assert all(m.startswith("reap.") for m, _ in COMMANDS.values())
