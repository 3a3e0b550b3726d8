"""Errors that the CLI turns into one-line messages and documented exit codes.

Library code raises `ReapError` (or a subclass) for anything a user can cause: a bad path, a
corrupt file, an unknown config. `reap.cli` prints `reap: error: <message>` and exits with the
error's `exit_code`; nothing else reaches the user as a traceback. `is_int` is the integer
check of every input parser.
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # a forward, binding or runtime failure
EXIT_USAGE = 2  # bad arguments, unknown config, unreadable or corrupt input, refused plan
EXIT_WRITE = 3  # the work finished but its result could not be written
EXIT_EXPERT_LOAD = 4  # a routed expert failed to load: results are not trustworthy
EXIT_INTERRUPTED = 5  # Ctrl-C


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


def sigterm_as_interrupt() -> None:
    """From the main thread: SIGTERM raises KeyboardInterrupt, so it stops a command the way
    Ctrl-C does (exit `EXIT_INTERRUPTED`); elsewhere a no-op (only that thread may set handlers)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
