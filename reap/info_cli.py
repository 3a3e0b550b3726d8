"""`reap info`: the parameter and byte census of a checkpoint or built-in config, printed as a
table or JSON (the numbers come from the size model, `reap.sizes.SizeModel`)."""

from __future__ import annotations

import argparse
import json
import os

from reap.sizes import SizeModel, fmt_params, resolve_config
from reap.units import format_bytes


def info(model: str, layers: int | None = None) -> dict:
    """Census of a checkpoint or built-in config as a JSON-able dict. A checkpoint is checked as
    the other commands check it first (config values, every shard header and the index, the
    tensors against the family layout), so `info` refuses what they refuse."""
    config, path = resolve_config(model, layers)
    on_disk = _check_checkpoint(path, config) if path is not None else None
    m = SizeModel.from_config(config)
    first = m.moe_layers[0] if m.moe_layers else None
    out = {
        "model": model,
        "components": {k: dict(v) for k, v in sorted(m.census.items())},
        "total_params": m.total_params,
        "active_params": m.active_params,
        "routed_params": m.census.get("routed_experts", {}).get("params", 0),
        "routed_bytes": m.census.get("routed_experts", {}).get("bytes", 0),
        "n_experts": m.n_experts,
        "top_k": m.top_k,
        "moe_layers": len(m.moe_layers),
        "params_per_routed_expert": m.expert_own_params.get(first, 0),
        "bytes_per_routed_expert": m.expert_own_bytes.get(first, 0),
        "checkpoint_bytes": m.predict_bytes(),
        "tensors": m.n_tensors,
    }
    if on_disk is not None:
        out["bytes_on_disk"], out["tensors_on_disk"] = on_disk
    return out


def _check_checkpoint(path: str, config: dict) -> tuple[int, int]:
    """(bytes, tensors) on disk of a checkpoint that passes the checks every command makes."""
    from reap.checkpoint import Checkpoint
    from reap.models import family
    from reap.models.checks import check_binding

    with Checkpoint.open(path) as ck:
        ck.validate()
        check_binding(ck.tensors, family(config), config, path)
        return sum(os.path.getsize(f) for f in ck.files), len(ck.tensors)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        metavar="MODEL_OR_CONFIG",
        help="checkpoint directory/file, or a built-in config: k3-tiny, k3-small, k3-full",
    )
    p.add_argument(
        "--layers", type=int, default=None, help="built-in configs only: keep the first N layers"
    )
    p.add_argument("--json", action="store_true", help="print the census as JSON")


def run(args: argparse.Namespace) -> int:
    out = info(args.model, args.layers)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    total = out["total_params"]
    print(
        f"{out['model']}: {fmt_params(total)} parameters, {format_bytes(out['checkpoint_bytes'])}"
        f" checkpoint, {out['tensors']:,} tensors"
    )
    print(f"{'component':<16}{'params':>14}{'share':>8}{'bytes':>14}")
    for name, c in out["components"].items():
        print(
            f"{name:<16}{fmt_params(c['params']):>14}{c['params'] / total:>8.1%}"
            f"{format_bytes(c['bytes']):>14}"
        )
    print(
        f"active per token: {fmt_params(out['active_params'])} "
        f"({out['active_params'] / total:.1%}); routed experts: {out['n_experts']} per layer, "
        f"top-{out['top_k']}, {out['moe_layers']} MoE layers"
    )
    print(
        f"per routed expert: {out['params_per_routed_expert']:,} params, "
        f"{out['bytes_per_routed_expert']:,} bytes"
    )
    if "bytes_on_disk" in out:
        on_disk = format_bytes(out["bytes_on_disk"])
        print(f"on disk: {on_disk} in {out['tensors_on_disk']:,} tensors")
    return 0
