"""The streaming engine: binds a checkpoint to its model family, plans memory, and runs forward
steps layer by layer with weights pulled from the pinned trunk, the streamed-layer ring and the
routed-expert cache (usage: `reap.engine`).

A step advances any number of sequences in lockstep (prefill chunks or single decode tokens):
each trunk unit is fetched once per step and serves every sequence; attention runs per sequence
against its own caches; the MoE runs once on the tokens of all sequences together, so each
routed expert is read once per step whatever the batch. The arithmetic never depends on where
a weight came from (pinned, ring slot or cache hit), so output is identical across budgets.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from reap.checkpoint import BufferReader, open_checkpoint
from reap.defaults import default_model
from reap.engine import memory, native_prefill
from reap.engine.binding import Binding, plan_checkpoint
from reap.engine.experts import ExpertCache, resident_keys, routed_counts
from reap.engine.native import NativeDecoder
from reap.engine.run_metrics import RunMetrics
from reap.engine.store import IO_KINDS, TrunkStore, embedding_table
from reap.errors import EXIT_FAILURE, ReapError
from reap.models.base import Family, expert_short_names
from reap.quant import ckernel, dense_kernel
from reap.quant.mxfp4_decode import BufferPool
from reap.quant.mxfp4_matmul import MXFP4Kernels, fused_available

# --resident-from pins at most this share of the expert cache's slots; the rest follow the
# cache's policy (recency and frequency catch what the statistics' corpus did not)
RESIDENT_SHARE = 0.5


@dataclass
class SequenceState:
    """One sequence's decode state: per-layer caches and the positions it holds."""

    caches: list
    length: int = 0


@dataclass(eq=False, repr=False)
class Engine:
    """A bound checkpoint with its memory plan, weight stores and model (see module docstring);
    made by `Engine.open`."""

    path: str  # checkpoint directory or URL
    config: dict  # its config.json
    fingerprint: str  # the checkpoint's fingerprint (reap.checkpoint)
    fam: Family  # the model family, through its declared contract
    cfg: Any  # the family's Config of this checkpoint
    binding: Binding  # checkpoint tensors -> trunk units and routed experts
    plan_bytes: memory.ModelBytes  # the byte census the plan was made from
    plan: memory.MemoryPlan
    reader: BufferReader  # buffered positioned reads of the checkpoint
    trunk: TrunkStore  # pinned units and the streamed-layer ring
    experts: ExpertCache  # the routed-expert cache
    model: Any  # fam.Model, weights pulled per step
    tokenizer: Any  # reap.tokenizer, or None without tokenizer.json
    device: str
    dtype: torch.dtype  # compute dtype
    context: int  # declared context: prompt + generated tokens per sequence
    max_prompt: int
    max_generation: int
    metrics: RunMetrics = field(init=False)  # cumulative over the engine's life
    unit_seconds: list[float] = field(init=False)  # wall time per trunk unit, cumulative
    _sync_io: float = field(init=False)  # compute-thread read seconds (experts, embedding rows)
    _source: _ExpertSource = field(init=False)
    _decoded: BufferPool = field(init=False)  # decoded expert weights: reused buffers
    _fused: bool = field(init=False)  # bf16 on CPU: fused expert matmuls
    _kernels: MXFP4Kernels = field(init=False)  # expert matmuls (reap.quant)
    _native: NativeDecoder = field(init=False)  # compiled one-token steps (reap.engine.native)
    embedding: torch.Tensor | None = field(init=False)  # the resident embedding table, or None

    def __post_init__(self) -> None:
        self.metrics = RunMetrics()
        self.unit_seconds = [0.0] * len(self.binding.units)
        self._sync_io = 0.0
        self._source = _ExpertSource(self)
        # as many decoded-expert buffers as the plan's scratch allows
        self._decoded = BufferPool(2 * self.plan_bytes.decoded_expert_bytes)
        self._fused = fused_available(self.dtype, self.device)
        self._kernels = MXFP4Kernels(self.dtype, self._decoded, self._fused)
        self._native = NativeDecoder(self)  # one-token steps through compiled kernels
        pin = self.plan.embed_table > 0  # read now (the plan has room for it)
        self.embedding = embedding_table(self.reader, self.binding.embed, pin, self.trunk)

    @classmethod
    def open(cls, model: str | os.PathLike | None = None, budget: str | int | None = None,
             preset: str | None = None, context: int = 4096, device: str = "cpu",
             dtype: str | None = None, batch: int = 1, prefill_chunk: int | None = None,
             direct: bool = False, max_prompt: int = 32768, max_generation: int = 4096,
             available: int | None = None, baseline: int | None = None,
             preload: bool = True, resident_from: str | None = None) -> Engine:
        """Bind `model` (a checkpoint directory or URL; None = the bundled default), plan memory
        for `batch` sequences of `context` positions under `budget` (bytes or "8GB") or `preset`,
        refuse a plan above 95 % of available memory (exit 2), then read the pinned trunk (and
        every routed expert when the expert cache holds them all, as at `--preset max`, unless
        `preload` is False: then each is read on first use). `resident_from`: statistics (a
        file or `reap calibrate` output) whose most routed experts are read now and never evicted.

        The budget covers the whole process: `baseline` (default: this process's RSS now, so a
        second engine in the same process sees the first one's memory as already used) plus
        everything the engine holds. `dtype` None/"auto": the checkpoint's (float32 or bf16)."""
        t0 = time.perf_counter()
        _check_device(device)
        ckpt, model = _open_checkpoint(model)
        fam, cfg, b, torch_dtype, mb, plan = plan_checkpoint(
            ckpt.config, ckpt.tensors, str(model), dtype, budget, preset, context, batch,
            prefill_chunk, available, baseline)
        memory.check_available(plan, available)
        counts = resident_from and routed_counts(resident_from, b.expert_layers, b.n_experts)
        reader, trunk, experts = _stores(ckpt, fam, cfg, b, plan, direct, device, preload,
                                         mb.top_k, counts)
        eng = cls(
            plan_bytes=mb, path=str(model), config=ckpt.config, fam=fam, cfg=cfg, binding=b,
            plan=plan, reader=reader, trunk=trunk, experts=experts, device=device,
            dtype=torch_dtype, model=fam.Model(cfg, device=device, dtype=torch_dtype),
            tokenizer=_tokenizer(ckpt.path), context=context, max_prompt=max_prompt,
            max_generation=max_generation, fingerprint=ckpt.fingerprint(),
        )  # fmt: skip
        eng.metrics.open_seconds = time.perf_counter() - t0
        eng.metrics.pinned_read_bytes = reader.io.bytes["trunk"]
        return eng

    # -- the forward step ---------------------------------------------------------------------
    def new_sequence(self) -> SequenceState:
        return SequenceState(self.model.new_caches())

    def step(self, seqs: list[SequenceState], chunks: list[list[int]], all_positions: bool = False,
             more: bool = True, first: int = 0) -> list[torch.Tensor]:
        """Advance each sequence by its chunk of token ids (all in lockstep). Returns per
        sequence the next-token logits, float32 on CPU: [T_s, V] if `all_positions` else [V].
        `more`: another step follows (lets the ring read the first layer during the head).
        `first`: with `all_positions`, only the chunk's positions from `first` on get logits
        ([T_s - first, V]; the head skips the others, as a perplexity pass that scores the
        later part of a window wants)."""
        if first < 0:
            raise ReapError(f"first position {first}: need >= 0")
        try:
            if self._native.usable(chunks) and self._native.whole(seqs):  # one library call
                return self._native.step(seqs, chunks, all_positions, more, first)  # no torch
            with torch.inference_mode(), dense_kernel.enabled():
                if self._native.usable(chunks):
                    return self._native.step(seqs, chunks, all_positions, more, first)
                if native_prefill.usable(self._native, chunks):  # torch: embedding and head
                    with ckernel.torch_serial():
                        return native_prefill.step(
                            self._native, seqs, chunks, all_positions, more, first
                        )
                with ckernel.torch_serial(self._native.covers_products(chunks)):
                    return self._step(seqs, chunks, all_positions, more, first)
        except ReapError:
            raise
        except (RuntimeError, ValueError, IndexError, KeyError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ReapError(f"forward failed: {msg}", EXIT_FAILURE) from None

    def _step(self, seqs, chunks, all_positions, more, first=0):
        m, n_layers = self.model, len(self.binding.units) - 1
        states = self.embed(chunks)
        sizes = [len(c) for c in chunks]
        for i in range(n_layers):
            t0 = time.perf_counter()
            units = self.trunk.get(i)
            get = _getter(units, self.binding.unit_names[i])
            xs = []
            for k, s in enumerate(seqs):
                states[k], x = m.attn_block(i, get, states[k], cache=s.caches[i])
                xs.append(x.reshape(-1, x.shape[-1]))
            x = torch.cat(xs)[None]  # [1, N, D] every sequence's tokens
            y = self._native.moe(i, units, x)  # [N, D] compiled, or None: the family's
            if y is None:
                y = m.mlp_block(i, get, x, experts=self._source)[0]
            self.experts.release()
            for k, y_k in enumerate(y.split(sizes)):
                states[k] = m.finish_layer(i, states[k], y_k[None])
            self.unit_seconds[i] += time.perf_counter() - t0
        t0 = time.perf_counter()
        get = _getter(self.trunk.get(n_layers, wrap=more), "head")
        out = []
        for k, s in enumerate(seqs):
            s.length += sizes[k]
            st = _positions(states[k], first if all_positions else -1)
            out.append(m.head(get, st)[0].float().cpu())  # [T, V]
        self.unit_seconds[n_layers] += time.perf_counter() - t0
        return out if all_positions else [o[-1] for o in out]

    def embed(self, chunks: list[list[int]]) -> list:
        """Embed each chunk: the rows the chunks use, from the resident table or read."""
        uniq = sorted({t for c in chunks for t in c})
        vocab = self.reader.info(self.binding.embed).shape[0]
        bad = [t for t in uniq if not 0 <= t < vocab]
        if bad:
            raise ReapError(f"token id {bad[0]} outside the vocabulary of {vocab}")
        if (table := self.embedding) is not None:  # resident
            rows = table[torch.tensor(uniq, device=table.device)].to(self.device)
        else:
            t0 = time.perf_counter()
            rows = self.reader.read_rows(self.binding.embed, uniq).to(self.device)  # [U, D]
            self._sync_io += time.perf_counter() - t0
        where = {t: j for j, t in enumerate(uniq)}
        get = _getter({self.binding.embed: rows}, "embedding")
        return [self.model.embed(get, torch.tensor([[where[t] for t in c]])) for c in chunks]

    def expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """ExpertSource: cached or freshly read tensors as the family's typed weights, MXFP4
        matrices multiplied by the engine's kernels (in bf16, few rows run fused without
        decoding; see `reap.quant.mxfp4_matmul.MXFP4Kernels`); an expert that failed to load is
        served as zeros (recorded; exit code 4)."""
        t = self.stored_expert(layer, expert)
        if t is None:
            t = self._zero_expert(layer, expert)
        return self._kernels.attach(self.fam.expert_matrices(t))

    def stored_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor] | None:
        """The expert's stored tensors (short names) from the cache, or None if it failed to
        load; a read on this thread counts as compute-thread I/O wait."""
        t0 = time.perf_counter()
        misses = self.experts.misses
        t = self.experts.get(layer, expert)
        if self.experts.misses != misses:
            self._sync_io += time.perf_counter() - t0
        return t

    def _zero_expert(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """All-zero bytes decode to all-zero weights: the expert contributes nothing."""
        names = self.fam.expert_tensor_names(self.cfg, layer, expert)
        # bind() checked every expert tensor is listed; only its bytes failed to load
        shapes = (self.reader.tensors[n].shape for n in names)
        return {s: torch.zeros(shape, dtype=torch.uint8)
                for s, shape in zip(expert_short_names(names), shapes)}

    # -- accounting ---------------------------------------------------------------------------
    def counters(self) -> dict:
        """A snapshot of the I/O and cache counters (for RunMetrics.add)."""
        io = self.reader.io
        return {"bytes": dict(io.bytes), "reads": io.reads, "io_seconds": io.seconds,
                "wait_seconds": self.trunk.stall + self._sync_io,
                "expert_hits": self.experts.hits, "expert_misses": self.experts.misses}

    @property
    def expert_failures(self) -> list[tuple[int, int, str]]:
        """(layer, expert, reason) of every routed expert that failed to load."""
        return list(self.experts.failed)

    def generate(self, prompts, max_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop=()) -> list:
        """See `reap.engine.generate.generate` (which also returns the run's metrics)."""
        from reap.engine.generate import generate

        return generate(self, prompts, max_tokens, temperature, top_p, seed, stop)[0]

    def stream(self, prompt, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, stop=()):
        """See `reap.engine.generate.stream`: yields token ids as they are sampled."""
        from reap.engine.generate import stream

        return stream(self, prompt, max_tokens, temperature, top_p, seed, stop)

    def logits(self, sequences) -> list[torch.Tensor]:
        """See `reap.engine.generate.teacher_forced_logits`: [T, V] float32 per sequence."""
        from reap.engine.generate import teacher_forced_logits

        return teacher_forced_logits(self, sequences)[0]

    def close(self) -> None:
        """Release buffers and file descriptors."""
        self.trunk.close()
        self.experts.close()
        self.reader.close()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ExpertSource:
    """The ExpertSource handed to the model: `source(layer, expert)` -> tensors; a model that
    knows a layer's routing before dispatching may call `source.prefetch(layer, ids)` so the
    reads of all of them start at once, in the background."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def __call__(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return self.engine.expert(layer, expert)

    def prefetch(self, layer: int, experts) -> None:
        self.engine.experts.prefetch(layer, [int(e) for e in experts])


def _open_checkpoint(model):
    """(Checkpoint, its path or URL) for MODEL: None = the default model; http(s) = remote."""
    model = default_model() if model is None else model
    ckpt = open_checkpoint(model)
    if not ckpt.config:
        raise ReapError(f"{model}: no config.json; the engine needs a model directory")
    return ckpt, model


def _stores(ckpt, fam, cfg, b: Binding, plan: memory.MemoryPlan, direct: bool, device: str,
            preload: bool, top_k: int, resident=None):
    """The reader, the trunk store (pinned units read now) and the expert cache (slab held, a
    half-life of one decode token's expert uses; with `resident` = (layer, expert) -> routed
    tokens, the most routed experts pinned in RESIDENT_SHARE of the slots, at least one layer's
    top_k slots left to the rest)."""
    reader = BufferReader(ckpt, direct=direct, kinds=IO_KINDS)
    try:
        trunk = TrunkStore(reader, b.units, plan.pinned, plan.ring_slots, plan.slot_bytes,
                           device=device, check=b.guard.check_all if b.guard else None)
    except ReapError:
        reader.close()
        raise
    names = functools.partial(fam.expert_tensor_names, cfg)  # (layer, expert) -> stored names
    experts = ExpertCache(reader, plan.expert_cache, names, fam.expert_matrices,
                          half_life=max(1, len(b.expert_layers) * top_k), device=device)
    keys = [(layer, e) for layer in b.expert_layers for e in range(b.n_experts)]
    experts.reserve(keys)
    if preload and experts.preload(keys):  # when the cache holds every expert, read them all now
        return reader, trunk, experts
    if resident:
        size = lambda k: sum(reader.info(n).nbytes for n in names(*k))
        stored = {k: c for k, c in resident.items() if experts.stored(k)}
        room = min(int(RESIDENT_SHARE * experts.n_slots), experts.n_slots - top_k)
        experts.pin(resident_keys(stored, size, room))
    return reader, trunk, experts


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ReapError(f"unknown device {device!r} (cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ReapError(f"device {device!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ReapError(f"device {device!r} is not supported (cpu or cuda)")


def _tokenizer(path):
    from reap.tokenizer import has_tokenizer, load_tokenizer

    return load_tokenizer(path) if has_tokenizer(path) else None


def _getter(tensors: dict[str, torch.Tensor], where: str):
    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise ReapError(f"tensor binding failed: {name} is not part of {where}",
                            EXIT_FAILURE) from None

    return get


def _positions(state, start: int):
    """The state of positions start.. only (-1: the last; the head works per position)."""
    return type(state)(state.hidden[:, start:], [b[:, start:] for b in state.blocks])
