"""Kimi K3's own blocks: the LatentMoE (sigmoid router with selection bias, routed experts in a
down-projected space with MXFP4 weights, RMSNorm of their weighted sum, up-projection, shared
experts) and the AttnRes residual mix. Shared blocks (norms, GLUs, KDA, dispatch) are in
`reap.models.shared.blocks`; the family itself (config, layout, model) in `kimi_k3.family`.

Dimension letters as in `shared.blocks`: N tokens, D hidden, Dl latent width, E n_experts,
K top_k, M one expert's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from reap.models.base import ExpertSource, Observer
from reap.models.shared.blocks import (
    WeightFn,
    glu_mlp,
    linear,
    report_moe,
    rms_norm,
    routed_experts,
    wanted,
)
from reap.quant.matrix import Matrix
from reap.quant.mxfp4 import MXFP4Matrix


# -- LatentMoE ---------------------------------------------------------------------------------
def route(
    logits: Tensor, bias: Tensor | None, top_k: int, scaling: float, renormalize: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Sigmoid router with selection bias. logits [N, E] -> (ids [N, K] int64, weights [N, K]
    fp32: raw sigmoid scores of the chosen, renormalized, times `scaling`, probs [N, E] fp32)."""
    probs = torch.sigmoid(logits.float())
    sel = probs + bias.float() if bias is not None else probs
    ids = sel.topk(top_k, dim=-1).indices  # [N, K]
    weights = probs.gather(-1, ids)
    if renormalize and top_k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling, probs


def expert_matrices(tensors: Mapping[str, Matrix]) -> dict[str, Matrix]:
    """The `expert_matrices` family hook: one routed expert's tensors by short name -> its
    weights {w1,w2,w3}.weight, each stored MXFP4 pair (`wN.weight_packed` blocks, `wN.weight_scale`
    E8M0 scales) as an MXFP4Matrix; weights already typed or dense pass through."""

    def weight(n: str) -> Matrix:
        if f"{n}.weight_packed" in tensors:
            return MXFP4Matrix(tensors[f"{n}.weight_packed"], tensors[f"{n}.weight_scale"])
        return tensors[f"{n}.weight"]

    return {f"{n}.weight": weight(n) for n in ("w1", "w2", "w3")}


def expert_glu(
    x: Tensor, t: Mapping[str, Matrix], beta: float, linear_beta: float | None
) -> Tensor:
    """One routed expert on its tokens: x [M, Dl] -> [M, Dl]. `t`: its stored tensors or typed
    weights (see `expert_matrices`); an MXFP4 matrix is applied by `linear` (the reference
    decodes it here, nothing cached; the engine's kernels may never decode it)."""
    w = expert_matrices(t)
    return glu_mlp(x, w["w1.weight"], w["w3.weight"], w["w2.weight"], beta, linear_beta)


@dataclass
class MoEDims:
    """Sigmoid-routed MoE settings (LatentMoE when `latent`)."""

    top_k: int
    scaling: float  # routed_scaling_factor
    renormalize: bool
    latent: bool  # routed experts run in a down-projected space
    latent_norm: bool  # RMSNorm on the weighted sum of routed outputs
    shared: bool  # shared experts (one fused GLU) added for every token
    eps: float
    beta: float  # SiTU
    linear_beta: float | None

    @classmethod
    def from_config(cls, cfg) -> MoEDims:
        """The settings of a Kimi K3 config (`reap.models.kimi_k3.family.Config`)."""
        routing = (cfg.num_experts_per_token, cfg.routed_scaling_factor, cfg.moe_renormalize)
        latent = (cfg.routed_expert_hidden_size is not None, cfg.latent_moe_use_norm)
        act = (cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta)
        return cls(*routing, *latent, cfg.num_shared_experts > 0, cfg.rms_norm_eps, *act)


def latent_moe(
    x: Tensor,
    w: WeightFn,
    d: MoEDims,
    layer: int,
    experts: ExpertSource,
    observer: Observer | None = None,
) -> Tensor:
    """LatentMoE on x [N, D] -> [N, D]: route on x, down-project, routed experts expert-major,
    RMSNorm of their weighted sum, up-project, add the shared experts. Weights (short names):
    gate.weight, gate.e_score_correction_bias, routed_expert_{down,up}_proj.weight,
    routed_expert_norm.weight, shared_experts.{gate,up,down}_proj.weight. Reports a MoERecord;
    its model_norm is ||up(g * o_e)|| / rms(y): the RMSNorm of y = sum_e w_e o_e is y * g / rms(y),
    so expert e adds exactly w_e * up(g * o_e) / rms(y) to the output."""
    logits, bias = linear(x, w("gate.weight")), w("gate.e_score_correction_bias")  # [N, E], [E]
    ids, weights, probs = route(logits, bias, d.top_k, d.scaling, d.renormalize)
    up = w("routed_expert_up_proj.weight") if d.latent else None
    g = w("routed_expert_norm.weight").float() if d.latent_norm else None

    def to_model(o):
        o = o * g if g is not None else o
        return linear(o, up) if up is not None else o

    xl = linear(x, w("routed_expert_down_proj.weight")) if d.latent else x  # [N, Dl]
    wants, gram = wanted(observer)
    run = partial(expert_glu, beta=d.beta, linear_beta=d.linear_beta)  # (x_e, tensors) -> y_e
    y, stats = routed_experts(
        xl, ids, weights, layer, experts, run, to_model if wants else None, gram
    )
    y = y.to(x.dtype)
    rms = torch.ones(y.shape[0], device=y.device)
    if g is not None:
        rms = (y.float().pow(2).mean(-1) + d.eps).sqrt()  # [N]
        y = rms_norm(y, g, d.eps)
    y = linear(y, up) if up is not None else y
    if d.shared:
        mats = (w(f"shared_experts.{n}_proj.weight") for n in ("gate", "up", "down"))
        y = y + glu_mlp(x, *mats, d.beta, d.linear_beta)
    report_moe(observer, layer, ids, weights, probs, stats, rms, d.eps if g is not None else None)
    return y


# -- AttnRes ---------------------------------------------------------------------------------------
def attn_res_mix(
    blocks: list[Tensor], partial: Tensor, proj: Tensor, norm_w: Tensor, eps: float
) -> Tensor:
    """Softmax mix of the block snapshots and the running partial sum ([B, T, D] each), with
    logits <RMSNorm(x), proj> per token (norm weight folded into proj), fp32, fixed order."""
    if not blocks:
        return partial
    w_eff = norm_w.float() * proj.float().reshape(-1)  # [D]

    def logit(x):
        xf = x.float()
        return (xf @ w_eff) * torch.rsqrt(xf.pow(2).mean(-1) + eps)  # [B, T]

    p = torch.softmax(torch.stack([logit(x) for x in [*blocks, partial]]), dim=0)  # [n+1, B, T]
    out = p[-1, ..., None] * partial.float()
    for i, b in enumerate(blocks):
        out = out + p[i, ..., None] * b.float()
    return out.to(partial.dtype)
