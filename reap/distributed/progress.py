"""Driving Ray work from the driver: one progress bar over all workers and result gathering.

Workers report `(key, tokens done)` to a `Tracker` actor (absolute, so a retried or resumed shard
never counts twice); the driver waits for results with a short timeout, redraws one tqdm bar
(tokens/s, ETA) from the tracker, hands each finished result to `on_done`, and cancels what is
still running when it stops early (Ctrl-C, a failed shard).
"""

from __future__ import annotations

from reap.errors import ReapError

_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} tok [{elapsed}<{remaining}, " \
    "{rate_fmt}{postfix}]"
POLL_S = 0.5  # how often the bar is redrawn while waiting for results


class TrackerState:
    """What workers reported: tokens done per key and the last note (pid, layer) per key."""

    def __init__(self):
        self.done: dict = {}
        self.notes: dict = {}

    def report(self, key, tokens: float, note: dict | None = None) -> None:
        self.done[key] = max(self.done.get(key, 0.0), tokens)
        if note is not None:
            self.notes[key] = note

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.done), dict(self.notes)

    def reset(self) -> None:
        self.done, self.notes = {}, {}


_TRACKERS: dict = {}  # Ray job id -> this driver's tracker handle (held: the actor lives on)


def make_tracker(ray):
    """This driver's `TrackerState` actor (no CPU reserved), emptied: one per driver and Ray
    job, reused by its later runs (an actor costs a worker process start)."""
    job = ray.get_runtime_context().get_job_id()
    tracker = _TRACKERS.get(job)
    if tracker is None:
        tracker = _TRACKERS[job] = ray.remote(num_cpus=0)(TrackerState).remote()
    ray.get(tracker.reset.remote())
    return tracker


def unwrap(ray, ref):
    """`ray.get(ref)`, with a worker's ReapError re-raised as itself (one line, its exit code)
    and any other Ray failure (a worker or actor lost past its retries...) as one line, exit 1."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ReapError):
            raise e.cause from None
        raise RuntimeError(f"a Ray worker failed: {type(e.cause).__name__}: {e.cause}") from None
    except ray.exceptions.RayError as e:
        line = (str(e).strip().splitlines() or [""])[0]
        raise ReapError(f"Ray: {type(e).__name__}: {line}", exit_code=1) from None


def gather(ray, keys: list, submit, workers: int, tracker, *, total: float, initial: float,
           on_done, progress: bool, desc: str, on_poll=None) -> None:
    """Run `submit(key) -> ref` for every key, at most `workers` in flight; call
    `on_done(key, result)` as each finishes and `on_poll(notes)` at each redraw (tests use it).
    What is still running is cancelled when this returns early (error, Ctrl-C)."""
    from tqdm import tqdm

    queue, pending = list(keys), {}
    bar = tqdm(total=total, initial=initial, unit="tok", desc=desc, disable=not progress,
               dynamic_ncols=True, smoothing=0.1, bar_format=_BAR)
    try:
        while queue or pending:
            while queue and len(pending) < workers:
                key = queue.pop(0)
                pending[submit(key)] = key
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=POLL_S)
            done, notes = unwrap(ray, tracker.snapshot.remote())
            bar.n = min(total, initial + sum(done.values()))
            bar.set_postfix_str(f"{len(pending)} running", refresh=False)
            bar.refresh()
            if on_poll is not None:
                on_poll(notes)
            for ref in ready:
                on_done(pending.pop(ref), unwrap(ray, ref))
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        _drain(ray, pending)
        bar.close()


def _drain(ray, refs) -> None:
    """Fetch and drop what cancelled or failed `refs` hold: Ray prints an error nobody fetched
    as "Unhandled error" when its ref is freed, which would break the one-line error contract."""
    for ref in refs:
        try:
            ray.get(ref, timeout=30)
        except Exception:  # noqa: BLE001 - cancelled, failed or lost: all are being dropped
            pass
