"""The `reap plan`, `reap prune` and `reap verify` subcommands: arguments in, one call out.

    reap plan zh.safetensors code.safetensors --model DIR --target-size 350GB --out plan.json
    reap plan --config k3-full --target-size 350GB --dry-run      # counts only, no statistics
    reap prune MODEL --plan plan.json --out DIR
    reap verify PRUNED --source MODEL          # exit 0 if OK, 2 with the first problem

A plan from statistics alone is planned on the checkpoint the statistics were calibrated on,
when it is still there unchanged.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

from reap.errors import ReapError
from reap.fileio import OVERWRITE_HELP, claim_out
from reap.prune import plan_predict
from reap.prune.budget import positive_size
from reap.prune.criteria import CRITERIA
from reap.prune.merge_plan import METHODS, ROUTER_RULE, make_merge_plan
from reap.prune.plan import make_plan
from reap.prune.plan_file import Plan
from reap.prune.recon_pass import plan_recon

RECON_HELP = (
    "per layer, the kept set minimising the MoE block's output error on the statistics' "
    "calibration tokens (objective: sum over tokens of ||routed output - output with the "
    "dropped experts removed and the token's routing weights renormalised over its surviving "
    "experts||^2, each corpus relative to its output energy, computed exactly from each "
    "token's Gram of expert contributions in the model space); search: backward and forward "
    "greedy and the REAP set, each improved by pair swaps (layers with <= 2000 candidate sets "
    "enumerated). Cost: one extra streamed calibration pass over the statistics' tokens under "
    "--budget (what `reap calibrate` costs, plus each MoE layer's routed outputs, "
    "tokens*top_k*expert width*4 bytes, held while it runs), tokens*top_k*(4*top_k+14) bytes "
    "per MoE layer of records, and seconds per layer of search (O(tokens*top_k^3) per step); "
    "reap/ean read only the statistics"
)


MERGE_HELP = (
    "hc-smoe: average-linkage clustering (Euclidean) of the experts' mean outputs on sampled "
    "tokens; m-smoe: the most frequent experts are dominant, the others join the dominant one "
    "of most similar router scores, neurons aligned by weight matching. Both merge a group by "
    "frequency-weighted averaging, in float32, re-encoded in the source's format; router: "
    + ROUTER_RULE
)


class Subcommand(NamedTuple):
    """A `reap` subcommand: fills its parser, then runs on the parsed arguments (exit code)."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def size_table(plan: Plan) -> str:
    """Human-readable per-layer counts and predicted sizes of a plan."""
    from reap.sizes import fmt_params
    from reap.units import format_bytes

    rows, start, layers, E = [], 0, plan.layers, plan.n_experts
    for i in range(1, len(layers) + 1):
        if i == len(layers) or plan.counts[layers[i]] != plan.counts[layers[start]]:
            n = plan.counts[layers[start]]
            span = f"{layers[start]}-{layers[i - 1]}" if i - 1 > start else f"{layers[start]}"
            rows.append(f"  layers {span:<10} keep {n:>5}/{E} ({n / E:6.1%})")
            start = i
    total = sum(plan.counts.values())
    shown = {k: v for k, v in plan.budget.items() if k not in ("target_bytes", "note")}
    budget = ", ".join(f"{k} {v}" for k, v in shown.items())
    criterion = plan.criterion or "(counts only)"
    head = f"plan: {plan.scope} scope, criterion {criterion}, budget: {budget}"
    kept = (f"  experts kept: {total:,} of {E * len(layers):,} "
            f"({total / max(E * len(layers), 1):.1%}); protected: {len(plan.protected)}")
    out = [head, *rows, kept]
    if plan.budget.get("note"):
        out.insert(1, f"  note: {plan.budget['note']}")
    if plan.predicted_bytes is not None:
        out.append(f"  predicted: {format_bytes(plan.predicted_bytes)} "
                   f"({fmt_params(plan.predicted_params)} params) from "
                   f"{format_bytes(plan.source_bytes)} ({fmt_params(plan.source_params)} params), "
                   f"{plan.predicted_bytes / plan.source_bytes:.1%}")
    return "\n".join(out)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stats", nargs="*", metavar="STATS",
                   help="statistics files from `reap calibrate`, one per corpus")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="source checkpoint (config, sizes and fingerprint; default: "
                     "the checkpoint the statistics were calibrated on, if still there)")
    src.add_argument("--config", help="built-in config (k3-tiny, k3-small, k3-full), checkpoint, "
                     "http(s) URL, or a directory holding only config.json (sizes without weights)")
    p.add_argument("--layers", type=int, help="with a built-in --config: its first N layers")
    p.add_argument("--out", help="plan JSON to write")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--dry-run", action="store_true", help="print the size table, write nothing")
    p.add_argument("--criterion", default="reap", choices=CRITERIA, help="reap/ean/frequency/"
                   "gate/random rank experts by statistics alone; recon: " + RECON_HELP)
    p.add_argument("--latent", action="store_true",
                   help="reap/ean: expert output norms in the latent space, not model space")
    p.add_argument("--weights", help="corpus weights, e.g. zh=3,code=1 (default: equal)")
    p.add_argument("--quota", action="store_true",
                   help="each corpus keeps its top experts for its weight's share of the budget")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--keep", type=int, help="experts to keep per layer (on average if global)")
    b.add_argument("--ratio", type=float, help="fraction of experts to keep")
    b.add_argument("--target-size", help="largest checkpoint that fits, e.g. 350GB, 64GiB")
    p.add_argument("--scope", default="uniform", choices=("uniform", "global"))
    p.add_argument("--min-keep", type=int, help="global scope: least experts per layer (>= top_k)")
    p.add_argument("--no-protect", action="store_true", help="do not protect super experts")
    p.add_argument("--seed", type=int, default=0, help="seed of --criterion random")
    p.add_argument("--method", choices=METHODS, help="merge experts instead of dropping them "
                   "(statistics from `reap calibrate --merge-stats`): " + MERGE_HELP)
    # predictions, comparisons and the recon pass
    p.add_argument("--against", nargs="+", default=[], metavar="STATS",
                   help="more corpora (statistics files or calibration directories) to "
                   "predict the plan's losses on; the plan's own corpora are always predicted")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap replicates over sequences of the damage interval")
    p.add_argument("--plot", help="PNG of the prediction: per-layer kept mass per corpus and "
                   "the damage index")
    p.add_argument("--compare", nargs="+", metavar="PLAN",
                   help="print the predictions of these plan files side by side (markdown; "
                   "--plot for a PNG, --md to save); with STATS/--against, predict on those")
    p.add_argument("--md", help="--compare: also write the markdown here")
    p.add_argument("--budget", default="4GB",
                   help="--criterion recon: RSS budget of its calibration pass (e.g. 4GB)")


def run_plan(args: argparse.Namespace) -> int:
    for flag, path in (("--plot", args.plot), ("--md", args.md)):
        if path:
            claim_out(path, args.overwrite, flag)
    if args.compare:
        return plan_predict.run_compare(args)
    config, model, path = None, None, None
    if args.model or args.config:
        config, path = _source_config(args.model or args.config, args.layers)
        model = _fingerprint(path) if path else None
    elif args.stats:
        config, model = _calibrated_model(args.stats[0])
    if not args.dry_run and not args.out:
        raise ReapError("give --out plan.json (or --dry-run)")
    if not args.dry_run:
        from reap.stats import expand_paths

        _check_plan_out(args.out, expand_paths(args.stats)[0], path)
        claim_out(args.out, args.overwrite)
    arguments = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    planner = make_plan
    if args.method:
        planner = functools.partial(make_merge_plan, method=args.method)
    elif args.criterion == "recon":
        budget = positive_size(args.budget, "--budget")
        planner = functools.partial(plan_recon, checkpoint=path, budget=budget)
    plan = planner(stats=args.stats, config=config, model=model, criterion=args.criterion,
                   latent=args.latent, weights=args.weights, quota=args.quota, keep=args.keep,
                   ratio=args.ratio, target_size=args.target_size, scope=args.scope,
                   min_keep=args.min_keep, protect=not args.no_protect, seed=args.seed,
                   arguments=arguments)
    print(size_table(plan))
    plan_predict.predict_plan(plan, args)
    if args.dry_run:
        return 0
    if plan.keep is None:
        raise ReapError("without statistics a plan has counts only: give statistics files, "
                        "--criterion random, or --dry-run")
    print(plan.save(args.out), file=sys.stderr)
    return 0


def _check_plan_out(out: str, stats: list[str], model: str | None) -> None:
    """Refuse a plan file that would replace an input: a statistics file, the model file, or a
    file already in the model directory."""
    from reap.fileio import overlap

    hit = overlap(out, [*stats, *([model] if model else [])])
    if hit and (hit[0] == "is" or (hit[0] == "is inside" and os.path.lexists(out))):
        raise ReapError(f"{out}: --out would replace the input {hit[1]}; choose another file")


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


def _source_config(model: str, layers: int | None) -> tuple[dict, str | None]:
    """(config, checkpoint path or URL) of --model/--config: a built-in name, a checkpoint, a
    URL, or a directory holding only config.json (its index, if any, checked as `reap info`
    checks it). Config-only sources plan sizes; they have no fingerprint to record."""
    from reap.sizes import check_index, layout, resolve_source

    src = resolve_source(model, layers)
    if src.config_only is not None and src.config_only.weight_map is not None:
        from reap.models import family

        fam = family(src.config)
        check_index(src.config_only, layout(src.config), fam.__name__.rsplit(".", 1)[-1])
    return src.config, src.path


def _fingerprint(path: str) -> str:
    from reap.checkpoint import open_checkpoint

    with open_checkpoint(path) as ck:
        return ck.fingerprint()


def add_prune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="source checkpoint directory")
    p.add_argument("--plan", required=True, help="plan JSON from `reap plan`")
    p.add_argument("--out", required=True, help="output directory (appears when complete)")
    p.add_argument("--max-shard-size", help="largest shard, e.g. 5GB (default: the source's)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--push-to", metavar="ORG/NAME", help="then upload the build and a model card "
                   "to this Hub repo (created private)")


def run_prune(args: argparse.Namespace) -> int:
    from reap.prune.write import prune
    from reap.units import format_bytes

    limit = None
    if args.max_shard_size is not None:
        limit = positive_size(args.max_shard_size, "--max-shard-size")
    arguments = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    r = prune(model=args.model, plan=args.plan, out=args.out, max_shard_bytes=limit,
              overwrite=args.overwrite, progress=not args.no_progress, arguments=arguments)
    pred = f", predicted {format_bytes(r.predicted_bytes)}" if r.predicted_bytes else ""
    resumed = f" ({r.resumed_tensors} tensors resumed)" if r.resumed_tensors else ""
    print(f"{r.out}: {r.tensors} tensors, {r.kept_experts} experts kept, "
          f"{format_bytes(r.file_bytes)} written{pred}, {r.seconds:.1f} s{resumed}",
          file=sys.stderr)
    if args.push_to:
        from reap.checkpoint.hub import push

        print(f"pushed: {push(r.out, args.push_to)}", file=sys.stderr)
    return 0


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("pruned", help="pruned checkpoint directory (from `reap prune`)")
    p.add_argument("--source", required=True, help="the checkpoint it was pruned from")


def run_verify(args: argparse.Namespace) -> int:
    from reap.prune.verify import verify

    r = verify(pruned=args.pruned, source=args.source)
    merged = f", {r.merged} merged ones equal to their recomputed merge," if r.merged else ""
    print(f"{args.pruned}: OK, {r.tensors} tensors ({r.bytes_compared:,} bytes) match the "
          f"source; {r.experts - r.merged} kept experts bit-identical{merged} and matching the "
          "manifest", file=sys.stderr)
    return 0


PLAN = Subcommand(add_plan_arguments, run_plan)
PRUNE = Subcommand(add_prune_arguments, run_prune)
VERIFY = Subcommand(add_verify_arguments, run_verify)
