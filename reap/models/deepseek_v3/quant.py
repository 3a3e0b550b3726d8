"""The quantization of DeepSeek-V3-style releases (`reap.models.deepseek_v3.family` and the families
built on it, e.g. Kimi K2.5-style `kimi_k25`): which Linear weights a checkpoint stores
quantized, under which tensor names, and how they are read back.

- block-scaled FP8 (DeepSeek-V3 / Kimi K2 releases, quant_method "fp8"): an F8_E4M3 weight with
  F32 `weight_scale_inv` per (b0 x b1) block (`reap.quant.fp8`);
- compressed-tensors pack-quantized INT4 (Kimi-K2-Thinking's routed experts, quant_method
  "compressed-tensors"): `weight_packed` / `weight_scale` / `weight_shape` (`reap.quant.int4`);
  which modules are quantized follows the config's targets and ignore list, as
  compressed-tensors matches them ("Linear" is every torch Linear: the `*_proj` projections and
  `lm_head`; the MoE router is not one).

`Quant.from_config(text)` decides once per config (ConfigError, exit 2, for what it cannot read).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from reap.checkpoint import TensorSpec
from reap.errors import ReapError
from reap.models import validate
from reap.models.base import Weights
from reap.quant import fp8, int4
from reap.quant.matrix import Matrix


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fp8_block(q: dict) -> tuple[int, int]:
    """`weight_block_size` of an FP8 quantization_config (default 128 x 128), checked."""
    block = q.get("weight_block_size")
    if block is None:
        return (128, 128)
    if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
        raise validate.ConfigError(
            "quantization_config.weight_block_size", f"must be two ints >= 1 (got {block!r})"
        )
    return tuple(block)


# -- quantization: which weights a release stores quantized, and how ---------------------------
# torch Linear weights (the modules compressed-tensors' "Linear" target matches), module group 1
_LINEAR_RE = re.compile(r"^(model\.layers\.\d+\..*_proj(?:_with_mqa)?|lm_head)\.weight$")
_FP8_RE = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")  # FP8 releases
# an INT4 weight [O, I] as stored: (suffix replacing "weight", dtype or None: the scales', role)
INT4_PARTS = (
    ("weight_packed", "I32", "int4.packed"),  # [O, ceil(I/8)]
    ("weight_scale", None, "int4.scales"),  # [O, I/group]
    ("weight_shape", "I32", "int4.shape"),  # [2]
)


@dataclass(frozen=True)
class Quant:
    """How a DeepSeek-V3-style checkpoint stores its Linear weights, read from the text config's
    `quantization_config`: block-scaled FP8, compressed-tensors pack-quantized INT4, or plain.
    Families built on this one reuse it."""

    fp8_block: tuple[int, int] | None = None
    fp8_skip: tuple[str, ...] = ()
    int4: int4.Int4Scheme | None = None

    @classmethod
    def from_config(cls, text: dict) -> Quant:
        """The scheme of a text config dict (a multimodal release passes its text config with the
        `quantization_config` it has, wherever it sits); ConfigError (exit 2) naming the key it
        cannot read. Module names are matched without any `language_model.` prefix."""
        q = text.get("quantization_config")
        if not q:
            return cls()
        if not isinstance(q, dict):
            raise validate.ConfigError("quantization_config", "must be an object")
        method = q.get("quant_method")
        if method == "fp8":  # the MTP projection is BF16 in the FP8 releases
            skip = (*(q.get("modules_to_not_convert") or ()), "eh_proj")
            return cls(fp8_block=_fp8_block(q), fp8_skip=skip)
        if method == "compressed-tensors":
            try:
                return cls(int4=int4.Int4Scheme.parse(q))
            except int4.SchemeError as e:
                raise validate.ConfigError(e.field, e.detail) from None
        raise validate.ConfigError(
            "quantization_config.quant_method",
            f"{method!r} is not supported (fp8, compressed-tensors pack-quantized)",
        )

    def is_fp8(self, name: str) -> bool:
        """Whether weight `name` is stored FP8 (with `name + "_scale_inv"` next to it)."""
        skip = self.fp8_skip
        return bool(self.fp8_block and _FP8_RE.match(name) and not any(m in name for m in skip))

    def is_int4(self, name: str) -> bool:
        """Whether weight `name` is stored as INT4's three tensors (`INT4_PARTS`)."""
        m = self.int4 and _LINEAR_RE.match(name)
        return bool(m and self.int4.quantizes(m.group(1), linear=True))

    def stored_names(self, name: str) -> list[str]:
        """The tensors weight `name` is stored as, in file order."""
        if self.is_fp8(name):
            return [name, name + "_scale_inv"]
        if self.is_int4(name):
            return [name.removesuffix("weight") + part for part, _, _ in INT4_PARTS]
        return [name]

    def stored(self, s: TensorSpec) -> list[TensorSpec]:
        """Spec `s` [O, I] as stored: itself, an FP8 weight with its F32 block scales
        [ceil(O/b0), ceil(I/b1)], or INT4's packed words, scales (in `s`'s dtype) and shape."""
        if self.is_fp8(s.name):
            (O, I), (b0, b1) = s.shape, self.fp8_block
            scale = replace(s, name=s.name + "_scale_inv", dtype="F32", role="fp8.scales",
                            shape=(-(-O // b0), -(-I // b1)))  # fmt: skip
            return [replace(s, dtype="F8_E4M3", role="fp8.weight", block=self.fp8_block), scale]
        if not self.is_int4(s.name):
            return [s]
        (O, I), group = s.shape, self.int4.group
        if I % group:
            raise ReapError(f"{s.name}: width {I} is not a multiple of INT4 group_size {group}")
        shapes = ((O, -(-I // int4.PER_WORD)), (O, I // group), (2,))
        names = self.stored_names(s.name)
        return [
            replace(s, name=n, dtype=dtype or s.dtype, shape=shape, role=role)
            for n, (_, dtype, role), shape in zip(names, INT4_PARTS, shapes)
        ]

    def load(self, get: Weights, name: str) -> Matrix:
        """Weight `name` pulled through `get`: the tensor (FP8 decoded to float32), or an
        `INT4Matrix` of its three stored tensors."""
        if self.is_fp8(name):
            return fp8.dequantize(get(name), get(name + "_scale_inv"), self.fp8_block)
        if self.is_int4(name):
            return int4.INT4Matrix.from_stored(*map(get, self.stored_names(name)))
        return get(name)


def expert_matrices(tensors: dict) -> dict:
    """The `expert_matrices` family hook: one routed expert's stored tensors by short name -> its
    weights, each INT4 triple (`X.weight_packed`, `X.weight_scale`, `X.weight_shape`) paired into
    an `INT4Matrix` under `X.weight`; other tensors (plain, FP8 with `_scale_inv`) unchanged."""
    out = {}
    for name, t in tensors.items():
        base, _, part = name.rpartition(".")
        if part == "weight_packed":
            parts = (tensors[f"{base}.{p}"] for p in ("weight_scale", "weight_shape"))
            out[f"{base}.weight"] = int4.INT4Matrix.from_stored(t, *parts)
        elif part not in ("weight_scale", "weight_shape"):
            out[name] = t
    return out
