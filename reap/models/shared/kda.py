"""Kimi Delta Attention (KDA, the gated delta rule of Kimi Linear and Kimi K3): the short
causal convolution, the per-step recurrence (the slow reference) and its chunked WY form, and the
whole attention block. Dimension letters as in `reap.models.shared.blocks`: B batch, T new tokens,
H heads, Dk key/query head width, Dv value head width, C chunk length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import conv1d, pad, silu, softplus

from reap.models.shared.blocks import WeightFn, linear, rms_norm

Tensor = torch.Tensor


@dataclass
class KDACache:
    """Decode state of one KDA layer: conv tail [B, k-1, 3*H*Dk], recurrent state [B, H, Dv, Dk]
    fp32."""

    conv: Tensor | None = None
    state: Tensor | None = None


def short_conv(x: Tensor, w: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU. x [B, T, C], w [C, 1, k], tail [B, k-1, C] (previous inputs,
    zeros at the start). Returns (silu(conv) [B, T, C], new tail [B, k-1, C]). The conv runs in
    fp32 and is rounded to x's dtype once, as torch's bf16 conv accumulates; torch's bf16
    depthwise conv itself took 300x the fp32 one's time on a CPU without bf16 instructions."""
    k = w.shape[-1]
    if tail is None:
        tail = x.new_zeros(x.shape[0], k - 1, x.shape[2])
    xp = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, k-1+T, C]
    y = conv1d(xp.transpose(1, 2).float(), w.to(x.dtype).float(), groups=x.shape[2])  # [B, C, T]
    return silu(y.to(x.dtype).transpose(1, 2)), xp[:, xp.shape[1] - (k - 1) :]


def kda_log_decay(a: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Per-channel log decay log g [..., H, Dk] (fp32) from a [..., H, Dk], A_log [H], dt_bias
    [H, Dk]: lower_bound * sigmoid(exp(A_log) * (a + dt_bias)); unbounded form without a bound."""
    A = A_log.float().exp()[:, None]  # [H, 1]
    z = a.float() + dt_bias.float()
    if lower_bound is None:
        return -A * softplus(z)
    return lower_bound * torch.sigmoid(A * z)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last axis (fp32 inside)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_recurrent(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """Gated delta rule, one step at a time (decode; the slow reference of `kda_chunked`).

    q, k [B, T, H, Dk] (q already scaled), v [B, T, H, Dv], log_g [B, T, H, Dk], beta [B, T, H],
    state [B, H, Dv, Dk]; all fp32. Returns (o [B, T, H, Dv], final state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * log_g[:, t].exp()[:, :, None, :]
        kv = torch.einsum("bhvk,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]  # [B, H, Dv]
        state = state + delta[..., None] * k[:, t, :, None, :]
        outs.append(torch.einsum("bhvk,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


def kda_chunked(
    q: Tensor, k: Tensor, v: Tensor, log_g: Tensor, beta: Tensor, state: Tensor, chunk: int = 16
) -> tuple[Tensor, Tensor]:
    """The same recurrence in chunks of `chunk` tokens (prefill/training), WY form.

    Within a chunk, the delta-rule updates U [C, Dv] solve (I + A) U = beta*(V - (k*a) S0^T) with
    A[t, s] = beta_t sum_d k_td k_sd exp(G_td - G_sd) (s < t), G the in-chunk cumulative log decay;
    then o_t = S0 (q_t*a_t) + sum_{s<=t} u_s (k_s . q_t*exp(G_t-G_s)). Exponent differences are
    taken against the chunk midpoint so nothing overflows for |log g| * C / 2 < 80: faster decays
    (Kimi Linear's gate is unbounded) take smaller chunks. Only a loop over chunks remains (the
    state passes between them). Shapes/dtypes as `kda_recurrent`."""
    while chunk > 1 and float(log_g.min()) * chunk < -160:
        chunk //= 2
    Bn, T, H, _ = q.shape
    n_pad = (-T) % chunk
    if n_pad:  # zero k, v, beta and log g leave the state untouched
        q, k, v, log_g = (pad(x, (0, 0, 0, 0, 0, n_pad)) for x in (q, k, v, log_g))
        beta = pad(beta, (0, 0, 0, n_pad))
    n, C = (T + n_pad) // chunk, chunk

    def split(x):  # [B, T, H, X] -> [B, H, n, C, X]
        return x.reshape(Bn, n, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, G = split(q), split(k), split(v), split(log_g).cumsum(-2)
    b = split(beta[..., None])  # [B, H, n, C, 1]
    Gm = G[..., C // 2 : C // 2 + 1, :]  # [B, H, n, 1, Dk] reference point
    k_fwd, k_bwd = k * (G - Gm).exp(), k * (Gm - G).exp()
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    A = (b * (k_fwd @ k_bwd.transpose(-1, -2))).masked_fill(~strict, 0)  # [B, H, n, C, C]
    M = A + torch.eye(C, dtype=A.dtype, device=A.device)
    W_v = torch.linalg.solve_triangular(M, b * v, upper=False, unitriangular=True)  # [.., C, Dv]
    W_k = torch.linalg.solve_triangular(M, b * k * G.exp(), upper=False, unitriangular=True)
    Aq = ((q * (G - Gm).exp()) @ k_bwd.transpose(-1, -2)).masked_fill(~incl, 0)  # s <= t
    q_dec = q * G.exp()
    G_last = G[..., -1:, :]  # [B, H, n, 1, Dk]
    k_end = k * (G_last - G).exp()
    outs = []
    for c in range(n):
        U = W_v[:, :, c] - W_k[:, :, c] @ state.transpose(-1, -2)  # [B, H, C, Dv]
        outs.append(q_dec[:, :, c] @ state.transpose(-1, -2) + Aq[:, :, c] @ U)
        state = state * G_last[:, :, c].exp() + U.transpose(-1, -2) @ k_end[:, :, c]
    o = torch.stack(outs, dim=2).permute(0, 2, 3, 1, 4).reshape(Bn, n * C, H, -1)  # [B, T', H, Dv]
    return o[:, :T], state


def kda_attention(
    x: Tensor,
    w: WeightFn,
    heads: int,
    head_dim: int,
    lower_bound: float | None,
    eps: float,
    cache: KDACache | None = None,
    chunk: int = 16,
    low_rank_gate: bool = False,
) -> Tensor:
    """Kimi Delta Attention: x [B, T, D] -> [B, T, D]. Weights (short names): {q,k,v}_proj,
    {q,k,v}_conv1d, f_a_proj, f_b_proj, b_proj, g_proj (or g_a_proj, g_b_proj with
    `low_rank_gate`, Kimi Linear), A_log (padded), dt_bias, o_norm, o_proj.
    Updates `cache` in place when given (decode)."""
    Bn, T, _ = x.shape
    H, Dk, P = heads, head_dim, heads * head_dim
    qkv = torch.cat([linear(x, w(f"{n}_proj.weight")) for n in "qkv"], -1)  # [B, T, 3P]
    conv_w = torch.cat([w(f"{n}_conv1d.weight") for n in "qkv"], 0)  # [3P, 1, k]
    qkv, tail = short_conv(qkv, conv_w, cache.conv if cache else None)
    q, k, v = (t.reshape(Bn, T, H, Dk) for t in qkv.split(P, dim=-1))  # [B, T, H, Dk]
    q, k = l2_normalize(q) * Dk**-0.5, l2_normalize(k)
    a = linear(linear(x, w("f_a_proj.weight")), w("f_b_proj.weight")).reshape(Bn, T, H, Dk)
    log_g = kda_log_decay(a, w("A_log")[:H], w("dt_bias").reshape(H, Dk), lower_bound)
    beta = torch.sigmoid(linear(x, w("b_proj.weight")).float())  # [B, T, H]
    state = (
        cache.state
        if cache and cache.state is not None
        else x.new_zeros(Bn, H, Dk, Dk, dtype=torch.float32)
    )
    core = kda_recurrent if T == 1 else kda_chunked
    o, state = core(q.float(), k.float(), v.float(), log_g, beta, state)
    if cache is not None:
        cache.conv, cache.state = tail, state
    if low_rank_gate:
        g = linear(linear(x, w("g_a_proj.weight")), w("g_b_proj.weight"))  # [B, T, P]
    else:
        g = linear(x, w("g_proj.weight"))
    gate = torch.sigmoid(g.float()).reshape(Bn, T, H, Dk)
    o = rms_norm(o, w("o_norm.weight"), eps).float() * gate
    return linear(o.reshape(Bn, T, P).to(x.dtype), w("o_proj.weight"))
