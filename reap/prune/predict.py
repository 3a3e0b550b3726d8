"""What a plan keeps of each corpus, predicted from statistics before anything is built.

For every corpus with statistics (those the plan was made from and any given with `--against`),
per MoE layer l and overall (the mean over layers, each layer counting once):

- `gate_kept[l]`: share of the corpus's routed gate mass (sum of routing weights over routed
  tokens, `gate_sum`) that lands on kept experts;
- `reap_kept[l]`: the same share of REAP mass (sum of weight * ||expert output||, `reap_sum`):
  how much of the routed experts' contribution to the layer output the kept experts carried;
- `topk_kept[l]`: share of tokens whose whole top-k survives, exact from the per-token routing
  records of `reap calibrate --save-token-experts` (None without them).

The predicted-damage index of a corpus is the mean over layers of the REAP mass lost,
1 - mean_l reap_kept[l]: 0 when the plan keeps every expert the corpus uses, 1 when it keeps
none of them. Its 95 % interval is a percentile bootstrap over the corpus's calibration
sequences; the statistics hold per-sequence routed counts (`seq_count` [S, L, E]) but no
per-sequence REAP sums, so a resampled sequence contributes count[s, l, e] * (the expert's mean
REAP contribution per routed token): the interval covers which experts sequences use, not the
spread of the per-token contribution (no interval when `seq_count` is absent).

Dimension letters: L MoE layers, E experts, S sequences, N tokens, K top_k, B replicates.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from reap.errors import ReapError

FORMAT = "reap.prediction/1"
INDEX = "1 - mean over MoE layers of the share of the corpus's REAP mass on kept experts"
TOKEN_FILE = "token_experts.safetensors"


@dataclass
class CorpusPrediction:
    """One corpus under one plan; per-layer lists in the plan's layer order."""

    corpus: str
    source: str  # statistics file
    tokens: int
    sequences: int | None
    gate_kept: list[float]  # [L]
    reap_kept: list[float]  # [L]
    topk_kept: list[float] | None  # [L], from per-token routing records
    gate_overall: float
    reap_overall: float
    topk_overall: float | None
    damage: float  # INDEX
    damage_ci: list[float] | None  # [lo, hi], 95 % bootstrap over sequences


def keep_mask(keep: dict[int, list[int]], layers: list[int], n_experts: int) -> torch.Tensor:
    """Kept experts as a bool mask [L, E] in `layers` order."""
    mask = torch.zeros(len(layers), n_experts, dtype=torch.bool)
    for li, layer in enumerate(layers):
        mask[li, keep[layer]] = True
    return mask


def kept_share(sums: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share [..., L] of per-expert mass sums [..., L, E] on kept experts (a layer without
    mass keeps all of it: nothing routed there can be lost)."""
    sums = sums.double()
    total = sums.sum(-1)
    kept = (sums * mask).sum(-1)
    return torch.where(total > 0, kept / total.clamp(min=1e-300), torch.ones_like(total))


def topk_survival(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share [L] of tokens whose every routed expert is kept; ids [L, N, K], mask [L, E]."""
    L = ids.shape[0]
    alive = torch.stack([mask[li][ids[li].long()] for li in range(L)])  # [L, N, K]
    return alive.all(-1).double().mean(-1)


def bootstrap_damage(seq_count: torch.Tensor, per_token: torch.Tensor, mask: torch.Tensor,
                     reps: int, seed: int) -> list[float] | None:
    """95 % percentile interval [lo, hi] of the damage index over `reps` resamples of sequences;
    seq_count [S, L, E], per_token [L, E] mean REAP mass per routed token."""
    S = seq_count.shape[0]
    if S < 2 or reps < 1:
        return None
    mass = seq_count.double() * per_token.double()  # [S, L, E]
    seq_kept, seq_all = (mass * mask).sum(-1), mass.sum(-1)  # [S, L]
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, S, (reps, S), generator=g)  # [B, S]
    kept, total = seq_kept[idx].sum(1), seq_all[idx].sum(1)  # [B, L]
    share = torch.where(total > 0, kept / total.clamp(min=1e-300), torch.ones_like(total))
    damage = 1.0 - share.mean(-1)  # [B]
    lo, hi = torch.quantile(damage, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return [lo, hi]


def predict_corpus(name: str, path: str, stats, mask: torch.Tensor, ids: torch.Tensor | None,
                   reps: int = 1000, seed: int = 0) -> CorpusPrediction:
    """The prediction for one corpus (`stats` an ExpertStats of the plan's layers, ids its
    per-token routing [L, N, K] or None)."""
    gate = kept_share(stats.gate_sum, mask)  # [L]
    reap = kept_share(stats.reap_sum, mask)  # [L]
    topk = topk_survival(ids, mask) if ids is not None and ids.shape[1] else None
    ci = None
    if stats.seq_count is not None:
        ci = bootstrap_damage(stats.seq_count, stats.reap(), mask, reps, seed)
    return CorpusPrediction(
        corpus=name, source=os.path.abspath(path), tokens=stats.tokens,
        sequences=None if stats.seq_count is None else int(stats.seq_count.shape[0]),
        gate_kept=gate.tolist(), reap_kept=reap.tolist(),
        topk_kept=None if topk is None else topk.tolist(), gate_overall=float(gate.mean()),
        reap_overall=float(reap.mean()), topk_overall=None if topk is None else float(topk.mean()),
        damage=float(1.0 - reap.mean()), damage_ci=ci)


def predict(plan, stats: list[str], reps: int = 1000, seed: int = 0,
            token_files: dict[str, str] | None = None) -> dict:
    """Predictions of `plan` (a Plan with kept sets) for every corpus in the statistics files
    or calibration directories `stats`: {"format", "index", "corpora": [CorpusPrediction]}.
    token_files: {corpus: token_experts file}; by default the one beside each statistics file."""
    from reap.stats import ExpertStats, expand_paths

    if plan.keep is None:
        raise ReapError("a counts-only plan keeps no particular experts: nothing to predict")
    mask = keep_mask(plan.keep, plan.layers, plan.n_experts)
    out = []
    for path in expand_paths(stats)[0]:
        s = ExpertStats.load(path)
        name = str(s.meta.get("corpus") or os.path.splitext(os.path.basename(path))[0])
        _check_shape(path, s, plan)
        if any(p.corpus == name for p in out):
            continue  # the same corpus given twice (e.g. as a plan input and --against)
        tok = (token_files or {}).get(name) or os.path.join(os.path.dirname(path), TOKEN_FILE)
        ids = corpus_token_ids(tok, s, plan.layers)
        out.append(predict_corpus(name, path, s, mask, ids, reps, seed))
    return {"format": FORMAT, "index": INDEX, "corpora": [asdict(p) for p in out]}


def _check_shape(path: str, s, plan) -> None:
    if (list(s.layers), s.n_experts, s.top_k) != (list(plan.layers), plan.n_experts, plan.top_k):
        raise ReapError(f"{path}: statistics of layers/experts/top-k {s.layers}/{s.n_experts}/"
                        f"{s.top_k}, the plan has {plan.layers}/{plan.n_experts}/{plan.top_k}")
    if plan.model and s.meta.get("model") and s.meta["model"] != plan.model:
        raise ReapError(f"{path}: statistics of model {s.meta['model']}, the plan of {plan.model}")


def _component_names(meta: dict) -> list[str]:
    """Corpus names a statistics file covers (a merge covers those of its parts)."""
    parts = meta.get("merged_from")
    if parts:
        return [n for p in parts for n in _component_names(p)]
    return [str(meta.get("corpus"))]


def corpus_token_ids(path: str, stats, layers: list[int]) -> torch.Tensor | None:
    """Routed ids [L, N_c, K] of the corpus's tokens from a token_experts file of the same model
    and layers, or None when there is none that covers the corpus."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        return None
    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {}).get("reap", "{}"))
            seq_corpus = f.get_tensor("seq_corpus")  # [S]
            ids = f.get_tensor("ids")  # [L, N, K]
    except Exception as e:  # safetensors raises its own error types
        raise ReapError(f"{path}: not a token_experts file ({type(e).__name__}: {e})") from e
    names = meta.get("corpora") or []
    want = _component_names(stats.meta)
    if meta.get("model") != stats.meta.get("model") or not set(want) <= set(names):
        return None
    if ids.shape[0] != len(layers) or seq_corpus.numel() == 0:
        return None
    T = ids.shape[1] // seq_corpus.numel()
    codes = torch.tensor([names.index(n) for n in want])
    seq_mask = torch.isin(seq_corpus, codes)  # [S]
    tok_mask = seq_mask.repeat_interleave(T)  # [N]
    if int(tok_mask.sum()) != stats.tokens:
        return None  # records of other tokens (another shard or run)
    return ids[:, tok_mask]
