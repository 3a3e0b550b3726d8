"""`calibrate(...)`: resolve the model and corpus, plan memory, resume or start, run the layer loop
(`reap.calibrate.runner`), and write the statistics with provenance.

The default model (no MODEL given) is the bundled one; until a trained model ships, that is a
k3-tiny synthesized on first use into the cache directory (`$REAP_CACHE`, else
`$XDG_CACHE_HOME/reap`, else `~/.cache/reap`) under `models/k3-tiny`.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from reap.calibrate import artifacts as art
from reap.calibrate import runner
from reap.calibrate.accumulate import OutputProbe, StatsAccumulator
from reap.calibrate.memory import plan_batches
from reap.calibrate.spill import SpillStore
from reap.checkpoint import Checkpoint
from reap.defaults import default_model as _default_model
from reap.errors import ReapError
from reap.memstat import peak_rss
from reap.provenance import code_version

if TYPE_CHECKING:
    from reap.models.checks import FiniteGuard
    from reap.sizes import SizeModel

# progress in whole calibrated tokens (token-layers scaled by 1/layers), tokens/s and ETA
_BAR = "{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} tok [{elapsed}<{remaining}, " \
    "{rate_fmt}{postfix}]"
# seq_count [S, L, E] int32 is recorded automatically up to this size
SEQ_COUNT_AUTO_BYTES = 256 << 20


@dataclass
class ModelSetup:
    """A checked checkpoint ready to calibrate (`setup_model`): family module and config, tensor
    layout, size facts, the model (weights pulled per layer), its dtype and device, and the guard
    that checks every weight read is finite."""

    fam: ModuleType
    cfg: Any
    specs: list
    size: SizeModel
    model: Any
    dtype: torch.dtype
    device: torch.device
    guard: FiniteGuard


def default_model(log=print) -> str:
    """Path of the default model (see `reap.defaults`), announcing a synthesized fallback."""
    return _default_model(log)


def calibrate(*, corpus: str, tokens: int, seq_len: int, out: str, model: str | None = None,
              budget: int = 4_000_000_000, device: str = "cpu", dtype: str = "float32",
              seed: int = 0, batch: int | None = None, save_token_experts: bool = False,
              seq_counts: bool | None = None, shard: tuple[int, int] = (1, 1),
              max_pass_seqs: int | None = None, progress: bool = True,
              hooks=None, observe=None, merge_stats: int = 0) -> runner.CalibrateResult:
    """Stream `tokens` calibration tokens of corpus mixture `corpus` (e.g. "zh:3+code:1")
    through `model` in sequences of `seq_len` and write per-corpus expert statistics to `out`.

    budget: bytes of RSS to stay within (see `reap.calibrate.memory`). seq_counts: record
    per-sequence counts (None: when they take at most 256 MB). shard (k, n): only the k-th of n
    contiguous parts of the sampled sequences (merge the parts with `reap stats merge`).
    max_pass_seqs: cap the sequences per MLP pass below what the budget allows (tests use it
    to force several passes). merge_stats N > 0: also what expert merging needs (see
    `reap.calibrate.cli.MERGE_STATS_HELP`), every expert run on about N sampled tokens.
    hooks(layer) runs after each committed layer; observe(record, corpus index [N]) receives
    every MoE record (`StatsAccumulator.record_sink`), with `MoERecord.gram` when `observe` has
    `wants_gram` true (not in the memory plan: N*K*Dl fp32 per MLP pass). Re-running with the
    same arguments resumes after the last completed layer. Returns what was written and measured.
    """
    t0 = time.perf_counter()
    from reap.corpora import corpus_fingerprint, parse_spec

    names = [name for name, _ in parse_spec(corpus)]  # unknown corpora fail before model work
    runner.check_lengths({}, tokens, seq_len)
    if model is None:
        model = default_model(lambda m: print(m, file=sys.stderr))
    path = os.path.abspath(model)
    ckpt = Checkpoint.open(path)
    try:
        setup = setup_model(ckpt, path, tokens, seq_len, device, dtype)
        seqs, (s0, s1) = _sequences(corpus, path, tokens, seq_len, seed, shard)
        if seq_counts is None:
            size = setup.size
            seq_counts = len(seqs) * len(size.moe_layers) * size.n_experts * 4 \
                <= SEQ_COUNT_AUTO_BYTES
        args = {"model": path, "corpus": corpus, "tokens": tokens, "seq_len": seq_len,
                "seed": seed, "budget": budget, "device": device, "dtype": dtype, "batch": batch,
                "shard": list(shard), "save_token_experts": save_token_experts,
                "seq_counts": seq_counts, "max_pass_seqs": max_pass_seqs,
                **({"merge_stats": merge_stats} if merge_stats else {})}
        identity = {"arguments": args, "model": ckpt.fingerprint(),
                    "corpus_sha256": corpus_fingerprint(corpus, art.SPLIT),
                    "code_version": code_version(art.RESULT_CODE), "sequences": [s0, s1]}
        ids = torch.tensor([s.ids for s in seqs], dtype=torch.int64)  # [S, T]
        run = _make_run(ckpt, setup, ids, [names.index(s.corpus) for s in seqs], len(names),
                        identity, out, budget, batch, seq_counts, save_token_experts)
        run.acc.record_sink = observe
        run.acc.wants_gram = bool(getattr(observe, "wants_gram", False))
        return _execute(run, setup, seqs, names, progress, hooks, t0)
    finally:
        ckpt.close()


def _sequences(corpus: str, path: str, tokens: int, seq_len: int, seed: int,
               shard: tuple[int, int]) -> tuple[list, tuple[int, int]]:
    """This shard's calibration sequences and their range [s0, s1) among all sampled ones."""
    from reap.corpora import calibration_sequences
    from reap.tokenizer import load_tokenizer

    seqs = calibration_sequences(corpus, load_tokenizer(path), tokens, seq_len, seed)
    s0, s1 = runner.resolve_shard(shard, len(seqs))
    if s0 == s1:
        raise ReapError(f"--shard {shard[0]}/{shard[1]} holds no sequences")
    return seqs[s0:s1], (s0, s1)


def setup_model(ckpt, path: str, tokens: int, seq_len: int, device: str,
                dtype: str) -> ModelSetup:
    """Family, model, layout and size facts of the checkpoint (bad input -> ReapError)."""
    from reap.models.checks import FiniteGuard, check_binding
    from reap.models import load_config
    from reap.sizes import SizeModel

    if not ckpt.config:
        raise ReapError(f"{path}: no config.json: not a model checkpoint")
    fam, cfg = load_config(ckpt.config, path)  # the checks `reap run` makes
    runner.check_lengths(ckpt.config, tokens, seq_len)
    specs = fam.layout(ckpt.config)
    check_binding(ckpt.tensors, fam, ckpt.config, path, specs)
    size = SizeModel.from_layout(specs, fam, ckpt.config)
    if not size.moe_layers:
        raise ReapError(f"{path}: the model has no MoE layers to calibrate")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ReapError("--device cuda: no CUDA device is available")
    if dtype not in ("float32", "bfloat16"):
        raise ReapError(f"--dtype must be float32 or bfloat16, got {dtype!r}")
    tdtype, guard = getattr(torch, dtype), FiniteGuard(fam, cfg, specs, path)
    last, counted = max(size.moe_layers), (ckpt.bytes_read, ckpt.reads)
    for s in specs:  # norms calibration never reads (after the last MoE layer): as `run` does
        if s.name in guard.pending and (s.layer is None or s.layer > last):
            guard(s.name, ckpt.read(s.name))
    ckpt.bytes_read, ckpt.reads = counted  # a check, not calibration's reads (resume-stable)
    model = fam.Model(cfg, device=device, dtype=tdtype)
    return ModelSetup(fam, cfg, specs, size, model, tdtype, torch.device(device), guard)


def _make_run(ckpt, setup, ids, seq_corpus, n_corpora, identity, out, budget, batch, seq_counts,
              save_token_experts) -> runner.Run:
    """Plan memory, then open a fresh work directory or resume the one in `out`."""
    size, fam = setup.size, setup.fam
    widths = fam.calibration_widths(setup.cfg, max(size.moe_layers) + 1)
    S, T = ids.shape
    plan = plan_batches(
        weight_bytes=runner.weight_sizes(ckpt, setup.specs, setup.dtype.itemsize),
        hidden=widths.hidden, heads=widths.heads, dense_ffn=widths.dense_ffn,
        n_experts=size.n_experts, top_k=size.top_k, n_blocks=widths.snapshots, n_seq=S,
        seq_len=T, budget=budget, batch=batch,
        max_pass_seqs=identity["arguments"]["max_pass_seqs"])
    work = os.path.join(out, ".work")
    prog = art.read_json(os.path.join(work, "progress.json"))
    if prog is None and os.path.exists(os.path.join(out, "all.safetensors")):
        raise ReapError(f"{out} already holds finished statistics; choose another --out")
    if prog is not None and prog["identity"] != identity:
        diff = runner.identity_diff(prog["identity"], identity)
        raise ReapError(f"{out} holds an unfinished run with different arguments ({diff}); "
                        f"rerun with the same arguments to resume, or delete {work}")
    if prog is None:
        runner.cleanup_work(work)
        store = SpillStore(work, S)
    else:
        store = SpillStore.from_manifest(work, S, prog["store"])
        store.cleanup()  # files of the layer that was interrupted
    expert_names = functools.partial(fam.expert_tensor_names, setup.cfg)  # (layer, expert)
    merge_stats = identity["arguments"].get("merge_stats", 0)
    acc = StatsAccumulator(size.n_experts, size.top_k, seq_corpus, T, n_corpora, seq_counts,
                           prob_gram=merge_stats > 0)
    run = runner.Run(ckpt=ckpt, model=setup.model, moe_layers=size.moe_layers, ids=ids,
                     plan=plan, store=store, acc=acc,
                     weights=runner.LayerWeights(ckpt, setup.device, setup.guard),
                     experts=runner.StoreExperts(ckpt, expert_names, setup.device,
                                                 fam.expert_matrices),
                     work=work, identity=identity, device=setup.device)
    if merge_stats:
        run.experts.probe = OutputProbe(acc, max(1, S * T // merge_stats))
    run.done = -1 if prog is None else prog["done"]
    if prog is not None:
        run.counters = dict(prog["counters"])
    if save_token_experts:
        run.token_experts = art.TokenExperts(work, S * T, size.top_k)
        acc.ids_sink = run.token_experts.write
    return run


def _execute(run: runner.Run, setup, seqs, names, progress, hooks, t0) -> runner.CalibrateResult:
    """Run the remaining layers with a progress bar, then write the final artifacts."""
    from tqdm import tqdm

    S, T = run.ids.shape
    n_layers = max(run.moe_layers) + 1
    resumed = run.done if run.done >= 0 else None
    run.bar = tqdm(total=n_layers * S * T, initial=(run.done + 1) * S * T, unit="tok",
                   unit_scale=1 / n_layers, desc="calibrate", disable=not progress,
                   dynamic_ncols=True, smoothing=0.1, bar_format=_BAR)
    try:
        runner.run_layers(run, run.done if run.done < 0 else run.done + 1, hooks)
    finally:
        run.bar.close()
        run.store.close()
    result = _write(run, setup, seqs, names)
    result.resumed_after, result.seconds = resumed, time.perf_counter() - t0
    result.peak_rss, result.timing = peak_rss(), dict(run.timing)
    art.write_json(os.path.join(os.path.dirname(run.work), "run.json"),
                   {"seconds": result.seconds, "peak_rss": result.peak_rss,
                    "tokens_per_second": result.tokens / max(result.seconds, 1e-9),
                    "resumed_after": resumed, "plan": run.plan.__dict__, "timing": run.timing,
                    "estimated_peak_rss": run.plan.estimate_peak(), "files": result.files})
    runner.cleanup_work(run.work)
    return result


def _write(run: runner.Run, setup, seqs, names) -> runner.CalibrateResult:
    """Statistics files (and token ids) with provenance; returns the result record."""
    S, T = run.ids.shape
    out, size, c = os.path.dirname(run.work), setup.size, run.counters
    ckpt_bytes = sum(t.nbytes for t in run.ckpt.tensors.values())
    counts = [sum(1 for s in seqs if s.corpus == n) for n in names]
    metas, run_meta = art.stats_metas(run.identity, T, names, counts, {
        **c, "checkpoint_bytes": ckpt_bytes, "passes": run.plan.passes})
    files = art.write_stats(out, run.work, names=names, layers=run.moe_layers,
                            n_experts=size.n_experts, top_k=size.top_k,
                            tokens=[k * T for k in counts], metas=metas, run_meta=run_meta)
    tok = None
    if run.token_experts is not None:
        meta = {**run_meta, "corpora": names, "doc_ids": [s.doc_id for s in seqs]}
        tok = run.token_experts.assemble(os.path.join(out, "token_experts.safetensors"),
                                         run.moe_layers, [names.index(s.corpus) for s in seqs],
                                         meta)
    return runner.CalibrateResult(out, files, tok, S * T, list(run.moe_layers), c["bytes_read"],
                             ckpt_bytes, c["expert_reads_max"], run.plan.passes, None, 0.0, 0,
                             run.plan)
