"""`reap eval`: compare builds side by side against a reference.

    reap eval runs/zh runs/en+code --reference runs/full --corpus zh,en,code --out runs/eval
    reap eval small=runs/a --reference runs/full --corpus zh --max-docs 20 --gen-tokens 64
    reap eval runs/zh --reference runs/full --tasks arc_easy,hellaswag --task-limit 500 --out e

Per corpus (held-out eval split): next-token loss and perplexity with bootstrap intervals, the
ratio to the reference, top-1 agreement and KL(reference || build). Per prompt domain: greedy
generations side by side with repetition, script and code-validity metrics. Writes results.json,
report.md, generations.md, report.html and plots/ under --out; results are cached per build in
<out>/cache, so re-running (or adding a build) only computes what is new.
"""

from __future__ import annotations

import argparse
import inspect

from reap.engine.cli import set_threads
from reap.engine.memory import PRESETS
from reap.errors import ReapError

EXIT_CODES = """exit codes: 0 ok, 1 binding or forward failure, 2 bad arguments or input (or a
memory plan refused), 3 a result file could not be written, 4 a routed expert failed to load
(report written, marked untrustworthy, not cached), 5 interrupted"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap eval`."""
    p.epilog = EXIT_CODES
    p.add_argument("builds", nargs="+", metavar="BUILD",
                   help="checkpoint directory to compare (LABEL=DIR names its column)")
    p.add_argument("--reference", required=True, metavar="FULL",
                   help="the reference checkpoint (its tokenizer encodes documents and prompts)")
    p.add_argument("--corpus", default="",
                   help="comma-separated corpora whose eval split is scored, e.g. zh,en,code "
                        "(`reap corpora list`); empty: generations only")
    p.add_argument("--out", required=True, help="output directory (cache in OUT/cache)")
    p.add_argument("--max-docs", type=int, default=None,
                   help="documents per corpus (first N in a fixed hash order; default all)")
    p.add_argument("--max-tokens-per-doc", type=int, default=512,
                   help="tokens read per document (default 512)")
    p.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                   help='prompt set, one {"id","domain","prompt"} per line (default: the '
                        "shipped sets in corpora/prompts)")
    p.add_argument("--gen-domains", default=None,
                   help="comma-separated prompt domains to generate for (default: all)")
    p.add_argument("--gen-tokens", type=int, default=64,
                   help="tokens generated per prompt, greedy (default 64; 0: no generations)")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval tasks run on every "
                   "column, e.g. arc_easy,hellaswag (needs reap[bench]; 2048-token contexts, "
                   "greedy); scores with value +- 1.96 lm-eval stderr. lm-eval's own CLI with "
                   "model reap: python -m reap.eval.harness --model reap --model_args ...")
    p.add_argument("--task-path", metavar="DIR", help="more lm-eval task YAMLs (--include_path)")
    p.add_argument("--task-limit", type=int, help="documents per task (default all)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--budget", help="RAM budget of the whole process, e.g. 64GB (split "
                                      "between the reference and the build being evaluated)")
    mem.add_argument("--preset", choices=list(PRESETS),
                     help="engine memory preset, applied to each engine")
    p.add_argument("--bootstrap", type=int, default=1000,
                   help="bootstrap replicates for the intervals (default 1000; 0: none)")
    p.add_argument("--batch", type=int, default=4, help="documents scored in lockstep (4)")
    p.add_argument("--gen-batch", type=int, default=16, help="prompts decoded in lockstep (16)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: float32 for float32 checkpoints, else bfloat16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (faster)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _positive(name: str, v: int | None, zero_ok: bool = False) -> None:
    if v is not None and (v < 0 or (v == 0 and not zero_ok)):
        raise ReapError(f"{name} must be {'non-negative' if zero_ok else 'positive'}, got {v}")


def _list(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def run(args: argparse.Namespace, run_tasks=None) -> int:
    """Run the evaluation and print where the report is; returns the exit code. `run_tasks`:
    `evaluate`'s (`reap eval --ray` passes Ray's: `reap.distributed.cli`)."""
    from reap.eval.pipeline import evaluate
    from reap.fileio import check_out_dir

    for name in ("max_docs", "max_tokens_per_doc", "batch", "gen_batch", "task_limit"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    for name in ("gen_tokens", "bootstrap"):
        _positive("--" + name.replace("_", "-"), getattr(args, name), zero_ok=True)
    check_out_dir(args.out)
    set_threads(args.threads)
    kw = {k: v for k, v in vars(args).items() if k in inspect.signature(evaluate).parameters}
    kw.update(corpora=_list(args.corpus) or [], gen_domains=_list(args.gen_domains),
              tasks=_list(args.tasks) or [], progress=not args.quiet, plots=not args.no_plots)
    results = evaluate(**kw, run_tasks=run_tasks)  # the flags spelled as its arguments as is
    c = results["cache"]
    print(f"{args.out}/report.md  ({c['hits']} cached, {c['misses']} computed results)")
    return 0
