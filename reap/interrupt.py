"""SIGINT and SIGTERM as Ctrl-C with a deadline (`reap serve`, `--ray`): KeyboardInterrupt in the
main thread (exit 5 through `reap.cli`); `grace` s after the first signal, at a second one, or at
any once `exiting()`, the process runs its `force` cleanup and exits 5 at once."""

import os
import signal
import sys
import threading
import time

from reap.errors import EXIT_INTERRUPTED

_FIRED: list = []  # signals received, or None from `exiting()`: the next one exits at once


def on_interrupt(grace: float, force=None) -> None:
    """Handle SIGINT and SIGTERM as above from now on (main thread only, else a no-op)."""
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
