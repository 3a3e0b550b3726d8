"""Many-token steps (prefill chunks, perplexity windows) through the compiled step kernels, for
the layers `reap.engine.native` runs one token at a time: per layer, one library call per
sequence for the attention half (`reap_attn_prefill`), then the routed experts of every token of
the step in one call (`NativeDecoder.routed`; a dense MLP as one expert of weight 1); torch is
left the embedding and the head.

Why: torch runs some forty small ops a layer on one thread between the kernels' products (a
tenth of a 32-token prefill on 1b float32 at 2 threads). The arithmetic is the decode step's,
so a run's numbers do not depend on its memory preset.
"""

from __future__ import annotations

import time

import torch

from reap.models import base
from reap.quant import ckernel, step_kernel

_A = step_kernel.ATTN


def usable(nd, chunks: list[list[int]]) -> bool:
    """Whether `step` takes a step of these chunks: the native decoder serves the model, and in
    bf16 no more than PAIR_ROWS tokens (above it torch's bf16 matmul on the CPU's bf16 dot-product
    instructions is faster; without them PAIR_ROWS is unbounded)."""
    return nd.serves(chunks, step_kernel.PAIR_ROWS)


def step(nd, seqs, chunks, all_positions: bool, more: bool, first: int) -> list[torch.Tensor]:
    """`Engine.step` of many-token chunks (see `usable`): logits per sequence as `_step`'s."""
    states = nd.eng.embed(chunks)
    hs = [st.hidden.reshape(-1, st.hidden.shape[-1]).to(torch.float32, copy=True)
          for st in states]  # fmt: skip  # [T, D] each, updated in place
    with ckernel.spinning(nd.lib):  # the kernels' jobs follow each other closely
        for i, spec in enumerate(nd.specs):
            _layer(nd, i, spec, seqs, hs)
    return _head(nd, seqs, states, hs, all_positions, more, first)


def _layer(nd, i: int, spec, seqs, hs: list[torch.Tensor]) -> None:
    eng = nd.eng
    t0 = time.perf_counter()
    units = eng.trunk.get(i)
    args = nd.layer_args(i, spec, units)
    routes = [_attention(nd, spec, args, h, s.caches[i]) for h, s in zip(hs, seqs)]
    x2, ids, weights = (torch.cat(r) for r in zip(*routes))  # [N, D], [N, K], [N, K]
    y = _mlp(nd, i, spec, units, x2, ids, weights)
    eng.experts.release()
    for h, y_k in zip(hs, y.split([h.shape[0] for h in hs])):
        nd.lib.reap_residual(h.data_ptr(), y_k.data_ptr(), h.numel(), int(nd.rnd))
    eng.unit_seconds[i] += time.perf_counter() - t0


def _attention(nd, spec, a, h: torch.Tensor, cache):
    """The attention half for one sequence's tokens h [T, D] (updated in place; their keys and
    values written into the cache, advanced by T) -> the MLP input [T, D] fp32 and the routing
    ids, weights [T, K]."""
    (T, D), K = h.shape, max(1, spec.top_k)
    outs = torch.empty(T, D), torch.empty(T, K, dtype=torch.int64), torch.empty(T, K)
    nd.bind(spec, a, h, cache, outs)
    a[_A["scratch"]] = nd.scratch_of(nd.lib.reap_attn_prefill_scratch(a, T)).data_ptr()
    nd.floats[0], nd.floats[1] = spec.eps, spec.dk**-0.5
    nd.lib.reap_attn_prefill(a, nd.floats, T)
    cache.advance(T)
    return outs


def _mlp(nd, i: int, spec, units: dict, x2, ids, weights) -> torch.Tensor:
    """The MLP of every token of the step -> [N, D] fp32 (each expert's output rounded as the
    torch path rounds it, the weighted sum not)."""
    if spec.router is None:  # a dense MLP: one expert of weight 1
        table = torch.tensor([[units[spec.prefix + n].data_ptr() for n in spec.mlp]])
        F = units[spec.prefix + spec.mlp[0]].shape[0]
        ones = torch.ones(x2.shape[0], 1)
        return nd.moe_call(x2, torch.zeros_like(ones, dtype=torch.int64), ones, table, F)
    E = units[spec.prefix + spec.router].shape[0]
    return nd.routed(i, spec, x2, ids, weights, E)  # not None: `usable` bounds bf16 rows


def _head(nd, seqs, states, hs, all_positions: bool, more: bool, first: int):
    """The family's final norm and head (as `Engine._step`) of the last position, or of every
    position from `first` on."""
    eng = nd.eng
    t0 = time.perf_counter()
    units = eng.trunk.get(len(nd.specs), wrap=more)
    out = []
    for s, st, h in zip(seqs, states, hs):
        s.length += h.shape[0]
        hidden = (h[first:] if all_positions else h[-1:]).to(eng.dtype)[None]  # [1, T, D]
        out.append(eng.model.head(units.__getitem__, base.State(hidden, st.blocks))[0].float())
    eng.unit_seconds[-1] += time.perf_counter() - t0
    return out if all_positions else [o[-1] for o in out]
