"""Turn MoE routing records into per-corpus, per-layer expert statistics.

`StatsAccumulator` is the observer calibration hands to `model.mlp_block`: each `MoERecord` covers
the tokens of a contiguous span of calibration sequences (set with `span`), and every statistic is
added only for the experts each token was actually routed to. Sums are float64 and counts int64,
accumulated in token order, so results are deterministic on the CPU and shards merge exactly.

Dimension letters: N tokens of a record, K top_k, E n_experts, S sequences, T seq_len.
"""

from __future__ import annotations

import torch

from reap.models.base import MoERecord
from reap.stats import ExpertSums, zero_sums

# Tokens per step of the [n, E] and [n, K, K] temporaries (bounds their memory).
_CHUNK = 4096


class StatsAccumulator:
    """Observer that accumulates `ExpertSums` rows ([E]; coact [E, E], seq_count
    [S_c, E]) per (layer, corpus) from MoE records.

    `seq_corpus[s]` is the corpus index (0..n_corpora-1) of calibration sequence s; every
    sequence has `seq_len` tokens. Before each `mlp_block` call, `span(s0, s1)` says which
    sequences the record's N = (s1 - s0) * seq_len tokens belong to (row-major [S, T]).
    """

    wants_norms = True
    wants_gram = False  # set by the recon pass: records carry `gram` to `record_sink`

    def __init__(self, n_experts: int, top_k: int, seq_corpus: list[int], seq_len: int,
                 n_corpora: int, seq_counts: bool = True, prob_gram: bool = False):
        self.n_experts, self.top_k, self.seq_len = n_experts, top_k, seq_len
        self.n_corpora = n_corpora
        self.seq_corpus = torch.tensor(seq_corpus, dtype=torch.int64)  # [S]
        # position of each sequence among its corpus's sequences
        local = torch.zeros(len(seq_corpus), dtype=torch.int64)
        sizes = [0] * n_corpora
        for s, c in enumerate(seq_corpus):
            local[s], sizes[c] = sizes[c], sizes[c] + 1
        self.seq_local, self.corpus_sizes = local, sizes
        self.seq_counts, self.prob_gram = seq_counts, prob_gram
        self.rows: dict[int, list[ExpertSums]] = {}  # layer -> row per corpus
        self.span_seqs = (0, len(seq_corpus))
        # optional: ids_sink(layer, first_token, ids [N, K]) receives every record's routing
        self.ids_sink = None
        # optional: record_sink(record on the CPU, corpus index [N] of its tokens) receives every
        # record (the recon criterion's pass, `reap.prune.recon`)
        self.record_sink = None

    def span(self, s0: int, s1: int) -> None:
        """The next records cover sequences s0..s1-1 (all of their tokens, in order)."""
        self.span_seqs = (s0, s1)

    def layer(self, layer: int) -> list[ExpertSums]:
        """The rows of a layer, one per corpus (created empty on first use)."""
        if layer not in self.rows:
            self.rows[layer] = [
                ExpertSums(**zero_sums(self.n_experts, n if self.seq_counts else None))
                for n in self.corpus_sizes
            ]
            for row in self.rows[layer] if self.prob_gram else ():
                row.prob_gram = torch.zeros(self.n_experts, self.n_experts, dtype=torch.float64)
        return self.rows[layer]

    def on_moe(self, record: MoERecord) -> None:
        """Add one record's routed tokens to its layer's rows."""
        s0, s1 = self.span_seqs
        n_tok = (s1 - s0) * self.seq_len
        if record.ids.shape[0] != n_tok:
            raise RuntimeError(f"MoE record of layer {record.layer} has {record.ids.shape[0]} "
                               f"tokens, expected {n_tok} for sequences {s0}..{s1 - 1}")
        if record.latent_norm is None or record.model_norm is None or record.max_act is None:
            raise RuntimeError(f"MoE record of layer {record.layer} lacks expert output norms")
        rec = _to_cpu(record)
        if self.ids_sink is not None:
            self.ids_sink(record.layer, s0 * self.seq_len, rec.ids)
        seq = torch.arange(s0, s1).repeat_interleave(self.seq_len)  # [N]
        tok_corpus = self.seq_corpus[seq]  # [N]
        if self.record_sink is not None:
            self.record_sink(rec, tok_corpus)
        rows = self.layer(record.layer)
        for c in torch.unique(tok_corpus).tolist():
            sel = (tok_corpus == c).nonzero().squeeze(1)  # [n]
            self._add(rows[c], rec, sel, seq[sel])

    def _add(self, row: ExpertSums, rec: MoERecord, sel: torch.Tensor, seq: torch.Tensor) -> None:
        E = self.n_experts
        ids = rec.ids[sel]  # [n, K]
        flat = ids.reshape(-1)  # [n*K]
        w = rec.weights[sel].double()  # [n, K]
        model_norm = rec.model_norm[sel].double()  # [n, K]
        latent_norm = rec.latent_norm[sel].double()  # [n, K]
        row.count += torch.bincount(flat, minlength=E)
        row.gate_sum.index_add_(0, flat, w.reshape(-1))
        row.reap_sum.index_add_(0, flat, (w * model_norm).reshape(-1))
        row.reap_latent_sum.index_add_(0, flat, (w * latent_norm).reshape(-1))
        row.ean_sum.index_add_(0, flat, model_norm.reshape(-1))
        row.ean_latent_sum.index_add_(0, flat, latent_norm.reshape(-1))
        row.max_act.scatter_reduce_(0, flat, rec.max_act[sel].float().reshape(-1), "amax")
        for i in range(0, ids.shape[0], _CHUNK):
            probs = rec.probs[sel[i:i + _CHUNK]].double()  # [m, E]
            row.prob_mass += probs.sum(0)
            if row.prob_gram is not None:
                row.prob_gram += probs.T @ probs  # [E, E]
            part = ids[i:i + _CHUNK]  # [m, K]
            pairs = part[:, :, None] * E + part[:, None, :]  # [m, K, K]
            row.coact += torch.bincount(pairs.reshape(-1), minlength=E * E).view(E, E)
        if row.seq_count is not None:
            local = self.seq_local[seq]  # [n]
            keys = (local[:, None] * E + ids).reshape(-1)  # [n*K]
            lo, hi = int(local.min()), int(local.max()) + 1
            part = torch.bincount(keys - lo * E, minlength=(hi - lo) * E).view(hi - lo, E)
            row.seq_count[lo:hi] += part.to(torch.int32)


def _to_cpu(r: MoERecord) -> MoERecord:
    def cpu(t):
        return None if t is None else t.detach().to("cpu")

    return MoERecord(r.layer, cpu(r.ids).long(), cpu(r.weights), cpu(r.probs),
                     cpu(r.latent_norm), cpu(r.model_norm), cpu(r.max_act), cpu(r.gram),
                     cpu(r.norm_gram), cpu(r.norm_eps))


class OutputProbe:
    """Every expert's output on a token sample (calibration token g when g % stride == 0),
    routed to it or not, summed per corpus into `ExpertSums.out_sum` (`--merge-stats`). As the
    expert source's `probe` it wraps the layer's source and expert function (`routed_experts`),
    so a routed expert runs on the sample with the same read; `finish` runs the others."""

    def __init__(self, acc: StatsAccumulator, stride: int):
        self.acc, self.stride, self.pending = acc, stride, None

    def __call__(self, layer: int, x: torch.Tensor, experts, run):
        T, (s0, s1) = self.acc.seq_len, self.acc.span_seqs
        g = torch.arange(s0 * T, s1 * T)  # [N] calibration token index of each row of x
        sel = (g % self.stride == 0).nonzero().squeeze(1)  # [M]
        corpus = self.acc.seq_corpus[g[sel] // T]  # [M]
        self.pending = (layer, x[sel.to(x.device)], corpus, experts, run, set())
        tags = {}

        def source(layer_: int, e: int):
            tensors = experts(layer_, e)
            tags[id(tensors)] = (e, tensors)
            return tensors

        def wrapped(xs: torch.Tensor, tensors) -> torch.Tensor:
            self._add(tags.pop(id(tensors))[0], tensors)
            return run(xs, tensors)

        return source, wrapped

    def _add(self, e: int, tensors) -> None:
        layer, xs, corpus, _, run, seen = self.pending
        seen.add(e)
        out = run(xs, tensors).double().cpu()  # [M, Dx]
        for c, row in enumerate(self.acc.layer(layer)):
            if row.out_sum is None:
                row.out_sum = torch.zeros(self.acc.n_experts, out.shape[1])
                row.out_count = torch.zeros(self.acc.n_experts, dtype=torch.int64)
            mine = corpus == c
            row.out_sum[e] += out[mine].sum(0).float()
            row.out_count[e] += int(mine.sum())

    def finish(self) -> None:
        """Run the experts the last pass did not route on its sample."""
        if self.pending is not None:
            layer, _, _, experts, _, seen = self.pending
            for e in sorted(set(range(self.acc.n_experts)) - seen):
                self._add(e, experts(layer, e))
        self.pending = None
