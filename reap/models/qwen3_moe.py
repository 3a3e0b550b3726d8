"""Qwen3-MoE and OLMoE (`model_type` qwen3_moe, olmoe): softmax top-k routed SwiGLU experts
behind grouped-query RoPE attention with q/k RMSNorm, read from Hugging Face checkpoints in place.

Also the shared core of `reap.models.mixtral`, which differs only in names and config fields
(`Naming`). Qwen3-MoE normalizes q and k per head and may keep dense MLP layers and renormalize
the top-k weights; OLMoE normalizes the whole q and k projections and may clip q, k, v.

References: transformers 5 `modeling_qwen3_moe.py` / `modeling_olmoe.py`, mlx-lm `qwen3_moe.py` /
`olmoe.py`. Shapes: B batch, T tokens, N = B*T, D hidden, H heads, Hkv key/value heads,
Dh head width, V vocab, E n_experts, K top_k, F expert width.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import base, validate
from reap.models.base import ExpertSource, Weights, decoder_specs, dtype_code
from reap.models.shared import blocks
from reap.models.shared.attention import KVCache, Rope, gqa_attention, rope_settings
from reap.quant.matrix import stored_matrices as expert_matrices  # noqa: F401 - family hook


@dataclass(frozen=True)
class Naming:
    """Where a family keeps its MoE tensors: `moe` is the block's prefix inside a layer, `gate`,
    `up`, `down` an expert's matrices (short names), `order` their order in the file."""

    moe: str
    gate: str
    up: str
    down: str
    expert_count_key: str  # the config.json key holding n_experts

    @property
    def order(self) -> tuple[str, str, str]:
        return tuple(sorted((self.gate, self.up, self.down)))  # safetensors writes names sorted

    def expert_names(self, layer: int, expert: int) -> list[str]:
        p = f"model.layers.{layer}.{self.moe}experts.{expert}."
        return [p + s for s in self.order]

    def expert_key(self, name: str) -> tuple[int, int] | None:
        pattern = rf"(?:^|\.)model\.layers\.(\d+)\.{re.escape(self.moe)}experts\.(\d+)\."
        m = re.search(pattern, name)
        return (int(m.group(1)), int(m.group(2))) if m else None


NAMES = Naming("mlp.", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "num_experts")
# config keys every release of this module's families carries (Config.REQUIRED adds its own)
HF_SHARED = (*validate.HF_REQUIRED, "num_experts_per_tok", "num_key_value_heads", "hidden_act")
HF_SHARED += ("intermediate_size", "rms_norm_eps", "tie_word_embeddings", validate.ROPE[0])


@dataclass
class Config:
    """A Qwen3-MoE or OLMoE config; field names are the `config.json` names (transformers 5's
    `num_local_experts` and `dtype` are read as `num_experts` and `torch_dtype`)."""

    names: ClassVar[Naming] = NAMES
    model_type: str = "qwen3_moe"
    vocab_size: int = 151936
    hidden_size: int = 2048
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None
    intermediate_size: int = 6144  # dense MLP width (Qwen3-MoE); the expert width in OLMoE
    moe_intermediate_size: int | None = None
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    clip_qkv: float | None = None
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    # what every Qwen3-MoE and OLMoE release carries (tests/test_strict_release.py: the others)
    REQUIRED = (*HF_SHARED, ("num_experts", "num_local_experts"), "norm_topk_prob")
    REQUIRED += ("attention_bias", validate.ROPE[1])

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a config.json dict (or one with a `text_config`); unknown keys ignored."""
        text = cls._aliases(dict(validate.text_of(d)))
        cls.validate(text)
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in text.items() if k in names and v is not None})
        cfg.rope_theta, cfg.rope_scaling = rope_settings(text)
        cfg.sliding_window = cls._window(text)
        cfg._check()
        return cfg

    @staticmethod
    def _aliases(text: dict) -> dict:
        text.setdefault("num_experts", text.get("num_local_experts"))
        text.setdefault("torch_dtype", text.get("dtype"))
        return text

    @staticmethod
    def _window(text: dict) -> int | None:
        # transformers drops Qwen3-MoE's window unless use_sliding_window is set
        return text.get("sliding_window") if text.get("use_sliding_window") else None

    @classmethod
    def validate(cls, text: dict) -> None:
        """Types, required keys and ranges of a config (after `_aliases`; ConfigError, exit 2)."""
        validate.check_fields(cls, text, none_is_default=True)
        validate.need_hf(text, "num_experts", "num_experts_per_tok", ("head_dim",))
        validate.need_int(text, "decoder_sparse_step", 1, validate.MAX_LAYERS)
        n = text["num_hidden_layers"]
        validate.need_int_list(text, "mlp_only_layers", 0, n - 1, "num_hidden_layers - 1")

    def _check(self) -> None:
        if self.hidden_act != "silu":
            raise ReapError(f"{self.model_type} config: unsupported hidden_act={self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ReapError(f"{self.model_type} config: heads not a multiple of key/value heads")

    # -- derived facts ------------------------------------------------------------------------
    @property
    def dh(self) -> int:
        """Per-head width."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def expert_width(self) -> int:
        """F, the hidden width of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def qk_norm(self) -> str | None:
        """ "head" (per-head RMSNorm of q and k), "full" (over the whole projection) or None."""
        return "full" if self.model_type == "olmoe" else "head"

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` (zero-based) has routed experts (else a dense MLP)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def experts_in(self, layer: int) -> int:
        """Routed experts of MoE layer `layer` (one count for all layers)."""
        return self.num_experts


# -- layout ------------------------------------------------------------------------------------
def layout_of(cfg: Config) -> list[TensorSpec]:
    """Every tensor of the Hugging Face layout of `cfg` (logical order: embedding, layers,
    final norm, head)."""
    dt = dtype_code(cfg.torch_dtype)
    return decoder_specs(cfg, dt, lambda i: _layer_specs(cfg, i, dt))


def _layer_specs(cfg: Config, i: int, dt: str) -> list[TensorSpec]:
    D, p = cfg.hidden_size, f"model.layers.{i}."

    def t(name, shape, comp):
        return TensorSpec(p + name, dt, tuple(shape), comp, i)

    out = [t("input_layernorm.weight", (D,), "norms")]
    out += _attn_specs(cfg, t)
    out.append(t("post_attention_layernorm.weight", (D,), "norms"))
    if not cfg.is_moe(i):
        F = cfg.intermediate_size
        dense = (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F)))
        return out + [t(f"mlp.{n}.weight", s, "dense_mlp") for n, s in dense]
    out.append(t(cfg.names.moe + "gate.weight", (cfg.experts_in(i), D), "router"))
    for e in range(cfg.experts_in(i)):
        out += expert_specs(cfg, i, e, dt)
    return out


def _attn_specs(cfg: Config, t) -> list[TensorSpec]:
    D, Dh, a = cfg.hidden_size, cfg.dh, "self_attn."
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    rows = {"q": H * Dh, "k": Hkv * Dh, "v": Hkv * Dh}
    out = [t(f"{a}{n}_proj.weight", (r, D), "attention") for n, r in rows.items()]
    out.append(t(a + "o_proj.weight", (D, H * Dh), "attention"))
    if cfg.attention_bias:
        out += [t(f"{a}{n}_proj.bias", (r,), "attention") for n, r in rows.items()]
        out.append(t(a + "o_proj.bias", (D,), "attention"))
    if cfg.qk_norm == "head":
        out += [t(a + f"{n}_norm.weight", (Dh,), "attention") for n in "qk"]
    elif cfg.qk_norm == "full":  # transformers sizes them from hidden_size, as OLMoE does
        kv = cfg.hidden_size // H * Hkv
        out += [
            t(a + "q_norm.weight", (D,), "attention"),
            t(a + "k_norm.weight", (kv,), "attention"),
        ]
    return out


def expert_specs(cfg: Config, layer: int, expert: int, dt: str | None = None) -> list[TensorSpec]:
    """The three matrices of one routed expert, file order."""
    dt = dt or dtype_code(cfg.torch_dtype)
    D, F, n = cfg.hidden_size, cfg.expert_width, cfg.names
    shapes = {n.gate: (F, D), n.up: (F, D), n.down: (D, F)}
    names = n.expert_names(layer, expert)
    return [
        TensorSpec(name, dt, shapes[s], "routed_experts", layer, expert)
        for name, s in zip(names, n.order)
    ]


def set_experts(config_dict: dict, n_experts: int | dict[int, int], key: str) -> dict:
    """config.json with `n_experts` routed experts per MoE layer (under `key` and any alias
    already present), top-k capped at that count. The Hugging Face configs hold one count for
    every layer, so differing per-layer counts are refused."""
    n = base.one_count(n_experts)
    out = copy.deepcopy(config_dict)
    text = out.get("text_config", out)
    for k in {key} | ({"num_experts", "num_local_experts"} & text.keys()):
        text[k] = n
    text["num_experts_per_tok"] = min(int(text.get("num_experts_per_tok", n)), n)
    return out


def state_bytes(cfg: Config, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position, recurrent bytes per sequence (none), activation bytes per token,
    attention-score bytes per (query, key) pair) for the engine's memory plan."""
    H, Hkv, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dh
    per_pos = cfg.num_hidden_layers * 2 * Hkv * Dh * act_bytes
    widest = max(cfg.intermediate_size, cfg.expert_width, (H + 2 * Hkv) * Dh, cfg.vocab_size)
    act = 4 * (cfg.hidden_size * 8 + 4 * widest)
    return per_pos, 0, act, 4 * 3 * H


# -- the family API ----------------------------------------------------------------------------
expert_groups = base.ungrouped  # softmax top-k over all experts
calibration_widths = base.residual_widths
top_k = base.hf_top_k
chat_format = base.own_template  # the checkpoints ship their chat template
expert_key = NAMES.expert_key  # (layer, expert) of a routed-expert tensor name, else None


def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint (names as Hugging Face saves them)."""
    return layout_of(Config.from_dict(config_dict))


def expert_tensor_names(cfg: Config, layer: int, expert: int) -> list[str]:
    """The three tensor names of routed expert `expert` of `layer`, file order."""
    return cfg.names.expert_names(layer, expert)


def router_tensors(cfg: Config, layer: int) -> dict[str, int]:
    """The router tensor of `layer` -> its expert axis (sliced when pruning experts)."""
    return {f"model.layers.{layer}.{cfg.names.moe}gate.weight": 0}


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts per layer (see `set_experts`)."""
    return set_experts(config_dict, n_experts, NAMES.expert_count_key)


# -- the model ---------------------------------------------------------------------------------
class Model(blocks.PreNormModel):
    """Pre-norm decoder with GQA RoPE attention and softmax-routed SwiGLU experts; holds no
    weights (see `reap.models.base`). Compute runs in `dtype` on `device`; router probabilities,
    norms and attention softmax in fp32."""

    expert_tensor_names = staticmethod(expert_tensor_names)
    cache_type = KVCache

    def __init__(
        self, cfg: Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        super().__init__(cfg, device, dtype)
        self.rope = Rope.create(cfg.dh, cfg.rope_theta, cfg.rope_scaling)

    def _attention(
        self, i: int, get: Weights, x: torch.Tensor, cache: KVCache | None
    ) -> torch.Tensor:
        cfg, Bn, T, w = self.cfg, x.shape[0], x.shape[1], self._w(get, f"model.layers.{i}.")
        H, Hkv, Dh, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dh, cfg.rms_norm_eps
        q, k, v = (self._proj(x, w, n) for n in "qkv")  # [B, T, H*Dh], [B, T, Hkv*Dh] x2
        if cfg.qk_norm == "full":
            q = blocks.rms_norm(q, w("self_attn.q_norm.weight"), eps)
            k = blocks.rms_norm(k, w("self_attn.k_norm.weight"), eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k = q.reshape(Bn, T, H, Dh), k.reshape(Bn, T, Hkv, Dh)  # per head
        v = v.reshape(Bn, T, Hkv, Dh)
        if cfg.qk_norm == "head":
            q = blocks.rms_norm(q, w("self_attn.q_norm.weight"), eps)
            k = blocks.rms_norm(k, w("self_attn.k_norm.weight"), eps)
        start = cache.length if cache is not None else 0
        q, k = self.rope.apply(q, start), self.rope.apply(k, start)
        o = gqa_attention(q, k, v, cache, Dh**-0.5, window=cfg.sliding_window)  # [B, T, H, Dh]
        return self._proj(o.reshape(Bn, T, H * Dh), w, "o")

    def native_layer(self, i: int) -> blocks.NativeLayer | None:
        """Layer i for the engine's compiled decode step (see `blocks.NativeLayer`); None with
        attention biases or q/k/v clipping."""
        cfg, n = self.cfg, self.cfg.names
        if cfg.attention_bias or cfg.clip_qkv is not None:
            return None
        moe = cfg.is_moe(i)
        return blocks.NativeLayer(
            prefix=f"model.layers.{i}.",
            attn=tuple(f"self_attn.{p}_proj.weight" for p in "qkvo"),
            norms=("input_layernorm.weight", "post_attention_layernorm.weight"),
            qk_norms=("self_attn.q_norm.weight", "self_attn.k_norm.weight") if cfg.qk_norm else None,
            qk_per_head=cfg.qk_norm == "head", heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, dk=cfg.dh, rotary=self.rope,
            window=cfg.sliding_window, eps=cfg.rms_norm_eps,
            router=n.moe + "gate.weight" if moe else None,
            mlp=(n.gate, n.up, n.down) if moe else tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
            top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
        )  # fmt: skip

    def _proj(self, x: torch.Tensor, w: blocks.WeightFn, n: str) -> torch.Tensor:
        y = blocks.linear(x, w(f"self_attn.{n}_proj.weight"))
        return y + w(f"self_attn.{n}_proj.bias") if self.cfg.attention_bias else y

    def _moe(
        self, i: int, get: Weights, x: torch.Tensor, experts: ExpertSource, observer
    ) -> torch.Tensor:
        """The routed experts of layer i: x [N, D] -> [N, D] fp32."""
        cfg, w = self.cfg, self._w(get, f"model.layers.{i}.{self.cfg.names.moe}")
        ids, weights, probs = blocks.softmax_topk(
            blocks.linear(x, w("gate.weight")), cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        return blocks.model_width_experts(
            x, ids, weights, probs, i, experts, self._expert, observer
        )

    def _expert(self, x: torch.Tensor, t) -> torch.Tensor:
        """One routed expert on its tokens: x [M, D] -> [M, D]."""
        n = self.cfg.names
        return blocks.silu_glu(x, *(t[s].to(x.device, x.dtype) for s in (n.gate, n.up, n.down)))
