"""The prediction side of `reap plan` (options in `reap.prune.cli`): the prediction table
every plan prints (and stores), and `reap plan --compare PLAN...`.

    reap plan runs/zh-code --against runs/en runs/ja --keep 16 --out plan.json
    reap plan --compare a.json b.json --against runs/en --plot compare.png --md compare.md
"""

from __future__ import annotations

import os
import sys

from reap.errors import ReapError


def predict_plan(plan, args) -> None:
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
    png = args.plot
    if png:
        label = os.path.basename(args.out) if args.out else "plan"
        print(write_plot([(label, plan)], png), file=sys.stderr)


def run_compare(args) -> int:
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
        from reap.fileio import MD_TAG, write_atomic

        print(write_atomic(args.md, MD_TAG + text), file=sys.stderr)
    if args.plot:
        print(write_plot(named, args.plot), file=sys.stderr)
    return 0
