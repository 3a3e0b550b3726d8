"""`reap analyze`: expert overlap between corpora against chance, clusters, plots, report.

    reap analyze stats/en.safetensors stats/zh.safetensors stats/code.safetensors --out runs/overlap

Takes one statistics file per corpus (from `reap calibrate`), runs `reap.analyze.analyze` and
writes tables, summary.json, PNG figures and report.md under --out.
"""

from __future__ import annotations

import argparse
import math
import sys

from reap.errors import ReapError

# replicate and graph counts above these take days and memory no machine has
MAX_REPLICATES = 100_000
MAX_NULLS = 1_000


def _m(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError("must be a positive finite number")
    return v


def _check(args: argparse.Namespace) -> None:
    """Bad numbers in the arguments are exit 2 before any statistics file is read."""
    for flag, v, top in (("--bootstrap", args.bootstrap, MAX_REPLICATES),
                         ("--permutations", args.permutations, MAX_REPLICATES),
                         ("--community-nulls", args.community_nulls, MAX_NULLS)):
        if not 0 <= v <= top:
            raise ReapError(f"{flag} {v}: need an integer in [0, {top}]")
    if not 0 < args.alpha < 1:
        raise ReapError("--alpha must be in (0, 1)")
    if not (math.isfinite(args.specialist_ratio) and args.specialist_ratio > 0):
        raise ReapError(f"--specialist-ratio {args.specialist_ratio}: need a positive finite number")
    if not (math.isfinite(args.min_load) and args.min_load >= 0):
        raise ReapError(f"--min-load {args.min_load}: need a finite number >= 0")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("stats", nargs="+",
                   help="statistics files, one per corpus (>= 2); a directory (e.g. a `reap "
                        "calibrate` --out) stands for its per-corpus files")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--top-m", type=_m, nargs="+", default=[0.25], metavar="M",
                   help="important-set sizes: integers, or fractions of n_experts (default 0.25)")
    p.add_argument("--criteria", nargs="+", default=["count", "reap_mass"],
                   choices=["count", "reap_mass"], help="what ranks experts (default both)")
    p.add_argument("--bootstrap", type=int, default=200, metavar="N",
                   help="bootstrap replicates over calibration sequences; 0 = none (default 200)")
    p.add_argument("--ci", default="basic", choices=["basic", "percentile"],
                   help="bootstrap interval type (default basic: bias-corrected)")
    p.add_argument("--permutations", type=int, default=100, metavar="P",
                   help="sequence shuffles for the specialist chance baseline (default 100)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alpha", type=float, default=0.05, help="significance level (default 0.05)")
    p.add_argument("--specialist-ratio", type=float, default=3.0,
                   help="specialist: used this many times more than by any other corpus")
    p.add_argument("--min-load", type=float, default=0.5,
                   help="minimum usage, as a multiple of the uniform rate top_k/n_experts")
    p.add_argument("--community-nulls", type=int, default=3, metavar="N",
                   help="random graphs per layer for the modularity chance level (default 3)")
    p.add_argument("--no-communities", action="store_true",
                   help="skip co-activation communities (the slowest part on large models)")
    p.add_argument("--no-plots", action="store_true", help="tables, JSON and report only")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    from reap.analyze.pipeline import analyze
    from reap.analyze.report import write_report
    from reap.fileio import check_out_dir

    _check(args)
    check_out_dir(args.out)
    result = analyze(args.stats, top_m=args.top_m, criteria=args.criteria,
                     bootstrap=args.bootstrap, ci_method=args.ci, seed=args.seed, alpha=args.alpha,
                     specialist_ratio=args.specialist_ratio, min_load=args.min_load,
                     permutations=args.permutations, communities=not args.no_communities,
                     community_nulls=args.community_nulls, progress=not args.quiet)
    files = write_report(result, args.out, with_plots=not args.no_plots, progress=not args.quiet)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    print(files.report)
    return 0
