"""`reap prune`: write a pruned checkpoint from a plan, streaming tensor by tensor.

    reap prune MODEL --plan plan.json --out DIR

Kept routed experts are copied byte for byte and renumbered densely in ascending original id;
a fused expert tensor X [E, ...] (the family names its experts by views `X[e]`) keeps its name and
holds the kept slices in new id order, [n_kept, ...]; the router tensors the family names
(`router_tensors`) are sliced to the kept rows; tensors of components the text model never reads
(UNUSED_COMPONENTS, e.g. an MTP layer) are left out; every other tensor is copied verbatim;
config.json gets the new expert count (`with_experts`, which also says what was left out).
Tensors keep the source's file order (an expert's tensors stay together, in the family's name
order), shards are at most as large as the source's largest unless `--max-shard-size` is given.

Memory is bounded by the largest single tensor (one tensor, or one expert, in flight; a fused
tensor is assembled slice by slice). Output is
atomic and resumable through `CheckpointWriter`: a rerun with the same arguments after a crash or
Ctrl-C skips the completed shards. Next to the weights: `reap_manifest.json` (per layer the
original id of every new expert id, and sha256 of every kept expert's bytes, provenance),
`reap_plan.json` (the plan), and every non-weight file of the source (tokenizer, ...).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from reap.errors import ReapError
from reap.prune.plan import Plan, code_version

MANIFEST = "reap_manifest.json"
PLAN_COPY = "reap_plan.json"
MANIFEST_FORMAT = "reap.prune_manifest/1"
HASH_RULE = (
    "sha256 over the stored bytes of the expert's tensors, concatenated in the order "
    "of the family's expert_tensor_names"
)
_WEIGHT_FILES = {"config.json", "model.safetensors.index.json", MANIFEST, PLAN_COPY}
DROPPED_NOTE = (
    "tensors the family's layout tags as never read by the text model (UNUSED_COMPONENTS, e.g. "
    "an MTP layer, whose experts were neither calibrated nor pruned) are left out"
)


@dataclass
class Item:
    """One output tensor: where it comes from and how (kind: copy | router | expert | fused)."""

    source: str  # tensor name in the source checkpoint
    spec: object  # reap.checkpoint.TensorSpec of the output tensor
    kind: str
    axis: int = 0  # router: the expert axis
    rows: list[int] | None = None  # router, fused: kept original ids, ascending
    expert: tuple[int, int] | None = None  # expert: (layer, new id)


@dataclass
class PruneResult:
    """What `prune` wrote: the directory, its tensor bytes and counts."""

    out: str
    tensors: int
    file_bytes: int  # size of all .safetensors files written
    predicted_bytes: int | None
    kept_experts: int
    resumed_tensors: int
    seconds: float


def prune(
    *,
    model: str,
    plan: str | Plan,
    out: str,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    progress: bool = False,
    arguments: dict | None = None,
) -> PruneResult:
    """Write the pruned checkpoint of `model` under `plan` to `out` (see the module docstring)."""
    from reap.checkpoint import Checkpoint, CheckpointWriter
    from reap.models import family

    t0 = time.perf_counter()
    plan = Plan.load(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if plan.keep is None:
        raise ReapError("the plan holds counts only (no kept experts): make it from statistics")
    with Checkpoint.open(model) as ck:
        if not ck.config:
            raise ReapError(f"{model}: no config.json next to the weights")
        fam = family(ck.config)
        config = _pruned_config(fam, ck.config, plan)
        _check_model(ck, plan)
        dropped = unused_tensors(fam, ck.config)
        items, new_ids = plan_items(ck, fam, plan, dropped)
        specs = [it.spec for it in items]
        limit = max_shard_bytes or _largest_shard(ck)
        writer = CheckpointWriter(out, specs, limit, prefix=ck.prefix, overwrite=overwrite)
        hashes, resumed = _stream(ck, fam, writer, items, progress, new_ids)
        manifest = _manifest(ck, plan, new_ids, hashes, arguments)
        if dropped:
            manifest["dropped"] = {"tensors": len(dropped), "note": DROPPED_NOTE}
        extra = {
            MANIFEST: json.dumps(manifest, indent=1),
            PLAN_COPY: json.dumps(plan.to_json(), indent=1),
            **_other_files(ck),
        }
        path = writer.close(config, extra)
    files = [p for p in Path(path).iterdir() if p.suffix == ".safetensors"]
    return PruneResult(
        path,
        len(items),
        sum(p.stat().st_size for p in files),
        plan.predicted_bytes,
        sum(len(v) for v in plan.keep.values()),
        resumed,
        time.perf_counter() - t0,
    )


def _pruned_config(fam, config: dict, plan: Plan) -> dict:
    counts = set(plan.counts.values())
    if len(counts) == 1:
        return fam.with_experts(config, counts.pop())
    return fam.with_experts(config, {int(k): v for k, v in plan.counts.items()})


def _check_model(ck, plan: Plan) -> None:
    fp = ck.fingerprint()
    if plan.model and plan.model != fp:
        raise ReapError(
            f"the plan was made for model {plan.model[:16]}..., not {ck.path} ({fp[:16]}...)"
        )


def unused_tensors(fam, config: dict) -> set[str]:
    """Names the family's layout tags with a component the text model never reads
    (UNUSED_COMPONENTS): a pruned checkpoint leaves them out."""
    from reap.checkpoint.spec import UNUSED_COMPONENTS

    return {s.name for s in fam.layout(config) if s.component in UNUSED_COMPONENTS}


def plan_items(
    ck, fam, plan: Plan, dropped: set[str] | None = None
) -> tuple[list[Item], dict[int, list[int]]]:
    """Output tensors in write order and, per MoE layer, the original id of each new id;
    `dropped` (default: `unused_tensors`) are left out."""
    from reap.checkpoint import TensorSpec

    cfg = fam.Config.from_dict(ck.config)
    dropped = unused_tensors(fam, ck.config) if dropped is None else dropped
    new_ids = {layer: {e: j for j, e in enumerate(ids)} for layer, ids in plan.keep.items()}
    fused = fused_tensors(fam, plan.layers)
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
            rows = plan.keep[fused[info.name]]
            spec = TensorSpec(
                info.name,
                info.dtype,
                (len(rows), *info.shape[1:]),
                "routed_experts",
                fused[info.name],
            )
            items.append(Item(info.name, spec, "fused", 0, rows))
        elif key is None and info.name in routers:
            axis, rows = routers.pop(info.name)
            shape = _sliced_shape(info, axis, len(rows), plan.n_experts)
            spec = TensorSpec(info.name, info.dtype, shape, "router", None, None)
            items.append(Item(info.name, spec, "router", axis, rows))
        elif key is None:
            items.append(
                Item(info.name, TensorSpec(info.name, info.dtype, info.shape, comp), "copy")
            )
        elif key in seen or key[1] not in new_ids.get(key[0], {}):
            continue  # a dropped expert, or one already emitted with its first tensor
        else:
            seen.add(key)
            items += _expert_items(ck, fam, key, new_ids[key[0]][key[1]], found[key])
    if routers:
        raise ReapError(f"{ck.path}: router tensor {next(iter(routers))} is missing")
    return items, {layer: list(ids) for layer, ids in plan.keep.items()}


def fused_tensors(fam, layers) -> dict[str, int]:
    """Stored fused expert tensor -> its layer: the tensors X behind the views `X[e]` that the
    family's `expert_tensor_names` use for these layers (empty for per-expert layouts)."""
    from reap.checkpoint import split_view

    out = {}
    for layer in layers:
        for name in fam.expert_tensor_names(layer, 0):
            base, index = split_view(name)
            if index is not None:
                out[base] = layer
    return out


def _experts_found(
    ck, fam, plan: Plan, fused: dict[str, int], dropped: set[str]
) -> dict[tuple[int, int], set[str]]:
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
        raise ReapError(
            f"{ck.path}: routed experts in layers {layers[:4]}..., the plan has "
            f"layers {plan.layers[:4]}..."
        )
    for layer in layers:
        n = 1 + max(e for la, e in found if la == layer)
        if n != plan.n_experts:
            raise ReapError(
                f"{ck.path}: layer {layer} has {n} routed experts, the plan {plan.n_experts}"
            )
    return found


def _expert_items(ck, fam, key: tuple[int, int], new: int, present: set[str]) -> list[Item]:
    from reap.checkpoint import TensorSpec

    layer, e = key
    old_names = fam.expert_tensor_names(layer, e)
    missing = [n for n in old_names if n not in ck.tensors]
    if missing:
        raise ReapError(f"{ck.path}: expert tensor {missing[0]} is missing")
    extra = sorted(present - set(old_names))
    if extra:
        raise ReapError(f"{ck.path}: tensor {extra[0]} is not one of its expert's tensors")
    out = []
    for old, name in zip(old_names, fam.expert_tensor_names(layer, new)):
        info = ck.tensors[old]
        spec = TensorSpec(name, info.dtype, info.shape, "routed_experts", layer, new)
        out.append(Item(old, spec, "expert", expert=(layer, new)))
    return out


def _sliced_shape(info, axis: int, n: int, n_experts: int) -> tuple[int, ...]:
    if axis >= len(info.shape) or info.shape[axis] != n_experts:
        raise ReapError(
            f"router tensor {info.name}: shape {info.shape} has no axis {axis} of "
            f"{n_experts} experts"
        )
    return tuple(n if i == axis else s for i, s in enumerate(info.shape))


def _largest_shard(ck) -> int:
    per_file: dict[str, int] = {}
    for t in ck.tensors.values():
        per_file[t.file] = per_file.get(t.file, 0) + t.nbytes
    return max(per_file.values(), default=1)


class _Hasher:
    """sha256 of each kept expert on a worker thread, overlapping the copy (hashlib releases the
    GIL); at most one expert waits to be hashed while the next is copied, so memory stays small."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="reap-sha256")
        self.pending = None
        self.hashes: dict[tuple[int, int], str] = {}

    def submit(self, key: tuple[int, int], tensors: list[torch.Tensor]) -> None:
        self._collect()
        self.pending = (key, self.pool.submit(_sha256, tensors))

    def _collect(self) -> None:
        if self.pending is not None:
            key, fut = self.pending
            self.hashes[key] = fut.result()
            self.pending = None

    def close(self) -> dict[tuple[int, int], str]:
        self._collect()
        self.pool.shutdown()
        return self.hashes


def _sha256(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def _stream(ck, fam, writer, items: list[Item], progress: bool, new_ids: dict[int, list[int]]):
    """Copy every item into the writer; returns ({(layer, new id): sha256}, resumed count)."""
    from tqdm import tqdm

    hasher = _Hasher()
    resumed = 0
    bar = tqdm(
        total=sum(it.spec.nbytes for it in items),
        unit="B",
        unit_scale=True,
        disable=not progress,
        desc="prune",
    )
    i = 0
    while i < len(items):
        it = items[i]
        group = [it]
        if it.kind == "expert":
            while i + len(group) < len(items) and items[i + len(group)].expert == it.expert:
                group.append(items[i + len(group)])
        done = [writer.done(g.spec.name) for g in group]
        resumed += sum(done)
        if it.kind == "expert":  # read even when written: the manifest needs its hash
            hasher.submit(it.expert, _copy_expert(ck, writer, group))
        elif not done[0]:
            writer.write(it.spec.name, _fused(ck, it) if it.kind == "fused" else _tensor(ck, it))
        bar.update(sum(g.spec.nbytes for g in group))
        i += len(group)
    bar.close()
    for layer in sorted({it.spec.layer for it in items if it.kind == "fused"}):
        for j, e in enumerate(new_ids[layer]):  # an expert's slices lie in several tensors
            hasher.submit(
                (layer, j), list(ck.read_many(fam.expert_tensor_names(layer, e)).values())
            )
    return hasher.close(), resumed


def _fused(ck, it: Item) -> torch.Tensor:
    """The fused tensor [n_kept, ...] of the kept slices in new id order, read one at a time."""
    from reap.checkpoint import TORCH_DTYPES, view_name

    out = torch.empty(it.spec.shape, dtype=TORCH_DTYPES[it.spec.dtype])
    for j, e in enumerate(it.rows):
        out[j] = ck.read(view_name(it.source, e))  # [...] slice e of the source [E, ...]
    return out


def _copy_expert(ck, writer, group: list[Item]) -> list[torch.Tensor]:
    """One expert's tensors, read together (adjacent: one read) and written verbatim (the writer
    skips tensors of shards a previous run completed); returns them, in order, for hashing."""
    tensors = ck.read_many([g.source for g in group])
    for g in group:
        writer.write(g.spec.name, tensors[g.source])
    return [tensors[g.source] for g in group]


def _tensor(ck, it: Item) -> torch.Tensor:
    t = ck.read(it.source)
    if it.kind == "router":
        t = t.index_select(it.axis, torch.tensor(it.rows, dtype=torch.long)).contiguous()
    return t


def _manifest(ck, plan: Plan, new_ids, hashes, arguments) -> dict:
    experts = {}
    for layer, ids in new_ids.items():
        experts[str(layer)] = {
            "original": ids,
            "sha256": [hashes[(layer, j)] for j in range(len(ids))],
        }
    plan_bytes = json.dumps(plan.to_json(), indent=1).encode()
    return {
        "format": MANIFEST_FORMAT,
        "hash_rule": HASH_RULE,
        "source": {"path": os.path.abspath(ck.path), "fingerprint": ck.fingerprint()},
        "plan_sha256": hashlib.sha256(plan_bytes).hexdigest(),
        "n_experts": {"source": plan.n_experts, "kept": sorted(set(plan.counts.values()))},
        "experts": experts,
        "provenance": {
            "code_version": code_version(),
            "arguments": arguments or {},
            "criterion": plan.criterion,
            "budget": plan.budget,
            "plan_provenance": plan.provenance,
        },
    }


def _other_files(ck) -> dict[str, bytes]:
    """Non-weight files next to the source weights (tokenizer, generation config, ...)."""
    root = Path(ck.path)
    if not root.is_dir():
        return {}
    out = {}
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix != ".safetensors" and p.name not in _WEIGHT_FILES:
            out[p.name] = p.read_bytes()
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="source checkpoint directory")
    p.add_argument("--plan", required=True, help="plan JSON from `reap plan`")
    p.add_argument("--out", required=True, help="output directory (appears when complete)")
    p.add_argument("--max-shard-size", help="largest shard, e.g. 5GB (default: the source's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    limit = None
    if args.max_shard_size:
        from reap.sizes import parse_size

        limit = parse_size(args.max_shard_size)
    arguments = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    r = prune(
        model=args.model,
        plan=args.plan,
        out=args.out,
        max_shard_bytes=limit,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        arguments=arguments,
    )
    from reap.sizes import fmt_bytes

    pred = f", predicted {fmt_bytes(r.predicted_bytes)}" if r.predicted_bytes else ""
    print(
        f"{r.out}: {r.tensors} tensors, {r.kept_experts} experts kept, "
        f"{fmt_bytes(r.file_bytes)} written{pred}, {r.seconds:.1f} s"
        + (f" ({r.resumed_tensors} tensors resumed)" if r.resumed_tensors else ""),
        file=sys.stderr,
    )
    return 0
