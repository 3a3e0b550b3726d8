"""Calibration and evaluation on a Ray cluster (`reap calibrate --ray`, `reap eval --ray`).

Ray is optional (`pip install -e ".[distributed]"`): nothing here imports it at module level, and
`require_ray` turns its absence into one line, exit 2. Calibration is token-sharded (`shards.py`:
each Ray task calibrates a sequence shard, merged exactly into a single run's files) or
layer-parallel (`layers.py`: actors own layer ranges, hidden states flow between them); `eval.py`
runs `reap eval`'s (build x domain) tasks. A cluster address of None starts (or joins, via
RAY_ADDRESS) a local cluster, which listens on 127.0.0.1 and dies with the driver; workers on
other machines need the same `reap` installed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
from concurrent.futures import Future

from reap.errors import ReapError, exiting, on_interrupt

INSTALL = 'pip install -e ".[distributed]"'
GRACE = 15  # seconds from SIGINT/SIGTERM to exit, the local cluster stopped


def require_ray():
    """The `ray` module, or ReapError (exit 2) saying how to install it."""
    # read at import: a cluster reap starts is this machine alone, every server on 127.0.0.1
    # (an ADDRESS given is joined as it is), and SIGTERM is reap's to handle
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    # no workers before the driver registers: one dying then hangs ray.init for good
    os.environ.setdefault("RAY_enable_worker_prestart", "0")
    try:
        import ray
    except ImportError:
        raise ReapError(f"--ray needs the optional dependency ray: {INSTALL}") from None
    return ray


def connect(address: str | None):
    """Join the cluster at `address` (None: the one already joined, else RAY_ADDRESS or a new
    local one, stopped with all its processes when this one exits); returns the `ray` module.
    SIGINT and SIGTERM stop the driver (`reap.errors.on_interrupt`, GRACE)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    local = _LocalCluster() if not (address or os.environ.get("RAY_ADDRESS")) else None
    on_interrupt(GRACE, local.kill if local else None)
    try:
        _init(ray, address="local" if local else address, include_dashboard=False,
              log_to_driver=False, configure_logging=False)
    except BaseException as e:  # interrupted or failed while starting: stop what started
        if local:
            local.stop(ray)
        if isinstance(e, (ConnectionError, ValueError, RuntimeError)):
            raise ReapError(f"--ray {address or ''}: cannot join the Ray cluster: {e}") from None
        raise
    if local:
        atexit.register(local.stop, ray)
    return ray


def _init(ray, **kw) -> None:
    """ray.init in a thread that lives on: no signal lands in it (a Ray half made crashes), Ray
    sets no SIGTERM handler, and what it starts lives on (it dies with its starter thread)."""
    done: Future = Future()

    def start() -> None:
        try:
            done.set_result(ray.init(**kw))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            return done.set_exception(e)
        threading.Event().wait()

    log = logging.getLogger("ray._private.worker")  # it warns that it set no SIGTERM handler
    log.addFilter(lambda r: "main thread" not in r.getMessage())
    threading.Thread(target=start, name="reap-ray-init", daemon=True).start()
    try:
        done.result()
    except KeyboardInterrupt:
        done.exception()  # wait: Ray started (or failed) whole before it is stopped
        raise


class _LocalCluster:
    """The local cluster this driver starts: its new children (GCS, raylet...) and their
    descendants (agents, workers), found in /proc (Linux)."""

    def __init__(self):
        self.before = set(_children().get(os.getpid(), ()))

    def pids(self) -> list[int]:
        kids = _children()
        todo, found = [p for p in kids.get(os.getpid(), ()) if p not in self.before], []
        while todo:
            found.append(todo.pop())
            todo += kids.get(found[-1], ())
        return found

    def stop(self, ray) -> None:
        """ray.shutdown(), then kill what outlived it (the raylet's agents)."""
        exiting()
        pids = self.pids()  # before: orphans are no descendants of ours
        try:
            ray.shutdown()
        finally:
            _signal(pids, signal.SIGKILL)

    def kill(self) -> None:
        """Kill all at once, each stopped first so that none starts another."""
        seen: set[int] = set()
        while new := set(self.pids()) - seen:
            _signal(new, signal.SIGSTOP)
            seen |= new
        _signal(seen, signal.SIGKILL)


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids of every process (none without /proc)."""
    kids: dict[int, list[int]] = {}
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{pid}/stat") as f:
                kids.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return kids


def _signal(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)
