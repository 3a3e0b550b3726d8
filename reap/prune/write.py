"""`prune`: write a pruned checkpoint from a plan, streaming tensor by tensor (`reap prune`).

Kept routed experts are copied byte for byte and renumbered densely in ascending original id,
router tensors sliced to the kept rows, unused components (an MTP layer) left out, every other
tensor copied verbatim; config.json gets the new expert count (`with_experts`). Shards are at
most as large as the source's largest unless `max_shard_bytes` is given. A rerun with the same
inputs after a crash or Ctrl-C resumes; one with other inputs is refused (`resume`). The output
may never be, hold or lie inside the source or the plan file (it could be replaced). Beside the
weights: `reap_manifest.json` (per layer the original id of every new expert id, the sha256 of
every kept expert and of every other file written, provenance), `reap_plan.json`, and every
non-weight file of the source (tokenizer, ...).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from reap.errors import ReapError, is_int
from reap.fileio import claim_out, overlap
from reap.provenance import code_version
from reap.prune import resume
from reap.prune.plan_file import PRUNE_CODE, Plan, check
from reap.prune.stream import stream_items
from reap.prune.tensor_map import plan_items, unused_tensors

MANIFEST = "reap_manifest.json"
PLAN_COPY = "reap_plan.json"
MANIFEST_FORMAT = "reap.prune_manifest/1"
HASH_RULE = ("sha256 over the stored bytes of the expert's tensors, concatenated in the order "
             "of the family's expert_tensor_names")
_WEIGHT_FILES = {"config.json", "model.safetensors.index.json", MANIFEST, PLAN_COPY, resume.INPUTS}
DROPPED_NOTE = ("tensors the family's layout tags as never read by the text model "
                "(UNUSED_COMPONENTS, e.g. an MTP layer, whose experts were neither calibrated nor "
                "pruned) are left out")


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


def prune(*, model: str, plan: str | Plan, out: str, max_shard_bytes: int | None = None,
          overwrite: bool = False, progress: bool = False,
          arguments: dict | None = None) -> PruneResult:
    """Write the pruned checkpoint of `model` under `plan` to `out` (see the module docstring)."""
    from reap.checkpoint import Checkpoint, CheckpointWriter

    t0 = time.perf_counter()
    plan_path = os.fspath(plan) if isinstance(plan, (str, os.PathLike)) else None
    plan = Plan.load(plan_path) if plan_path else plan
    if max_shard_bytes is not None and not (is_int(max_shard_bytes) and max_shard_bytes > 0):
        raise ReapError(f"max_shard_bytes {max_shard_bytes!r} is not a positive byte count")
    with Checkpoint.open(model) as ck:
        fam = _check_inputs(ck, plan, plan_path or "plan")
        _check_out(out, _inputs(model, ck, plan_path), overwrite)
        config = _pruned_config(fam, ck.config, plan)
        dropped = unused_tensors(fam, ck.config)
        items, new_ids = plan_items(ck, fam, plan, dropped)
        specs = [it.spec for it in items]
        limit = max_shard_bytes or _largest_shard(ck)
        inputs = resume.identity(ck, _plan_bytes(plan), limit, code_version(PRUNE_CODE))
        resume.claim(out, inputs, overwrite)
        writer = CheckpointWriter(out, specs, limit, prefix=ck.prefix, overwrite=overwrite)
        resume.record(out, inputs)
        merger = None
        if plan.merge:
            from reap.prune.merge_write import Merger

            groups = {int(layer): gs for layer, gs in plan.merge["groups"].items()}
            merger = Merger(ck, fam, groups, plan.merge.get("align"))
        hashes, resumed = stream_items(ck, fam, writer, items, progress, new_ids, merger)
        manifest = _manifest(ck, plan, new_ids, hashes, arguments, merger)
        if dropped:
            manifest["dropped"] = {"tensors": len(dropped), "note": DROPPED_NOTE}
        files = {"config.json": json.dumps(config, indent=2).encode(), PLAN_COPY: _plan_bytes(plan)}
        files.update(_other_files(ck))  # `verify` checks each against its digest
        manifest["files"] = {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}
        path = writer.close(None, {MANIFEST: json.dumps(manifest, indent=1), **files})
        resume.release(path)
    written = sum(p.stat().st_size for p in Path(path).iterdir() if p.suffix == ".safetensors")
    kept, seconds = sum(len(v) for v in plan.keep.values()), time.perf_counter() - t0
    return PruneResult(path, len(items), written, plan.predicted_bytes, kept, resumed, seconds)


def _check_inputs(ck, plan: Plan, where: str):
    """The source's family, once the source binds like `run` binds it (names, shapes, dtypes:
    a relabelled tensor is refused, not copied) and the plan is checked (`plan_file.check`)."""
    from reap.models import family
    from reap.models.checks import check_binding

    if not ck.config:
        raise ReapError(f"{ck.path}: no config.json next to the weights")
    fam = family(ck.config)
    layout = fam.layout(ck.config)  # built once: binding check and size model
    check_binding(ck.tensors, fam, ck.config, str(ck.path), layout)
    _check_model(ck, plan)
    check(plan, where, _model_shape(layout, fam, ck.config))
    if plan.keep is None:
        raise ReapError(f"{where}: keep: the plan holds counts only (no kept experts): make it "
                        "from statistics")
    return fam


def _model_shape(layout: list, fam, config: dict) -> tuple[list[int], int, int]:
    """(MoE layers, n_experts, top_k) of the source model, as the size model reads them."""
    from reap.sizes import SizeModel

    size = SizeModel.from_layout(layout, fam, config)
    return list(size.moe_layers), size.n_experts, size.top_k


def _inputs(model: str, ck, plan_path: str | None) -> list[str]:
    """Every path a prune reads: the model, each file in its directory and each shard (a link
    counts where it points, e.g. into a hub cache's blobs), and the plan file."""
    listed = [str(p) for p in Path(model).iterdir()] if Path(model).is_dir() else []
    return [model, *listed, *ck.files, *([plan_path] if plan_path else [])]


def _check_out(out: str, sources: list[str], overwrite: bool) -> None:
    """Refuse an output that is, holds or lies inside an input (or whose half-written
    `<out>.partial` does): replacing it would destroy the input. Then `claim_out`."""
    for path in (out, resume.work_dir(out)):
        hit = overlap(path, sources)
        if hit:
            raise ReapError(f"{path}: the output {hit[0]} the input {hit[1]}; choose an output "
                            "directory outside the source model and the plan")
    claim_out(out, overwrite, directory=True)


def _pruned_config(fam, config: dict, plan: Plan) -> dict:
    counts = set(plan.counts.values())
    if len(counts) == 1:
        return fam.with_experts(config, counts.pop())
    return fam.with_experts(config, {int(k): v for k, v in plan.counts.items()})


def _check_model(ck, plan: Plan) -> None:
    fp = ck.fingerprint()
    if plan.model and plan.model != fp:
        raise ReapError(f"the plan was made for model {plan.model[:16]}..., not {ck.path} "
                        f"({fp[:16]}...)")


def _largest_shard(ck) -> int:
    per_file: dict[str, int] = {}
    for t in ck.tensors.values():
        per_file[t.file] = per_file.get(t.file, 0) + t.nbytes
    return max(per_file.values(), default=1)


def _manifest(ck, plan: Plan, new_ids, hashes, arguments, merger=None) -> dict:
    experts = {}
    for layer, ids in new_ids.items():
        experts[str(layer)] = {"original": ids,
                               "sha256": [hashes[(layer, j)] for j in range(len(ids))]}
        if merger is not None:  # every output expert's sources, weights and re-encoding error
            gs = merger.groups[layer]
            experts[str(layer)].update(
                sources=[[e for e, _ in g] for g in gs], weights=[[w for _, w in g] for g in gs],
                reencode_error=[merger.errors.get((layer, j), 0.0) for j in range(len(ids))])
    merge = None if merger is None else {
        **{k: v for k, v in plan.merge.items() if k != "groups"},
        "reencode_error": "relative Frobenius error of the stored merged expert: "
                          "||decoded stored - float32 merge|| / ||float32 merge||, all matrices"}
    return {
        "format": MANIFEST_FORMAT,
        "hash_rule": HASH_RULE,
        "source": {"path": os.path.abspath(ck.path), "fingerprint": ck.fingerprint()},
        "plan_sha256": hashlib.sha256(_plan_bytes(plan)).hexdigest(),
        "n_experts": {"source": plan.n_experts, "kept": sorted(set(plan.counts.values()))},
        "experts": experts,
        **({"merge": merge} if merge else {}),
        "provenance": {"code_version": code_version(PRUNE_CODE), "arguments": arguments or {},
                       "criterion": plan.criterion, "budget": plan.budget,
                       "plan_provenance": plan.provenance},
    }


def _plan_bytes(plan: Plan) -> bytes:
    """The plan as `reap_plan.json` holds it (and as the manifest's plan_sha256 hashes it)."""
    return json.dumps(plan.to_json(), indent=1).encode()


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
