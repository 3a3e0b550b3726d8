"""The value rules of a Kimi K3 / Kimi Linear text config (types come from the `Config`
dataclass through `reap.models.validate.check_fields`; these are the ranges and the keys with
no safe default). Called by `kimi_k3.Config.from_dict` before any field is used."""

from __future__ import annotations

from collections.abc import Mapping

from reap.models.validate import (
    HF_REQUIRED,
    MAX_EXPERTS,
    MAX_LAYERS,
    ConfigError,
    need_hf,
    need_int,
    need_int_list,
    need_str_list,
)

# no safe default: every Kimi Linear release (and transformers 5) writes these...
LINEAR_REQUIRED = (*HF_REQUIRED, "num_key_value_heads", "intermediate_size", "hidden_act")
LINEAR_REQUIRED += ("num_experts", "num_experts_per_token", "num_shared_experts", "topk_group")
LINEAR_REQUIRED += ("moe_intermediate_size", "moe_renormalize", "routed_scaling_factor")
LINEAR_REQUIRED += ("num_expert_group", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim")
LINEAR_REQUIRED += ("qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "tie_word_embeddings")
# ... and every K3 release these too
REQUIRED = (*LINEAR_REQUIRED, "activation_situ_beta", "activation_situ_linear_beta")
REQUIRED += ("attn_res_block_size", "first_k_dense_replace", "latent_moe_use_norm")
REQUIRED += ("linear_attn_config", "mla_use_nope", "mla_use_output_gate", "moe_layer_freq")
REQUIRED += ("moe_router_activation_func", "routed_expert_hidden_size")


def check_text(text: Mapping) -> None:
    """Raise ConfigError for the first out-of-range value of a K3 / Kimi Linear text config
    (after `check_fields` has checked the types)."""
    widths = ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
    need_hf(text, "num_experts", "num_experts_per_token", widths)  # sizes, experts, eps, scale
    n = text.get("num_hidden_layers") or 1
    need_int(text, "moe_layer_freq", 1, MAX_LAYERS)
    need_int(text, "first_k_dense_replace", 0, MAX_LAYERS)
    need_int(text, "attn_res_block_size", 1, MAX_LAYERS)
    need_int(text, "num_expert_group", 1, MAX_EXPERTS)
    need_int(text, "topk_group", 1, MAX_EXPERTS)
    need_int(text, "num_shared_experts", 0, MAX_EXPERTS)
    for name in ("layer_types", "mlp_layer_types"):
        choices = ("linear_attention", "full_attention") if name == "layer_types" else ()
        need_str_list(text, name, choices or ("dense", "sparse"), n)
    _check_per_layer(text, n)
    lac = text.get("linear_attn_config") or {}
    for key in ("num_heads", "head_dim", "short_conv_kernel_size"):
        _nested(need_int, lac, key, 1, 1 << 16)
    for key in ("kda_layers", "full_attn_layers"):
        _nested(need_int_list, lac, key, 1, n, "num_hidden_layers")


def _nested(check, lac: Mapping, key: str, *args) -> None:
    try:
        check(lac, key, *args)
    except ConfigError as e:
        raise ConfigError(f"linear_attn_config.{key}", e.detail) from None


def _check_per_layer(text: Mapping, n_layers: int) -> None:
    """`num_experts_per_layer` (reap's extension): {"layer": count}, layers in range, each
    count in top_k..num_experts."""
    counts = text.get("num_experts_per_layer")
    if not counts:
        return
    name, k, most = "num_experts_per_layer", text["num_experts_per_token"], text["num_experts"]
    if len(counts) > n_layers:
        raise ConfigError(name, f"lists {len(counts)} layers, the model has {n_layers}")
    for layer, count in counts.items():
        if not (layer.isdigit() and int(layer) < n_layers):
            raise ConfigError(name, f"keys must be layers 0..{n_layers - 1} (got {layer!r})")
        need_int({name: count}, name, k, most)
