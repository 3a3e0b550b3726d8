"""`reap synth`: write a random but valid checkpoint of a built-in config (or a config.json) in
the released layout, for tests, benchmarks and size checks without the real weights.

Every tensor is drawn from its own generator seeded by (seed, name), so the same seed gives
byte-identical files whatever the sharding. Values are scaled so activations stay O(1) through
the layers. Quantized weights are drawn in floats and quantized with their codec; large MXFP4
ones (k3-full) get random codes and scales directly, so memory stays bounded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import torch

from reap.checkpoint import CheckpointWriter, TensorSpec
from reap.checkpoint.config_only import LayoutTable
from reap.errors import ReapError
from reap.fileio import OVERWRITE_HELP
from reap.models import BUILTIN, builtin_config, family
from reap.models.validate import text_of, text_prefix
from reap.quant import fp8, int4, mxfp4
from reap.tokenizer import byte_tokenizer_files

SIZES = (
    "k3-tiny ~0.7 MB (seconds), k3-small ~0.34 GB, k3-full ~1.56 TB (~15.7 GB of experts "
    "per MoE layer: use --layers N)"
)
_TORCH = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "U8": torch.uint8}
_DIRECT_CODES_ABOVE = 1 << 22  # expert matrices with more params get codes drawn directly
_E2M1_RMS = math.sqrt(68.5 / 8)  # rms of a uniformly drawn E2M1 code value
# tensors drawn together, by the role of the first: MXFP4 (blocks, scales), an FP8 weight and its
# block scales, INT4 (packed, scales, shape)
_PARTS = {"mxfp4.blocks": 2, "fp8.weight": 2, "int4.packed": 3}


def load_config(config: str | dict, layers: int | None = None) -> dict:
    """A config.json dict from a built-in name or a path to a config.json (or its directory)."""
    if isinstance(config, dict):
        return config
    if config in BUILTIN:
        return builtin_config(config, layers)
    p = Path(config)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ReapError(f"{config}: neither a built-in config ({', '.join(BUILTIN)}) nor a file")
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ReapError(f"{p}: not a readable config.json ({e})") from None
    if layers is not None:
        raise ReapError("--layers applies to built-in configs only")
    return d


def synth(
    config: str | dict,
    out: str | Path,
    seed: int = 0,
    layers: int | None = None,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    max_shard_bytes: int = 5_000_000_000,
    progress: bool = False,
    vision: bool = False,
) -> str:
    """Write a random checkpoint (shards, index, config.json, byte-level tokenizer) to `out`.
    dtype: "bfloat16" or "float32" for the non-expert tensors; `vision`: add a small vision
    tower in the release's layout (`reap.models.shared.vision.with_tiny_vision`) to a config without
    one. Returns the directory."""
    from reap.models.shared.vision import with_tiny_vision

    if dtype not in ("bfloat16", "float32"):
        raise ReapError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
    cfgd = json.loads(json.dumps(load_config(config, layers)))
    cfgd = with_tiny_vision(cfgd) if vision else cfgd
    text = text_of(cfgd)
    text.update(torch_dtype=dtype, **({"dtype": dtype} if "dtype" in text else {}))
    fam = family(cfgd)
    table = LayoutTable(fam.layout(cfgd))  # fused expert views `X[e]` as their tensor X [E, ...]
    specs = [table[n] for n in table]
    if vision and not any(s.component == "vision" for s in specs):
        raise ReapError(f"--vision: model_type {cfgd.get('model_type')!r} has no vision tower")
    writer = CheckpointWriter(out, specs, max_shard_bytes, prefix=text_prefix(cfgd),
                              overwrite=overwrite)
    from tqdm import tqdm

    total = sum(s.nbytes for s in specs)
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc="synth")
    i = 0
    while i < len(specs):
        group = specs[i : i + _PARTS.get(specs[i].role, 1)]  # a tensor, or a codec's parts
        if not writer.done(group[0].name):
            for s, t in zip(group, _draw(group, seed)):
                writer.write(s.name, t)
        bar.update(sum(s.nbytes for s in group))
        i += len(group)
    bar.close()
    return writer.close(cfgd, byte_tokenizer_files())


def _gen(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _draw(group: list[TensorSpec], seed: int) -> list[torch.Tensor]:
    draw = {"mxfp4.blocks": _mxfp4, "fp8.weight": _fp8, "int4.packed": _int4}.get(group[0].role)
    g = _gen(seed, group[0].name)
    return draw(*group, g) if draw else [_float_tensor(group[0], g)]


def _mxfp4(packed: TensorSpec, scale: TensorSpec, g: torch.Generator) -> list[torch.Tensor]:
    """MXFP4 blocks [.., R, C/2] (GPT-OSS: [E, R, C/32, 16]) and scales [.., R, C/32] of
    matrices [.., R, C]."""
    cols = scale.shape[-1] * 32
    rows = packed.numel * 2 // cols
    if packed.numel * 2 != scale.numel * 32:
        raise ReapError(f"tensor {packed.name}: MXFP4 needs widths that are multiples of 32, got "
                        f"{list(packed.shape)} codes and {list(scale.shape)} scales")
    if rows * cols > _DIRECT_CODES_ABOVE:
        return _direct_codes(packed, scale, cols, g)
    codes, scales = mxfp4.quantize(torch.randn(rows, cols, generator=g) / math.sqrt(cols))
    return [codes.reshape(packed.shape), scales.reshape(scale.shape)]


def _fp8(weight: TensorSpec, scale: TensorSpec, g: torch.Generator) -> list[torch.Tensor]:
    """F8_E4M3 [O, I] ~N(0, 1/I) and its F32 scales, quantized with the layout's block."""
    rows, cols = weight.shape
    w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
    return list(fp8.quantize(w, weight.block))


def _int4(packed: TensorSpec, scale: TensorSpec, _shape: TensorSpec, g: torch.Generator):
    """Compressed-tensors INT4 (`reap.quant.int4`) (packed, scales, shape) of a matrix [O, I]
    ~N(0, 1/I), quantized in groups of I / (scale columns), scales in the scale spec's dtype."""
    rows, cols = packed.shape[0], packed.shape[1] * int4.PER_WORD
    w = torch.randn(rows, cols, generator=g) / math.sqrt(cols)
    words, scales = int4.quantize(w, cols // scale.shape[1], _TORCH[scale.dtype])
    return [words, scales, torch.tensor([rows, cols], dtype=torch.int32)]


def _direct_codes(
    packed: TensorSpec, scale: TensorSpec, fan_in: int, g: torch.Generator
) -> list[torch.Tensor]:
    """Uniform random E2M1 code pairs; E8M0 scales near 2^round(log2(1/(rms*sqrt(fan_in))))
    (about 2^-7 at K3 widths), jittered by one step, so outputs keep unit variance. Bytes come
    from numpy's PCG64 (seeded from `g`) as 64-bit words: ~10x faster than torch.randint."""
    import numpy as np

    rng = np.random.Generator(np.random.PCG64(int(torch.randint(0, 2**62, (1,), generator=g))))
    base = 127 + round(math.log2(1 / (_E2M1_RMS * math.sqrt(fan_in))))
    words = rng.integers(0, 2**64 - 1, -(-packed.numel // 8), dtype=np.uint64, endpoint=True)
    codes = words.view(np.uint8)[: packed.numel].reshape(packed.shape)
    scales = (base + rng.integers(-1, 2, scale.shape)).astype(np.uint8)
    return [torch.from_numpy(codes), torch.from_numpy(scales)]


def _float_tensor(s: TensorSpec, g: torch.Generator) -> torch.Tensor:
    """A plausible random value for a non-expert tensor, chosen by its declared role."""
    dtype = _TORCH[s.dtype]
    # decay rates exp(A) in [1, 16] for the real heads, zero padding after
    if s.role == "decay_log":
        return torch.log(1 + 15 * torch.rand(s.shape, generator=g)).to(dtype)
    if s.role == "decay_bias":  # with A in [1, 16]: per-step decays from ~0.01 to ~0.999
        return (-0.5 + 0.3 * torch.randn(s.shape, generator=g)).to(dtype)
    if s.role == "router_bias":
        return (0.01 * torch.randn(s.shape, generator=g)).to(dtype)
    if s.role == "norm":
        return (1 + 0.1 * torch.randn(s.shape, generator=g)).to(dtype)
    if s.role == "conv":  # [C, 1, k]
        return (torch.randn(s.shape, generator=g) / math.sqrt(s.shape[-1])).to(dtype)
    std = 1.0 if s.role == "embedding" else 1 / math.sqrt(s.shape[-1])
    if s.role == "decay_proj":  # keep the decay input small so dt_bias sets the decay range
        std *= 0.3
    return _randn_rows(s, std, g)


def _randn_rows(s: TensorSpec, std: float, g: torch.Generator) -> torch.Tensor:
    """N(0, std^2) in the spec's dtype, drawn a block of rows at a time (bounded fp32 memory)."""
    out = torch.empty(s.shape, dtype=_TORCH[s.dtype])
    rows = max(1, (1 << 24) // max(1, s.numel // max(1, s.shape[0])))
    flat = out.reshape(s.shape[0], -1) if s.shape else out.reshape(1, 1)
    for r in range(0, flat.shape[0], rows):
        block = flat[r : r + rows]
        block.copy_(torch.randn(block.shape, generator=g) * std)
    return out


# -- CLI ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments of `reap synth`."""
    p.description = f"Write a random but valid checkpoint. Sizes: {SIZES}."
    p.add_argument(
        "config",
        metavar="CONFIG",
        help=f"built-in config ({', '.join(BUILTIN)}) or a config.json path",
    )
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed: same bytes)")
    p.add_argument("--layers", type=int, help="keep only the first N decoder layers")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype of the non-expert tensors (experts are always MXFP4)",
    )
    p.add_argument("--shard-gb", type=float, default=5.0, help="max shard size in GB (default 5)")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument(
        "--vision",
        action="store_true",
        help="add a small vision tower and projector in the release's layout (K3, K2.5)",
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of `reap synth`."""
    path = synth(
        args.config,
        args.out,
        seed=args.seed,
        layers=args.layers,
        dtype=args.dtype,
        overwrite=args.overwrite,
        max_shard_bytes=int(args.shard_gb * 1e9),
        progress=True,
        vision=args.vision,
    )
    print(path)
    return 0
