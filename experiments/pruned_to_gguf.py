"""Experiment: a pruned Qwen3-MoE build goes on to llama.cpp (README "Where a pruned build can
go next"; results in reports/loaders.md).

A tiny random Qwen3-MoE (transformers, float32, 8 experts, top-2, Qwen2's tokenizer rebuilt from
the vocabulary file llama.cpp ships for its tokenizer tests) is pruned by `reap` to 4 experts per layer; llama.cpp's
own `convert_hf_to_gguf.py` converts the pruned directory (f32), llama.cpp loads the GGUF (through
the ctypes bindings of the llama-cpp-python source package, loaded without its high-level
wrapper) and its logits over a prompt and greedy continuation are compared with reap's engine on
the same files. The unpruned source goes through the same steps as a control.

    python experiments/pruned_to_gguf.py --llama-cpp /work/tools/llama.cpp \
        --bindings /work/tools/src/llama_cpp_python-0.3.36 --out reports/loaders.json

llama.cpp is not built here: `--llama-cpp` is a source tree already built (build/bin holding
libllama.so) by whoever provides it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 42, 99, 7, 150, 33, 8, 61, 200, 12, 77]
STEPS = 8
GGML_TYPE_F32 = 0  # ggml_type
QWEN = {
    "vocab_size": 151936, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [],
    "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}  # fmt: skip


def make_source(llama_cpp: Path, path: Path, seed: int = 0) -> Path:
    """A tiny random Qwen3-MoE saved by transformers, with Qwen2's tokenizer (`_tokenizer`)."""
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # clear margins: N(0, 1/fan_in) matrices, norms near 1
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            p.copy_(r * p.shape[-1] ** -0.5 if p.dim() >= 2 else 1 + 0.1 * r)
    model.save_pretrained(path)
    _tokenizer(llama_cpp, path)
    return path


def _tokenizer(llama_cpp: Path, path: Path) -> None:
    """Qwen2's byte-level BPE tokenizer rebuilt as tokenizer.json from the vocabulary llama.cpp
    ships for its own tokenizer tests (models/ggml-vocab-qwen2.gguf: tokens, merges, types) with
    the released pre-tokenizer (NFC, the Qwen2 split pattern, byte-level). The converter accepts
    only tokenizers whose pre-tokenizer it recognizes (a hash of the ids of a probe text), so a
    made-up vocabulary would be refused; this one reproduces the ids of llama.cpp's reference
    test strings (checked here) and hashes as "qwen2"."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pt

    gguf = _package("gguf", llama_cpp / "gguf-py" / "gguf")
    vocab = llama_cpp / "models" / "ggml-vocab-qwen2.gguf"
    r = gguf.GGUFReader(vocab)

    def strings(name: str) -> list[str]:
        f = r.fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    kinds = [int(r.fields["tokenizer.ggml.token_type"].parts[i][0])
             for i in r.fields["tokenizer.ggml.token_type"].data]  # fmt: skip
    plain = {t: i for i, t in enumerate(tokens) if kinds[i] == 1}
    tok = Tokenizer(models.BPE(vocab=plain, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.normalizer = normalizers.NFC()
    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")  # fmt: skip
    tok.pre_tokenizer = pt.Sequence(
        [
            pt.Split(Regex(split), behavior="isolated"),
            pt.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for i, t in enumerate(tokens) if kinds[i] == 4])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for i, t in enumerate(tokens) if kinds[i] == 3])  # fmt: skip
    cases = Path(f"{vocab}.inp").read_text().split("\n__ggml_vocab_test__\n")
    want = Path(f"{vocab}.out").read_text().split("\n")
    bad = [c for c, w in zip(cases, want) if " ".join(map(str, tok.encode(c).ids)) != w.strip()]
    if bad:
        raise SystemExit(f"rebuilt Qwen2 tokenizer disagrees with llama.cpp's test on {bad[0]!r}")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )


def _package(name: str, directory: Path):
    """Import the package in `directory` as `name` (llama.cpp's gguf-py, not installed here)."""
    import importlib.util

    init = directory / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(directory)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def prune_source(src: Path, out: Path, keep: int, seed: int = 0) -> dict:
    """reap plan (random criterion, uniform) + reap prune (which carries the tokenizer files)."""
    from reap.checkpoint import Checkpoint
    from reap.prune.plan import make_plan
    from reap.prune.write import prune

    with Checkpoint.open(src) as ck:
        plan = make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", keep=keep,
                         seed=seed)  # fmt: skip
    r = prune(model=str(src), plan=plan, out=str(out))
    return {"kept": plan.keep, "file_bytes": r.file_bytes}


def convert(llama_cpp: Path, model: Path, gguf: Path) -> dict:
    """llama.cpp's convert_hf_to_gguf.py on `model` (f32); the command, seconds, and its log."""
    cmd = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(model),
           "--outtype", "f32", "--outfile", str(gguf)]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    log = (p.stdout + p.stderr).splitlines()
    if p.returncode != 0:
        raise SystemExit("convert_hf_to_gguf.py failed:\n" + "\n".join(log[-20:]))
    keys = [ln for ln in log if "expert" in ln.lower()]
    return {"seconds": round(time.perf_counter() - t0, 2), "expert_lines": keys[:8],
            "gguf_bytes": gguf.stat().st_size}  # fmt: skip


def bindings(llama_cpp: Path, source: Path):
    """llama-cpp-python's ctypes module `llama_cpp.llama_cpp` on llama.cpp's libllama, imported
    without the package's high-level wrapper (which needs packages this machine lacks)."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(llama_cpp / "build" / "bin")
    pkg = types.ModuleType("llama_cpp")
    pkg.__path__ = [str(source / "llama_cpp")]
    sys.modules["llama_cpp"] = pkg
    import llama_cpp.llama_cpp as lib

    lib.llama_backend_init()
    lib._quiet = lib.llama_log_callback(lambda level, text, data: None)  # keep it referenced
    lib.llama_log_set(lib._quiet, ctypes.c_void_p(0))
    return lib


class LlamaRun:
    """One llama.cpp model and context; `decode(ids)` -> logits [T, V] of every position."""

    def __init__(self, lib, gguf: Path, n_ctx: int = 128):
        self.lib = lib
        self.model = lib.llama_model_load_from_file(
            str(gguf).encode(), lib.llama_model_default_params()
        )
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_threads, params.n_threads_batch = n_ctx, n_ctx, 1, 1
        params.type_k = params.type_v = GGML_TYPE_F32  # an f32 KV cache (the default is f16)
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # its kernel works in f16
        self.ctx = lib.llama_init_from_model(self.model, params)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        self.pos = 0

    def decode(self, ids: list[int]) -> np.ndarray:
        lib, n = self.lib, len(ids)
        batch = lib.llama_batch_init(n, 0, 1)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, self.pos + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, 1
        batch.n_tokens = n
        if lib.llama_decode(self.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")
        out = np.stack([np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), (self.vocab,)).copy()
                        for i in range(n)])  # fmt: skip
        lib.llama_batch_free(batch)
        self.pos += n
        return out  # [T, V]

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def greedy(step, ids: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """Prefill then `steps` greedy steps through `step(ids) -> logits [T, V]` (stateful)."""
    logits = [step(ids)]
    tokens = [int(logits[-1][-1].argmax())]
    for _ in range(steps):
        logits.append(step([tokens[-1]]))
        tokens.append(int(logits[-1][-1].argmax()))
    return logits, tokens


def ours(model: Path) -> tuple[list[np.ndarray], list[int]]:
    """reap's engine on `model`: the same greedy run, logits [T, V] per step."""
    from reap.engine import Engine

    with Engine.open(str(model), budget="4GB", context=128, dtype="float32") as eng:
        seq = eng.new_sequence()
        return greedy(lambda x: eng.step([seq], [list(x)], all_positions=True)[0].numpy(),
                      PROMPT, STEPS)  # fmt: skip


def compare(lib, model: Path, gguf: Path) -> dict:
    run = LlamaRun(lib, gguf)
    try:
        ref = greedy(run.decode, PROMPT, STEPS)
    finally:
        run.close()
    got = ours(model)
    diffs = [float(np.abs(a - b[:, : a.shape[1]]).max()) for a, b in zip(got[0], ref[0])]
    return {
        "max_abs_logit_diff": max(diffs),
        "per_step_max_abs_diff": diffs,
        "tokens_reap": got[1],
        "tokens_llama_cpp": ref[1],
        "same_tokens": got[1] == ref[1],
        "logit_scale": float(np.abs(got[0][0]).max()),
        "prefill_logit_checksum": float(np.abs(got[0][0]).sum()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", type=Path, default=Path("/work/tools/llama.cpp"))
    ap.add_argument("--bindings", type=Path,
                    default=Path("/work/tools/src/llama_cpp_python-0.3.36"))  # fmt: skip
    ap.add_argument("--keep", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "loaders.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lib = bindings(args.llama_cpp, args.bindings)
    result = {"prompt": PROMPT, "steps": STEPS, "config": QWEN, "keep": args.keep}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = make_source(args.llama_cpp, tmp / "source")
        result["prune"] = prune_source(src, tmp / "pruned", args.keep)
        for name, model in (("source", src), ("pruned", tmp / "pruned")):
            gguf = tmp / f"{name}.gguf"
            result[name] = {"convert": convert(args.llama_cpp, model, gguf),
                            **compare(lib, model, gguf)}  # fmt: skip
            cfg = json.loads((model / "config.json").read_text())
            result[name]["config_experts"] = cfg.get("num_experts", cfg.get("num_local_experts"))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("source", "pruned")}, indent=1))


if __name__ == "__main__":
    main()
