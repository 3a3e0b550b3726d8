"""`evaluate`: the whole side-by-side evaluation of builds against a reference, cached per build.

    result = evaluate(builds=["runs/zh", "runs/en+code"], reference="runs/full",
                      corpora=["zh", "en", "code"], out="runs/eval", max_docs=20)

For every build not yet cached: the reference and the build are open together (the memory budget
split between them) and score every corpus's held-out documents in lockstep (`quality`), then the
build decodes the prompt set greedily (`generations`); the reference decodes it once. Results are
cached per build (`cache`), so adding a build to an evaluation only runs that build. Summaries
(bootstrap intervals), tables, plots and the HTML page are recomputed from the cached raw results
each time (`summary`, `report`). One progress bar counts every token to be read or generated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from reap.errors import ExpertLoadError, ReapError
from reap.eval import cache as C
from reap.eval.generations import generate_all, load_prompts, prompts_digest, with_metrics
from reap.eval.quality import score_documents, select_documents
from reap.eval.summary import reference_quality, summarize_generations, summarize_quality

FORMAT = "reap.eval/1"


@dataclass(eq=False)  # two columns may be the same checkpoint
class Build:
    """A column of the comparison: `label` (unique), checkpoint `path`, `identity` (cache)."""

    label: str
    path: str
    identity: dict

    @property
    def key(self) -> str:
        return C.key_of(self.identity)


def parse_build(arg: str) -> tuple[str | None, str]:
    """`LABEL=PATH` or `PATH` (a label holds no `/`, and PATH is then taken as given)."""
    label, sep, path = arg.partition("=")
    if sep and label and "/" not in label and not Path(arg).exists():
        return label, path
    return None, arg


def make_builds(args: list[str]) -> list[Build]:
    """Builds with unique labels (directory names, `#2` appended to a repeated one)."""
    out: list[Build] = []
    for arg in args:
        label, path = parse_build(arg)
        base = label or Path(path.rstrip("/")).name or path
        label, n = base, 1
        while any(b.label == label for b in out):
            n += 1
            label = f"{base}#{n}"
        out.append(Build(label, path, C.build_identity(path)))
    return out


class Engines:
    """Opens the reference once and each build in turn under one memory budget (`--budget`,
    else 80 % of the available memory; a `--preset` applies to each engine as is): the reference
    gets half of it above the process baseline, a build what the reference's plan leaves."""

    def __init__(self, reference: Build, opts: dict):
        self.reference, self.opts = reference, opts
        self.ref = None
        self.total: int | None = None
        self.failures: dict[str, list] = {}

    def _open(self, path: str, budget: int | None):
        from reap.engine import Engine

        o = self.opts
        return Engine.open(
            path,
            budget=budget,
            preset=o["preset"],
            context=o["context"],
            device=o["device"],
            dtype=o["dtype"],
            batch=o["plan_batch"],
            max_generation=max(1, o["gen_tokens"]),
        )

    def reference_engine(self):
        """The reference's engine, opened on first use."""
        from reap.engine import memory

        if self.ref is None:
            base = memory.rss_bytes()[0]
            if self.opts["preset"] is None:
                b = self.opts["budget"]
                self.total = (
                    (memory.parse_bytes(b) if isinstance(b, str) else int(b))
                    if b is not None
                    else base + int(0.8 * memory.available_memory()[0])
                )
            half = None if self.total is None else base + (self.total - base) // 2
            self.ref = self._open(self.reference.path, half)
        return self.ref

    def build_engine(self, build: Build):
        """A build's engine, opened next to the reference's (close it when done)."""
        ref = self.reference_engine()
        left = None if self.total is None else self.total - (ref.plan.total - ref.plan.baseline)
        return self._open(build.path, left)

    def check(self, engine, label: str) -> None:
        """Record routed experts that failed to load (the results are then untrustworthy)."""
        if engine.expert_failures:
            self.failures[label] = [list(f) for f in engine.expert_failures]

    def close(self) -> None:
        if self.ref is not None:
            self.ref.close()
            self.ref = None


@dataclass
class Task:
    """One result to compute or read from the cache."""

    kind: str  # "quality" or "generations"
    build: Build
    corpus: str | None  # quality only
    fields: dict
    key: str
    payload: list | None = None


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _tokenizer(path: str):
    from reap.tokenizer import load_tokenizer

    if str(path).lower().startswith(("http://", "https://")):
        raise ReapError(
            "the reference must be a local checkpoint directory (its tokenizer "
            "encodes the documents and prompts)"
        )
    return load_tokenizer(path)


def _tasks(w: Workload, args: dict) -> list[Task]:
    """Every result of the evaluation with its cache key (reference generations first)."""
    out = []
    common = {"format": FORMAT, "dtype": args["dtype"], "device": args["device"].split(":")[0]}
    qcode, gcode = C.code_digest("quality"), C.code_digest("generations")
    for b in w.others:
        for c in w.docs:
            f = {
                **common,
                "kind": "quality",
                "code": qcode,
                "build": b.identity,
                "reference": w.ref.identity,
                "corpus": c,
                "corpus_sha256": w.corpus_sha[c],
                "max_docs": args["max_docs"],
                "max_tokens_per_doc": args["max_tokens_per_doc"],
            }
            out.append(Task("quality", b, c, f, C.key_of(f)))
    if w.prompts:
        for b in [w.ref, *w.others]:
            f = {
                **common,
                "kind": "generations",
                "code": gcode,
                "build": b.identity,
                "tokenizer": w.ref.identity.get("tokenizer"),
                "prompts": prompts_digest(w.prompts),
                "gen_tokens": args["gen_tokens"],
            }
            out.append(Task("generations", b, None, f, C.key_of(f)))
    return out


def _work(t: Task, docs: dict, prompts) -> int:
    """Tokens a task reads or generates (for the progress bar)."""
    if t.kind == "quality":
        return sum(len(d.ids) - 1 for d in docs[t.corpus])
    return len(prompts) * t.fields["gen_tokens"]


def _run_tasks(
    todo: list[Task], w: Workload, engines: Engines, opts: dict, cache: C.Cache, bar
) -> None:
    """Compute the uncached tasks, one build engine open at a time, caching each result."""
    ref, upd = w.ref, bar.update

    def gens(eng) -> list[dict]:
        return generate_all(eng, w.tokenizer, w.prompts, opts["gen_tokens"], opts["gen_batch"], upd)

    for t in [t for t in todo if t.build is ref and t.kind == "generations"]:
        t.payload = gens(engines.reference_engine())
        engines.check(engines.reference_engine(), ref.label)
        _store(t, cache, engines, ref.label)
    for build in dict.fromkeys(t.build for t in todo if t.build is not ref):
        eng = engines.build_engine(build)
        try:
            for t in [t for t in todo if t.build is build]:
                if t.kind == "quality":
                    scores = score_documents(
                        engines.reference_engine(), eng, w.docs[t.corpus], opts["batch"], upd
                    )
                    t.payload = [s.as_dict() for s in scores]
                else:
                    t.payload = gens(eng)
                engines.check(eng, build.label)
                engines.check(engines.reference_engine(), ref.label)
                _store(t, cache, engines, build.label)
        finally:
            eng.close()


def _store(t: Task, cache: C.Cache, engines: Engines, label: str) -> None:
    """Cache a result unless an expert failed to load while computing it."""
    if label not in engines.failures and engines.reference.label not in engines.failures:
        cache.put(t.kind, t.key, t.fields, t.payload)


def evaluate(
    *,
    builds: list[str],
    reference: str,
    corpora: list[str],
    out: str,
    max_docs: int | None = None,
    max_tokens_per_doc: int = 512,
    prompts: str | None = None,
    gen_domains: list[str] | None = None,
    gen_tokens: int = 64,
    budget: str | int | None = None,
    preset: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    bootstrap: int = 1000,
    batch: int = 4,
    gen_batch: int = 16,
    progress: bool = True,
    plots: bool = True,
) -> dict:
    """Evaluate `builds` against `reference` (see the module docstring); writes results.json,
    report.md, report.html, generations.md and plots/ under `out`; returns the results dict.
    Raises ExpertLoadError (exit 4) after writing if a routed expert failed to load."""
    from reap.eval.report import write_report

    outdir = C.check_out_dir(out)
    w = _prepare(
        builds, reference, corpora, max_docs, max_tokens_per_doc, prompts, gen_domains, gen_tokens
    )
    args = {
        "corpora": list(corpora),
        "max_docs": max_docs,
        "max_tokens_per_doc": max_tokens_per_doc,
        "gen_domains": gen_domains,
        "gen_tokens": gen_tokens,
        "budget": budget,
        "preset": preset,
        "device": _device(device),
        "dtype": dtype,
        "bootstrap": bootstrap,
        "batch": batch,
        "gen_batch": gen_batch,
    }
    tasks = _tasks(w, args)
    cache = C.Cache(outdir)
    for t in tasks:
        t.payload = cache.get(t.kind, t.key)
    todo = [t for t in tasks if t.payload is None]
    plan_batch = max(batch, min(gen_batch, len(w.prompts)) if w.prompts else 1)
    engines = Engines(w.ref, {**args, "context": w.context(gen_tokens), "plan_batch": plan_batch})
    _run_with_progress(todo, w, engines, args, cache, progress)
    results = _results(w, tasks, prompts, args, cache, engines.failures)
    write_report(results, outdir, plots)
    if engines.failures:
        label, f = next(iter(engines.failures.items()))
        raise ExpertLoadError(
            f"{label}: {len(f)} routed expert load(s) failed (first: layer "
            f"{f[0][0]} expert {f[0][1]}); its results are not trustworthy "
            f"and were not cached"
        )
    return results


@dataclass
class Workload:
    """What an evaluation reads: the columns, the reference tokenizer, documents per corpus
    (with the corpus sha256) and the prompts."""

    ref: Build
    others: list[Build]
    tokenizer: object
    docs: dict[str, list]
    corpus_sha: dict[str, str]
    prompts: list

    def context(self, gen_tokens: int) -> int:
        """The longest sequence an engine must hold: a document, or a prompt + generation."""
        return max(
            [len(d.ids) for ds in self.docs.values() for d in ds]
            + [len(self.tokenizer.encode(p.prompt)) + gen_tokens for p in self.prompts]
        )


def _prepare(
    builds, reference, corpora, max_docs, max_tokens_per_doc, prompts, gen_domains, gen_tokens
) -> Workload:
    """Check the inputs and load everything the evaluation reads (one-line errors)."""
    from reap.corpora import corpus_fingerprint

    if not builds:
        raise ReapError("give at least one build to compare with the reference")
    cols = make_builds([reference, *builds])
    tokenizer = _tokenizer(cols[0].path)
    for b in cols[1:]:
        tok = b.identity.get("tokenizer")
        if tok is not None and tok != cols[0].identity.get("tokenizer"):
            raise ReapError(
                f"{b.path}: its tokenizer.json differs from the reference's; builds "
                f"are compared on the reference's token ids"
            )
    docs = {c: select_documents(c, tokenizer, max_docs, max_tokens_per_doc) for c in corpora}
    corpus_sha = {c: corpus_fingerprint(c, "eval") for c in corpora}
    plist = load_prompts(prompts, gen_domains) if gen_tokens > 0 else []
    if not docs and not plist:
        raise ReapError("nothing to evaluate: give --corpus, or prompts with --gen-tokens > 0")
    return Workload(cols[0], cols[1:], tokenizer, docs, corpus_sha, plist)


def _run_with_progress(
    todo: list[Task], w: Workload, engines: Engines, opts: dict, cache: C.Cache, progress: bool
) -> None:
    """Run the uncached tasks under one progress bar (tokens read or generated, with ETA)."""
    from tqdm import tqdm

    total = sum(_work(t, w.docs, w.prompts) for t in todo)
    with tqdm(
        total=total, unit="tok", desc="eval", disable=not progress or not todo, dynamic_ncols=True
    ) as bar:
        try:
            _run_tasks(todo, w, engines, opts, cache, bar)
        finally:
            engines.close()


def _results(
    w: Workload, tasks: list[Task], prompts_src, args: dict, cache: C.Cache, failures: dict
) -> dict:
    """The results document (results.json): provenance, summaries and generations."""
    from reap.eval.quality import DocScore

    labels = [w.ref.label] + [b.label for b in w.others]
    quality: dict = {}
    n = args["bootstrap"]
    for c in w.docs:
        pay = {
            t.build.label: [DocScore(**d) for d in t.payload]
            for t in tasks
            if t.kind == "quality" and t.corpus == c
        }
        quality[c] = {w.ref.label: asdict(reference_quality(pay[w.others[0].label], n))}
        quality[c].update({b.label: asdict(summarize_quality(pay[b.label], n)) for b in w.others})
    gens = {
        t.build.label: with_metrics(t.payload, w.prompts) for t in tasks if t.kind == "generations"
    }
    corpora = {
        c: {"sha256": w.corpus_sha[c], "docs": len(d), "tokens": sum(len(x.ids) - 1 for x in d)}
        for c, d in w.docs.items()
    }
    return {
        "format": FORMAT,
        "reference": _describe(w.ref),
        "builds": [_describe(b) for b in w.others],
        "columns": labels,
        "arguments": args,
        "corpora": corpora,
        "prompts": {
            "source": prompts_src or "shipped",
            "count": len(w.prompts),
            "sha256": prompts_digest(w.prompts) if w.prompts else None,
        },
        "quality": quality,
        **_generation_results(labels, gens, w.prompts),
        "cache": {"hits": cache.hits, "misses": cache.misses, "dir": str(cache.dir)},
        "expert_failures": failures,
    }


def _describe(b: Build) -> dict:
    return {
        "label": b.label,
        "path": b.path,
        "fingerprint": b.identity.get("fingerprint"),
        "identity_sha256": b.key,
    }


def _generation_results(labels: list[str], gens: dict, plist) -> dict:
    """Per-domain generation summaries and the side-by-side rows (prompt, output per build)."""
    if not gens:
        return {"generation_summary": {}, "generations": {}}
    summary: dict = {}
    rows: dict = {}
    for dom in dict.fromkeys(p.domain for p in plist):
        idx = [i for i, p in enumerate(plist) if p.domain == dom]
        ref_rows = [gens[labels[0]][i] for i in idx]
        summary[dom] = {
            lb: asdict(summarize_generations([gens[lb][i] for i in idx], ref_rows)) for lb in labels
        }
        rows[dom] = [
            {
                "id": plist[i].id,
                "prompt": plist[i].prompt,
                "outputs": {
                    lb: {k: gens[lb][i][k] for k in ("text", "finish_reason", "metrics")}
                    for lb in labels
                },
            }
            for i in idx
        ]
    return {"generation_summary": summary, "generations": rows}
