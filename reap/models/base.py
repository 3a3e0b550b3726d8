"""The family contract: what every model family module provides, and the layer-by-layer protocol.

Each family is one module under `reap.models` (registered in `FAMILIES`) implementing `Family`
below; `check_family` refuses it (TypeError) when first loaded if it lacks a member or a hook
cannot take the contract's arguments. Stages ask the family; none reads its config fields or
tensor names (the structure test checks this outside `models/`, `checkpoint/` and `quant/`):

- `Config`: a dataclass whose field names are the `config.json` names; `Config.from_dict(d)` is
  where a config is validated, once for every command (`reap.models.validate`; exit 2);
- `Model(cfg, device, dtype)`: a `LayerModel` holding no weights (the driving protocol below);
- `layout(config_dict)`: every tensor of the released layout in file order, names without any
  `language_model.` prefix, tagged with component, layer, expert and role;
- `expert_key`, `expert_tensor_names`, `router_tensors` (sliced along the expert axis when
  pruning), `with_experts`, `expert_groups` (1 for ungrouped routers), `top_k`;
- `state_bytes` (see `reap.engine.binding.state_costs`), `calibration_widths`;
- `expert_matrices(tensors)`: one routed expert's stored tensors as the weights its code
  multiplies by (`reap.quant.matrix`);
- `chat_format(config_dict)`: the built-in chat markers, or None (the checkpoint's template).

Driving a model layer by layer (shapes: B batch, T tokens, D hidden, V vocab): weights are
pulled by name through a `Weights` getter, so the same code runs fully in memory (tests, the
reference forward) and one layer at a time with weights streamed from disk (calibration, engine).

    state = model.embed(get, ids)                      # ids [B, T] -> State
    for i in range(model.n_layers):
        state, x = model.attn_block(i, get, state, cache=caches[i])  # x [B, T, D], MLP input
        y = model.mlp_block(i, get, x, experts=experts, observer=observer)  # [B, T, D]
        state = model.finish_layer(i, state, y)
    logits = model.head(get, state)                    # [B, T, V]

MoE layers dispatch expert-major: experts in ascending id order, each run once on all of its
tokens, weighted outputs accumulated in that fixed order so results do not depend on caching or
memory budgets.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

import torch

from reap.checkpoint.spec import split_view

# (layer, expert) -> that expert's tensors by short name, e.g. "w1.weight_packed", "w1.weight_scale".
# A source may also have `prefetch(layer, expert_ids)`: MoE layers call it with every expert they
# are about to use (ascending ids) once routing is known, before the first fetch; and a `probe`
# (layer, x, source, run) -> (source, run) that sees the layer's expert inputs x [N, Dx].
ExpertSource = Callable[[int, int], Mapping[str, torch.Tensor]]

# name (without prefix) -> tensor; raises reap.errors.CheckpointError for unknown names.
Weights = Callable[[str], torch.Tensor]


# A family's tensor names -> their role (TensorSpec.role) by name suffix: the Hugging Face ones
# every family shares; families with more (KDA's decay, router biases) extend the table.
HF_ROLES = {"embed_tokens.weight": "embedding", "norm.weight": "norm"}


def tag_roles(specs: list, roles: Mapping[str, str] = HF_ROLES) -> list:
    """`specs` with the role of each plain non-expert tensor whose name ends with a key of
    `roles` (tensors already given a role, e.g. quantized experts, keep it)."""
    suffixes, out = tuple(roles), []
    for s in specs:
        if s.expert is None and s.role == "weight" and s.name.endswith(suffixes):
            s = dataclasses.replace(s, role=next(r for k, r in roles.items() if s.name.endswith(k)))
        out.append(s)
    return out


def decoder_specs(
    cfg, dtype: str, layer_specs: Callable[[int], list], roles: Mapping[str, str] = HF_ROLES
) -> list:
    """The TensorSpecs of a decoder-only layout in order: `model.embed_tokens.weight`, each
    layer's `layer_specs(i)`, `model.norm.weight`, then `lm_head.weight` unless the config ties
    it (`cfg`: hidden_size, vocab_size, num_hidden_layers, tie_word_embeddings), tagged with
    `roles` (see `tag_roles`)."""
    from reap.checkpoint import TensorSpec

    D, V = cfg.hidden_size, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (V, D), "embed_head")]
    for i in range(cfg.num_hidden_layers):
        specs += layer_specs(i)
    specs.append(TensorSpec("model.norm.weight", dtype, (D,), "norms"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", dtype, (V, D), "embed_head"))
    return tag_roles(specs, roles)


def dtype_code(torch_dtype: str | None) -> str:
    """The safetensors dtype code of a config's `torch_dtype` / `dtype` (default BF16)."""
    codes = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
    return codes.get(torch_dtype or "bfloat16", "BF16")


@dataclass(frozen=True)
class ActivationWidths:
    """What calibration's memory plan needs of a family's activations (`calibration_widths`)."""

    hidden: int  # D, the residual stream width
    heads: int  # attention heads of a layer (its [H, T] scores per token)
    dense_ffn: int  # intermediate width of the dense MLP layers (0 if none)
    snapshots: int  # residual snapshots carried through the layers (AttnRes blocks; 0 if none)


class Family(Protocol):
    """The members every family module has (module-level functions and classes)."""

    Config: type  # dataclass with from_dict(config_dict) and a `torch_dtype` field
    Model: type  # Model(cfg, device=..., dtype=...) -> LayerModel

    def layout(self, config: dict) -> list: ...
    def expert_key(self, name: str) -> tuple[int, int] | None: ...
    def expert_tensor_names(self, cfg: Any, layer: int, expert: int) -> list[str]: ...
    def router_tensors(self, cfg: Any, layer: int) -> dict[str, int]: ...
    def with_experts(self, config: dict, n_experts: int | dict[int, int]) -> dict: ...
    def expert_groups(self, config: dict) -> int: ...
    def top_k(self, cfg: Any) -> int: ...
    def state_bytes(self, cfg: Any, act_bytes: int) -> tuple[int, int, int, int]: ...
    def calibration_widths(self, cfg: Any, n_layers: int) -> ActivationWidths: ...
    def expert_matrices(self, tensors: Mapping[str, torch.Tensor]) -> dict: ...
    def chat_format(self, config: dict) -> ChatFormat | None: ...


def ungrouped(config_dict: dict) -> int:
    """`expert_groups` of a family whose router picks among all experts at once."""
    return 1


def one_count(n_experts: int | dict[int, int]) -> int:
    """The count a `with_experts` request keeps in every layer, for a config.json holding one
    expert count for all layers (ReapError when the per-layer counts differ)."""
    from reap.errors import ReapError

    counts = set(n_experts.values()) if isinstance(n_experts, dict) else {n_experts}
    if len(counts) != 1:
        raise ReapError(
            "config.json holds one expert count for all layers, so a plan must keep the same "
            f"number in every layer (got {sorted(counts)}): use a uniform or per-layer scope"
        )
    return int(counts.pop())


def expert_key_by(pattern: str) -> Callable[[str], tuple[int, int] | None]:
    """An `expert_key` hook: (layer, expert) from the two groups of regex `pattern` searched in a
    tensor name (prefix optional), else None."""
    regex = re.compile(pattern)

    def expert_key(name: str) -> tuple[int, int] | None:
        m = regex.search(name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    return expert_key


def hf_top_k(cfg) -> int:
    """`top_k` of a family whose config uses the Hugging Face name `num_experts_per_tok`."""
    return cfg.num_experts_per_tok


def own_template(config_dict: dict) -> None:
    """`chat_format` of a family whose checkpoints ship their own chat template: None."""


def residual_widths(cfg, n_layers: int) -> ActivationWidths:
    """`calibration_widths` of a plain residual stream (no snapshots) from the Hugging Face
    names `hidden_size`, `num_attention_heads` and `intermediate_size`."""
    return ActivationWidths(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, 0)


def family_hooks() -> dict[str, int]:
    """The functions of the contract -> how many arguments each takes."""
    hooks = {n: f for n, f in vars(Family).items() if inspect.isfunction(f) and n[0] != "_"}
    return {n: len(inspect.signature(f).parameters) - 1 for n, f in hooks.items()}  # no self


def check_family(module: ModuleType) -> ModuleType:
    """`module` if it implements `Family`, else TypeError naming every missing or misdeclared
    member (called once per family when `reap.models.family` first loads it)."""
    config, problems = getattr(module, "Config", None), []
    fields = (
        {f.name for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else ()
    )
    if "torch_dtype" not in fields or not hasattr(config, "from_dict"):
        problems.append("Config is not a dataclass with from_dict and a torch_dtype field")
    model = getattr(module, "Model", None)
    if not (inspect.isclass(model) and issubclass(model, LayerModel)):
        problems.append("class Model is missing or not a LayerModel")
    for name, n_args in family_hooks().items():
        fn = getattr(module, name, None)
        if not callable(fn):
            problems.append(f"{name}() is missing")
        elif not _takes(fn, n_args):
            problems.append(f"{name}() cannot be called with the contract's {n_args} argument(s)")
    if problems:
        raise TypeError(f"model family {module.__name__}: {'; '.join(problems)}")
    return module


def _takes(fn: Callable, n_args: int) -> bool:
    try:
        inspect.signature(fn).bind(*[None] * n_args)
    except TypeError:
        return False
    return True


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
    Norm fields are None unless the observer sets `wants_norms`; `gram` is None unless it also
    sets `wants_gram` (costs N*K*Dl fp32 per layer while the layer runs, Dl the experts' width).
    """

    layer: int
    ids: torch.Tensor  # [N, K] int64 routed expert ids
    weights: torch.Tensor  # [N, K] float32 routing weights (renormalized, times scaling factor)
    probs: torch.Tensor  # [N, E] float32 router scores (sigmoid before any bias, or softmax)
    latent_norm: torch.Tensor | None = None  # [N, K] ||expert output|| in the expert space
    model_norm: torch.Tensor | None = None  # [N, K] ||contribution|| / weight, model space
    max_act: torch.Tensor | None = None  # [N, K] max |expert output| (expert space)
    # [N, K, K] <u_i, u_j>, u_k = slot k's contribution / its weight (model space, as model_norm:
    # diagonal = model_norm^2)
    gram: torch.Tensor | None = None
    # with `gram`, for layers that RMS-normalize the weighted sum y = sum_k w_k o_k of the expert
    # outputs o_k (width Dl) before the model space (K3's LatentMoE), rms^2 = mean(y^2) + eps:
    # [N, K, K] <o_i, o_j> / (Dl rms^2) and [N] eps / rms^2 (w^T norm_gram w + norm_eps = 1)
    norm_gram: torch.Tensor | None = None
    norm_eps: torch.Tensor | None = None


class Observer(Protocol):
    """Receives each MoE layer's routing (and optional per-expert output norms; an observer
    may also set `wants_gram` for `MoERecord.gram`, read with getattr: default False)."""

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

    def native_layer(self, i: int) -> Any:
        """Layer i for the compiled decode step (`blocks.NativeLayer`); None (default): torch."""
        return None

    def native_head(self) -> tuple[str, str, float] | None:
        """(final norm, head weight, epsilon) for the compiled decode step, or None."""
        return None

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
    (rendered by `reap.serve.chat.render_markers`).

    Optional: `answer_open`/`answer_close` wrap the answer; `stop` ends a reply besides `end`;
    `keep_reasoning` keeps every assistant turn's reasoning; `bare_answer` omits the reasoning
    block when thinking is off; `renders=False` declares the markers only (to split replies)."""

    system: str
    user: str
    assistant: str
    end: str
    think_open: str
    think_close: str
    answer_open: str = ""
    answer_close: str = ""
    stop: tuple[str, ...] = ()
    keep_reasoning: bool = False
    bare_answer: bool = False
    renders: bool = True
