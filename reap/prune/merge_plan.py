"""Expert-merging plans (`reap plan --method hc-smoe|m-smoe`): which source experts become one.

The budget gives each MoE layer's output count n as for pruning (`make_plan`); then, on the
statistics of all corpora summed (`reap calibrate --merge-stats`):
- hc-smoe (HC-SMoE, arXiv 2410.08589): each expert is represented by its mean output over the
  sampled calibration tokens, routed to it or not; average-linkage agglomerative clustering on
  Euclidean distance cut at n clusters (as the HC-SMoE and Cerebras REAP code run it);
- m-smoe (MC-SMoE, arXiv 2310.01334): the n most frequently routed experts are dominant; every
  other expert joins the dominant one whose router scores it is most similar to (cosine over all
  calibration tokens of the two experts' scores); `reap prune` aligns each member's neurons to
  the dominant expert before merging (`merge_write`).
Each group is merged by frequency-weighted averaging (routed-token counts; equal weights in a
group never routed). Router: see ROUTER_RULE. Plan.merge records the groups and weights.
"""

from __future__ import annotations

import torch

from reap.errors import ReapError
from reap.prune.criteria import order
from reap.prune.plan import load_stats, make_plan
from reap.prune.plan_file import Plan

METHODS = ("hc-smoe", "m-smoe")
ROUTER_RULE = (
    "each output expert keeps the router row (and bias) of its group's most frequently routed "
    "member (its dominant expert), so the router is the source's rows of the dominant experts; "
    "MC-SMoE, HC-SMoE and Cerebras REAP keep all router rows and point a group's rows at one "
    "shared merged expert, which keeps the expert count in the config"
)


def make_merge_plan(*, method: str, stats: list[str] | None = None, **kw) -> Plan:
    """`make_plan`'s budget and counts (criterion frequency, no protection), then the groups of
    `method` (see the module docstring); the other keywords are `make_plan`'s."""
    if method not in METHODS:
        raise ReapError(f"unknown merge method {method!r} (choose from {', '.join(METHODS)})")
    loaded = load_stats(stats or [])
    if not loaded:
        raise ReapError(f"--method {method} needs statistics from `reap calibrate --merge-stats`")
    need = "out_sum" if method == "hc-smoe" else "prob_gram"
    parts = [s for _, _, s in loaded]
    if any(getattr(s, need) is None for s in parts):
        raise ReapError(f"{loaded[0][1]}: no {need}: calibrate with --merge-stats for {method}")
    kw.update(criterion="frequency", protect=False)
    plan = make_plan(stats=stats, loaded=loaded, **kw)  # read once: merge stats are large
    count = sum(s.count.double() for s in parts)  # [L, E]
    groups = {}
    for li, layer in enumerate(plan.layers):
        n = plan.counts[layer]
        if method == "hc-smoe":
            out = sum(s.out_sum[li].double() for s in parts)  # [E, Dx]
            seen = sum(s.out_count[li] for s in parts).clamp(min=1)  # [E]
            labels = hc_labels(out / seen[:, None], n)
        else:
            dominant = sorted(order(count[li])[:n])  # the n most frequently routed
            labels = msmoe_labels(sum(s.prob_gram[li] for s in parts), dominant)
        groups[layer] = _groups(labels, count[li])
    plan.keep = {layer: [g[0][0] for g in gs] for layer, gs in groups.items()}
    plan.criterion, plan.scores, plan.protected = method, None, []
    plan.merge = {"method": method, "router": ROUTER_RULE,
                  "align": "weight-matching" if method == "m-smoe" else None,
                  "groups": {str(la): gs for la, gs in groups.items()}}
    return plan


def hc_labels(reps: torch.Tensor, n: int) -> list[int]:
    """Cluster label per expert: average-linkage agglomerative clustering of reps [E, Dx]
    (Euclidean) cut at n clusters."""
    from scipy.cluster.hierarchy import cut_tree, linkage

    if n >= reps.shape[0]:
        return list(range(reps.shape[0]))
    tree = linkage(reps.numpy(), method="average", metric="euclidean")
    return cut_tree(tree, n_clusters=n)[:, 0].tolist()


def msmoe_labels(gram: torch.Tensor, dominant: list[int]) -> list[int]:
    """Each expert's dominant expert: itself if dominant, else the dominant one of highest
    cosine similarity of router scores (gram [E, E] = sum over tokens of p p^T; ties: lowest
    id)."""
    norm = gram.diagonal().clamp(min=1e-300).sqrt()
    cos = gram / norm[:, None] / norm[None, :]  # [E, E]
    dom = torch.tensor(dominant)
    best = dom[cos[:, dom].argmax(1)]  # argmax takes the first of equal maxima
    best[dom] = dom
    return best.tolist()


def _groups(labels: list[int], count: torch.Tensor) -> list[list[list]]:
    """Groups as [[expert, weight], ...], the most frequent member first (the dominant: ties to
    the lowest id), then ascending; groups ordered by their dominant's id."""
    members: dict[int, list[int]] = {}
    for e, label in enumerate(labels):
        members.setdefault(label, []).append(e)
    out = []
    for ids in members.values():
        dom = min(ids, key=lambda e: (-float(count[e]), e))
        ids = [dom] + [e for e in ids if e != dom]
        c = count[ids].double()
        w = c / c.sum() if c.sum() > 0 else torch.full_like(c, 1 / len(ids))
        out.append([[e, float(x)] for e, x in zip(ids, w)])
    return sorted(out, key=lambda g: g[0][0])
