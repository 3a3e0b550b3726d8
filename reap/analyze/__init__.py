"""Analysis stage: which experts do corpora share, measured against chance, with uncertainty.

`analyze(stats, ...)` (in `pipeline`) compares two or more corpora's expert statistics and
returns an `AnalysisResult`; `write_report(result, out_dir)` (in `report`) writes tables,
summary.json, figures and report.md. Modules: `chance` (exact null of set overlap), `overlap`
(sets and distributions per pair), `bootstrap` (intervals over sequences), `specialists`,
`cluster` (corpora, experts, co-activation communities), `plots`, `markdown`, `synthetic`
(statistics with planted structure), `cli` (`reap analyze`).
"""

from reap.analyze.pipeline import AnalysisResult, analyze

__all__ = ["AnalysisResult", "analyze"]
