"""`calibrate_ray(...)`: `reap calibrate --ray [ADDRESS] [--workers N] [--layer-parallel]`.

    res = calibrate_ray(address=None, workers=4, corpus="zh+code", tokens=65536, seq_len=512,
                        out="runs/zh-code", model="k3-mini")

Writes the same statistics files as `reap.calibrate.pipeline.calibrate` with the same arguments
(counts exactly equal, float sums to float64 rounding, maxima to float32 rounding of
differently batched kernels), plus run.json with each worker's peak RSS. See the package
docstring for the two modes.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

from reap.distributed import connect
from reap.distributed import job as jobs
from reap.errors import ReapError

MODES = ("tokens", "layers")


@dataclass
class DistributedResult:
    """What a distributed calibration wrote and measured."""

    out: str
    files: dict[str, str]  # corpus -> statistics file, plus "all"
    tokens: int
    layers: list[int]  # MoE layers recorded
    mode: str
    shards: int
    workers: int
    shards_run: list[int]  # shards computed by this invocation (the rest were resumed)
    seconds: float
    worker_peak_rss: dict = field(default_factory=dict)  # shard or stage -> peak RSS, bytes
    bytes_read: int = 0


def calibrate_ray(*, address: str | None = None, workers: int = 2, mode: str = "tokens",
                  shards: int | None = None, progress: bool = True, hook=None, on_done=None,
                  on_poll=None, **kw) -> DistributedResult:
    """Distributed `calibrate` (keyword arguments as there; no shard, hooks or token ids).

    workers: concurrent shard tasks (tokens) or pipeline stages (layers). shards: sequence shards
    (default: workers in token mode, 4 x workers in layer mode), the unit of resume.
    hook(shard, layer) runs in the worker after each committed layer (tokens) or after a stage
    ran a shard through its layers, `layer` its first (layers); on_done(shard) on the driver
    after each saved shard and on_poll(notes) at each progress redraw (tests use them).
    """
    if mode not in MODES:
        raise ReapError(f"unknown distributed mode {mode!r} (choose from {', '.join(MODES)})")
    if workers < 1:
        raise ReapError(f"--workers must be at least 1, got {workers}")
    if kw.pop("save_token_experts", False):
        raise ReapError("--save-token-experts is not supported with --ray")
    t0 = time.perf_counter()
    kw = {"model": None, "budget": 4_000_000_000, "device": "cpu", "dtype": "float32",
          "seed": 0, "batch": None, "seq_counts": None, "max_pass_seqs": None, **kw}
    shards = shards or (workers if mode == "tokens" else 4 * workers)
    out = kw.pop("out")
    job = jobs.prepare(kw, out, mode, shards)
    ray = connect(address)
    before = {k for k in range(1, shards + 1) if job.finished(k)}
    if mode == "tokens":
        files, records, read = _tokens(ray, job, shards, workers, progress, hook, on_done,
                                       on_poll)
    else:
        from reap.distributed.layers import run_layers

        files, records, read = run_layers(ray, job, shards=shards, workers=workers,
                                          progress=progress, hook=hook, on_done=on_done,
                                          on_poll=on_poll)
    res = DistributedResult(job.out, files, job.n_seq * job.kw["seq_len"], job.moe_layers,
                            mode, shards, workers, sorted(set(range(1, shards + 1)) - before),
                            time.perf_counter() - t0, records, read)
    _write_run(job, res)
    shutil.rmtree(job.work, ignore_errors=True)
    return res


def _tokens(ray, job, shards, workers, progress, hook, on_done, on_poll):
    from reap.distributed import shards as sh

    records = sh.run_shards(ray, job, shards=shards, workers=workers, progress=progress,
                            hook=hook, on_done=on_done, on_poll=on_poll)
    parts = sh.load_parts(job, shards)
    c = sh.counters(parts)
    files = jobs.write_merged(job, parts, c)
    return files, {f"shard {r['shard']}": r["peak_rss"] for r in records}, c["bytes_read"]


def _write_run(job: jobs.Job, res: DistributedResult) -> None:
    from reap.calibrate.artifacts import write_json

    write_json(os.path.join(job.out, "run.json"),
               {"seconds": res.seconds, "tokens_per_second": res.tokens / max(res.seconds, 1e-9),
                "mode": res.mode, "shards": res.shards, "workers": res.workers,
                "shards_run": res.shards_run, "budget": job.kw["budget"],
                "worker_peak_rss": res.worker_peak_rss, "bytes_read": res.bytes_read,
                "files": res.files})
