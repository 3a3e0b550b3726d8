"""Size model: parameter and byte census of a checkpoint layout, and byte predictions for
pruned builds (`reap info`, `reap plan --target-size`), all from the family's `layout(config)`,
so a config alone answers the full-scale questions without weights. An expert's unit cost
includes its rows of the router tensors (sliced when pruning), so `predict_bytes` of a plan is
what `reap prune` writes; unused components (e.g. an MTP layer) count only in the source.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

from reap.checkpoint import TensorSpec, entry_bytes, split_view
from reap.checkpoint.spec import UNUSED_COMPONENTS
from reap.errors import ReapError

_SHARD_BYTES = 5_000_000_000  # the writer's default shard size, for offset digit estimates


@dataclass
class SizeModel:
    """Bytes and parameters of a layout as a function of experts kept per MoE layer.

    An expert's unit cost (`expert_bytes`, `expert_params`) includes its rows of the router
    tensors; `expert_own_*` are its own tensors alone. Parameters are the weights tensors hold by
    their layout role (`TensorSpec.weights`: two per MXFP4 block byte, none in a scale).
    """

    n_experts: int
    top_k: int
    moe_layers: list[int]
    fixed_bytes: int  # everything but routed experts and their router rows
    fixed_params: int
    expert_bytes: dict[int, int]
    expert_params: dict[int, int]
    expert_own_bytes: dict[int, int]
    expert_own_params: dict[int, int]
    header_bytes_fixed: int  # safetensors header bytes of the fixed tensors
    header_bytes_expert: dict[int, int]  # per expert
    census: dict[str, dict[str, int]] = field(default_factory=dict)  # component -> params/bytes
    n_tensors: int = 0
    input_embedding_params: int = 0
    unused_bytes: int = 0  # UNUSED_COMPONENTS tensors, header entries included: source only
    unused_params: int = 0

    @classmethod
    def from_config(cls, config: dict) -> SizeModel:
        """Size model of a config.json dict (any family with a `layout`)."""
        from reap.models import family

        return cls.from_layout(layout(config), family(config), config)

    @classmethod
    def from_layout(cls, specs: list[TensorSpec], fam, config: dict) -> SizeModel:
        from reap.models.validate import text_prefix

        cfg = fam.Config.from_dict(config)
        moe_layers = sorted({s.layer for s in specs if s.component == "routed_experts"})
        router = {}
        for layer in moe_layers:
            router.update(fam.router_tensors(cfg, layer))
        census: dict[str, dict[str, int]] = defaultdict(lambda: {"params": 0, "bytes": 0})
        unit = {k: defaultdict(int) for k in ("b", "p", "ob", "op", "h")}
        fixed = {"b": 0, "p": 0, "h": 0}
        unused = {"b": 0, "p": 0}
        n_exp = 0
        shard = min(sum(s.nbytes for s in specs), _SHARD_BYTES)
        digits = len(str(shard // 2))  # typical offset within a shard
        prefix = text_prefix(config)  # as synth and the releases
        for s in specs:
            census[s.component]["params"] += s.weights
            census[s.component]["bytes"] += s.nbytes
            if s.component in UNUSED_COMPONENTS:
                unused["b"] += s.nbytes + entry_bytes(s, prefix, digits)
                unused["p"] += s.weights
                continue
            if s.expert is not None:
                n_exp = max(n_exp, s.expert + 1)
                if s.expert == 0:
                    h = entry_bytes(s, prefix, digits)
                    if split_view(s.name)[1] is not None:  # a fused tensor: one header entry
                        fixed["h"], h = fixed["h"] + h, 0
                    for k, v in (("b", s.nbytes), ("ob", s.nbytes), ("p", s.weights),
                                 ("op", s.weights), ("h", h)):
                        unit[k][s.layer] += v
                continue
            fixed["h"] += entry_bytes(s, prefix, digits)
            if s.name in router:
                rows = s.shape[router[s.name]]
                unit["b"][s.layer] += s.nbytes // rows
                unit["p"][s.layer] += s.numel // rows
                fixed["b"] += s.nbytes - s.nbytes // rows * rows
                continue
            fixed["b"] += s.nbytes
            fixed["p"] += s.weights
        top_k = fam.top_k(cfg)
        d = {k: dict(v) for k, v in unit.items()}
        embed = sum(
            s.numel for s in specs if s.role == "embedding" and s.component not in UNUSED_COMPONENTS
        )
        stored = len({split_view(s.name)[0] for s in specs})  # a fused tensor's views: one tensor
        return cls(n_exp, top_k, moe_layers, fixed["b"], fixed["p"], d["b"], d["p"], d["ob"],
                   d["op"], fixed["h"], d["h"], dict(census), stored, embed, unused["b"],
                   unused["p"])

    @property
    def total_params(self) -> int:
        return sum(c["params"] for c in self.census.values())

    @property
    def active_with_embedding(self) -> int:
        """`active_params` plus the input embedding table (the convention of some model cards,
        which count the looked-up row as active; see the README's table of releases)."""
        return self.active_params + self.input_embedding_params

    @property
    def active_params(self) -> int:
        """Parameters that multiply a text token's activations: all but the vision tower, the
        unchosen experts, the input embedding table (a row lookup, not a matmul) and unused
        components."""
        vision = self.census.get("vision", {}).get("params", 0)
        routed = self.census.get("routed_experts", {}).get("params", 0)
        chosen = sum(self.expert_own_params[la] * self.top_k for la in self.moe_layers)
        unused = self.unused_params + self.input_embedding_params
        return self.total_params - vision - routed + chosen - unused

    def predict_bytes(self, keep: dict[int, int] | int | None = None) -> int:
        """Checkpoint bytes (tensor data + safetensors headers) with `keep` experts per layer; the
        source (keep None) also holds the unused components a pruned build leaves out."""
        data = self.unused_bytes if keep is None else 0
        keep = self._keep(keep)
        data += self.fixed_bytes + sum(self.expert_bytes[la] * k for la, k in keep.items())
        head = self.header_bytes_fixed + sum(
            self.header_bytes_expert[la] * k for la, k in keep.items()
        )
        return data + head

    def predict_params(self, keep: dict[int, int] | int | None = None) -> int:
        """Parameters with `keep` experts per layer (the source, keep None: unused ones too)."""
        unused = self.unused_params if keep is None else 0
        keep = self._keep(keep).items()
        return unused + self.fixed_params + sum(self.expert_params[la] * k for la, k in keep)

    def max_uniform_keep(self, target_bytes: int) -> int:
        """Largest per-layer expert count whose checkpoint fits in `target_bytes` (0 if none)."""
        lo, hi = 0, self.n_experts
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict_bytes(mid) <= target_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _keep(self, keep) -> dict[int, int]:
        if keep is None or isinstance(keep, int):
            return {layer: self.n_experts if keep is None else keep for layer in self.moe_layers}
        return keep


def layout(config: dict) -> list[TensorSpec]:
    """The family layout of a config.json dict (seconds at full size: callers build it once)."""
    from reap.models import family

    return family(config).layout(config)


def fmt_params(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(int(n))


@dataclass(frozen=True)
class Source:
    """What a MODEL argument names: its config.json dict, and where its weights are (`path`: a
    checkpoint directory, file or http(s) URL), or a config-only directory (`config_only`), or
    neither (a built-in config)."""

    config: dict
    path: str | None = None
    config_only: object | None = None  # reap.checkpoint.config_only.ConfigOnly


def resolve_source(model: str, layers: int | None = None) -> Source:
    """A built-in config name, a checkpoint path or URL, or a directory holding only config.json
    (and perhaps the index) -> `Source`; the config is validated as every command validates it
    (`reap.models.load_config`). A URL's config, index and shard headers are fetched
    (`reap.checkpoint.RemoteCheckpoint`), never its tensors."""
    from reap.checkpoint import is_url, open_checkpoint
    from reap.checkpoint.config_only import open_config_only
    from reap.checkpoint.hub import open_cache
    from reap.models import builtin_config, load_config

    if not is_url(model) and not os.path.exists(model):
        if os.sep in model or model.endswith(".json"):
            raise ReapError(f"{model}: no such checkpoint or config directory")
        return Source(builtin_config(model, layers=layers))
    if layers is not None:
        raise ReapError(f"--layers applies to built-in configs only, not {model}")
    src = open_cache(model).config_only() if is_url(model) else open_config_only(model)
    if src is not None:
        load_config(src.config, model)
        return Source(src.config, None, src)
    with open_checkpoint(model) as ck:
        if not ck.config:
            raise ReapError(f"{model}: no config.json")
        load_config(ck.config, model)
        return Source(ck.config, model)


def check_index(src, specs: list[TensorSpec], family_name: str) -> int:
    """Check a config-only directory's index (if any) against the layout `specs`: every tensor
    it names must be one the layout has (CheckpointError naming the index and the first one
    that is not). Returns how many layout tensors the index does not list (0 for a complete
    index; an excerpt lists fewer)."""
    from reap.errors import CheckpointError

    if src.weight_map is None:
        return 0
    stored = {split_view(s.name)[0] for s in specs}
    unknown = sorted(src.stored_names() - stored)
    if unknown:
        raise CheckpointError(
            f"{src.index_path}: weight_map: tensor {unknown[0]} is not in the {family_name} "
            f"layout of config.json ({len(unknown)} such)"
        )
    return len(stored - src.stored_names())
