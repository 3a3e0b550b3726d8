"""The expert-matmul interface: how model code multiplies by a weight matrix that may be stored
quantized. A quantized matrix is a typed record of its codec's tensors (`MXFP4Matrix`,
`reap.quant.int4.INT4Matrix`) with `linear(x)`, `dense(dtype)` and `shape`; nothing imitates a
tensor. A family's `expert_matrices(tensors)` pairs one routed expert's stored tensors into
records, to which the engine attaches its kernels and whose bytes it checks (`check_matrices`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, Union

import torch

from reap.errors import ReapError


class QuantizedMatrix(Protocol):
    """A weight matrix W [O, I] stored by a codec (`reap.quant.mxfp4.MXFP4Matrix`,
    `reap.quant.int4.INT4Matrix`)."""

    def linear(self, x: torch.Tensor) -> torch.Tensor: ...  # x [..., I] @ W.T, x's dtype

    def check(self, what: str) -> None: ...  # ReapError if its stored bytes cannot be right


Matrix = Union[torch.Tensor, QuantizedMatrix]
# the largest decoded weight the checks accept: trained ones are O(1); a GLU multiplies two
# projections, so weights this large near fp32/bf16's 3.4e38 within a layer or two
MAX_WEIGHT = 2.0**16


def check_matrices(weights: Mapping[str, Matrix]) -> None:
    """Raise ReapError naming the first corrupt matrix of `weights` (dense ones: `check_range`)."""
    for name, w in weights.items():
        if not isinstance(w, torch.Tensor):
            w.check(name)
        elif w.is_floating_point() and w.element_size() > 1:  # FP8 holds no Inf
            check_range(w, name)


def check_range(t: torch.Tensor, what: str, code_max: float = 1.0) -> None:
    """ReapError naming `what` unless every value of float tensor `t` (a codec's scales: times
    its largest code `code_max`) is finite and within +-MAX_WEIGHT; one pass, no copy."""
    lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
    if not -MAX_WEIGHT <= float(lo) * code_max <= float(hi) * code_max <= MAX_WEIGHT:
        span = f"[{float(lo):g}, {float(hi):g}]" + f" x {code_max:g}" * (code_max != 1)
        raise ReapError(f"{what}: values {span}: Inf or NaN, or beyond +-{MAX_WEIGHT:g}: corrupt")


def stored_matrices(tensors: Mapping[str, torch.Tensor]) -> dict[str, Matrix]:
    """`expert_matrices` of a family whose expert weights are used as stored (dense, or decoded
    by the family's own expert code): the tensors unchanged."""
    return dict(tensors)
