"""Checkpoint store: the only code that knows safetensors file layouts.

Reading (`Checkpoint`, in `reader.py`) pulls tensors by name from a lazily indexed checkpoint:
a Hugging Face style directory, a directory holding one `model.safetensors`, or a single
`.safetensors` file. Opening parses only the safetensors headers (8-byte little-endian length
+ JSON); tensor bytes come from positioned reads, never by loading or mapping whole shards.

Writing (`CheckpointWriter`, in `writer.py`) streams tensors, declared up front as
`TensorSpec`s, into deterministic shards under `<out>.partial/` and renames the directory into
place on `close()`; a killed job resumes from the shards it completed.

Fused tensors: `X[e]` names slice e of a stored tensor X along its first axis (a fused expert
tensor [E, ...] addressed one expert at a time); `Checkpoint.tensors` resolves such views on
lookup to the slice's byte range, while iteration lists only the stored names.

Names: a tensor's `name` never carries the `language_model.` prefix that the release puts on
text tensors; the stored `key` does. Vision tensors (component "vision") keep their names.
"""

from reap.checkpoint.reader import Checkpoint, file_size
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
    "Checkpoint",
    "CheckpointWriter",
    "TensorInfo",
    "TensorSpec",
    "file_size",
    "split_view",
    "view_name",
]
