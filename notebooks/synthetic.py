"""Synthetic expert statistics with planted structure, for tests, the notebook and demos.

Real statistics come from `reap calibrate`; these are made by simulating a router: every token
of every sequence routes to `top_k` distinct experts drawn without replacement in proportion to
a per-sequence usage distribution (Gumbel top-k). The result is an ordinary `ExpertStats`
(counts, co-activation, per-sequence counts, gate and output-norm sums), so analysis code cannot
tell it from a calibration run, while the truth it should recover is known (`planted_corpora`).

Dimension letters: S sequences, L layers, E experts, T tokens per sequence, K top_k.
"""

from __future__ import annotations

import numpy as np
import torch

from reap.stats import ExpertStats

DEFAULT_FAMILIES = {"european": ["en", "de", "fr"], "code": ["python", "rust"], "chinese": ["zh"]}


def routed_stats(
    probs: np.ndarray,
    *,
    tokens_per_seq: int,
    top_k: int,
    seed: int = 0,
    corpus: str = "synthetic",
    model: str = "synthetic-model",
    with_seq_count: bool = True,
) -> ExpertStats:
    """Simulate routing and return the statistics a calibration run would record.

    probs: [S, L, E] usage distribution of each sequence at each layer (rows sum to 1).
    Each token picks `top_k` distinct experts; gate weights are the chosen probabilities
    renormalized; an expert's output norm is a fixed per-expert scale (shared by all corpora of
    the same `model`) times log-normal token noise.
    """
    probs = np.asarray(probs, dtype=np.float64)
    S, L, E = probs.shape
    if top_k > E:
        raise ValueError("top_k exceeds n_experts")
    gen = torch.Generator().manual_seed(seed)
    logp = torch.from_numpy(np.log(np.clip(probs, 1e-300, None)))  # [S, L, E]
    uniform = torch.rand((S, L, tokens_per_seq, E), generator=gen, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
    idx = (logp[:, :, None, :] + gumbel).topk(top_k, dim=-1).indices  # [S, L, T, K]
    chosen_p = torch.gather(
        torch.from_numpy(probs)[:, :, None, :].expand(-1, -1, tokens_per_seq, -1), -1, idx
    )  # [S, L, T, K]
    gate = chosen_p / chosen_p.sum(-1, keepdim=True)
    scale = _expert_scales(model, L, E)  # [L, E]
    lscale = scale[torch.arange(L)[None, :, None, None], idx]  # [S, L, T, K]
    norm = lscale * torch.exp(0.25 * torch.randn(idx.shape, generator=gen, dtype=torch.float64))
    meta = {"corpus": corpus, "model": model, "synthetic": True, "seed": seed}
    return _assemble(probs, idx, gate, norm, E, top_k, tokens_per_seq, meta, with_seq_count)


def _expert_scales(model: str, L: int, E: int) -> torch.Tensor:
    """Per-expert output-norm scale, a pure function of the model name: [L, E]."""
    g = torch.Generator().manual_seed(sum(map(ord, model)) * 7919 + L * 31 + E)
    return torch.exp(0.3 * torch.randn((L, E), generator=g, dtype=torch.float64))


def _assemble(probs, idx, gate, norm, E, top_k, T, meta, with_seq_count) -> ExpertStats:
    S, L = probs.shape[:2]
    st = ExpertStats.zeros(list(range(1, L + 1)), E, top_k, meta=meta)
    st.tokens = S * T
    onehot = torch.zeros((S, L, T, E), dtype=torch.float64)
    onehot.scatter_(-1, idx, 1.0)  # [S, L, T, E]
    seq = onehot.sum(2)  # [S, L, E]
    st.count = seq.sum(0).round().long()

    def routed_sum(v):  # sum over tokens of per-choice values, landed on their experts: [L, E]
        out = torch.zeros((S, L, T, E), dtype=torch.float64)
        out.scatter_add_(-1, idx, v)
        return out.sum((0, 2))

    st.gate_sum = routed_sum(gate)
    st.reap_sum = routed_sum(gate * norm)
    st.reap_latent_sum = 0.5 * st.reap_sum
    st.ean_sum = routed_sum(norm)
    st.ean_latent_sum = 0.5 * st.ean_sum
    mx = torch.zeros((S, L, T, E), dtype=torch.float64)
    mx.scatter_reduce_(-1, idx, norm, reduce="amax")
    st.max_act = mx.amax((0, 2)).float()
    st.prob_mass = torch.from_numpy(probs).sum(0) * T
    flat = onehot.permute(1, 0, 2, 3).reshape(L, S * T, E)  # [L, S*T, E]
    st.coact = torch.einsum("lti,ltj->lij", flat, flat).round().long()
    if with_seq_count:
        st.seq_count = seq.round().int()
    return st


def sequence_probs(
    profile: np.ndarray, n_seqs: int, *, concentration: float = 200.0, rng: np.random.Generator
) -> np.ndarray:
    """Per-sequence usage distributions scattered around a corpus profile.

    profile: [L, E] rows summing to 1. Each sequence draws Dirichlet(concentration * profile)
    per layer, so sequences differ (topic drift) but average to the profile. Returns [S, L, E].
    """
    alpha = np.clip(concentration * profile, 1e-3, None)
    out = rng.gamma(np.broadcast_to(alpha, (n_seqs, *alpha.shape)))  # [S, L, E]
    out = np.clip(out, 1e-12, None)
    return out / out.sum(-1, keepdims=True)


def planted_profiles(
    *,
    families: dict[str, list[str]] | None = None,
    n_layers: int = 4,
    n_experts: int = 64,
    generalists: int = 8,
    home_boost: float = 3.0,
    generalist_boost: float = 2.0,
    corpus_noise: float = 0.3,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Usage profiles with planted family structure.

    Per layer: `generalists` experts favored by every corpus (logit +generalist_boost); the rest
    split into disjoint home blocks, one per family (logit +home_boost), plus corpus-specific
    Gaussian logit noise. Returns ({corpus: profile [L, E]}, {family: home mask [L, E] bool}).
    """
    families = families or DEFAULT_FAMILIES
    rng = np.random.default_rng(seed)
    n_fam = len(families)
    block = (n_experts - generalists) // (n_fam + 1)  # one unowned block of the same size
    if block < 1:
        raise ValueError("too few experts for the families")
    homes = {f: np.zeros((n_layers, n_experts), bool) for f in families}
    base = np.zeros((n_layers, n_experts))
    for layer in range(n_layers):
        perm = rng.permutation(n_experts)
        base[layer, perm[:generalists]] = generalist_boost
        for i, f in enumerate(families):
            homes[f][layer, perm[generalists + i * block : generalists + (i + 1) * block]] = True
    profiles = {}
    for f, members in families.items():
        for c in members:
            logits = base + home_boost * homes[f] + corpus_noise * rng.standard_normal(base.shape)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            profiles[c] = p / p.sum(-1, keepdims=True)
    return profiles, homes


def planted_corpora(
    *,
    families: dict[str, list[str]] | None = None,
    n_layers: int = 4,
    n_experts: int = 64,
    top_k: int = 4,
    n_seqs: int = 24,
    tokens_per_seq: int = 64,
    concentration: float = 200.0,
    seed: int = 0,
    with_seq_count: bool = True,
    **profile_kw,
) -> list[ExpertStats]:
    """Statistics of every corpus of `families`, routed through one synthetic model (knobs:
    `planted_profiles`): cross-family top-m sets overlap less than chance."""
    profiles, _ = planted_profiles(
        families=families, n_layers=n_layers, n_experts=n_experts, seed=seed, **profile_kw
    )
    seeds = np.random.SeedSequence(seed).spawn(len(profiles))
    out = []
    for (name, prof), ss in zip(profiles.items(), seeds):
        rng = np.random.default_rng(ss)
        probs = sequence_probs(prof, n_seqs, concentration=concentration, rng=rng)
        out.append(
            routed_stats(
                probs,
                tokens_per_seq=tokens_per_seq,
                top_k=top_k,
                seed=int(rng.integers(2**31)),
                corpus=name,
                with_seq_count=with_seq_count,
            )
        )
    return out


def write_corpora(stats: list[ExpertStats], out_dir: str) -> list[str]:
    """Save each corpus's statistics as `<out_dir>/<corpus>.safetensors`; returns the paths."""
    import os

    return [s.save(os.path.join(out_dir, f"{s.meta['corpus']}.safetensors")) for s in stats]
