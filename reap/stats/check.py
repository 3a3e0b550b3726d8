"""Validation of a statistics file's header and tensors before an `ExpertStats` is built from
them: every field the header declares has the JSON type it must have (no float, bool or negative
counts), and every tensor has the shape and dtype the header implies. Failures are `ReapError`
(exit 2) naming the file and the field. `nonfinite` also serves calibration's check before it
writes statistics."""

from __future__ import annotations

import torch

from reap.errors import ReapError, is_int

# the largest counts a header may declare: more experts or layers than any model has
MAX_EXPERTS = 1 << 20
MAX_LAYERS = 1 << 16


def _int_field(path: str, head: dict, name: str, low: int, high: int | None = None) -> int:
    v = head.get(name)
    if not is_int(v) or v < low or (high is not None and v > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ReapError(f"{path}: field {name}: {v!r} is not an integer {bound}")
    return v


def check_header(path: str, head: dict) -> None:
    """The header's layers, n_experts, top_k, tokens and meta have valid types and ranges."""
    layers = head.get("layers")
    if (not isinstance(layers, list) or not layers or len(layers) > MAX_LAYERS
            or not all(is_int(x) and 0 <= x < MAX_LAYERS for x in layers)):
        raise ReapError(f"{path}: field layers: not a non-empty list of layer numbers")
    if len(set(layers)) != len(layers):
        raise ReapError(f"{path}: field layers: a layer is listed twice")
    n_experts = _int_field(path, head, "n_experts", 1, MAX_EXPERTS)
    _int_field(path, head, "top_k", 1, n_experts)
    _int_field(path, head, "tokens", 0, 2**63 - 1)
    if not isinstance(head.get("meta", {}), dict):
        raise ReapError(f"{path}: field meta: not a JSON object")


def check_shapes(path: str, head: dict, tensors: dict[str, torch.Tensor], fields: list) -> None:
    """Each statistics tensor of `fields` (`reap.stats.sum_fields()`) is [L, E] ([L, E, E] for
    coact and prob_gram, [L, E, Dx] for out_sum, [S, L, E] for seq_count), integer where its
    declared dtype is, no count negative and no sum NaN or infinite."""
    L, E = len(head["layers"]), head["n_experts"]
    for f in fields:
        t = tensors.get(f.name)
        if t is None:
            continue
        first, last = (t.shape[0], t.shape[-1]) if t.dim() else (-1, -1)
        want = {"coact": (L, E, E), "prob_gram": (L, E, E), "out_sum": (L, E, last),
                "seq_count": (first, L, E)}
        shape = want.get(f.name, (L, E))
        if tuple(t.shape) != shape:
            raise ReapError(f"{path}: tensor {f.name}: shape {list(t.shape)}, the header "
                            f"implies {list(shape)}")
        if t.is_floating_point() != f.metadata["dtype"].is_floating_point:
            raise ReapError(f"{path}: tensor {f.name}: dtype {t.dtype}, expected "
                            f"{f.metadata['dtype']}")
        if not t.is_floating_point() and t.numel() and int(t.min()) < 0:
            raise ReapError(f"{path}: tensor {f.name}: negative counts")
    bad = nonfinite(tensors)
    if bad:
        raise ReapError(f"{path}: tensor {bad[0]}: NaN or infinite values (first at {bad[1]})")


def nonfinite(tensors: dict[str, torch.Tensor]) -> tuple[str, list[int]] | None:
    """(name, index) of the first NaN or infinite value of the floating tensors, or None."""
    for name, t in tensors.items():
        bad = (~torch.isfinite(t)).nonzero() if t.is_floating_point() else ()
        if len(bad):
            return name, bad[0].tolist()
    return None
