"""gpt-oss with MXFP4 experts on both sides: where reap and llama.cpp can differ, and by how much.

- `decode_check`: llama.cpp's own decoding of the GGUF's MXFP4 expert tensors (gguf-py's
  `quants.dequantize`, the converter having repacked the release's nibbles and split gate/up)
  against reap's decoding of the checkpoint's blocks and scales (`reap.quant.mxfp4`).
- `dense_copy`: the same checkpoint with its experts decoded to bfloat16 (exact: an E2M1 value
  times a power of two fits bfloat16) in transformers' fused layout; converted to GGUF F32 it
  gives llama.cpp the same expert weights in float32, so greedy agreement on it isolates the one
  difference left on the MXFP4 GGUF: ggml multiplies MXFP4 weights by activations quantized to
  Q8_0 (`vec_dot_type` of MXFP4), reap by float activations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

GGUF_EXPERTS = {"ffn_gate_exps": ("gate_up_proj", 0), "ffn_up_exps": ("gate_up_proj", 1),
                "ffn_down_exps": ("down_proj", None)}  # fmt: skip


def _reap_decoded(tensors: dict, layer: int, name: str, half: int | None):
    """reap's float32 decoding of `name` of `layer`: [E, R, C] (rows = outputs); `half` 0 or 1
    takes the gate or up rows of the interleaved gate_up."""
    import torch

    from reap.quant import mxfp4

    key = f"model.layers.{layer}.mlp.experts.{name}"
    blocks, scales = tensors[key + "_blocks"], tensors[key + "_scales"]
    w = mxfp4.dequantize(blocks.reshape(*blocks.shape[:-2], -1), scales, torch.float32)
    return w if half is None else w[:, half::2]


def decode_check(tree: Path, ckpt: Path, gguf: Path) -> dict:
    """`compare` in a fresh interpreter that imports llama.cpp's own gguf-py (from `tree`)."""
    from experiments.llamacpp_models import run_python

    root = Path(__file__).resolve().parent.parent
    code = (
        "import json; from experiments.llamacpp_mxfp4 import compare; "
        f"print(json.dumps(compare({str(ckpt)!r}, {str(gguf)!r})))"
    )
    return json.loads(run_python(code, [tree / "gguf-py", root]).strip().splitlines()[-1])


def compare(ckpt: str, gguf: str) -> dict:
    """Max |llama.cpp's decoded expert weight - reap's| over every MXFP4 expert tensor of
    `gguf` (needs llama.cpp's gguf-py importable)."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    tensors = load_file(Path(ckpt) / "model.safetensors")
    worst, count = 0.0, 0
    for t in GGUFReader(gguf).tensors:
        parts = t.name.split(".")  # blk.{layer}.{kind}.weight
        if len(parts) != 4 or parts[2] not in GGUF_EXPERTS or t.tensor_type.name != "MXFP4":
            continue
        theirs = dequantize(t.data, t.tensor_type)  # [E, R, C]
        ours = _reap_decoded(tensors, int(parts[1]), *GGUF_EXPERTS[parts[2]]).numpy()
        worst = max(worst, float(np.abs(theirs - ours).max()))
        count += 1
    return {"tensors": count, "max_abs_diff": worst}


def dense_copy(src: Path, out: Path) -> Path:
    """`src` with its MXFP4 experts decoded to bfloat16 as transformers saves them
    (gate_up_proj [E, D, 2F], down_proj [E, F, D]); no quantization_config."""
    if (out / "config.json").is_file():
        return out
    import torch
    from safetensors.torch import load_file, save_file

    from reap.quant import mxfp4

    t = load_file(src / "model.safetensors")
    dense = {}
    for k, v in t.items():
        if k.endswith("_blocks"):
            base = k.removesuffix("_blocks")
            w = mxfp4.dequantize(v.reshape(*v.shape[:-2], -1), t[base + "_scales"], torch.float32)
            dense[base] = w.transpose(1, 2).contiguous().to(torch.bfloat16)  # [E, in, out]
        elif not k.endswith("_scales"):
            dense[k] = v
    out.mkdir(parents=True, exist_ok=True)
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
