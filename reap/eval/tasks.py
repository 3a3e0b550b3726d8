"""The results of an evaluation as tasks (`Task`: a kind, a build, a cache key), and running
the ones not cached: one build engine open at a time next to the reference, every result cached
as it is computed (unless a routed expert failed to load), one progress bar over all tokens
(lm-eval's benchmarks, `reap.eval.harness`, show their own).
"""

from __future__ import annotations

from dataclasses import dataclass

from reap.eval.builds import Build, Engines
from reap.eval.cache import Cache, key_of
from reap.eval.generations import generate_all, prompts_digest
from reap.eval.quality import score_documents
from reap.eval.workload import Workload
from reap.provenance import code_version

FORMAT = "reap.eval/1"  # of results.json, and part of every cache key
# the sources whose change changes the numbers of each kind of result (`code_version` parts)
_FORWARD_CODE = ("engine", "models", "checkpoint", "quant", "quant/mxfp4_kernels.c")
EVAL_CODE = {
    "quality": (*_FORWARD_CODE, "eval/quality.py"),
    "generations": (*_FORWARD_CODE, "tokenizer.py", "eval/generations.py"),
    "benchmarks": (*_FORWARD_CODE, "tokenizer.py", "eval/quality.py", "eval/harness.py"),
}


@dataclass
class Task:
    """One result to compute or read from the cache."""

    kind: str  # "quality", "generations" or "benchmarks"
    build: Build
    corpus: str | None  # quality only
    fields: dict
    key: str
    payload: list | None = None


def make_tasks(w: Workload, args: dict) -> list[Task]:
    """Every result of the evaluation with its cache key (reference generations first)."""
    out, qcode = [], code_version(EVAL_CODE["quality"])
    common = {"format": FORMAT, "dtype": args["dtype"], "device": args["device"].split(":")[0]}
    for b in w.others:
        for c in w.docs:
            f = {**common, "kind": "quality", "code": qcode, "build": b.identity,
                 "reference": w.ref.identity, "corpus": c, "corpus_sha256": w.corpus_sha[c],
                 "max_docs": args["max_docs"], "max_tokens_per_doc": args["max_tokens_per_doc"]}
            out.append(Task("quality", b, c, f, key_of(f)))
    kinds = [("generations", {"tokenizer": w.ref.identity.get("tokenizer"), "prompts":
               prompts_digest(w.prompts), "gen_tokens": args["gen_tokens"]})] if w.prompts else []
    if w.benchmarks:
        kinds.append(("benchmarks", {**w.benchmarks, "limit": args["task_limit"],
                                     "bootstrap": args["bootstrap"]}))
    for kind, fields in kinds:
        for b in [w.ref, *w.others]:
            f = {**common, "kind": kind, "code": code_version(EVAL_CODE[kind]),
                 "build": b.identity, **fields}
            out.append(Task(kind, b, None, f, key_of(f)))
    return out


def total_tokens(todo: list[Task], w: Workload) -> int:
    """Tokens the tasks read or generate (for the progress bar)."""
    return sum(sum(len(d.ids) - 1 for d in w.docs[t.corpus]) if t.kind == "quality"
               else len(w.prompts) * t.fields.get("gen_tokens", 0) for t in todo)


def run_with_progress(todo: list[Task], w: Workload, engines: Engines, opts: dict, cache: Cache,
                      progress: bool) -> None:
    """Run the uncached tasks under one progress bar (tokens read or generated, with ETA)."""
    from tqdm import tqdm

    with tqdm(total=total_tokens(todo, w), unit="tok", desc="eval",
              disable=not progress or not todo, dynamic_ncols=True) as bar:
        try:
            compute_tasks(todo, w, engines, opts, cache, bar)
        finally:
            engines.close()


def compute_tasks(todo: list[Task], w: Workload, engines: Engines, opts: dict, cache: Cache,
                  bar) -> None:
    """Compute the uncached tasks, one build engine open at a time, caching each result."""
    ref = w.ref
    for t in [t for t in todo if t.build is ref]:
        t.payload = _compute(t, engines.reference_engine(), w, engines, opts, bar.update)
        engines.check(engines.reference_engine(), ref.label)
        _store(t, cache, engines, ref.label)
    for build in dict.fromkeys(t.build for t in todo if t.build is not ref):
        eng = engines.build_engine(build)
        try:
            for t in [t for t in todo if t.build is build]:
                t.payload = _compute(t, eng, w, engines, opts, bar.update)
                engines.check(eng, build.label)
                engines.check(engines.reference_engine(), ref.label)
                _store(t, cache, engines, build.label)
        finally:
            eng.close()


def _compute(t: Task, eng, w: Workload, engines: Engines, opts: dict, upd):
    if t.kind == "quality":
        docs = w.docs[t.corpus]
        return [s.as_dict() for s in
                score_documents(engines.reference_engine(), eng, docs, opts["batch"], upd)]
    if t.kind == "generations":
        return generate_all(eng, w.tokenizer, w.prompts, opts["gen_tokens"], opts["gen_batch"], upd)
    from reap.eval.harness import run_benchmarks

    return run_benchmarks(eng, w.benchmarks["tasks"], opts["task_path"], opts["task_limit"],
                          opts["batch"], opts["bootstrap"])


def _store(t: Task, cache: Cache, engines: Engines, label: str) -> None:
    """Cache a result unless an expert failed to load while computing it."""
    if label not in engines.failures and engines.reference.label not in engines.failures:
        cache.put(t.kind, t.key, t.fields, t.payload)
