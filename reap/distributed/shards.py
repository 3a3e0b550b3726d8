"""Token-sharded calibration on Ray: each of N contiguous sequence shards is a Ray task running
the ordinary streaming calibration (`reap calibrate --shard K/N`, its own --budget and device)
in a scratch directory; its statistics come back through the object store and the driver saves
them atomically under OUT/.work/shards/<K>/ before merging all shards exactly.

Failure handling: a worker process that dies (SIGKILL, OOM) is retried by Ray (`max_retries`)
and resumes the shard after its last committed layer when it lands on the same machine; a
rerun of the whole command skips finished shards. Bad input inside a shard is not retried.
"""

from __future__ import annotations

import json
import os
import time

from reap.distributed import job as jobs
from reap.distributed.progress import gather, make_tracker
from reap.fileio import atomic_path, replace_dir

RETRIES = 3  # attempts after a worker dies, per shard


def shard_task(kw: dict, k: int, n: int, names: list[str], scratch: str, tracker, tokens: int,
               n_layers: int, hook=None) -> dict:
    """Run in a Ray worker: calibrate shard k of n into `scratch` (resuming what is there) and
    return its per-corpus statistics files as bytes with the worker's peak RSS."""
    from reap.calibrate.artifacts import safe_name
    from reap.calibrate.pipeline import calibrate
    from reap.memstat import peak_rss

    def after_layer(layer: int) -> None:
        tracker.report.remote(k, tokens * (layer + 1) / n_layers,
                              {"pid": os.getpid(), "layer": layer})
        if hook is not None:
            hook(k, layer)

    t0, resumed = time.perf_counter(), None
    if not os.path.exists(os.path.join(scratch, "run.json")):  # else: done, result not saved
        res = calibrate(**kw, shard=(k, n), out=scratch, progress=False, hooks=after_layer)
        resumed = res.resumed_after
    tracker.report.remote(k, tokens, {"pid": os.getpid(), "layer": n_layers - 1})
    files = {}
    for name in names:
        with open(os.path.join(scratch, f"{safe_name(name)}.safetensors"), "rb") as f:
            files[name] = f.read()
    return {"files": files, "peak_rss": peak_rss(), "pid": os.getpid(), "resumed_after": resumed,
            "seconds": time.perf_counter() - t0}


def run_shards(ray, job: jobs.Job, *, shards: int, workers: int, progress: bool,
               hook=None, on_done=None, on_poll=None) -> list[dict]:
    """Calibrate every unfinished shard on the cluster (at most `workers` at once, one CPU and,
    on --device cuda, one GPU each); returns each shard's record (shard.json) in order."""
    from reap.calibrate import artifacts as art
    from reap.calibrate import runner

    kw = {k: v for k, v in job.kw.items() if k not in ("progress", "shard", "hooks")}
    dev = kw["device"]
    task = ray.remote(num_cpus=1, num_gpus=1 if dev.startswith("cuda") else 0,
                      max_retries=RETRIES, retry_exceptions=False)(shard_task)
    tracker, T = make_tracker(ray), job.kw["seq_len"]
    spans = {k: runner.resolve_shard((k, shards), job.n_seq) for k in range(1, shards + 1)}
    sizes = {k: (s1 - s0) * T for k, (s0, s1) in spans.items()}
    todo = [k for k in range(1, shards + 1) if not job.finished(k)]

    def submit(k: int):
        scratch = os.path.join(job.work, "scratch", str(k))
        return task.remote(kw, k, shards, job.names, scratch, tracker, sizes[k], job.n_layers,
                           hook)

    def done(k: int, result: dict) -> None:
        save_shard(job, k, result)
        if on_done is not None:
            on_done(k)

    gather(ray, todo, submit, workers, tracker, total=job.n_seq * T,
           initial=sum(sizes[k] for k in sizes if k not in todo), on_done=done,
           progress=progress, desc=f"calibrate x{workers}", on_poll=on_poll)
    return [art.read_json(os.path.join(job.shard_dir(k), "shard.json"))
            for k in range(1, shards + 1)]


def save_shard(job: jobs.Job, k: int, result: dict) -> None:
    """Write a finished shard into a temporary directory, then rename it into place whole."""
    from reap.calibrate.artifacts import safe_name

    final = job.shard_dir(k)
    tmp = f"{final}.tmp.{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for name, data in result["files"].items():
        with open(os.path.join(tmp, f"{safe_name(name)}.safetensors"), "wb") as f:
            f.write(data)
    record = {k2: v for k2, v in result.items() if k2 != "files"}
    with atomic_path(os.path.join(tmp, "shard.json"), fsync=True) as p, open(p, "w") as f:
        json.dump({"shard": k, **record}, f)
    replace_dir(tmp, final)


def load_parts(job: jobs.Job, shards: int) -> list[dict]:
    """{corpus: ExpertStats} of every saved shard, in shard (= sequence) order."""
    from reap.calibrate.artifacts import safe_name
    from reap.stats import ExpertStats

    return [{n: ExpertStats.load(os.path.join(job.shard_dir(k), f"{safe_name(n)}.safetensors"))
             for n in job.names} for k in range(1, shards + 1)]


def counters(parts: list[dict]) -> dict:
    """The run's I/O counters from the shards' records: reads add up, maxima take the max."""
    metas = [p[next(iter(p))].meta for p in parts]
    return {"bytes_read": sum(m["bytes_read"] for m in metas),
            "checkpoint_bytes": metas[0]["checkpoint_bytes"],
            "expert_reads_max": max(m["expert_reads_max"] for m in metas),
            "expert_reads": sum(m["expert_reads"] for m in metas),
            "passes": max(m["passes"] for m in metas)}
