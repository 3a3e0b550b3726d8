"""The report's "Pruning against merging" section, from reports/corpus-study/merging.json
(`experiments.corpus_study.merging`)."""

from __future__ import annotations


def merging_section(m: dict) -> list[str]:
    return ["## Pruning against merging", "", "(pending)", ""]
