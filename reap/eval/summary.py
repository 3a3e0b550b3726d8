"""Per-domain summaries of the streamed scores and the generation metrics, with bootstrap
confidence intervals over documents.

Every quality figure is a ratio of sums over documents (a token-weighted mean):

    loss = sum nll / sum tokens          ppl = exp(loss)
    ppl_ratio = exp(loss - ref_loss)     (build perplexity / reference perplexity)
    agreement = sum agree / sum tokens   kl = sum kl / sum tokens     (nats per token)

The bootstrap resamples documents with replacement (`n_boot` replicates, numpy PCG64 seeded by
`seed`); each replicate recomputes every ratio from the same resampled documents, so the ratio to
the reference is paired. Intervals are percentile intervals at `level`. lm-eval's scores
come with its standard errors instead: their interval is the normal one.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass, field

import numpy as np

BLOCK = 256  # bootstrap replicates drawn per block (bounds the [B, docs] weight matrix)


@dataclass
class Estimate:
    """A point value with its bootstrap interval (lo, hi None without a bootstrap)."""

    value: float
    lo: float | None = None
    hi: float | None = None


@dataclass
class QualitySummary:
    """One build on one corpus (see the module docstring); `docs`, `tokens` scored."""

    docs: int
    tokens: int
    loss: Estimate
    ppl: Estimate
    ref_loss: Estimate
    ppl_ratio: Estimate
    agreement: Estimate
    kl: Estimate


def bootstrap_counts(n_docs: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """How often each document is drawn in each of `n_boot` replicates: [n_boot, n_docs]."""
    idx = rng.integers(0, n_docs, size=(n_boot, n_docs))  # [B, n] drawn document indices
    counts = np.zeros((n_boot, n_docs))
    np.add.at(counts, (np.arange(n_boot)[:, None], idx), 1.0)
    return counts


def ratio_replicates(num: np.ndarray, den: np.ndarray, n_boot: int, seed: int = 0) -> np.ndarray:
    """Bootstrap replicates of sum(num[:, j]) / sum(den) for every column j of num [n, M]:
    returns [n_boot, M]."""
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n_boot, BLOCK):
        w = bootstrap_counts(len(den), min(BLOCK, n_boot - start), rng)  # [b, n]
        out.append((w @ num) / (w @ den)[:, None])  # [b, M]
    return np.concatenate(out) if out else np.zeros((0, num.shape[1]))


def _interval(reps: np.ndarray, level: float) -> tuple[float | None, float | None]:
    if len(reps) == 0:
        return None, None
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [a, 1.0 - a])
    return float(lo), float(hi)


def summarize_quality(scores: list, n_boot: int = 1000, level: float = 0.95,
                      seed: int = 0) -> QualitySummary:
    """Summary of per-document scores (objects with tokens, nll, ref_nll, agree, kl)."""
    tok = np.array([s.tokens for s in scores], dtype=np.float64)
    cols = np.array([[s.nll, s.ref_nll, s.agree, s.kl] for s in scores], dtype=np.float64)
    point = cols.sum(0) / tok.sum()  # [4]: loss, ref_loss, agreement, kl
    reps = ratio_replicates(cols, tok, n_boot, seed)  # [B, 4]

    def est(j: int, f=lambda x: x) -> Estimate:
        lo, hi = _interval(f(reps[:, j]), level)
        return Estimate(float(f(point[j])), lo, hi)

    ratio_reps = np.exp(reps[:, 0] - reps[:, 1])
    lo, hi = _interval(ratio_reps, level)
    return QualitySummary(docs=len(scores), tokens=int(tok.sum()), loss=est(0),
                          ppl=est(0, np.exp), ref_loss=est(1),
                          ppl_ratio=Estimate(math.exp(point[0] - point[1]), lo, hi),
                          agreement=est(2), kl=est(3))


def reference_quality(scores: list, n_boot: int = 1000, level: float = 0.95,
                      seed: int = 0) -> QualitySummary:
    """The reference's own column: its loss from `ref_nll`, ratio 1, agreement 1, KL 0."""
    s = summarize_quality(scores, n_boot, level, seed)
    exact = [Estimate(v, v, v) if n_boot else Estimate(v) for v in (1.0, 1.0, 0.0)]
    ppl = Estimate(*(None if v is None else math.exp(v) for v in astuple(s.ref_loss)))
    return QualitySummary(s.docs, s.tokens, s.ref_loss, ppl, s.ref_loss, *exact)


def benchmark_estimate(value: float, stderr: float | None, z: float = 1.959964) -> Estimate:
    """An lm-eval score with its normal 95 % interval, value +- z stderr (none without one)."""
    return Estimate(value) if stderr is None else Estimate(value, value - z * stderr,
                                                           value + z * stderr)


@dataclass
class GenerationSummary:
    """One build's generations on one domain: means over prompts (rates for booleans); `script`
    and `python_valid` None where the domain has no such check; `same_as_reference`: share of
    prompts whose generated token ids equal the reference's."""

    prompts: int
    tokens: float
    chars: float
    distinct_2: float
    longest_repeat: float
    looping: float
    script: float | None = None
    python_valid: float | None = None
    same_as_reference: float | None = None
    extra: dict = field(default_factory=dict)


def _mean(values) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def summarize_generations(gens: list[dict],
                          ref_gens: list[dict] | None = None) -> GenerationSummary:
    """Means of the per-generation metrics (`gens[i]["metrics"]`); with `ref_gens` (same prompt
    order) the share of identical outputs."""
    ms = [g["metrics"] for g in gens]
    same = None
    if ref_gens is not None:
        same = _mean(g["ids"] == r["ids"] for g, r in zip(gens, ref_gens))
    extra = {k: _mean(m.get(k) for m in ms) for k in ("kana", "distinct_1", "distinct_3")
             if any(m.get(k) is not None for m in ms)}
    always = ("tokens", "chars", "distinct_2", "longest_repeat", "looping")
    means = {k: _mean(m[k] for m in ms) or 0.0 for k in always}
    checks = {k: _mean(m[k] for m in ms) for k in ("script", "python_valid")}  # None: unchecked
    return GenerationSummary(len(gens), **means, **checks, same_as_reference=same, extra=extra)
