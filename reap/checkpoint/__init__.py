"""Checkpoint store: the only code that knows safetensors and index file layouts (local, over
HTTP or on the Hugging Face Hub), and the only code that builds or parses a safetensors header.

`Checkpoint` (`reader.py`) pulls tensors by name from a lazily indexed checkpoint (`table.py`): an
HF directory, a directory holding one `model.safetensors`, or a `.safetensors` file. Opening
parses only the headers (`header.py`); tensor bytes come from positioned reads (`files.py`), into
long-lived buffers for the engine (`BufferReader`, `buffers.py`). `RemoteCheckpoint` (`remote.py`,
`http_range.py`) reads http(s) URLs by Range requests into a resumable cache; `hub.py` turns Hub
repo ids into a Hub cache snapshot or a Hub URL, and its `open_checkpoint` picks the backend.
Validation is one code path for all (`header.check_entries`, the index against the shards,
regular files only, size caps in `spec.py`): every invalid input is a `CheckpointError` (exit 2).
`CheckpointWriter` (`writer.py`) writes deterministic shards atomically and resumably.

Names: `X[e]` is slice e of a stored tensor X along its first axis (a fused expert tensor
[E, ...]); a tensor's `name` never carries the release's `language_model.` text prefix, its
stored `key` does.
"""

from reap.checkpoint.buffers import BufferReader
from reap.checkpoint.header import encode_header, entry_bytes
from reap.checkpoint.hub import open_checkpoint
from reap.checkpoint.reader import Checkpoint
from reap.checkpoint.remote import RemoteCheckpoint, default_cache_dir, is_url
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

__all__ = ["DTYPE_CODES", "DTYPE_SIZES", "INDEX_NAME", "SINGLE_NAME", "TEXT_PREFIX", "TORCH_DTYPES",
           "BufferReader", "Checkpoint", "CheckpointWriter", "RemoteCheckpoint", "TensorInfo",
           "TensorSpec", "default_cache_dir", "encode_header", "entry_bytes", "is_url",
           "open_checkpoint", "split_view", "view_name"]
