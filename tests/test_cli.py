"""The `reap` entry point: help, unknown commands, one-line errors with exit codes."""

import subprocess
import sys

import pytest

from reap.cli import COMMANDS, build_parser


def test_help_lists_available_commands():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0
    for name in COMMANDS:
        assert name in out.stdout


def test_unknown_command_is_usage_error():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "nope"], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr


def test_every_available_command_has_help(capsys):
    """In-process (a subprocess each would import torch a dozen times)."""
    for name in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            build_parser(only=name).parse_args([name, "--help"])
        assert exit_.value.code == 0, name
        assert "usage: reap " + name in capsys.readouterr().out


def test_registry_names_are_modules():
    assert all(m.startswith("reap.") for m, _ in COMMANDS.values())


SPIN_PROBE = """
import os, sys
from reap.cli import main
try:
    main(sys.argv[1:])
except SystemExit:  # argparse's usage error
    pass
print(os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize(("argv", "env", "want"), [
    (["run", "/nonexistent-model"], {}, "10000"),  # the engine commands: set before torch loads
    (["run", "/nonexistent-model"], {"GOMP_SPINCOUNT": "5"}, "5"),  # a user's own value wins
    (["info", "/nonexistent-model"], {}, "None"),  # the others leave OpenMP alone
])  # fmt: skip
def test_engine_commands_shorten_openmp_spinning(argv, env, want):
    """The engine commands set GNU OpenMP's spin count (read when torch loads, which happens
    inside `main` when the subcommand's module is imported) unless the user set one."""
    base = {k: v for k, v in __import__("os").environ.items() if k != "GOMP_SPINCOUNT"}
    out = subprocess.run([sys.executable, "-c", SPIN_PROBE, *argv], capture_output=True,
                         text=True, env={**base, **env}, check=False)  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == want
