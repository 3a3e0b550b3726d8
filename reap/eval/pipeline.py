"""`evaluate`: the whole side-by-side evaluation of builds against a reference, cached per build.

    result = evaluate(builds=["runs/zh", "runs/en+code"], reference="runs/full",
                      corpora=["zh", "en", "code"], out="runs/eval", max_docs=20)

The inputs are checked and loaded first (`workload`), every result becomes a task with a cache key
(`tasks`). For every build not yet cached: the reference and the build are open together (the memory
budget split between them) and score every corpus's held-out documents in lockstep (`quality`), then
the build decodes the prompt set greedily (`generations`); the reference decodes it once (engines:
`builds`); every column runs the lm-eval tasks (`harness`). Results are cached per build
(`cache`), so adding a build to an evaluation only runs that build. The results document with its
summaries (bootstrap intervals), tables, plots and the HTML page are recomputed from the cached raw
results each time (`results`, `summary`, `report`). One progress bar counts every token to be read
or generated.
"""

from __future__ import annotations

import json
from pathlib import Path

from reap.errors import ExpertLoadError
from reap.eval.builds import Engines
from reap.eval.cache import Cache
from reap.eval.page import html_report
from reap.eval.report import markdown_generations, markdown_report, write_plots
from reap.eval.results import results_document
from reap.eval.tasks import make_tasks, run_with_progress
from reap.eval.workload import prepare_workload
from reap.fileio import check_out_dir, write_atomic


def evaluate(*, builds: list[str], reference: str, corpora: list[str], out: str,
             max_docs: int | None = None, max_tokens_per_doc: int = 512,
             prompts: str | None = None, gen_domains: list[str] | None = None,
             gen_tokens: int = 64, budget: str | int | None = None, preset: str | None = None,
             device: str = "auto", dtype: str = "auto", bootstrap: int = 1000, batch: int = 4,
             gen_batch: int = 16, tasks: list[str] = (), task_path: str | None = None,
             task_limit: int | None = None, progress: bool = True, plots: bool = True,
             run_tasks=None) -> dict:
    """Evaluate `builds` against `reference` (see the module docstring); writes results.json,
    report.md, report.html, generations.md and plots/ under `out`; returns the results dict.
    Raises ExpertLoadError (exit 4) after writing if a routed expert failed to load.
    run_tasks: what computes the uncached tasks (default `tasks.run_with_progress`; `reap eval
    --ray` passes `reap.distributed.eval.ray_runner`), same arguments."""
    outdir = Path(check_out_dir(out))
    w = prepare_workload(builds, reference, corpora, max_docs, max_tokens_per_doc, prompts,
                         gen_domains, gen_tokens, tasks, task_path)
    args = dict(corpora=list(corpora), max_docs=max_docs, max_tokens_per_doc=max_tokens_per_doc,
                gen_domains=gen_domains, gen_tokens=gen_tokens, budget=budget, preset=preset,
                device=_device(device), dtype=dtype, bootstrap=bootstrap, batch=batch,
                gen_batch=gen_batch, tasks=list(tasks), task_path=task_path, task_limit=task_limit)
    tasks = make_tasks(w, args)
    cache = Cache(outdir)
    for t in tasks:
        t.payload = cache.get(t.kind, t.key)
    todo = [t for t in tasks if t.payload is None]
    plan_batch = max(batch, min(gen_batch, len(w.prompts)) if w.prompts else 1)
    engines = Engines(w.ref, {**args, "context": w.context(gen_tokens), "plan_batch": plan_batch})
    (run_tasks or run_with_progress)(todo, w, engines, args, cache, progress)
    results = results_document(w, tasks, prompts, args, cache, engines.failures)
    write_report(results, outdir, plots)
    if engines.failures:
        label, f = next(iter(engines.failures.items()))
        raise ExpertLoadError(f"{label}: {len(f)} routed expert load(s) failed (first: layer "
                              f"{f[0][0]} expert {f[0][1]}); its results are not trustworthy "
                              f"and were not cached")
    return results


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def write_report(results: dict, out: str | Path, plots: bool = True) -> dict[str, str]:
    """Write every output file (listed in `reap.eval.report`; no plots with `plots=False`);
    returns name -> path."""
    out = Path(out)
    pngs = write_plots(results, out) if plots else {}
    files = {
        "results.json": json.dumps(results, indent=1, ensure_ascii=False) + "\n",
        "report.md": markdown_report(results, list(pngs)),
        "generations.md": markdown_generations(results),
        "report.html": html_report(results, pngs),
    }
    for name, text in files.items():
        write_atomic(out / name, text)
    return {name: str(out / name) for name in [*files, *(f"plots/{p}.png" for p in pngs)]}
