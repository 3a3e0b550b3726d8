"""DeepSeek-V3 / Kimi K2 (`model_type` deepseek_v3 or kimi_k2): config, checkpoint layout and the
torch model driven layer by layer through the protocol of `reap.models.base`.

As transformers' `DeepseekV3ForCausalLM` and mlx-lm's `deepseek_v3`: MLA with (YaRN) RoPE on the
rope part, dense first layers, then MoE: sigmoid router, `e_score_correction_bias` for selection
only, limited to the `topk_group` best of `n_group` groups; SiLU GLU experts stored per expert, and
shared experts. Quantized releases (FP8, compressed-tensors INT4) are read in place
(`reap.models.deepseek_v3.quant`). Shapes: B batch, T tokens, N = B*T, D hidden, V vocab,
E n_experts, G n_group, K top_k, O/I a weight's output/input width.

Multi-token-prediction (MTP) layers `model.layers.{L + j}` are listed, tagged "mtp", and never
read, as in transformers and mlx-lm. Pruning drops them and writes `num_nextn_predict_layers: 0`:
an MTP layer with uncalibrated, unpruned experts would disagree with the pruned model, and
speculative decoding is not our use.

Kimi K2 releases also store each layer's `self_attn.rotary_emb.inv_freq` buffer: listed as
component "buffers", never read (RoPE frequencies come from the config, as every loader does),
optional for binding, and kept verbatim by prune, so a pruned K2 loads wherever the release loads.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields, replace

import torch

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import base, validate
from reap.models.base import ExpertSource, Weights, decoder_specs, dtype_code
from reap.models.deepseek_v3.quant import Quant, expert_matrices
from reap.models.shared import attention, blocks
from reap.quant import fp8
from reap.quant.matrix import Matrix

Tensor = torch.Tensor

# an expert's tensors in the order transformers writes them (by name)
EXPERT_TENSORS = ("down_proj.weight", "gate_proj.weight", "up_proj.weight")
_ROLES = {**base.HF_ROLES, "e_score_correction_bias": "router_bias"}  # TensorSpec.role by suffix
_KEEP_F32 = {"gate.weight", "gate.e_score_correction_bias"}  # the router runs in fp32
GLU = ("gate", "up", "down")  # the SwiGLU projections, as called


# Config fields not read from config.json
_DERIVED = ("router_f32", "fp8_block", "mtp_layers", "rope_buffers", "quant_scheme")
_WIDTHS = ("moe_intermediate_size", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim")
_WIDTHS += ("qk_nope_head_dim", "q_lora_rank")


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
    num_nextn_predict_layers: int = 0
    quantization_config: dict | None = None
    router_f32: bool = False  # router weight stored in fp32 (transformers >= 5 writes it so)
    fp8_block: tuple[int, int] | None = None  # (rows, cols) of an FP8 scale block
    mtp_layers: int = 0  # MTP layers stored after the decoder layers (see the module docstring)
    rope_buffers: bool = False  # Kimi K2 releases store rotary_emb.inv_freq (module docstring)
    # how the Linear weights are stored (from `quantization_config`; see `Quant`)
    quant_scheme: Quant = field(default_factory=lambda: Quant())
    REQUIRED = (*validate.HF_REQUIRED, "n_routed_experts", "num_experts_per_tok", *validate.ROPE)
    REQUIRED += (*_WIDTHS, "intermediate_size", "n_shared_experts", "routed_scaling_factor")
    REQUIRED += ("n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "hidden_act")
    REQUIRED += ("rms_norm_eps", "attention_bias", "tie_word_embeddings")
    REQUIRED += ("num_nextn_predict_layers",)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict (or one with a `text_config`); unknown keys ignored."""
        text = validate.text_of(d)
        cls.validate(text)
        names = {f.name for f in fields(cls)} - set(_DERIVED)
        cfg = cls(**{k: v for k, v in text.items() if k in names})
        # transformers >= 5 writes `dtype` (not `torch_dtype`), the router in fp32, no MTP layer
        cfg.router_f32 = "dtype" in text and "torch_dtype" not in text
        cfg.mtp_layers = 0 if cfg.router_f32 else int(cfg.num_nextn_predict_layers or 0)
        cfg.rope_buffers = d.get("model_type") == "kimi_k2" and not cfg.router_f32
        cfg.torch_dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.torch_dtype)
        cfg.n_group, cfg.topk_group = cfg.n_group or 1, cfg.topk_group or 1
        cfg.quant_scheme = Quant.from_config(text)
        cfg.fp8_block = cfg.quant_scheme.fp8_block
        cfg._check()
        return cfg

    @classmethod
    def validate(cls, text: dict) -> None:
        """Types, required keys and ranges of a config (ConfigError, exit 2)."""
        validate.check_fields(cls, {k: v for k, v in text.items() if k not in _DERIVED})
        validate.need_hf(text, "n_routed_experts", "num_experts_per_tok", _WIDTHS)
        for name in ("n_group", "topk_group", "moe_layer_freq"):
            validate.need_int(text, name, 1, validate.MAX_LAYERS)
        for name in ("first_k_dense_replace", "num_nextn_predict_layers"):
            validate.need_int(text, name, 0, validate.MAX_LAYERS)
        Quant.from_config(text)

    def _check(self) -> None:
        bad, q, E = [], self.quantization_config or {}, self.n_routed_experts or 0
        if self.hidden_act != "silu":
            bad.append(f"hidden_act={self.hidden_act!r}")
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            bad.append(f"routing {self.scoring_func}/{self.topk_method} (only sigmoid/noaux_tc)")
        if self.attention_bias:
            bad.append("attention_bias=true")
        if q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") != "e4m3":
            bad.append(f"quantization fp8 {q.get('fmt')} (only block-scaled FP8 e4m3)")
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

    def is_fp8(self, name: str) -> bool:
        """Whether tensor `name` is stored FP8 (with `name + "_scale_inv"` next to it)."""
        return self.quant_scheme.is_fp8(name)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk head width), times mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        _, s = attention.rope_settings(self)  # `rope_parameters`, or `rope_theta` + `rope_scaling`
        m_all = (s or {}).get("mscale_all_dim")
        if m_all and float(s["factor"]) > 1:
            scale *= (0.1 * m_all * math.log(float(s["factor"])) + 1.0) ** 2
        return scale


# -- layout ------------------------------------------------------------------------------------
def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of a transformers-format checkpoint (names without a prefix), in order."""
    cfg = Config.from_dict(config_dict)
    fdt = dtype_code(cfg.torch_dtype)
    specs = decoder_specs(cfg, fdt, lambda i: _layer_specs(cfg, i, fdt))
    for j in range(cfg.mtp_layers):
        specs += _mtp_specs(cfg, cfg.num_hidden_layers + j, fdt)
    return [q for s in base.tag_roles(specs, _ROLES) for q in cfg.quant_scheme.stored(s)]


def _mtp_specs(cfg: Config, n: int, fdt: str) -> list[TensorSpec]:
    """MTP layer `n`: its embedding, norms, [embedding; hidden] projection and head around a
    decoder layer, all tagged "mtp" with no layer or expert (nothing counts it as one)."""
    D, V, p = cfg.hidden_size, cfg.vocab_size, f"model.layers.{n}."
    own = {"embed_tokens": (V, D), "enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D)}
    own |= {"shared_head.norm": (D,), "shared_head.head": (V, D)}
    out = [TensorSpec(f"{p}{k}.weight", fdt, s, "mtp") for k, s in own.items()]
    block = _layer_specs(cfg, n, fdt)  # a full decoder layer, MoE as every later layer
    return out + [replace(s, component="mtp", layer=None, expert=None) for s in block]


def _layer_specs(cfg: Config, i: int, fdt: str) -> list[TensorSpec]:
    D, F, E, p = cfg.hidden_size, cfg.moe_intermediate_size, cfg.experts_in(i), f"model.layers.{i}."

    def t(name, shape, comp, dtype=fdt, expert=None):
        return TensorSpec(p + name, dtype, tuple(shape), comp, i, expert)

    def glu(prefix: str, F: int, comp: str, expert: int | None = None) -> list[TensorSpec]:
        shapes = {"down": (D, F), "gate": (F, D), "up": (F, D)}  # [out, in], file order
        return [t(f"{prefix}{n}_proj.weight", s, comp, fdt, expert) for n, s in shapes.items()]

    norm = [t(f"{n}_layernorm.weight", (D,), "norms") for n in ("input", "post_attention")]
    out = [norm[0], *attention.MLADims.from_config(cfg).specs(t, D), norm[1]]
    if cfg.rope_buffers:  # [(D // H) // 2], as the K2 release stores it (module docstring)
        half = cfg.hidden_size // cfg.num_attention_heads // 2
        out.insert(-1, t("self_attn.rotary_emb.inv_freq", (half,), "buffers"))
    if not cfg.is_moe(i):
        return out + glu("mlp.", cfg.intermediate_size, "dense_mlp")
    out += [
        t("mlp.gate.weight", (E, D), "router", "F32" if cfg.router_f32 else fdt),
        t("mlp.gate.e_score_correction_bias", (E,), "router", "F32"),
    ]
    if cfg.n_shared_experts:
        out += glu("mlp.shared_experts.", F * cfg.n_shared_experts, "shared_experts")
    for e in range(E):
        out += glu(f"mlp.experts.{e}.", F, "routed_experts", e)
    return out


# (layer, expert) of a routed-expert tensor name
expert_key = base.expert_key_by(r"(?:^|\.)model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def expert_tensor_names(cfg: Config, layer: int, expert: int) -> list[str]:
    """The tensor names of routed expert `expert` of `layer` as stored: `EXPERT_TENSORS`, each
    as `Quant.stored_names` (FP8: followed by its `_scale_inv`; INT4: its three tensors)."""
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return [n for s in EXPERT_TENSORS for n in cfg.quant_scheme.stored_names(p + s)]


def router_tensors(cfg: Config | dict, layer: int) -> dict[str, int]:
    """Tensors of `layer` indexed by expert id -> the axis to slice when pruning experts."""
    p = f"model.layers.{layer}.mlp.gate."
    return {p + "weight": 0, p + "e_score_correction_bias": 0}


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts per MoE layer (top_k capped at it): one count
    for all layers, a multiple of `n_group` leaving top_k in the `topk_group` best groups."""
    n = base.one_count(n_experts)  # transformers reads no per-layer counts
    out = copy.deepcopy(config_dict)
    text = out.get("text_config", out)
    G = int(text.get("n_group") or 1)
    if n < 1 or n % G:
        raise ReapError(f"deepseek_v3: keep a multiple of n_group={G} experts, not {n}")
    text["n_routed_experts"] = n
    if text.get("num_nextn_predict_layers"):  # prune leaves the MTP layers out (module docstring)
        text["num_nextn_predict_layers"] = 0
    k = text["num_experts_per_tok"] = min(int(text["num_experts_per_tok"]), n)
    if int(text.get("topk_group") or 1) * (n // G) < k:
        raise ReapError(f"deepseek_v3: {n} experts leave fewer than top_k={k} in the best groups")
    return out


def expert_groups(config_dict: dict) -> int:
    """Routing groups (`n_group`): a plan keeps as many experts in each (see reap.prune.plan)."""
    return int(config_dict.get("text_config", config_dict).get("n_group") or 1)


calibration_widths = base.residual_widths
top_k = base.hf_top_k
chat_format = base.own_template  # the checkpoints ship their chat template


def state_bytes(cfg: Config, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position: latent + rotated key per layer, recurrent bytes per sequence: 0,
    activation bytes per token, attention-score bytes per (query, key) pair)."""
    H, moe = cfg.num_attention_heads, max(cfg.n_shared_experts or 0, 2 * cfg.num_experts_per_tok)
    per_pos = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act_bytes
    attn = H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + 2 * cfg.v_head_dim)
    widest = max(cfg.intermediate_size, cfg.moe_intermediate_size * moe, attn)
    act = 4 * (cfg.hidden_size * 9 + 4 * widest + (cfg.n_routed_experts or 0))
    return per_pos, 0, act, 4 * 3 * H


# -- the model ---------------------------------------------------------------------------------
class Model(blocks.PreNormModel):
    """DeepSeek-V3 / Kimi K2 text model; holds no weights (see `reap.models.base`).

    Compute runs in `dtype` on `device`; norms, the router and the softmax are fp32."""

    expert_tensor_names = staticmethod(expert_tensor_names)
    cache_type = attention.MLACache

    def __init__(
        self, cfg: Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        super().__init__(cfg, device, dtype)
        self.mla = attention.MLADims.from_config(cfg)
        self.rope = attention.Rope.create(cfg.qk_rope_head_dim, *attention.rope_settings(cfg))
        self.scale = cfg.softmax_scale
        r = (cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        self.routing = (*r, cfg.norm_topk_prob)  # blocks.grouped_route's settings

    def _rotate(self, x: Tensor, start: int) -> Tensor:
        return self.rope.apply(x, start, interleaved=self.cfg.rope_interleave)

    def _w(self, get: Weights, prefix: str) -> blocks.WeightFn:
        def w(name: str) -> Tensor:
            dtype = torch.float32 if name in _KEEP_F32 else self.dtype
            t = self.cfg.quant_scheme.load(get, prefix + name)
            return (
                t.to(self.device, dtype) if isinstance(t, Tensor) else t.dense(dtype, self.device)
            )

        return w

    def _attention(self, i: int, get: Weights, x: Tensor, cache) -> Tensor:
        """The MLA of layer i: x [B, T, D] -> [B, T, D]."""
        sub = self._w(get, f"model.layers.{i}.self_attn.")
        return attention.mla_attention(x, sub, self.mla, cache, rope=self._rotate, scale=self.scale)

    def _moe(self, i: int, get: Weights, x: Tensor, experts: ExpertSource, observer) -> Tensor:
        """Route, run the chosen experts expert-major, add the shared experts: [N, D] -> [N, D].
        Experts work in the model space, so an expert's model_norm is its output's norm."""
        w = self._w(get, f"model.layers.{i}.mlp.")
        bias = w("gate.e_score_correction_bias")
        ids, weights, probs = blocks.grouped_route(
            blocks.linear(x.float(), w("gate.weight")), bias, *self.routing
        )
        y = blocks.model_width_experts(x, ids, weights, probs, i, experts, self._expert, observer)
        y = y.to(x.dtype)
        if self.cfg.n_shared_experts:
            s = "shared_experts."
            y = y + blocks.silu_glu(x, *(w(f"{s}{n}_proj.weight") for n in GLU))
        return y

    def _expert(self, x: Tensor, t) -> Tensor:
        """One routed expert on its tokens: x [M, D] -> [M, D]."""

        typed = expert_matrices(t)  # INT4 triples as records (already so from the engine)

        def weight(n: str) -> Matrix:
            w, s = typed[f"{n}_proj.weight"], typed.get(f"{n}_proj.weight_scale_inv")
            w = w if s is None else fp8.dequantize(w, s, self.cfg.fp8_block)
            return w.to(x.device, x.dtype) if isinstance(w, Tensor) else w

        return blocks.silu_glu(x, *map(weight, GLU))
