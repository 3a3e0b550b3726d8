"""The results document of an evaluation (results.json): provenance, quality summaries with
bootstrap intervals per corpus, generation summaries per domain, the side-by-side rows and the
lm-eval scores per task with their intervals.
"""

from __future__ import annotations

from dataclasses import asdict

from reap.eval.builds import Build
from reap.eval.cache import Cache
from reap.eval.generations import prompts_digest, with_metrics
from reap.eval.summary import (benchmark_estimate, reference_quality, summarize_generations,
                               summarize_quality)
from reap.eval.tasks import FORMAT, Task
from reap.eval.workload import Workload


def results_document(w: Workload, tasks: list[Task], prompts_src, args: dict, cache: Cache,
                     failures: dict) -> dict:
    """The results document (results.json): provenance, summaries and generations."""
    from reap.eval.quality import DocScore

    labels = [w.ref.label] + [b.label for b in w.others]
    quality: dict = {}
    n = args["bootstrap"]
    for c in w.docs:
        pay = {t.build.label: [DocScore(**d) for d in t.payload]
               for t in tasks if t.kind == "quality" and t.corpus == c}
        quality[c] = {w.ref.label: asdict(reference_quality(pay[w.others[0].label], n))}
        quality[c].update({b.label: asdict(summarize_quality(pay[b.label], n)) for b in w.others})
    gens = {t.build.label: with_metrics(t.payload, w.prompts)
            for t in tasks if t.kind == "generations"}
    corpora = {c: {"sha256": w.corpus_sha[c], "docs": len(d),
                   "tokens": sum(len(x.ids) - 1 for x in d)} for c, d in w.docs.items()}
    digest = prompts_digest(w.prompts) if w.prompts else None
    return {
        "format": FORMAT,
        "reference": _describe(w.ref),
        "builds": [_describe(b) for b in w.others],
        "columns": labels,
        "arguments": args,
        "corpora": corpora,
        "prompts": {"source": prompts_src or "shipped", "count": len(w.prompts), "sha256": digest},
        "quality": quality,
        **_generation_results(labels, gens, w.prompts),
        "benchmarks": _benchmarks([t for t in tasks if t.kind == "benchmarks"]),
        "cache": {"hits": cache.hits, "misses": cache.misses, "dir": str(cache.dir)},
        "expert_failures": failures,
    }


def _describe(b: Build) -> dict:
    return {"label": b.label, "path": b.path, "fingerprint": b.identity.get("fingerprint"),
            "identity_sha256": b.key}


def _benchmarks(tasks: list[Task]) -> dict:
    """task -> column -> {"samples": n, metric: Estimate as a dict} (lm-eval's scores)."""
    out: dict = {}
    for t in tasks:
        for name, r in t.payload.items():
            col = out.setdefault(name, {})[t.build.label] = {"samples": r["samples"]}
            col.update({m: asdict(benchmark_estimate(*v)) for m, v in r["metrics"].items()})
    return out


def _generation_results(labels: list[str], gens: dict, plist) -> dict:
    """Per-domain generation summaries and the side-by-side rows (prompt, output per build)."""
    if not gens:
        return {"generation_summary": {}, "generations": {}}
    summary: dict = {}
    rows: dict = {}  # the outputs of each prompt, a column per build
    for dom in dict.fromkeys(p.domain for p in plist):
        idx = [i for i, p in enumerate(plist) if p.domain == dom]
        ref_rows = [gens[labels[0]][i] for i in idx]
        summary[dom] = {lb: asdict(summarize_generations([gens[lb][i] for i in idx], ref_rows))
                        for lb in labels}
        rows[dom] = [{"id": plist[i].id, "prompt": plist[i].prompt, "outputs": {
            lb: {k: gens[lb][i][k] for k in ("text", "finish_reason", "metrics")} for lb in labels}}
            for i in idx]
    return {"generation_summary": summary, "generations": rows}
