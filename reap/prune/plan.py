"""`make_plan`: choose the routed experts to keep in every MoE layer (`reap plan` runs it).

Scores come from calibration statistics (`reap.stats.ExpertStats`, one file per corpus) by a
criterion (`reap.prune.criteria`); corpora are combined by a weighted mean of per-layer shares
(`weights`) or by per-corpus quotas (`quota`). Budgets: `keep` N experts per layer, `ratio` R of
them, or `target_size` bytes, solved exactly with `reap.sizes.SizeModel` (the largest build that
fits; `reap.prune.budget`). `scope="uniform"` keeps the same count in every layer; `"global"` lets
the per-layer counts follow the shares, never below `min_keep` (at least top_k). Super experts are
protected by default (`criteria.PROTECT_RULE`). The result is a `reap.prune.plan_file.Plan`.
"""

from __future__ import annotations

import os

import torch

from reap.errors import ReapError, first_difference
from reap.models import family
from reap.provenance import code_version, sha256_file
from reap.prune import budget, criteria
from reap.prune.plan_file import PRUNE_CODE, Plan


def make_plan(*, stats: list[str] | None = None, config: dict | None = None,
              model: str | None = None, criterion: str = "reap", latent: bool = False,
              weights: str | None = None, quota: bool = False, keep: int | None = None,
              ratio: float | None = None, target_size: str | None = None, scope: str = "uniform",
              min_keep: int | None = None, protect: bool = True, seed: int = 0,
              arguments: dict | None = None, loaded: list | None = None) -> Plan:
    """Build a plan from statistics files and/or a config.json dict (see the module docstring).

    Without statistics, only `criterion="random"` chooses experts; otherwise the plan holds
    counts only (`keep` None), enough for a size table. `loaded`: `load_stats(stats)` already
    read by the caller.
    """
    loaded = load_stats(stats or []) if loaded is None else loaded
    size = _size_model(config)
    shape = _shape(loaded, size)
    layers, E, top_k = shape
    if model and _stats_model(loaded) not in (None, model):
        raise ReapError(f"{loaded[0][1]}: statistics of model {_stats_model(loaded)}, "
                        f"not of the given checkpoint ({model})")
    floor_ = budget.min_keep(min_keep, top_k, E)
    per_corpus, combined, wts = _scores(loaded, criterion, latent, weights, shape, seed)
    sup = criteria.super_experts(*_max_act(loaded), layers) if (protect and loaded) else []
    prot = [{e.expert for e in sup if e.layer == layer} for layer in layers]
    if scope == "global" and combined is None:
        raise ReapError("--scope global needs scores: give statistics or --criterion random")
    G = int(family(config).expert_groups(config)) if config is not None else 1
    counts = budget.layer_counts(scope, size, shape, combined, prot, floor_, keep, ratio,
                                 target_size, groups=G)
    groups = _expert_groups(config, counts, E)
    if config is not None:  # refuse now what prune would refuse (e.g. one count per config)
        family(config).with_experts(config, dict(zip(layers, counts)))
    kept = _select(layers, counts, combined, prot, per_corpus if quota else None, wts, groups)
    cmap = dict(zip(layers, counts))
    rule = "per-layer shares: score / layer total; weighted mean"  # how corpora were combined
    scores = None
    if combined is not None:
        scores = {layer: combined[li].tolist() for li, layer in enumerate(layers)}
    return Plan(
        n_experts=E, top_k=top_k, layers=layers, counts=cmap, keep=kept,
        criterion=criterion if combined is not None else None, scope=scope,
        budget=_budget(keep, ratio, target_size, floor_, size, scope, groups, counts),
        combine={"mode": "quota" if quota else "weighted", "weights": wts, "normalization": rule},
        protected=[{"layer": e.layer, "expert": e.expert, "max_act": e.max_act} for e in sup],
        protect_rule=criteria.PROTECT_RULE if (protect and loaded) else None, scores=scores,
        predicted_bytes=size.predict_bytes(cmap) if size else None,
        predicted_params=size.predict_params(cmap) if size else None,
        source_bytes=size.predict_bytes() if size else None,
        source_params=size.predict_params() if size else None,
        model=model or _stats_model(loaded), provenance=_provenance(loaded, model, arguments))


def load_stats(paths: list[str]) -> list[tuple[str, str, object]]:
    """[(corpus name, path, ExpertStats)]; all from one model and layer set. A directory (a
    calibration output) stands for its per-corpus files."""
    from reap.stats import ExpertStats, expand_paths

    out = []
    for p in expand_paths(paths)[0]:
        s = ExpertStats.load(p)
        name = str(s.meta.get("corpus") or os.path.splitext(os.path.basename(p))[0])
        if any(name == n for n, _, _ in out):
            raise ReapError(f"{p}: corpus {name!r} given twice")
        if out:
            a = out[0][2]
            if (s.layers, s.n_experts, s.top_k) != (a.layers, a.n_experts, a.top_k):
                raise ReapError(f"{p}: statistics of a different model or layer set than "
                                f"{out[0][1]}")
            if s.meta.get("model") != a.meta.get("model"):
                raise ReapError(f"{p}: statistics of a different model fingerprint than "
                                f"{out[0][1]}")
        out.append((name, p, s))
    return out


def _shape(loaded, size) -> tuple[list[int], int, int]:
    """(MoE layers, n_experts, top_k) from the statistics, checked against the size model."""
    if loaded:
        s = loaded[0][2]
        shape = (list(s.layers), s.n_experts, s.top_k)
        if size and shape != (size.moe_layers, size.n_experts, size.top_k):
            same = shape[0] == list(size.moe_layers)
            layers = "" if same else f"; MoE {first_difference(shape[0], size.moe_layers)}"
            raise ReapError(f"{loaded[0][1]}: statistics ({s.n_experts} experts, top-{s.top_k}) "
                            f"do not match the model config ({size.n_experts} experts, "
                            f"top-{size.top_k}{layers})")
        return shape
    if size is None:
        raise ReapError("nothing to plan from: give statistics files and/or --model/--config")
    return list(size.moe_layers), size.n_experts, size.top_k


def _size_model(config):
    if config is None:
        return None
    from reap.sizes import SizeModel

    return SizeModel.from_config(config)


def _scores(loaded, criterion, latent, weights, shape, seed):
    """(per-corpus scores {c: [L, E]}, combined shares [L, E] or None, weights)."""
    layers, E, _ = shape
    names = [n for n, _, _ in loaded]
    wts = criteria.parse_weights(weights, names) if loaded else {}
    if criterion not in criteria.CRITERIA:
        choices = ", ".join(criteria.CRITERIA)
        raise ReapError(f"unknown criterion {criterion!r} (choose from {choices})")
    if criterion == "random":
        r = criteria.random_scores(len(layers), E, seed)
        return {n: r for n in names}, criteria.shares(r), wts
    if not loaded:
        return {}, None, wts
    per = {n: criteria.scores(s, criterion, latent) for n, _, s in loaded}
    return per, criteria.combine(per, wts), wts


def _budget(keep, ratio, target_size, floor_, size, scope, groups, counts) -> dict:
    """The budget record, with a note when grouped routing rounded a target-size count."""
    b = budget.budget_record(keep, ratio, target_size, floor_)
    if target_size is not None and scope == "uniform" and groups > 1:
        note = budget.rounding_note(size, target_size, groups, counts[0])
        if note:
            b["note"] = note
    return b


def _expert_groups(config: dict | None, counts: list[int], E: int) -> int:
    """How many routing groups the family splits a layer's experts into (DeepSeek-V3's n_group):
    grouped top-k routes exactly as before only if every group keeps the same number, so each
    layer's count must be a multiple of it (ReapError otherwise)."""
    if config is None:
        return 1
    G = int(family(config).expert_groups(config))
    bad = sorted({n for n in counts if n % G})
    if G > 1 and (E % G or bad):
        raise ReapError(f"the model routes its {E} experts in {G} groups: keep a multiple of "
                        f"{G} per layer so each group keeps as many (not {bad[0] if bad else E})")
    return G


def _select(layers, counts, combined, prot, quota_scores, wts,
            groups: int = 1) -> dict[int, list[int]] | None:
    """Kept ids per layer: protected, then quotas (if any), then the combined score; with
    `groups` > 1, chosen that way within each group of consecutive ids, count / groups each."""
    if combined is None:
        return None
    kept = {}
    for li, layer in enumerate(layers):
        E, ids = combined.shape[1], []
        size = E // groups
        for g in range(groups):
            lo, hi = g * size, (g + 1) * size  # group g holds ids lo..hi-1
            q = None
            if quota_scores:
                q = {c: (wts[c], s[li][lo:hi]) for c, s in quota_scores.items()}
            p = {e - lo for e in prot[li] if lo <= e < hi}
            chosen = criteria.select_layer(counts[li] // groups, combined[li][lo:hi], p, q)
            ids += [lo + e for e in chosen]
        kept[layer] = ids
    return kept


def _max_act(loaded):
    """Model-wide max activation and routed counts [L, E] over all corpora."""
    max_act = torch.stack([s.max_act.float() for _, _, s in loaded]).amax(0)
    count = torch.stack([s.count for _, _, s in loaded]).sum(0)
    return max_act, count


def _stats_model(loaded) -> str | None:
    return loaded[0][2].meta.get("model") if loaded else None


def _provenance(loaded, model, arguments) -> dict:
    stats = [{"corpus": n, "path": os.path.abspath(p), "sha256": sha256_file(p), "meta": s.meta}
             for n, p, s in loaded]
    return {"stats": stats, "model": model, "arguments": arguments or {},
            "code_version": code_version(PRUNE_CODE)}
