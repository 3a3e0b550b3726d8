"""INT4 codec of compressed-tensors' `pack-quantized` format (Kimi-K2-Thinking's routed experts):
symmetric 4-bit integers, one scale per group of `group` consecutive values along a row.

A weight W [O, I] is stored as three tensors (the compressed-tensors names):
- `weight_packed` I32 [O, ceil(I/8)]: eight 4-bit codes a word, value i of a row in bits
  4*(i%8) .. 4*(i%8)+3 of word i//8 (the low nibble holds the first value); code = q + 8 for
  q in [-8, 7] (the "offset" binary of compressed-tensors' `pack_to_int32`);
- `weight_scale` [O, I/group] in the checkpoint's float dtype (BF16 in the releases);
- `weight_shape` [2] integers: (O, I), the unpacked shape.
The decoded weight is q * scale computed in the scale's dtype (compressed-tensors' `dequantize`:
the product rounded once to that dtype), then cast.

    packed, scales = quantize(w, group=32)         # w [O, I] -> I32 [O, I/8], [O, I/32]
    w_hat = dequantize(packed, scales, group=32)   # [O, I] in the scales' dtype (or dtype=)

A stored matrix handed to model code is an `INT4Matrix`; `Int4Scheme.parse` reads and checks a
config's `quantization_config`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from reap.errors import ReapError
from reap.quant.matrix import check_range

BITS = 4
PER_WORD = 32 // BITS  # codes per int32 word
OFFSET = 1 << (BITS - 1)  # stored code = q + 8
Q_MIN, Q_MAX = -OFFSET, OFFSET - 1
_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)  # [8] bit offset of each code in a word


def _check(packed: torch.Tensor, scales: torch.Tensor, group: int, cols: int | None) -> int:
    """The unpacked width I of a (packed [O, W], scales [O, G]) pair, or ReapError."""
    if packed.dtype != torch.int32:
        raise ReapError(f"int4: weight_packed must be int32, got {packed.dtype}")
    if not scales.is_floating_point():
        raise ReapError(f"int4: weight_scale must be a float tensor, got {scales.dtype}")
    cols = scales.shape[-1] * group if cols is None else cols
    if (
        packed.dim() != 2
        or scales.shape != (packed.shape[0], -(-cols // group))
        or packed.shape[1] != -(-cols // PER_WORD)
    ):
        raise ReapError(
            f"int4: weight_packed {tuple(packed.shape)} and weight_scale {tuple(scales.shape)} do "
            f"not fit a [{packed.shape[0] if packed.dim() else '?'}, {cols}] matrix in groups of "
            f"{group} (expected [O, ceil(I/8)] and [O, ceil(I/{group})])"
        )
    return cols


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """int32 words [O, W] -> int8 codes q in [-8, 7], [O, cols] (cols <= 8W)."""
    nibbles = (packed.unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 15  # [O, W, 8]
    return (nibbles.reshape(packed.shape[0], -1)[:, :cols] - OFFSET).to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 codes q in [-8, 7], [O, I] -> int32 words [O, ceil(I/8)] (zero codes pad the last)."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ReapError(f"int4: pack takes int8 [O, I], got {q.dtype} {tuple(q.shape)}")
    if q.numel() and (int(q.min()) < Q_MIN or int(q.max()) > Q_MAX):
        raise ReapError(f"int4: codes must lie in [{Q_MIN}, {Q_MAX}]")
    O, I = q.shape
    codes = torch.nn.functional.pad(q.to(torch.int64) + OFFSET, (0, (-I) % PER_WORD))
    words = (codes.reshape(O, -1, PER_WORD) << _SHIFTS.to(torch.int64)).sum(-1)  # [O, W]
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement of the top bit


def dequantize(
    packed: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    cols: int | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode packed int32 [O, W] with scales [O, G] -> [O, I] (I = `cols`, default G*group) in
    `dtype` (default the scales' dtype). Each value is q * scale rounded once to the scales' dtype
    (a 4-bit q times a 16-bit scale is exact in float32, so multiplying in bf16/f16 rounds just
    the exact product), as compressed-tensors does."""
    cols = _check(packed, scales, group, cols)
    O, work = packed.shape[0], scales.dtype  # the dtype every product is rounded to
    if sys.byteorder == "little":  # the words' bytes in order: two codes a byte, low nibble first
        b = packed.contiguous().view(torch.uint8)  # [O, 4W]
        codes = torch.stack((b & 15, b >> 4), dim=-1).reshape(O, -1)  # [O, 8W] stored q + 8
        q = codes.to(work) - OFFSET  # exact in any float dtype
    else:
        q = unpack(packed, packed.shape[1] * PER_WORD).to(work)  # [O, 8W]
    if cols == scales.shape[1] * group:  # whole groups: scale each [O, G, group] block
        out = (q[:, :cols].reshape(O, -1, group) * scales.unsqueeze(-1)).reshape(O, cols)
    else:
        out = q[:, :cols] * scales.repeat_interleave(group, dim=-1)[:, :cols]
    return out.to(dtype or scales.dtype)


def quantize(
    w: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric group quantization of w [O, I] (I a multiple of `group`), as compressed-tensors'
    min-max observer: scale = amax / 7.5 per group (in `scale_dtype`; 1 for an all-zero group),
    q = clamp(round(w / scale), -8, 7). Returns (packed int32 [O, I/8], scales [O, I/group])."""
    O, I = w.shape
    if I % group:
        raise ReapError(f"int4: width {I} is not a multiple of the group size {group}")
    x = w.detach().float().reshape(O, I // group, group)  # [O, G, group]
    amax = x.abs().amax(-1)  # [O, G]
    scales = torch.where(amax > 0, amax / ((Q_MAX - Q_MIN) / 2), torch.ones_like(amax))
    scales = scales.to(scale_dtype)
    q = torch.round(x / scales.float().unsqueeze(-1)).clamp(Q_MIN, Q_MAX).to(torch.int8)
    return pack(q.reshape(O, I)), scales


@dataclass(frozen=True, eq=False)
class INT4Matrix:
    """A weight matrix W [O, I] stored pack-quantized: `packed` int32 [O, I/8], `scales`
    [O, I/group] (float), `shape_tensor` the stored `weight_shape` (checked, never trusted for
    the size).
    A typed record, not a tensor: `reap.models.shared.blocks.linear` applies it through `linear(x)`,
    which decodes it whole (`dequantize`) in x's dtype."""

    packed: torch.Tensor
    scales: torch.Tensor
    shape_tensor: torch.Tensor
    group: int

    @classmethod
    def from_stored(
        cls, packed: torch.Tensor, scales: torch.Tensor, shape: torch.Tensor
    ) -> INT4Matrix:
        """The record of one matrix's three stored tensors. The group size follows from their
        shapes (`Int4Scheme` keeps it a multiple of 8, so a row of whole groups fills whole
        words); all-zero bytes of any dtype (the engine's stand-in for an expert that failed to
        load) decode to zeros."""
        packed = packed if packed.dtype == torch.int32 else packed.to(torch.int32)
        scales = scales if scales.is_floating_point() else scales.float()
        group = max(1, PER_WORD * packed.shape[-1] // max(1, scales.shape[-1]))
        return cls(packed, scales, shape, group)

    @property
    def shape(self) -> torch.Size:
        """[O, I], the decoded shape (I = scale groups x group: compressed-tensors needs whole
        groups)."""
        return torch.Size((self.packed.shape[0], self.scales.shape[-1] * self.group))

    def dense(self, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """The decoded matrix [O, I] in `dtype` (on `device`, default where the bytes are)."""
        device = device or self.packed.device
        packed, scales = self.packed.to(device), self.scales.to(device)
        return dequantize(packed, scales, self.group, self.shape[1], dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] @ W.T -> [..., O] in x's dtype."""
        return x @ self.dense(x.dtype, x.device).T

    def check(self, what: str) -> None:
        """Raise ReapError (naming `what`) if `weight_shape` disagrees with the packed words and
        scales, or a decoded weight could be beyond `check_range`'s bound: corrupt bytes."""
        _check(self.packed, self.scales, self.group, self.shape[1])
        stored = [int(v) for v in self.shape_tensor.reshape(-1).tolist()]
        if stored != list(self.shape):
            raise ReapError(f"{what}: weight_shape {stored} != {list(self.shape)}: corrupt bytes")
        check_range(self.scales, f"{what}_scale", -Q_MIN)  # |q| <= 8


# -- the compressed-tensors quantization_config ------------------------------------------------
class SchemeError(ReapError):
    """A `quantization_config` value this codec cannot read (exit 2): `field` is its key path."""

    def __init__(self, field: str, detail: str):
        super().__init__(f"config.json: quantization_config.{field}: {detail}")
        self.field, self.detail = f"quantization_config.{field}", detail


# the weight settings of a config group, as the one format read here needs them (absent = ok)
_WEIGHTS = {"num_bits": BITS, "type": "int", "strategy": "group", "symmetric": True}
_OPTIONAL_NONE = ("actorder", "block_structure", "dynamic")


@dataclass(frozen=True)
class Int4Scheme:
    """compressed-tensors `pack-quantized` INT4 (weight-only, symmetric, one group size): which
    modules it quantizes (`targets` minus `ignore`, compressed-tensors' matching) and how."""

    group: int
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    @classmethod
    def parse(cls, qc: dict) -> Int4Scheme:
        """From a config's `quantization_config` (quant_method "compressed-tensors"); SchemeError
        naming the key for anything else (other formats, bit widths, asymmetric, activations)."""
        fmt = qc.get("format")
        if fmt != "pack-quantized":
            raise SchemeError(
                "format", f"compressed-tensors {fmt!r} is not supported (only pack-quantized)"
            )
        if qc.get("quantization_status", "compressed") != "compressed":
            raise SchemeError(
                "quantization_status", f"{qc['quantization_status']!r}, not compressed"
            )
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if qc.get(key):
                raise SchemeError(key, "is not supported (weight-only INT4 only)")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise SchemeError("config_groups", "must be a non-empty object")
        sizes, targets = {_group_size(name, g) for name, g in groups.items()}, []
        if len(sizes) != 1:
            raise SchemeError("config_groups", f"mixed group sizes {sorted(sizes)}")
        for name, g in groups.items():
            targets += _strings(g.get("targets"), f"config_groups.{name}.targets")
        ignore = _strings(qc.get("ignore"), "ignore")
        return cls(sizes.pop(), tuple(targets), tuple(ignore))

    def quantizes(self, module: str, linear: bool) -> bool:
        """Whether module `module` (e.g. "model.layers.1.mlp.experts.0.down_proj"; `linear`: it
        is a torch Linear) is stored quantized: matched by a target and by no ignore entry."""

        def hit(pattern: str) -> bool:
            if pattern.startswith("re:"):
                return re.match(pattern[3:], module) is not None
            return pattern == module or (linear and pattern == "Linear")

        return any(map(hit, self.targets)) and not any(map(hit, self.ignore))


def _strings(value, field: str) -> list[str]:
    """`value` if it is a list of strings (None: empty), else SchemeError naming `field`."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SchemeError(field, f"must be a list of strings (got {value!r})")
    return value


def _group_size(name: str, g) -> int:
    """The group size of config group `name`, after checking it is weight-only symmetric INT4."""
    where = f"config_groups.{name}"
    if not isinstance(g, dict) or not isinstance(g.get("weights"), dict):
        raise SchemeError(f"{where}.weights", "must be an object")
    if g.get("format", "pack-quantized") != "pack-quantized":
        raise SchemeError(f"{where}.format", f"{g['format']!r} is not supported")
    for key in ("input_activations", "output_activations"):
        if g.get(key) is not None:
            raise SchemeError(f"{where}.{key}", "must be null (weight-only INT4 only)")
    w = g["weights"]
    for key, want in _WEIGHTS.items():
        if w.get(key) != want:
            raise SchemeError(
                f"{where}.weights.{key}", f"{w.get(key)!r} is not supported ({want!r})"
            )
    for key in _OPTIONAL_NONE:
        if w.get(key) not in (None, False):
            raise SchemeError(f"{where}.weights.{key}", f"{w[key]!r} is not supported (null)")
    size = w.get("group_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1 or size % PER_WORD:
        raise SchemeError(
            f"{where}.weights.group_size", f"must be a positive multiple of 8 (got {size!r})"
        )
    return size
