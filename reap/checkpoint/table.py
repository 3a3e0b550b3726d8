"""Indexing a checkpoint: which safetensors files make it (an HF directory with its index, a
directory holding one `model.safetensors`, or a single file), and `TensorTable`, the lazy
name -> `TensorInfo` mapping over their shards (built from the scanned keys; a shard's entries
are parsed and validated the first time one of its tensors is looked up). An HF directory's
shards are exactly the files its index names; the index is checked against their keys at open.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from itertools import chain, repeat
from pathlib import Path

from reap.checkpoint.header import Shard, load_index, load_json, parse_shard, scan_shard
from reap.checkpoint.spec import (
    INDEX_NAME,
    SINGLE_NAME,
    TEXT_PREFIX,
    TensorInfo,
    split_view,
    view_name,
)
from reap.errors import CheckpointError


def open_table(path: Path) -> tuple[dict, list[Shard], TensorTable]:
    """(config.json or {}, shards, tensor table) of a checkpoint directory or file, from its
    headers alone: checks every shard's framing, that tensor names are unique and, for an HF
    directory, that the index names plain shard files that exist and maps every tensor to the
    shard that holds it, and no other."""
    files, index, config = _shard_files(path)
    weight_map = None
    if index is not None:
        weight_map = load_index(index)
        files = [_named_shard(index, f) for f in sorted(set(weight_map.values()))]
    scans = [scan_shard(f) for f in files]
    shards = [sh for sh, _ in scans]
    for sh, header in scans:
        if header is not None:  # json.loads already parsed it: validate now
            parse_shard(sh, header)
    where, prefixed = _name_index(shards, path)
    if weight_map is not None:
        problem = index_mismatch(index, shards, weight_map)
        if problem:
            raise CheckpointError(problem)
    return config, shards, TensorTable(shards, where, prefixed)


class TensorTable(Mapping[str, TensorInfo]):
    """name -> TensorInfo over all shards. Names and membership are known from the scan at open;
    a shard's entries are fully parsed and validated the first time one of them is looked up."""

    def __init__(self, shards: list[Shard], where: dict[str, int], prefixed: bool):
        self._shards, self._where, self._prefixed = shards, where, prefixed

    def _key(self, name: str) -> str:
        """The stored key of tensor `name` (KeyError if there is none)."""
        if self._prefixed:
            if name.startswith(TEXT_PREFIX):
                raise KeyError(name)  # names never carry the prefix
            if TEXT_PREFIX + name in self._where:
                return TEXT_PREFIX + name
        if name not in self._where:
            raise KeyError(name)
        return name

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            key = self._key(name)
        except KeyError:
            base, index = split_view(name)
            if index is None:
                raise
            return _slice(parse_shard(self._shards[self._where[self._key(base)]])[base], index)
        return parse_shard(self._shards[self._where[key]])[name]

    def __contains__(self, name: object) -> bool:
        try:
            self._key(name)  # type: ignore[arg-type]
        except (KeyError, AttributeError):
            if not isinstance(name, str) or split_view(name)[1] is None:
                return False
            try:
                self[name]
            except KeyError:
                return False
        return True

    def __iter__(self) -> Iterator[str]:
        return (k.removeprefix(TEXT_PREFIX) for k in self._where)

    def __len__(self) -> int:
        return len(self._where)


def _slice(info: TensorInfo, index: int) -> TensorInfo:
    """The view `X[index]` of stored tensor X [E, ...]: its contiguous byte range, shape [...]."""
    if not info.shape or not 0 <= index < info.shape[0]:
        raise KeyError(view_name(info.name, index))
    row = info.nbytes // info.shape[0]  # bytes per slice along axis 0
    start = info.start + index * row
    return info._replace(name=view_name(info.name, index), key=view_name(info.key, index),
                         shape=info.shape[1:], start=start, end=start + row)


def _name_index(shards: list[Shard], path: Path) -> tuple[dict[str, int], bool]:
    """stored key -> shard number over all shards, and whether the checkpoint is prefixed;
    CheckpointError on duplicate names."""
    n = sum(len(sh.keys) for sh in shards)
    where = dict(zip(chain.from_iterable(sh.keys for sh in shards),
                     chain.from_iterable(repeat(i, len(sh.keys)) for i, sh in enumerate(shards))))
    prefixed = any(sh.n_prefixed for sh in shards)
    dup = None if len(where) == n else next(k for k in where if _count(shards, k) > 1)
    if dup is None and prefixed:  # a bare key may collide with a prefixed one's name
        bare = (k for sh in shards if sh.n_prefixed < len(sh.keys) for k in sh.keys
                if not k.startswith(TEXT_PREFIX))
        dup = next((k for k in bare if TEXT_PREFIX + k in where), None)
    if dup is not None:
        raise CheckpointError(f"{path}: tensor name {dup} is stored twice")
    return where, prefixed


def _count(shards: list[Shard], key: str) -> int:
    return sum(sh.keys.count(key) for sh in shards)


def _shard_files(path: Path) -> tuple[list[str], Path | None, dict]:
    """A checkpoint path -> (shard files to scan, index path or None, config dict). With an
    index, the shards are the files it names (see `open_table`)."""
    if not path.is_dir():
        if os.path.lexists(path):  # a file; scan_shard refuses anything but a regular one
            return [str(path)], None, {}
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    config_path = path / "config.json"
    config = load_json(config_path, "config") if os.path.lexists(config_path) else {}
    index = path / INDEX_NAME
    if os.path.lexists(index):
        return [], index, config
    if os.path.lexists(path / SINGLE_NAME):
        return [str(path / SINGLE_NAME)], None, config
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _named_shard(index: Path, name: str) -> str:
    """The path of shard `name` (a plain name, checked by `load_index`) named by the index."""
    path = index.parent / name
    if not os.path.lexists(path):
        raise CheckpointError(f"{index}: weight_map: shard {name} is missing")
    return str(path)


def index_mismatch(index: Path, shards: list[Shard], weight_map: dict[str, str]) -> str | None:
    """The first disagreement between an index's weight map and the shards' (unique) tensor
    keys, each of which must be in the shard the index names, all of them listed; or None."""
    listed = 0
    for sh in shards:  # the common case: C-level lookups and counts
        name = os.path.basename(sh.path)
        if list(map(weight_map.get, sh.keys)).count(name) != len(sh.keys):
            break
        listed += len(sh.keys)
    else:
        if listed == len(weight_map):
            return None
    stored = {k: os.path.basename(sh.path) for sh in shards for k in sh.keys}
    for key, shard in weight_map.items():
        if stored.get(key) != shard:
            return f"{index}: index places tensor {key} in {shard}, but that shard lacks it"
    for key, shard in stored.items():
        if key not in weight_map:
            return f"{index}: tensor {key} in {shard} is not listed in the index"
    return None
