"""Errors that the CLI turns into one-line messages and documented exit codes.

Library code raises `ReapError` (or a subclass) for anything a user can cause: a bad path, a
corrupt file, an unknown config. `reap.cli` prints `reap: error: <message>` and exits with the
error's `exit_code`; nothing else reaches the user as a traceback. `is_int` is the integer
check of every input parser. `on_interrupt` makes SIGINT and SIGTERM exit 5 within a deadline.
"""

import os
import signal
import sys
import threading
import time

EXIT_OK = 0
EXIT_FAILURE = 1  # a forward, binding or runtime failure
EXIT_USAGE = 2  # bad arguments, unknown config, unreadable or corrupt input, refused plan
EXIT_WRITE = 3  # the work finished but its result could not be written
EXIT_EXPERT_LOAD = 4  # a routed expert failed to load: results are not trustworthy
EXIT_INTERRUPTED = 5  # Ctrl-C or SIGTERM
_FIRED: list = []  # signals received, or None from `exiting()`: the next one exits at once


class ReapError(Exception):
    """A user-facing failure with a one-line message and an exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class CheckpointError(ReapError):
    """A checkpoint file is missing, corrupt, truncated or inconsistent."""


class WriteError(ReapError):
    """An output could not be written."""

    exit_code = EXIT_WRITE


class ExpertLoadError(ReapError):
    """A routed expert could not be read: tokens computed without it are untrustworthy."""

    exit_code = EXIT_EXPERT_LOAD


def is_int(x) -> bool:
    """An int that is not a bool (JSON true/false must not pass as a count, an id or a seed)."""
    return isinstance(x, int) and not isinstance(x, bool)


def first_difference(a: list, b: list, what: str = "layers") -> str:
    """Where two lists first differ, for a message: 'layers differ at position 3: 7 vs 9 (5 and 4
    layers)'. Messages show this instead of truncated lists that stop before the difference."""
    a, b = list(a), list(b)
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    left = repr(a[i]) if i < len(a) else "(end)"
    right = repr(b[i]) if i < len(b) else "(end)"
    return f"{what} differ at position {i}: {left} vs {right} ({len(a)} and {len(b)} {what})"


def on_interrupt(grace: float, force=None) -> None:
    """From now on SIGINT and SIGTERM raise KeyboardInterrupt in the main thread (exit 5
    through `reap.cli`); `grace` s after the first, at a second one, or at any once `exiting()`,
    `force()` runs and the process exits 5 at once: no stuck thread holds it (main thread only,
    else a no-op; for commands that hold threads or processes: serve, --ray)."""
    if threading.current_thread() is not threading.main_thread():
        return

    def hard_exit() -> None:
        if force is not None:
            force()
        print("reap: interrupted (exiting now, cleanup cut short)", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    def handler(signum, frame) -> None:
        if _FIRED:
            hard_exit()
        _FIRED.append(signum)
        threading.Thread(target=lambda: (time.sleep(grace), hard_exit()), daemon=True).start()
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


def exiting() -> None:
    """Cleanup under way: a signal now exits at once rather than interrupting it half done."""
    _FIRED.append(None)
