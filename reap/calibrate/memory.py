"""How calibration fits a memory budget: batch sizes from the checkpoint layout and the config.

Peak RSS during calibration is the sum of
- the baseline (interpreter, torch, the checkpoint index), measured when the plan is made;
- resident weights: one layer's trunk tensors (cached for the layer's duration; the embedding
  while embedding), plus one routed expert at a time (read, used, dropped);
- one attention batch: the hidden state of `batch` sequences and the attention temporaries;
- one MLP pass: the MLP inputs/outputs and router tensors of `pass_seqs` sequences (every token
  of a pass goes through the layer's experts together, so an expert is read once per pass).
The hidden states of all sequences never need to fit: they live in the disk-backed spill
(`reap.calibrate.spill`). The per-token terms below are estimates (fp32 activations, generous
constant factors); `experiments/bench_calibrate.py` measures the real peak against the budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reap.errors import ReapError
from reap.memstat import current_rss
from reap.units import format_bytes

_F32 = 4


@dataclass(frozen=True)
class BatchPlan:
    """Batch sizes chosen for a budget; all sizes in bytes."""

    budget: int
    baseline: int  # RSS when the plan was made
    weights: int  # largest resident weight set (layer trunk or embedding, plus one expert)
    per_seq_attn: int  # working bytes of one sequence in an attention batch
    per_seq_mlp: int  # working bytes of one sequence in an MLP pass
    state_bytes: int  # hidden states of all sequences, kept on disk
    batch: int  # sequences per attention batch
    pass_seqs: int  # sequences per MLP pass (each expert is read once per pass)
    passes: int

    def estimate_peak(self) -> int:
        """Predicted peak RSS of a run with this plan."""
        work = max(self.batch * self.per_seq_attn, self.pass_seqs * self.per_seq_mlp)
        return self.baseline + self.weights + work


def plan_batches(*, weight_bytes: dict, hidden: int, heads: int, dense_ffn: int, n_experts: int,
                 top_k: int,
                 n_blocks: int, n_seq: int, seq_len: int, budget: int,
                 batch: int | None = None, max_pass_seqs: int | None = None,
                 baseline: int | None = None) -> BatchPlan:
    """Choose the attention batch and the MLP pass size for `budget` bytes.

    weight_bytes: {"trunk": largest layer's non-expert bytes, "embed": embedding bytes,
    "expert": one routed expert's bytes}, all as resident in memory (fp32 where converted).
    dense_ffn: intermediate width of dense MLP layers (0 if none).
    n_blocks: most AttnRes block snapshots carried (0 for a plain residual stream).
    max_pass_seqs caps the sequences per MLP pass. Raises ReapError (exit 2) when not even one
    sequence fits.
    """
    baseline = current_rss() if baseline is None else baseline
    weights = max(weight_bytes["trunk"], weight_bytes["embed"]) + weight_bytes["expert"]
    T = seq_len
    state_tok = _F32 * hidden * (n_blocks + 2)  # partial sum, snapshots, MLP input
    # attention projections and temporaries (~32 D-wide fp32 rows per token, measured on
    # k3-small), a dense layer's GLU rows, and the [H, T] attention scores and probabilities
    per_seq_attn = T * (state_tok + _F32 * (32 * hidden + 3 * dense_ffn + 2 * heads * T))
    # MLP pass: ~12 D-wide rows (input, router/shared/latent outputs, the layer output) and
    # ~8 E-wide router rows per token (measured on k3-small, 512 experts)
    per_seq_mlp = T * _F32 * (12 * hidden + 8 * n_experts + 8 * top_k)
    free = budget - baseline - weights
    need = baseline + weights + max(per_seq_attn, per_seq_mlp)
    if free < max(per_seq_attn, per_seq_mlp):
        raise ReapError(f"--budget {format_bytes(budget, 2)} is too small for this model and "
                        f"--seq-len {T}: one layer's weights and one sequence need about "
                        f"{format_bytes(need, 2)}")
    fit_attn = max(1, free // per_seq_attn)
    if batch is None:
        batch = int(min(n_seq, fit_attn, 64))
    elif batch > fit_attn:
        raise ReapError(f"--batch {batch} does not fit --budget {format_bytes(budget, 2)}: at most "
                        f"{fit_attn} sequences of {T} tokens fit")
    pass_seqs = int(min(n_seq, max(1, free // per_seq_mlp), max_pass_seqs or n_seq))
    return BatchPlan(budget, baseline, weights, per_seq_attn, per_seq_mlp,
                     n_seq * T * state_tok, int(batch), pass_seqs,
                     math.ceil(n_seq / pass_seqs) if n_seq else 0)
