"""`reap eval --ray`: the evaluation's uncached tasks (build x domain quality, generations per
build) as Ray tasks, into the same cache and results as a local run.

`ray_runner(address, workers)` is passed to `reap.eval.pipeline.evaluate` as its `run_tasks`:
each Ray task opens the reference and its build under the evaluation's own engine options
(its own --budget) and runs exactly the local code on its one task; the result comes back
through the object store and the driver caches it (unless an expert failed to load), so the
results document is then assembled from the cache as always.
"""

from __future__ import annotations

from reap.distributed import connect
from reap.distributed.progress import gather, make_tracker


class _Capture:
    """A Cache stand-in that keeps what a worker would have stored."""

    def __init__(self):
        self.items: list[tuple] = []

    def put(self, kind: str, key: str, fields: dict, payload) -> None:
        self.items.append((kind, key, fields, payload))


class _Bar:
    """tqdm-like `update` that reports a task's tokens to the progress tracker."""

    def __init__(self, tracker, key):
        self.tracker, self.key, self.n = tracker, key, 0

    def update(self, n: int) -> None:
        self.n += n
        self.tracker.report.remote(self.key, self.n)


def eval_task(work: tuple, opts: dict, tracker, key: int) -> dict:
    """Run in a Ray worker: one evaluation task with the local code; returns its payload, what
    it would have cached and the experts that failed to load. `work` is (workload, task) in one
    argument, so the task's build stays the very object `workload.ref` when it is the reference."""
    from reap.eval.builds import Engines
    from reap.eval.tasks import compute_tasks

    w, task = work
    engines, capture = Engines(w.ref, opts), _Capture()
    try:
        compute_tasks([task], w, engines, opts, capture, _Bar(tracker, key))
    finally:
        engines.close()
    return {"payload": task.payload, "items": capture.items, "failures": engines.failures}


def ray_runner(address: str | None, workers: int):
    """A `run_tasks` for `evaluate` running each uncached task on the Ray cluster at `address`,
    at most `workers` at once (one CPU, or one GPU on --device cuda, each)."""

    def run(todo, w, engines, args, cache, progress) -> None:
        from reap.eval.tasks import total_tokens

        ray = connect(address)
        gpu = 1 if args["device"].startswith("cuda") else 0
        remote = ray.remote(num_cpus=1, num_gpus=gpu, max_retries=3,
                            retry_exceptions=False)(eval_task)
        tracker, opts = make_tracker(ray), {**args, **engines.opts}

        def submit(i: int):
            return remote.remote((w, todo[i]), opts, tracker, i)

        def done(i: int, result: dict) -> None:
            engines.failures.update(result["failures"])
            todo[i].payload = result["payload"]
            for kind, key, fields, payload in result["items"]:
                cache.put(kind, key, fields, payload)

        gather(ray, list(range(len(todo))), submit, workers, tracker, total=total_tokens(todo, w),
               initial=0, on_done=done, progress=progress and bool(todo), desc=f"eval x{workers}")

    return run
