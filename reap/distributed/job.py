"""A distributed calibration job: its arguments and identity, its work directory, and the final
statistics files, written exactly as a single-process `reap calibrate` writes them.

    OUT/.work/job.json            mode, shard count and the calibrate arguments (resume check)
    OUT/.work/shards/<k>/         one finished shard, renamed into place whole (atomic)
    OUT/.work/scratch/<k>/        a running shard's own work directory (token-sharded mode)

The statistics metadata repeats the record `reap.calibrate.pipeline` writes (identity, corpus
and I/O counters) with `shard` [1, 1] and the whole sequence range, so readers cannot tell a
distributed run from a single-process one except by run.json; tests compare the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from reap.calibrate import artifacts as art
from reap.errors import ReapError
from reap.stats import ExpertSums, sum_fields


@dataclass
class Job:
    """Facts every mode needs, resolved once on the driver."""

    kw: dict  # keyword arguments of reap.calibrate.pipeline.calibrate (model resolved)
    out: str
    names: list[str]  # corpora of the mixture
    seq_corpus: list[int]  # [S] corpus index of each calibration sequence
    doc_ids: list[str]
    moe_layers: list[int]
    n_experts: int
    top_k: int
    ids: torch.Tensor  # [S, T] token ids of every calibration sequence
    identity: dict = field(default_factory=dict)

    @property
    def work(self) -> str:
        return os.path.join(self.out, ".work")

    @property
    def n_seq(self) -> int:
        return len(self.seq_corpus)

    @property
    def n_layers(self) -> int:
        return max(self.moe_layers) + 1

    def shard_dir(self, k: int) -> str:
        return os.path.join(self.work, "shards", str(k))

    def finished(self, k: int) -> bool:
        return os.path.exists(os.path.join(self.shard_dir(k), "shard.json"))


def prepare(kw: dict, out: str, mode: str, shards: int) -> Job:
    """Check the arguments and the model as calibrate does, sample the sequences, and open (or
    resume) the job's work directory; ReapError (exit 2) on bad input or a different job."""
    from reap.calibrate.pipeline import default_model, setup_model
    from reap.checkpoint import Checkpoint
    from reap.corpora import calibration_sequences, corpus_fingerprint, parse_spec
    from reap.provenance import code_version
    from reap.tokenizer import load_tokenizer

    names = [n for n, _ in parse_spec(kw["corpus"])]
    kw = dict(kw, model=os.path.abspath(kw["model"] or default_model()))
    with Checkpoint.open(kw["model"]) as ckpt:
        # the driver computes nothing: "cpu" here, each worker checks its own --device
        size = setup_model(ckpt, kw["model"], kw["tokens"], kw["seq_len"], "cpu",
                           kw["dtype"]).size
        fingerprint = ckpt.fingerprint()
    seqs = calibration_sequences(kw["corpus"], load_tokenizer(kw["model"]), kw["tokens"],
                                 kw["seq_len"], kw["seed"])
    if shards > len(seqs):
        raise ReapError(f"--workers/shards {shards}: only {len(seqs)} sequences to share")
    if kw["seq_counts"] is None:  # decided for the whole run, not per shard
        from reap.calibrate.pipeline import SEQ_COUNT_AUTO_BYTES

        kw["seq_counts"] = len(seqs) * len(size.moe_layers) * size.n_experts * 4 \
            <= SEQ_COUNT_AUTO_BYTES
    job = Job(kw, os.path.abspath(out), names, [names.index(s.corpus) for s in seqs],
              [s.doc_id for s in seqs], list(size.moe_layers), size.n_experts, size.top_k,
              torch.tensor([s.ids for s in seqs], dtype=torch.int64))
    args = {k: kw[k] for k in ("model", "corpus", "tokens", "seq_len", "seed", "budget",
                               "device", "dtype", "batch")}
    args.update(shard=[1, 1], save_token_experts=False, seq_counts=kw["seq_counts"],
                max_pass_seqs=kw.get("max_pass_seqs"))
    job.identity = {"arguments": args, "model": fingerprint,
                    "corpus_sha256": corpus_fingerprint(kw["corpus"], art.SPLIT),
                    "code_version": code_version(art.RESULT_CODE), "sequences": [0, len(seqs)]}
    _open_work(job, {"mode": mode, "shards": shards, "identity": job.identity})
    return job


def _open_work(job: Job, record: dict) -> None:
    path = os.path.join(job.work, "job.json")
    old = art.read_json(path)
    if old is None and os.path.exists(os.path.join(job.out, "all.safetensors")):
        raise ReapError(f"{job.out} already holds finished statistics; choose another --out")
    if old is not None and old != record:
        diff = [k for k in record if old.get(k) != record[k]]
        raise ReapError(f"{job.out} holds an unfinished distributed run with different "
                        f"arguments ({', '.join(diff)}); rerun with the same arguments to "
                        f"resume, or delete {job.work}")
    if old is None:
        art.write_json(path, record)


def add_rows(a: list[ExpertSums] | None, b: list[ExpertSums]) -> list[ExpertSums]:
    """Rows of two disjoint sets of sequences combined (per corpus): sums add, maxima take the
    max; seq_count rows cover all sequences of the corpus, zero outside their own, so they add."""
    if a is None:
        return b
    out = []
    for x, y in zip(a, b):
        vals = {}
        for f in sum_fields():
            u, v = getattr(x, f.name), getattr(y, f.name)
            vals[f.name] = None if u is None else (torch.maximum(u, v)
                                                   if f.metadata["merge"] == "max" else u + v)
        out.append(ExpertSums(**vals))
    return out


def metas(job: Job, counters: dict) -> tuple[list[dict], dict]:
    """`art.stats_metas` of the whole job."""
    counts = [job.seq_corpus.count(i) for i in range(len(job.names))]
    return art.stats_metas(job.identity, job.kw["seq_len"], job.names, counts, counters)


def write_outputs(job: Job, rows: dict[int, list[ExpertSums]], counters: dict) -> dict:
    """The final per-corpus statistics and their merge from whole-run rows {layer: [corpus]}
    through the pipeline's own writer; returns {corpus: path, "all": path}."""
    for layer in job.moe_layers:
        art.save_rows(job.work, layer, rows[layer])
    per, run_meta = metas(job, counters)
    counts = [job.seq_corpus.count(i) for i in range(len(job.names))]
    return art.write_stats(job.out, job.work, names=job.names, layers=job.moe_layers,
                           n_experts=job.n_experts, top_k=job.top_k,
                           tokens=[k * job.kw["seq_len"] for k in counts], metas=per,
                           run_meta=run_meta)


def write_merged(job: Job, parts: list[dict], counters: dict) -> dict:
    """The final files from per-shard statistics ({corpus: ExpertStats} per shard, in sequence
    order): each corpus merged exactly (`reap.stats.merge`; seq_count rows concatenate in
    shard order, which is sequence order), then the merge of the corpora, as the pipeline does."""
    from reap.stats import merge

    per, run_meta = metas(job, counters)
    files, corpus_stats = {}, []
    for name, meta in zip(job.names, per):
        st = merge([p[name] for p in parts])
        st.meta = meta  # a whole-run record, not a merge of files (analysis skips merges)
        files[name] = st.save(os.path.join(job.out, f"{art.safe_name(name)}.safetensors"))
        corpus_stats.append(st)
    files["all"] = merge(corpus_stats, meta=run_meta).save(
        os.path.join(job.out, "all.safetensors"))
    return files
