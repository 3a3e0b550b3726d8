"""Kimi K3 (`model_type` kimi_k3 wrapping a kimi_linear `text_config`): config, checkpoint layout
and the torch model driven layer by layer through the protocol of `reap.models.base`.

Architecture (reference: mlx-lm 0.32.2 `models/kimi_k3.py`): layer 0 dense, layers 1.. LatentMoE;
attention is KDA (gated delta rule, `linear_attn_config.kda_layers`, one-based) or gated NoPE MLA;
the residual stream is AttnRes (softmax mix over block snapshots). Shapes: B batch, T tokens,
D hidden, V vocab, E n_experts, K top_k."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, replace

import torch

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import base, validate
from reap.models.base import ExpertSource, State, Weights, dtype_code
from reap.models.kimi_k3 import config as kimi_k3_config
from reap.models.kimi_k3.blocks import (
    MoEDims,
    attn_res_mix,
    expert_matrices,  # noqa: F401 - family hook
    latent_moe,
)
from reap.models.kimi_k3.chat import chat_format  # noqa: F401 - family hook (chat markers)
from reap.models.shared import attention, blocks, kda
from reap.models.shared.vision import check as check_vision
from reap.models.shared.vision import vision_specs

# the six tensors of a routed expert, file order: w1 gate, w2 down, w3 up; E2M1 pairs, E8M0 scales
EXPERT_TENSORS = tuple(f"w{i}.weight_{k}" for i in (1, 2, 3) for k in ("packed", "scale"))
# K3's tensor roles by name suffix (TensorSpec.role): KDA's decay and convolutions, router bias
ROLES = base.HF_ROLES | {"A_log": "decay_log", "dt_bias": "decay_bias", "conv1d.weight": "conv"}
ROLES |= {"f_b_proj.weight": "decay_proj", "e_score_correction_bias": "router_bias"}
expert_groups = base.ungrouped  # family hook: K3 routes ungrouped (num_expert_group must be 1)
_KEEP_F32 = {"A_log", "dt_bias", "gate.e_score_correction_bias"}  # used in fp32 whatever dtype


@dataclass
class Config:
    """The text config of a K3 checkpoint; field names are the `config.json` names."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    num_attention_heads: int = 96
    num_key_value_heads: int = 96
    intermediate_size: int = 33792
    rms_norm_eps: float = 1e-5
    linear_attn_config: dict = field(default_factory=dict)
    hidden_act: str = "situ"
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    attn_res_block_size: int | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = False
    num_experts: int = 0
    num_experts_per_layer: dict | None = None  # reap extension: {"layer": n} (global prune)
    num_experts_per_token: int = 16
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    REQUIRED = kimi_k3_config.REQUIRED  # every release carries these

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a full config.json (with `text_config`) or a bare text config; unknown keys ignored."""
        text = validate.text_of(d)
        cls.validate(text)
        if text is not d and d.get("vision_config") is not None:
            check_vision(d["vision_config"])
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in text.items() if k in names})
        cfg._check()
        return cfg

    @classmethod
    def validate(cls, text: dict) -> None:
        """Types, required keys and ranges of a text config (ConfigError, exit 2)."""
        validate.check_fields(cls, text)
        kimi_k3_config.check_text(text)

    def _check(self) -> None:
        unsupported = []
        if self.hidden_act != "situ":
            unsupported.append(f"hidden_act={self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            unsupported.append(f"moe_router_activation_func={self.moe_router_activation_func!r}")
        if self.num_expert_group != 1 or not self.mla_use_nope:
            unsupported.append("grouped routing or RoPE MLA")
        if not self.linear_attn_config.get("use_full_rank_gate", False):
            unsupported.append("low-rank KDA output gate")
        if unsupported:
            raise ReapError(f"kimi_k3 config: unsupported {', '.join(unsupported)}")

    # -- derived facts ------------------------------------------------------------------------
    def is_kda(self, layer: int) -> bool:
        """Whether decoder layer `layer` (zero-based) uses KDA (else MLA)."""
        return layer + 1 in self.linear_attn_config.get("kda_layers", [])

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a LatentMoE layer (else the dense MLP)."""
        first, freq = self.first_k_dense_replace, self.moe_layer_freq
        return self.num_experts > 0 and layer >= first and layer % freq == 0

    def experts_in(self, layer: int) -> int:
        """Routed experts of MoE layer `layer` (per-layer counts after a global-scope prune)."""
        return int((self.num_experts_per_layer or {}).get(str(layer), self.num_experts))

    @property
    def kda_heads(self) -> int:
        return self.linear_attn_config["num_heads"]

    @property
    def kda_head_dim(self) -> int:
        return self.linear_attn_config["head_dim"]

    @property
    def latent(self) -> int:
        return self.routed_expert_hidden_size or self.hidden_size


# -- layout ------------------------------------------------------------------------------------
def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of the released layout in file order (names without `language_model.`).

    A `vision_config` adds the vision tower and projector (`reap.models.shared.vision`): stored in
    the release, never read by the text model, copied verbatim by prune."""
    cfg = Config.from_dict(config_dict)
    fdt = dtype_code(cfg.torch_dtype)
    D, V = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", fdt, (V, D), "embed_head")]
    for i in range(cfg.num_hidden_layers):
        specs += _layer_specs(cfg, i, fdt)
    specs += [TensorSpec("model.norm.weight", fdt, (D,), "norms")]
    if cfg.attn_res_block_size is not None:
        specs += [
            TensorSpec("model.output_attn_res_proj.weight", fdt, (1, D), "attn_res"),
            TensorSpec("model.output_attn_res_norm.weight", fdt, (D,), "attn_res"),
        ]
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", fdt, (V, D), "embed_head"))
    vision = config_dict.get("vision_config")
    specs = base.tag_roles(specs, ROLES)
    return specs + (vision_specs(vision, fdt, D) if vision is not None else [])


def _layer_specs(cfg: Config, i: int, fdt: str) -> list[TensorSpec]:
    D, p = cfg.hidden_size, f"model.layers.{i}."

    def t(name, shape, comp, dtype=fdt):
        return TensorSpec(p + name, dtype, tuple(shape), comp, i)

    out = [t("input_layernorm.weight", (D,), "norms")]
    mla = attention.MLADims.from_config(cfg)
    out += _kda_specs(cfg, t) if cfg.is_kda(i) else mla.specs(t, D)
    out.append(t("post_attention_layernorm.weight", (D,), "norms"))
    if cfg.attn_res_block_size is not None:
        for r in ("self_attention_res", "mlp_res"):
            out += [
                t(f"{r}_proj.weight", (1, D), "attn_res"),
                t(f"{r}_norm.weight", (D,), "attn_res"),
            ]
    if not cfg.is_moe(i):
        return out + _mlp_specs(t, "mlp.", D, cfg.intermediate_size, "dense_mlp")
    return out + _moe_specs(cfg, i, t, fdt)


def _mlp_specs(t, p: str, D: int, F: int, comp: str) -> list[TensorSpec]:
    shapes = {"gate": (F, D), "up": (F, D), "down": (D, F)}  # [out, in], layout order
    return [t(f"{p}{n}_proj.weight", s, comp) for n, s in shapes.items()]


def _kda_specs(cfg: Config, t) -> list[TensorSpec]:
    D, H, Dk = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
    P, K, a = H * Dk, cfg.linear_attn_config.get("short_conv_kernel_size", 4), "self_attn."
    out = [t(a + f"{n}_proj.weight", (P, D), "kda") for n in "qkv"]
    out += [t(a + f"{n}_conv1d.weight", (P, 1, K), "kda", "F32") for n in "qkv"]
    out += [
        t(a + "f_a_proj.weight", (Dk, D), "kda"),
        t(a + "f_b_proj.weight", (P, Dk), "kda"),
        t(a + "b_proj.weight", (H, D), "kda"),
        t(a + "g_proj.weight", (P, D), "kda"),
        t(a + "A_log", (max(H, Dk),), "kda", "F32"),
        t(a + "dt_bias", (P,), "kda", "F32"),
        t(a + "o_norm.weight", (Dk,), "kda", "F32"),
        t(a + "o_proj.weight", (D, P), "kda"),
    ]
    return out


def _moe_specs(cfg: Config, i: int, t, fdt: str) -> list[TensorSpec]:
    D, E, m = cfg.hidden_size, cfg.experts_in(i), "block_sparse_moe."
    out = [
        t(m + "gate.weight", (E, D), "router"),
        t(m + "gate.e_score_correction_bias", (E,), "router", "F32"),
    ]
    if cfg.num_shared_experts:
        F = cfg.moe_intermediate_size * cfg.num_shared_experts
        out += _mlp_specs(t, m + "shared_experts.", D, F, "shared_experts")
    if cfg.routed_expert_hidden_size:
        Lt = cfg.routed_expert_hidden_size
        out.append(t(m + "routed_expert_down_proj.weight", (Lt, D), "latent_proj"))
        if cfg.latent_moe_use_norm:
            out.append(t(m + "routed_expert_norm.weight", (Lt,), "latent_proj"))
        out.append(t(m + "routed_expert_up_proj.weight", (D, Lt), "latent_proj"))
    for e in range(E):
        out += expert_specs(cfg, i, e)
    return out


def expert_specs(cfg: Config, layer: int, expert: int) -> list[TensorSpec]:
    """The six MXFP4 tensors of one routed expert, in file order (w1 gate, w2 down, w3 up)."""
    Lt, F = cfg.latent, cfg.moe_intermediate_size
    shapes = {"w1": (F, Lt), "w2": (Lt, F), "w3": (F, Lt)}  # [out, in]
    names = expert_tensor_names(cfg, layer, expert)
    roles = {"packed": ("mxfp4.blocks", 2), "scale": ("mxfp4.scales", 32)}  # weights per byte
    out = []
    for name, short in zip(names, EXPERT_TENSORS):
        (rows, cols), (role, per_byte) = shapes[short[:2]], roles[short.rsplit("_", 1)[1]]
        shape = (rows, cols // per_byte)
        out.append(TensorSpec(name, "U8", shape, "routed_experts", layer, expert, role))
    return out


# (layer, expert) of a routed-expert tensor name
expert_key = base.expert_key_by(r"(?:^|\.)model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.")


def expert_tensor_names(cfg: Config | None, layer: int, expert: int) -> list[str]:
    """The six tensor names of routed expert `expert` of `layer`, file order (any K3 config)."""
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return [p + s for s in EXPERT_TENSORS]


def router_tensors(cfg: Config | dict, layer: int) -> dict[str, int]:
    """Tensors of `layer` indexed by expert id -> the axis to slice when pruning experts."""
    p = f"model.layers.{layer}.block_sparse_moe.gate."
    return {p + "weight": 0, p + "e_score_correction_bias": 0}


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` per layer, or {layer: n} (non-uniform counts go to the reap
    extension `num_experts_per_layer`); top_k capped at the smallest count."""
    out = copy.deepcopy(config_dict)
    text = out.get("text_config", out)
    counts = n_experts if isinstance(n_experts, dict) else {}
    text.pop("num_experts_per_layer", None)
    if len(set(counts.values())) > 1:
        text["num_experts_per_layer"] = {str(k): int(v) for k, v in sorted(counts.items())}
    n, low = (max(counts.values()), min(counts.values())) if counts else (n_experts, n_experts)
    text["num_experts"] = int(n)
    text["num_experts_per_token"] = min(text["num_experts_per_token"], low)
    return out


def top_k(cfg: Config) -> int:
    """Experts each token is routed to (`num_experts_per_token`)."""
    return cfg.num_experts_per_token


def calibration_widths(cfg: Config, n_layers: int) -> base.ActivationWidths:
    """Calibration's widths: the AttnRes snapshots carried through `n_layers` layers (or 0)."""
    snapshots = -(-n_layers // cfg.attn_res_block_size) if cfg.attn_res_block_size else 0
    return replace(base.residual_widths(cfg, n_layers), snapshots=snapshots)


def state_bytes(cfg: Config, act_bytes: int) -> tuple[int, int, int, int]:
    """(KV bytes per position, recurrent bytes per sequence, activation bytes per token, score
    bytes per (query, key) pair) for the engine's memory plan: MLA caches latent + rope key per
    position; KDA keeps an fp32 [H, Dk, Dk] state and a (kernel-1)-step q/k/v conv tail."""
    n = cfg.num_hidden_layers
    kda_layers = [i for i in range(n) if cfg.is_kda(i)]
    per_pos = (n - len(kda_layers)) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * act_bytes
    P = cfg.kda_heads * cfg.kda_head_dim if kda_layers else 0
    k = cfg.linear_attn_config.get("short_conv_kernel_size", 4)
    per_seq = len(kda_layers) * (
        cfg.kda_heads * cfg.kda_head_dim**2 * 4 + (k - 1) * 3 * P * act_bytes
    )
    n_blocks = -(-n // (cfg.attn_res_block_size or n))
    mla = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + 2 * cfg.v_head_dim
    widest = max(cfg.intermediate_size, 3 * P, cfg.num_attention_heads * mla)
    act = 4 * (cfg.hidden_size * (n_blocks + 8) + 4 * widest)
    pair = 4 * 3 * max(cfg.num_attention_heads, cfg.kda_heads if kda else 0)
    return per_pos, per_seq, act, pair


# -- the model ---------------------------------------------------------------------------------
class Model(blocks.PreNormModel):
    """Kimi K3 text model; holds no weights (see `reap.models.base` for the driving protocol).

    Compute runs in `dtype` on `device`; the KDA decay and state, router scores, norms and the
    AttnRes mix are always fp32."""

    expert_tensor_names = staticmethod(expert_tensor_names)

    def __init__(
        self, cfg: Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ):
        super().__init__(cfg, device, dtype)
        self.mla = attention.MLADims.from_config(cfg)
        self.act = (cfg.activation_situ_beta or 1.0, cfg.activation_situ_linear_beta)
        self.moe = MoEDims.from_config(cfg)

    def _w(self, get: Weights, prefix: str) -> blocks.WeightFn:
        def w(name: str) -> torch.Tensor:
            t = get(prefix + name)
            keep = name in _KEEP_F32 or not t.is_floating_point()
            return t.to(self.device) if keep else t.to(self.device, self.dtype)

        return w

    def new_caches(self) -> list[kda.KDACache | attention.MLACache]:
        """Empty per-layer decode caches (KDA conv/recurrent state or MLA latent KV)."""
        return [
            kda.KDACache() if self.cfg.is_kda(i) else attention.MLACache()
            for i in range(self.n_layers)
        ]

    def embed(self, get: Weights, ids: torch.Tensor) -> State:
        """ids [B, T] int -> State with hidden [B, T, D]."""
        table = self._w(get, "model.")("embed_tokens.weight")
        return State(table[ids.to(self.device)].to(self.dtype))

    def attn_block(
        self, i: int, get: Weights, state: State, cache=None
    ) -> tuple[State, torch.Tensor]:
        """Attention of layer i with its AttnRes mixes; returns (state, MLP input [B, T, D])."""
        cfg, w, eps = self.cfg, self._w(get, f"model.layers.{i}."), self.cfg.rms_norm_eps
        partial, snapshots = state.hidden, list(state.blocks)
        res = cfg.attn_res_block_size is not None
        h = self._mix(w, "self_attention_res", snapshots, partial) if res else partial
        if res and i % cfg.attn_res_block_size == 0:
            snapshots, partial = [*snapshots, partial], None
        x = blocks.rms_norm(h, w("input_layernorm.weight"), eps)
        sub = self._w(get, f"model.layers.{i}.self_attn.")
        if cfg.is_kda(i):
            bound = cfg.linear_attn_config.get("gate_lower_bound")
            a = kda.kda_attention(x, sub, cfg.kda_heads, cfg.kda_head_dim, bound, eps, cache)
        else:
            a = attention.mla_attention(x, sub, self.mla, cache)
        partial = a if partial is None else partial + a
        h = self._mix(w, "mlp_res", snapshots, partial) if res else partial
        x = blocks.rms_norm(h, w("post_attention_layernorm.weight"), eps)
        return State(partial, snapshots), x

    def _mix(
        self, w: blocks.WeightFn, name: str, snapshots: list, partial: torch.Tensor
    ) -> torch.Tensor:
        proj, norm = w(f"{name}_proj.weight"), w(f"{name}_norm.weight")
        return attn_res_mix(snapshots, partial, proj, norm, self.cfg.rms_norm_eps)

    def _dense_mlp(self, i: int, get: Weights, x: torch.Tensor) -> torch.Tensor:
        w = self._w(get, f"model.layers.{i}.mlp.")
        mats = (w(f"{n}_proj.weight") for n in ("gate", "up", "down"))
        return blocks.glu_mlp(x, *mats, *self.act)

    def _moe(
        self, i: int, get: Weights, x: torch.Tensor, experts: ExpertSource, observer
    ) -> torch.Tensor:
        """The LatentMoE of layer i: x [N, D] -> [N, D]."""
        w = self._w(get, f"model.layers.{i}.block_sparse_moe.")
        return latent_moe(x, w, self.moe, i, experts, observer)

    def head(self, get: Weights, state: State) -> torch.Tensor:
        """Final AttnRes mix, norm and output head: -> logits [B, T, V]."""
        cfg, w = self.cfg, self._w(get, "model.")
        h = state.hidden
        if cfg.attn_res_block_size is not None:
            h = self._mix(w, "output_attn_res", state.blocks, h)
        h = blocks.rms_norm(h, w("norm.weight"), cfg.rms_norm_eps)
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        return blocks.linear(h, self._w(get, "")(name))
