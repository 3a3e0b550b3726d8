"""Kimi K3's built-in configs (`reap synth`, the size model, tests): the release's config.json
with the widths of `k3-tiny`, `k3-small` or `k3-full` (see `reap.models`)."""

from __future__ import annotations

import copy

from reap.errors import ReapError

# compressed-tensors MXFP4 as in the release: read by mlx-lm from text_config
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "group",
                "group_size": 32,
                "symmetric": True,
                "scale_dtype": "uint8",
            },
        }
    },
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*gate$",
        "re:.*mlp\\..*",
        "re:.*routed_expert_(down|up)_proj$",
        "lm_head",
    ],
}

# the widths of the built-in K3-architecture configs, side by side: key -> (k3-tiny, k3-small,
# k3-full); "kda" is (KDA heads, head width)
_K3_WIDTHS = {
    "vocab_size": (384, 16384, 163840),
    "hidden_size": (64, 768, 7168),
    "num_hidden_layers": (6, 12, 93),
    "num_attention_heads": (2, 6, 96),
    "num_key_value_heads": (2, 6, 96),
    "intermediate_size": (96, 2048, 33792),
    "kda": ((2, 32), (6, 128), (96, 128)),
    "attn_res_block_size": (2, 4, 12),
    "q_lora_rank": (32, 256, 1536),
    "kv_lora_rank": (32, 128, 512),
    "qk_nope_head_dim": (16, 64, 128),
    "qk_rope_head_dim": (16, 32, 64),
    "v_head_dim": (16, 64, 128),
    "num_experts": (16, 64, 896),
    "num_experts_per_token": (4, 8, 16),
    "num_shared_experts": (2, 2, 2),
    "moe_intermediate_size": (32, 384, 3072),
    "routed_expert_hidden_size": (32, 384, 3584),
}
BUILTIN = {
    name: {k: widths[i] for k, widths in _K3_WIDTHS.items()}
    for i, name in enumerate(("k3-tiny", "k3-small", "k3-full"))
}
# the released K3 vision_config (tests/fixtures/releases/kimi-k3/config.json), the keys
# `shared.vision` reads: MoonViT-V2, 165 tower + 3 projector tensors, 401.2 M + 46.1 M params
_VISION = {
    "attn_bias": False,
    "init_pos_emb_height": 64,
    "init_pos_emb_width": 64,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "qkv_hidden_size": 1536,
    "text_hidden_size": 7168,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
}


def builtin_config(name: str, layers: int | None = None) -> dict:
    """The full config.json dict of built-in config `name`; `layers=N` keeps the first N layers
    (the release's vision tower is only listed for the complete k3-full)."""
    if name not in BUILTIN:
        raise ReapError(f"unknown built-in config {name!r} (known: {', '.join(BUILTIN)})")
    text = _text_config(BUILTIN[name])
    n = text["num_hidden_layers"]
    if layers is not None:
        if not 1 <= layers <= n:
            raise ReapError(f"--layers must be between 1 and {n} for {name}, got {layers}")
        lac = text["linear_attn_config"]
        lac["kda_layers"] = [j for j in lac["kda_layers"] if j <= layers]
        lac["full_attn_layers"] = [j for j in lac["full_attn_layers"] if j <= layers]
        text["num_hidden_layers"] = layers
    out = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": text,
    }
    if name == "k3-full" and layers is None:
        out["vision_config"] = copy.deepcopy(_VISION)
    return out


def _text_config(b: dict) -> dict:
    n = b["num_hidden_layers"]
    # MLA at one-based positions 4, 8, ... and the last layer; KDA elsewhere (K3's rule)
    mla = sorted({j for j in range(4, n + 1, 4)} | {n})
    text = {k: v for k, v in b.items() if k != "kda"}
    text.update(
        model_type="kimi_linear",
        rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
        hidden_act="situ",
        activation_situ_beta=4.0,
        activation_situ_linear_beta=25.0,
        mla_use_nope=True,
        mla_use_output_gate=True,
        moe_router_activation_func="sigmoid",
        moe_renormalize=True,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_expert_group=1,
        topk_group=1,
        latent_moe_use_norm=True,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        bos_token_id=256,
        eos_token_id=256,
        linear_attn_config={
            "kda_layers": [j for j in range(1, n + 1) if j not in mla],
            "full_attn_layers": mla,
            "num_heads": b["kda"][0],
            "head_dim": b["kda"][1],
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
        },
        quantization_config=copy.deepcopy(QUANTIZATION_CONFIG),
    )
    return text
