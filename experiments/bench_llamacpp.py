"""reap's engine against llama.cpp on the same checkpoint and threads -> reports/llamacpp.md and
reports/llamacpp.json.

    python experiments/bench_llamacpp.py [--work /tmp/reap-llamacpp] [--tools /work/tools]
        [--reps 3] [--threads 1,2] [--prompts 32,512] [--dtypes float32,bfloat16]

1. llama.cpp: the tools under `--tools`/llama.cpp/build/bin (llama-bench), else built there from
   the `llama-cpp-python` source package (`pip download --no-binary`, cmake, CPU only).
2. The checkpoint: a random-weight Qwen3-MoE saved by transformers (the config below: 1.0 B
   parameters, 178 M active), in float32 and a bfloat16 copy, each converted to GGUF (F32,
   BF16) by llama.cpp's own `convert_hf_to_gguf.py`. The byte-level tokenizer reap writes is not
   one the converter knows by hash, and it has no merges (256 byte tokens), which llama.cpp
   refuses; the converter is run with its pre-tokenizer lookup answered "default" and one
   placeholder merge added (every comparison here feeds token ids, never text).
3. Agreement in float32: 16 greedy tokens after 3 prompts, reap vs llama.cpp (its Python
   bindings from the same source package over the library built in 1, F32 KV cache).
4. Speed: `reap run --preset max` (fresh process; its prefill and decode tok/s) and
   `llama-bench -p P -n 0` / `-n N -p 0`, at each thread count and prompt length, the two
   engines interleaved, median of `--reps`; /proc/loadavg recorded around every run (the
   machine is shared: ratios measured side by side are the signal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"
QWEN = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 3072,
    "moe_intermediate_size": 384, "num_hidden_layers": 12, "num_attention_heads": 16,
    "num_key_value_heads": 4, "head_dim": 64, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}  # fmt: skip
PROMPTS = [
    [(97 * i + 13 * j) % 31000 + 300 for j in range(n)] for i, n in ((1, 8), (2, 12), (3, 5))
]


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


# -- llama.cpp ---------------------------------------------------------------------------------
def ensure_llamacpp(tools: Path) -> Path:
    """The llama.cpp tree under `tools` with its tools built (build/bin); builds it if absent."""
    tree = tools / "llama.cpp"
    bench = tree / "build" / "bin" / "llama-bench"
    if bench.is_file():
        return tree
    src = tools / "src"
    src.mkdir(parents=True, exist_ok=True)
    pkg = f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    if not (src / pkg).is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)], check=True,
        )  # fmt: skip
        subprocess.run(["tar", "xzf", f"{pkg}.tar.gz"], cwd=src, check=True)
    if not tree.is_dir():
        subprocess.run(["cp", "-r", str(src / pkg / "vendor" / "llama.cpp"), str(tree)], check=True)
    print(f"building llama.cpp in {tree} (minutes)", flush=True)
    subprocess.run(
        ["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=OFF"], cwd=tree, check=True,
    )  # fmt: skip
    targets = ["llama-bench", "llama-perplexity", "llama-simple", "llama-completion"]
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", *targets], cwd=tree, check=True)
    return tree


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
GREEDY = """
import json
import llama_cpp
import numpy as np
llm = llama_cpp.Llama(model_path={gguf!r}, n_ctx=256, n_threads=1, n_batch=256, verbose=False,
                      type_k=0, type_v=0, logits_all=True)
out = []
for prompt in {prompts!r}:
    llm.reset()
    llm.eval(prompt)
    ids = []
    for _ in range({n}):
        ids.append(int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1]))))
        llm.eval([ids[-1]])
    out.append(ids)
print(json.dumps(out))
"""


def _python(code: str, pythonpath: list[Path], env: dict | None = None) -> str:
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
    """`convert_hf_to_gguf.py SRC --outtype OUTTYPE` (see the module docstring)."""
    if not out.is_file():
        code = CONVERT.format(src=str(src), outtype=outtype, out=str(out))
        _python(code, [tree, tree / "gguf-py"])
    return out


# -- the checkpoint ----------------------------------------------------------------------------
def make_checkpoint(work: Path) -> dict[str, Path]:
    """float32 and bfloat16 saves of the random Qwen3-MoE (made once, kept under `work`)."""
    out = {"float32": work / "qwen3moe-f32", "bfloat16": work / "qwen3moe-bf16"}
    if all((p / "config.json").is_file() for p in out.values()):
        return out
    import torch
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.tokenizer import byte_tokenizer_files

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN)).float().eval()
    with torch.no_grad():  # random weights of a trained model's scale, not transformers' init
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    for dtype, path in out.items():
        model.to(getattr(torch, dtype)).save_pretrained(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(num_experts=QWEN["num_experts"], rope_theta=QWEN["rope_theta"])
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        for name, text in byte_tokenizer_files().items():
            (path / name).write_text(text)
    return out


# -- agreement ---------------------------------------------------------------------------------
def reap_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    from reap.engine import Engine

    with Engine.open(path, preset="max", context=256, dtype="float32") as eng:
        return eng.generate([prompt], max_tokens=n)[0].ids


def llama_greedy(tools: Path, tree: Path, gguf: Path, n: int) -> list[list[int]]:
    """Greedy ids from llama.cpp for every prompt: token ids in, argmax of its logits out (F32
    KV cache), through llama-cpp-python's bindings (same source package) over the library
    built in `tree`."""
    code = GREEDY.format(gguf=str(gguf), prompts=PROMPTS, n=n)
    pkg = tools / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    env = {"LLAMA_CPP_LIB_PATH": str(tree / "build" / "bin")}
    return json.loads(_python(code, [pkg], env))


def agreement(tools: Path, tree: Path, ckpt: Path, gguf: Path, n: int = 16) -> list[dict]:
    rows = []
    for p, theirs in zip(PROMPTS, llama_greedy(tools, tree, gguf, n)):
        ours = reap_greedy(ckpt, p, n)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n)
        rows.append({"prompt": p, "reap": ours, "llama.cpp": theirs, "agree_first": same})
        print(f"prompt of {len(p)}: first {same}/{n} greedy tokens agree", flush=True)
    return rows


# -- speed -------------------------------------------------------------------------------------
def reap_speed(path: Path, dtype: str, threads: int, prompt: int, decode: int) -> dict:
    """`reap run --preset max` in a fresh process: prefill and decode tok/s."""
    ids = ",".join(str(300 + (7 * i) % 30000) for i in range(prompt))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "reap.cli", "run", str(path), "--preset", "max", "--dtype",
           dtype, "--prompt-ids", ids, "--max-tokens", str(decode), "--ignore-eos",
           "--threads", str(threads), "--context", str(prompt + decode + 8), "--json", "--quiet"]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0:
        raise SystemExit(f"reap run failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    m = json.loads(p.stdout)["metrics"]
    return {
        "prefill": m["prefill"]["tokens_per_s"],
        "decode": m["decode"]["tokens_per_s"],
        "hit": m["decode"]["expert_hit_rate"],
    }


def llama_speed(tree: Path, gguf: Path, threads: int, prompt: int, decode: int) -> dict:
    """llama-bench: prefill of `prompt` tokens, then `decode` tokens after a context of `prompt`
    (-d), one repetition each (after its own warm-up run)."""
    bench = str(tree / "build" / "bin" / "llama-bench")
    out = {}
    for key, args in (("prefill", ["-p", str(prompt), "-n", "0"]),
                      ("decode", ["-p", "0", "-n", str(decode), "-d", str(prompt)])):  # fmt: skip
        cmd = [bench, "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json", *args]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if p.returncode != 0:
            raise SystemExit(f"llama-bench failed ({p.returncode}): {p.stderr.strip()[-500:]}")
        out[key] = json.loads(p.stdout)[0]["avg_ts"]
    return out


def speed(tree, ckpts, ggufs, args) -> list[dict]:
    """Every (dtype, threads, prompt) cell: reap and llama.cpp interleaved, `reps` times."""
    rows = []
    for dtype in args.dtypes.split(","):
        for threads in map(int, args.threads.split(",")):
            for prompt in map(int, args.prompts.split(",")):
                runs = []
                for _ in range(args.reps):
                    l0 = load()
                    ours = reap_speed(ckpts[dtype], dtype, threads, prompt, args.decode)
                    l1 = load()
                    theirs = llama_speed(tree, ggufs[dtype], threads, prompt, args.decode)
                    runs.append({"reap": ours, "llama.cpp": theirs, "load": [l0, l1, load()]})
                row = summarize(dtype, threads, prompt, runs)
                print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
                rows.append(row)
    return rows


def summarize(dtype, threads, prompt, runs) -> dict:
    def med(who, key):
        return statistics.median(r[who][key] for r in runs)

    row = {"dtype": dtype, "threads": threads, "prompt": prompt, "runs": runs}
    for key in ("prefill", "decode"):
        row[key] = {"reap": med("reap", key), "llama.cpp": med("llama.cpp", key)}
        row[key]["ratio"] = row[key]["reap"] / row[key]["llama.cpp"]
    row["hit"] = med("reap", "hit")
    return row


# -- report ------------------------------------------------------------------------------------
def report(res: dict) -> str:
    lines = [
        "# reap vs llama.cpp on the same checkpoint and threads",
        "",
        (
            f"Command: `{res['command']}` ({res['minutes']:.1f} min; code {res['code_version']}; "
            f"load average {res['load'][0]} -> {res['load'][1]} on a shared 2-core machine: "
            "other helpers ran at the same time, so absolute rates are noisy; each ratio comes "
            "from runs interleaved in the same minutes)."
        ),
        "",
        (
            f"Checkpoint: random-weight Qwen3-MoE saved by transformers ({res['params']}); GGUF "
            f"by llama.cpp's `convert_hf_to_gguf.py` (llama-cpp-python {LLAMA_CPP_PYTHON} "
            "source, CPU build, -DGGML_NATIVE=ON). reap: `reap run --preset max` (fresh "
            f"process); llama.cpp: `llama-bench -r 1` (prefill `-p P -n 0`, decode "
            f"`-n {res['decode']} -d P`). Median of {res['reps']}."
        ),
        "",
        "## Greedy agreement (float32, llama.cpp with an F32 KV cache)",
        "",
        "| prompt | agreeing of 16 | reap | llama.cpp |",
        "|---|---|---|---|",
    ]
    for a in res["agreement"]:
        lines.append(f"| {len(a['prompt'])} tokens | {a['agree_first']} | {a['reap']} | "
                     f"{a['llama.cpp']} |")  # fmt: skip
    lines += [
        "",
        "## Speed (tokens/s, median; ratio = reap / llama.cpp)",
        "",
        (
            "| dtype | threads | prompt | prefill reap | llama.cpp | ratio | decode reap | "
            "llama.cpp | ratio | expert hit | load (1-min) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["speed"]:
        p, d = r["prefill"], r["decode"]
        loads = sorted(float(x) for run in r["runs"] for x in run["load"])
        lines.append(
            f"| {r['dtype']} | {r['threads']} | {r['prompt']} | {p['reap']:.1f} | "
            f"{p['llama.cpp']:.1f} | **{p['ratio']:.2f}** | {d['reap']:.1f} | "
            f"{d['llama.cpp']:.1f} | **{d['ratio']:.2f}** | {r['hit']:.2f} | "
            f"{loads[0]:.1f}-{loads[-1]:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/reap-llamacpp")
    ap.add_argument("--tools", default="/work/tools")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--no-agreement", action="store_true")
    args = ap.parse_args()
    from reap.fileio import write_atomic
    from reap.provenance import code_version

    t0, l0 = time.time(), load()
    work, tools = Path(args.work), Path(args.tools)
    work.mkdir(parents=True, exist_ok=True)
    tree = ensure_llamacpp(tools)
    ckpts = make_checkpoint(work)
    ggufs = {
        "float32": convert(tree, ckpts["float32"], work / "qwen3moe-f32.gguf", "f32"),
        "bfloat16": convert(tree, ckpts["bfloat16"], work / "qwen3moe-bf16.gguf", "bf16"),
    }
    agree = [] if args.no_agreement else agreement(tools, tree, ckpts["float32"], ggufs["float32"])
    rows = speed(tree, ckpts, ggufs, args)
    res = {
        "command": "python experiments/bench_llamacpp.py " + " ".join(sys.argv[1:]),
        "minutes": (time.time() - t0) / 60, "code_version": code_version(), "load": [l0, load()],
        "params": "vocab 32000, hidden 1024, 12 layers, 64 experts top-8, moe_intermediate "
                  "384, 16/4 heads: 1.0 B parameters, 178 M active",
        "decode": args.decode, "reps": args.reps, "agreement": agree, "speed": rows,
    }  # fmt: skip
    write_atomic(ROOT / "reports" / "llamacpp.json", json.dumps(res, indent=1).encode())
    write_atomic(ROOT / "reports" / "llamacpp.md", report(res).encode())
    print(report(res))


if __name__ == "__main__":
    main()
