"""lm-eval-harness on the streaming engine: `ReapLM`, lm-eval's model `reap`.

    python -m reap.eval.harness --model reap --model_args pretrained=BUILD,budget=64GB \\
        --tasks arc_easy,hellaswag --batch_size 4        # lm-eval's own CLI, arguments as given
    scores = run_benchmarks(engine, ["arc_easy"], limit=100)    # what `reap eval --tasks` runs

lm-eval 0.4 reads no plugin entry points, so its `lm_eval` command cannot see an outside model;
importing this module registers it (`simple_evaluate(model="reap")`). model_args: pretrained,
budget or preset, max_length (2048), max_gen_toks (256), dtype; --batch_size sequences run in
lockstep. Contexts are cut on the left as lm-eval's `hf` model cuts them; decoding is greedy.
"""

from __future__ import annotations

import functools
import sys

import torch

from reap.errors import ReapError
from reap.eval.quality import lockstep_logits

MISSING = "lm-eval is not installed: pip install 'reap[bench]'"
try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as e:
    if __name__ == "__main__":
        sys.exit(f"reap: error: {MISSING} ({e})")
    raise ReapError(f"{MISSING} ({e})") from None


@register_model("reap")
class ReapLM(TemplateLM):
    """lm-eval's LM on an `Engine` (opened here from `pretrained`, or given as `engine`)."""

    def __init__(self, pretrained=None, budget=None, preset=None, max_length=2048,
                 max_gen_toks=256, batch_size=1, max_batch_size=None, device=None, dtype="auto",
                 engine=None, **unknown):
        super().__init__()
        if unknown:
            raise ReapError(f"model_args {', '.join(unknown)}: not an argument of model reap")
        self.batch = int(batch_size) if str(batch_size).isdigit() else 4  # "auto": 4
        self.max_gen_toks = int(max_gen_toks)
        if engine is None:
            from reap.engine import Engine

            if device is None or (device.startswith("cuda") and not torch.cuda.is_available()):
                device = "cpu"  # lm-eval's default is cuda:0, as its `hf` model falls back
            engine = Engine.open(pretrained, budget=budget, preset=preset, device=device,
                                 context=int(max_length), dtype=dtype, batch=self.batch,
                                 max_generation=int(max_length))
        if engine.tokenizer is None or engine.tokenizer.eos_id is None:
            raise ReapError(f"{engine.path}: lm-eval needs a tokenizer with an end-of-text id")
        self.engine, self.max_length = engine, engine.context

    @property
    def eot_token_id(self) -> int:
        return self.engine.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.engine.tokenizer.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """(log p(continuation | context), greedy?) of ((context, continuation) | None,
        context ids, continuation ids) requests, longest first in lockstep batches."""
        out: list = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        for j in range(0, len(order), self.batch):
            idx = order[j : j + self.batch]
            seqs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1) :] for i in idx]
            lens = [len(requests[i][2]) for i in idx]
            for i, s in zip(idx, continuation_scores(self.engine, seqs, lens)):
                out[i] = s
        return self._cached("loglikelihood", [r[0] for r in requests], out)

    def _cached(self, kind: str, args: list, results: list) -> list:
        """`results`, handed to lm-eval's --use_cache too (requests with args)."""
        for a, r in zip(args, results):
            if a is not None:
                self.cache_hook.add_partial(kind, a, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihoods in lm-eval's disjoint windows of max_length tokens."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows = [(i, (None, *make_disjoint_window(w))) for i, r in enumerate(requests) for w in
                   get_rolling_token_windows(self.tok_encode(r.args[0]), self.prefix_token_id,
                                             self.max_length, 1)]
        sums = [0.0] * len(requests)
        for (i, _), (ll, _) in zip(windows, self._loglikelihood_tokens([w for _, w in windows])):
            sums[i] += ll
        return self._cached("loglikelihood_rolling", [r.args for r in requests], sums)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations in lockstep batches, cut before the first stop string."""
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        from reap.engine.generate import Request, generate

        reqs = []
        for context, kw in (r.args for r in requests):
            kw = normalize_gen_kwargs(dict(kw), self.max_gen_toks)
            n = kw["max_gen_toks"]
            if kw.get("do_sample") or not 0 < n < self.max_length:
                raise ReapError(f"generation {kw}: reap decodes greedily, with "
                                f"0 < max_gen_toks < max_length ({self.max_length})")
            ids = self.tok_encode(context)[-(self.max_length - n) :] or [self.prefix_token_id]
            stop = tuple(handle_stop_sequences(kw.get("until"), eos=None))
            reqs.append(Request(ids, n, 0.0, 1.0, 0, stop))
        out = [g.text for j in range(0, len(reqs), self.batch)
               for g in generate(self.engine, None, requests=reqs[j : j + self.batch])[0]]
        return self._cached("generate_until", [r.args for r in requests], out)


def continuation_scores(engine, seqs: list[list[int]], n_cont: list[int]) -> list[tuple]:
    """(sum of log-probabilities, all greedy?) of the last n_cont[k] ids of each sequence given
    the ids before them, streamed in lockstep (float64 log-softmax of the rows needed)."""
    sums = [[0.0, True] for _ in seqs]
    for k, pos, (logits,) in lockstep_logits([engine], seqs):
        lo = max(len(seqs[k]) - 1 - n_cont[k] - pos, 0)  # the chunk's first continuation row
        if lo < len(logits):
            rows = torch.log_softmax(logits[lo:].double(), dim=-1)  # [n, V]
            targets = torch.tensor(seqs[k][pos + lo + 1 : pos + 1 + len(logits)])  # [n]
            sums[k][0] += float(rows.gather(1, targets[:, None]).sum())
            sums[k][1] &= bool((rows.argmax(-1) == targets).all())
    return [tuple(s) for s in sums]


@functools.lru_cache(maxsize=4)
def task_manager(task_path: str | None, tasks: tuple[str, ...]):
    """lm-eval's TaskManager that knows `tasks` (indexing lm-eval's own ~15k tasks takes
    seconds: only the YAMLs under `task_path` when they hold them all); ReapError naming the
    first unknown task."""
    from lm_eval.tasks import TaskManager

    for defaults in [False] * (task_path is not None) + [True]:
        manager = TaskManager(include_path=task_path, include_defaults=defaults)
        unknown = [t for t in tasks if t not in manager.all_tasks]
        if not unknown:
            return manager
    raise ReapError(f"unknown lm-eval task {unknown[0]!r} (`lm-eval ls tasks`; or give "
                    f"--task-path DIR with its YAML)")


def run_benchmarks(engine, tasks: list[str], task_path: str | None = None,
                   limit: int | None = None, batch: int = 4, bootstrap: int = 1000) -> dict:
    """lm-eval `tasks` (names, or those under `task_path`) on an open engine, the first `limit`
    documents of each: {task: {"samples": n, "metrics": {metric: [value, stderr or None]}}}."""
    from lm_eval import simple_evaluate

    lm = ReapLM(engine=engine, batch_size=batch)
    manager = task_manager(task_path, tuple(tasks))
    try:
        res = simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager,
                              bootstrap_iters=bootstrap, log_samples=False, verbosity="ERROR")
    except (OSError, ValueError) as e:  # a dataset that cannot be read, a bad task YAML
        raise ReapError(f"lm-eval: {(str(e) or type(e).__name__).splitlines()[0]}") from None
    out = {}
    for task, r in res["results"].items():  # "acc,none" and "acc_stderr,none" (N/A: none)
        keys = [k for k, v in r.items() if "," in k and "_stderr," not in k
                and isinstance(v, int | float)]
        se = {k: r.get(k.replace(",", "_stderr,", 1)) for k in keys}
        se = {k: float(v) if isinstance(v, int | float) else None for k, v in se.items()}
        out[task] = {"samples": res["n-samples"].get(task, {}).get("effective"), "metrics": {
            k.removesuffix(",none"): [float(r[k]), se[k]] for k in keys}}
    return out


def main() -> int:
    """lm-eval's CLI (sys.argv as given) with model `reap` registered; ReapError in one line."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except ReapError as e:
        print(f"reap: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
