"""Expert scores, their combination across corpora, super-expert protection and selection.

Pure functions on [L, E] score matrices (L MoE layers in statistics order, E routed experts);
`reap.prune.plan` turns them into a plan. Nothing here knows a model family or a file.

Combining corpora: each corpus's scores are first normalized per layer to *shares*, the score
divided by the layer's total (a row that sums to zero becomes uniform), so every corpus contributes
a distribution over the layer's experts that sums to 1 whatever the criterion's units or the
corpus's size; the combined score is the weighted mean of the shares (weights scaled to sum 1).

Ranking is by descending score, ties broken by ascending expert id, so every selection is
deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from reap.errors import ReapError
from reap.stats import ExpertStats

CRITERIA = ("reap", "ean", "frequency", "gate", "random", "recon")

PROTECT_RULE = (
    "super expert: an expert whose max |activation| is a far-out outlier of the model, "
    "log(max_act) > Q3 + 3*IQR of log(max_act) over all routed experts of all MoE layers that "
    "received tokens (Tukey's far-out fence on a log scale: about 1 false positive per million "
    "experts for log-normal max activations); protected experts are always kept and count "
    "toward the budget"
)


def scores(stats: ExpertStats, criterion: str, latent: bool = False) -> torch.Tensor:
    """Per-expert saliency [L, E] float64 of one corpus (higher = more worth keeping).

    reap: mean over routed tokens of weight * ||output||; ean: mean ||output||; frequency: share
    of tokens routed to the expert; gate: gate-weight mass per token (sum of the expert's routing
    weights / all tokens). `random` needs no statistics: see `random_scores`; `recon` chooses
    sets, not scores: see `reap.prune.recon`.
    """
    if criterion == "reap":
        s = stats.reap(latent=latent)
    elif criterion == "ean":
        s = stats.ean(latent=latent)
    elif criterion == "frequency":
        s = stats.frequency()
    elif criterion == "gate":
        s = stats.gate_sum / max(stats.tokens, 1)
    elif criterion == "recon":
        raise ReapError("criterion recon chooses kept sets by its own streamed pass "
                        "(reap.prune.recon_pass.plan_recon), not by per-expert scores")
    else:
        raise ReapError(f"unknown criterion {criterion!r} (choose from {', '.join(CRITERIA)})")
    return s.double()


def random_scores(n_layers: int, n_experts: int, seed: int) -> torch.Tensor:
    """Seeded uniform random scores [L, E] float64: the baseline criterion."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_layers, n_experts, generator=g, dtype=torch.float64)


def shares(s: torch.Tensor) -> torch.Tensor:
    """Scores [L, E] divided by their layer total; an all-zero layer becomes uniform 1/E."""
    s = s.double().clamp(min=0)
    total = s.sum(1, keepdim=True)
    uniform = torch.full_like(s, 1.0 / s.shape[1])
    return torch.where(total > 0, s / total.clamp(min=1e-300), uniform)


def combine(per_corpus: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Weighted mean [L, E] of each corpus's per-layer shares; weights are scaled to sum 1."""
    total = sum(weights[c] for c in per_corpus)
    if total <= 0:
        raise ReapError("corpus weights must have a positive sum")
    return sum(shares(s) * (weights[c] / total) for c, s in per_corpus.items())


def parse_weights(text: str | None, corpora: list[str]) -> dict[str, float]:
    """'zh=3,code=1' -> {corpus: weight}; unnamed corpora get weight 1 only when text is None."""
    if not text:
        return {c: 1.0 for c in corpora}
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, val = part.partition("=")
        try:
            w = float(val)
        except ValueError:
            w = float("nan")
        if not sep or not math.isfinite(w) or w < 0:
            raise ReapError(f"cannot read corpus weight {part!r} (use e.g. --weights zh=3,code=1)")
        out[name.strip()] = w
    unknown = sorted(set(out) - set(corpora))
    if unknown:
        raise ReapError(f"--weights names {', '.join(unknown)}, not among the statistics' "
                        f"corpora ({', '.join(corpora)})")
    missing = sorted(set(corpora) - set(out))
    if missing:
        raise ReapError(f"--weights gives no weight for corpus {', '.join(missing)}")
    return out


def order(score: torch.Tensor) -> list[int]:
    """Expert ids [E] by descending score, ties by ascending id."""
    s = score.double().numpy()
    return np.lexsort((np.arange(len(s)), -s)).tolist()


@dataclass(frozen=True)
class SuperExpert:
    """A protected expert: MoE layer index, expert id, its max |activation|."""

    layer: int
    expert: int
    max_act: float


def super_experts(max_act: torch.Tensor, count: torch.Tensor,
                  layers: list[int]) -> list[SuperExpert]:
    """Experts whose max activation is a far-out outlier (see PROTECT_RULE).

    max_act, count: [L, E] (count = routed tokens; unrouted experts are not in the population).
    """
    used = (count > 0) & (max_act > 0)
    if int(used.sum()) < 4:
        return []
    logs = torch.log(max_act[used].double())
    q1, q3 = torch.quantile(logs, torch.tensor([0.25, 0.75], dtype=torch.float64)).tolist()
    fence = q3 + 3.0 * (q3 - q1)
    hits = (used & (torch.log(max_act.double().clamp(min=1e-300)) > fence)).nonzero().tolist()
    return [SuperExpert(layers[li], e, float(max_act[li, e])) for li, e in hits]


def select_layer(n: int, combined: torch.Tensor, protected: set[int],
                 quota: dict[str, tuple[float, torch.Tensor]] | None = None) -> list[int]:
    """The n expert ids [sorted] to keep in one layer.

    Protected experts first; then, with `quota` ({corpus: (weight, scores [E])}), each corpus's
    top experts for its share of the remaining budget (largest-remainder rounding), their union;
    then filled up to n by the combined score [E].
    """
    if len(protected) > n:
        raise ReapError(f"{len(protected)} protected experts exceed the {n} to keep in a layer "
                        f"(raise the budget or use --no-protect)")
    kept = set(protected)
    if quota:
        room = n - len(kept)
        for (_, s), q in zip(quota.values(), _apportion(room, [w for w, _ in quota.values()])):
            kept.update([e for e in order(s) if e not in protected][:q])
    for e in order(combined):
        if len(kept) >= n:
            break
        kept.add(e)
    return sorted(kept)


def _apportion(n: int, weights: list[float]) -> list[int]:
    """Split n into integer parts proportional to weights (largest remainder, ties to first)."""
    total = sum(weights)
    if total <= 0:
        return [0] * len(weights)
    exact = [n * w / total for w in weights]
    parts = [math.floor(x) for x in exact]
    by_rest = sorted(range(len(weights)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in by_rest[: n - sum(parts)]:
        parts[i] += 1
    return parts


def global_counts(combined: torch.Tensor, floor: list[int], protected: list[set[int]],
                  admit: Callable[[list[int], int], bool]) -> list[int]:
    """Per-layer counts [L] when the budget is shared across layers.

    Each layer starts with `floor[l]` experts (its protected ones, then its best); the remaining
    experts of all layers are then offered in descending combined share (ties by layer, then id),
    each layer's in its own order, and taken while `admit(counts, layer_index)` says the budget
    allows one more in that layer. combined: [L, E] per-layer shares.
    """
    L = combined.shape[0]
    counts = list(floor)
    queue = []  # (share, layer, id) of the experts not in the floor, in each layer's order
    for li in range(L):
        rest = [e for e in order(combined[li]) if e not in protected[li]]
        start = max(floor[li] - len(protected[li]), 0)
        queue += [(-float(combined[li, e]), li, e) for e in rest[start:]]
    queue.sort()
    blocked = [False] * L
    for _, li, _ in queue:
        if blocked[li]:
            continue
        if admit(counts, li):
            counts[li] += 1
        else:
            blocked[li] = True  # later experts of this layer are offered later: keep the prefix
    return counts
