"""The streamed pass of `--criterion recon` and `plan_recon`, which runs it and the search of
`reap.prune.recon`: rerun the statistics' calibration with an observer that keeps, per MoE
layer, every wanted token's routing and the per-token Gram of its experts' contributions
(`MoERecord.gram`; the diagonal from `model_norm` when a record has none), as `LayerTokens`.

Dimension letters: N tokens, K top_k.
"""

from __future__ import annotations

import os
import tempfile

import torch

from reap.errors import ReapError
from reap.prune import recon
from reap.prune.recon import FIELDS, LayerTokens


class Collector:
    """Calibration observer sink keeping, per layer, the records of the wanted corpora (with
    their Gram: `wants_gram`)."""

    wants_gram = True

    def __init__(self, wanted: dict[int, float]):
        self.wanted = wanted  # corpus index in the run -> objective weight of its tokens
        self.parts: dict[int, list[tuple]] = {}

    def __call__(self, rec, tok_corpus: torch.Tensor) -> None:
        codes = torch.tensor(sorted(self.wanted))
        sel = torch.isin(tok_corpus, codes).nonzero().squeeze(1)  # [n]
        if sel.numel() == 0:
            return
        w = rec.weights[sel].double()  # [n, K]
        ww = w[:, :, None] * w[:, None, :]  # [n, K, K]
        if rec.gram is not None:  # G_t = w_k w_j <u_k, u_j>
            gram = rec.gram[sel].double() * ww  # [n, K, K]
        else:  # its diagonal: w^2 ||u||^2
            gram = (w * rec.model_norm[sel].double()).pow(2)  # [n, K]
        norm, eps = None, None
        if rec.gram is not None and rec.norm_gram is not None:
            norm, eps = (rec.norm_gram[sel].double() * ww).float(), rec.norm_eps[sel].float()
        part = (rec.ids[sel].to(torch.int16), w.float(), gram.float(), tok_corpus[sel], norm, eps)
        self.parts.setdefault(rec.layer, []).append(part)

    def layer(self, layer: int) -> LayerTokens:
        parts = self.parts[layer]
        if len({p[2].dim() for p in parts}) > 1 or any(p[4] is None for p in parts):
            parts = [(i, w, g, c, None, None) for i, w, g, c, *_ in parts]  # all or none
        if len({p[2].dim() for p in parts}) > 1:  # some records with a Gram, some without
            parts = [(i, w, _diagonal(g), c, *r) for i, w, g, c, *r in parts]
        ids, w, gram, corpus = (torch.cat(x) for x in list(zip(*parts))[:4])
        norm, eps = None, None
        if parts[0][4] is not None:
            norm, eps = (torch.cat([p[k] for p in parts]).double() for k in (4, 5))
        gram = gram.double()
        energy = gram.sum(-1) if gram.dim() == 2 else gram.sum((-2, -1))  # [N] ||routed||^2
        scale = torch.zeros(ids.shape[0], dtype=torch.float64)
        for c, weight in self.wanted.items():
            m = corpus == c
            scale[m] = weight / max(float(energy[m].sum()), 1e-300)
        return LayerTokens(ids.long(), w.double(), gram, scale, norm, eps)


def _diagonal(gram: torch.Tensor) -> torch.Tensor:
    """The diagonal [N, K] of a Gram [N, K, K] (a diagonal one as it is)."""
    return torch.diagonal(gram, dim1=-2, dim2=-1) if gram.dim() == 3 else gram


def gram_kind(tokens: dict[int, LayerTokens]) -> str:
    """`full` when every layer's records carry the Gram, `diagonal` when none does, else
    `mixed`."""
    kinds = {"full" if t.gram.dim() == 3 else "diagonal" for t in tokens.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _run_key(meta: dict) -> tuple:
    a = meta.get("arguments") or {}
    return (a.get("model"), a.get("corpus"), a.get("tokens"), a.get("seq_len"), a.get("seed"),
            tuple(a.get("shard") or (1, 1)), a.get("dtype"))


def collect(loaded, weights: dict[str, float], checkpoint: str | None, budget: int,
            progress: bool = False) -> dict[int, LayerTokens]:
    """Rerun the calibration of the statistics `loaded` ([(name, path, ExpertStats)]) as one
    streamed pass per distinct calibration run, keeping their corpora's routing records;
    returns {layer: LayerTokens}."""
    from reap.calibrate.pipeline import calibrate
    from reap.corpora import parse_spec

    runs: dict[tuple, dict[str, float]] = {}
    total = sum(weights.values())
    for name, path, s in loaded:
        metas = s.meta.get("merged_from") or [s.meta]
        parts = [str(m.get("corpus")) for m in metas]
        for m, part in zip(metas, parts):
            key = _run_key(m)
            if not key[1] or not key[2]:
                raise ReapError(f"{path}: statistics without their calibration arguments "
                                "(recon reruns the calibration pass)")
            runs.setdefault(key, {})[part] = weights[name] / total / len(parts)
    merged: dict[int, list[LayerTokens]] = {}
    for key, want in runs.items():
        model, spec, tokens, seq_len, seed, shard, dtype = key
        names = [n for n, _ in parse_spec(spec)]
        sink = Collector({names.index(c): w for c, w in want.items()})
        with tempfile.TemporaryDirectory(prefix="reap-recon-") as tmp:
            calibrate(corpus=spec, tokens=tokens, seq_len=seq_len, out=os.path.join(tmp, "o"),
                      model=checkpoint or model, budget=budget, seed=seed, shard=shard,
                      dtype=dtype or "float32", seq_counts=False, progress=progress,
                      observe=sink)
        for layer in sink.parts:
            merged.setdefault(layer, []).append(sink.layer(layer))
    return {layer: _cat(ts) for layer, ts in merged.items()}


def _cat(ts: list[LayerTokens]) -> LayerTokens:
    if len(ts) == 1:
        return ts[0]
    K = max(t.ids.shape[1] for t in ts)
    if any(t.ids.shape[1] != K for t in ts):
        raise ReapError("recon: statistics of runs with different top_k")
    if len({t.gram.dim() for t in ts}) > 1 or len({t.norm is None for t in ts}) > 1:
        ts = [LayerTokens(t.ids, t.w, _diagonal(t.gram), t.scale) for t in ts]
    cols = [[getattr(t, f) for t in ts] for f in FIELDS]
    return LayerTokens(*(None if c[0] is None else torch.cat(c) for c in cols))


def plan_recon(*, stats: list[str], checkpoint: str | None = None, budget: int = 4_000_000_000,
               progress: bool = False, tokens: dict[int, LayerTokens] | None = None, **plan_kw):
    """A `make_plan` plan (same arguments; its counts, protected experts and REAP scores) whose
    kept sets recon chooses; `checkpoint` is the model to stream (default: the one the
    statistics were calibrated on), `budget` the pass's RSS budget in bytes, `tokens` the
    records of an earlier `collect` (skips the pass)."""
    import time

    from reap.models import family
    from reap.prune.plan import load_stats, make_plan

    if plan_kw.pop("quota", False):
        raise ReapError("--criterion recon does not take --quota (it weighs corpora by --weights)")
    plan_kw["criterion"] = "reap"
    plan = make_plan(stats=stats, **plan_kw)
    config = plan_kw.get("config")
    if config is not None and int(family(config).expert_groups(config)) > 1:
        raise ReapError("--criterion recon does not support grouped routing (n_group > 1)")
    t0 = time.perf_counter()
    if tokens is None:
        tokens = collect(load_stats(stats), plan.combine["weights"], checkpoint, budget, progress)
    prot = [{e["expert"] for e in plan.protected if e["layer"] == layer} for layer in plan.layers]
    counts = [plan.counts[layer] for layer in plan.layers]
    kept, record = recon.recon_keep(plan.layers, counts, tokens, plan.n_experts, prot, plan.keep)
    plan.keep, plan.criterion = kept, "recon"
    kind = gram_kind(tokens)
    plan.recon = {"objective": OBJECTIVE + (ORTHOGONAL if kind != "full" else ""),
                  "method": f"{recon.METHOD}; {kind} Gram", "gram": kind, "layers": record,
                  "seconds": time.perf_counter() - t0,
                  "scores": "plan.scores are the REAP shares (counts of a global scope)"}
    return plan


OBJECTIVE = ("per layer, sum over calibration tokens of ||routed output - output with the "
             "dropped experts removed and the token's weights renormalised over its surviving "
             "experts||^2 (each corpus relative to its own output energy, weighted as --weights)")
ORTHOGONAL = (" (no per-token Gram in the records: expert contributions to one token taken as "
              "orthogonal)")
