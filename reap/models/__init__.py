"""Model families and built-in configs.

`family(config_dict)` returns the module that implements a checkpoint's architecture, registered
in FAMILIES and checked against the contract `reap.models.base.Family` when first loaded.
`builtin_config(name)` (`kimi_k3/builtin.py`) returns a full config.json dict for the built-in
K3-architecture configs used by tests, `reap synth` and the size model:

- `k3-tiny`: every code path (dense layer 0, KDA and MLA layers, several AttnRes blocks, LatentMoE
  with norm, shared experts, top-k > 1), widths of 32-64: a forward takes milliseconds.
- `k3-small`: the same at widths of a few hundred; ~0.3 GB on disk.
- `k3-full`: the published Kimi K3 widths (~1.56 TB); `layers=N` keeps the first N layers.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

from reap.models.kimi_k3.builtin import BUILTIN, QUANTIZATION_CONFIG, builtin_config  # noqa: F401

# model_type (top level, or of a bare text config) -> family module
FAMILIES = {
    "kimi_k3": "reap.models.kimi_k3.family",
    "kimi_linear": "reap.models.kimi_linear",
    "deepseek_v3": "reap.models.deepseek_v3.family",
    "kimi_k2": "reap.models.deepseek_v3.family",
    "kimi_k25": "reap.models.deepseek_v3.kimi_k25",  # DeepSeek-V3 text model + MoonViT (K2.5-style)
    "qwen3_moe": "reap.models.qwen3_moe",
    "mixtral": "reap.models.mixtral",
    "olmoe": "reap.models.qwen3_moe",  # named like Qwen3-MoE (mlp.experts.E.*_proj)
    "gpt_oss": "reap.models.gpt_oss",
}


def family(config_dict: dict) -> ModuleType:
    """The family module implementing this config.json (dispatch on `model_type`; a kimi_linear
    text config with K3-only fields, as a bare K3 `text_config` is, goes to kimi_k3)."""
    from reap.models.validate import ConfigError, text_of

    text = text_of(config_dict)  # ConfigError unless JSON objects
    mt = config_dict.get("model_type") or text.get("model_type")
    if mt == "kimi_linear" and _is_k3_text(text):
        mt = "kimi_k3"
    if not isinstance(mt, str) or mt not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise ConfigError("model_type", f"unsupported model_type {mt!r} (supported: {known})")
    return load_family(FAMILIES[mt])


def load_config(config: dict, path: str | os.PathLike):
    """(family module, validated Config) of the config.json dict of the checkpoint at `path`;
    any `ConfigError` names that file."""
    from reap.models.validate import ConfigError, config_source

    try:
        fam = family(config)
        return fam, fam.Config.from_dict(config)
    except ConfigError as e:
        raise e.at(config_source(path)) from None


@functools.cache
def load_family(module: str) -> ModuleType:
    """The family module `module` (a FAMILIES value), checked once against the contract
    (TypeError naming what a family lacks)."""
    from reap.models.base import check_family

    return check_family(importlib.import_module(module))


def _is_k3_text(text: dict) -> bool:
    """Whether a kimi_linear text config is K3's: LatentMoE, AttnRes or the SiTU activation."""
    k3_only = ("routed_expert_hidden_size", "attn_res_block_size", "activation_situ_beta")
    return any(text.get(k) is not None for k in k3_only) or text.get("hidden_act") == "situ"
