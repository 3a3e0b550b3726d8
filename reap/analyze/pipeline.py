"""The analysis stage as one keyword-argument function: statistics in, typed results out.

`analyze(stats, top_m=..., bootstrap=..., seed=...)` runs every part of the overlap analysis on
two or more corpora's statistics and returns an `AnalysisResult`; `reap.analyze.report`
writes it (tables, JSON, plots, report.md). Deterministic for a given seed.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from reap.analyze import bootstrap as boot
from reap.analyze import cluster, overlap, specialists
from reap.analyze.overlap import CRITERIA, CorpusUsage
from reap.errors import ReapError
from reap.stats import ExpertStats, expand_paths


@dataclass
class InputCorpus:
    """Provenance of one input corpus."""

    name: str
    path: str
    tokens: int
    sequences: int | None  # None: the file has no seq_count (no bootstrap, no permutation)
    meta: dict


@dataclass
class Settings:
    """Arguments of the run, as resolved."""

    criteria: list[str]
    top_m: list[float]  # as requested
    m: list[int]  # resolved set sizes
    bootstrap: int
    ci_method: str
    seed: int
    alpha: float
    specialist_ratio: float
    min_load: float
    permutations: int
    community_nulls: int


@dataclass
class AnalysisResult:
    """Everything the analysis found; see each record's docstring for fields and shapes."""

    corpora: list[InputCorpus]
    layers: list[int]
    n_experts: int
    top_k: int
    settings: Settings
    set_overlap: list[overlap.SetOverlap]
    set_overall: list[overlap.SetOverlapOverall]
    usage: list[overlap.UsageSimilarity]
    profiles: specialists.ExpertProfiles
    specialist_null: specialists.SpecialistNull | None
    corpus_clusters: cluster.CorpusClustering
    expert_clusters: cluster.ExpertClustering | None
    communities: list[cluster.Communities]
    notes: list[str] = field(default_factory=list)


def _as_corpora(stats: list) -> tuple[list[CorpusUsage], list[str]]:
    """The corpora, and the files a directory held that are not per-corpus statistics."""
    if all(isinstance(s, (str, os.PathLike)) for s in stats):
        files, skipped = expand_paths([os.fspath(s) for s in stats])
        return overlap.load_corpora(files), skipped
    out = []
    for s in stats:
        if isinstance(s, ExpertStats):
            s = overlap.from_stats(s)
        if not isinstance(s, CorpusUsage):
            raise ReapError(f"cannot analyze a {type(s).__name__}: give statistics files")
        out.append(s)
    overlap.check_compatible(out)
    return out, []


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def analyze(stats: list, *, top_m: list[float] = (0.25,), criteria: list[str] = CRITERIA,
            bootstrap: int = 200, ci_method: str = "basic", seed: int = 0, alpha: float = 0.05,
            specialist_ratio: float = 3.0, min_load: float = 0.5, permutations: int = 100,
            communities: bool = True, community_nulls: int = 3,
            progress: bool = False) -> AnalysisResult:
    """Overlap of expert usage between corpora against chance, with uncertainty and clusters.

    stats: statistics file paths (a directory stands for its per-corpus files, see
    `reap.stats.expand_paths`), `ExpertStats` or `CorpusUsage`, one per corpus (>= 2).
    top_m: important-set sizes, integers or fractions of n_experts. bootstrap: replicates over
    calibration sequences (0 = none). permutations: sequence shuffles for the specialist and
    expert-cluster chance levels. community_nulls: random graphs per layer for modularity.
    """
    corpora, skipped = _as_corpora(list(stats))
    first = corpora[0].stats
    for c in criteria:
        corpora[0].score(c)  # validates the name
    ms = sorted({overlap.resolve_m(m, first.n_experts) for m in top_m})
    settings = Settings(list(criteria), list(top_m), ms, bootstrap, ci_method, seed, alpha,
                        specialist_ratio, min_load, permutations, community_nulls)  # fmt: skip
    notes = [f"skipped {', '.join(skipped)}: not per-corpus statistics"] if skipped else []
    sets, overall, usage = _pairwise(corpora, criteria, ms, alpha, progress)
    _bootstrap(corpora, ms, settings, sets, overall, usage, notes, progress)
    _log(progress, "specialists and clusters")
    prof = specialists.expert_profiles(corpora, specialist_ratio, min_load)
    shuffled = specialists.shuffle_sequences(corpora, permutations, seed, progress)
    null = specialists.specialist_null(prof, shuffled)
    if null is None and permutations > 0:
        notes.append("no chance baseline for specialists and expert clusters: it needs "
                     "seq_count in every file")
    return AnalysisResult(
        corpora=[InputCorpus(c.name, c.path, c.tokens, c.n_sequences, c.stats.meta)
                 for c in corpora],
        layers=list(first.layers), n_experts=first.n_experts, top_k=first.top_k,
        settings=settings, set_overlap=sets, set_overall=overall, usage=usage, profiles=prof,
        specialist_null=null, corpus_clusters=cluster.cluster_corpora(corpora),
        expert_clusters=cluster.cluster_experts(prof, seed=seed, null=shuffled),
        communities=(cluster.communities(corpora, seed, community_nulls, progress)
                     if communities else []),
        notes=notes)


def _pairwise(corpora, criteria, ms, alpha, progress):
    from tqdm.auto import tqdm

    pairs = [(a, b) for i, a in enumerate(corpora) for b in corpora[i + 1 :]]
    sets, overall, usage = [], [], []
    for a, b in tqdm(pairs, desc="corpus pairs", disable=not progress):
        for crit in criteria:
            for m in ms:
                rows, ov = overlap.compare_sets(a, b, crit, m, alpha)
                sets += rows
                overall.append(ov)
        usage += overlap.compare_usage(a, b)
    return sets, overall, usage


def _bootstrap(corpora, ms, settings, sets, overall, usage, notes, progress) -> None:
    if settings.bootstrap <= 0:
        notes.append("bootstrap disabled (--bootstrap 0): no confidence intervals")
        return
    missing = [c.name for c in corpora if c.stats.seq_count is None]
    if missing:
        notes.append(
            "no seq_count (per-sequence counts) in "
            + ", ".join(missing)
            + ": confidence intervals skipped for every pair involving them"
        )
    if "reap_mass" in settings.criteria:
        notes.append(
            "REAP-mass sets have no confidence intervals: the statistics keep "
            "per-sequence routed counts only"
        )
    if len(missing) >= len(corpora) - 1:
        return
    boots = boot.bootstrap_pairs(corpora, ms, settings.bootstrap, settings.seed, progress)
    boot.attach_cis(
        sets, overall, usage, boots, list(corpora[0].stats.layers), method=settings.ci_method
    )
