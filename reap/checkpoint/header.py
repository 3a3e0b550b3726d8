"""safetensors headers and HF index files: build, read, scan fast, validate strictly.

`encode_header` is the one place a header is built and `entry_bytes` its size estimate.
`parse_header` and `check_entries` are the one validation of a header, local or remote, as
strict as the safetensors library, and entries must tile the data region exactly, so that a
header length off by one byte is refused instead of read one byte off.

Opening a 497,220-tensor checkpoint must take well under a second, and fully parsing ~76 MB of
header JSON into Python objects does not (several seconds). So opening is two-tier:
`scan_shard` checks a header's framing and extracts only the tensor keys (on the canonical
compact form the header split at its quotes has exactly ten tokens per tensor, so keys are one
slice; anything else falls back to `json.loads`), and `parse_shard` fully validates a shard the
first time any of its tensors is used. A tensor's name is its key without the
`language_model.` prefix, where it has one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from reap.checkpoint.files import open_regular, read_regular
from reap.checkpoint.spec import (
    DTYPE_SIZES,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    MAX_JSON_BYTES,
    TEXT_PREFIX,
    TensorInfo,
    TensorSpec,
    shard_name,
    stored_key,
)
from reap.errors import CheckpointError

_FIRST_READ = 1 << 16  # header bytes fetched speculatively with the length prefix
_new_tuple = tuple.__new__
_TOKENS = 10  # quote-split tokens per canonical tensor entry
# token offset within an entry -> the literal it must be (offset 0 is the key)
_FIXED = {1: ":{", 2: "dtype", 8: "data_offsets"}


# Bytes of one header entry besides its key, dtype, shape and offset digits:
# "key":{"dtype":"..","shape":[..],"data_offsets":[..,..]}, (quotes, colon, braces, comma).
_ENTRY_FIXED = 45


def encode_header(tensors: Iterable[tuple[str, str, Sequence[int], int]],
                  metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors header of tensors stored back to back in the given order, each
    (stored key, dtype code, shape, byte length), with `metadata` first under `__metadata__`:
    little-endian u64 length + compact JSON padded with spaces to a multiple of 8 bytes."""
    entries: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape, nbytes in tensors:
        entries[key] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def entry_bytes(spec: TensorSpec, prefix: str, offset_digits: int) -> int:
    """Bytes of `spec`'s entry in a header from `encode_header` (the writer's `prefix` on text
    tensors): exact but for its two offsets, each taken as `offset_digits` long."""
    key = len(stored_key(spec, prefix))
    shape = sum(len(str(d)) for d in spec.shape) + max(len(spec.shape) - 1, 0)
    return key + len(spec.dtype) + shape + 2 * offset_digits + 1 + _ENTRY_FIXED


def length_prefix(raw: bytes) -> int:
    """The header length stated by a shard's first 8 bytes."""
    return struct.unpack("<Q", raw)[0]


@contextlib.contextmanager
def no_gc():
    """Pause the cyclic garbage collector while building many small objects: json.loads of a
    large header otherwise triggers repeated full collections (half of the parse time)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass
class Shard:
    """One safetensors file: where its data region starts, its stored tensor keys (in header
    order) and, once parsed, their validated TensorInfos by name."""

    path: str
    base: int  # absolute offset of the data region (8 + header length)
    size: int  # file size in bytes
    keys: list[str]
    n_prefixed: int = 0  # how many keys carry the text prefix
    infos: dict[str, TensorInfo] | None = field(default=None, repr=False)


def _read_text(path: str) -> tuple[str, int, int]:
    """A shard's header JSON text, data-region start and file size (one or two preads)."""
    fd, size = open_regular(path, "shard")
    try:
        head = os.pread(fd, _FIRST_READ, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors header ({size} bytes)")
        n = length_prefix(head[:8])
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {n} exceeds the limit of "
                                  f"{MAX_HEADER_BYTES} bytes")
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} beyond file size {size}")
        raw = head[8 : 8 + n]
        if len(raw) < n:  # a header longer than the first read
            raw += os.pread(fd, n - len(raw), len(head))
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: invalid safetensors JSON header ({e})") from None
    if not text.lstrip().startswith("{") or not text.rstrip().endswith("}"):
        raise CheckpointError(f"{path}: invalid safetensors JSON header (not a JSON object)")
    return text, 8 + n, size


def parse_header(where: str, text: str | bytes) -> dict:
    """A safetensors header's JSON -> its tensor entries (`__metadata__`, which must map strings
    to strings, removed); CheckpointError naming `where` on anything else."""
    try:
        header = json.loads(text)
    except ValueError as e:  # UnicodeDecodeError included
        raise CheckpointError(f"{where}: invalid safetensors JSON header ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{where}: invalid safetensors JSON header (nested too deeply)"
                              ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"{where}: __metadata__ must map strings to strings")
    return header


def _fast_keys(text: str) -> tuple[list[str], int] | None:
    """(tensor keys, how many carry the prefix) of a canonical header; None when not canonical."""
    if "\\" in text:  # escaped characters: only a real JSON parser gets these right
        return None
    tok = text.split('"')  # [T]
    limit = min(len(tok) - 2, 64)  # the metadata before the first key is short
    first = next((i for i in range(1, limit) if tok[i + 1 : i + 3] == [":{", "dtype"]), None)
    if first is None:
        return None
    n, rest = divmod(len(tok) - first, _TOKENS)
    if rest or any(tok[first + j :: _TOKENS].count(lit) != n for j, lit in _FIXED.items()):
        return None
    start = sum(map(len, tok[:first])) + first - 1  # offset of the first key's opening quote
    return tok[first::_TOKENS], text.count('"' + TEXT_PREFIX, start)  # [n] every tenth token


def scan_shard(path: str) -> tuple[Shard, dict | None]:
    """Read one shard's header: (Shard with its keys, the parsed header when the fast scan had
    to fall back to json.loads, else None)."""
    text, base, size = _read_text(path)
    fast = _fast_keys(text)
    header = None
    if fast is None:
        header = parse_header(path, text)
        keys = list(header)
        fast = keys, sum(k.startswith(TEXT_PREFIX) for k in keys)
    return Shard(path, base, size, *fast), header


def _entry(where: str, key: str, entry: object) -> tuple[str, tuple, int, int]:
    """(dtype, shape, begin, end) of one header entry, with the types safetensors requires."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: tensor {key}: malformed header entry (not an object)")
    missing = next((f for f in ("dtype", "shape", "data_offsets") if f not in entry), None)
    if missing is not None:
        raise CheckpointError(f"{where}: tensor {key}: malformed header entry (no {missing})")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise CheckpointError(f"{where}: tensor {key}: unknown dtype {dtype!r}")
    # type(...) is int: JSON floats (2.0) and booleans compare and hash equal to ints
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: tensor {key}: bad shape {shape!r} (non-negative "
                              "integers only)")
    if (type(offsets) is not list or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: tensor {key}: bad data_offsets {offsets!r} (two "
                              "non-negative integers)")
    return dtype, tuple(shape), offsets[0], offsets[1]


def check_entries(where: str, header: dict, base: int, size: int,
                  file: str | None = None) -> dict[str, TensorInfo]:
    """Validated TensorInfos (in `file`, default `where`) by name of a parsed header (from
    `parse_header`) whose data region is bytes [base, size) of the file. Checks what the
    safetensors library checks: known dtypes, integer shapes and offsets, each byte length
    = dtype size x shape, and the entries, ordered by offset, tiling the data region exactly
    (no overlap, no gap, nothing after the last). The one check for local and remote shards."""
    file = where if file is None else file
    region = size - base
    nbytes: dict[tuple[str, tuple], int] = {}  # shapes repeat: compute each (dtype, shape) once
    infos = {}
    for key, entry in header.items():
        dtype, shape, b, e = _entry(where, key, entry)
        nb = nbytes.get((dtype, shape))
        if nb is None:
            nb = nbytes[dtype, shape] = DTYPE_SIZES[dtype] * math.prod(shape)
        if not b <= e <= region:
            raise CheckpointError(f"{where}: tensor {key}: offsets [{b}, {e}] outside the "
                                  f"data region of {region} bytes")
        if e - b != nb:
            raise CheckpointError(f"{where}: tensor {key}: {e - b} bytes do not hold {dtype} "
                                  f"{list(shape)}")
        name = key.removeprefix(TEXT_PREFIX)
        # tuple.__new__ skips NamedTuple's Python-level __new__: half the cost per tensor
        infos[name] = _new_tuple(TensorInfo, (name, key, dtype, shape, file, base + b, base + e))
    _check_tiling(where, infos, base, size)
    return infos


def _check_tiling(where: str, infos: dict[str, TensorInfo], base: int, size: int) -> None:
    """The tensors' byte ranges cover [base, size) exactly, without overlap."""
    at, last = base, None
    for start, end, key in sorted((t.start, t.end, t.key) for t in infos.values()):
        if start < at:
            raise CheckpointError(f"{where}: tensors {last} and {key} overlap")
        if start > at:
            raise CheckpointError(f"{where}: data_offsets: bytes {at - base}-{start - base} "
                                  f"before tensor {key} belong to no tensor")
        at, last = end, key
    if at != size:
        raise CheckpointError(f"{where}: data_offsets: the header describes a file of {at} bytes, "
                              f"but it has {size} (wrong header length, or bytes after the last "
                              "tensor)")


def parse_shard(shard: Shard, header: dict | None = None) -> dict[str, TensorInfo]:
    """Fully parse and validate one shard (re-reading its header unless given); the result is
    cached on the shard. Raises CheckpointError naming the file and tensor."""
    if shard.infos is not None:
        return shard.infos
    if header is None:
        text, base, size = _read_text(shard.path)
        if (base, size) != (shard.base, shard.size):
            raise CheckpointError(f"{shard.path}: shard changed since the checkpoint was opened")
        with no_gc():
            header = parse_header(shard.path, text)
    if list(header) != shard.keys:
        raise CheckpointError(f"{shard.path}: header keys differ from the scanned keys")
    with no_gc():
        shard.infos = check_entries(shard.path, header, shard.base, shard.size)
    return shard.infos


def load_json(path: Path, what: str, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object file (config, index) of at most `limit` bytes, or a CheckpointError
    naming it."""
    try:
        data = json.loads(read_regular(path, what, limit))
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON in {what} ({e})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: invalid JSON in {what} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def load_index(path: Path) -> dict[str, str]:
    """The weight_map (stored key -> shard file name) of an index file; every name a plain
    shard file name (`shard_name`)."""
    with no_gc():
        weight_map = load_json(path, "index", MAX_INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: index has no weight_map")
    if set(map(type, weight_map.values())) - {str}:
        bad = next(v for v in weight_map.values() if not isinstance(v, str))
        shard_name(bad, str(path))
    for name in set(weight_map.values()):
        shard_name(name, str(path))
    return weight_map
