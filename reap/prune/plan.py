"""`reap plan`: choose the routed experts to keep in every MoE layer.

    reap plan zh.safetensors code.safetensors --model DIR --target-size 350GB --out plan.json
    reap plan --config k3-full --target-size 350GB --dry-run      # counts only, no statistics

Scores come from calibration statistics (`reap.stats.ExpertStats`, one file per corpus) by a
criterion (`reap.prune.criteria`); corpora are combined by a weighted mean of per-layer shares
(`--weights`) or by per-corpus quotas (`--quota`). Budgets: `--keep N` experts per layer,
`--ratio R` of them, or `--target-size` bytes, solved exactly with `reap.sizes.SizeModel` (the
largest build that fits). `--scope uniform` keeps the same count in every layer; `global` lets the
per-layer counts follow the shares, never below `--min-keep` (at least top_k). Super experts are
protected by default (`criteria.PROTECT_RULE`). The plan is a `Plan` saved as JSON atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from reap.errors import ReapError
from reap.fileio import write_atomic
from reap.models import family
from reap.provenance import code_version as _code_version
from reap.prune import budget as B
from reap.prune import criteria as C

FORMAT = "reap.plan/1"


@dataclass
class Plan:
    """Which experts to keep. `keep[layer]` = kept original expert ids, ascending (None in a
    counts-only plan made from a config alone); `scores[layer]` = combined score per expert [E];
    bytes and parameters are predictions for the pruned checkpoint (None without a config)."""

    n_experts: int
    top_k: int
    layers: list[int]
    counts: dict[int, int]
    keep: dict[int, list[int]] | None = None
    criterion: str | None = None
    scope: str = "uniform"
    budget: dict = field(default_factory=dict)
    combine: dict = field(default_factory=dict)
    protected: list[dict] = field(default_factory=list)
    protect_rule: str | None = None
    scores: dict[int, list[float]] | None = None
    predicted_bytes: int | None = None
    predicted_params: int | None = None
    source_bytes: int | None = None
    source_params: int | None = None
    model: str | None = None  # source checkpoint fingerprint, when known
    provenance: dict = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("counts", "keep", "scores"):
            if d[k] is not None:
                d[k] = {str(layer): v for layer, v in d[k].items()}
        return d

    def save(self, path: str | os.PathLike) -> str:
        """Write the plan as JSON atomically (temp file, then rename); returns the path."""
        return write_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read and check a plan file; a one-line ReapError if it is not a valid plan."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("format") != FORMAT:
                raise ReapError(f"{path}: not a reap plan (format {d.get('format')!r})")
            for k in ("counts", "keep", "scores"):
                if d.get(k) is not None:
                    d[k] = {int(layer): v for layer, v in d[k].items()}
            plan = cls(**d)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ReapError(f"{path}: cannot read plan ({e})") from e
        plan.check(path)
        return plan

    def check(self, where: str = "plan") -> None:
        """Kept ids sorted, unique, in range, at least top_k per layer, matching counts."""
        if self.keep is None:
            return
        if sorted(self.keep) != sorted(self.layers):
            raise ReapError(
                f"{where}: kept experts given for layers {sorted(self.keep)}, "
                f"plan layers are {self.layers}"
            )
        for layer, ids in self.keep.items():
            ok = ids == sorted(set(ids)) and all(0 <= e < self.n_experts for e in ids)
            if not ok or len(ids) != self.counts.get(layer) or len(ids) < self.top_k:
                raise ReapError(f"{where}: layer {layer}: invalid kept expert list")


def make_plan(
    *,
    stats: list[str] | None = None,
    config: dict | None = None,
    model: str | None = None,
    criterion: str = "reap",
    latent: bool = False,
    weights: str | None = None,
    quota: bool = False,
    keep: int | None = None,
    ratio: float | None = None,
    target_size: str | None = None,
    scope: str = "uniform",
    min_keep: int | None = None,
    protect: bool = True,
    seed: int = 0,
    arguments: dict | None = None,
) -> Plan:
    """Build a plan from statistics files and/or a config.json dict (see the module docstring).

    Without statistics, only `criterion="random"` chooses experts; otherwise the plan holds
    counts only (`keep` None), enough for a size table.
    """
    loaded = _load_stats(stats or [])
    size = _size_model(config)
    shape = _shape(loaded, size)
    layers, E, top_k = shape
    if model and _stats_model(loaded) not in (None, model):
        raise ReapError(
            f"{loaded[0][1]}: statistics of model {_stats_model(loaded)}, "
            f"not of the given checkpoint ({model})"
        )
    floor_ = B.min_keep(min_keep, top_k, E)
    per_corpus, combined, wts = _scores(loaded, criterion, latent, weights, shape, seed)
    sup = C.super_experts(*_max_act(loaded), layers) if (protect and loaded) else []
    prot = [{e.expert for e in sup if e.layer == layer} for layer in layers]
    if scope == "global" and combined is None:
        raise ReapError("--scope global needs scores: give statistics or --criterion random")
    counts = B.layer_counts(scope, size, shape, combined, prot, floor_, keep, ratio, target_size)
    groups = _expert_groups(config, counts, E)
    if config is not None:  # refuse now what prune would refuse (e.g. one count per config)
        family(config).with_experts(config, dict(zip(layers, counts)))
    kept = _select(layers, counts, combined, prot, per_corpus if quota else None, wts, groups)
    cmap = dict(zip(layers, counts))
    return Plan(
        n_experts=E,
        top_k=top_k,
        layers=layers,
        counts=cmap,
        keep=kept,
        criterion=criterion if combined is not None else None,
        scope=scope,
        budget=B.budget_record(keep, ratio, target_size, floor_),
        combine={
            "mode": "quota" if quota else "weighted",
            "weights": wts,
            "normalization": "per-layer shares: score / layer total; weighted mean",
        },
        protected=[{"layer": e.layer, "expert": e.expert, "max_act": e.max_act} for e in sup],
        protect_rule=C.PROTECT_RULE if (protect and loaded) else None,
        scores={layer: combined[li].tolist() for li, layer in enumerate(layers)}
        if combined is not None
        else None,
        predicted_bytes=size.predict_bytes(cmap) if size else None,
        predicted_params=size.predict_params(cmap) if size else None,
        source_bytes=size.predict_bytes() if size else None,
        source_params=size.predict_params() if size else None,
        model=model or _stats_model(loaded),
        provenance=_provenance(loaded, model, arguments),
    )


def _load_stats(paths: list[str]) -> list[tuple[str, str, object]]:
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
                raise ReapError(
                    f"{p}: statistics of a different model or layer set than {out[0][1]}"
                )
            if s.meta.get("model") != a.meta.get("model"):
                raise ReapError(
                    f"{p}: statistics of a different model fingerprint than {out[0][1]}"
                )
        out.append((name, p, s))
    return out


def _shape(loaded, size) -> tuple[list[int], int, int]:
    """(MoE layers, n_experts, top_k) from the statistics, checked against the size model."""
    if loaded:
        s = loaded[0][2]
        shape = (list(s.layers), s.n_experts, s.top_k)
        if size and shape != (size.moe_layers, size.n_experts, size.top_k):
            raise ReapError(
                f"{loaded[0][1]}: statistics (layers {s.layers[:3]}..., "
                f"{s.n_experts} experts, top-{s.top_k}) do not match the model "
                f"config ({size.n_experts} experts, top-{size.top_k})"
            )
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
    wts = C.parse_weights(weights, names) if loaded else {}
    if criterion not in C.CRITERIA:
        raise ReapError(f"unknown criterion {criterion!r} (choose from {', '.join(C.CRITERIA)})")
    if criterion == "random":
        r = C.random_scores(len(layers), E, seed)
        return {n: r for n in names}, C.shares(r), wts
    if not loaded:
        return {}, None, wts
    per = {n: C.scores(s, criterion, latent) for n, _, s in loaded}
    return per, C.combine(per, wts), wts


def _expert_groups(config: dict | None, counts: list[int], E: int) -> int:
    """How many routing groups the family splits a layer's experts into (DeepSeek-V3's n_group):
    grouped top-k routes exactly as before only if every group keeps the same number, so each
    layer's count must be a multiple of it (ReapError otherwise)."""
    if config is None:
        return 1
    hook = getattr(family(config), "expert_groups", None)
    G = int(hook(config)) if hook else 1
    bad = sorted({n for n in counts if n % G})
    if G > 1 and (E % G or bad):
        raise ReapError(
            f"the model routes its {E} experts in {G} groups: keep a multiple of {G} per layer "
            f"so each group keeps as many (not {bad[0] if bad else E})"
        )
    return G


def _select(
    layers, counts, combined, prot, quota_scores, wts, groups: int = 1
) -> dict[int, list[int]] | None:
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
            ids += [lo + e for e in C.select_layer(counts[li] // groups, combined[li][lo:hi], p, q)]
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
    return {
        "stats": [
            {"corpus": n, "path": os.path.abspath(p), "sha256": _sha256_file(p), "meta": s.meta}
            for n, p, s in loaded
        ],
        "model": model,
        "arguments": arguments or {},
        "code_version": code_version(),
    }


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def code_version() -> str:
    """Digest of the sources that decide what a plan and a pruned checkpoint contain."""
    return _code_version(("prune", "checkpoint", "models", "sizes.py", "stats.py"))


def size_table(plan: Plan) -> str:
    """Human-readable per-layer counts and predicted sizes of a plan."""
    from reap.sizes import fmt_bytes, fmt_params

    rows, start = [], 0
    layers = plan.layers
    for i in range(1, len(layers) + 1):
        if i == len(layers) or plan.counts[layers[i]] != plan.counts[layers[start]]:
            n = plan.counts[layers[start]]
            span = f"{layers[start]}-{layers[i - 1]}" if i - 1 > start else f"{layers[start]}"
            rows.append(
                f"  layers {span:<10} keep {n:>5}/{plan.n_experts} ({n / plan.n_experts:6.1%})"
            )
            start = i
    total = sum(plan.counts.values())
    budget = ", ".join(f"{k} {v}" for k, v in plan.budget.items() if k != "target_bytes")
    head = (
        f"plan: {plan.scope} scope, criterion {plan.criterion or '(counts only)'}, budget: {budget}"
    )
    kept = (
        f"  experts kept: {total:,} of {plan.n_experts * len(layers):,} "
        f"({total / max(plan.n_experts * len(layers), 1):.1%}); "
        f"protected: {len(plan.protected)}"
    )
    out = [head, *rows, kept]
    if plan.predicted_bytes is not None:
        out.append(
            f"  predicted: {fmt_bytes(plan.predicted_bytes)} "
            f"({fmt_params(plan.predicted_params)} params) from "
            f"{fmt_bytes(plan.source_bytes)} ({fmt_params(plan.source_params)} params), "
            f"{plan.predicted_bytes / plan.source_bytes:.1%}"
        )
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "stats",
        nargs="*",
        metavar="STATS",
        help="statistics files from `reap calibrate`, one per corpus",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        help="source checkpoint (config, sizes and fingerprint; default: "
        "the checkpoint the statistics were calibrated on, if still there)",
    )
    src.add_argument("--config", help="built-in config (k3-tiny, k3-small, k3-full) or checkpoint")
    p.add_argument("--layers", type=int, help="with a built-in --config: its first N layers")
    p.add_argument("--out", help="plan JSON to write")
    p.add_argument("--dry-run", action="store_true", help="print the size table, write nothing")
    p.add_argument("--criterion", default="reap", choices=C.CRITERIA)
    p.add_argument(
        "--latent",
        action="store_true",
        help="reap/ean: expert output norms in the latent space, not model space",
    )
    p.add_argument("--weights", help="corpus weights, e.g. zh=3,code=1 (default: equal)")
    p.add_argument(
        "--quota",
        action="store_true",
        help="each corpus keeps its top experts for its weight's share of the budget",
    )
    b = p.add_mutually_exclusive_group()
    b.add_argument("--keep", type=int, help="experts to keep per layer (on average if global)")
    b.add_argument("--ratio", type=float, help="fraction of experts to keep")
    b.add_argument("--target-size", help="largest checkpoint that fits, e.g. 350GB, 64GiB")
    p.add_argument("--scope", default="uniform", choices=("uniform", "global"))
    p.add_argument("--min-keep", type=int, help="global scope: least experts per layer (>= top_k)")
    p.add_argument("--no-protect", action="store_true", help="do not protect super experts")
    p.add_argument("--seed", type=int, default=0, help="seed of --criterion random")


def run(args: argparse.Namespace) -> int:
    config, model = None, None
    if args.model or args.config:
        from reap.sizes import resolve_config

        config, path = resolve_config(args.model or args.config, args.layers)
        model = _fingerprint(path) if path else None
    elif args.stats:
        config, model = _calibrated_model(args.stats[0])
    if not args.dry_run and not args.out:
        raise ReapError("give --out plan.json (or --dry-run)")
    arguments = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    plan = make_plan(
        stats=args.stats,
        config=config,
        model=model,
        criterion=args.criterion,
        latent=args.latent,
        weights=args.weights,
        quota=args.quota,
        keep=args.keep,
        ratio=args.ratio,
        target_size=args.target_size,
        scope=args.scope,
        min_keep=args.min_keep,
        protect=not args.no_protect,
        seed=args.seed,
        arguments=arguments,
    )
    print(size_table(plan))
    if args.dry_run:
        return 0
    if plan.keep is None:
        raise ReapError(
            "without statistics a plan has counts only: give statistics files, "
            "--criterion random, or --dry-run"
        )
    print(plan.save(args.out), file=sys.stderr)
    return 0


def _calibrated_model(stats_path: str) -> tuple[dict | None, str | None]:
    """The config of the checkpoint a statistics file was calibrated on, when that checkpoint
    is still where calibration found it with the same fingerprint; else (None, None)."""
    from reap.checkpoint import Checkpoint
    from reap.stats import ExpertStats, expand_paths

    files = expand_paths([stats_path])[0]
    if not files:
        raise ReapError(f"{stats_path}: no statistics files")
    meta = ExpertStats.load(files[0]).meta
    path = (meta.get("arguments") or {}).get("model")
    if not path or not os.path.exists(path):
        return None, None
    try:
        with Checkpoint.open(path) as ck:
            if ck.config and ck.fingerprint() == meta.get("model"):
                return ck.config, meta["model"]
    except ReapError:
        pass
    return None, None


def _fingerprint(path: str) -> str:
    from reap.checkpoint import Checkpoint

    with Checkpoint.open(path) as ck:
        return ck.fingerprint()
