"""`--criterion recon`: per MoE layer, the kept set that least changes the layer's routed output
on the calibration tokens.

Objective (per layer, to minimise over kept sets S of the planned size): for each calibration
token t routed to experts k = 1..K with weights w_k and contributions u_k (expert output mapped
to the model space, per unit weight; ||u_k|| is `MoERecord.model_norm`),

    err_t(S) = || sum_k w_k u_k - c_t sum_{k in S} w_k u_k ||^2,   c_t = sum_k w_k / sum_{k in S} w_k

the dropped experts removed and the router's weights renormalised over the token's surviving
experts (no survivor: the whole routed output is lost). Substitutes the pruned router would
route in from outside the token's top-k are not modelled. Writing G_t[k, j] = w_k w_j <u_k, u_j>
and d_k = 1 - c_t [k in S], err_t = d^T G_t d. The streamed pass asks the model for the
per-token Gram of the contributions (`MoERecord.gram`, an observer's `wants_gram`), so the
objective is the exact output error of the renormalised top-k; a record without one falls back
to its diagonal (w_k^2 ||u_k||^2, contributions taken as orthogonal), and the plan's recon
block says which was used (`gram`: "full" or "diagonal"). A layer that RMS-normalizes the
routed sum before the model space (K3's LatentMoE) also reports what the survivors' sum's rms
needs, and the error uses it (d_k = 1 - c_t rho_t [k in S], rho_t = rms of the full sum / rms of
the survivors' renormalised sum): the exact change of that layer's output too. Tokens are
weighted so each corpus counts by its plan weight, relative to its routed output energy
(sum_t ||sum_k w_k u_k||^2 = sum_t 1^T G_t 1): the layer objective is the weighted mean of the
corpora's relative errors.

Search: three starts, backward greedy elimination (remove the expert whose removal raises the
objective least, ties to the lowest id; every expert's single-removal change comes from one
vectorized O(N K^2) pass), forward greedy selection and the REAP plan's set; from each, swaps
(one kept for one dropped) while one helps, and the best end wins: each sweep ranks all pairs by
the sum of their single-flip changes and evaluates the best SWAP_CANDIDATES exactly. A layer
with at most EXACT_LIMIT candidate sets is enumerated instead (the optimum). Protected experts
are always kept.

Cost against reap/ean: those read only the statistics' sums (seconds); recon reruns the
statistics' calibration as one streamed pass (`reap.calibrate.pipeline.calibrate` with an
observer: the same reads and compute as `reap calibrate`, under the same --budget, plus while a
layer runs every routed output of its pass's tokens (N*K*Dl fp32, Dl the experts' output width)
for the Gram, and N*K*(4K+14) bytes per MoE layer of kept records), then per layer E - n greedy
steps and a few swap sweeps, each O(N K^3) with the full Gram (O(N K) diagonal).

Dimension letters: N tokens, K top_k, E n_experts, L MoE layers.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from reap.errors import ReapError

METHOD = "backward and forward greedy + REAP start, each improved by pair swaps"
MAX_SWEEPS = 100
SWAP_CANDIDATES = 16
EXACT_LIMIT = 2000  # layers with at most this many candidate kept sets are enumerated


@dataclass
class LayerTokens:
    """One layer's calibration tokens: ids [N, K], w [N, K] routing weights, gram: G_t above,
    [N, K, K], or its diagonal [N, K] when off-diagonals are taken as 0; scale [N] per-token
    weight of the objective. For a layer that RMS-normalizes the routed sum (K3's LatentMoE, see
    `MoERecord.norm_gram`): norm [N, K, K] w_k w_j <o_k, o_j> / (Dl rms_t^2) and eps [N]
    eps / rms_t^2, so that the survivors' sum has rms_t' = rms_t sqrt(c^2 a^T norm a + eps)."""

    ids: torch.Tensor
    w: torch.Tensor
    gram: torch.Tensor
    scale: torch.Tensor
    norm: torch.Tensor | None = None
    eps: torch.Tensor | None = None

    def rows(self, rows: torch.Tensor) -> LayerTokens:
        """The tokens `rows` (an index or mask)."""
        pick = [None if v is None else v[rows] for v in self.fields()]
        return LayerTokens(*pick)

    def fields(self) -> tuple:
        return (self.ids, self.w, self.gram, self.scale, self.norm, self.eps)


FIELDS = ("ids", "w", "gram", "scale", "norm", "eps")


def token_error(t: LayerTokens, alive: torch.Tensor, rows: torch.Tensor | None = None):
    """err_t [n] of the tokens `rows` (all when None) with kept mask alive [E]."""
    t = t if rows is None else t.rows(rows)
    return _masked_error(t, alive[t.ids])


def objective(t: LayerTokens, kept: list[int], n_experts: int) -> float:
    """The layer objective of kept set `kept` (sum of scale * err_t)."""
    alive = torch.zeros(n_experts, dtype=torch.bool)
    alive[kept] = True
    return float((t.scale * token_error(t, alive)).sum())


def flip_deltas(t: LayerTokens, alive: torch.Tensor, err: torch.Tensor) -> torch.Tensor:
    """Objective change [E] of flipping each single expert's kept state (exact: a token routes
    to an expert at most once); err [N] the current scaled per-token errors."""
    N, K = t.ids.shape
    a = alive[t.ids]  # [N, K]
    out = torch.zeros(alive.shape[0], dtype=torch.float64)
    if t.gram.dim() == 2:  # diagonal: err = sum g - 2 c sum_S g + c^2 sum_S g, per flipped slot
        af, g = a.double(), t.gram
        sign = 1.0 - 2.0 * af  # +1 adds slot k to S, -1 removes it
        kept = (t.w * af).sum(-1, keepdim=True) + sign * t.w  # [N, K]
        s_in = (g * af).sum(-1, keepdim=True) + sign * g  # [N, K]
        c = torch.where(kept > 1e-300, t.w.sum(-1, keepdim=True) / kept.clamp(min=1e-300),
                        torch.zeros_like(kept))
        new = (g.sum(-1, keepdim=True) - 2 * c * s_in + c * c * s_in) * t.scale[:, None]
        return out.index_add_(0, t.ids.reshape(-1), (new - err[:, None]).reshape(-1))
    flips = a[:, None, :].repeat(1, K, 1) ^ torch.eye(K, dtype=torch.bool)  # [N, K(flip), K]

    def rep(v):  # [N, ...] -> [N*K, ...], each token's row once per flipped slot
        return None if v is None else v.repeat_interleave(K, dim=0)

    sub = LayerTokens(*(rep(v) for v in t.fields()))
    new = _masked_error(sub, flips.reshape(N * K, K)).view(N, K) * t.scale[:, None]  # [N, K]
    return out.index_add_(0, t.ids.reshape(-1), (new - err[:, None]).reshape(-1))


def _masked_error(t: LayerTokens, a: torch.Tensor) -> torch.Tensor:
    """err [n] for explicit slot masks a [n, K] (bool) of the rows of t: d = 1 - c rho a,
    err = d^T G d; rho = rms_t / rms_t' for a normalized routed sum, else 1."""
    a = a.double()
    total, kept = t.w.sum(-1), (t.w * a).sum(-1)
    c = torch.where(kept > 0, total / kept.clamp(min=1e-300), torch.zeros_like(kept))  # [n]
    if t.norm is not None:
        ms = c * c * torch.einsum("nk,nkj,nj->n", a, t.norm, a) + t.eps  # (rms_t' / rms_t)^2
        c = torch.where(c > 0, c / ms.clamp(min=1e-300).sqrt(), c)
    d = 1.0 - c[:, None] * a  # [n, K]
    if t.gram.dim() == 2:
        return (d * d * t.gram).sum(-1)
    return torch.einsum("nk,nkj,nj->n", d, t.gram, d)


def greedy(t: LayerTokens, n_experts: int, n: int, protected: set[int]) -> list[int]:
    """Backward elimination from all experts down to n (see the module docstring)."""
    alive = torch.ones(n_experts, dtype=torch.bool)
    fixed = torch.zeros(n_experts, dtype=torch.bool)
    fixed[list(protected)] = True
    err = t.scale * token_error(t, alive)
    for _ in range(n_experts - n):
        d = flip_deltas(t, alive, err).masked_fill(~alive | fixed, float("inf"))
        alive[int(torch.argmin(d))] = False  # argmin: the lowest id among ties
        err = t.scale * token_error(t, alive)
    return alive.nonzero().squeeze(1).tolist()


def forward(t: LayerTokens, n_experts: int, n: int, protected: set[int]) -> list[int]:
    """Forward selection from the protected experts up to n (add the expert whose addition
    lowers the objective most, ties to the lowest id)."""
    alive = torch.zeros(n_experts, dtype=torch.bool)
    alive[list(protected)] = True
    for _ in range(n - int(alive.sum())):
        err = t.scale * token_error(t, alive)
        d = flip_deltas(t, alive, err).masked_fill(alive, float("inf"))
        alive[int(torch.argmin(d))] = True
    return alive.nonzero().squeeze(1).tolist()


def improve(t: LayerTokens, n_experts: int, kept: list[int], protected: set[int]):
    """Swaps (one kept for one dropped) while one lowers the objective: each sweep ranks all
    pairs by the sum of their single-flip changes and evaluates the best SWAP_CANDIDATES
    exactly, taking the best improving one. Returns (kept, sweeps run)."""
    alive = torch.zeros(n_experts, dtype=torch.bool)
    alive[kept] = True
    fixed = torch.zeros(n_experts, dtype=torch.bool)
    fixed[list(protected)] = True
    for sweep in range(MAX_SWEEPS):
        err = t.scale * token_error(t, alive)
        value = float(err.sum())
        d = flip_deltas(t, alive, err)
        outs = (alive & ~fixed).nonzero().squeeze(1)
        ins = (~alive).nonzero().squeeze(1)
        if outs.numel() == 0 or ins.numel() == 0:
            return kept, sweep
        est = d[outs][:, None] + d[ins][None, :]  # [n_out, n_in]
        best = None
        for flat in torch.argsort(est.reshape(-1))[:SWAP_CANDIDATES].tolist():
            e, f = int(outs[flat // ins.numel()]), int(ins[flat % ins.numel()])
            trial = alive.clone()
            trial[e], trial[f] = False, True
            v = float((t.scale * token_error(t, trial)).sum())
            if v < value * (1 - 1e-12) and (best is None or v < best[0]):
                best = (v, trial)
        if best is None:
            return alive.nonzero().squeeze(1).tolist(), sweep
        alive = best[1]
    return alive.nonzero().squeeze(1).tolist(), MAX_SWEEPS


def select_layer(t: LayerTokens, n_experts: int, n: int, protected: set[int],
                 start: list[int]) -> tuple[list[int], dict]:
    """The recon kept set (sorted) of one layer and a record of the search: objective values
    of the greedy set, of `start` (the REAP plan's set) and of the result."""
    if math.comb(n_experts - len(protected), n - len(protected)) <= EXACT_LIMIT:
        kept, val = exhaustive(t, n_experts, n, protected)
        return kept, {"reap": objective(t, list(start), n_experts), "recon": val, "exact": True,
                      "tokens": int(t.ids.shape[0])}
    starts = {"greedy": greedy(t, n_experts, n, protected),
              "forward": forward(t, n_experts, n, protected), "reap": list(start)}
    rec = {k: objective(t, v, n_experts) for k, v in starts.items()}
    best, sweeps = None, 0
    for v in starts.values():  # swaps from every start; the best end wins (ties: first)
        kept, sw = improve(t, n_experts, v, protected)
        val, sweeps = objective(t, kept, n_experts), sweeps + sw
        if best is None or val < best[0]:
            best = (val, kept)
    return sorted(best[1]), {**rec, "recon": best[0], "swap_sweeps": sweeps, "exact": False,
                             "tokens": int(t.ids.shape[0])}


def exhaustive(t: LayerTokens, n_experts: int, n: int, protected: set[int]):
    """The optimal kept set by enumeration (small layers: at most EXACT_LIMIT sets); returns
    (sorted ids, objective), ties to the lexicographically first set."""
    free = [e for e in range(n_experts) if e not in protected]
    best = None
    for extra in itertools.combinations(free, n - len(protected)):
        kept = sorted([*protected, *extra])
        v = objective(t, kept, n_experts)
        if best is None or v < best[1]:
            best = (kept, v)
    return best


def recon_keep(layers, counts, tokens: dict[int, LayerTokens], n_experts, protected, start):
    """Kept ids per layer and the search record ({layer: select_layer record})."""
    kept, record = {}, {}
    for li, layer in enumerate(layers):
        if layer not in tokens:
            raise ReapError(f"recon: the calibration pass recorded no tokens for layer {layer}")
        kept[layer], record[str(layer)] = select_layer(tokens[layer], n_experts, counts[li],
                                                       protected[li], start[layer])
    return kept, record
