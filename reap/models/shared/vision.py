"""The Kimi vision tower (MoonViT) and its projector, as the releases store them: tensors the
text model never reads, listed so that binding recognises them, sizes count them and `reap
prune` copies them byte for byte (component "vision", stored without the `language_model.`
prefix). Read from the release's own `vision_config` keys. Two projector types are released:
"patchmerger" (K2.5: a LayerNorm on the merged patches before two biased linears) and
"patchmergerv2" (K3: two linears, then an RMSNorm at the text width). Shapes: W tower width,
M MLP width, Q attention width, P patch side, C merged patch width, D text width.
"""

from __future__ import annotations

from collections.abc import Mapping

from reap.checkpoint import TensorSpec
from reap.models.validate import MAX_LAYERS, MAX_WIDTH, ConfigError, need_int

# keys with no safe default: every released vision_config carries them
_REQUIRED = ("vt_hidden_size", "vt_num_hidden_layers", "vt_intermediate_size", "patch_size")
_SIZES = ("vt_num_attention_heads", "qkv_hidden_size", "mm_hidden_size", "text_hidden_size")
_SIZES += ("init_pos_emb_height", "init_pos_emb_width")
PROJECTORS = ("patchmerger", "patchmergerv2")


def check(vision: object) -> None:
    """ConfigError (exit 2) naming `vision_config.KEY` for a vision config this module cannot
    lay out: not an object, a required key missing, a size not a positive int, an unknown
    projector type or a merge kernel that is not two positive ints."""
    if not isinstance(vision, Mapping):
        raise ConfigError("vision_config", f"must be a JSON object (got {type(vision).__name__})")
    for key in _REQUIRED + _SIZES:
        if vision.get(key) is None and key in _REQUIRED:
            raise ConfigError(f"vision_config.{key}", "is missing")
        try:
            need_int(vision, key, 1, MAX_LAYERS if key == "vt_num_hidden_layers" else MAX_WIDTH)
        except ConfigError as e:
            raise ConfigError(f"vision_config.{key}", e.detail) from None
    kind = vision.get("mm_projector_type", "patchmerger")
    if kind not in PROJECTORS:
        raise ConfigError(
            "vision_config.mm_projector_type",
            f"must be one of {', '.join(PROJECTORS)} (got {kind!r})",
        )
    kernel = vision.get("merge_kernel_size", [2, 2])
    if not (
        isinstance(kernel, list)
        and len(kernel) == 2
        and all(isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= 64 for k in kernel)
    ):
        raise ConfigError(
            "vision_config.merge_kernel_size", f"must be two ints 1..64 (got {kernel!r})"
        )


def vision_specs(vision: Mapping, dtype: str, text_hidden: int | None = None) -> list[TensorSpec]:
    """Every tensor of the tower and projector (component "vision"), tower first; `dtype` the
    checkpoint's float dtype code; `text_hidden` the text width when the config omits it."""
    check(vision)
    return _tower(vision, dtype) + _projector(vision, dtype, text_hidden)


def _tower(v: Mapping, dtype: str) -> list[TensorSpec]:
    W, M, P = v["vt_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    Q = v.get("qkv_hidden_size") or W
    rms = v.get("norm_type") == "rmsnorm"
    lin_bias, attn_bias = v.get("linear_bias", True), v.get("attn_bias", True)
    pos = (v.get("init_pos_emb_height", 64), v.get("init_pos_emb_width", 64), W)
    p = "vision_tower."
    out = _linear(p + "patch_embed.proj", (W, 3, P, P), v.get("patch_embed_proj_bias", True))
    out.append((p + "patch_embed.pos_emb.weight", pos))
    for b in range(v["vt_num_hidden_layers"]):
        q = f"{p}encoder.blocks.{b}."
        out += _norm(q + "norm0", W, rms) + _norm(q + "norm1", W, rms)
        out += _linear(q + "wqkv", (3 * Q, W), attn_bias) + _linear(q + "wo", (W, Q), attn_bias)
        out += _linear(q + "mlp.fc0", (M, W), lin_bias) + _linear(q + "mlp.fc1", (W, M), lin_bias)
    out += _norm(p + "encoder.final_layernorm", W, rms)
    return [TensorSpec(n, dtype, s, "vision") for n, s in out]


def _projector(v: Mapping, dtype: str, text_hidden: int | None) -> list[TensorSpec]:
    kh, kw = v.get("merge_kernel_size", [2, 2])
    mm = v.get("mm_hidden_size") or v["vt_hidden_size"]
    C, D = mm * kh * kw, v.get("text_hidden_size") or text_hidden
    if D is None:
        raise ConfigError("vision_config.text_hidden_size", "is missing")
    p = "mm_projector."
    if v.get("mm_projector_type", "patchmerger") == "patchmergerv2":
        bias = v.get("linear_bias", True)
        out = _linear(p + "proj.0", (C, C), bias) + _linear(p + "proj.2", (D, C), bias)
        out += _norm(p + "post_norm", D, rms=True)
    else:
        out = _norm(p + "pre_norm", mm, rms=False)
        out += _linear(p + "proj.0", (C, C), True) + _linear(p + "proj.2", (D, C), True)
    return [TensorSpec(n, dtype, s, "vision") for n, s in out]


def _linear(name: str, shape: tuple[int, ...], bias: bool) -> list[tuple[str, tuple]]:
    return [(name + ".weight", shape)] + ([(name + ".bias", shape[:1])] if bias else [])


def _norm(name: str, width: int, rms: bool) -> list[tuple[str, tuple]]:
    return [(name + ".weight", (width,))] + ([] if rms else [(name + ".bias", (width,))])


def tiny_config(text_hidden: int, projector: str = "patchmergerv2") -> dict:
    """A small `vision_config` in the release's keys (K3's MoonViT-V2 settings, or K2.5's with
    `projector="patchmerger"`) for tiny test checkpoints (`reap synth --vision`)."""
    v2 = projector == "patchmergerv2"
    out = {
        "init_pos_emb_height": 4,
        "init_pos_emb_width": 4,
        "merge_kernel_size": [2, 2],
        "mm_hidden_size": 16,
        "mm_projector_type": projector,
        "patch_size": 2,
        "text_hidden_size": text_hidden,
        "vt_hidden_size": 16,
        "vt_intermediate_size": 32,
        "vt_num_attention_heads": 2,
        "vt_num_hidden_layers": 2,
    }
    if v2:
        out.update(attn_bias=False, linear_bias=False, norm_type="rmsnorm", qkv_hidden_size=24)
        out.update(patch_embed_proj_bias=False)
    return out


def with_tiny_vision(config: dict) -> dict:
    """`config` with a `tiny_config` vision tower added when it has none: K2.5's projector for
    a kimi_k25 config, K3's otherwise (a family without a vision tower ignores it)."""
    if config.get("vision_config") is not None:
        return config
    text = config.get("text_config", config)
    kind = "patchmerger" if config.get("model_type") == "kimi_k25" else "patchmergerv2"
    return {**config, "vision_config": tiny_config(text["hidden_size"], kind)}
