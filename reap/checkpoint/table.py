"""Indexing a checkpoint: which safetensors files make it (an HF directory with its index, a
directory holding one `model.safetensors`, or a single file), and `TensorTable`, the lazy
name -> `TensorInfo` mapping over their shards (built from the scanned keys; a shard's entries
are parsed and validated the first time one of its tensors is looked up).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from itertools import chain, repeat
from pathlib import Path

from reap.checkpoint.header import (
    Shard,
    count_index_entries,
    load_index,
    load_json,
    parse_shard,
    scan_shard,
)
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
    directory, that its shards hold as many tensors as the index has entries (otherwise the
    index is parsed and followed exactly)."""
    files, index, config = _shard_files(path)
    scans = [scan_shard(f) for f in files] if index is None else _scan_indexed(index, files)
    shards = [sh for sh, _ in scans]
    for sh, header in scans:
        if header is not None:  # json.loads already parsed it: validate now
            parse_shard(sh, header)
    where, prefixed = _name_index(shards, path)
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
        cut = len(TEXT_PREFIX)
        return (k[cut:] if k.startswith(TEXT_PREFIX) else k for k in self._where)

    def __len__(self) -> int:
        return len(self._where)

    def shard_of(self, name: str) -> str:
        """The file holding tensor `name`, without parsing its shard."""
        return self._shards[self._where[self._key(name)]].path


def _slice(info: TensorInfo, index: int) -> TensorInfo:
    """The view `X[index]` of stored tensor X [E, ...]: its contiguous byte range, shape [...]."""
    if not info.shape or not 0 <= index < info.shape[0]:
        raise KeyError(view_name(info.name, index))
    row = info.nbytes // info.shape[0]  # bytes per slice along axis 0
    start = info.start + index * row
    return TensorInfo(
        view_name(info.name, index),
        view_name(info.key, index),
        info.dtype,
        info.shape[1:],
        info.file,
        start,
        start + row,
    )


def _name_index(shards: list[Shard], path: Path) -> tuple[dict[str, int], bool]:
    """stored key -> shard number over all shards, and whether the checkpoint is prefixed;
    CheckpointError on duplicate names."""
    n = sum(len(sh.keys) for sh in shards)
    where = dict(
        zip(
            chain.from_iterable(sh.keys for sh in shards),
            chain.from_iterable(repeat(i, len(sh.keys)) for i, sh in enumerate(shards)),
        )
    )
    prefixed = any(sh.n_prefixed for sh in shards)
    dup = None if len(where) == n else next(k for k in where if _count(shards, k) > 1)
    if dup is None and prefixed:  # a bare key may collide with a prefixed one's name
        bare = (
            k
            for sh in shards
            if sh.n_prefixed < len(sh.keys)
            for k in sh.keys
            if not k.startswith(TEXT_PREFIX)
        )
        dup = next((k for k in bare if TEXT_PREFIX + k in where), None)
    if dup is not None:
        raise CheckpointError(f"{path}: tensor name {dup} is stored twice")
    return where, prefixed


def _count(shards: list[Shard], key: str) -> int:
    return sum(sh.keys.count(key) for sh in shards)


def _shard_files(path: Path) -> tuple[list[str], Path | None, dict]:
    """A checkpoint path -> (shard files to scan, index path or None, config dict). With an
    index, the files are the directory's `.safetensors` files (checked against the index)."""
    if path.is_file():
        return [str(path)], None, {}
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    config_path = path / "config.json"
    config = load_json(config_path, "config") if config_path.exists() else {}
    index = path / INDEX_NAME
    if index.exists():
        return sorted(str(f) for f in path.glob("*.safetensors")), index, config
    if (path / SINGLE_NAME).is_file():
        return [str(path / SINGLE_NAME)], None, config
    raise CheckpointError(f"{path}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def _scan_indexed(index: Path, files: list[str]) -> list[tuple[Shard, dict | None]]:
    """Scan an HF directory's shards. Fast path: the directory's shards hold exactly as many
    tensors as the index has entries. Otherwise the exact path: parse the index, scan only the
    shards it names, and report the first disagreement."""
    try:
        scans = [scan_shard(f) for f in files]
        if sum(len(sh.keys) for sh, _ in scans) == count_index_entries(index):
            return scans
    except CheckpointError:
        pass  # maybe a stray file the index does not name; the exact path decides
    weight_map = load_index(index)
    named = sorted(set(weight_map.values()))
    for f in named:
        if not (index.parent / f).is_file():
            raise CheckpointError(f"{index}: shard {f} is missing")
    scans = [scan_shard(str(index.parent / f)) for f in named]
    shards = [sh for sh, _ in scans]
    for sh, header in scans:
        if header is not None:
            parse_shard(sh, header)
    if sum(len(sh.keys) for sh in shards) != len(weight_map):
        raise CheckpointError(index_mismatch(index, shards, weight_map) or f"{index}: mismatch")
    return scans


def index_mismatch(index: Path, shards: list[Shard], weight_map: dict[str, str]) -> str | None:
    """The first disagreement between an index and the shard headers, or None."""
    stored: dict[str, str] = {}
    for sh in shards:
        file = os.path.basename(sh.path)
        stored.update((t.key, file) for t in parse_shard(sh).values())
    for key, shard in weight_map.items():
        if stored.get(key) != shard:
            return f"{index}: index places tensor {key} in {shard}, but that shard lacks it"
    for key, shard in stored.items():
        if key not in weight_map:
            return f"{index}: tensor {key} in {shard} is not listed in the index"
    return None
