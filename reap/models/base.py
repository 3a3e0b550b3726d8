"""Contracts between model families and the stages that drive them (calibrate, engine, eval).

Every family module under `reap.models` (one file each, e.g. `kimi_k3.py`) provides:

- `Config` dataclass whose field names are the `config.json` names, `Config.from_dict(d)`;
- `layout(config_dict) -> list[TensorSpec]`: every tensor of the released checkpoint layout, in
  file order, names without any `language_model.` prefix, tagged with component/layer/expert;
- `expert_key(name) -> (layer, expert) | None`, `router_tensors(cfg, layer) -> {name: axis}`
  (tensors sliced along the expert axis when pruning) and `with_experts(config_dict, n) -> dict`;
- `state_bytes(cfg, act_bytes)`: the engine's per-sequence cache and activation sizes (see
  `reap.engine.binding.state_costs` for the four numbers);
- `Model(cfg)`: holds no weights. Weights are pulled by name through a `Weights` getter, so the
  same code runs fully in memory (tests, the reference forward) and one layer at a time with
  weights streamed from disk (calibration, the engine).

Driving a model layer by layer (shapes: B batch, T tokens, D hidden, V vocab):

    state = model.embed(get, ids)                      # ids [B, T] -> State
    for i in range(model.n_layers):
        state, x = model.attn_block(i, get, state, cache=caches[i])  # x [B, T, D], MLP input
        y = model.mlp_block(i, get, x, experts=experts, observer=observer)  # [B, T, D]
        state = model.finish_layer(i, state, y)
    logits = model.head(get, state)                    # [B, T, V]

`model.forward(get, ids, caches=None, experts=None, observer=None)` is that loop. MoE layers
dispatch expert-major: experts in ascending id order, each run once on all of its tokens, its
weights fetched by `experts(layer, expert)`; weighted outputs are accumulated in that fixed order so
results do not depend on caching or memory budgets.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch

from reap.checkpoint.spec import split_view

# (layer, expert) -> that expert's tensors by short name, e.g. "w1.weight_packed", "w1.weight_scale".
# A source may also have `prefetch(layer, expert_ids)`: MoE layers call it with every expert they
# are about to use (ascending ids) once routing is known, before the first fetch.
ExpertSource = Callable[[int, int], Mapping[str, torch.Tensor]]

# name (without prefix) -> tensor; raises reap.errors.CheckpointError for unknown names.
Weights = Callable[[str], torch.Tensor]


def decoder_specs(cfg, dtype: str, layer_specs: Callable[[int], list]) -> list:
    """The TensorSpecs of a decoder-only layout in order: `model.embed_tokens.weight`, each
    layer's `layer_specs(i)`, `model.norm.weight`, then `lm_head.weight` unless the config ties
    it (`cfg`: hidden_size, vocab_size, num_hidden_layers, tie_word_embeddings)."""
    from reap.checkpoint import TensorSpec

    D, V = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (V, D), "embed_head")]
    for i in range(cfg.num_hidden_layers):
        specs += layer_specs(i)
    specs.append(TensorSpec("model.norm.weight", dtype, (D,), "norms"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", dtype, (V, D), "embed_head"))
    return specs


_VARIANTS: dict[tuple[str, str], ModuleType] = {}


def storage_variant(module: str, name: str, **functions: Callable) -> ModuleType:
    """Family module `module` (its __name__) as seen for one storage of its experts (e.g. "fp8",
    "mxfp4"): a cached copy with `functions` (e.g. expert_tensor_names) replaced. For families
    whose tensor names depend on how a checkpoint stores its experts; `family()` returns it."""
    key = (module, name)
    if key not in _VARIANTS:
        source = sys.modules[module]
        twin = ModuleType(f"{module}.{name}", source.__doc__)
        twin.__dict__.update({k: v for k, v in vars(source).items() if not k.startswith("__")})
        twin.__dict__.update(functions)
        _VARIANTS[key] = twin
    return _VARIANTS[key]


def dtype_code(torch_dtype: str | None) -> str:
    """The safetensors dtype code of a config's `torch_dtype` / `dtype` (default BF16)."""
    codes = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
    return codes.get(torch_dtype or "bfloat16", "BF16")


@dataclass
class State:
    """The residual stream between layers, everything a later layer needs (spillable with `to`).

    `hidden` [B, T, D]: the residual stream; for AttnRes families the running partial sum of the
    current block. `blocks`: AttnRes block snapshots, oldest first, each [B, T, D] (empty for a
    plain residual stream).
    """

    hidden: torch.Tensor
    blocks: list[torch.Tensor] = field(default_factory=list)

    def to(self, device: str | torch.device) -> State:
        """A copy on `device` (e.g. "cpu" to spill between layers)."""
        return State(self.hidden.to(device), [b.to(device) for b in self.blocks])


@dataclass
class MoERecord:
    """What one MoE layer did to N tokens (N = B*T, row-major over [B, T]); K = top_k.

    `model_norm[n, k]` is the norm of expert k's contribution to the layer output divided by its
    routing weight (for LatentMoE: after the routed-expert norm's per-token scale and the shared
    up-projection), so REAP saliency = mean over routed tokens of weights * model_norm.
    Norm fields are None unless the observer sets `wants_norms`.
    """

    layer: int
    ids: torch.Tensor  # [N, K] int64 routed expert ids
    weights: torch.Tensor  # [N, K] float32 routing weights (renormalized, times scaling factor)
    probs: torch.Tensor  # [N, E] float32 router scores (sigmoid before any bias, or softmax)
    latent_norm: torch.Tensor | None = None  # [N, K] ||expert output|| in the expert space
    model_norm: torch.Tensor | None = None  # [N, K] ||contribution|| / weight, model space
    max_act: torch.Tensor | None = None  # [N, K] max |expert output| (expert space)


class Observer(Protocol):
    """Receives each MoE layer's routing (and optional per-expert output norms)."""

    wants_norms: bool

    def on_moe(self, record: MoERecord) -> None: ...


def expert_short_names(names: list[str]) -> list[str]:
    """Short names of one expert's tensors (`expert_tensor_names` order): each name after the
    prefix the names share up to a dot, with a fused view's `[e]` dropped, e.g.
    "...experts.7.w1.weight_packed" -> "w1.weight_packed", "...experts.down_proj[7]" -> "down_proj"."""
    bases = [split_view(n)[0] for n in names]
    prefix = os.path.commonprefix(bases)
    cut = prefix.rfind(".") + 1
    return [b[cut:] for b in bases]


def dict_weights(tensors: Mapping[str, torch.Tensor]) -> Weights:
    """A strict getter over an in-memory dict (prefix-free names)."""
    from reap.errors import CheckpointError

    def get(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is missing from the weights") from None

    return get


class LayerModel:
    """The whole-model loop over the layer-at-a-time protocol; families subclass it and
    implement `embed`, `attn_block`, `mlp_block` and `head` (plain residual `finish_layer`)."""

    n_layers: int

    def finish_layer(self, i: int, state: State, y: torch.Tensor) -> State:
        """Add the MLP output y [B, T, D] to the residual stream."""
        return State(state.hidden + y, state.blocks)

    def forward(
        self,
        get: Weights,
        ids: torch.Tensor,
        caches: list | None = None,
        experts: ExpertSource | None = None,
        observer: Observer | None = None,
    ) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V]; with caches, decoding continues from them."""
        state = self.embed(get, ids)
        for i in range(self.n_layers):
            state, x = self.attn_block(i, get, state, None if caches is None else caches[i])
            state = self.finish_layer(i, state, self.mlp_block(i, get, x, experts, observer))
        return self.head(get, state)


@dataclass(frozen=True)
class ChatFormat:
    """A family's built-in chat format, for checkpoints that ship no chat template: the marker
    opening each role's turn, the one closing every turn, and the reasoning-block delimiters
    (rendered by `reap.serve.chat.render_markers`). A family module's `chat_format(config_dict)`
    returns one, or None when the checkpoint's own tokenizer chat template must be used."""

    system: str
    user: str
    assistant: str
    end: str
    think_open: str
    think_close: str
