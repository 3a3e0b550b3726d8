"""Confidence intervals by resampling calibration sequences (the unit that is independent).

Tokens of one sequence share a topic and route alike, so resampling tokens would understate
the uncertainty; a replicate draws S sequences with replacement per corpus from the per-sequence
counts (`seq_count`, [S, L, E]) and recomputes every count-based quantity. REAP mass has no
per-sequence record, so sets chosen by it get no interval; corpora without `seq_count` get none
at all (reported, not invented). Dimension letters: N replicates, S sequences, L layers, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from reap.analyze.chance import jaccard_of
from reap.analyze.overlap import (
    CorpusUsage,
    SetOverlap,
    SetOverlapOverall,
    UsageSimilarity,
    cosine,
    important_set,
    jsd,
    sum_min,
)


@dataclass
class PairBootstrap:
    """Replicates of the count-based metrics of one pair of corpora."""

    corpus_a: str
    corpus_b: str
    jaccard: dict[int, np.ndarray] = field(default_factory=dict)  # m -> [N, L]
    jsd: np.ndarray | None = None  # [N, L]
    cosine: np.ndarray | None = None  # [N, L]
    sum_min: np.ndarray | None = None  # [N, L]


def resample_weights(n_seqs: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each sequence is drawn in each replicate: [N, S], rows summing to S."""
    return rng.multinomial(n_seqs, np.full(n_seqs, 1.0 / n_seqs), size=n_boot).astype(np.float64)


def bootstrap_pairs(
    corpora: list[CorpusUsage], ms: list[int], n_boot: int, seed: int = 0, progress: bool = False
) -> dict[tuple[str, str], PairBootstrap]:
    """Replicates for every pair of corpora that both carry `seq_count` (others are skipped).

    Each corpus is resampled independently (its own sequences); the same replicate weights
    serve every layer, so layer means keep their cross-layer correlation.
    """
    from tqdm.auto import tqdm

    have = [c for c in corpora if c.stats.seq_count is not None]
    seeds = np.random.SeedSequence(seed).spawn(len(corpora))
    weights = {
        c.name: resample_weights(c.n_sequences, n_boot, np.random.default_rng(s))
        for c, s in zip(corpora, seeds)
        if c.stats.seq_count is not None
    }
    pairs = [(a, b) for i, a in enumerate(have) for b in have[i + 1 :]]
    L = len(corpora[0].stats.layers)
    out = {}
    for a, b in pairs:
        jaccard = {m: np.empty((n_boot, L)) for m in ms}  # m -> [N, L]
        out[a.name, b.name] = PairBootstrap(a.name, b.name, jaccard, *np.empty((3, n_boot, L)))
    for li in tqdm(range(L), desc="bootstrap layers", disable=not progress or not pairs):
        counts = {
            c.name: weights[c.name] @ c.stats.seq_count[:, li, :].double().numpy() for c in have
        }  # name -> [N, E]
        sets = {(name, m): important_set(x, m) for name, x in counts.items() for m in ms}
        for a, b in pairs:
            pb, ca, cb = out[(a.name, b.name)], counts[a.name], counts[b.name]
            metrics = (jsd(ca, cb), cosine(ca, cb), sum_min(ca, cb))  # [N] each
            pb.jsd[:, li], pb.cosine[:, li], pb.sum_min[:, li] = metrics
            for m in ms:
                sa, sb = sets[(a.name, m)], sets[(b.name, m)]  # [N, E]
                pb.jaccard[m][:, li] = jaccard_of((sa & sb).sum(-1), sa.sum(-1), sb.sum(-1))
    return out


def bootstrap_ci(
    reps: np.ndarray,
    estimate,
    level: float = 0.95,
    method: str = "basic",
    bounds: tuple[float, float] = (0.0, 1.0),
) -> tuple[np.ndarray, np.ndarray]:
    """Interval from replicates (axis 0) around an estimate, clipped to the metric's bounds.

    "basic" (default) reflects the replicate quantiles around the estimate,
    [2 x est - q_hi, 2 x est - q_lo], which removes the first-order bias sampling noise adds to
    divergences and top-m overlaps (noise always makes JSD larger and sum(min) smaller, and a
    replicate is noisier than the sample). "percentile" is [q_lo, q_hi]: it inherits that bias
    twice and under-covers badly for similar corpora.
    """
    q_lo, q_hi = np.nanpercentile(reps, [50 * (1 - level), 50 * (1 + level)], axis=0)
    if method == "percentile":
        lo, hi = q_lo, q_hi
    elif method == "basic":
        est = np.asarray(estimate, dtype=np.float64)
        lo, hi = 2 * est - q_hi, 2 * est - q_lo
    else:
        raise ValueError(f"unknown interval method {method!r}")
    return np.clip(lo, *bounds), np.clip(hi, *bounds)


def attach_cis(
    sets: list[SetOverlap],
    overall: list[SetOverlapOverall],
    usage: list[UsageSimilarity],
    boots: dict[tuple[str, str], PairBootstrap],
    layers: list[int],
    level: float = 0.95,
    method: str = "basic",
) -> None:
    """Fill the ci_* fields of count-criterion records whose pair has replicates.

    layers: the model layer index of each replicate column. Overall records get the interval
    of the layer mean (each replicate averaged over layers first). See `bootstrap_ci`.
    """

    def ci(reps, est):
        return tuple(map(float, bootstrap_ci(reps, est, level, method)))

    pos = {layer: i for i, layer in enumerate(layers)}
    for r in sets:
        pb = boots.get((r.corpus_a, r.corpus_b))
        if pb is not None and r.criterion == "count" and r.m in pb.jaccard:
            r.ci_lo, r.ci_hi = ci(pb.jaccard[r.m][:, pos[r.layer]], r.jaccard)
    for r in overall:
        pb = boots.get((r.corpus_a, r.corpus_b))
        if pb is not None and r.criterion == "count" and r.m in pb.jaccard:
            r.ci_lo, r.ci_hi = ci(np.nanmean(pb.jaccard[r.m], 1), r.mean_jaccard)
    for r in usage:
        pb = boots.get((r.corpus_a, r.corpus_b))
        if pb is None:
            continue
        for name in ("jsd", "cosine", "sum_min"):
            x = getattr(pb, name)  # [N, L]
            v = x.mean(1) if r.layer == -1 else x[:, pos[r.layer]]  # [N]
            lo, hi = ci(v, getattr(r, name))
            setattr(r, f"{name}_lo", lo)
            setattr(r, f"{name}_hi", hi)
