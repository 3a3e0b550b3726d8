"""Layer-parallel calibration on Ray: `Stage` actors own contiguous layer ranges (their weights
and routed experts read once and kept resident), and each sequence shard flows stage to stage
through Ray's object store as named hidden-state arrays (`reap.calibrate.spill.state_arrays`).

Each stage runs the model's own layer protocol (`embed`, `attn_block`, `mlp_block`,
`finish_layer` of `reap.models.base`) and records its MoE layers' statistics for the shard with
calibration's `StatsAccumulator`; it returns them beside the hidden state, so a stage holds no
results: a restarted actor (its process killed) just re-runs the retried call. Shards are
pipelined: stage j works on shard k while stage j+1 works on shard k-1. The driver saves each
shard's rows atomically under OUT/.work/shards/<k>/ and sums them at the end.

Dimension letters: B sequences of a shard, T seq_len, E experts.
"""

from __future__ import annotations

import functools
import itertools
import json
import os

from reap.distributed import job as jobs
from reap.distributed.progress import gather, make_tracker
from reap.errors import ReapError
from reap.fileio import atomic_path, replace_dir

RETRIES = 3  # restarts of a dead stage actor, and retries of its calls


class Stage:
    """Layers [l0, l1) of the model held resident (stage 0 also embeds)."""

    def __init__(self, kw: dict, l0: int, l1: int, job_facts: dict, tracker, hook=None):
        from reap.calibrate.pipeline import setup_model
        from reap.calibrate.runner import LayerWeights, StoreExperts
        from reap.checkpoint import Checkpoint

        self.ckpt = Checkpoint.open(kw["model"])
        setup = setup_model(self.ckpt, kw["model"], kw["tokens"], kw["seq_len"], kw["device"],
                       kw["dtype"])
        fam, cfg = setup.fam, setup.cfg
        self.model, self.device, self.l0, self.l1 = setup.model, setup.device, l0, l1
        self.weights = LayerWeights(self.ckpt, self.device, setup.guard)  # never cleared
        self.source = StoreExperts(self.ckpt, functools.partial(fam.expert_tensor_names, cfg),
                                   self.device, fam.expert_matrices)
        self.resident: dict[tuple[int, int], dict] = {}
        self.facts, self.tracker, self.seq_counts = job_facts, tracker, kw["seq_counts"]
        self.hook = hook  # hook(shard, first layer) after each shard's layers (tests use it)

    def expert(self, layer: int, e: int) -> dict:
        """ExpertSource: an expert's tensors, read from the checkpoint once."""
        got = self.resident.get((layer, e))
        if got is None:
            got = self.resident[(layer, e)] = self.source(layer, e)
        return got

    def run(self, k: int, s0: int, s1: int, payload) -> tuple[dict | None, dict]:
        """Sequences s0..s1-1 (shard k) through this stage's layers: payload is token ids
        [B, T] (stage 0) or the previous stage's state arrays; returns (state arrays for the
        next stage, None after the last layer; {layer: rows per corpus})."""
        from reap.calibrate.accumulate import StatsAccumulator
        from reap.calibrate.spill import state_arrays, state_from_arrays
        from reap.memstat import release_memory

        f = self.facts
        if self.l0 == 0:
            state = self.model.embed(self.weights, payload.to(self.device))
        else:
            state = state_from_arrays({n: t.to(self.device) for n, t in payload.items()})
        rows = {}
        for i in range(self.l0, self.l1):
            state, x = self.model.attn_block(i, self.weights, state, cache=None)  # x [B, T, D]
            if i in f["moe_layers"]:
                acc = StatsAccumulator(f["n_experts"], f["top_k"], f["seq_corpus"], f["seq_len"],
                                       f["n_corpora"], self.seq_counts)
                acc.span(s0, s1)
                y = self.model.mlp_block(i, self.weights, x, experts=self.expert, observer=acc)
                rows[i] = acc.rows.pop(i)
            else:
                y = self.model.mlp_block(i, self.weights, x)
            state = self.model.finish_layer(i, state, y)
            release_memory()
        share = (s1 - s0) * f["seq_len"] * (self.l1 - self.l0) / f["n_layers"]
        self.tracker.report.remote((k, self.l0), share, {"pid": os.getpid(), "stage": self.l0})
        if self.hook is not None:
            self.hook(k, self.l0)
        last = self.l1 == f["n_layers"]
        return (None if last else {n: t.cpu() for n, t in state_arrays(state).items()}), rows

    def measured(self) -> dict:
        """Peak RSS of this actor's process and the checkpoint bytes it read."""
        from reap.memstat import peak_rss

        return {"peak_rss": peak_rss(), "bytes_read": self.ckpt.bytes_read,
                "experts": len(self.resident), "layers": [self.l0, self.l1]}


def layer_bytes(job: jobs.Job) -> list[int]:
    """Checkpoint bytes of each layer 0..n_layers-1 (embedding and final norms count to the
    first and last)."""
    from reap.checkpoint import Checkpoint
    from reap.models import load_config

    with Checkpoint.open(job.kw["model"]) as ckpt:
        fam, _ = load_config(ckpt.config, job.kw["model"])
        per = [0] * job.n_layers
        for s in fam.layout(ckpt.config):
            info = ckpt.tensors.get(s.name)
            if info is not None and (s.layer is None or s.layer < job.n_layers):
                per[0 if s.layer is None else s.layer] += info.nbytes
    return per


def split_layers(per: list[int], workers: int) -> list[tuple[int, int]]:
    """Contiguous ranges [l0, l1) over len(per) layers, balanced by bytes, one layer at least
    each (at most one stage per layer)."""
    L = len(per)
    n, total = min(workers, L), sum(per)
    cuts, acc = [], 0
    for i in range(L - 1):
        acc += per[i]
        need = n - 1 - len(cuts)
        if need and (acc >= total * (len(cuts) + 1) / n or L - (i + 1) == need):
            cuts.append(i + 1)
    return list(itertools.pairwise([0, *cuts, L]))


def _collect(*rows: dict) -> dict:
    """The rows of every stage of one shard as one {layer: rows} dict (a Ray task)."""
    return {layer: r for part in rows for layer, r in part.items()}


def run_layers(ray, job: jobs.Job, *, shards: int, workers: int, progress: bool, hook=None,
               on_done=None, on_poll=None) -> tuple[dict, dict, int]:
    """Layer-parallel calibration of every unfinished shard, then the final files; returns
    (files, {stage: peak RSS}, checkpoint bytes read)."""
    from reap.calibrate import runner

    per = layer_bytes(job)
    ranges = split_layers(per, workers)
    for a, b in ranges:
        if sum(per[a:b]) > job.kw["budget"]:
            raise ReapError(f"layers {a}..{b - 1} hold {sum(per[a:b])} bytes of weights, more "
                            f"than --budget {job.kw['budget']}: use more --workers")
    facts = {"moe_layers": job.moe_layers, "n_experts": job.n_experts, "top_k": job.top_k,
             "seq_corpus": job.seq_corpus, "seq_len": job.kw["seq_len"],
             "n_corpora": len(job.names), "n_layers": job.n_layers}
    gpu = 1 if job.kw["device"].startswith("cuda") else 0
    actor = ray.remote(num_cpus=1, num_gpus=gpu, max_restarts=RETRIES,
                       max_task_retries=RETRIES)(Stage)
    tracker = make_tracker(ray)
    stages = [actor.remote(job.kw, a, b, facts, tracker, hook) for a, b in ranges]
    collect = ray.remote(num_cpus=0)(_collect)
    spans = {k: runner.resolve_shard((k, shards), job.n_seq) for k in range(1, shards + 1)}

    def submit(k: int):
        s0, s1 = spans[k]
        payload, rows = job.ids[s0:s1], []
        for st in stages:
            payload, r = st.run.options(num_returns=2).remote(k, s0, s1, payload)
            rows.append(r)
        return collect.remote(*rows)

    def done(k: int, rows: dict) -> None:
        save_rows(job, k, rows)
        if on_done is not None:
            on_done(k)

    todo = [k for k in spans if not job.finished(k)]
    T = job.kw["seq_len"]
    gather(ray, todo, submit, len(stages) + 1, tracker, total=job.n_seq * T,
           initial=sum((spans[k][1] - spans[k][0]) * T for k in spans if k not in todo),
           on_done=done, progress=progress, desc=f"calibrate {len(stages)} stages",
           on_poll=on_poll)
    measured = ray.get([st.measured.remote() for st in stages])
    for st in stages:
        ray.kill(st)
    return _finish(job, shards, measured)


def save_rows(job: jobs.Job, k: int, rows: dict) -> None:
    """One finished shard's {layer: rows} into a temporary directory renamed into place."""
    from reap.calibrate import artifacts as art

    final = job.shard_dir(k)
    tmp = f"{final}.tmp.{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    for layer, r in rows.items():
        art.save_rows(tmp, layer, r)
    with atomic_path(os.path.join(tmp, "shard.json"), fsync=True) as p, open(p, "w") as f:
        json.dump({"shard": k, "layers": sorted(rows)}, f)
    replace_dir(tmp, final)


def _finish(job: jobs.Job, shards: int, measured: list[dict]) -> tuple[dict, dict, int]:
    """Sum every shard's rows per layer and write the statistics files."""
    from reap.calibrate import artifacts as art
    from reap.stats import ExpertSums

    total: dict = {}
    for k in range(1, shards + 1):
        for layer in job.moe_layers:
            rows = [ExpertSums(**r) for r in art.load_rows(job.shard_dir(k), layer,
                                                           len(job.names))]
            total[layer] = jobs.add_rows(total.get(layer), rows)
    read = sum(m["bytes_read"] for m in measured)
    counters = {"bytes_read": read, "checkpoint_bytes": _checkpoint_bytes(job),
                "expert_reads_max": 1, "expert_reads": sum(m["experts"] for m in measured),
                "passes": 1}
    files = jobs.write_outputs(job, total, counters)
    peaks = {f"layers {m['layers'][0]}..{m['layers'][1] - 1}": m["peak_rss"] for m in measured}
    return files, peaks, read


def _checkpoint_bytes(job: jobs.Job) -> int:
    from reap.checkpoint import Checkpoint

    with Checkpoint.open(job.kw["model"]) as ckpt:
        return sum(t.nbytes for t in ckpt.tensors.values())
