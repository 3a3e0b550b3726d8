"""The `Plan` record (which routed experts each MoE layer keeps) and its JSON file.

`reap.prune.plan.make_plan` builds one, `reap plan` saves it (`Plan.save`, atomic), `reap prune`
loads it (`Plan.load`). `check` is the one validation of a plan: `Plan.load` runs it on the file,
`prune` again against the model it prunes. The file is the record's fields as JSON, tagged with
`format` (FORMAT); layer keys are strings in the file and ints in the record. Format 2 added
`predictions` (what the plan keeps of each corpus, `reap.prune.predict`); format-1 plans load
with `predictions` None; format 3 added `merge` (expert merging, `reap.prune.merge_plan`):
{"method", "router", "align", "groups": {layer: [[[expert, weight], ...] per output expert]}},
group j's first member being keep[layer][j].
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from reap.errors import ReapError, is_int
from reap.fileio import write_atomic

FORMAT = "reap.plan/3"
READABLE = ("reap.plan/1", "reap.plan/2", FORMAT)  # formats `Plan.load` reads
# sources that decide what a plan and a pruned checkpoint contain: their `code_version` parts
PRUNE_CODE = ("prune", "checkpoint", "models", "sizes.py", "stats")


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
    predictions: dict | None = None  # reap.prune.predict.predict's record
    recon: dict | None = None  # --criterion recon: objective, method, per-layer search record
    merge: dict | None = None  # --method hc-smoe|m-smoe: the groups (module docstring)
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
        """Read a plan file and `check` it; a one-line ReapError if it is not a valid plan."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("format") not in READABLE:
                raise ReapError(f"{path}: format: not a reap plan ({d.get('format')!r})")
            for k in ("counts", "keep", "scores"):
                if d.get(k) is not None:
                    d[k] = {int(layer): v for layer, v in d[k].items()}
            d["format"] = FORMAT  # older formats lack predictions and merge
            plan = cls(**d)
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as e:
            raise ReapError(f"{path}: cannot read plan ({e})") from e
        check(plan, path)
        return plan


def check(plan: Plan, where: str = "plan", shape: tuple[list[int], int, int] | None = None) -> None:
    """Refuse (ReapError naming `where`, the field and the layer) a plan prune must not write:
    counts and top_k positive ints, every layer keeping between top_k and n_experts experts,
    kept ids ints (not bools or floats), unique, ascending and in range, one list per layer of
    its count. With the model's `shape` (MoE layers, n_experts, top_k; a top_k of 0 is
    unknown), the plan must be of that model: the same layers, expert count and top_k (a plan
    never changes how many experts a token is routed to)."""
    E, top_k = plan.n_experts, plan.top_k
    if not is_int(E) or E < 1:
        raise ReapError(f"{where}: n_experts: {E!r} is not a positive integer")
    if not is_int(top_k) or not 1 <= top_k <= E:
        raise ReapError(f"{where}: top_k: {top_k!r} is not an integer in [1, n_experts {E}]")
    layers = plan.layers
    if not isinstance(layers, list) or not all(is_int(la) and la >= 0 for la in layers):
        raise ReapError(f"{where}: layers: {layers!r} is not a list of layer numbers")
    if len(set(layers)) != len(layers) or not layers:
        raise ReapError(f"{where}: layers: {layers} is empty or names a layer twice")
    if shape is not None:
        _check_model(plan, where, shape)
    counts = plan.counts
    if not isinstance(counts, dict) or sorted(counts) != sorted(layers):
        raise ReapError(f"{where}: counts: not one count for each of the layers {layers}")
    for layer in layers:
        n = counts[layer]
        if not is_int(n) or not top_k <= n <= E:
            raise ReapError(f"{where}: counts: layer {layer} keeps {n!r} experts, not an integer "
                            f"in [top_k {top_k}, n_experts {E}]")
    if plan.keep is not None:
        _check_keep(plan, where)
    if plan.merge is not None:
        _check_merge(plan, where)


def _check_model(plan: Plan, where: str, shape: tuple[list[int], int, int]) -> None:
    layers, E, top_k = shape
    extra = sorted(set(plan.layers) - set(layers))
    missing = sorted(set(layers) - set(plan.layers))
    if extra:
        raise ReapError(f"{where}: layers: layer {extra[0]} is not a MoE layer of the model")
    if missing:
        raise ReapError(f"{where}: layers: the model's MoE layer {missing[0]} is missing")
    if plan.n_experts != E:
        raise ReapError(f"{where}: n_experts: {plan.n_experts}, the model has {E} per layer")
    if top_k and plan.top_k != top_k:
        raise ReapError(f"{where}: top_k: {plan.top_k}, the model routes each token to {top_k} "
                        "experts (a plan may not change num_experts_per_token)")


def _check_keep(plan: Plan, where: str) -> None:
    keep = plan.keep
    if not isinstance(keep, dict) or sorted(keep) != sorted(plan.layers):
        raise ReapError(f"{where}: keep: not one kept expert list for each of the layers")
    for layer in plan.layers:
        ids = keep[layer]
        problem = None
        if not isinstance(ids, list) or not all(is_int(e) for e in ids):
            problem = "ids must be integers"
        elif ids != sorted(set(ids)):
            problem = "ids must be unique and ascending"
        elif not all(0 <= e < plan.n_experts for e in ids):
            problem = f"ids must lie in [0, {plan.n_experts})"
        elif len(ids) != plan.counts[layer]:
            problem = f"{len(ids)} ids, the count is {plan.counts[layer]}"
        if problem:
            raise ReapError(f"{where}: keep: layer {layer}: invalid kept expert list ({problem})")


def _check_merge(plan: Plan, where: str) -> None:
    """Each layer's groups partition its experts, group j led by keep[layer][j], with finite
    non-negative weights summing to 1."""
    groups = plan.merge.get("groups") if isinstance(plan.merge, dict) else None
    if plan.keep is None or not isinstance(groups, dict) or sorted(groups) != sorted(
            str(la) for la in plan.layers):
        raise ReapError(f"{where}: merge: not one group list for each of the layers")
    for layer in plan.layers:
        try:
            gs = [[(int(e), float(w)) for e, w in g] for g in groups[str(layer)]]
            ok = sorted(e for g in gs for e, _ in g) == list(range(plan.n_experts)) and all(
                w >= 0 for g in gs for _, w in g) and all(abs(sum(w for _, w in g) - 1) < 1e-6
                                                          for g in gs)
            ok = ok and [g[0][0] for g in gs] == plan.keep[layer]
        except (TypeError, ValueError, IndexError):
            ok = False
        if not ok:
            raise ReapError(f"{where}: merge: layer {layer}: groups must hold each expert once, "
                            "group j led by keep[j], weights >= 0 summing to 1")
