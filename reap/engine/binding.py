"""Binding a checkpoint to its model family, and what the memory plan needs to know about it.

    b = bind(checkpoint.tensors, fam, config, path)       # strict: missing/unused -> exit 1
    fam, cfg, b, dtype, mb, plan = plan_checkpoint(config, tensors, path, "auto", "8GB", ...)

Works on anything with `.shape`, `.dtype` and `.nbytes` per tensor name (TensorInfo, or
TensorSpec for a layout with no checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reap.checkpoint import DTYPE_CODES
from reap.engine import memory
from reap.errors import EXIT_FAILURE, ReapError
from reap.memstat import available_memory, current_rss
from reap.models.checks import FiniteGuard, check_binding
from reap.units import parse_bytes


@dataclass
class Binding:
    """What the engine reads, by trunk unit: units[i] names unit i's tensors (decoder layers in
    order, then the head); `embed` is the embedding table, read by rows. `first_expert[layer]`
    names the tensors of expert 0 of each MoE layer; `expert_weights` is how many weights one
    routed expert holds (decoded, by the layout's roles: MXFP4 blocks two a byte, scales none)."""

    unit_names: list[str]
    units: list[list[str]]
    embed: str
    expert_layers: list[int]
    n_experts: int
    first_expert: dict[int, list[str]]
    expert_weights: int
    guard: FiniteGuard | None = None  # checks norm and router tensors once, when first read


def bind(tensors: dict, fam, config: dict, path: str) -> Binding:
    """Match the checkpoint's tensors to the family layout strictly, as calibration does
    (`reap.models.checks.check_binding`; exit 1); what the text model never reads is recognised,
    not bound."""
    specs = check_binding(tensors, fam, config, path)
    guard = FiniteGuard(fam, fam.Config.from_dict(config), specs, path)
    n_layers = 1 + max((s.layer for s in specs if s.layer is not None), default=-1)
    units: list[list[str]] = [[] for _ in range(n_layers + 1)]
    embed_specs = [s for s in specs if s.component == "embed_head" and s.layer is None]
    embed = embed_specs[0].name  # the layout lists the embedding first (file order)
    for s in specs:
        if s.component == "routed_experts":
            continue
        if s.layer is not None:
            units[s.layer].append(s.name)
        elif s.name != embed or len(embed_specs) == 1:  # a tied table is also the head
            units[n_layers].append(s.name)
    first = [s for s in specs if s.component == "routed_experts" and s.expert == 0]
    first_expert: dict[int, list[str]] = {}
    for s in first:
        first_expert.setdefault(s.layer, []).append(s.name)
    n_experts = 1 + max((s.expert for s in specs if s.expert is not None), default=-1)
    names = [f"layer {i}" for i in range(n_layers)] + ["head"]
    weights = sum(s.weights for s in first if s.layer == first[0].layer) if first else 0
    return Binding(
        names, units, embed, sorted(first_expert), n_experts, first_expert, weights, guard
    )


def state_costs(fam, cfg, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position, recurrent-state bytes per sequence, activation bytes per token,
    attention-score bytes per (query, key) pair) of one sequence with `act_bytes`-byte
    activations, from the family's `state_bytes`: KV summed over layers (sliding-window ones
    too); recurrent state independent of length (KDA state, conv tails); the peak transient
    bytes per token of one layer; fp32 scores, probabilities and mask of one attention layer."""
    costs = tuple(int(c) for c in fam.state_bytes(cfg, act_bytes))
    if len(costs) != 4 or min(costs) < 0:
        raise ReapError(
            f"model family {fam.__name__}: state_bytes returned {costs}, not 4 byte counts >= 0",
            EXIT_FAILURE,
        )
    return costs


def model_bytes(
    tensors: dict, b: Binding, costs: tuple[int, int, int, int], top_k: int, dtype: torch.dtype
) -> memory.ModelBytes:
    """The plan's view of a bound checkpoint (bytes as stored) computing in `dtype`."""
    units = [sum(tensors[n].nbytes for n in names) for names in b.units]
    expert_bytes = [0] * len(units)
    n_experts = [0] * len(units)
    for layer in b.expert_layers:
        expert_bytes[layer] = sum(tensors[n].nbytes for n in b.first_expert[layer])
        n_experts[layer] = b.n_experts
    code, size = DTYPE_CODES[dtype], torch.finfo(dtype).bits // 8
    cast = max(
        (
            _numel(tensors[n].shape) * size
            for names in b.units
            for n in names
            if tensors[n].dtype not in (code, "F32")
        ),
        default=0,
    )
    row = tensors[b.embed]
    return memory.ModelBytes(
        unit_names=list(b.unit_names),
        units=units,
        expert_bytes=expert_bytes,
        n_experts=n_experts,
        top_k=top_k,
        resident=0,
        embed_row=row.nbytes // row.shape[0],
        embed_table=0 if b.embed in b.units[-1] else row.nbytes,  # tied: the head's weight
        cast_bytes=cast,
        decoded_expert_bytes=b.expert_weights * size,
        state_per_position=costs[0],
        state_per_sequence=costs[1],
        act_per_token=costs[2],
        attn_per_pair=costs[3],
    )


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PREFILL_CHUNKS = (512, 256, 128, 64, 32, 16)


def plan_checkpoint(config: dict, tensors, path: str, dtype: str | None, budget, preset,
                    context: int, batch: int, prefill_chunk: int | None, available=None,
                    baseline=None) -> tuple:
    """(family, Config, Binding, compute dtype, ModelBytes, MemoryPlan) of a checkpoint's
    config.json and tensor table: what `Engine.open` decides before reading a weight, and what
    `reap run --plan-only` prints."""
    from reap.models import load_config

    fam, cfg = load_config(config, path)
    torch_dtype = _compute_dtype(dtype, cfg)
    b = bind(tensors, fam, config, path)
    costs = state_costs(fam, cfg, torch.finfo(torch_dtype).bits // 8)
    mb = model_bytes(tensors, b, costs, fam.top_k(cfg), torch_dtype)
    plan = _make_plan(mb, budget, preset, context, batch, prefill_chunk, available, baseline)
    return fam, cfg, b, torch_dtype, mb, plan


def _compute_dtype(dtype: str | None, cfg) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = "float32" if cfg.torch_dtype == "float32" else "bfloat16"
    if dtype not in DTYPES:
        raise ReapError(f"--dtype must be auto, float32 or bfloat16, got {dtype!r}")
    return DTYPES[dtype]


def _make_plan(mb, budget, preset, context, batch, prefill_chunk, available,
               baseline=None) -> memory.MemoryPlan:
    if budget is not None and preset is not None:
        raise ReapError("give --budget or --preset, not both")
    if context < 1 or batch < 1:
        raise ReapError(f"--context and batch must be positive (got {context}, {batch})")
    base = current_rss() if baseline is None else baseline
    avail = available if available is not None else available_memory()[0]
    if budget is not None:
        b = parse_bytes(budget) if isinstance(budget, str) else int(budget)
        chunk = prefill_chunk or memory.choose_prefill_chunk(mb, context, b, PREFILL_CHUNKS)
    else:
        chunk = prefill_chunk or memory.choose_prefill_chunk(mb, context, avail, PREFILL_CHUNKS)
        b = memory.preset_budget(mb, preset or "max", context, batch, chunk, base)
        if preset is None:  # no request: the whole model if it fits, else 80 % of available
            b = min(b, base + int(0.8 * avail))
    return memory.plan_memory(mb, b, context, batch, chunk, base)
