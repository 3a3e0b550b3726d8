"""The k3-mini corpus study (issue #7): which experts each language and domain needs, and what a
build calibrated on some of them loses on the others.

    python -m experiments.corpus_study                  # run the study (from the repository root)
    python -m experiments.corpus_study.report           # rewrite the report from results.json
    python -m experiments.corpus_study --merging        # pruning against expert merging (#31)

Modules: `study` (settings, calibration, plans, builds, evaluations, results.json), `stats`
(intervals, chance levels, tables and answers), `report` (the markdown report), `prose` (its
hand-written text), `plots`; `merging` (REAP against HC-SMoE and M-SMoE builds, merging.json)
and `report_merging` (its report section).
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: reports/ and the bundled model
