"""GPT-OSS (`model_type` gpt_oss): config, checkpoint layout and the torch model driven layer by
layer through the protocol of `reap.models.base`.

Architecture (references: transformers `models/gpt_oss`, mlx-lm `models/gpt_oss.py`): every layer
is grouped-query attention with q/k/v/o biases, YaRN RoPE, a learned per-head sink logit and, on
`layer_types` "sliding_attention" layers, a sliding window; then an MoE whose router is a biased
linear (top-k on the logits, softmax over the chosen) and whose experts are biased GLUs with
interleaved gate/up columns, clamped at `swiglu_limit`: (up + 1) * gate * sigmoid(alpha * gate).

Experts are stored fused, one tensor per layer with the expert axis first: MXFP4 blocks, scales
and biases in the release, dequantized matrices and biases as transformers saves them. Expert e
is addressed by the fused views `X[e]` (see `reap.checkpoint`). Shapes: B batch, T tokens,
D hidden, V vocab, H heads, Hkv kv heads, Dh head width, E n_experts, K top_k, F expert width.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

import torch

from reap.checkpoint import TensorSpec, view_name
from reap.errors import ReapError
from reap.models import base, validate
from reap.models.base import ExpertSource, Weights, decoder_specs, dtype_code
from reap.models.shared import blocks
from reap.models.shared.attention import KVCache, Rope, gqa_attention, rope_settings
from reap.quant import mxfp4

DENSE_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
MXFP4_TENSORS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


@dataclass
class Config:
    """A GPT-OSS config; field names are the `config.json` names."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: list | None = None
    rms_norm_eps: float = 1e-5
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False
    quantization_config: dict | None = None
    dtype: str | None = None
    torch_dtype: str | None = None
    rope: tuple = field(default=(150000.0, None), repr=False)  # (theta, HF scaling dict)
    REQUIRED = (*validate.HF_REQUIRED, "num_local_experts", "num_experts_per_tok", *validate.ROPE)
    REQUIRED += ("num_key_value_heads", "head_dim", "intermediate_size", "sliding_window")
    REQUIRED += ("layer_types", "rms_norm_eps", "swiglu_limit", "attention_bias")
    REQUIRED += ("tie_word_embeddings",)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict; unknown keys ignored."""
        cls.validate(validate.text_of(d))
        names = {f.name for f in fields(cls)} - {"rope"}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.torch_dtype = cfg.torch_dtype or cfg.dtype  # transformers 5 writes `dtype`
        cfg.rope = rope_settings(d) if ("rope_parameters" in d or "rope_theta" in d) else cfg.rope
        if not cfg.attention_bias:
            raise ReapError("gpt_oss config: attention_bias false is not supported")
        if cfg.mxfp4 and (cfg.hidden_size % 32 or cfg.intermediate_size % 32):
            raise ReapError("gpt_oss config: MXFP4 experts need hidden_size and intermediate_size "
                            f"multiples of 32 (got {cfg.hidden_size}, {cfg.intermediate_size})")
        return cfg

    @classmethod
    def validate(cls, d: dict) -> None:
        """Types, required keys and ranges of a config (ConfigError, exit 2)."""
        validate.check_fields(cls, {k: v for k, v in d.items() if k != "rope"})
        validate.need_hf(d, "num_local_experts", "num_experts_per_tok", ("head_dim",))
        validate.need_int(d, "sliding_window", 1, validate.MAX_INT)
        validate.need_float(d, "swiglu_limit", 0.0, validate.MAX_SCALE, above_lo=True)
        kinds = ("sliding_attention", "full_attention")
        validate.need_str_list(d, "layer_types", kinds, d["num_hidden_layers"])

    def is_moe(self, layer: int) -> bool:
        """Every GPT-OSS layer is an MoE layer."""
        return True

    def experts_in(self, layer: int) -> int:
        """Routed experts of layer `layer` (one count for all layers)."""
        return self.num_local_experts

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None for full attention."""
        sliding = self.layer_types is not None and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding else None

    @property
    def mxfp4(self) -> bool:
        """Whether the experts are stored as MXFP4 blocks and scales."""
        return (self.quantization_config or {}).get("quant_method") == "mxfp4"

    @property
    def file_dtype(self) -> str:
        return dtype_code(self.torch_dtype)


# -- layout ------------------------------------------------------------------------------------
def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor in layer order; routed experts as per-expert views `X[e]` of the fused
    tensors (component "routed_experts", layer and expert set)."""
    cfg = Config.from_dict(config_dict)
    fdt = cfg.file_dtype
    return decoder_specs(cfg, fdt, lambda i: _layer_specs(cfg, i, fdt))


def _layer_specs(cfg: Config, i: int, fdt: str) -> list[TensorSpec]:
    D, Dh, p = cfg.hidden_size, cfg.head_dim, f"model.layers.{i}."
    H, Hkv, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts

    def t(name, shape, comp):
        return TensorSpec(p + name, fdt, tuple(shape), comp, i)

    out = [t("input_layernorm.weight", (D,), "norms")]
    for n, rows in (("q", H * Dh), ("k", Hkv * Dh), ("v", Hkv * Dh)):
        out += [t(f"self_attn.{n}_proj.weight", (rows, D), "attention")]
        out += [t(f"self_attn.{n}_proj.bias", (rows,), "attention")]
    out += [
        t("self_attn.o_proj.weight", (D, H * Dh), "attention"),
        t("self_attn.o_proj.bias", (D,), "attention"),
        t("self_attn.sinks", (H,), "attention"),
        t("post_attention_layernorm.weight", (D,), "norms"),
        t("mlp.router.weight", (E, D), "router"),
        t("mlp.router.bias", (E,), "router"),
    ]
    for e in range(E):
        out += expert_specs(cfg, i, e)
    return out


def expert_specs(cfg: Config, layer: int, expert: int) -> list[TensorSpec]:
    """The views of one routed expert's slices of the fused tensors (expert_tensor_names order)."""
    D, F, fdt = cfg.hidden_size, cfg.intermediate_size, cfg.file_dtype
    if cfg.mxfp4:
        shapes = {
            "gate_up_proj_blocks": ((2 * F, D // 32, 16), "U8", "mxfp4.blocks"),
            "gate_up_proj_scales": ((2 * F, D // 32), "U8", "mxfp4.scales"),
            "gate_up_proj_bias": ((2 * F,), fdt, "weight"),
            "down_proj_blocks": ((D, F // 32, 16), "U8", "mxfp4.blocks"),
            "down_proj_scales": ((D, F // 32), "U8", "mxfp4.scales"),
            "down_proj_bias": ((D,), fdt, "weight"),
        }
    else:
        shapes = {
            "gate_up_proj": ((D, 2 * F), fdt, "weight"),
            "gate_up_proj_bias": ((2 * F,), fdt, "weight"),
            "down_proj": ((F, D), fdt, "weight"),
            "down_proj_bias": ((D,), fdt, "weight"),
        }
    names = expert_tensor_names(cfg, layer, expert)
    return [
        TensorSpec(n, dtype, shape, "routed_experts", layer, expert, role)
        for n, (shape, dtype, role) in zip(names, shapes.values())
    ]


def _expert_names(short: tuple[str, ...], layer: int, expert: int) -> list[str]:
    return [view_name(f"model.layers.{layer}.mlp.experts.{s}", expert) for s in short]


# (layer, expert) of a routed-expert view `...experts.X[e]` (the fused tensors hold all experts)
expert_key = base.expert_key_by(r"(?:^|\.)model\.layers\.(\d+)\.mlp\.experts\.\w+\[(\d+)\]$")


def expert_tensor_names(cfg: Config, layer: int, expert: int) -> list[str]:
    """The views of expert `expert` of `layer` in the fused tensors as stored: the MXFP4 blocks,
    scales and biases of a release, or transformers' dequantized matrices and biases."""
    return _expert_names(MXFP4_TENSORS if cfg.mxfp4 else DENSE_TENSORS, layer, expert)


def router_tensors(cfg: Config | dict, layer: int) -> dict[str, int]:
    """Tensors of `layer` indexed by expert id -> the axis to slice when pruning experts."""
    p = f"model.layers.{layer}.mlp.router."
    return {p + "weight": 0, p + "bias": 0}


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts in every layer (top_k capped at it). GPT-OSS
    configs hold one count for all layers, so per-layer counts must all be equal."""
    n = base.one_count(n_experts)
    out = copy.deepcopy(config_dict)
    out["num_local_experts"] = n
    out["num_experts_per_tok"] = min(out.get("num_experts_per_tok", 4), n)
    return out


expert_groups = base.ungrouped  # softmax over the top-k logits of all experts
calibration_widths = base.residual_widths
top_k = base.hf_top_k
# harmony: the checkpoints ship their chat template; these markers only split replies (the
# model opens its analysis channel itself; the final channel follows it)
HARMONY = base.ChatFormat(
    system="<|start|>system<|message|>", user="<|start|>user<|message|>",
    assistant="<|start|>assistant", end="<|end|>",
    think_open="<|channel|>analysis<|message|>",
    think_close="<|end|><|start|>assistant<|channel|>final<|message|>", renders=False)


def chat_format(config_dict: dict) -> base.ChatFormat:
    """gpt-oss's harmony reasoning markers (rendering needs the checkpoint's template)."""
    return HARMONY


def state_bytes(cfg: Config, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position, recurrent bytes per sequence, activation bytes per token,
    attention-score bytes per (query, key) pair) of one sequence."""
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_pos = cfg.num_hidden_layers * 2 * Hkv * Dh * act_bytes
    widest = max((H + 2 * Hkv) * Dh, 2 * cfg.intermediate_size, cfg.num_local_experts)
    act = 4 * (cfg.hidden_size * 8 + 4 * widest)
    return per_pos, 0, act, 4 * 3 * H


# -- experts -----------------------------------------------------------------------------------
def sanitize(t: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One expert's stored slices (short names) -> {gate_up [D, 2F], gate_up_bias [2F],
    down [F, D], down_bias [D]} in `dtype`: MXFP4 blocks [R, C/32, 16] with scales [R, C/32]
    decode to [R, C] (low nibble = even column, scale 2^(byte - 127)) and are transposed."""
    out = {
        "gate_up_bias": t["gate_up_proj_bias"].to(dtype),
        "down_bias": t["down_proj_bias"].to(dtype),
    }
    for n in ("gate_up", "down"):
        if f"{n}_proj_blocks" in t:
            codes, scales = t[f"{n}_proj_blocks"], t[f"{n}_proj_scales"]
            packed = codes.reshape(*codes.shape[:-2], -1)  # [R, C/2]
            out[n] = mxfp4.dequantize(packed, scales, dtype).T  # [C, R]
        else:
            out[n] = t[f"{n}_proj"].to(dtype)
    return out


def expert_matrices(t: Mapping[str, torch.Tensor]) -> dict:
    """The family hook: one expert's stored slices with each MXFP4 pair (blocks [R, C/32, 16],
    scales [R, C/32]) as one `MXFP4Matrix` W [R, C] named `gate_up_proj` / `down_proj` as a
    check names it (rows are outputs), which the engine multiplies with its kernels (fused,
    without decoding, for a few bf16 tokens); dense matrices and biases unchanged."""
    out = dict(t)
    for n in ("gate_up", "down"):
        if f"{n}_proj_blocks" in t:
            codes = out.pop(f"{n}_proj_blocks")
            packed = codes.reshape(codes.shape[0], -1)  # [R, C/2]
            out[f"{n}_proj"] = mxfp4.MXFP4Matrix(packed, out.pop(f"{n}_proj_scales"))
    return out


def expert_mlp(x: torch.Tensor, t: Mapping[str, torch.Tensor], alpha: float, limit: float):
    """One expert on its tokens: x [M, D] -> [M, D] (t: stored slices by short name, or
    `expert_matrices` of them)."""
    if isinstance(t.get("gate_up_proj"), mxfp4.MXFP4Matrix):
        gate_up = blocks.linear(x, t["gate_up_proj"]) + t["gate_up_proj_bias"].to(x)  # x's dtype
        down = lambda h: blocks.linear(h, t["down_proj"]) + t["down_proj_bias"].to(x)
    else:
        w = sanitize(t, x.dtype)
        gate_up = x @ w["gate_up"].to(x.device) + w["gate_up_bias"].to(x.device)  # [M, 2F]
        down = lambda h: h @ w["down"].to(x.device) + w["down_bias"].to(x.device)
    gate = gate_up[:, 0::2].clamp(max=limit)  # [M, F]
    up = gate_up[:, 1::2].clamp(-limit, limit)
    return down((up + 1) * gate * torch.sigmoid(gate * alpha))


def router(logits: torch.Tensor, top_k: int):
    """logits [N, E] -> (ids [N, K], weights [N, K] fp32: softmax over the top-k logits,
    probs [N, E] fp32: softmax over all logits, reported to observers)."""
    top, ids = logits.float().topk(top_k, dim=-1)  # [N, K]
    return ids, torch.softmax(top, dim=-1), torch.softmax(logits.float(), dim=-1)


# -- the model ---------------------------------------------------------------------------------
class Model(blocks.PreNormModel):
    """GPT-OSS decoder; holds no weights (see `reap.models.base` for the driving protocol).
    Compute runs in `dtype` on `device`; norms, router softmax and attention softmax in fp32."""

    expert_tensor_names = staticmethod(expert_tensor_names)
    cache_type = KVCache

    def __init__(
        self, cfg: Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        super().__init__(cfg, device, dtype)
        self.rope = Rope.create(cfg.head_dim, *cfg.rope)

    def _attention(self, i: int, get: Weights, x: torch.Tensor, cache: KVCache | None):
        """Biased GQA with sinks of layer i: x [B, T, D] -> [B, T, D]."""
        cfg, w = self.cfg, self._w(get, f"model.layers.{i}.self_attn.")
        Bn, T, _ = x.shape

        def proj(n: str) -> torch.Tensor:  # [B, T, heads, Dh]
            y = blocks.linear(x, w(f"{n}_proj.weight")) + w(f"{n}_proj.bias")
            return y.reshape(Bn, T, -1, cfg.head_dim)

        start = cache.length if cache is not None else 0
        q, k = self.rope.apply(proj("q"), start), self.rope.apply(proj("k"), start)
        sinks = get(f"model.layers.{i}.self_attn.sinks").to(self.device, torch.float32)
        o = gqa_attention(q, k, proj("v"), cache, cfg.head_dim**-0.5, sinks, cfg.window(i))
        o = o.reshape(Bn, T, -1)  # [B, T, H*Dh]
        return blocks.linear(o, w("o_proj.weight")) + w("o_proj.bias")

    def _moe(
        self, i: int, get: Weights, x: torch.Tensor, experts: ExpertSource, observer
    ) -> torch.Tensor:
        """The MoE of layer i: x [N, D] -> [N, D] fp32."""
        cfg, w = self.cfg, self._w(get, f"model.layers.{i}.mlp.router.")
        logits = blocks.linear(x, w("weight")) + w("bias")  # [N, E]
        ids, weights, probs = router(logits, cfg.num_experts_per_tok)

        def run(xs: torch.Tensor, t) -> torch.Tensor:
            return expert_mlp(xs, t, cfg.swiglu_alpha, cfg.swiglu_limit)

        return blocks.model_width_experts(x, ids, weights, probs, i, experts, run, observer)
