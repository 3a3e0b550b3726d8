"""The `reap` command: one entry point that dispatches to each stage's subcommand.

Each subcommand lives with the stage that does the work as `add_arguments(parser)` and
`run(args) -> int` (the exit code), of a module or, written `module:NAME`, of the object NAME in
it. Modules are imported only when their subcommand runs, so `reap --help` stays fast and a
broken optional stage cannot break the others. A `reap.errors.ReapError` is printed as one line
with its exit code (EPILOG). Integer arguments are checked here for every subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from reap import __version__
from reap.errors import EXIT_FAILURE, EXIT_INTERRUPTED, ReapError

SEED_LIMIT = 2**32  # numpy's legacy RandomState and scikit-learn take seeds below this
INT_LIMIT = 2**63  # torch, numpy and C sizes: larger integers overflow

# name -> (module, or module:NAME, and a one-line help). Order is the order `reap --help` lists.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("reap.info_cli", "parameter and byte census of a checkpoint or built-in config"),
    "synth": ("reap.synth", "write a random but valid checkpoint of a built-in config"),
    "corpora": ("reap.corpora.cli", "list, build and inspect calibration/evaluation corpora"),
    "calibrate": ("reap.distributed.cli:CALIBRATE", "stream corpora through a model, record expert statistics"),
    "stats": ("reap.stats.cli", "inspect and merge expert statistics files"),
    "analyze": ("reap.analyze.cli", "expert overlap between corpora against chance, clusters, plots"),
    "plan": ("reap.prune.cli:PLAN", "choose the experts to keep (criteria, budgets, target size)"),
    "prune": ("reap.prune.cli:PRUNE", "write a pruned checkpoint from a plan, kept experts bit-identical"),
    "verify": ("reap.prune.cli:VERIFY", "check a pruned checkpoint against its source"),
    "run": ("reap.engine.cli", "generate text with the streaming engine under a memory budget"),
    "serve": ("reap.serve.cli", "OpenAI-compatible HTTP server on the streaming engine"),
    "eval": ("reap.distributed.cli:EVAL", "compare builds side by side: perplexity, agreement, generations"),
}

# Commands whose compiled kernels (reap.quant.step_kernel's thread pool) take turns with torch's
# OpenMP threads: those spin after each torch op (GNU OpenMP's default: 300,000 loops, several
# ms) and hold the cores the pool's next call needs; set before torch is imported, a user's
# own value wins (experiments/bench_llamacpp.py measures the engine commands with it)
OPENMP_SPIN = ("run", "serve", "eval")
GOMP_SPINCOUNT = "10000"

# command -> its model arguments, where a Hub repo ORG/NAME[@REV] is resolved (reap.checkpoint.hub)
MODEL_ARGS = {"info": ("model",), "plan": ("model", "config"), "calibrate": ("model",),
              "prune": ("model",), "verify": ("pruned", "source"), "run": ("model",),
              "serve": ("model",), "eval": ("builds", "reference")}
EPILOG = """MODEL: a Hub repo ORG/NAME[@REVISION] (a local path of that name wins), a local
directory, or an http(s) URL.
exit codes: 0 ok, 1 runtime failure, 2 bad arguments or input, 3 result not written,
4 a routed expert failed to load (output untrustworthy), 5 interrupted"""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser; with `only`, import just that subcommand's module."""
    parser = argparse.ArgumentParser(
        prog="reap", description="Prune the experts of Mixture-of-Experts language models.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"reap {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (target, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if only == name:
            module, _, attr = target.partition(":")
            command = importlib.import_module(module)
            command = getattr(command, attr) if attr else command
            command.add_arguments(p)
            if name in ("run", "serve"):
                p.add_argument("--no-download", action="store_true", help="a Hub MODEL not in "
                               "the Hub cache: read tensors by HTTP ranges as needed instead")
            p.set_defaults(_run=command.run)
    return parser


def check_integers(args: argparse.Namespace) -> None:
    """Bad input, before any work: a seed outside [0, 2^32) or an integer beyond 64 bits."""
    for name, value in vars(args).items():
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        flag = "--" + name.replace("_", "-")
        if name == "seed" and not 0 <= value < SEED_LIMIT:
            raise ReapError(f"{flag} {value}: need an integer in [0, 2^32)")
        if abs(value) >= INT_LIMIT:
            raise ReapError(f"{flag} {value}: out of range (beyond 64 bits)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `reap` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    only = next((a for a in argv if not a.startswith("-")), None)
    if only in OPENMP_SPIN:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    try:
        parser = build_parser(only if only in COMMANDS else None)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0 if not argv else 2
        check_integers(args)
        if args.command in MODEL_ARGS:
            from reap.checkpoint.hub import resolve_args

            resolve_args(args, MODEL_ARGS[args.command])
        return int(args._run(args) or 0)
    except ReapError as e:
        print(f"reap: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("reap: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        sys.stderr.close()
        return 0
    except MemoryError:
        print("reap: error: out of memory (lower --budget or the batch size)", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # a bug, not bad input: still one line unless asked for more
        if os.environ.get("REAP_DEBUG"):
            raise
        print(f"reap: error: internal error: {type(e).__name__}: {e} "
              "(set REAP_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
