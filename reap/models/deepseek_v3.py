"""DeepSeek-V3 / Kimi K2 (`model_type` deepseek_v3 or kimi_k2): config, checkpoint layout and the
torch model driven layer by layer through the protocol of `reap.models.base`.

Architecture (references: transformers `DeepseekV3ForCausalLM`, mlx-lm `deepseek_v3`): MLA with
RoPE on the rope part of queries and the shared key (`rope_interleave` pairs dims 2i, 2i+1; YaRN's
mscale enlarges the softmax scale), the first `first_k_dense_replace` layers dense, then MoE
layers (every `moe_layer_freq`): a sigmoid router whose `e_score_correction_bias` steers only the
selection, limited to the `topk_group` best of `n_group` expert groups, SiLU GLU experts stored
per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as transformers saves them) and
`n_shared_experts` shared experts fused into one GLU. Plain residual stream.
Shapes: B batch, T tokens, N = B*T, D hidden, V vocab, E n_experts, G n_group, K top_k."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, fields

import torch

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import blocks as B
from reap.models.attention import Rope, rope_settings
from reap.models.base import ExpertSource, LayerModel, Observer, State, Weights

Tensor = torch.Tensor

# an expert's tensors in the order transformers writes them (by name)
EXPERT_TENSORS = ("down_proj.weight", "gate_proj.weight", "up_proj.weight")
_EXPERT_RE = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_DTYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
_KEEP_F32 = {"gate.weight", "gate.e_score_correction_bias"}  # the router runs in fp32
GLU = ("gate", "up", "down")  # the SwiGLU projections, as called


@dataclass
class Config:
    """A DeepSeek-V3 / Kimi K2 config; field names are the `config.json` names (defaults:
    transformers' DeepSeek-V3)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int | None = 1
    n_routed_experts: int | None = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = None
    router_f32: bool = False  # router weight stored in fp32 (transformers >= 5 writes it so)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict (or one with a `text_config`); unknown keys ignored."""
        text = d.get("text_config", d)
        names = {f.name for f in fields(cls)} - {"router_f32"}
        cfg = cls(**{k: v for k, v in text.items() if k in names})
        # transformers >= 5 writes `dtype` (not `torch_dtype`) and keeps the router in fp32
        cfg.router_f32 = "dtype" in text and "torch_dtype" not in text
        cfg.torch_dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.torch_dtype)
        cfg.n_group, cfg.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        cfg._check()
        return cfg

    def _check(self) -> None:
        bad = []
        if self.hidden_act != "silu":
            bad.append(f"hidden_act={self.hidden_act!r}")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            bad.append(f"routing {self.scoring_func}/{self.topk_method} (only sigmoid/noaux_tc)")
        if self.attention_bias:
            bad.append("attention_bias=true")
        if self.quantization_config:
            method = self.quantization_config.get("quant_method")
            bad.append(f"quantized weights ({method}); dequantize to bf16 first")
        E = self.n_routed_experts or 0
        if E and (E % self.n_group or self.topk_group > self.n_group):
            bad.append(f"{E} experts in n_group={self.n_group}, topk_group={self.topk_group}")
        if bad:
            raise ReapError(f"deepseek_v3 config: unsupported {', '.join(bad)}")

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (zero-based) is an MoE layer (else the dense MLP)."""
        first, freq = self.first_k_dense_replace, self.moe_layer_freq
        return bool(self.n_routed_experts) and layer >= first and layer % freq == 0

    def experts_in(self, layer: int) -> int:
        """Routed experts of MoE layer `layer` (the same in every layer)."""
        return int(self.n_routed_experts or 0)

    @property
    def num_experts_per_token(self) -> int:
        """top_k under the name the engine and size model read."""
        return self.num_experts_per_tok

    @property
    def rope(self) -> tuple[float, dict | None]:
        """(theta, scaling) from `rope_parameters` or `rope_theta` + `rope_scaling`."""
        return rope_settings(self)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk head width), times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        _, s = self.rope
        m_all = (s or {}).get("mscale_all_dim")
        if m_all and float(s["factor"]) > 1:
            scale *= (0.1 * m_all * math.log(float(s["factor"])) + 1.0) ** 2
        return scale


# -- layout ------------------------------------------------------------------------------------
def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of a transformers-format checkpoint (names without a prefix), in order."""
    cfg = Config.from_dict(config_dict)
    fdt = _DTYPES.get(cfg.torch_dtype, "BF16")
    D, V = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", fdt, (V, D), "embed_head")]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i, fdt)
    specs.append(TensorSpec("model.norm.weight", fdt, (D,), "norms"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", fdt, (V, D), "embed_head"))
    return specs


def _layer_specs(cfg: Config, i: int, fdt: str) -> list[TensorSpec]:
    D, p = cfg.hidden_size, f"model.layers.{i}."

    def t(name, shape, comp, dtype=fdt):
        return TensorSpec(p + name, dtype, tuple(shape), comp, i)

    out = [t("input_layernorm.weight", (D,), "norms")]
    out += _mla_specs(cfg, t)
    out.append(t("post_attention_layernorm.weight", (D,), "norms"))
    if not cfg.is_moe(i):
        return out + _mlp_specs(t, "mlp.", D, cfg.intermediate_size, "dense_mlp")
    E = cfg.experts_in(i)
    out += [
        t("mlp.gate.weight", (E, D), "router", "F32" if cfg.router_f32 else fdt),
        t("mlp.gate.e_score_correction_bias", (E,), "router", "F32"),
    ]
    if cfg.n_shared_experts:
        F = cfg.moe_intermediate_size * cfg.n_shared_experts
        out += _mlp_specs(t, "mlp.shared_experts.", D, F, "shared_experts")
    for e in range(E):
        out += expert_specs(cfg, i, e, fdt)
    return out


def _mlp_specs(t, p: str, D: int, F: int, comp: str) -> list[TensorSpec]:
    return [
        t(p + "gate_proj.weight", (F, D), comp),
        t(p + "up_proj.weight", (F, D), comp),
        t(p + "down_proj.weight", (D, F), comp),
    ]


def _mla_specs(cfg: Config, t) -> list[TensorSpec]:
    D, H, a = cfg.hidden_size, cfg.num_attention_heads, "self_attn."
    q_dim, kv = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        r = cfg.q_lora_rank
        out = [
            t(a + "q_a_proj.weight", (r, D), "mla"),
            t(a + "q_a_layernorm.weight", (r,), "mla"),
            t(a + "q_b_proj.weight", (H * q_dim, r), "mla"),
        ]
    else:
        out = [t(a + "q_proj.weight", (H * q_dim, D), "mla")]
    return out + [
        t(a + "kv_a_proj_with_mqa.weight", (kv + cfg.qk_rope_head_dim, D), "mla"),
        t(a + "kv_a_layernorm.weight", (kv,), "mla"),
        t(a + "kv_b_proj.weight", (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), kv), "mla"),
        t(a + "o_proj.weight", (D, H * cfg.v_head_dim), "mla"),
    ]


def expert_specs(cfg: Config, layer: int, expert: int, fdt: str) -> list[TensorSpec]:
    """The three tensors of one routed expert ([out, in] each), in `EXPERT_TENSORS` order."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {"down_proj.weight": (D, F), "gate_proj.weight": (F, D), "up_proj.weight": (F, D)}
    names = expert_tensor_names(layer, expert)
    return [
        TensorSpec(n, fdt, shapes[s], "routed_experts", layer, expert)
        for n, s in zip(names, EXPERT_TENSORS)
    ]


def expert_key(name: str) -> tuple[int, int] | None:
    """(layer, expert) of a routed-expert tensor name (prefix optional), else None."""
    m = _EXPERT_RE.search(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def expert_tensor_names(layer: int, expert: int) -> list[str]:
    """The tensor names of routed expert `expert` of `layer`, in `EXPERT_TENSORS` order."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return [p + s for s in EXPERT_TENSORS]


def router_tensors(cfg: Config | dict, layer: int) -> dict[str, int]:
    """Tensors of `layer` indexed by expert id -> the axis to slice when pruning experts."""
    p = f"model.layers.{layer}.mlp.gate."
    return {p + "weight": 0, p + "e_score_correction_bias": 0}


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts per MoE layer (top_k capped at it).

    The config has one count for all layers, so {layer: n} must be uniform; the count must split
    into the `n_group` groups (kept experts are regrouped in ascending original id) with the
    `topk_group` best groups still holding top_k experts. Anything else is a ReapError."""
    counts = set(n_experts.values()) if isinstance(n_experts, dict) else {n_experts}
    if len(counts) != 1:  # transformers reads no per-layer counts
        raise ReapError(f"deepseek_v3 needs a uniform expert count, not {sorted(counts)}")
    out = copy.deepcopy(config_dict)
    text = out.get("text_config", out)
    n, G = int(counts.pop()), int(text.get("n_group") or 1)
    if n < 1 or n % G:
        raise ReapError(f"deepseek_v3: keep a multiple of n_group={G} experts, not {n}")
    text["n_routed_experts"] = n
    k = text["num_experts_per_tok"] = min(int(text["num_experts_per_tok"]), n)
    if int(text.get("topk_group") or 1) * (n // G) < k:
        raise ReapError(f"deepseek_v3: {n} experts leave fewer than top_k={k} in the best groups")
    return out


def state_bytes(cfg: Config, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position: latent + rotated key per layer, recurrent bytes per sequence: 0,
    activation bytes per token, attention-score bytes per (query, key) pair)."""
    H = cfg.num_attention_heads
    per_pos = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act_bytes
    widest = max(
        cfg.intermediate_size,
        cfg.moe_intermediate_size * max(cfg.n_shared_experts or 0, 2 * cfg.num_experts_per_tok),
        H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + 2 * cfg.v_head_dim),
    )
    act = 4 * (cfg.hidden_size * 9 + 4 * widest + (cfg.n_routed_experts or 0))
    return per_pos, 0, act, 4 * 3 * H


# -- routing -----------------------------------------------------------------------------------
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


# -- the model ---------------------------------------------------------------------------------
def default_experts(get: Weights) -> ExpertSource:
    """An ExpertSource pulling each expert's tensors through the weight getter."""

    def source(layer: int, expert: int) -> dict[str, Tensor]:
        return {s: get(n) for s, n in zip(EXPERT_TENSORS, expert_tensor_names(layer, expert))}

    return source


class Model(LayerModel):
    """DeepSeek-V3 / Kimi K2 text model; holds no weights (see `reap.models.base`).

    Compute runs in `dtype` on `device`; norms, the router and the softmax are fp32."""

    def __init__(
        self, cfg: Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        self.cfg, self.device, self.dtype = cfg, torch.device(device), dtype
        self.n_layers = cfg.num_hidden_layers
        self.mla = B.MLADims.from_config(cfg)
        self.rope = Rope.create(cfg.qk_rope_head_dim, *cfg.rope)
        self.scale = cfg.softmax_scale
        self.routing = (
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.routed_scaling_factor,
            cfg.norm_topk_prob,
        )

    def _rotate(self, x: Tensor, start: int) -> Tensor:
        return self.rope.apply(x, start, interleaved=self.cfg.rope_interleave)

    def _w(self, get: Weights, prefix: str) -> B.WeightFn:
        def w(name: str) -> Tensor:
            dtype = torch.float32 if name in _KEEP_F32 else self.dtype
            return get(prefix + name).to(self.device, dtype)

        return w

    def new_caches(self) -> list[B.MLACache]:
        """Empty per-layer latent KV caches."""
        return [B.MLACache() for _ in range(self.n_layers)]

    def embed(self, get: Weights, ids: Tensor) -> State:
        """ids [B, T] int -> State with hidden [B, T, D]."""
        table = self._w(get, "model.")("embed_tokens.weight")
        return State(table[ids.to(self.device)].to(self.dtype))

    def attn_block(self, i: int, get: Weights, state: State, cache=None) -> tuple[State, Tensor]:
        """Pre-norm MLA of layer i plus the residual; returns (state, MLP input [B, T, D])."""
        w, eps = self._w(get, f"model.layers.{i}."), self.cfg.rms_norm_eps
        x = B.rms_norm(state.hidden, w("input_layernorm.weight"), eps)
        sub = self._w(get, f"model.layers.{i}.self_attn.")
        h = state.hidden + B.mla_attention(
            x, sub, self.mla, cache, rope=self._rotate, scale=self.scale
        )
        return State(h), B.rms_norm(h, w("post_attention_layernorm.weight"), eps)

    def mlp_block(
        self,
        i: int,
        get: Weights,
        x: Tensor,
        experts: ExpertSource | None = None,
        observer: Observer | None = None,
    ) -> Tensor:
        """Dense SwiGLU MLP or the MoE of layer i: x [B, T, D] -> [B, T, D]."""
        w = self._w(get, f"model.layers.{i}.mlp.")
        if not self.cfg.is_moe(i):
            return B.silu_glu(x, *(w(f"{n}_proj.weight") for n in GLU))
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        y = self._moe(flat, w, i, experts or default_experts(get), observer)
        return y.reshape(x.shape)

    def _moe(self, x: Tensor, w: B.WeightFn, i: int, experts: ExpertSource, observer) -> Tensor:
        """Route, run the chosen experts expert-major, add the shared experts: [N, D] -> [N, D].
        Experts work in the model space, so an expert's model_norm is its output's norm."""
        logits = B.linear(x.float(), w("gate.weight"))  # [N, E]
        ids, weights, probs = grouped_route(
            logits, w("gate.e_score_correction_bias"), *self.routing
        )
        wants = observer is not None and observer.wants_norms
        y, stats = B.routed_experts(
            x, ids, weights, i, experts, self._expert, (lambda o: o) if wants else None
        )
        y = y.to(x.dtype)
        if self.cfg.n_shared_experts:
            s = "shared_experts."
            y = y + B.silu_glu(x, *(w(f"{s}{n}_proj.weight") for n in GLU))
        B.report_moe(observer, i, ids, weights, probs, stats)
        return y

    def _expert(self, x: Tensor, t) -> Tensor:
        """One routed expert on its tokens: x [M, D] -> [M, D]."""
        return B.silu_glu(x, *(t[f"{n}_proj.weight"].to(x.device, x.dtype) for n in GLU))

    def head(self, get: Weights, state: State) -> Tensor:
        """Final norm and output head: -> logits [B, T, V]."""
        cfg, w = self.cfg, self._w(get, "model.")
        h = B.rms_norm(state.hidden, w("norm.weight"), cfg.rms_norm_eps)
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return B.linear(h, self._w(get, "")(name))
