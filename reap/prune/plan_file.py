"""The `Plan` record (which routed experts each MoE layer keeps) and its JSON file.

`reap.prune.plan.make_plan` builds one, `reap plan` saves it (`Plan.save`, atomic), `reap prune`
loads it (`Plan.load`, which checks it). The file is the record's fields as JSON, tagged with
`format` (FORMAT); layer keys are strings in the file and ints in the record.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from reap.errors import ReapError
from reap.fileio import write_atomic

FORMAT = "reap.plan/1"
# sources that decide what a plan and a pruned checkpoint contain: their `code_version` parts
PRUNE_CODE = ("prune", "checkpoint", "models", "sizes.py", "stats.py")


@dataclass
class Plan:
    """Which experts to keep. `keep[layer]` = kept original expert ids, ascending (None in a
    counts-only plan made from a config alone); `scores[layer]` = combined score per expert [E];
    bytes and parameters are predictions for the pruned checkpoint (None without a config)."""

    n_experts: int
    top_k: int
    layers: list[int]
    counts: dict[int, int]
    keep: dict[int, list[int]] | None = None
    criterion: str | None = None
    scope: str = "uniform"
    budget: dict = field(default_factory=dict)
    combine: dict = field(default_factory=dict)
    protected: list[dict] = field(default_factory=list)
    protect_rule: str | None = None
    scores: dict[int, list[float]] | None = None
    predicted_bytes: int | None = None
    predicted_params: int | None = None
    source_bytes: int | None = None
    source_params: int | None = None
    model: str | None = None  # source checkpoint fingerprint, when known
    provenance: dict = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> dict:
        d = asdict(self)
        for k in ("counts", "keep", "scores"):
            if d[k] is not None:
                d[k] = {str(layer): v for layer, v in d[k].items()}
        return d

    def save(self, path: str | os.PathLike) -> str:
        """Write the plan as JSON atomically (temp file, then rename); returns the path."""
        return write_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """Read and check a plan file; a one-line ReapError if it is not a valid plan."""
        path = os.fspath(path)
        try:
            with open(path) as f:
                d = json.load(f)
            if d.get("format") != FORMAT:
                raise ReapError(f"{path}: not a reap plan (format {d.get('format')!r})")
            for k in ("counts", "keep", "scores"):
                if d.get(k) is not None:
                    d[k] = {int(layer): v for layer, v in d[k].items()}
            plan = cls(**d)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ReapError(f"{path}: cannot read plan ({e})") from e
        plan.check(path)
        return plan

    def check(self, where: str = "plan") -> None:
        """Kept ids sorted, unique, in range, at least top_k per layer, matching counts."""
        if self.keep is None:
            return
        if sorted(self.keep) != sorted(self.layers):
            raise ReapError(
                f"{where}: kept experts given for layers {sorted(self.keep)}, "
                f"plan layers are {self.layers}"
            )
        for layer, ids in self.keep.items():
            ok = ids == sorted(set(ids)) and all(0 <= e < self.n_experts for e in ids)
            if not ok or len(ids) != self.counts.get(layer) or len(ids) < self.top_k:
                raise ReapError(f"{where}: layer {layer}: invalid kept expert list")
