"""Side-by-side evaluation of builds (`reap eval`): LM quality on held-out corpora, agreement
with a reference, and greedy generations with text metrics.

    from reap.eval import evaluate
    results = evaluate(builds=["runs/pruned"], reference="runs/full", corpora=["zh", "code"],
                       out="runs/eval", max_docs=20)

Modules: `quality` (documents streamed through the reference and a build in lockstep, per-document
sums), `summary` (bootstrap intervals, per-domain means), `text_metrics` (repetition, script, Python
validity), `generations` (prompt sets, batched greedy decoding), `cache` (build identities,
per-build cached results), `builds` (columns and their engines), `workload` (inputs), `tasks`
(results to compute, run uncached), `results` (results.json), `pipeline` (`evaluate`), `report` and
`page` (tables, plots, the HTML page), `cli` (`reap eval`). Importing this package loads nothing
heavy.
"""

from __future__ import annotations

__all__ = ["evaluate"]


def __getattr__(name: str):
    if name == "evaluate":
        from reap.eval.pipeline import evaluate

        return evaluate
    raise AttributeError(f"module 'reap.eval' has no attribute {name!r}")
