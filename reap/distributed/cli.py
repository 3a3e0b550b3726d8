"""`reap calibrate` and `reap eval` as the command table (`reap.cli.COMMANDS`) registers them:
each stage's own command line plus `--ray [ADDRESS]` and `--workers`, which run the work on a
Ray cluster. The flags and their runners live here, above the stages, so no stage imports
`reap.distributed`; without `--ray` the stage's own `run` does the work."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from reap.calibrate import cli as calibrate_cli
from reap.distributed import GRACE, INSTALL, require_ray
from reap.errors import ReapError
from reap.eval import cli as eval_cli


def _add_ray(p: argparse.ArgumentParser, what: str, after: str, workers: str) -> None:
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help=f"run {what} on a Ray cluster (ADDRESS, default: RAY_ADDRESS or a new "
                        f"local one on 127.0.0.1{after}; needs {INSTALL}); SIGINT or SIGTERM "
                        f"stops the driver and its local cluster within {GRACE} s, exit 5")
    p.add_argument("--workers", type=int, default=2,
                   help=f"with --ray: {workers}, each within --budget (default 2)")


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    calibrate_cli.add_arguments(p)
    _add_ray(p, "the shards", "; give it after MODEL", "concurrent workers")
    p.add_argument("--layer-parallel", action="store_true",
                   help="with --ray: workers own contiguous layer ranges (weights resident) and "
                        "pass hidden states on, instead of each streaming every layer")


def run_calibrate(args: argparse.Namespace) -> int:
    """`--ray`: the same statistics files, computed by Ray workers."""
    if args.ray is None:
        return calibrate_cli.run(args)
    from reap.units import format_bytes

    kw = calibrate_cli.calibrate_kwargs(args)
    require_ray()
    from reap.distributed.calibrate import calibrate_ray

    if args.shard != "1/1":
        raise ReapError("--shard and --ray exclude each other (--ray makes the shards)")
    res = calibrate_ray(address=args.ray or None, workers=args.workers,
                        mode="layers" if args.layer_parallel else "tokens", **kw)
    peak = max(res.worker_peak_rss.values(), default=0)
    print(f"calibrated {res.tokens} tokens over {len(res.layers)} MoE layers on {res.workers} "
          f"Ray workers ({res.mode} mode, {res.shards} shards, {len(res.shards_run)} run now) "
          f"in {res.seconds:.1f} s; worker peak RSS {format_bytes(peak)}", file=sys.stderr)
    for name, path in res.files.items():
        print(f"{name}\t{path}")
    return 0


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    eval_cli.add_arguments(p)
    _add_ray(p, "the (build x domain) tasks", "", "tasks at once")


def run_eval(args: argparse.Namespace) -> int:
    """`--ray`: every uncached (build x domain) task as a Ray task, into the same cache."""
    if args.ray is None:
        return eval_cli.run(args)
    from reap.distributed.eval import ray_runner

    require_ray()
    if args.workers < 1:
        raise ReapError(f"--workers must be positive, got {args.workers}")
    return eval_cli.run(args, ray_runner(args.ray or None, args.workers))


CALIBRATE = SimpleNamespace(add_arguments=add_calibrate_arguments, run=run_calibrate)
EVAL = SimpleNamespace(add_arguments=add_eval_arguments, run=run_eval)
