"""What overlap chance alone produces: the exact null distribution of set overlap.

If two important sets of sizes a and b among n experts had nothing to do with each other, their
intersection K is hypergeometric: P(K=k) = C(a,k) C(n-a,b-k) / C(n,b), and the Jaccard index
J = K / (a+b-K) is monotone in K. Everything here follows exactly from that (expected Jaccard,
spread, the central band, exact p-values). Across layers the selections are independent under
the null, so the total intersection's distribution is the convolution of the layers': an exact
test over all layers at once. `fdr_bh` adjusts per-layer p-values (Benjamini-Hochberg).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def intersection_pmf(n: int, a: int, b: int) -> np.ndarray:
    """P(|A ∩ B| = k) for k = 0..min(a, b), B a uniformly random b-subset of n items: [min+1]."""
    from scipy.stats import hypergeom

    if not (0 <= a <= n and 0 <= b <= n):
        raise ValueError(f"set sizes {a}, {b} outside 0..{n}")
    k = np.arange(min(a, b) + 1)
    pmf = hypergeom.pmf(k, n, a, b)
    return pmf / pmf.sum()


def jaccard_of(k, a, b) -> np.ndarray:
    """Jaccard index of sets of sizes a, b meeting in k items (broadcasts; NaN if both empty)."""
    k = np.asarray(k, dtype=np.float64)
    union = a + b - k
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, k / np.where(union > 0, union, 1), np.nan)


@dataclass(frozen=True)
class JaccardNull:
    """Distribution of the Jaccard index of an a-set and a random b-set among n items."""

    n: int
    a: int
    b: int
    mean: float  # exact E[J] = sum_k P(k) k / (a + b - k)
    sd: float  # exact standard deviation of J
    lo: float  # central band: P(J < lo) <= alpha/2 ...
    hi: float  # ... and P(J > hi) <= alpha/2, so chance lands in [lo, hi] with prob >= 1-alpha
    mean_k: float  # expected intersection a*b/n


def jaccard_null(n: int, a: int, b: int, alpha: float = 0.05) -> JaccardNull:
    """Exact null of the Jaccard index for set sizes a, b among n experts."""
    pmf = intersection_pmf(n, a, b)
    j = jaccard_of(np.arange(len(pmf)), a, b)
    if np.isnan(j).all():
        return JaccardNull(n, a, b, np.nan, np.nan, np.nan, np.nan, 0.0)
    mean = float((pmf * j).sum())
    sd = float(np.sqrt(max((pmf * (j - mean) ** 2).sum(), 0.0)))
    cdf = np.cumsum(pmf)
    lo = j[np.searchsorted(cdf, alpha / 2 - 1e-12)]
    sf = np.cumsum(pmf[::-1])[::-1]  # P(K >= k)
    hi = j[np.nonzero(sf >= alpha / 2 - 1e-12)[0][-1]]
    return JaccardNull(n, a, b, mean, sd, float(lo), float(hi), a * b / n)


@dataclass(frozen=True)
class TailP:
    """Exact p-values of an observed count against a discrete null."""

    less: float  # P(K <= k): evidence of less overlap than chance
    greater: float  # P(K >= k): evidence of more overlap than chance
    two_sided: float  # min(1, 2 * min(less, greater))


def tail_p(pmf: np.ndarray, k: int) -> TailP:
    """p-values of observing k under a pmf over 0..len(pmf)-1 (tails summed, never 1 - cdf)."""
    k = int(k)
    less = float(pmf[: k + 1].sum()) if k >= 0 else 0.0
    greater = float(pmf[max(k, 0) :].sum()) if k < len(pmf) else 0.0
    return TailP(min(less, 1.0), min(greater, 1.0), min(1.0, 2 * min(less, greater)))


def jaccard_p(n: int, a: int, b: int, k: int) -> TailP:
    """Exact p-values of an intersection of k items (equivalently of its Jaccard index)."""
    return tail_p(intersection_pmf(n, a, b), k)


def sum_pmf(pmfs: list[np.ndarray]) -> np.ndarray:
    """Distribution of a sum of independent counts, each given by its pmf: the convolution."""
    out = np.ones(1)
    for p in pmfs:
        out = np.convolve(out, p)
        out[out < 0] = 0.0
    return out / out.sum()


def total_intersection_p(sizes: list[tuple[int, int, int]], k_total: int) -> TailP:
    """Exact p-values of the intersection summed over layers.

    sizes: per layer (n, a, b). Layers are independent under the null, so the total is the
    convolution of the per-layer hypergeometrics.
    """
    return tail_p(sum_pmf([intersection_pmf(n, a, b) for n, a, b in sizes]), k_total)


def fdr_bh(p: np.ndarray) -> np.ndarray:
    """Benjamini-Hochberg adjusted p-values (q-values) of a 1-D array; NaN stays NaN."""
    p = np.asarray(p, dtype=np.float64)
    out = np.full_like(p, np.nan)
    ok = ~np.isnan(p)
    v = p[ok]
    m = len(v)
    if m == 0:
        return out
    order = np.argsort(v)
    scaled = v[order] * m / np.arange(1, m + 1)
    q = np.minimum.accumulate(scaled[::-1])[::-1].clip(max=1.0)
    res = np.empty(m)
    res[order] = q
    out[ok] = res
    return out
