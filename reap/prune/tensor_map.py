"""The tensors of a pruned checkpoint, in write order, each mapped to its source tensor.

`plan_items` lists the output tensors (`Item`) in the source's file order (an expert's tensors
together, in the family's name order): kept routed experts renumbered densely in ascending
original id (kind "expert"); a fused expert tensor X [E, ...] (the family names its experts by
views `X[e]`) keeps its name and holds the kept slices in new id order, [n_kept, ...] (kind
"fused"); the router tensors the family names (`router_tensors`) sliced to the kept rows (kind
"router"); every other tensor verbatim (kind "copy"). Tensors of components the text model never
reads (`unused_tensors`: UNUSED_COMPONENTS, e.g. an MTP layer) are left out. `reap.prune.verify`
shares `fused_tensors` and `unused_tensors` but maps the tensors again on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from reap.errors import ReapError, first_difference
from reap.prune.plan_file import Plan


@dataclass
class Item:
    """One output tensor: where it comes from and how (kind: copy | router | expert | fused)."""

    source: str  # tensor name in the source checkpoint
    spec: object  # reap.checkpoint.TensorSpec of the output tensor
    kind: str
    axis: int = 0  # router: the expert axis
    rows: list[int] | None = None  # router, fused: kept original ids, ascending
    expert: tuple[int, int] | None = None  # expert: (layer, new id)


def unused_tensors(fam, config: dict) -> set[str]:
    """Names the family's layout tags with a component the text model never reads
    (UNUSED_COMPONENTS): a pruned checkpoint leaves them out."""
    from reap.checkpoint.spec import UNUSED_COMPONENTS

    return {s.name for s in fam.layout(config) if s.component in UNUSED_COMPONENTS}


def plan_items(ck, fam, plan: Plan,
               dropped: set[str] | None = None) -> tuple[list[Item], dict[int, list[int]]]:
    """Output tensors in write order and, per MoE layer, the original id of each new id;
    `dropped` (default: `unused_tensors`) are left out."""
    from reap.checkpoint import TensorSpec

    cfg = fam.Config.from_dict(ck.config)
    dropped = unused_tensors(fam, ck.config) if dropped is None else dropped
    new_ids = {layer: {e: j for j, e in enumerate(ids)} for layer, ids in plan.keep.items()}
    fused = fused_tensors(fam, cfg, plan.layers)
    if fused and plan.merge:
        raise ReapError(f"{ck.path}: merging experts stored in fused tensors is not supported")
    found = _experts_found(ck, fam, plan, fused, dropped)
    routers = {}
    for layer in plan.layers:
        for name, axis in fam.router_tensors(cfg, layer).items():
            routers[name] = (axis, plan.keep[layer])
    items, seen = [], set()
    for info in sorted(ck.tensors.values(), key=lambda t: (t.file, t.start)):
        if info.name in dropped:
            continue
        comp = "vision" if ck.prefix and not info.key.startswith(ck.prefix) else "other"
        key = fam.expert_key(info.name)
        if info.name in fused:
            layer = fused[info.name]
            rows = plan.keep[layer]
            shape = (len(rows), *info.shape[1:])
            spec = TensorSpec(info.name, info.dtype, shape, "routed_experts", layer)
            items.append(Item(info.name, spec, "fused", 0, rows))
        elif key is None and info.name in routers:
            axis, rows = routers.pop(info.name)
            shape = _sliced_shape(info, axis, len(rows), plan.n_experts)
            spec = TensorSpec(info.name, info.dtype, shape, "router", None, None)
            items.append(Item(info.name, spec, "router", axis, rows))
        elif key is None:
            spec = TensorSpec(info.name, info.dtype, info.shape, comp)
            items.append(Item(info.name, spec, "copy"))
        elif key in seen or key[1] not in new_ids.get(key[0], {}):
            continue  # a dropped expert, or one already emitted with its first tensor
        else:
            seen.add(key)
            items += _expert_items(ck, fam, cfg, key, new_ids[key[0]][key[1]], found[key])
    if routers:
        raise ReapError(f"{ck.path}: router tensor {next(iter(routers))} is missing")
    return items, {layer: list(ids) for layer, ids in plan.keep.items()}


def fused_tensors(fam, cfg, layers) -> dict[str, int]:
    """Stored fused expert tensor -> its layer: the tensors X behind the views `X[e]` that the
    family's `expert_tensor_names` use for these layers (empty for per-expert layouts)."""
    from reap.checkpoint import split_view

    out = {}
    for layer in layers:
        for name in fam.expert_tensor_names(cfg, layer, 0):
            base, index = split_view(name)
            if index is not None:
                out[base] = layer
    return out


def _experts_found(ck, fam, plan: Plan, fused: dict[str, int],
                   dropped: set[str]) -> dict[tuple[int, int], set[str]]:
    """(layer, expert) -> its tensor names (views of fused tensors included); checks the
    experts match the plan's model."""
    from reap.checkpoint import view_name

    found: dict[tuple[int, int], set[str]] = {}
    for name in ck.tensors:
        key = None if name in dropped else fam.expert_key(name)
        if key is not None:
            found.setdefault(key, set()).add(name)
        elif name in fused and ck.tensors[name].shape:
            for e in range(ck.tensors[name].shape[0]):  # [E, ...]: one view per expert
                found.setdefault((fused[name], e), set()).add(view_name(name, e))
    layers = sorted({layer for layer, _ in found})
    if layers != sorted(plan.layers):
        raise ReapError(f"{ck.path}: the checkpoint's routed-expert layers and the plan's disagree "
                        f"({first_difference(layers, sorted(plan.layers))})")
    for layer in layers:
        n = 1 + max(e for la, e in found if la == layer)
        if n != plan.n_experts:
            raise ReapError(f"{ck.path}: layer {layer} has {n} routed experts, the plan "
                            f"{plan.n_experts}")
    return found


def _expert_items(ck, fam, cfg, key: tuple[int, int], new: int, present: set[str]) -> list[Item]:
    from reap.checkpoint import TensorSpec

    layer, e = key
    old_names = fam.expert_tensor_names(cfg, layer, e)
    missing = [n for n in old_names if n not in ck.tensors]
    if missing:
        raise ReapError(f"{ck.path}: expert tensor {missing[0]} is missing")
    extra = sorted(present - set(old_names))
    if extra:
        raise ReapError(f"{ck.path}: tensor {extra[0]} is not one of its expert's tensors")
    out = []
    for old, name in zip(old_names, fam.expert_tensor_names(cfg, layer, new)):
        info = ck.tensors[old]
        spec = TensorSpec(name, info.dtype, info.shape, "routed_experts", layer, new)
        out.append(Item(old, spec, "expert", expert=(layer, new)))
    return out


def _sliced_shape(info, axis: int, n: int, n_experts: int) -> tuple[int, ...]:
    if axis >= len(info.shape) or info.shape[axis] != n_experts:
        raise ReapError(f"router tensor {info.name}: shape {info.shape} has no axis {axis} of "
                        f"{n_experts} experts")
    return tuple(n if i == axis else s for i, s in enumerate(info.shape))
