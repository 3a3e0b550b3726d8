"""Expert statistics: the artifact calibration writes and analysis and planning read.

One `ExpertStats` holds what one corpus did to one model: per MoE layer, per routed expert,
sums that merge exactly by addition (and one maximum). Means are derived, never stored, so
statistics from separate runs or corpus shards combine with `merge` (`reap stats merge`, in
`reap.stats.cli`). The fields are declared once, in `ExpertSums` (dtype and merge rule in each
field's metadata); calibration's per-layer rows, the file format and `merge` derive from it.

Dimension letters: L recorded MoE layers, E routed experts, S calibration sequences.

File format: one safetensors file; tensors by field name, provenance as JSON in the header's
`__metadata__["reap"]`. Sums are float64 and counts int64, so a merge of shards equals the stats
of the concatenated corpus to float64 rounding (counts exactly).
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, Field, dataclass, field, fields

import torch

from reap.errors import ReapError, WriteError, first_difference
from reap.fileio import atomic_path
from reap.stats.check import check_header, check_shapes

FORMAT = "reap.expert_stats/1"


# field metadata: the dtype of a statistic and how shards merge ("sum", "max" or "cat")
_COUNT = {"dtype": torch.int64, "merge": "sum"}
_SUM = {"dtype": torch.float64, "merge": "sum"}
_MAX = {"dtype": torch.float32, "merge": "max"}
_PER_SEQUENCE = {"dtype": torch.int32, "merge": "cat"}
_OUT = {"dtype": torch.float32, "merge": "sum"}  # float32: [L, E, Dx] is large at scale


@dataclass(kw_only=True)
class ExpertSums:
    """The per-expert sums, the one declaration of the statistics fields (a field with a
    default may be absent from a file). Shapes are [*R, E]: R = [L] in `ExpertStats`, nothing in
    one layer's calibration row; `coact` adds a trailing E, `seq_count` a leading S."""

    count: torch.Tensor = field(metadata=_COUNT)  # tokens routed to the expert
    gate_sum: torch.Tensor = field(metadata=_SUM)  # sum of routing weights over routed tokens
    reap_sum: torch.Tensor = field(metadata=_SUM)  # sum of weight * ||expert output|| (model)
    reap_latent_sum: torch.Tensor = field(metadata=_SUM)  # same, output norm in latent space
    ean_sum: torch.Tensor = field(metadata=_SUM)  # sum of ||expert output|| (model space)
    ean_latent_sum: torch.Tensor = field(metadata=_SUM)  # sum of ||expert output|| (latent)
    max_act: torch.Tensor = field(metadata=_MAX)  # max |activation| of the expert's output
    prob_mass: torch.Tensor = field(metadata=_SUM)  # sum over ALL tokens of router probability
    coact: torch.Tensor = field(metadata=_COUNT)  # [*R, E, E] tokens routed to both i and j
    seq_count: torch.Tensor | None = field(default=None, metadata=_PER_SEQUENCE)  # [S, *R, E]
    # with `reap calibrate --merge-stats` (expert merging): sum over ALL tokens of p_i * p_j,
    # p the router scores [E]; each expert's output summed over a token sample, routed or not
    # ([*R, E, Dx], Dx the experts' output width), and that sample's size
    prob_gram: torch.Tensor | None = field(default=None, metadata=_SUM)  # [*R, E, E]
    out_sum: torch.Tensor | None = field(default=None, metadata=_OUT)  # [*R, E, Dx]
    out_count: torch.Tensor | None = field(default=None, metadata=_COUNT)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Field name -> tensor, omitting absent optional fields."""
        return {f.name: getattr(self, f.name) for f in sum_fields()
                if getattr(self, f.name) is not None}


def sum_fields() -> list[Field]:
    """The statistics fields of `ExpertSums`, in declaration order."""
    return list(fields(ExpertSums))


def zero_sums(n_experts: int, n_seq: int | None = None, rows: tuple[int, ...] = ()) -> dict:
    """Empty `ExpertSums` fields of shape [*rows, E] to accumulate into, name -> tensor
    (`seq_count` [n_seq, *rows, E] only when `n_seq` is given)."""
    E = n_experts
    out = {f.name: torch.zeros((*rows, E, E) if f.name == "coact" else (*rows, E),
                               dtype=f.metadata["dtype"])
           for f in sum_fields() if f.default is MISSING}
    if n_seq is not None:
        out["seq_count"] = torch.zeros((n_seq, *rows, E), dtype=torch.int32)
    return out


@dataclass
class ExpertStats(ExpertSums):
    """Per-layer, per-expert routing statistics of one corpus on one model ([L, E] sums).

    `layers[l]` is the model layer index of row l. `tokens` counts every token that passed
    the layers (routed or not). `meta` is provenance: model fingerprint, corpus name and sha256,
    arguments, code version.
    """

    layers: list[int]
    n_experts: int
    top_k: int
    tokens: int
    meta: dict = field(default_factory=dict)

    @classmethod
    def zeros(cls, layers: list[int], n_experts: int, top_k: int, meta: dict | None = None):
        """Empty statistics to accumulate into."""
        sums = zero_sums(n_experts, rows=(len(layers),))
        return cls(list(layers), n_experts, top_k, 0, meta=dict(meta or {}), **sums)

    # Derived per-expert scores, [L, E]; experts never routed score 0.
    def reap(self, latent: bool = False) -> torch.Tensor:
        """REAP saliency: mean over routed tokens of weight * ||output|| (model space default)."""
        s = self.reap_latent_sum if latent else self.reap_sum
        return s / self.count.clamp(min=1)

    def ean(self, latent: bool = False) -> torch.Tensor:
        """Mean expert-output norm over routed tokens."""
        s = self.ean_latent_sum if latent else self.ean_sum
        return s / self.count.clamp(min=1)

    def frequency(self) -> torch.Tensor:
        """Share of tokens routed to each expert."""
        return self.count.double() / max(self.tokens, 1)

    def header(self) -> dict:
        return {"format": FORMAT, "layers": self.layers, "n_experts": self.n_experts,
                "top_k": self.top_k, "tokens": self.tokens, "meta": self.meta}

    def save(self, path: str | os.PathLike) -> str:
        """Write atomically (temp file, then rename); returns the path."""
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in self.tensors().items()}
        with atomic_path(path) as tmp:
            try:
                save_file(tensors, tmp, metadata={"reap": json.dumps(self.header())})
            except SafetensorError as e:  # its I/O errors are not OSError
                raise WriteError(f"cannot write {os.fspath(path)}: {e}") from e
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExpertStats:
        """Read a statistics file; a clear error if it is not one."""
        from safetensors import safe_open

        path = os.fspath(path)
        try:
            with safe_open(path, "pt") as f:
                head = json.loads((f.metadata() or {})["reap"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises its own error type for non-safetensors
            raise ReapError(f"{path}: not a reap statistics file ({type(e).__name__}: {e})") from e
        if not isinstance(head, dict) or head.get("format") != FORMAT:
            fmt = head.get("format") if isinstance(head, dict) else head
            raise ReapError(f"{path}: unknown statistics format {fmt!r}")
        missing = [f.name for f in sum_fields() if f.default is MISSING and f.name not in tensors]
        if missing:
            raise ReapError(f"{path}: statistics file lacks {', '.join(missing)}")
        check_header(path, head)
        check_shapes(path, head, tensors, sum_fields())
        return cls(head["layers"], head["n_experts"], head["top_k"], head["tokens"],
                   meta=head.get("meta", {}), **tensors)


def expand_paths(paths: list[str]) -> tuple[list[str], list[str]]:
    """Statistics files: files as given; a directory (a calibration output) contributes its
    per-corpus files, skipping `*.safetensors` that are not statistics (token expert ids) or
    that merge others (`all.safetensors`). Returns (files, skipped)."""
    import glob

    files, skipped = [], []
    for p in paths:
        if not os.path.isdir(p):
            files.append(p)
            continue
        for f in sorted(glob.glob(os.path.join(p, "*.safetensors"))):
            head = _header(f)
            ok = head is not None and head.get("format") == FORMAT
            ok = ok and "merged_from" not in head.get("meta", {})
            (files if ok else skipped).append(f)
    return files, skipped


def _header(path: str) -> dict | None:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return json.loads((f.metadata() or {}).get("reap", "null"))
    except Exception:  # not safetensors, or not ours
        return None


def merge(parts: list[ExpertStats], meta: dict | None = None) -> ExpertStats:
    """Statistics of the union of the parts' tokens (same model and layers required)."""
    if not parts:
        raise ReapError("nothing to merge")
    a = parts[0]
    for b in parts[1:]:
        if b.meta.get("model") != a.meta.get("model"):
            raise ReapError("cannot merge statistics of different models (fingerprints "
                            f"{a.meta.get('model')} and {b.meta.get('model')})")
        if b.layers != a.layers:
            raise ReapError(f"cannot merge statistics of different layer sets: "
                            f"{first_difference(a.layers, b.layers)}")
        if (b.n_experts, b.top_k) != (a.n_experts, a.top_k):
            raise ReapError(f"cannot merge statistics of different models: n_experts/top_k "
                            f"{a.n_experts}/{a.top_k} vs {b.n_experts}/{b.top_k}")
    out = {}
    for f in sum_fields():
        name, rule = f.name, f.metadata["merge"]
        vals = [getattr(p, name) for p in parts]
        if any(v is None for v in vals):
            continue  # an optional field some part lacks
        if rule == "sum":
            out[name] = torch.stack(vals).sum(0)
        elif rule == "max":
            out[name] = torch.stack(vals).amax(0)
        else:
            out[name] = torch.cat(vals)
    m = dict(meta if meta is not None else a.meta)
    m["merged_from"] = [p.meta for p in parts]
    return ExpertStats(list(a.layers), a.n_experts, a.top_k, sum(p.tokens for p in parts),
                       meta=m, **out)
