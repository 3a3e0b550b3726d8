"""Layer-major, expert-major calibration over a checkpoint store (`calibrate`).

Every calibration token passes layer L before layer L+1 is touched, so each layer's trunk
weights are read once and held only while that layer runs. Per layer:

1. attention: for each batch of sequences, load its hidden state from the spill, run
   `model.attn_block`, and store the new state and the MLP input x;
2. MLP (MoE layers): for each pass (as many sequences as the budget allows, normally all), run
   `model.mlp_block` on every token of the pass at once: the model groups tokens by routed expert,
   and the `StoreExperts` source reads each expert from the checkpoint at most once per pass while
   the `StatsAccumulator` observer records the routing; then `finish_layer` per batch;
3. commit: the spill generation, the layer's statistics rows and the progress record are
   written atomically, so a crash or Ctrl-C resumes at the next layer with identical results.

Dimension letters: S sequences, T seq_len, D hidden, E n_experts, K top_k.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field

import torch

from reap.calibrate import artifacts as art
from reap.calibrate.accumulate import StatsAccumulator
from reap.calibrate.memory import BatchPlan
from reap.calibrate.spill import SpillStore, state_arrays, state_from_arrays
from reap.checkpoint import Checkpoint
from reap.checkpoint.spec import is_quantized
from reap.errors import CheckpointError, ExpertLoadError, ReapError
from reap.memstat import release_memory
from reap.models.base import expert_short_names
from reap.models.validate import text_of
from reap.quant.matrix import check_matrices


@dataclass
class CalibrateResult:
    """What a calibration run wrote and measured."""

    out: str
    files: dict[str, str]  # corpus name -> statistics file, plus "all" -> their merge
    token_experts: str | None
    tokens: int
    layers: list[int]  # MoE layers recorded
    bytes_read: int  # checkpoint bytes read over the whole run (resumed runs included)
    checkpoint_bytes: int
    expert_reads_max: int  # most reads of one expert within one pass of one layer
    passes: int
    resumed_after: int | None  # the layer an interrupted run was resumed after, else None
    seconds: float
    peak_rss: int
    plan: BatchPlan | None = None
    timing: dict = field(default_factory=dict)  # seconds per phase in this process

    @property
    def read_ratio(self) -> float:
        return self.bytes_read / max(self.checkpoint_bytes, 1)


class LayerWeights:
    """Weight getter over the store that caches what the current layer asked for (`clear` at
    the end of each layer), so a layer's trunk tensors are read once whatever the batching."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, guard=None):
        self.ckpt, self.device, self.cache = ckpt, device, {}
        self.guard = guard or (lambda name, tensor: None)  # a reap.models.checks.FiniteGuard

    def __call__(self, name: str) -> torch.Tensor:
        t = self.cache.get(name)
        if t is None:
            t = self.ckpt.read(name, self.device)
            self.guard(name, t)  # NaN/Inf in a norm or router: exit 2 before any statistic
            self.cache[name] = t
        return t

    def clear(self) -> None:
        """Drop the cached tensors (end of a layer)."""
        self.cache.clear()


class StoreExperts:
    """ExpertSource reading one routed expert's tensors with one coalesced read, counting reads
    per (layer, expert) within the current pass; `names(layer, expert)` lists an expert's
    tensors (the family's `expert_tensor_names` for this config)."""

    def __init__(self, ckpt: Checkpoint, names, device: torch.device, matrices_of=None):
        self.ckpt, self.names, self.device = ckpt, names, device
        self.matrices_of = matrices_of  # the family's expert_matrices: codecs check their bytes
        self.pass_reads: dict[tuple[int, int], int] = {}
        self.max_reads = 0
        self.total = 0
        self.probe = None  # an OutputProbe (--merge-stats)

    def new_pass(self) -> None:
        """Start counting reads of a new MLP pass."""
        self.pass_reads = {}

    def __call__(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        names = self.names(layer, expert)
        try:
            got = self.ckpt.read_many(names, self.device)
        except (CheckpointError, OSError) as e:
            raise ExpertLoadError(f"layer {layer} expert {expert} failed to load: {e}") from e
        n = self.pass_reads[(layer, expert)] = self.pass_reads.get((layer, expert), 0) + 1
        self.max_reads, self.total = max(self.max_reads, n), self.total + 1
        tensors = dict(zip(expert_short_names(names), (got[n] for n in names)))
        if self.matrices_of is not None:
            try:  # as the engine's expert cache does: corrupt bytes are a failed load (exit 4)
                check_matrices(self.matrices_of(tensors))
            except ReapError as e:
                raise ExpertLoadError(f"layer {layer} expert {expert} failed to load: {e}") from e
        return tensors


@dataclass
class Run:
    """Everything one calibration run needs while it loops over layers."""

    ckpt: Checkpoint
    model: object
    moe_layers: list[int]
    ids: torch.Tensor  # [S, T] token ids
    plan: BatchPlan
    store: SpillStore
    acc: StatsAccumulator
    weights: LayerWeights
    experts: StoreExperts
    work: str
    identity: dict
    device: torch.device
    token_experts: art.TokenExperts | None = None
    done: int = -1  # last committed layer (-1: nothing yet)
    counters: dict = field(default_factory=lambda: {"bytes_read": 0, "expert_reads_max": 0,
                                                    "expert_reads": 0})
    bar: object = None
    timing: dict = field(default_factory=dict)  # seconds per phase (not part of the results)

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]

    def batches(self, s0: int, s1: int) -> list[tuple[int, int]]:
        """Sequence ranges of at most `plan.batch` sequences covering [s0, s1)."""
        b = self.plan.batch
        return [(a, min(a + b, s1)) for a in range(s0, s1, b)]


# -- the layer loop -----------------------------------------------------------------------------
def _load_state(run: Run, s0: int, s1: int):
    arrays = {k: run.store.read(k, s0, s1).to(run.device) for k in run.store.current if k != "x"}
    return state_from_arrays(arrays), arrays


def _save_state(run: Run, s0: int, state, gen: str, loaded: dict) -> None:
    for key, t in state_arrays(state).items():
        if loaded.get(key) is not t:  # a tensor passed through unchanged is already stored
            run.store.write(key, s0, t, gen)


def _embed(run: Run) -> None:
    for s0, s1 in run.batches(0, run.ids.shape[0]):
        state = run.model.embed(run.weights, run.ids[s0:s1].to(run.device))
        _save_state(run, s0, state, "e", {})
    run.store.commit()


def _attention(run: Run, i: int, moe: bool) -> None:
    """Attention of layer i over all sequences (and the whole layer if it is not MoE)."""
    for s0, s1 in run.batches(0, run.ids.shape[0]):
        state, loaded = _load_state(run, s0, s1)
        state, x = run.model.attn_block(i, run.weights, state, cache=None)  # x [B, T, D]
        if moe:
            _save_state(run, s0, state, f"a{i}", loaded)
            run.store.write("x", s0, x, f"a{i}")
        else:
            y = run.model.mlp_block(i, run.weights, x)
            _save_state(run, s0, run.model.finish_layer(i, state, y), f"f{i}", loaded)
        _tick(run, (s1 - s0) * run.seq_len * (0.5 if moe else 1.0), i)
    run.store.commit()


def _moe(run: Run, i: int) -> None:
    """The MoE MLP of layer i, one pass of `plan.pass_seqs` sequences at a time."""
    S, T = run.ids.shape
    for p0 in range(0, S, run.plan.pass_seqs):
        p1 = min(p0 + run.plan.pass_seqs, S)
        x = run.store.read("x", p0, p1).to(run.device)  # [P, T, D]
        run.acc.span(p0, p1)
        run.experts.new_pass()
        y = run.model.mlp_block(i, run.weights, x, experts=run.experts, observer=run.acc)
        if run.experts.probe is not None:
            run.experts.probe.finish()
        del x
        for s0, s1 in run.batches(p0, p1):
            state, loaded = _load_state(run, s0, s1)
            state = run.model.finish_layer(i, state, y[s0 - p0:s1 - p0])
            _save_state(run, s0, state, f"f{i}", loaded)
        _tick(run, (p1 - p0) * T * 0.5, i)
    run.store.commit()


def _commit_layer(run: Run, i: int, moe: bool) -> None:
    """Persist layer i: spill, statistics rows, token ids, then the progress record."""
    run.store.commit(durable=True)
    if moe:
        art.save_rows(run.work, i, run.acc.rows.pop(i))
        if run.token_experts is not None:
            run.token_experts.commit(i)
    c = run.counters
    c["bytes_read"] += run.ckpt.bytes_read
    run.ckpt.bytes_read = 0
    c["expert_reads_max"] = max(c["expert_reads_max"], run.experts.max_reads)
    c["expert_reads"] += run.experts.total
    run.experts.max_reads = run.experts.total = 0
    art.write_json(os.path.join(run.work, "progress.json"),
                   {"identity": run.identity, "done": i, "store": run.store.manifest(),
                    "counters": c})
    run.store.cleanup()
    run.weights.clear()


def _tick(run: Run, tokens: float, layer: int) -> None:
    release_memory()
    if run.bar is not None:
        run.bar.update(tokens)
        run.bar.set_postfix_str(f"layer {layer}", refresh=False)


def run_layers(run: Run, start: int, hooks=None) -> None:
    """Layers start.. up to the last MoE layer (start = -1: embed first). `hooks(layer)` is
    called after each committed layer (tests use it to interrupt a run)."""
    if start < 0:
        _timed(run, "embed", _embed, run)
        run.weights.clear()
        start = 0
    for i in range(start, max(run.moe_layers) + 1):
        moe = i in run.moe_layers
        _timed(run, "attention", _attention, run, i, moe)
        if moe:
            _timed(run, "moe", _moe, run, i)
        _timed(run, "commit", _commit_layer, run, i, moe)
        if hooks is not None:
            hooks(i)


def _timed(run: Run, phase: str, fn, *args) -> None:
    t0 = time.perf_counter()
    fn(*args)
    run.timing[phase] = run.timing.get(phase, 0.0) + time.perf_counter() - t0


# -- sizes --------------------------------------------------------------------------------------
def weight_sizes(ckpt: Checkpoint, specs, itemsize: int) -> dict:
    """Resident bytes of the largest layer trunk, the embedding and one routed expert (its
    quantized parts, by their layout role, count their bytes plus their weights decoded to fp32:
    nine times for MXFP4 blocks, nine for INT4 words); 16-bit weights count double when computing
    in fp32."""
    first = next(((s.layer, s.expert) for s in specs if s.expert is not None), None)
    trunk: dict[int, int] = {}
    expert = embed = 0
    for s in specs:
        info = ckpt.tensors.get(s.name)
        if info is None:
            continue
        n = info.nbytes * (2 if info.dtype in ("BF16", "F16") and itemsize == 4 else 1)
        if s.expert is not None:
            if (s.layer, s.expert) == first:
                expert += info.nbytes + s.weights * 4 if is_quantized(s.role) else n * 2
        elif s.layer is not None:
            trunk[s.layer] = trunk.get(s.layer, 0) + n
        elif s.component == "embed_head":
            embed = max(embed, n)
    return {"trunk": max(trunk.values(), default=0), "embed": embed, "expert": expert}


# -- checks -------------------------------------------------------------------------------------
def check_lengths(config: dict, tokens: int, seq_len: int) -> None:
    """--tokens and --seq-len against each other and the model's context limit."""
    limit = text_of(config).get("max_position_embeddings")
    if seq_len < 1:
        raise ReapError(f"--seq-len must be positive, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise ReapError(f"--seq-len {seq_len} exceeds the model's limit of {limit} tokens")
    if tokens < seq_len:
        raise ReapError(f"--tokens {tokens} is less than one sequence of --seq-len {seq_len}")


def resolve_shard(shard: tuple[int, int], n_seq: int) -> tuple[int, int]:
    """Sequence range [s0, s1) of shard k of n (1-based), contiguous and balanced."""
    k, n = shard
    if not 1 <= k <= n:
        raise ReapError(f"--shard {k}/{n}: need 1 <= K <= N")
    return (k - 1) * n_seq // n, k * n_seq // n


def identity_diff(old: dict, new: dict) -> str:
    """Which recorded facts differ between two run identities, for the refusal message."""
    diff = [f"{k}: {old['arguments'].get(k)!r} -> {v!r}" for k, v in new["arguments"].items()
            if old.get("arguments", {}).get(k) != v]
    diff += [k for k in new if k != "arguments" and old.get(k) != new[k]]
    return "; ".join(diff) or "format"


def cleanup_work(work: str) -> None:
    """Delete a run's work directory (`work` is OUT/.work), never one it did not make."""
    art.check_work(os.path.dirname(work))
    shutil.rmtree(work, ignore_errors=True)
