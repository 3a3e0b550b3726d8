"""safetensors headers and HF index files: build, read, scan fast, parse strictly.

`encode_header` is the one place a header is built (the checkpoint writer, calibration's token
expert file) and `entry_bytes` its size estimate (`reap.sizes`); `length_prefix` and
`described_size` read the framing of a header fetched piecewise (remote checkpoints).

Opening a 497,220-tensor checkpoint must take well under a second, and fully parsing ~76 MB of
header JSON into Python objects does not (several seconds). So opening is two-tier:

- `scan_shard` reads a shard's header with one positioned read, checks its framing (length
  prefix, size, JSON object) and extracts only the tensor keys. On the canonical compact form
  that the safetensors library and our writer emit (`"key":{"dtype":..,"shape":..,
  "data_offsets":..}`), the header split at its quotes has exactly ten tokens per tensor, so
  keys are one slice and the form is verified with C-level list counts. Anything else
  (escapes, whitespace, another key order) falls back to `json.loads`.
- `parse_shard` fully parses and validates one shard (dtype, byte length, bounds, overlaps) the
  first time any of its tensors is used, and checks its keys against the scan.
- `count_index_entries` counts an HF index's entries without building its weight map;
  `load_index` parses it exactly when the counts disagree or when validating.

Names: a tensor's name is its key without the `language_model.` prefix, where it has one.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from reap.checkpoint.spec import DTYPE_SIZES, TEXT_PREFIX, TensorInfo, TensorSpec, stored_key
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


def described_size(header: bytes) -> int | None:
    """The file size a header (the JSON after the length prefix) describes: 8 + its length +
    the largest tensor end offset; None when it is not a valid header."""
    try:
        ends = [v["data_offsets"][1] for k, v in json.loads(header).items()
                if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
    return 8 + len(header) + max(ends, default=0)


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
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open shard ({e.strerror})") from None
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _FIRST_READ, 0)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors header ({size} bytes)")
        n = length_prefix(head[:8])
        if n > size - 8:
            raise CheckpointError(f"{path}: header length {n} beyond file size {size}")
        raw = (
            head[8 : 8 + n]
            if 8 + n <= len(head)
            else head[8:] + os.pread(fd, n + 8 - len(head), len(head))
        )
    finally:
        os.close(fd)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: invalid safetensors JSON header ({e})") from None
    if not text.lstrip().startswith("{") or not text.rstrip().endswith("}"):
        raise CheckpointError(f"{path}: invalid safetensors JSON header (not a JSON object)")
    return text, 8 + n, size


def _loads(path: str, text: str) -> dict:
    try:
        header = json.loads(text)
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid safetensors JSON header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
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
        header = _loads(path, text)
        keys = list(header)
        fast = keys, sum(k.startswith(TEXT_PREFIX) for k in keys)
    return Shard(path, base, size, *fast), header


def _nbytes(path: str, key: str, dtype: str, shape: tuple) -> int:
    """Bytes a tensor of this dtype and shape must occupy (validates both)."""
    itemsize = DTYPE_SIZES.get(dtype)
    if itemsize is None:
        raise CheckpointError(f"{path}: tensor {key}: unknown dtype {dtype!r}")
    n = itemsize
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise CheckpointError(f"{path}: tensor {key}: bad shape {list(shape)}")
        n *= d
    return n


def _entries(shard: Shard, header: dict) -> dict[str, TensorInfo]:
    """Validated TensorInfos of a parsed header, by name."""
    path, base, region = shard.path, shard.base, shard.size - shard.base
    nbytes: dict[tuple[str, tuple], int] = {}  # shapes repeat: validate each (dtype, shape) once
    infos = {}
    for key, entry in header.items():
        try:
            dtype, shape, (b, e) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            nb = nbytes.get((dtype, shape))
            if nb is None:
                nb = nbytes[dtype, shape] = _nbytes(path, key, dtype, shape)
            if not 0 <= b <= e <= region:
                raise CheckpointError(
                    f"{path}: tensor {key}: offsets [{b}, {e}] outside the "
                    f"data region of {region} bytes"
                )
            if e - b != nb:
                raise CheckpointError(
                    f"{path}: tensor {key}: {e - b} bytes do not hold {dtype} {list(shape)}"
                )
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {key}: malformed header entry") from None
        name = key.removeprefix(TEXT_PREFIX)
        # tuple.__new__ skips NamedTuple's Python-level __new__: half the cost per tensor
        infos[name] = _new_tuple(TensorInfo, (name, key, dtype, shape, path, base + b, base + e))
    return infos


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
            header = _loads(shard.path, text)
    if list(header) != shard.keys:
        raise CheckpointError(f"{shard.path}: header keys differ from the scanned keys")
    with no_gc():
        infos = _entries(shard, header)
    spans = sorted((t.start, t.end, t.key) for t in infos.values())
    for (_, e0, k0), (b1, _, k1) in itertools.pairwise(spans):
        if b1 < e0:
            raise CheckpointError(f"{shard.path}: tensors {k0} and {k1} overlap")
    shard.infos = infos
    return infos


def load_json(path: Path, what: str) -> dict:
    """A JSON object file (config, index) or a CheckpointError naming it."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid JSON in {what} ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def load_index(path: Path) -> dict[str, str]:
    """The exact weight_map (stored key -> shard file name) of an index file."""
    with no_gc():
        weight_map = load_json(path, "index").get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{path}: index has no weight_map")
    return weight_map


def count_index_entries(path: Path) -> int:
    """The number of shard references in an index (its entries), without parsing it."""
    try:
        return path.read_bytes().count(b'.safetensors"')
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read index ({e.strerror})") from None
