"""Checkpoint vocabulary shared by the reader and the writer: dtype tables, `TensorSpec` (a
declared tensor of a layout) and `TensorInfo` (where a stored tensor lives)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch

from reap.errors import CheckpointError

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
    "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_SIZES = {code: dtype.itemsize for code, dtype in TORCH_DTYPES.items()}
DTYPE_CODES = {v: k for k, v in TORCH_DTYPES.items()}

TEXT_PREFIX = "language_model."
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SHARD_SUFFIX = ".safetensors"

# Size caps, checked before anything is read whole (a local file) or while it streams (remote):
MAX_HEADER_BYTES = 100_000_000  # a safetensors header, the safetensors library's own cap
MAX_INDEX_BYTES = 256 << 20  # an HF index (K3's 497,220 entries take 59 MB)
MAX_JSON_BYTES = 16 << 20  # config.json and the other small metadata files
MAX_TOKENIZER_BYTES = 64 << 20  # tokenizer.json, tiktoken.model

# A shard file name from an index: a plain name inside the checkpoint directory (no separators,
# no `..`, not hidden), ending in .safetensors.
_SHARD_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


def shard_name(name: object, where: str) -> str:
    """`name` if it is a plain shard file name (see `_SHARD_NAME`), else CheckpointError naming
    `where`, the file that named it."""
    if (not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or ".." in name
            or not name.endswith(SHARD_SUFFIX)):
        raise CheckpointError(f"{where}: weight_map: unsafe file name {name!r} for a shard "
                              f"(plain *{SHARD_SUFFIX} names inside the directory only)")
    return name


# `X[e]` names slice e of a stored tensor X along its first axis (a fused expert tensor [E, ...])
_VIEW = re.compile(r"^(.+)\[(\d+)\]$")


def view_name(base: str, index: int) -> str:
    """The view name of slice `index` of stored tensor `base` along axis 0: `base[index]`."""
    return f"{base}[{index}]"


def split_view(name: str) -> tuple[str, int | None]:
    """(stored name, slice index) of a view name `X[e]`; (name, None) for a plain name."""
    m = _VIEW.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


# Components a layout lists that the text model never reads, e.g. "mtp" (a multi-token-prediction
# layer, kept for speculative decoding): the engine and calibration skip them, sizes count them
# in the totals but not in the active parameters, and `reap prune` leaves them out.
UNUSED_COMPONENTS = frozenset({"mtp"})

# What a tensor's elements hold (TensorSpec.role, declared by the family layouts) -> the weights
# each stores, for the size model, the engine's byte census and `reap synth`. Plain weights: a
# "weight" (matrix, bias, sink), or one synth draws its own way: "embedding", "norm", "conv",
# "router_bias", KDA's "decay_log"/"decay_bias"/"decay_proj" (A_log, dt_bias, f_b_proj).
# Quantized "codec.part": "mxfp4.blocks" (two E2M1 codes a byte: `weight_packed`, `_blocks`) with
# "mxfp4.scales" (E8M0); "fp8.weight" (F8_E4M3) with "fp8.scales" (F32 `weight_scale_inv`);
# compressed-tensors INT4 (`reap.quant.int4`): "int4.packed" (eight 4-bit codes an I32 word:
# `weight_packed`) with "int4.scales" (`weight_scale`) and "int4.shape" (`weight_shape`).
_ONE_EACH = "weight embedding norm conv router_bias decay_log decay_bias decay_proj fp8.weight"
_QUANTIZED = {"mxfp4.blocks": 2, "mxfp4.scales": 0, "fp8.scales": 0}
_QUANTIZED |= {"int4.packed": 8, "int4.scales": 0, "int4.shape": 0}
ROLE_WEIGHTS = dict.fromkeys(_ONE_EACH.split(), 1) | _QUANTIZED


def is_quantized(role: str) -> bool:
    """Whether tensors of `role` are a quantization codec's part ("codec.part"): decoded before
    use, so a resident copy costs their bytes plus their `weights` decoded."""
    return "." in role


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint layout: name (without any `language_model.` prefix),
    safetensors dtype code, shape, and where it belongs (for size census and pruning).

    component: routed_experts | shared_experts | latent_proj | router | kda | mla | attention
    (softmax GQA) | dense_mlp | embed_head | attn_res | norms | vision | mtp (see
    UNUSED_COMPONENTS) | other.
    layer: decoder layer index or None; expert: routed expert id or None.
    role: what its elements hold, a key of ROLE_WEIGHTS (default "weight").
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    component: str = "other"
    layer: int | None = None
    expert: int | None = None
    role: str = "weight"
    block: tuple[int, int] | None = None  # an "fp8.weight"'s scale block (rows, cols)

    @property
    def weights(self) -> int:
        """Weights the tensor holds: two per MXFP4 block byte, eight per INT4 word, none in a
        scale (ROLE_WEIGHTS)."""
        return self.numel * ROLE_WEIGHTS[self.role]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


def stored_key(spec: TensorSpec, prefix: str) -> str:
    """The key a tensor is stored under: text tensors carry the checkpoint's `prefix`."""
    return spec.name if spec.component == "vision" else prefix + spec.name


class TensorInfo(NamedTuple):
    """Where one stored tensor lives: `start`/`end` are absolute byte offsets in `file`."""

    name: str  # without the text prefix
    key: str  # as stored in the file
    dtype: str  # safetensors dtype code
    shape: tuple[int, ...]
    file: str  # absolute path of the shard
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start
