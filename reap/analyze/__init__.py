"""Analysis stage: which experts do corpora share, measured against chance, with uncertainty.

`analyze(stats, ...)` (in `pipeline`) compares two or more corpora's expert statistics and
returns an `AnalysisResult`; `write_report(result, out_dir)` (in `report`) writes tables,
summary.json, figures and report.md.
"""

from reap.analyze.pipeline import AnalysisResult, analyze

__all__ = ["AnalysisResult", "analyze"]
