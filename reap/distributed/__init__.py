"""Calibration and evaluation on a Ray cluster (`reap calibrate --ray`, `reap eval --ray`).

Ray is an optional dependency (`pip install -e ".[distributed]"`); nothing here imports it at
module level, and `require_ray` turns its absence into one line, exit 2. Two calibration modes:

- `reap.distributed.shards` (token-sharded): the calibration sequences are cut into N contiguous
  shards (`reap calibrate --shard K/N`), each a Ray task that runs the ordinary streaming
  calibration with its own `--budget` and device; the driver saves each finished shard atomically
  under `OUT/.work/shards/` and merges them exactly (`reap.stats.merge`) into the files a
  single-process run writes.
- `reap.distributed.layers` (layer-parallel): Ray actors own contiguous layer ranges and keep
  their weights resident; hidden states of each sequence shard flow stage to stage through Ray's
  object store, each stage records the statistics of its own MoE layers.

`reap.distributed.eval` runs `reap eval`'s (build x domain) tasks as Ray tasks into the same cache.
A cluster address of None starts (or joins, via RAY_ADDRESS) a local cluster; workers on other
machines need the same `reap` installed.
"""

from __future__ import annotations

import atexit

from reap.errors import ReapError, sigterm_as_interrupt

INSTALL = 'pip install -e ".[distributed]"'


def require_ray():
    """The `ray` module, or ReapError (exit 2) saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ReapError(f"--ray needs the optional dependency ray: {INSTALL}") from None
    return ray


def connect(address: str | None):
    """Join the cluster at `address` (None: the one already joined, else RAY_ADDRESS or a new
    local one); returns the `ray` module. From the main thread, SIGTERM then stops the driver
    like Ctrl-C, and the driver's exit stops the local cluster it started (`ray.shutdown`)."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise ReapError(f"--ray {address or ''}: cannot join the Ray cluster: {e}") from None
    atexit.register(ray.shutdown)
    sigterm_as_interrupt()  # after ray.init, which sets its own
    return ray

