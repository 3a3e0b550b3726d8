"""Shared torch blocks for the model families: norms, `linear` (the expert-matmul hook, see
`reap.quant.matrix`), the SiTU and SiLU GLUs, the routers, expert-major dispatch and the
Llama-style model ends. Attention lives in `attention` and `kda`, Kimi K3's own blocks in
`reap.models.kimi_k3.blocks`.

Functions take tensors, not modules: families pull weights by name and pass them in. Dimension
letters: B batch, T new tokens, S all tokens (cache + new), N = B*T, H heads, Dk key/query head
width, Dv value head width, R latent KV width, E n_experts, K top_k, C chunk length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import silu

from reap.models import base
from reap.models.base import ExpertSource, LayerModel, MoERecord, Observer, State, Weights
from reap.quant import ckernel, dense_kernel
from reap.quant.matrix import Matrix

Tensor = torch.Tensor
WeightFn = Callable[[str], Tensor]  # short name -> tensor in the compute dtype/device
ToModel = Callable[[Tensor], Tensor]  # an expert's output [M, Dl] -> model space [M, D]
RunExpert = Callable[[Tensor, Mapping[str, Tensor]], Tensor]  # (x_e [M, Dx], tensors) -> [M, Dx]
FAST_SWIGLU = True  # False: every SwiGLU op by op (`silu_glu_reference`), for the tests


# -- elementwise and dense ---------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * weight / rms(x) over the last axis, computed in fp32, returned in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def linear(x: Tensor, w: Matrix) -> Tensor:
    """x [..., in] @ w[out, in].T -> [..., out] in x's dtype and device: a dense tensor is cast,
    a quantized matrix applies itself; a few rows of bf16 or fp32 (decode) go to a compiled GEMV
    (`reap.quant.dense_kernel`: torch's runs below the memory bandwidth)."""
    if not isinstance(w, Tensor):
        return w.linear(x)
    if dense_kernel.usable(x, w):
        return dense_kernel.dense_linear(x, w)
    return linear_reference(x, w)


def linear_reference(x: Tensor, w: Tensor) -> Tensor:
    """`linear` of a dense tensor by torch alone: x [..., in] @ w.T -> [..., out]."""
    return x @ w.to(x.device, x.dtype).T


def situ(x: Tensor, gate: Tensor, beta: float, linear_beta: float | None) -> Tensor:
    """SiTU GLU activation: beta*tanh(gate/beta)*sigmoid(gate) * (soft-clipped x), in fp32."""
    g, xf = gate.float(), x.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        xf = linear_beta * torch.tanh(xf / linear_beta)
    return (a * xf).to(x.dtype)


def glu_mlp(x: Tensor, gate_w: Matrix, up_w: Matrix, down_w: Matrix, beta: float,
            linear_beta: float | None) -> Tensor:
    """down(situ(up(x), gate(x))): [..., D] -> [..., D] (weights [F, D], [F, D], [D, F])."""
    return linear(situ(linear(x, up_w), linear(x, gate_w), beta, linear_beta), down_w)


def silu_glu(x: Tensor, gate_w: Matrix, up_w: Matrix, down_w: Matrix) -> Tensor:
    """down(silu(gate(x)) * up(x)): the SwiGLU MLP of Llama-style families, [..., D] -> [..., D]
    (weights [F, D], [F, D], [D, F]). A few tokens with dense bf16/fp32 weights of their dtype
    (decode's experts) run as two compiled calls (`dense_kernel.swiglu`);
    `silu_glu_reference` is the op-by-op path."""
    dense = isinstance(gate_w, Tensor) and isinstance(up_w, Tensor)
    if FAST_SWIGLU and dense and dense_kernel.swiglu_usable(x, gate_w, up_w, down_w):
        return dense_kernel.swiglu(x, gate_w, up_w, down_w)
    return silu_glu_reference(x, gate_w, up_w, down_w)


def silu_glu_reference(x: Tensor, gate_w: Matrix, up_w: Matrix, down_w: Matrix) -> Tensor:
    """`silu_glu` op by op: three `linear`s, torch's silu and product."""
    return linear(silu(linear(x, gate_w)) * linear(x, up_w), down_w)


# -- routers ---------------------------------------------------------------------------------
def softmax_topk(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Softmax router (Mixtral, Qwen3-MoE, OLMoE). logits [N, E] -> (ids [N, K] int64, weights
    [N, K] fp32: softmax probabilities of the chosen, renormalized if asked, probs [N, E] fp32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)  # [N, K]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights, probs


def grouped_route(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                  scaling: float, renormalize: bool) -> tuple[Tensor, Tensor, Tensor]:
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
    gram: Tensor | None = None  # [N, K, K] <to_model(o_i), to_model(o_j)>, when asked
    latent_gram: Tensor | None = None  # [N, K, K] <o_i, o_j> / Dl (o_e's mean products), with it


Outputs = ExpertOutputs | None


def dispatch(xl: Tensor, ids: Tensor, weights: Tensor, run: Callable[[int, Tensor], Tensor],
             to_model: ToModel | None = None, gram: bool = False) -> tuple[Tensor, Outputs]:
    """Expert-major MoE: each used expert, in ascending id order, runs once on all its tokens;
    weighted outputs accumulate in that order (fp32). xl [N, Dl], ids/weights [N, K],
    run(e, x [M, Dl]) -> [M, Dl]. With `to_model`, also measures each output, and with `gram`
    the per-token Gram of the measured outputs (`output_gram`; holds every output, N*K*Dl fp32,
    until the end). Returns y [N, Dl]. One token without measurements (decode) takes a short
    path: the same arithmetic in the same order without the sort, unique and scatter
    (`dispatch_reference` always sorts)."""
    if ids.shape[0] == 1 and to_model is None and FAST_ONE_TOKEN:
        order = sorted(zip(ids[0].tolist(), range(ids.shape[1])))  # (expert, slot) ascending
        return _accumulate(xl, weights, order, [run(e, xl) for e, _ in order]), None
    return dispatch_reference(xl, ids, weights, run, to_model, gram)


FAST_ONE_TOKEN = True  # False: every dispatch sorts (`dispatch_reference`), for the tests


def _accumulate(xl: Tensor, weights: Tensor, order, outs) -> Tensor:
    """One token: y += w_k * out_k in fp32 over (expert, slot) `order` (ascending experts)."""
    y = torch.zeros(1, xl.shape[1], dtype=torch.float32, device=xl.device)  # [1, Dl]
    w = weights[0].float()  # [K]
    for (_, k), out in zip(order, outs):
        y.add_(out.float() * w[k])
    return y


def _one_token(x: Tensor, ids: Tensor, weights: Tensor, layer: int, experts, run) -> Tensor:
    """`dispatch` of one token through an ExpertSource: the experts are fetched in ascending
    order on this thread (the source's bookkeeping is not thread-safe); on one thread each is
    run as soon as it is fetched (a streaming source's later reads go on meanwhile); with dense
    weights and several torch threads, their outputs computed on the kernels' pool (the
    compiled GEMVs release the GIL) and summed here in ascending order: the same numbers as
    one thread."""
    order = sorted(zip(ids[0].tolist(), range(ids.shape[1])))  # (expert, slot) ascending
    n = min(torch.get_num_threads(), len(order))
    if n < 2 or x.device.type != "cpu":  # each run once fetched: overlaps the later reads
        return _accumulate(x, weights, order, [run(x, experts(layer, e)) for e, _ in order])
    tensors = [experts(layer, e) for e, _ in order]
    if not all(isinstance(t, Tensor) for ts in tensors for t in ts.values()):
        return _accumulate(x, weights, order, [run(x, t) for t in tensors])
    outs, grad = [None] * len(tensors), torch.is_grad_enabled()

    def work(a: int, b: int) -> None:
        with torch.inference_mode(not grad):  # thread-local: the caller's mode, here too
            outs[a:b] = [run(x, t) for t in tensors[a:b]]

    ckernel.parallel(work, len(tensors), len(tensors) // n)  # about n ranges, on the pool
    return _accumulate(x, weights, order, outs)


def dispatch_reference(xl: Tensor, ids: Tensor, weights: Tensor,
                       run: Callable[[int, Tensor], Tensor], to_model: ToModel | None = None,
                       gram: bool = False) -> tuple[Tensor, Outputs]:
    """`dispatch` for any number of tokens: sort the (token, slot) pairs by expert, run each
    expert once on its tokens, scatter-add the weighted outputs."""
    N, K = ids.shape
    y = torch.zeros(N, xl.shape[1], dtype=torch.float32, device=xl.device)
    stats, outs = None, None
    if to_model is not None:
        stats = ExpertOutputs(*(torch.zeros(N, K, device=xl.device) for _ in range(3)))
        if gram:
            outs = torch.zeros(N, K, xl.shape[1], device=xl.device)  # [N, K, Dl]
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
            if outs is not None:
                outs[tok, slot] = out
    if outs is not None:
        stats.gram = output_gram(outs, to_model)
        stats.latent_gram = outs @ outs.transpose(1, 2) / outs.shape[2]  # [N, K, K]
    return y, stats


GRAM_CHUNK = 1024  # tokens per to_model call of `output_gram` (bounds its [n, K, D] temporary)


def output_gram(outs: Tensor, to_model: ToModel) -> Tensor:
    """Per-token Gram of expert outputs mapped to the model space: outs [N, K, Dl] ->
    G [N, K, K] fp32, G[n, i, j] = <to_model(outs[n, i]), to_model(outs[n, j])>; to_model runs
    on GRAM_CHUNK tokens at a time."""
    N, K, Dl = outs.shape
    G = torch.zeros(N, K, K, device=outs.device)
    for i in range(0, N, GRAM_CHUNK):
        part = outs[i : i + GRAM_CHUNK]  # [n, K, Dl]
        m = to_model(part.reshape(-1, Dl)).float().reshape(part.shape[0], K, -1)  # [n, K, D]
        G[i : i + GRAM_CHUNK] = m @ m.transpose(1, 2)  # [n, K, K]
    return G


def routed_experts(x: Tensor, ids: Tensor, weights: Tensor, layer: int, experts: ExpertSource,
                   run: RunExpert, to_model: ToModel | None = None,
                   gram: bool = False) -> tuple[Tensor, Outputs]:
    """The routed part of any MoE layer: x [N, Dx], ids/weights [N, K] -> (y [N, Dx] fp32,
    per-slot output facts when `to_model` is given, their Gram too with `gram`). Lets a
    streaming source prefetch every expert it will be asked for, then runs
    run(x_e [M, Dx], expert tensors) expert-major."""
    prefetch = getattr(experts, "prefetch", None)
    if prefetch is not None:  # a streaming source may start every read now, in the background
        prefetch(layer, sorted(set(ids.reshape(-1).tolist())))
    probe = getattr(experts, "probe", None)  # calibration's merge statistics (OutputProbe)
    if probe is not None:
        experts, run = probe(layer, x, experts, run)
    if x.shape[0] == 1 and to_model is None and FAST_ONE_TOKEN:
        return _one_token(x, ids, weights, layer, experts, run), None
    return dispatch(x, ids, weights, lambda e, xs: run(xs, experts(layer, e)), to_model, gram)


def model_width_experts(x: Tensor, ids: Tensor, weights: Tensor, probs: Tensor, layer: int,
                        experts: ExpertSource, run: RunExpert,
                        observer: Observer | None = None) -> Tensor:
    """`routed_experts` then `report_moe` for experts that work in the model width (no latent
    projection or norm after them, so an expert's model_norm is its own output's norm):
    x [N, D] -> y [N, D] fp32, the weighted sum of the routed experts' outputs."""
    wants, gram = wanted(observer)
    to_model = (lambda o: o) if wants else None
    y, stats = routed_experts(x, ids, weights, layer, experts, run, to_model, gram)
    report_moe(observer, layer, ids, weights, probs, stats)
    return y


def wanted(observer: Observer | None) -> tuple[bool, bool]:
    """(output norms, their per-token Gram) as the observer asks (`wants_norms`, `wants_gram`:
    the Gram only with the norms)."""
    norms = observer is not None and observer.wants_norms
    return norms, norms and bool(getattr(observer, "wants_gram", False))


def report_moe(observer: Observer | None, layer: int, ids: Tensor, weights: Tensor, probs: Tensor,
               stats: Outputs, rms: Tensor | None = None, norm_eps: float | None = None) -> None:
    """Send one layer's routing (and output norms and Gram, divided by a per-token `rms` [N]
    (the Gram by rms^2) when the routed sum is scaled by it before it reaches the model) to the
    observer, if any. `norm_eps`: the routed sum y is RMS-normalized, rms = sqrt(mean(y^2) +
    norm_eps): the record then also carries what a changed sum's rms needs (`norm_gram`,
    `norm_eps`, see `MoERecord`)."""
    if observer is None:
        return
    rec = MoERecord(layer, ids, weights, probs)
    if stats is not None:
        rec.latent_norm, rec.max_act = stats.latent_norm, stats.max_act
        rec.model_norm = stats.model_norm if rms is None else stats.model_norm / rms[:, None]
        if stats.gram is not None:
            one = torch.ones_like(ids[:, 0], dtype=torch.float32)
            ms = (one if rms is None else rms.float()).pow(2)  # [N]
            rec.gram = stats.gram / ms[:, None, None]
            if norm_eps is not None:
                rec.norm_gram = stats.latent_gram / ms[:, None, None]
                rec.norm_eps = norm_eps / ms
    observer.on_moe(rec)


# -- Llama-style models ------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeLayer:
    """What a compiled decode step (`reap.quant.step_kernel`) needs of one pre-norm layer whose
    arithmetic it reproduces: RMSNorm, grouped-query rotate-half RoPE attention over a KV cache
    (optionally q/k RMSNorm per head or over the whole projection, a sliding window), RMSNorm,
    then a softmax top-k router over SwiGLU experts or one dense SwiGLU MLP. A family's
    `native_layer(i)` returns it, or None where its layer does anything else (biases, clipping,
    sinks, other routers or activations): the torch path then runs that step."""

    prefix: str  # the layer's tensor-name prefix ("model.layers.3.")
    attn: tuple[str, str, str, str]  # q, k, v, o projection names after the prefix
    norms: tuple[str, str]  # input and post-attention RMSNorm weights after the prefix
    qk_norms: tuple[str, str] | None  # q and k RMSNorm weights after the prefix, or None
    qk_per_head: bool  # the q/k norms act per head (else over the whole projection)
    heads: int
    kv_heads: int
    dk: int  # per-head width
    rotary: Any  # reap.models.shared.attention.Rope (rotate-half pairing)
    window: int | None  # sliding-window length, or None
    eps: float  # the RMSNorms' epsilon
    router: str | None  # router weight after the prefix; None: `mlp` is a dense SwiGLU
    mlp: tuple[str, str, str]  # expert short names (gate, up, down), or dense full suffixes
    top_k: int = 0
    renormalize: bool = False  # top-k weights renormalized to sum 1


class PreNormModel(LayerModel):
    """A LayerModel with the Llama-style pieces: embedding, layers of input norm, the family's
    `_attention`, residual, post-attention norm, then a dense SwiGLU `mlp.` or the family's
    `_moe`; final RMSNorm and head (or the tied table). `_w` casts every weight to the compute
    dtype (override it to keep some in fp32 or to dequantize)."""

    expert_tensor_names: Callable[..., list[str]]
    cache_type: type  # the per-layer decode cache (`new_caches`)

    def __init__(self, cfg, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.n_layers = cfg.num_hidden_layers

    def new_caches(self) -> list:
        """Empty per-layer decode caches."""
        return [self.cache_type() for _ in range(self.n_layers)]

    def _w(self, get: Weights, prefix: str) -> WeightFn:
        return lambda name: get(prefix + name).to(self.device, self.dtype)

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

    def mlp_block(self, i: int, get: Weights, x: Tensor, experts: ExpertSource | None = None,
                  observer: Observer | None = None) -> Tensor:
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

    def native_head(self) -> tuple[str, str, float]:
        """(final norm, head weight, epsilon) of `head`, for a compiled decode step."""
        head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        return "model.norm.weight", head, self.cfg.rms_norm_eps

    def head(self, get: Weights, state: State) -> Tensor:
        """Final norm and output head: -> logits [B, T, V]."""
        (norm, head, eps), w = self.native_head(), self._w(get, "")
        return linear(rms_norm(state.hidden, w(norm), eps), w(head))
