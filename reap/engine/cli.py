"""`reap run`: generate text with the streaming engine under a memory budget.

    reap run [MODEL] --prompt "Hello" --max-tokens 32 --budget 8GB
    reap run MODEL --prompt-ids 1,2,3 --json
    reap run MODEL --prompts prompts.jsonl --preset laptop --out results.json

The memory plan is computed and printed (stderr) before any weight is read; a plan above 95 % of
the available memory is refused (exit 2). Output is text on stdout, or JSON with --json.
`--plan-only` reads no weight at all: the tensor table comes from the shard headers (a local
checkpoint or an http(s) URL) or, for a directory holding only config.json, from the family
layout, so a user sees the plan before downloading anything.
"""

from __future__ import annotations

import argparse
import json
import sys

from reap.defaults import default_model
from reap.engine.memory import PRESET_HELP, PRESETS
from reap.errors import EXIT_EXPERT_LOAD, ReapError, is_int
from reap.fileio import OVERWRITE_HELP, claim_out, write_atomic

RESIDENT_HELP = ("calibration statistics (a file or a `reap calibrate` output directory): the "
                 "experts they route most tokens to fill up to half the expert cache, never "
                 "evicted; the other slots follow the cache's policy. Output is unchanged")
MAX_THREADS = 4096  # torch takes a C int; more threads than this is a typo

EXIT_CODES = """exit codes:
  0  success
  1  tensor binding or forward failure (e.g. a trunk tensor missing from the checkpoint)
  2  bad arguments, unknown config, or a memory plan refused by the budget / available memory
  3  finished, but the result file (--out) could not be written
  4  finished, but at least one routed expert failed to load: the tokens are not trustworthy
     (the failed experts contributed nothing; stderr names the first, --json lists all)
  5  interrupted (Ctrl-C)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap run`."""
    p.epilog = EXIT_CODES
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or http(s) URL (default: the bundled k3-mini, "
                        "see reap/models/k3mini/MODEL_CARD.md)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (encoded with the model's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help="batch mode: one JSON object per line with 'prompt' (text) or 'ids', "
                          "optional max_tokens/temperature/top_p/seed/stop; all sequences "
                          "advance in lockstep so each weight read serves every sequence")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (CPU torch.Generator)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-text token until --max-tokens "
                        "(benchmarks, tests)")
    _add_engine_arguments(p)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Memory budget, context, device and output options of `reap run`."""
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--budget", help="RAM budget, e.g. 8GB or 512MiB (the whole process)")
    mem.add_argument("--preset", choices=list(PRESETS), help=PRESET_HELP)
    p.add_argument("--context", type=int, default=4096,
                   help="declared context (prompt + generated tokens) the KV cache is planned "
                        "for (default 4096)")
    p.add_argument("--max-prompt", type=int, default=32768, help="prompt length limit (32768)")
    p.add_argument("--max-generation", type=int, default=4096,
                   help="generation length limit (4096)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per forward pass (default: chosen by the plan)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 on a shared machine)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (auto: float32 for float32 checkpoints, else bfloat16)")
    p.add_argument("--resident-from", metavar="STATS", help=RESIDENT_HELP)
    p.add_argument("--direct", action="store_true",
                   help="read with O_DIRECT (bypass the page cache) where the filesystem allows")
    p.add_argument("--plan-only", action="store_true",
                   help="print the memory plan and stop, reading no weight (works on a URL or "
                        "a directory holding only config.json)")
    p.add_argument("--warmup", action="store_true",
                   help="generate once, unmeasured, before the reported run (as llama-bench's "
                        "warm-up run): one-time costs such as kernel builds and first use of "
                        "each matrix shape stay out of the rates")
    p.add_argument("--json", action="store_true", help="print text, token ids, plan and metrics")
    p.add_argument("--out", help="also write the JSON result to this file")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--quiet", action="store_true", help="do not print the plan and metrics")


def _requests(args, engine) -> list:
    from reap.engine.generate import OPTIONS, OptionError, Request, _encode, request_options

    defaults = {k: getattr(args, k) for k in OPTIONS}

    def req(prompt, **kw) -> Request:
        opts = request_options(kw, defaults, engine.max_generation)
        return Request(_encode(engine, prompt), **opts, ignore_eos=args.ignore_eos)

    if args.prompt is not None:
        return [req(args.prompt)]
    if args.prompt_ids is not None:
        try:
            return [req([int(t) for t in args.prompt_ids.split(",") if t.strip()])]
        except ValueError:
            raise ReapError(f"--prompt-ids must be comma-separated integers: {args.prompt_ids!r}")
    out = []
    for i, line in _lines(args.prompts):
        prompt, opts = _line(args.prompts, i, line)
        try:
            out.append(req(prompt, **opts))
        except OptionError as e:
            raise ReapError(f"{args.prompts}:{i}: {e}") from None
    return out


def _lines(path: str):
    try:
        with open(path) as f:
            lines = [(i, ln) for i, ln in enumerate(f, 1) if ln.strip()]
    except OSError as e:
        raise ReapError(f"{path}: cannot read prompts ({e.strerror})") from None
    if not lines:
        raise ReapError(f"{path}: no prompts")
    return lines


def _line(path: str, i: int, line: str) -> tuple:
    try:
        d = json.loads(line)
    except (ValueError, RecursionError) as e:
        raise ReapError(f"{path}:{i}: invalid JSON ({str(e) or 'nested too deeply'})") from None
    if not isinstance(d, dict) or ("prompt" in d) == ("ids" in d):
        raise ReapError(f"{path}:{i}: need an object with exactly one of 'prompt' or 'ids'")
    prompt = d.pop("prompt", None)
    prompt = d.pop("ids") if prompt is None else prompt
    unknown = set(d) - {"max_tokens", "temperature", "top_p", "seed", "stop"}
    if unknown:
        raise ReapError(f"{path}:{i}: unknown field(s) {', '.join(sorted(unknown))}")
    if not isinstance(prompt, (str, list)) or (
        isinstance(prompt, list) and not all(is_int(t) for t in prompt)
    ):
        raise ReapError(f"{path}:{i}: 'prompt' must be text and 'ids' a list of token ids")
    return prompt, d


def run(args: argparse.Namespace) -> int:
    """Open the engine, generate, print; returns the exit code (see EXIT_CODES)."""
    from reap.engine.core import Engine
    from reap.engine.generate import generate

    batch = len(_lines(args.prompts)) if args.prompts else 1
    if args.plan_only:
        return _plan_only(args, batch)
    if args.out:
        claim_out(args.out, args.overwrite)
    set_threads(args.threads)
    engine = Engine.open(args.model, budget=args.budget, preset=args.preset, context=args.context,
                         device=args.device, dtype=args.dtype, batch=batch,
                         prefill_chunk=args.prefill_chunk, direct=args.direct,
                         resident_from=args.resident_from,
                         max_prompt=args.max_prompt, max_generation=args.max_generation)
    with engine:
        if not args.quiet:
            print(engine.plan.describe(), file=sys.stderr)
        if args.warmup:
            generate(engine, None, requests=_requests(args, engine))
        gens, metrics = generate(engine, None, requests=_requests(args, engine))
        result = {
            "format": "reap.run/1",  # what `claim_out` recognises as reap's
            "model": engine.path,
            "fingerprint": engine.fingerprint,
            "generations": [g.as_dict() for g in gens],
            "plan": engine.plan.to_dict(),
            "metrics": metrics.as_dict(),
            "unit_seconds": dict(zip(engine.binding.unit_names, engine.unit_seconds)),
            "expert_failures": [list(f) for f in engine.expert_failures],
        }
        _print(args, gens, result, engine)
        if not args.quiet:
            print(metrics.describe(), file=sys.stderr)
        if args.out:
            write_atomic(args.out, json.dumps(result, indent=1) + "\n")
        if engine.expert_failures:
            f = engine.expert_failures
            raise ReapError(
                f"{len(f)} routed expert load(s) failed (first: layer {f[0][0]} "
                f"expert {f[0][1]}: {f[0][2]}); the output is not trustworthy",
                EXIT_EXPERT_LOAD,
            )
    return 0


def set_threads(threads: int | None) -> None:
    """--threads of run, eval and serve: torch's CPU threads (None: torch's choice); ReapError
    (exit 2) outside [1, MAX_THREADS]."""
    if threads is None:
        return
    if not 1 <= threads <= MAX_THREADS:
        raise ReapError(f"--threads {threads}: need an integer in [1, {MAX_THREADS}]")
    import torch

    torch.set_num_threads(threads)


def _plan_only(args: argparse.Namespace, batch: int) -> int:
    """Print the memory plan Engine.open would make for MODEL, reading no weight; exit 2 when
    the plan is above the available memory, as a run would be refused."""
    from reap.engine import memory
    from reap.engine.binding import plan_checkpoint

    model, config, tensors = _plan_tensors(args.model)
    plan = plan_checkpoint(config, tensors, model, args.dtype, args.budget, args.preset,
                           args.context, batch, args.prefill_chunk)[-1]
    if args.json:
        print(json.dumps({"model": model, "plan": plan.to_dict()}, indent=1))
    elif not args.quiet:
        print(plan.describe(), file=sys.stderr)
    memory.check_available(plan)
    return 0


def _plan_tensors(model: str | None) -> tuple[str, dict, dict]:
    """(model, config, name -> tensor with shape/dtype/nbytes) for a plan without weights: a
    checkpoint's (or URL's) shard headers, or a config-only directory's family layout (its
    index, if any, checked against the layout as `reap info` checks it)."""
    from reap.sizes import check_index, layout, resolve_source

    model = default_model() if model is None else model
    src = resolve_source(str(model))
    if src.config_only is None:
        from reap.checkpoint import open_checkpoint

        with open_checkpoint(model) as ck:
            return str(model), ck.config, dict(ck.tensors.items())
    from reap.models import family

    fam = family(src.config)
    specs = layout(src.config)
    check_index(src.config_only, specs, fam.__name__.rsplit(".", 1)[-1])
    from reap.checkpoint.config_only import LayoutTable

    return str(model), src.config, LayoutTable(specs)


def _print(args, gens, result: dict, engine) -> None:
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for g in gens:
            print(g.text if engine.tokenizer is not None else ",".join(map(str, g.ids)))
