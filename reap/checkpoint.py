"""Checkpoint store: the only code that knows safetensors file layouts.

(Being built: TensorSpec is the shared contract; the reader and writer land next.)
"""

from __future__ import annotations

from dataclasses import dataclass

# safetensors dtype code -> bytes per element
DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint layout: name (without any `language_model.` prefix),
    safetensors dtype code, shape, and where it belongs (for size census and pruning).

    component: routed_experts | shared_experts | latent_proj | router | kda | mla |
    dense_mlp | embed_head | attn_res | norms | vision | other.
    layer: decoder layer index or None; expert: routed expert id or None.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    component: str = "other"
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]
