"""Config-only model directories: `config.json` (and perhaps the index) without the weights.

A user deciding what to download asks `reap info DIR`, `reap plan --config DIR --dry-run` and
`reap run DIR --plan-only` of a directory holding only the released small files. The size model
needs no weights (`reap.sizes`, from the family layout); the index, when present, names every
stored tensor and its `metadata.total_size` is the exact sum of their bytes, so both are read and
checked against the layout by the caller.

    src = open_config_only("path/to/DeepSeek-V3")      # None when shards are present
    src.config, src.weight_map, src.total_size

A directory is config-only when it has `config.json`, no `model.safetensors` and none of the
shards its index names (some but not all of them present is a broken checkpoint, left to
`Checkpoint.open` to refuse).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from reap.checkpoint.header import load_index, load_json
from reap.checkpoint.spec import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    SINGLE_NAME,
    TEXT_PREFIX,
    TensorSpec,
    split_view,
)
from reap.errors import CheckpointError


@dataclass(frozen=True)
class ConfigOnly:
    """A model directory without weights: its config, and its index if it has one.

    weight_map: stored key -> shard name (None without an index); total_size: the index's
    `metadata.total_size` in bytes (None when absent)."""

    path: str
    config: dict
    weight_map: dict[str, str] | None = None
    total_size: int | None = None

    @property
    def index_path(self) -> str:
        return f"{self.path}/{INDEX_NAME}"  # a directory or a URL

    def stored_names(self) -> set[str]:
        """The index's tensor names without the `language_model.` prefix (empty: no index)."""
        keys = self.weight_map or {}
        return {k.removeprefix(TEXT_PREFIX) for k in keys}


def open_config_only(path: str | os.PathLike) -> ConfigOnly | None:
    """The config-only view of directory `path` (of a URL: `HttpCache.config_only`), or None
    if it holds weights (or is not a directory with a config.json). CheckpointError names a bad
    config or index file."""
    p = Path(path)
    if not p.is_dir() or not os.path.lexists(p / "config.json"):
        return None
    if os.path.lexists(p / SINGLE_NAME):
        return None
    index = p / INDEX_NAME
    weight_map, total = None, None
    if os.path.lexists(index):
        weight_map = load_index(index)
        if any(os.path.lexists(p / name) for name in set(weight_map.values())):
            return None
        total = _total_size(index)
    return ConfigOnly(str(p), load_json(p / "config.json", "config"), weight_map, total)


def _total_size(index: Path) -> int | None:
    """`metadata.total_size` of an index (None if absent); CheckpointError unless a whole,
    non-negative number of bytes."""
    meta = load_json(index, "index", MAX_INDEX_BYTES).get("metadata") or {}
    if not isinstance(meta, dict) or "total_size" not in meta:
        return None
    n = meta["total_size"]
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CheckpointError(f"{index}: metadata.total_size: {n!r} is not a byte count")
    return n


class LayoutTable(Mapping):
    """name -> tensor (shape, dtype, nbytes) of a layout as a checkpoint would store it, for
    questions without weights (binding checks, the engine's memory plan): iteration lists the
    stored names (a fused expert tensor once, [E, ...]), and `X[e]` looks up its slice, as
    `Checkpoint.tensors` does."""

    def __init__(self, specs: list[TensorSpec]):
        self._views = {s.name: s for s in specs}
        self._stored: dict[str, TensorSpec] = {}
        fused: dict[str, list[TensorSpec]] = {}
        for s in specs:
            base, index = split_view(s.name)
            if index is None:
                self._stored[s.name] = s
            else:
                fused.setdefault(base, []).append(s)
        for base, views in fused.items():
            s = views[0]
            shape = (len(views), *s.shape)  # [E, ...]
            self._stored[base] = replace(s, name=base, shape=shape, expert=None)

    def __getitem__(self, name: str) -> TensorSpec:
        if name in self._stored:
            return self._stored[name]
        if split_view(name)[1] is not None:
            return self._views[name]
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self._stored or (isinstance(name, str) and name in self._views)

    def __iter__(self) -> Iterator[str]:
        return iter(self._stored)

    def __len__(self) -> int:
        return len(self._stored)
