"""Overlap of expert usage between corpora, per layer and over all layers, against chance.

Two views of "do corpus A and corpus B use the same experts":
- Sets: each corpus's top-m experts in a layer by a criterion (routed count, or REAP mass) and
  their Jaccard index, next to the exact Jaccard chance gives sets of the same sizes
  (`reap.analyze.chance`), with exact p-values per layer and over all layers together.
- Distributions: the per-layer routing distributions compared by Jensen-Shannon divergence
  (base 2), cosine similarity and sum(min(p, q)) = 1 - total variation distance.

Ties at the set boundary are kept together and never-used experts are never important, so sets
are a deterministic function of the scores and the hypergeometric null is exact whenever the
experts are exchangeable. Dimension letters: C corpora, L layers, E experts, S sequences,
N bootstrap replicates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from reap.analyze import chance
from reap.errors import ReapError, first_difference
from reap.stats import ExpertStats

CRITERIA = ("count", "reap_mass")


@dataclass
class CorpusUsage:
    """One corpus's routing statistics as the analysis needs them (float64 numpy)."""

    name: str
    path: str
    stats: ExpertStats  # the full record (coact [L, E, E] is read layer by layer from here)
    count: np.ndarray  # [L, E] tokens routed to each expert
    reap_mass: np.ndarray  # [L, E] sum over routed tokens of gate weight x output norm

    @property
    def tokens(self) -> int:
        return self.stats.tokens

    @property
    def n_sequences(self) -> int | None:
        sc = self.stats.seq_count
        return None if sc is None else int(sc.shape[0])

    def score(self, criterion: str) -> np.ndarray:
        """Importance scores [L, E] under a criterion of `CRITERIA`."""
        if criterion == "count":
            return self.count
        if criterion == "reap_mass":
            return self.reap_mass
        raise ReapError(f"unknown criterion {criterion!r} (choose from {', '.join(CRITERIA)})")

    def usage(self) -> np.ndarray:
        """Routing distribution per layer, [L, E], rows summing to 1."""
        return self.count / self.count.sum(-1, keepdims=True)


def from_stats(stats: ExpertStats, path: str = "", name: str | None = None) -> CorpusUsage:
    """Wrap loaded statistics; the name is `meta['corpus']`, else the file stem."""
    name = name or stats.meta.get("corpus") or os.path.splitext(os.path.basename(path))[0]
    where = path or name
    if stats.tokens <= 0 or int(stats.count.sum()) <= 0:
        raise ReapError(f"{where}: statistics hold no routed tokens")
    count = stats.count.double().numpy()
    if (count.sum(-1) <= 0).any():
        raise ReapError(f"{where}: some layer has no routed tokens")
    sc = stats.seq_count
    if sc is not None:
        if tuple(sc.shape[1:]) != tuple(stats.count.shape):
            raise ReapError(f"{where}: seq_count shape {tuple(sc.shape)} does not match count")
        if not np.array_equal(sc.long().sum(0).numpy(), stats.count.numpy()):
            raise ReapError(f"{where}: seq_count does not sum to count (inconsistent statistics)")
    return CorpusUsage(name, path, stats, count, stats.reap_sum.double().numpy())


def load_corpora(paths: list[str]) -> list[CorpusUsage]:
    """Load statistics files, one per corpus, and check that they describe the same model.

    Corpora are named by `meta["corpus"]`; when two files name the same corpus (e.g. runs with
    different seeds), each is suffixed with its directory name: `zh@run1`.
    """
    from safetensors import SafetensorError

    corpora = []
    for p in paths:
        if not os.path.isfile(p):
            raise ReapError(f"{p}: no such statistics file")
        try:
            stats = ExpertStats.load(p)
        except SafetensorError as e:  # ExpertStats.load lets this one through
            raise ReapError(f"{p}: not a reap statistics file ({e})") from e
        corpora.append(from_stats(stats, p))
    names = [c.name for c in corpora]
    for c in corpora:
        if names.count(c.name) > 1:
            c.name = f"{c.name}@{os.path.basename(os.path.dirname(os.path.abspath(c.path)))}"
    check_compatible(corpora)
    return corpora


def check_compatible(corpora: list[CorpusUsage]) -> None:
    """At least two corpora, distinct names, same layers/experts/top_k/model fingerprint."""
    if len(corpora) < 2:
        raise ReapError("analysis compares corpora: give at least two statistics files")
    first = corpora[0]
    seen = set()
    for c in corpora:
        s, f = c.stats, first.stats
        here, there = c.path or c.name, first.path or first.name
        if s.meta.get("model") != f.meta.get("model"):  # before names: a clash would hide it
            raise ReapError(
                f"{here} and {there} are statistics of different models (fingerprints "
                f"{s.meta.get('model')} and {f.meta.get('model')})"
            )
        if s.layers != f.layers:
            raise ReapError(f"{here}: layers differ from {there}: "
                            f"{first_difference(f.layers, s.layers)}")
        if (s.n_experts, s.top_k) != (f.n_experts, f.top_k):
            raise ReapError(
                f"{here}: n_experts/top_k {s.n_experts}/{s.top_k} differ from {there} "
                f"({f.n_experts}/{f.top_k})"
            )
        if c.name in seen:
            other = next(o for o in corpora if o.name == c.name)
            _check_same_checkpoint(other, c)
            raise ReapError(
                f"corpus {c.name!r} given twice (shards of one run: `reap stats merge`)"
            )
        seen.add(c.name)


def _check_same_checkpoint(a: CorpusUsage, b: CorpusUsage) -> None:
    """Two statistics of one corpus from different checkpoints are a model mismatch, not a
    repeated corpus: the fingerprint hashes names, shapes and config, not weights, so two
    checkpoints of one architecture share it and only the recorded model path tells them apart."""
    args = [c.stats.meta.get("arguments") for c in (a, b)]
    paths = [x.get("model") if isinstance(x, dict) else None for x in args]
    if paths[0] != paths[1]:
        raise ReapError(
            f"{a.path or a.name} and {b.path or b.name} are statistics of different models: "
            f"{paths[0]} and {paths[1]} (fingerprint {a.stats.meta.get('model')} for both: "
            "same architecture and config, weights not compared)"
        )


def resolve_m(m: float, n_experts: int) -> int:
    """Set size from --top-m: an integer count, or a fraction of n_experts when 0 < m < 1."""
    size = round(m * n_experts) if 0 < m < 1 else int(m)
    if not 1 <= size <= n_experts or (m >= 1 and m != int(m)):
        raise ReapError(f"--top-m {m}: need an integer in 1..{n_experts} or a fraction in (0, 1)")
    return size


def important_set(score: np.ndarray, m: int) -> np.ndarray:
    """Top-m experts along the last axis, ties at the boundary included, zeros excluded.

    score: [..., E] -> bool mask [..., E].
    """
    kth = -np.partition(-score, m - 1, axis=-1)[..., m - 1 : m]  # [..., 1] the m-th largest
    return (score >= kth) & (score > 0)


def _normalize(x: np.ndarray) -> np.ndarray:
    s = x.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(s > 0, x / np.where(s > 0, s, 1), np.nan)


def jsd(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence in bits (0 = identical, 1 = disjoint) over the last axis."""
    p, q = _normalize(np.asarray(p, float)), _normalize(np.asarray(q, float))
    mix = 0.5 * (p + q)

    def kl(x):
        with np.errstate(invalid="ignore", divide="ignore"):
            t = np.where(x > 0, x * np.log2(np.where(x > 0, x, 1) / np.where(mix > 0, mix, 1)), 0)
        return t.sum(-1)

    return np.clip(0.5 * kl(p) + 0.5 * kl(q), 0.0, 1.0)


def cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cosine similarity over the last axis (NaN if either vector is zero)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    den = np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (x * y).sum(-1) / np.where(den > 0, den, 1), np.nan)


def sum_min(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Weighted overlap sum(min(p, q)) of normalized vectors: 1 - total variation distance."""
    return np.minimum(_normalize(np.asarray(p, float)), _normalize(np.asarray(q, float))).sum(-1)


@dataclass
class SetOverlap:
    """Overlap of two corpora's important-expert sets in one layer, against chance."""

    corpus_a: str
    corpus_b: str
    criterion: str  # "count" or "reap_mass"
    m: int  # requested set size (ties can make a set larger, rarely-used layers smaller)
    layer: int  # model layer index
    size_a: int
    size_b: int
    intersection: int
    jaccard: float
    expected: float  # exact E[J] under random sets of sizes size_a, size_b
    null_sd: float
    null_lo: float  # chance band (central 1 - alpha)
    null_hi: float
    z: float  # (jaccard - expected) / null_sd
    p_less: float  # exact P(K <= observed): fewer shared experts than chance
    p_greater: float  # exact P(K >= observed): more shared experts than chance
    p_value: float  # two-sided
    q_value: float = float("nan")  # p_value BH-adjusted over the layers of this pair/criterion/m
    ci_lo: float = float("nan")  # bootstrap CI over sequences (count criterion only)
    ci_hi: float = float("nan")


@dataclass
class SetOverlapOverall:
    """All layers together: mean Jaccard vs its chance mean, exact test on total intersection."""

    corpus_a: str
    corpus_b: str
    criterion: str
    m: int
    n_layers: int
    mean_jaccard: float
    mean_expected: float
    null_lo: float  # normal approximation: mean_expected -/+ z_(1-alpha/2) x sd of the mean
    null_hi: float
    z: float
    intersection: int  # summed over layers
    expected_intersection: float
    p_less: float  # exact, from the convolution of the layers' hypergeometrics
    p_greater: float
    p_value: float
    layers_above: int  # layers with q < alpha and more overlap than chance
    layers_below: int  # layers with q < alpha and less overlap than chance
    ci_lo: float = float("nan")
    ci_hi: float = float("nan")


@dataclass
class UsageSimilarity:
    """Distribution-level similarity of two corpora's routing in one layer (or overall)."""

    corpus_a: str
    corpus_b: str
    layer: int  # model layer index; -1 = mean over layers
    jsd: float  # bits
    cosine: float
    sum_min: float
    jsd_lo: float = float("nan")  # bootstrap CIs (NaN when a corpus lacks seq_count)
    jsd_hi: float = float("nan")
    cosine_lo: float = float("nan")
    cosine_hi: float = float("nan")
    sum_min_lo: float = float("nan")
    sum_min_hi: float = float("nan")


def compare_sets(
    a: CorpusUsage, b: CorpusUsage, criterion: str, m: int, alpha: float = 0.05
) -> tuple[list[SetOverlap], SetOverlapOverall]:
    """Per-layer and overall set overlap of two corpora under one criterion and set size."""
    sa = important_set(a.score(criterion), m)  # [L, E]
    sb = important_set(b.score(criterion), m)
    n = sa.shape[-1]
    rows, sizes, inter_total = [], [], 0
    for li, layer in enumerate(a.stats.layers):
        na, nb, k = int(sa[li].sum()), int(sb[li].sum()), int((sa[li] & sb[li]).sum())
        null = chance.jaccard_null(n, na, nb, alpha)
        p = chance.jaccard_p(n, na, nb, k)
        j = float(chance.jaccard_of(k, na, nb))
        z = (j - null.mean) / null.sd if null.sd > 0 else np.nan
        band = (null.mean, null.sd, null.lo, null.hi, float(z))  # chance, as SetOverlap orders it
        tests = (p.less, p.greater, p.two_sided)
        rows.append(SetOverlap(a.name, b.name, criterion, m, layer, na, nb, k, j, *band, *tests))
        sizes.append((n, na, nb))
        inter_total += k
    q = chance.fdr_bh(np.array([r.p_value for r in rows]))
    for r, qv in zip(rows, q):
        r.q_value = float(qv)
    return rows, _overall(rows, sizes, inter_total, alpha)


def _overall(rows: list[SetOverlap], sizes, inter_total: int, alpha: float) -> SetOverlapOverall:
    from scipy.stats import norm

    L = len(rows)
    mean_j = float(np.nanmean([r.jaccard for r in rows]))
    mean_e = float(np.nanmean([r.expected for r in rows]))
    sd = float(np.sqrt(np.nansum([r.null_sd**2 for r in rows]))) / L
    zc = float(norm.ppf(1 - alpha / 2))
    p = chance.total_intersection_p(sizes, inter_total)
    sig = [r for r in rows if r.q_value < alpha]
    r0 = rows[0]
    pair = (r0.corpus_a, r0.corpus_b, r0.criterion, r0.m, L)
    z = (mean_j - mean_e) / sd if sd > 0 else float("nan")
    band = (mean_j, mean_e, mean_e - zc * sd, mean_e + zc * sd, z)
    expected = float(sum(a * b / n for n, a, b in sizes))
    above = sum(r.jaccard > r.expected for r in sig)
    below = sum(r.jaccard < r.expected for r in sig)
    tests = (inter_total, expected, p.less, p.greater, p.two_sided, above, below)
    return SetOverlapOverall(*pair, *band, *tests)


def compare_usage(a: CorpusUsage, b: CorpusUsage) -> list[UsageSimilarity]:
    """Per-layer JSD / cosine / sum(min) of the routing distributions, then their layer mean."""
    pa, pb = a.usage(), b.usage()  # [L, E]
    j, c, s = jsd(pa, pb), cosine(pa, pb), sum_min(pa, pb)  # [L]
    rows = [
        UsageSimilarity(a.name, b.name, layer, float(j[i]), float(c[i]), float(s[i]))
        for i, layer in enumerate(a.stats.layers)
    ]
    rows.append(
        UsageSimilarity(a.name, b.name, -1, float(j.mean()), float(c.mean()), float(s.mean()))
    )
    return rows
