"""`reap info`: the parameter and byte census of a checkpoint, an http(s) URL (config, index and
shard headers only), a directory holding only `config.json` (and perhaps the index), or a
built-in config, printed as a table or JSON (the numbers come from the size model,
`reap.sizes.SizeModel`; a checkpoint's headers or an index's `total_size` give the bytes stored)."""

from __future__ import annotations

import argparse
import json
import os

from reap.sizes import SizeModel, check_index, fmt_params, layout, resolve_source
from reap.units import format_bytes


def info(model: str, layers: int | None = None) -> dict:
    """Census of a checkpoint or built-in config as a JSON-able dict. A checkpoint is checked as
    the other commands check it first (config values, every shard header and the index, the
    tensors against the family layout), so `info` refuses what they refuse."""
    src = resolve_source(model, layers)
    config = src.config
    on_disk = _check_checkpoint(src.path, config) if src.path is not None else None
    from reap.models import family

    fam = family(config)
    specs = layout(config)
    m = SizeModel.from_layout(specs, fam, config)
    first = m.moe_layers[0] if m.moe_layers else None
    out = {
        "model": model,
        "components": {k: dict(v) for k, v in sorted(m.census.items())},
        "total_params": m.total_params,
        "active_params": m.active_params,
        "active_with_embedding": m.active_with_embedding,
        "tensor_bytes": sum(s.nbytes for s in specs),
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
        out.update(on_disk)
    if src.config_only is not None:
        out["config_only"] = True
        if src.config_only.weight_map is not None:
            missing = check_index(src.config_only, specs, fam.__name__.rsplit(".", 1)[-1])
            out["index_tensors"] = len(src.config_only.weight_map)
            out["index_missing"] = missing
            out["index_total_size"] = src.config_only.total_size
    return out


def _check_checkpoint(path: str, config: dict) -> dict:
    """What is stored of a checkpoint (local or URL) that passes the checks every command makes:
    tensors, their exact bytes from the headers, and (local) the files' bytes on disk."""
    from reap.checkpoint import is_url, open_checkpoint
    from reap.models import family
    from reap.models.checks import check_binding

    with open_checkpoint(path) as ck:
        ck.validate()
        check_binding(ck.tensors, family(config), config, path)
        out = {"tensors_on_disk": len(ck.tensors),
               "stored_tensor_bytes": sum(t.nbytes for t in ck.tensors.values())}
        if not is_url(path):
            out["bytes_on_disk"] = sum(os.path.getsize(f) for f in ck.files)
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_OR_CONFIG",
                   help="checkpoint directory/file, http(s) URL, a directory holding only "
                        "config.json (and perhaps the index), or a built-in config: k3-tiny, "
                        "k3-small, k3-full")
    p.add_argument("--layers", type=int, default=None,
                   help="built-in configs only: keep the first N layers")
    p.add_argument("--json", action="store_true", help="print the census as JSON")


def run(args: argparse.Namespace) -> int:
    out = info(args.model, args.layers)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    total = out["total_params"]
    print(f"{out['model']}: {fmt_params(total)} parameters, "
          f"{format_bytes(out['checkpoint_bytes'])} checkpoint, {out['tensors']:,} tensors")
    print(f"{'component':<16}{'params':>14}{'share':>8}{'bytes':>14}")
    for name, c in out["components"].items():
        print(f"{name:<16}{fmt_params(c['params']):>14}{c['params'] / total:>8.1%}"
              f"{format_bytes(c['bytes']):>14}")
    print(f"active per token: {fmt_params(out['active_params'])} "
          f"({out['active_params'] / total:.1%}); routed experts: {out['n_experts']} per layer, "
          f"top-{out['top_k']}, {out['moe_layers']} MoE layers")
    print(f"per routed expert: {out['params_per_routed_expert']:,} params, "
          f"{out['bytes_per_routed_expert']:,} bytes")
    print(f"active with the input embedding: {fmt_params(out['active_with_embedding'])}; "
          f"tensor data: {out['tensor_bytes']:,} bytes")
    if "bytes_on_disk" in out:
        print(f"on disk: {format_bytes(out['bytes_on_disk'])} in {out['tensors_on_disk']:,} "
              "tensors")
    elif "stored_tensor_bytes" in out:
        print(f"stored: {out['stored_tensor_bytes']:,} bytes in {out['tensors_on_disk']:,} tensors")
    _print_index(out)
    return 0


def _print_index(out: dict) -> None:
    if not out.get("config_only"):
        return
    if "index_tensors" not in out:
        print("config only: sizes from the layout (no index to compare)")
        return
    total = out["index_total_size"]
    listed = f"the index lists {out['index_tensors']:,} tensors"
    if out["index_missing"]:
        listed += f" ({out['index_missing']:,} of the layout's are not listed: an excerpt?)"
    if total is not None:
        same = "the same" if total == out["tensor_bytes"] else "NOT the same"
        listed += f"; its total_size {total:,} bytes is {same} as the layout's tensor data"
    print(f"config only: {listed}")
