"""The expert-matmul interface: how model code multiplies by a weight matrix that may be stored
quantized. A quantized matrix is a typed record of its codec's tensors (`MXFP4Matrix`,
`reap.quant.int4.INT4Matrix`) with `linear(x)`; `reap.models.blocks.linear(x, w)` calls it, or does the dense matmul for a tensor.
Nothing imitates a tensor: code that needs the values asks for `dense(dtype)`.

A family's `expert_matrices(tensors)` turns one routed expert's stored tensors (short names) into
its weights, pairing each quantized matrix's tensors into its record; the engine attaches its
kernels to those records (`reap.quant.mxfp4_matmul.MXFP4Kernels.attach`) and checks their bytes
(`check_matrices`). A new codec adds one record class with these two methods (and `dense`,
`shape`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Union

import torch


class QuantizedMatrix(Protocol):
    """A weight matrix W [O, I] stored by a codec (`reap.quant.mxfp4.MXFP4Matrix`,
    `reap.quant.int4.INT4Matrix`)."""

    def linear(self, x: torch.Tensor) -> torch.Tensor: ...  # x [..., I] @ W.T, x's dtype

    def check(self, what: str) -> None: ...  # ReapError if its stored bytes cannot be right


Matrix = Union[torch.Tensor, QuantizedMatrix]


def check_matrices(weights: Mapping[str, Matrix]) -> None:
    """Raise ReapError naming the first quantized matrix of `weights` whose bytes are corrupt."""
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor):
            w.check(name)


def stored_matrices(tensors: Mapping[str, torch.Tensor]) -> dict[str, Matrix]:
    """`expert_matrices` of a family whose expert weights are used as stored (dense, or decoded
    by the family's own expert code): the tensors unchanged."""
    return dict(tensors)
