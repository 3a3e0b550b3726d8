"""Shared torch blocks for the model families: norms, `linear` (the expert-matmul hook: a
dense tensor or a quantized matrix record, see `reap.quant.matrix`), the SiTU and SiLU GLUs, Kimi
Delta Attention (KDA, gated delta rule: a per-step recurrence and a chunked WY form), the routers
(DeepSeek's grouped top-k, softmax top-k), expert-major dispatch (`routed_experts`, reported
through `report_moe`) and the Llama-style model ends. Softmax attention (GQA, MLA) lives in
`reap.models.attention`; Kimi K3's LatentMoE and AttnRes in `reap.models.kimi_k3_blocks`.

Functions take tensors, not modules: families pull weights by name and pass them in. Dimension
letters: B batch, T new tokens, S all tokens (cache + new), N = B*T, H heads, Dk key/query head
width, Dv value head width, R latent KV width, E n_experts, K top_k, C chunk length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.nn.functional import conv1d, pad, silu, softplus

from reap.models import base
from reap.models.base import ExpertSource, LayerModel, MoERecord, Observer, State, Weights
from reap.quant.matrix import Matrix

Tensor = torch.Tensor
WeightFn = Callable[[str], Tensor]  # short name -> tensor in the compute dtype/device


# -- elementwise and dense ---------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * weight / rms(x) over the last axis, computed in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def linear(x: Tensor, w: Matrix) -> Tensor:
    """x [..., in] @ w[out, in].T -> [..., out] in x's dtype and device: a dense tensor is cast,
    a quantized matrix (`reap.quant.matrix.QuantizedMatrix`) applies itself."""
    return x @ w.to(x.device, x.dtype).T if isinstance(w, Tensor) else w.linear(x)


def situ(x: Tensor, gate: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU GLU activation: beta*tanh(gate/beta)*sigmoid(gate) * (soft-clipped x), in fp32."""
    g, xf = gate.float(), x.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        xf = linear_beta * torch.tanh(xf / linear_beta)
    return (a * xf).to(x.dtype)


def glu_mlp(
    x: Tensor, gate_w: Matrix, up_w: Matrix, down_w: Matrix, beta: float, linear_beta: float | None
) -> Tensor:
    """down(situ(up(x), gate(x))): [..., D] -> [..., D] (weights [F, D], [F, D], [D, F])."""
    return linear(situ(linear(x, up_w), linear(x, gate_w), beta, linear_beta), down_w)


def silu_glu(x: Tensor, gate_w: Matrix, up_w: Matrix, down_w: Matrix) -> Tensor:
    """down(silu(gate(x)) * up(x)): the SwiGLU MLP of Llama-style families, [..., D] -> [..., D]
    (weights [F, D], [F, D], [D, F])."""
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


# -- KDA ---------------------------------------------------------------------------------------
@dataclass
class KDACache:
    """Decode state of one KDA layer: conv tail [B, k-1, 3*H*Dk], recurrent state [B, H, Dv, Dk]
    fp32."""

    conv: Tensor | None = None
    state: Tensor | None = None


def short_conv(x: Tensor, w: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU. x [B, T, C], w [C, 1, k], tail [B, k-1, C] (previous inputs,
    zeros at the start). Returns (silu(conv) [B, T, C], new tail [B, k-1, C])."""
    k = w.shape[-1]
    if tail is None:
        tail = x.new_zeros(x.shape[0], k - 1, x.shape[2])
    xp = torch.cat([tail.to(x.dtype), x], dim=1)  # [B, k-1+T, C]
    y = conv1d(xp.transpose(1, 2), w.to(x.dtype), groups=x.shape[2])  # [B, C, T]
    return silu(y.transpose(1, 2)), xp[:, xp.shape[1] - (k - 1) :]


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
    taken against the chunk midpoint so nothing overflows for |log g| * C / 2 < 80. Only a loop
    over chunks remains (the state passes between them). Shapes/dtypes as `kda_recurrent`."""
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


# -- routers ---------------------------------------------------------------------------------
def softmax_topk(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax router (Mixtral, Qwen3-MoE, OLMoE). logits [N, E] -> (ids [N, K] int64, weights
    [N, K] fp32: softmax probabilities of the chosen, renormalized if asked, probs [N, E] fp32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)  # [N, K]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights, probs


def grouped_route(
    logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int, scaling: float,
    renormalize: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """DeepSeek-V3 routing: logits [N, E] -> (ids [N, K] int64, weights [N, K] fp32, probs [N, E]
    fp32 sigmoid scores). Selection uses probs + bias, only among the `topk_group` groups with the
    largest sum of their two best biased scores; weights are the unbiased scores of the chosen,
    renormalized (when asked, whatever top_k), times `scaling`."""
    probs = torch.sigmoid(logits.float())
    sel = probs + bias.float()
    N, E = sel.shape
    if n_group > 1 and topk_group < n_group:
        grouped = sel.reshape(N, n_group, E // n_group)  # [N, G, E/G]
        score = grouped.topk(min(2, E // n_group), dim=-1).values.sum(-1)  # [N, G]
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, score.topk(topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = sel.topk(top_k, dim=-1).indices  # [N, K]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling, probs


# -- expert-major MoE --------------------------------------------------------------------------
@dataclass
class ExpertOutputs:
    """Per (token, slot) facts gathered during dispatch (only when norms are wanted)."""

    latent_norm: Tensor  # [N, K] ||o_e||
    max_act: Tensor  # [N, K] max |o_e|
    model_norm: Tensor  # [N, K] ||to_model(o_e)||, not yet divided by the norm's rms


def dispatch(
    xl: Tensor,
    ids: Tensor,
    weights: Tensor,
    run: Callable[[int, Tensor], Tensor],
    to_model: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, ExpertOutputs | None]:
    """Expert-major MoE: each used expert, in ascending id order, runs once on all its tokens;
    weighted outputs accumulate in that order (fp32). xl [N, Dl], ids/weights [N, K],
    run(e, x [M, Dl]) -> [M, Dl]. With `to_model`, also measures each output. Returns y [N, Dl]."""
    N, K = ids.shape
    y = torch.zeros(N, xl.shape[1], dtype=torch.float32, device=xl.device)
    stats = None
    if to_model is not None:
        stats = ExpertOutputs(*(torch.zeros(N, K, device=xl.device) for _ in range(3)))
    flat = ids.reshape(-1)  # [N*K]
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    for e, pos in zip(experts.tolist(), order.split(counts.tolist())):
        tok, slot = pos // K, pos % K  # a token routes to an expert at most once
        out = run(e, xl[tok]).float()  # [M, Dl]
        y.index_add_(0, tok, out * weights[tok, slot, None].float())
        if stats is not None:
            stats.latent_norm[tok, slot] = out.norm(dim=-1)
            stats.max_act[tok, slot] = out.abs().amax(dim=-1)
            stats.model_norm[tok, slot] = to_model(out).float().norm(dim=-1)
    return y, stats


def routed_experts(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    layer: int,
    experts: ExpertSource,
    run: Callable[[Tensor, Mapping[str, Tensor]], Tensor],
    to_model: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, ExpertOutputs | None]:
    """The routed part of any MoE layer: x [N, Dx], ids/weights [N, K] -> (y [N, Dx] fp32,
    per-slot output facts when `to_model` is given). Lets a streaming source prefetch every
    expert it will be asked for, then runs run(x_e [M, Dx], expert tensors) expert-major."""
    prefetch = getattr(experts, "prefetch", None)
    if prefetch is not None:  # a streaming source may start every read now, in the background
        prefetch(layer, torch.unique(ids).tolist())
    return dispatch(x, ids, weights, lambda e, xs: run(xs, experts(layer, e)), to_model)


def model_width_experts(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    probs: Tensor,
    layer: int,
    experts: ExpertSource,
    run: Callable[[Tensor, Mapping[str, Tensor]], Tensor],
    observer: Observer | None = None,
) -> Tensor:
    """`routed_experts` then `report_moe` for experts that work in the model width (no latent
    projection or norm after them, so an expert's model_norm is its own output's norm):
    x [N, D] -> y [N, D] fp32, the weighted sum of the routed experts' outputs."""
    wants = observer is not None and observer.wants_norms
    to_model = (lambda o: o) if wants else None
    y, stats = routed_experts(x, ids, weights, layer, experts, run, to_model)
    report_moe(observer, layer, ids, weights, probs, stats)
    return y


def report_moe(
    observer: Observer | None,
    layer: int,
    ids: Tensor,
    weights: Tensor,
    probs: Tensor,
    stats: ExpertOutputs | None,
    rms: Tensor | None = None,
) -> None:
    """Send one layer's routing (and output norms, divided by a per-token `rms` [N] when the
    routed sum is normalized before it reaches the model) to the observer, if any."""
    if observer is None:
        return
    rec = MoERecord(layer, ids, weights, probs)
    if stats is not None:
        rec.latent_norm, rec.max_act = stats.latent_norm, stats.max_act
        rec.model_norm = stats.model_norm if rms is None else stats.model_norm / rms[:, None]
    observer.on_moe(rec)


# -- Llama-style models ------------------------------------------------------------------------
class PreNormModel(LayerModel):
    """A LayerModel with the Llama-style pieces: embedding `model.embed_tokens.weight`; layers of
    `input_layernorm`, the family's `_attention`, residual, `post_attention_layernorm`, then a
    dense SwiGLU `mlp.` or the family's `_moe` (x [N, D], the default ExpertSource reading the
    family's `expert_tensor_names`, set as a static method); final RMSNorm `model.norm.weight`
    and head `lm_head.weight` (or the tied table). Needs `cfg` with `num_hidden_layers`,
    `rms_norm_eps`, `tie_word_embeddings` and `is_moe(layer)` (or an `is_moe` override); `_w`
    casts every weight to the compute dtype (override it to keep some in fp32 or to
    dequantize)."""

    expert_tensor_names: Callable[..., list[str]]
    cache_type: type  # the per-layer decode cache (`new_caches`)

    def __init__(self, cfg, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.n_layers = cfg.num_hidden_layers

    def new_caches(self) -> list:
        """Empty per-layer decode caches."""
        return [self.cache_type() for _ in range(self.n_layers)]

    def _w(self, get: Weights, prefix: str) -> WeightFn:
        def w(name: str) -> Tensor:
            return get(prefix + name).to(self.device, self.dtype)

        return w

    def embed(self, get: Weights, ids: Tensor) -> State:
        """ids [B, T] int -> State with hidden [B, T, D] (only the used rows are cast)."""
        table = get("model.embed_tokens.weight")
        return State(table[ids.to(table.device)].to(self.device, self.dtype))

    def attn_block(self, i: int, get: Weights, state: State, cache=None) -> tuple[State, Tensor]:
        """Pre-norm attention of layer i plus the residual; returns (state, MLP input [B, T, D])."""
        w, eps = self._w(get, f"model.layers.{i}."), self.cfg.rms_norm_eps
        x = rms_norm(state.hidden, w("input_layernorm.weight"), eps)
        h = state.hidden + self._attention(i, get, x, cache)
        return State(h), rms_norm(h, w("post_attention_layernorm.weight"), eps)

    def mlp_block(
        self,
        i: int,
        get: Weights,
        x: Tensor,
        experts: ExpertSource | None = None,
        observer: Observer | None = None,
    ) -> Tensor:
        """The dense MLP or the MoE of layer i: x [B, T, D] -> [B, T, D]."""
        if not self.is_moe(i):
            return self._dense_mlp(i, get, x)
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        y = self._moe(i, get, flat, experts or self.default_experts(get), observer)
        return y.to(x.dtype).reshape(x.shape)

    def is_moe(self, i: int) -> bool:
        """Whether layer i routes to experts (as the config says)."""
        return self.cfg.is_moe(i)

    def _dense_mlp(self, i: int, get: Weights, x: Tensor) -> Tensor:
        w = self._w(get, f"model.layers.{i}.mlp.")
        return silu_glu(x, *(w(f"{n}_proj.weight") for n in ("gate", "up", "down")))

    def default_experts(self, get: Weights) -> ExpertSource:
        """The ExpertSource used when none is given: one expert's tensors as stored
        (`expert_tensor_names`) pulled through `get`, keyed by short name."""

        def source(layer: int, expert: int) -> dict[str, Tensor]:
            full = self.expert_tensor_names(self.cfg, layer, expert)
            return dict(zip(base.expert_short_names(full), map(get, full)))

        return source

    def head(self, get: Weights, state: State) -> Tensor:
        """Final norm and output head: -> logits [B, T, V]."""
        w = self._w(get, "")
        h = rms_norm(state.hidden, w("model.norm.weight"), self.cfg.rms_norm_eps)
        tied = self.cfg.tie_word_embeddings
        return linear(h, w("model.embed_tokens.weight" if tied else "lm_head.weight"))
