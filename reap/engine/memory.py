"""Memory plan: how the engine spends a RAM budget, computed before any weight is read.

A model is seen as *trunk units* read once per forward pass (each decoder layer without its routed
experts, and the output head), routed experts read on demand, and per-sequence state (KV cache and
recurrent state) that grows with the declared context. The plan gives the budget, in this order, to

1. the process baseline (measured), always-resident small tensors, the sequence state for
   `batch` sequences at `context` positions, and scratch (see `fixed_costs`);
2. the streamed-layer ring (2 slots of the largest streamed unit: one computing, one being read);
3. pinned trunk units (never re-read), because every unit is read on every token;
4. the routed-expert cache (whatever is left);
5. the embedding table, once every expert is cached and it fits in what is still left (else a
   step reads just the rows of its tokens; a table tied to a pinned head is resident anyway).

Trunk before experts: a pinned byte of trunk saves one byte of reading on every token, a cached
byte of experts only when that expert is chosen again. A plan above 95 % of the memory actually
available (MemAvailable, capped by the cgroup limit) is refused before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reap.errors import ReapError
from reap.memstat import available_memory
from reap.units import format_bytes

RING_SLOTS = 2
OVERHEAD = 64 * 10**6  # allocator slack, libraries loaded after the baseline, Python objects
REFUSE_FRACTION = 0.95

# preset -> (fraction of the trunk pinned, fraction of all routed expert bytes cached).
PRESETS: dict[str, tuple[float, float]] = {
    "ultra": (0.0, 0.0),  # the smallest plan that runs: everything streamed, no expert cache
    "laptop": (0.25, 0.0),  # a quarter of the trunk pinned
    "desktop": (0.5, 0.02),  # half the trunk, 2 % of the experts
    "workstation": (1.0, 0.05),  # whole trunk, 5 % of the experts
    "server": (1.0, 0.25),  # whole trunk, a quarter of the experts
    "max": (1.0, 1.0),  # everything resident: no re-reads at all
}

PRESET_HELP = (
    "budget scaled to the model: ultra = the minimum that runs (all layers streamed through a "
    "2-slot ring, no expert cache); laptop = + 25%% of the trunk pinned; desktop = 50%% of the "
    "trunk + 2%% of the routed experts cached; workstation = the whole trunk + 5%%; server = the "
    "whole trunk + 25%%; max = the whole model resident"
)


@dataclass(frozen=True)
class ModelBytes:
    """What the plan needs to know about a checkpoint, in bytes as stored: per trunk unit
    (decoder layers, then the head) its bytes, one routed expert's (0 where none) and how many
    it has. State costs are per sequence."""

    unit_names: list[str]
    units: list[int]
    expert_bytes: list[int]
    n_experts: list[int]
    top_k: int
    resident: int  # always-resident small tensors (final norms, ...)
    embed_row: int  # bytes of one embedding row (the table is read by rows)
    cast_bytes: int  # the largest trunk weight's copy in the compute dtype (0 if stored so)
    decoded_expert_bytes: int  # one routed expert's weights decoded to the compute dtype
    state_per_position: int  # KV cache bytes per position per sequence
    state_per_sequence: int  # recurrent (KDA) state bytes per sequence
    act_per_token: int  # activation bytes per in-flight token (fp32 residual + snapshots)
    attn_per_pair: int = 0  # attention-score bytes per (query, key) pair during prefill
    embed_table: int = 0  # the whole embedding table, when it is not also the head's weight

    @property
    def trunk(self) -> int:
        return sum(self.units)

    @property
    def experts_total(self) -> int:
        return sum(b * n for b, n in zip(self.expert_bytes, self.n_experts))

# MemoryPlan.to_dict's keys, in the order `reap run --json` has always printed them
_SUMMARY = ("budget", "total", "baseline", "resident", "state", "scratch", "pinned_units",
            "pinned_bytes", "ring_slots", "slot_bytes", "expert_cache", "embed_table",
            "streamed_bytes", "context", "batch", "prefill_chunk")


@dataclass
class MemoryPlan:
    """Where each byte of the budget goes. All sizes in bytes."""

    budget: int
    baseline: int  # the process before loading (interpreter, torch)
    resident: int
    state: int  # KV cache + recurrent state for `batch` x `context`
    scratch: int
    pinned: list[int]  # trunk unit indices kept resident
    ring_slots: int
    slot_bytes: int
    expert_cache: int
    context: int
    batch: int
    prefill_chunk: int
    unit_names: list[str] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    embed_table: int = 0  # the embedding table held resident (0: read by rows)

    @property
    def pinned_units(self) -> list[str]:
        return [self.unit_names[i] for i in self.pinned]

    @property
    def pinned_bytes(self) -> int:
        return sum(self.units[i] for i in self.pinned)

    @property
    def streamed(self) -> list[int]:
        return [i for i in range(len(self.units)) if i not in set(self.pinned)]

    @property
    def streamed_bytes(self) -> int:
        return sum(self.units[i] for i in self.streamed)

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.slot_bytes

    @property
    def total(self) -> int:
        parts = (self.baseline, self.resident, self.state, self.scratch, self.pinned_bytes,
                 self.ring_bytes, self.expert_cache, self.embed_table)
        return sum(parts)

    def describe(self) -> str:
        """A human-readable table of the plan."""
        rows = [
            ("baseline (interpreter, torch)", self.baseline),
            ("always-resident tensors", self.resident),
            (f"pinned trunk: {len(self.pinned)}/{len(self.units)} units", self.pinned_bytes),
            (f"streamed-layer ring: {self.ring_slots} x {_size(self.slot_bytes)}", self.ring_bytes),
            ("routed-expert cache", self.expert_cache),
            ("embedding table" + ("" if self.embed_table else " (read by rows)"), self.embed_table),
            (f"KV cache + recurrent state ({self.batch} x {self.context} positions)", self.state),
            (f"scratch (prefill chunk {self.prefill_chunk})", self.scratch),
        ]
        lines = [f"memory plan (budget {_size(self.budget)}):"]
        lines += [f"  {name:<58} {_size(b):>10}" for name, b in rows]
        lines.append(f"  {'total':<58} {_size(self.total):>10}")
        lines.append(f"  streamed per token: {_size(self.streamed_bytes)} of trunk")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready summary."""
        return {k: getattr(self, k) for k in _SUMMARY}


def _size(n: int) -> str:
    """Bytes for the plan table and messages: two decimals, as the plan has always printed."""
    return format_bytes(n, digits=2)


def fixed_costs(mb: ModelBytes, context: int, batch: int, prefill_chunk: int) -> tuple[int, int]:
    """(state, scratch) bytes for `batch` sequences of `context` positions."""
    state = batch * (mb.state_per_sequence + context * mb.state_per_position)
    chunk = min(prefill_chunk, context)
    # a weight cast to the compute dtype, one decoded expert (and the next, while the first
    # is released), activations of one chunk of every sequence, and the attention scores of
    # one sequence's chunk against its whole context
    scratch = (
        OVERHEAD
        + mb.cast_bytes
        + 2 * mb.decoded_expert_bytes
        + batch * chunk * mb.act_per_token
        + chunk * context * mb.attn_per_pair
    )
    return state, scratch


def choose_prefill_chunk(
    mb: ModelBytes,
    context: int,
    budget: int,
    choices: tuple[int, ...] = (512, 256, 128, 64, 32, 16),
) -> int:
    """The largest prefill chunk whose attention scores take at most 1/8 of the budget."""
    for c in choices:
        if c * context * mb.attn_per_pair <= budget // 8:
            return c
    return choices[-1]


def minimum_budget(
    mb: ModelBytes, context: int, batch: int = 1, prefill_chunk: int = 512, baseline: int = 0
) -> int:
    """The smallest budget that runs: all trunk units streamed, no expert cache."""
    state, scratch = fixed_costs(mb, context, batch, prefill_chunk)
    return baseline + mb.resident + state + scratch + RING_SLOTS * max(mb.units)


def preset_budget(
    mb: ModelBytes,
    preset: str,
    context: int,
    batch: int = 1,
    prefill_chunk: int = 512,
    baseline: int = 0,
) -> int:
    """The budget a preset stands for on this model (see PRESETS)."""
    if preset not in PRESETS:
        raise ReapError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    f_trunk, f_experts = PRESETS[preset]
    base = minimum_budget(mb, context, batch, prefill_chunk, baseline)
    if f_trunk >= 1.0:  # a pinned trunk needs no ring
        base -= RING_SLOTS * max(mb.units)
    if f_trunk >= 1.0 and f_experts >= 1.0:  # the whole model: the embedding table too
        base += mb.embed_table
    return base + int(f_trunk * mb.trunk) + int(f_experts * mb.experts_total)


def plan_memory(
    mb: ModelBytes,
    budget: int,
    context: int,
    batch: int = 1,
    prefill_chunk: int = 512,
    baseline: int = 0,
) -> MemoryPlan:
    """Split `budget` bytes in the module docstring's order; ReapError (exit 2) if it cannot
    hold the smallest runnable plan."""
    state, scratch = fixed_costs(mb, context, batch, prefill_chunk)
    need = minimum_budget(mb, context, batch, prefill_chunk, baseline)
    if budget < need:
        raise ReapError(
            f"budget {_size(budget)} is below the {_size(need)} this model needs at "
            f"context {context} x batch {batch} (short by {_size(need - budget)}): raise --budget "
            "or --preset, or lower the context (--context; eval: --max-tokens-per-doc, "
            "--gen-tokens) or the batch (run: lines of --prompts; eval: --gen-batch, --batch)"
        )
    free = budget - (baseline + mb.resident + state + scratch)
    pinned = _pin(mb.units, free)
    rest = [b for i, b in enumerate(mb.units) if i not in pinned]
    slots = RING_SLOTS if rest else 0
    slot = max(rest) if rest else 0
    left = free - slots * slot - sum(mb.units[i] for i in pinned)
    cache = max(0, min(left, mb.experts_total))
    table = mb.embed_table if cache == mb.experts_total and left - cache >= mb.embed_table else 0
    return MemoryPlan(budget, baseline, mb.resident, state, scratch, sorted(pinned), slots, slot,
                      cache, context, batch, prefill_chunk, list(mb.unit_names), list(mb.units),
                      table)  # fmt: skip


def _pin(units: list[int], free: int) -> set[int]:
    """Pin trunk units (first-fit in layer order) while the ring for the rest still fits."""
    if sum(units) <= free:
        return set(range(len(units)))
    pinned: set[int] = set()
    used = 0
    for i, b in enumerate(units):
        rest = [u for j, u in enumerate(units) if j != i and j not in pinned]
        ring = RING_SLOTS * max(rest) if rest else 0
        if used + b + ring <= free:
            pinned.add(i)
            used += b
    return pinned


def check_available(plan: MemoryPlan, available: int | None = None) -> None:
    """Refuse (ReapError, exit 2) a plan above 95 % of the memory actually available (the
    baseline, already in use, is not counted against it)."""
    source = "given"
    if available is None:
        available, source = available_memory()
    need = plan.total - plan.baseline
    allowed = int(REFUSE_FRACTION * available)
    if need > allowed:
        raise ReapError(
            f"memory plan needs {_size(need)} beyond the running process but only "
            f"{_size(allowed)} is allowed (95% of {_size(available)} available, "
            f"{source}): short by {_size(need - allowed)}; lower --budget or --context"
        )
