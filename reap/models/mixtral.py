"""Mixtral (`model_type` mixtral): softmax top-k routed SwiGLU experts behind grouped-query RoPE
attention, read from Hugging Face checkpoints in place.

The architecture is the softmax-routed core of `reap.models.qwen3_moe` without q/k norms or dense
layers, with its own names: the MoE block is `block_sparse_moe`, expert e's matrices are
`experts.e.w1` (gate), `w3` (up) and `w2` (down); `num_local_experts` counts them; the top-k
weights are always renormalized; `sliding_window` (None by default) limits every layer's
attention. OLMoE, named like Qwen3-MoE, is served by `reap.models.qwen3_moe`.

References: transformers 5 `modeling_mixtral.py`, mlx-lm `mixtral.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from reap.checkpoint import TensorSpec
from reap.models import qwen3_moe
from reap.models.qwen3_moe import (  # noqa: F401 - family API
    Model,
    Naming,
    calibration_widths,
    chat_format,
    expert_groups,
    expert_matrices,
    expert_tensor_names,
    router_tensors,
    state_bytes,
    top_k,
)

NAMES = Naming("block_sparse_moe.", "w1.weight", "w3.weight", "w2.weight", "num_local_experts")


@dataclass
class Config(qwen3_moe.Config):
    """A Mixtral config; field names are the `config.json` names (`num_local_experts` is read
    as `num_experts`, `intermediate_size` is the expert width)."""

    names: ClassVar[Naming] = NAMES
    model_type: str = "mixtral"
    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_key_value_heads: int = 8
    intermediate_size: int = 14336
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    REQUIRED = (*qwen3_moe.HF_SHARED, ("num_local_experts", "num_experts"), "sliding_window")

    @staticmethod
    def _aliases(text: dict) -> dict:
        text = qwen3_moe.Config._aliases(text)
        text["norm_topk_prob"] = True  # Mixtral always renormalizes its top-k weights
        text.pop("moe_intermediate_size", None)
        return text

    @staticmethod
    def _window(text: dict) -> int | None:
        return text.get("sliding_window")

    @property
    def qk_norm(self) -> str | None:
        return None

    def is_moe(self, layer: int) -> bool:
        """Every Mixtral layer routes to experts."""
        return self.num_experts > 0


expert_key = NAMES.expert_key  # (layer, expert) of a routed-expert tensor name, else None


def layout(config_dict: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint (names as Hugging Face saves them)."""
    return qwen3_moe.layout_of(Config.from_dict(config_dict))


def with_experts(config_dict: dict, n_experts: int | dict[int, int]) -> dict:
    """The config with `n_experts` routed experts per layer (see `qwen3_moe.set_experts`)."""
    return qwen3_moe.set_experts(config_dict, n_experts, NAMES.expert_count_key)
