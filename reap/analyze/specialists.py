"""Specialist and generalist experts: whose usage is concentrated on one corpus, who serves all.

A corpus's usage rate of an expert is freq_c = count_c / tokens_c, so corpora of different sizes
weigh alike; share_c = freq_c / sum_c' freq_c'. An expert is a specialist of corpus c when c uses
it at least `ratio` times as often as any other corpus and at least `min_load` times the uniform
rate top_k / E (rarely used experts are noise); a generalist when every corpus uses it at least
`min_load` times the uniform rate and it is no specialist.

Sampling noise alone makes "specialists" among corpora that route identically, so the count is
given next to a chance baseline: the same count after shuffling whole calibration sequences
between corpora (sizes kept; needs `seq_count`). Dimension letters: C corpora, L layers,
E experts, S sequences, P permutations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reap.analyze.overlap import CorpusUsage


@dataclass
class ExpertProfiles:
    """How each corpus uses each expert, and the resulting specialist/generalist labels."""

    corpora: list[str]  # [C]
    layers: list[int]  # [L] model layer indices
    freq: np.ndarray  # [L, E, C] share of each corpus's tokens routed to the expert
    share: np.ndarray  # [L, E, C] freq / sum over corpora (rows sum to 1; NaN if unused)
    lift: np.ndarray  # [L, E, C] freq / equal-weight mix = C x share
    specialist_of: np.ndarray  # [L, E] int: corpus index, -1 = not a specialist
    generalist: np.ndarray  # [L, E] bool
    ratio: float
    min_load: float

    def specialist_counts(self) -> np.ndarray:
        """Specialists per layer and corpus: [L, C]."""
        C = len(self.corpora)
        return np.stack([(self.specialist_of == c).sum(-1) for c in range(C)], -1)


@dataclass
class SpecialistNull:
    """Specialist counts when sequences are shuffled between corpora (no real corpus effect)."""

    n_permutations: int
    mean: np.ndarray  # [C] specialists of each corpus, mean over permutations (all layers)
    hi: np.ndarray  # [C] 95th percentile over permutations
    total_mean: float  # all corpora together
    total_hi: float
    p_value: np.ndarray  # [C] (1 + #perm >= observed) / (1 + P), one-sided


def classify(
    freq: np.ndarray, top_k: int, ratio: float = 3.0, min_load: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Specialist corpus index (-1 none) and generalist flag from usage rates freq [..., E, C]."""
    E, C = freq.shape[-2:]
    floor = min_load * top_k / E
    top = freq.argmax(-1)  # [..., E]
    srt = np.sort(freq, -1)
    best, second = srt[..., -1], srt[..., -2] if C > 1 else np.zeros_like(srt[..., -1])
    spec = (best >= floor) & (best >= ratio * second) & (best > 0)
    specialist_of = np.where(spec, top, -1)
    generalist = (freq.min(-1) >= floor) & ~spec
    return specialist_of, generalist


def expert_profiles(
    corpora: list[CorpusUsage], ratio: float = 3.0, min_load: float = 0.5
) -> ExpertProfiles:
    """Usage rates, shares, lifts and labels of every expert of every layer."""
    freq = np.stack([c.count / c.tokens for c in corpora], -1)  # [L, E, C]
    return _profiles_from_freq(freq, corpora, ratio, min_load)


def _profiles_from_freq(freq, corpora, ratio, min_load) -> ExpertProfiles:
    total = freq.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(total > 0, freq / np.where(total > 0, total, 1), np.nan)
    spec, gen = classify(freq, corpora[0].stats.top_k, ratio, min_load)
    names, layers = [c.name for c in corpora], list(corpora[0].stats.layers)
    lift = share * len(corpora)
    return ExpertProfiles(names, layers, freq, share, lift, spec, gen, ratio, min_load)


@dataclass
class Shuffled:
    """Routed counts after shuffling whole sequences between corpora (sizes kept).

    A shuffle keeps everything but the corpus labels, so any structure it still shows is
    sampling noise. Counts are kept exact so rates compare bit for bit with the observed ones.
    """

    counts: np.ndarray  # [P, L, E, C] int32 routed counts of each shuffled corpus
    tokens: np.ndarray  # [P, C] tokens of each shuffled corpus

    def freq(self, p: int) -> np.ndarray:
        """Usage rates of shuffle p, [L, E, C], computed like `expert_profiles` does."""
        return self.counts[p] / self.tokens[p]

    def __len__(self) -> int:
        return len(self.tokens)


def shuffle_sequences(
    corpora: list[CorpusUsage], n_permutations: int = 100, seed: int = 0, progress: bool = False
) -> Shuffled | None:
    """P shuffles of sequences between corpora, the same for every layer (computed layer by
    layer to bound memory). None when a corpus lacks `seq_count` (no baseline rather than an
    invented one) or when P < 1.
    """
    from tqdm.auto import tqdm

    if n_permutations < 1 or any(c.stats.seq_count is None for c in corpora):
        return None
    top_k, C, L = corpora[0].stats.top_k, len(corpora), len(corpora[0].stats.layers)
    starts = np.cumsum([0] + [c.n_sequences for c in corpora])[:-1]  # [C] first sequence
    first = np.concatenate([c.stats.seq_count[:, 0, :].long().numpy() for c in corpora])
    seq_tokens = first.sum(-1) // top_k  # [S] tokens of each sequence
    rng = np.random.default_rng(seed)
    perms = np.stack([rng.permutation(len(seq_tokens)) for _ in range(n_permutations)])  # [P, S]
    counts = np.empty((n_permutations, L, first.shape[1], C), dtype=np.int32)
    for li in tqdm(range(L), desc="sequence shuffles", disable=not progress):
        seqs = np.concatenate([c.stats.seq_count[:, li, :].long().numpy() for c in corpora])
        for p in range(n_permutations):
            counts[p, li] = np.add.reduceat(seqs[perms[p]], starts, axis=0).T  # [E, C]
    return Shuffled(counts, np.add.reduceat(seq_tokens[perms], starts, axis=1))


def specialist_null(profiles: ExpertProfiles, shuffled: Shuffled | None) -> SpecialistNull | None:
    """Chance baseline for specialist counts from sequence shuffles.

    p-values are permutation p-values: their resolution is 1 / (P + 1).
    """
    if shuffled is None:
        return None
    P, C = len(shuffled), len(profiles.corpora)
    top_k = round(float(profiles.freq[0].sum()) / C)  # each corpus's rates of a layer sum to top_k
    counts = np.zeros((P, C))
    for p in range(P):
        spec, _ = classify(shuffled.freq(p), top_k, profiles.ratio, profiles.min_load)
        counts[p] = np.bincount(spec[spec >= 0], minlength=C)
    observed = profiles.specialist_counts().sum(0)  # [C]
    tot = counts.sum(1)
    per_corpus = (counts.mean(0), np.percentile(counts, 95, axis=0))
    total = (float(tot.mean()), float(np.percentile(tot, 95)))
    return SpecialistNull(P, *per_corpus, *total, (1 + (counts >= observed).sum(0)) / (1 + P))
