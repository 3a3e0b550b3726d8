"""The checkpoints `bench_llamacpp.py` compares reap and llama.cpp on, made once under a work
directory, and their GGUF conversions by llama.cpp's own `convert_hf_to_gguf.py`.

- `1b`: random Qwen3-MoE (vocab 32000, hidden 1024, 12 layers, 64 experts top-8,
  moe_intermediate 384, 16/4 heads): 1.0 B parameters, 178 M active; saved by transformers in
  float32, and a bfloat16 copy of it.
- `big`: random Qwen3-MoE (hidden 2048, 12 layers, 64 experts top-8, moe_intermediate 384,
  16/4 heads of 128; under `--work`-big): 2.07 B parameters (4.1 GB in bf16, 8.3 GB in f32), 419 M active. Made
  in bfloat16 (the model is never held in float32) and saved in 1 GB shards; the float32
  checkpoint is that one upcast shard by shard (same values, one shard in memory at a time).
- `gptoss`: random GPT-OSS (hidden 1024, 12 layers alternating sliding-window 128 and full
  attention, 32 experts top-4 of width 1024, 16/4 heads of 64, YaRN): 1.3 B parameters; the
  trunk in bfloat16 and the experts as MXFP4 blocks and E8M0 scales in the release's names
  and layout (`reap.quant.mxfp4.quantize`), so the converter keeps them MXFP4 and reap runs
  its MXFP4 kernels. One checkpoint serves both compute dtypes; the GGUFs differ only in the
  trunk (F32 or BF16), the experts stay MXFP4.
- `gptoss-big`: the same layout with hidden 2048, 64 experts top-4 of width 2048, 32/8 heads
  of 64 (under `--work`-big): 9.9 B parameters, 797 M active, 5.6 GB with MXFP4 experts.

Weights are random at a trained model's scale (normal / sqrt(fan-in); norms 1 + 0.1 normal;
biases and attention sinks 0.1 normal), not transformers' initializer. Every checkpoint carries
reap's byte-level tokenizer (256 byte tokens + <|endoftext|>).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from experiments.llamacpp_mxfp4 import dense_copy

QWEN_1B = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3072,
    "moe_intermediate_size": 384, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
QWEN_BIG = {**QWEN_1B, "hidden_size": 2048, "intermediate_size": 6144, "head_dim": 128}
GPTOSS = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 12,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 6, "max_position_embeddings": 131072,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": True,
    },
    "tie_word_embeddings": False,
}  # fmt: skip
GPTOSS_BIG = {**GPTOSS, "hidden_size": 2048, "intermediate_size": 2048, "num_local_experts": 64,
              "num_attention_heads": 32, "num_key_value_heads": 8}  # fmt: skip
LLAMA_CPP_PYTHON = "0.3.36"  # the source package llama.cpp and its Python bindings come from
EXPERTS = ("gate_up_proj", "down_proj")  # GPT-OSS's fused expert matrices, [E, in, out]


@dataclass
class Model:
    """One model of the comparison: `ckpts` (compute dtype -> checkpoint dir), `ggufs` (compute
    dtype -> GGUF), `params` (a sentence for the report)."""

    name: str
    ckpts: dict[str, Path]
    ggufs: dict[str, Path]
    params: str
    dense: tuple[Path, Path] | None = None  # gptoss: (checkpoint, F32 GGUF), experts decoded
    # compute dtype -> weight bytes one decode token reads (active parameters at the stored
    # width); empty where widths mix (gptoss: MXFP4 experts)
    token_bytes: dict[str, int] = field(default_factory=dict)


def param_counts(cfg: dict) -> tuple[int, int]:
    """(total, active) parameters of a Qwen3-MoE or GPT-OSS config dict (`cfg` as above);
    active counts the embedding row as nothing and the head as all of it."""
    D, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, Hkv, Dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E = cfg.get("num_experts", cfg.get("num_local_experts"))
    K = cfg["num_experts_per_tok"]
    if "num_local_experts" in cfg:  # GPT-OSS: biased GLU experts, biased projections, sinks
        F = cfg["intermediate_size"]
        expert = 3 * D * F + 2 * F + D
        attn = 2 * D * H * Dh + 2 * D * Hkv * Dh + H * Dh + 2 * Hkv * Dh + D + H
        router = E * D + E
    else:
        F = cfg["moe_intermediate_size"]
        expert = 3 * D * F
        attn = 2 * D * H * Dh + 2 * D * Hkv * Dh + 2 * Dh
        router = E * D
    per_layer = attn + router + 2 * D
    total = 2 * V * D + D + L * (per_layer + E * expert)
    active = V * D + D + L * (per_layer + K * expert)
    return total, active


def describe(cfg: dict) -> str:
    total, active = param_counts(cfg)
    E = cfg.get("num_experts", cfg.get("num_local_experts"))
    F = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    return (
        f"vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} "
        f"layers, {E} experts top-{cfg['num_experts_per_tok']} of width {F}, "
        f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads of "
        f"{cfg['head_dim']}: {total / 1e9:.2f} B parameters, {active / 1e6:.0f} M active"
    )


def bindings(tools: Path) -> Path:
    """llama-cpp-python's source tree (its `llama_cpp` package) under `tools`/src."""
    return tools / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"


# -- conversion --------------------------------------------------------------------------------
CONVERT = """
import convert_hf_to_gguf as c
import gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
add = gguf.SpecialVocab.add_to_gguf
def add_to_gguf(self, gw, quiet=False):
    self.merges = self.merges or ["\u0100 \u0100"]  # llama.cpp refuses a BPE without merges
    return add(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_to_gguf
c.sys.argv = ["convert_hf_to_gguf.py", {src!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
c.main()
"""


def run_python(code: str, pythonpath: list[Path], env: dict | None = None) -> str:
    """Run `code` in a fresh interpreter with `pythonpath` first on its path; its stdout."""
    path = os.pathsep.join(map(str, pythonpath))
    env = dict(os.environ, PYTHONPATH=path, **(env or {}))
    p = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if p.returncode != 0:
        raise SystemExit(f"subprocess failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    return p.stdout


def convert(tree: Path, src: Path, out: Path, outtype: str) -> Path:
    """`convert_hf_to_gguf.py SRC --outtype OUTTYPE` with the byte tokenizer accepted: its
    pre-tokenizer hash answered "default" and one placeholder merge added (the NUL pair, which
    no text here contains; every comparison feeds token ids or checks the tokenization)."""
    if not out.is_file():
        print(f"converting {src.name} -> {out.name}", flush=True)
        code = CONVERT.format(src=str(src), outtype=outtype, out=str(out) + ".part")
        run_python(code, [tree, tree / "gguf-py"])
        os.replace(str(out) + ".part", out)
    return out


# -- checkpoints -------------------------------------------------------------------------------
def _randomize(model, fan_in_axis: int = -1) -> None:
    """Random weights of a trained model's scale (see the module docstring), in place."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                axis = fan_in_axis if name.split(".")[-1] in EXPERTS else -1
                p.copy_(torch.randn_like(p) / p.shape[axis] ** 0.5)


def _finish(path: Path, extra: dict) -> None:
    """config.json updated with `extra`; the byte tokenizer's files written beside it."""
    from reap.tokenizer import byte_tokenizer_files

    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
    for name, text in byte_tokenizer_files().items():
        (path / name).write_text(text)


def _qwen(cfg: dict, dtype):
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(default)
    _randomize(model)
    return model


def qwen_1b(work: Path) -> dict[str, Path]:
    """float32 and bfloat16 saves of the 1 B Qwen3-MoE (the float32 model cast)."""
    out = {"float32": work / "qwen3moe-f32", "bfloat16": work / "qwen3moe-bf16"}
    if all((p / "config.json").is_file() for p in out.values()):
        return out
    import torch

    model = _qwen(QWEN_1B, torch.float32)
    extra = {"num_experts": QWEN_1B["num_experts"], "rope_theta": QWEN_1B["rope_theta"]}
    for dtype, path in out.items():
        model.to(getattr(torch, dtype)).save_pretrained(path)
        _finish(path, extra)
    return out


def qwen_big(work: Path) -> dict[str, Path]:
    """bfloat16 save of the big Qwen3-MoE in 1 GB shards, and its float32 upcast."""
    out = {"float32": work / "qwen3moe-f32", "bfloat16": work / "qwen3moe-bf16"}
    bf16, f32 = out["bfloat16"], out["float32"]
    extra = {"num_experts": QWEN_BIG["num_experts"], "rope_theta": QWEN_BIG["rope_theta"]}
    if not (bf16 / "config.json").is_file():
        import torch

        print("making the big Qwen3-MoE (bf16, minutes)", flush=True)
        model = _qwen(QWEN_BIG, torch.bfloat16)
        model.save_pretrained(bf16, max_shard_size="1GB")
        del model
        _finish(bf16, extra)
    if not (f32 / "config.json").is_file():
        _upcast(bf16, f32)
        _finish(f32, {**extra, "dtype": "float32"})
    return out


def _upcast(src: Path, out: Path) -> None:
    """A float32 copy of checkpoint `src`, one shard at a time, same file names and index."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
            continue
        shard = {k: v.float() for k, v in load_file(f).items()}
        save_file(shard, str(out / f.name), metadata={"format": "pt"})
        del shard
    index = out / "model.safetensors.index.json"
    if index.is_file():  # total_size doubles
        idx = json.loads(index.read_text())
        idx.get("metadata", {}).pop("total_size", None)
        index.write_text(json.dumps(idx, indent=2))
    _ = torch  # the upcast above is torch's


def gptoss(work: Path, cfg: dict = GPTOSS, name: str = "gptoss-mxfp4") -> Path:
    """The GPT-OSS checkpoint: bfloat16 trunk, MXFP4 experts in the release's layout, made one
    layer at a time (a one-layer model of that layer's attention type, saved as its own shard:
    a layer's float32 experts are the most ever in memory)."""
    out = work / name
    if (out / "config.json").is_file():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    from reap.quant import mxfp4

    transformers.logging.set_verbosity_error()
    tmp, weight_map = work / f"{name}.part", {}
    tmp.mkdir(parents=True, exist_ok=True)
    for i, kind in enumerate(cfg["layer_types"]):
        print(f"making {name} layer {i + 1}/{len(cfg['layer_types'])}", flush=True)
        torch.manual_seed(i)
        one = {**cfg, "num_hidden_layers": 1, "layer_types": [kind]}
        model = GptOssForCausalLM(GptOssConfig(**one)).eval()
        _randomize(model, fan_in_axis=-2)
        tensors = {}
        for key, p in model.state_dict().items():
            key = key.replace("model.layers.0.", f"model.layers.{i}.")
            if i and not key.startswith("model.layers."):
                continue  # embedding, final norm and head: layer 0's shard
            if key.split(".")[-1] not in EXPERTS:
                tensors[key] = p.to(torch.bfloat16).contiguous()
                continue
            q = [mxfp4.quantize(w.T.contiguous()) for w in p]  # an expert at a time: [out, in/2]
            scales = torch.stack([sc for _, sc in q])
            tensors[key + "_blocks"] = torch.stack([b for b, _ in q]).reshape(*scales.shape, 16)
            tensors[key + "_scales"] = scales
        shard = f"model-{i + 1:05d}-of-{len(cfg['layer_types']):05d}.safetensors"
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        del model, tensors
    GptOssConfig(**cfg).save_pretrained(tmp)
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    rope = dict(cfg["rope_parameters"])
    theta = rope.pop("rope_theta")
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn", "lm_head",
                                                                  "embed_tokens"]}  # fmt: skip
    _finish(tmp, {"architectures": ["GptOssForCausalLM"], "dtype": "bfloat16", "quantization_config": quant, "rope_theta": theta,
                  "rope_scaling": rope})  # fmt: skip
    os.replace(tmp, out)
    return out


def prepare(name: str, work: Path, tree: Path) -> Model:
    """Model `name` (1b, big, gptoss, gptoss-big): its checkpoints made and converted when
    absent."""
    gdir = work
    if name == "1b":
        ck, stem, cfg = qwen_1b(work), "qwen3moe", QWEN_1B
    elif name == "big":
        gdir = work.parent / f"{work.name}-big"
        ck, stem, cfg = qwen_big(gdir), "qwen3moe-big", QWEN_BIG
    elif name == "gptoss-big":
        gdir = work.parent / f"{work.name}-big"
        one = gptoss(gdir, GPTOSS_BIG)
        ck, stem, cfg = {"float32": one, "bfloat16": one}, "gptoss-big-mxfp4", GPTOSS_BIG
    elif name == "gptoss":
        one = gptoss(work)
        ck, stem, cfg = {"float32": one, "bfloat16": one}, "gptoss-mxfp4", GPTOSS
        dense = dense_copy(one, work / "gptoss-dense")
        dense_gguf = convert(tree, dense, work / "gptoss-dense-f32.gguf", "f32")
    else:
        raise SystemExit(f"unknown model {name!r} (1b, big, gptoss, gptoss-big)")
    ggufs = {
        dtype: convert(tree, ck[dtype], gdir / f"{stem}-{short}.gguf", short)
        for dtype, short in (("float32", "f32"), ("bfloat16", "bf16"))
    }
    extra = (dense, dense_gguf) if name == "gptoss" else None
    active = param_counts(cfg)[1]
    widths = {} if name.startswith("gptoss") else {"float32": 4, "bfloat16": 2}
    return Model(name, ck, ggufs, describe(cfg), extra, {k: active * w for k, w in widths.items()})
