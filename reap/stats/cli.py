"""`reap stats show PATH | merge PATHS... --out FILE`: inspect statistics files and merge the
statistics of corpus shards or runs exactly (see `reap.stats.merge`)."""

from __future__ import annotations

import argparse
import json

from reap.errors import ReapError
from reap.fileio import OVERWRITE_HELP, claim_out
from reap.stats import ExpertStats, merge


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    show = sub.add_parser("show", help="print a summary of a statistics file")
    show.add_argument("path")
    mg = sub.add_parser("merge", help="merge statistics of corpus shards or runs exactly")
    mg.add_argument("paths", nargs="+")
    mg.add_argument("--out", required=True, help="output .safetensors path")
    mg.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def _check_same_model(paths: list[str], parts: list[ExpertStats]) -> None:
    """Name the two files whose model fingerprints differ (`merge` sees no file names)."""
    first = parts[0].meta.get("model")
    for path, part in zip(paths[1:], parts[1:]):
        if part.meta.get("model") != first:
            raise ReapError(f"{paths[0]} and {path} are statistics of different models "
                            f"(fingerprints {first} and {part.meta.get('model')})")


def run(args: argparse.Namespace) -> int:
    if args.action == "merge":
        claim_out(args.out, args.overwrite)
        parts = [ExpertStats.load(p) for p in args.paths]
        _check_same_model(args.paths, parts)
        merged = merge(parts)
        print(merged.save(args.out))
        return 0
    s = ExpertStats.load(args.path)
    print(json.dumps({**s.header(), "fields": sorted(s.tensors())}, indent=1))
    used = (s.count > 0).sum(1).tolist()
    for layer, n in zip(s.layers, used):
        print(f"layer {layer:3d}: {n}/{s.n_experts} experts used")
    return 0
