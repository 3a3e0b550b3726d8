"""The prediction side of `reap plan`: the options it adds, the prediction table every plan
prints (and stores), and `reap plan --compare PLAN...`.

    reap plan runs/zh-code --against runs/en runs/ja --keep 16 --out plan.json
    reap plan --compare a.json b.json --against runs/en --plot compare.png --md compare.md
"""

from __future__ import annotations

import argparse
import os
import sys

from reap.errors import ReapError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `reap plan` for predictions, comparisons and the recon pass."""
    p.add_argument("--against", nargs="+", default=[], metavar="STATS",
                   help="more corpora (statistics files or calibration directories) to predict "
                   "the plan's losses on; the plan's own corpora are always predicted")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap replicates over sequences of the damage interval")
    p.add_argument("--plot", help="PNG of per-layer kept mass per corpus (default with --out: "
                   "beside the plan, PLAN.predict.png)")
    p.add_argument("--compare", nargs="+", metavar="PLAN",
                   help="print the predictions of these plan files side by side (markdown; "
                   "--plot for a PNG, --md to save); with STATS/--against, predict on those")
    p.add_argument("--md", help="--compare: also write the markdown here")
    p.add_argument("--budget", default="4GB",
                   help="--criterion recon: RSS budget of its calibration pass (e.g. 4GB)")


def predict_plan(plan, args: argparse.Namespace) -> None:
    """Attach, print and plot the plan's predictions (a plan with kept sets and statistics)."""
    from reap.prune.predict import predict
    from reap.prune.predict_report import prediction_table, write_plot

    sources = [*(args.stats or []), *args.against]
    if plan.keep is None or not sources:
        return
    if args.bootstrap < 0:
        raise ReapError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    plan.predictions = predict(plan, sources, reps=args.bootstrap, seed=args.seed)
    print(prediction_table(plan.predictions, plan.layers))
    png = args.plot or (os.path.splitext(args.out)[0] + ".predict.png" if args.out
                        and not args.dry_run else None)
    if png:
        label = os.path.basename(args.out) if args.out else "plan"
        print(write_plot([(label, plan)], png), file=sys.stderr)


def run_compare(args: argparse.Namespace) -> int:
    """`reap plan --compare`: the plans' predictions side by side."""
    from reap.prune.plan_file import Plan
    from reap.prune.predict import predict
    from reap.prune.predict_report import compare_markdown, write_plot

    named = []
    for path in args.compare:
        plan = Plan.load(path)
        sources = [*(args.stats or []), *args.against]
        if sources:
            plan.predictions = predict(plan, sources, reps=args.bootstrap, seed=args.seed)
        elif plan.predictions is None:
            raise ReapError(f"{path}: predictions: the plan has none (a reap.plan/1 file or "
                            "one made without statistics); give STATS or --against")
        named.append((os.path.basename(path), plan))
    text = compare_markdown(named)
    print(text, end="")
    if args.md:
        from reap.fileio import write_atomic

        print(write_atomic(args.md, text), file=sys.stderr)
    if args.plot:
        print(write_plot(named, args.plot), file=sys.stderr)
    return 0
