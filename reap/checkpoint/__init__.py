"""Checkpoint store: the only code that knows safetensors and index file layouts, local or over
HTTP, and the only code that builds or parses a safetensors header.

`Checkpoint` (`reader.py`) pulls tensors by name from a lazily indexed checkpoint (`table.py`): a
Hugging Face style directory, a directory holding one `model.safetensors`, or a single
`.safetensors` file. Opening parses only the headers (`header.py`: 8-byte little-endian length +
JSON); tensor bytes come from positioned reads (`files.py`: one read per run of adjacent
tensors, O_DIRECT with fallback), never by loading or mapping whole shards. `BufferReader`
(`buffers.py`) reads the same way into long-lived caller buffers, for the streaming engine.
`RemoteCheckpoint` (`remote.py`, `http_range.py`) is the backend for http(s) URLs: Range
requests into a resumable disk cache; `open_checkpoint` picks the backend for a path or URL.

Validation is one code path for both: `header.check_entries` (the safetensors library's rules:
integer shapes and offsets, byte lengths, entries tiling the data region exactly), the index
checked against the shards at open, regular files only, size caps (`spec.py`). Every invalid
input is a `CheckpointError` (exit 2) naming the file and the field.

`CheckpointWriter` (`writer.py`) streams tensors, declared up front as `TensorSpec`s, into
deterministic shards under `<out>.partial/` and renames the directory into place on `close()`;
a killed job resumes from the shards it completed. `encode_header` builds every header reap
writes; `entry_bytes` predicts its size.

Fused tensors: `X[e]` names slice e of a stored tensor X along its first axis (a fused expert
tensor [E, ...] addressed one expert at a time); `Checkpoint.tensors` resolves such views on
lookup to the slice's byte range, while iteration lists only the stored names.

Names: a tensor's `name` never carries the `language_model.` prefix that the release puts on
text tensors; the stored `key` does. Vision tensors (component "vision") keep their names.
"""

from reap.checkpoint.buffers import BufferReader
from reap.checkpoint.header import encode_header, entry_bytes
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.remote import RemoteCheckpoint, default_cache_dir, is_url, open_checkpoint
from reap.checkpoint.spec import (
    DTYPE_CODES,
    DTYPE_SIZES,
    INDEX_NAME,
    SINGLE_NAME,
    TEXT_PREFIX,
    TORCH_DTYPES,
    TensorInfo,
    TensorSpec,
    split_view,
    view_name,
)
from reap.checkpoint.writer import CheckpointWriter

__all__ = [
    "DTYPE_CODES",
    "DTYPE_SIZES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "TEXT_PREFIX",
    "TORCH_DTYPES",
    "BufferReader",
    "Checkpoint",
    "CheckpointWriter",
    "RemoteCheckpoint",
    "TensorInfo",
    "TensorSpec",
    "default_cache_dir",
    "encode_header",
    "entry_bytes",
    "is_url",
    "open_checkpoint",
    "split_view",
    "view_name",
]
