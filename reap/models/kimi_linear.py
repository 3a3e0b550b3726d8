"""Kimi Linear (`model_type` kimi_linear, e.g. moonshotai/Kimi-Linear-48B-A3B): config, checkpoint
layout and torch model. It is Kimi K3's ancestor and shares K3's pieces (`kimi_k3.family`).

Where it differs from K3 (references: transformers 5 `KimiLinearForCausalLM`, mlx-lm
`kimi_linear.py`): SiLU GLU MLPs and experts; plain per-expert tensors in the model width (no
LatentMoE, no MXFP4); a low-rank KDA output gate, unbounded decay and A_log stored [1, 1, H, 1];
plain pre-norm residuals (no AttnRes); a router that may group experts as DeepSeek-V3's does.
Configs come as released or as transformers 5 writes them; `_normalize` maps both onto `Config`.
Shapes: B batch, T tokens, N = B*T, D hidden, V vocab, E n_experts, K top_k, H KDA heads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import base, validate
from reap.models.base import ExpertSource, Observer, Weights, decoder_specs, dtype_code
from reap.models.kimi_k3 import config as kimi_k3_config
from reap.models.kimi_k3 import family as kimi_k3
from reap.models.shared import attention, blocks, kda
from reap.quant.matrix import stored_matrices as expert_matrices  # noqa: F401 - family hook

# shared with K3: same names, same meaning
expert_key = kimi_k3.expert_key
router_tensors = kimi_k3.router_tensors
top_k = kimi_k3.top_k
state_bytes = kimi_k3.state_bytes  # MLA latent KV, KDA state + conv tail; no AttnRes blocks
calibration_widths = kimi_k3.calibration_widths  # no AttnRes: no snapshots

EXPERT_TENSORS = ("w1.weight", "w2.weight", "w3.weight")  # gate, down, up: file order
_TRANSFORMERS_F32 = ("dt_bias", "gate.weight", "gate.e_score_correction_bias")
# used in fp32 whatever the compute dtype or the stored one (transformers keeps the router in
# fp32 too): cast to fp32 when read
_KEEP_F32 = {"A_log", "dt_bias", "gate.weight", "gate.e_score_correction_bias"}
# stored fp32 in a bf16 checkpoint: the release keeps the KDA decay in fp32 (its router, bias,
# convolutions and norms in the checkpoint's dtype); transformers 5 writes its keep-in-fp32
# modules (dt_bias and the router) in fp32 and A_log in the checkpoint's dtype
_STORED_F32 = {"release": ("A_log", "dt_bias"), "transformers": _TRANSFORMERS_F32}
# binding accepts either dtype for these (both layouts exist; `_w` casts them to fp32)
READ_DTYPES = {n: frozenset({"BF16", "F16", "F32"}) for n in ("A_log", *_TRANSFORMERS_F32)}


@dataclass
class Config(kimi_k3.Config):
    """A Kimi Linear text config; field names are the `config.json` names (K3's, plus the
    per-layer type lists transformers 5 writes)."""

    hidden_act: str = "silu"
    layer_types: list | None = None  # "linear_attention" (KDA) | "full_attention" (MLA)
    mlp_layer_types: list | None = None  # "dense" | "sparse"
    REQUIRED = kimi_k3_config.LINEAR_REQUIRED  # every release and transformers 5 write these

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From a released or a transformers-written config.json; unknown keys ignored."""
        text = validate.text_of(d)
        cls.validate(text)  # before normalizing: its layer lists are sized by the config
        return super().from_dict(_normalize(text))

    def _check(self) -> None:
        unsupported = []
        if self.hidden_act != "silu":
            unsupported.append(f"hidden_act={self.hidden_act!r}")
        if self.moe_router_activation_func != "sigmoid":
            unsupported.append(f"moe_router_activation_func={self.moe_router_activation_func!r}")
        E, G = self.num_experts, self.num_expert_group
        if E % G or not 1 <= self.topk_group <= G:
            unsupported.append(f"{E} experts in num_expert_group={G}, topk_group={self.topk_group}")
        if not self.mla_use_nope:
            unsupported.append("RoPE MLA (mla_use_nope false)")
        if self.linear_attn_config.get("use_full_rank_gate", False):
            unsupported.append("full-rank KDA output gate")
        if self.num_experts_per_layer:
            unsupported.append("per-layer expert counts")
        if unsupported:
            raise ReapError(f"kimi_linear config: unsupported {', '.join(unsupported)}")

    def is_moe(self, layer: int) -> bool:
        """Whether decoder layer `layer` is an MoE layer (else the dense MLP)."""
        if self.mlp_layer_types is not None:
            return self.num_experts > 0 and self.mlp_layer_types[layer] == "sparse"
        return super().is_moe(layer)

    @property
    def dense_prefix(self) -> str:
        """Where a dense layer's MLP is stored: `mlp.` as released; transformers 5 saves it under
        the MoE block's name (its save renames every `.mlp.`) and writes `mlp_layer_types`."""
        return "mlp." if self.mlp_layer_types is None else "block_sparse_moe."


def _normalize(text: dict) -> dict:
    """The text config in `Config`'s names: `dtype` -> `torch_dtype`; transformers' `linear_*`
    fields and `layer_types` (which win over the release's kda_layers, as in transformers) fill
    `linear_attn_config` (defaults as transformers': MLA at zero-based layers 4, 8, ...)."""
    t = dict(text)
    t.setdefault("torch_dtype", t.get("dtype", "bfloat16"))
    lac = dict(t.get("linear_attn_config") or {})
    for key, alias, default in (
        ("num_heads", "linear_num_heads", 32),
        ("head_dim", "linear_head_dim", 128),
        ("short_conv_kernel_size", "linear_conv_kernel_dim", 4),
    ):
        lac.setdefault(key, t.get(alias, default))
    types = t.get("layer_types")
    if types is None and "kda_layers" not in lac:
        n = t.get("num_hidden_layers", Config.num_hidden_layers)
        types = ["full_attention" if i % 4 == 0 and i else "linear_attention" for i in range(n)]
    if types is not None:
        lac["kda_layers"] = [i + 1 for i, k in enumerate(types) if k == "linear_attention"]
        lac["full_attn_layers"] = [i + 1 for i, k in enumerate(types) if k != "linear_attention"]
    t["linear_attn_config"] = lac
    return t


def sanitize(name: str, t: torch.Tensor) -> torch.Tensor:
    """A stored tensor in the form the shared blocks take (the one place they differ): KDA's
    A_log is stored [1, 1, H, 1], `kda_attention` takes [H]."""
    return t.reshape(-1) if name == "A_log" else t


# -- layout ------------------------------------------------------------------------------------
def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint in file order (names without any prefix); dtypes as the
    writer of its config stores them (`_STORED_F32`): a released config (no `mlp_layer_types`)
    the release's, one transformers 5 wrote transformers'. Binding also accepts the other
    writer's dtype for those tensors (`READ_DTYPES`)."""
    cfg = Config.from_dict(config_dict)
    fdt = dtype_code(cfg.torch_dtype)
    f32 = _STORED_F32["release" if cfg.mlp_layer_types is None else "transformers"]
    return decoder_specs(cfg, fdt, lambda i: _layer_specs(cfg, i, fdt, f32), kimi_k3.ROLES)


def _layer_specs(cfg: Config, i: int, fdt: str, f32: tuple[str, ...]) -> list[TensorSpec]:
    D, p = cfg.hidden_size, f"model.layers.{i}."

    def t(name, shape, comp, dtype=None):
        dtype = dtype or ("F32" if name.endswith(f32) else fdt)
        return TensorSpec(p + name, dtype, tuple(shape), comp, i)

    out = [t("input_layernorm.weight", (D,), "norms")]
    mla = attention.MLADims.from_config(cfg)
    out += _kda_specs(cfg, t) if cfg.is_kda(i) else mla.specs(t, D)
    out.append(t("post_attention_layernorm.weight", (D,), "norms"))
    if not cfg.is_moe(i):
        return out + kimi_k3._mlp_specs(t, cfg.dense_prefix, D, cfg.intermediate_size, "dense_mlp")
    m, E = "block_sparse_moe.", cfg.experts_in(i)
    out += [
        t(m + "gate.weight", (E, D), "router"),
        t(m + "gate.e_score_correction_bias", (E,), "router"),
    ]
    if cfg.num_shared_experts:
        F = cfg.moe_intermediate_size * cfg.num_shared_experts
        out += kimi_k3._mlp_specs(t, m + "shared_experts.", D, F, "shared_experts")
    for e in range(E):
        out += expert_specs(cfg, i, e)
    return out


def _kda_specs(cfg: Config, t) -> list[TensorSpec]:
    D, H, Dk = cfg.hidden_size, cfg.kda_heads, cfg.kda_head_dim
    P, k, a = H * Dk, cfg.linear_attn_config["short_conv_kernel_size"], "self_attn."
    out = [t(a + f"{n}_proj.weight", (P, D), "kda") for n in "qkv"]
    out += [t(a + f"{n}_conv1d.weight", (P, 1, k), "kda") for n in "qkv"]
    shapes = {
        "f_a_proj.weight": (Dk, D),
        "f_b_proj.weight": (P, Dk),
        "b_proj.weight": (H, D),
        "g_a_proj.weight": (Dk, D),
        "g_b_proj.weight": (P, Dk),
        "A_log": (1, 1, H, 1),
        "dt_bias": (P,),
        "o_norm.weight": (Dk,),
        "o_proj.weight": (D, P),
    }
    return out + [t(a + n, s, "kda") for n, s in shapes.items()]


def expert_specs(cfg: Config, layer: int, expert: int) -> list[TensorSpec]:
    """The three tensors of one routed expert, in file order (w1 gate, w2 down, w3 up)."""
    D, F = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = ((F, D), (D, F), (F, D))  # [out, in]
    names = expert_tensor_names(cfg, layer, expert)
    return [
        TensorSpec(n, dtype_code(cfg.torch_dtype), s, "routed_experts", layer, expert)
        for n, s in zip(names, shapes)
    ]


def expert_tensor_names(cfg: Config | None, layer: int, expert: int) -> list[str]:
    """The tensor names of routed expert `expert` of `layer`, file order (any config)."""
    p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    return [p + s for s in EXPERT_TENSORS]


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts in every MoE layer (top_k capped at it). The
    config has one `num_experts` for all layers, so differing per-layer counts are refused, as
    are counts that break the expert groups (kept experts regroup in ascending original id)."""
    n = base.one_count(n_experts)
    out = kimi_k3.with_experts(config_dict, n)
    text = out.get("text_config", out)
    G = int(text.get("num_expert_group", 1))
    if n % G or int(text.get("topk_group", 1)) * (n // G) < text["num_experts_per_token"]:
        raise ReapError(
            f"kimi_linear: {n} experts do not fill num_expert_group={G} groups with top_k "
            "experts left in the best topk_group groups"
        )
    return out


def expert_groups(config_dict: dict) -> int:
    """Routing groups (`num_expert_group`): a plan keeps as many experts in each."""
    return int(config_dict.get("text_config", config_dict).get("num_expert_group") or 1)


chat_format = base.own_template  # the checkpoints ship their chat template


# -- the model ---------------------------------------------------------------------------------
def _expert(x: torch.Tensor, t) -> torch.Tensor:
    """One routed expert on its tokens: x [M, D] -> [M, D]."""
    gate, up, down = (t[f"{n}.weight"].to(x.device) for n in ("w1", "w3", "w2"))
    return blocks.silu_glu(x, gate, up, down)


def sparse_moe(
    x: torch.Tensor,
    w: blocks.WeightFn,
    cfg: Config,
    layer: int,
    experts: ExpertSource,
    observer: Observer | None = None,
) -> torch.Tensor:
    """Kimi Linear's MoE on x [N, D] -> [N, D]: fp32 sigmoid router with correction bias, the
    routed SiLU GLU experts expert-major, plus the shared experts. Experts work in the model
    width, so a MoERecord's model_norm is the norm of the expert's own output."""
    logits = blocks.linear(x.float(), w("gate.weight").float())  # [N, E]
    bias = w("gate.e_score_correction_bias")
    groups = (cfg.num_expert_group, cfg.topk_group)
    k, scale = cfg.num_experts_per_token, cfg.routed_scaling_factor
    ids, weights, probs = blocks.grouped_route(logits, bias, k, *groups, scale, cfg.moe_renormalize)
    y = blocks.model_width_experts(x, ids, weights, probs, layer, experts, _expert, observer)
    y = y.to(x.dtype)
    if cfg.num_shared_experts:
        shared = (w(f"shared_experts.{n}_proj.weight") for n in ("gate", "up", "down"))
        y = y + blocks.silu_glu(x, *shared)
    return y


class Model(kimi_k3.Model):
    """Kimi Linear text model; holds no weights (see `reap.models.base` for the protocol).
    Compute runs in `dtype`; the KDA decay and state, router and norms are fp32."""

    def _w(self, get: Weights, prefix: str) -> blocks.WeightFn:
        def w(name: str) -> torch.Tensor:
            t = sanitize(name, get(prefix + name))
            if not t.is_floating_point():
                return t.to(self.device)
            return t.to(self.device, torch.float32 if name in _KEEP_F32 else self.dtype)

        return w

    attn_block = blocks.PreNormModel.attn_block  # plain pre-norm residual, no AttnRes
    expert_tensor_names = staticmethod(expert_tensor_names)

    def _attention(self, i: int, get: Weights, x: torch.Tensor, cache) -> torch.Tensor:
        """KDA or NoPE MLA of layer i: x [B, T, D] -> [B, T, D]."""
        cfg, sub = self.cfg, self._w(get, f"model.layers.{i}.self_attn.")
        if cfg.is_kda(i):
            H, Dk, eps = cfg.kda_heads, cfg.kda_head_dim, cfg.rms_norm_eps
            return kda.kda_attention(x, sub, H, Dk, None, eps, cache, low_rank_gate=True)
        return attention.mla_attention(x, sub, self.mla, cache)

    def _dense_mlp(self, i: int, get: Weights, x: torch.Tensor) -> torch.Tensor:
        w = self._w(get, f"model.layers.{i}.{self.cfg.dense_prefix}")
        return blocks.silu_glu(x, *(w(f"{n}_proj.weight") for n in ("gate", "up", "down")))

    def _moe(
        self, i: int, get: Weights, x: torch.Tensor, experts: ExpertSource, observer
    ) -> torch.Tensor:
        """The sparse MoE of layer i: x [N, D] -> [N, D]."""
        w = self._w(get, f"model.layers.{i}.block_sparse_moe.")
        return sparse_moe(x, w, self.cfg, i, experts, observer)
