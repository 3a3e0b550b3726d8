"""Kimi K2.5-style releases (`model_type` kimi_k25, e.g. moonshotai/Kimi-K2.5): a DeepSeek-V3 /
Kimi K2 text model under `text_config` with a MoonViT vision tower and projector beside it.

The text model is `deepseek_v3.family` unchanged (its `language_model.` prefix is stripped by
the checkpoint layer); the tower and projector are `reap.models.shared.vision`'s. Reference for the text path: mlx-lm 0.32.2
`models/kimi_k25.py` (a DeepSeek-V3 language model; sanitize drops the vision tensors)."""

from __future__ import annotations

from dataclasses import dataclass

from reap.checkpoint import TensorSpec
from reap.models import base
from reap.models.base import dtype_code
from reap.models.deepseek_v3 import family as deepseek_v3
from reap.models.deepseek_v3.family import (  # noqa: F401 - family hooks, the text model's
    Model,
    calibration_widths,
    expert_groups,
    expert_key,
    expert_matrices,
    expert_tensor_names,
    router_tensors,
    state_bytes,
    top_k,
    with_experts,
)
from reap.models.shared import vision

chat_format = base.own_template  # the release ships its chat template


@dataclass
class Config(deepseek_v3.Config):
    """The text config of a kimi_k25 checkpoint (DeepSeek-V3's fields, from `text_config`)."""

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """From the release's config.json: `text_config` as DeepSeek-V3's; a `vision_config`
        must be one `reap.models.shared.vision` can lay out (ConfigError naming its key)."""
        if isinstance(d, dict) and d.get("vision_config") is not None:
            vision.check(d["vision_config"])
        return super().from_dict(_as_released(d))


def _as_released(config_dict: dict) -> dict:
    """The config with its text dtype named `torch_dtype`: the release stores its router in the
    checkpoint's dtype whichever key names it (`deepseek_v3` reads a bare `dtype` as a config
    transformers 5 wrote, whose DeepSeek-V3 save keeps the router in fp32)."""
    text = config_dict.get("text_config")
    if not isinstance(text, dict) or "torch_dtype" in text or "dtype" not in text:
        return config_dict
    return {**config_dict, "text_config": {**text, "torch_dtype": text["dtype"]}}


def layout(config_dict: dict) -> list[TensorSpec]:
    """The text model's tensors (DeepSeek-V3's layout of `text_config`, names without the
    `language_model.` prefix), then the vision tower and projector when configured."""
    cfg = Config.from_dict(config_dict)
    specs = deepseek_v3.layout(_as_released(config_dict))
    v = config_dict.get("vision_config")
    if v is None:
        return specs
    return specs + vision.vision_specs(v, dtype_code(cfg.torch_dtype), cfg.hidden_size)
