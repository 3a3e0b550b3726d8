"""reap's engine against llama.cpp on the same checkpoints and threads -> reports/llamacpp.md and
reports/llamacpp.json.

    python -m experiments.bench_llamacpp [--models 1b,big,gptoss]
        [--sections agreement,speed,perplexity] [--reps 3] [--threads 1,2] [--prompts 32,512]
        [--dtypes float32,bfloat16] [--decode 32] [--work /tmp/reap-llamacpp] [--tools /work/tools]

    # harness check -> reports/llamacpp-draft.{md,json} (10 min here): one rep, 2 cells a model
    python -m experiments.bench_llamacpp --draft --reps 1 --threads 1 --prompts 32 --decode 8

The full default run takes about an hour on this 2-core machine when quiet (per model, minutes:
1b agreement 0.3, speed 4-5, perplexity 6; big 0.6, 9-10, 13; gptoss 2, 12, 8; every model and
section can be run alone with --models / --sections). Disk: 1b 12 GB, big 25 GB (under
`--work`-big), gptoss 8 GB; peak memory about 9 GB (reap holding the big float32 model).

1. llama.cpp: the tools under `--tools`/llama.cpp/build/bin (llama-bench, llama-perplexity),
   else built there from the `llama-cpp-python` source package (`pip download --no-binary`,
   cmake, CPU only); its Python bindings come from the same package.
2. The models (`llamacpp_models`): `1b` and `big` random Qwen3-MoE (1.0 B and 2.07 B
   parameters) saved by transformers in float32 and bfloat16, `gptoss` a random GPT-OSS with
   MXFP4 experts in the release's layout; each converted to GGUF (F32, BF16; gptoss's experts
   stay MXFP4) by llama.cpp's own `convert_hf_to_gguf.py` (under `--work`; big under
   `--work`-big). Made once and kept.
3. agreement: 16 greedy tokens after 3 prompts in float32, reap vs llama.cpp (its bindings,
   token ids in, argmax of its logits out, F32 KV cache).
4. speed: `reap run --preset max --warmup` (fresh process; its prefill and decode tok/s after
   one unmeasured generation, as llama-bench's warm-up run) and
   `llama-bench -p P -n 0` / `-n N -d P` at each dtype, thread count and prompt length;
   after each cell, the GB/s the same threads read from RAM (a torch sum over 1 GiB), against
   which a decode rate is put as weight bytes a token reads x tokens/s.
5. perplexity (`llamacpp_ppl`): reap's perplexity pass vs `llama-perplexity` on the same
   4096 token ids (8 chunks of 512, 4 in parallel), both perplexities and tokens/s.
Every cell runs the two engines interleaved (order alternating between repetitions), median
of `--reps`; /proc/loadavg is recorded around every run (the machine is shared: ratios
measured side by side are the signal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

from experiments import llamacpp_ppl as ppl
from experiments.llamacpp_models import LLAMA_CPP_PYTHON, Model, bindings, prepare, run_python
from experiments.llamacpp_mxfp4 import decode_check
from experiments.llamacpp_report import report

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    [(97 * i + 13 * j) % 31000 + 300 for j in range(n)] for i, n in ((1, 8), (2, 12), (3, 5))
]
SECTIONS = ("agreement", "speed", "perplexity")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def cpu() -> str:
    """The CPU in words, with the vector width reap's kernels run in (results differ by CPU:
    the kernels are AVX-512, AVX2 or plain C, and so are llama.cpp's)."""
    from reap.quant import ckernel, step_kernel

    info = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, val = line.partition(":")
        info.setdefault(key.strip(), val.strip())
    flags = set(ckernel.machine_tag().split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    lib = step_kernel.library()
    width = f"{lib.reap_simd()}-bit" if lib is not None and lib.reap_simd() else "plain C"
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}), {isa}; reap's kernels {width}")  # fmt: skip


# -- llama.cpp ---------------------------------------------------------------------------------
def ensure_llamacpp(tools: Path) -> Path:
    """The llama.cpp tree under `tools` with its tools built (build/bin); builds it if absent."""
    tree = tools / "llama.cpp"
    targets = ["llama-bench", "llama-perplexity", "llama-simple", "llama-completion"]
    if all((tree / "build" / "bin" / t).is_file() for t in targets):
        return tree
    src = tools / "src"
    src.mkdir(parents=True, exist_ok=True)
    pkg = bindings(tools)
    if not pkg.is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src)], check=True,
        )  # fmt: skip
        subprocess.run(["tar", "xzf", f"{pkg.name}.tar.gz"], cwd=src, check=True)
    if not tree.is_dir():
        subprocess.run(["cp", "-r", str(pkg / "vendor" / "llama.cpp"), str(tree)], check=True)
    print(f"building llama.cpp in {tree} (minutes)", flush=True)
    subprocess.run(
        ["cmake", "-S", ".", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_SERVER=OFF"], cwd=tree, check=True,
    )  # fmt: skip
    subprocess.run(["cmake", "--build", "build", "-j2", "--target", *targets], cwd=tree, check=True)
    return tree


# -- agreement ---------------------------------------------------------------------------------
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
    ids, first = [], np.asarray(llm.scores[llm.n_tokens - 1]).tolist()
    for _ in range({n}):
        ids.append(int(np.argmax(np.asarray(llm.scores[llm.n_tokens - 1]))))
        llm.eval([ids[-1]])
    out.append({{"ids": ids, "logits": first}})
print(json.dumps(out))
"""


def reap_greedy(path: Path, n: int) -> list[dict]:
    """reap's greedy ids after every prompt, and its logits at each prompt's last position."""
    from reap.engine import Engine

    out = []
    with Engine.open(path, preset="max", context=256, dtype="float32") as eng:
        for p in PROMPTS:
            ids = eng.generate([p], max_tokens=n)[0].ids
            out.append({"ids": ids, "logits": eng.logits([p])[0][-1].tolist()})
    return out


def llama_greedy(tools: Path, tree: Path, gguf: Path, n: int) -> list[dict]:
    """Greedy ids from llama.cpp for every prompt: token ids in, argmax of its logits out (F32
    KV cache), through llama-cpp-python's bindings over the library built in `tree`."""
    code = GREEDY.format(gguf=str(gguf), prompts=PROMPTS, n=n)
    env = {"LLAMA_CPP_LIB_PATH": str(tree / "build" / "bin")}
    return json.loads(run_python(code, [bindings(tools)], env))


def greedy_rows(tools: Path, tree: Path, ckpt: Path, gguf: Path, n: int = 16) -> list[dict]:
    """Per prompt: both greedy continuations, how many first tokens agree, and the largest
    |logit difference| after the prompt."""
    rows = []
    for p, ours, theirs in zip(PROMPTS, reap_greedy(ckpt, n), llama_greedy(tools, tree, gguf, n)):
        same = next((i for i, (a, b) in enumerate(zip(ours["ids"], theirs["ids"])) if a != b), n)
        diff = max(abs(a - b) for a, b in zip(ours["logits"], theirs["logits"]))
        scale = max(map(abs, ours["logits"]))
        rows.append({"prompt": p, "reap": ours["ids"], "llama.cpp": theirs["ids"],
                     "agree_first": same, "max_logit_diff": diff, "max_logit": scale})  # fmt: skip
        print(f"{gguf.name}: prompt of {len(p)}: first {same}/{n} greedy tokens agree, "
              f"max |logit diff| {diff:.2e}", flush=True)  # fmt: skip
    return rows


def agreement(tools: Path, tree: Path, model: Model) -> dict:
    """Greedy agreement in float32; for gptoss also llama.cpp's MXFP4 decoding against reap's
    and the agreement on the experts-decoded copy (see `llamacpp_mxfp4`)."""
    res = {"rows": greedy_rows(tools, tree, model.ckpts["float32"], model.ggufs["float32"])}
    if model.dense is not None:
        res["mxfp4_decode"] = decode_check(tree, model.ckpts["float32"], model.ggufs["float32"])
        print(f"{model.name}: MXFP4 decode check {res['mxfp4_decode']}", flush=True)
        res["dense_rows"] = greedy_rows(tools, tree, *model.dense)
    return res


# -- speed -------------------------------------------------------------------------------------
def reap_speed(path: Path, dtype: str, threads: int, prompt: int, decode: int) -> dict:
    """`reap run --preset max` in a fresh process: prefill and decode tok/s."""
    ids = ",".join(str(300 + (7 * i) % 30000) for i in range(prompt))
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "reap.cli", "run", str(path), "--preset", "max", "--dtype",
           dtype, "--prompt-ids", ids, "--max-tokens", str(decode), "--ignore-eos",
           "--threads", str(threads), "--context", str(prompt + decode + 8), "--warmup", "--json",
           "--quiet"]  # fmt: skip
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=1800, check=False)  # fmt: skip
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


def interleaved(reps: int, ours, theirs) -> list[dict]:
    """`reps` runs of the two thunks, reap first on even repetitions and llama.cpp first on
    odd ones, each run with the 1-minute load before, between and after."""
    runs = []
    for r in range(reps):
        order = [("reap", ours), ("llama.cpp", theirs)]
        run, loads = {}, [load()]
        for who, thunk in order if r % 2 == 0 else order[::-1]:
            run[who] = thunk()
            loads.append(load())
        runs.append({**run, "load": loads})
    return runs


def speed(tree: Path, model: Model, args) -> list[dict]:
    """Every (dtype, threads, prompt) cell of `model`: reap and llama.cpp interleaved."""
    rows = []
    for dtype in args.dtypes.split(","):
        for threads in map(int, args.threads.split(",")):
            for prompt in map(int, args.prompts.split(",")):
                runs = interleaved(
                    args.reps,
                    partial(reap_speed, model.ckpts[dtype], dtype, threads, prompt, args.decode),
                    partial(llama_speed, tree, model.ggufs[dtype], threads, prompt, args.decode),
                )
                row = summarize(dtype, threads, prompt, runs)
                row["read_gbps"] = read_bandwidth(threads)
                if dtype in model.token_bytes:
                    row["token_bytes"] = model.token_bytes[dtype]
                print(model.name, json.dumps({k: v for k, v in row.items() if k != "runs"}),
                      flush=True)  # fmt: skip
                rows.append(row)
    return rows


PROBE = """
import statistics, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a = torch.ones(1 << 28)  # 1 GiB of float32, far beyond any cache
a.sum()
ts = []
for _ in range(5):
    t = time.perf_counter()
    a.sum()
    ts.append(time.perf_counter() - t)
print(a.numel() * 4 / statistics.median(ts) / 1e9)
"""


def read_bandwidth(threads: int) -> float:
    """GB/s that `threads` threads read from RAM now: the median of 5 torch sums over 1 GiB
    (the ceiling of a decode step, which reads every active weight once)."""
    p = subprocess.run([sys.executable, "-c", PROBE, str(threads)], capture_output=True,
                       text=True, timeout=600, check=False)  # fmt: skip
    if p.returncode != 0:
        raise SystemExit(f"bandwidth probe failed ({p.returncode}): {p.stderr.strip()[-500:]}")
    return float(p.stdout)


def summarize(dtype, threads, prompt, runs) -> dict:
    def med(who, key):
        return statistics.median(r[who][key] for r in runs)

    row = {"dtype": dtype, "threads": threads, "prompt": prompt, "runs": runs}
    for key in ("prefill", "decode"):
        row[key] = {"reap": med("reap", key), "llama.cpp": med("llama.cpp", key)}
        row[key]["ratio"] = row[key]["reap"] / row[key]["llama.cpp"]
    row["hit"] = med("reap", "hit")
    return row


# -- perplexity --------------------------------------------------------------------------------
def perplexity(work: Path, tools: Path, tree: Path, model: Model, args) -> dict:
    """reap's perplexity pass vs llama-perplexity on the same ids, per dtype and threads."""
    text = ppl.prepare(work, tools, tree, model)
    rows = []
    for dtype in args.dtypes.split(","):
        for threads in map(int, args.threads.split(",")):
            f32_cache = dtype == "float32"
            runs = interleaved(
                args.reps,
                partial(ppl.reap_ppl, ROOT, model.ckpts[dtype], dtype, threads, text["ids"]),
                partial(ppl.llama_ppl, tree, model.ggufs[dtype], text["text"], threads, f32_cache),
            )
            row = ppl.summarize(dtype, threads, runs)
            print(model.name, json.dumps({k: v for k, v in row.items() if k != "runs"}),
                  flush=True)  # fmt: skip
            rows.append(row)
    return {**{k: v for k, v in text.items() if k in ("same_tokens", "add_bos", "chunks")},
            "n_ctx": ppl.N_CTX, "parallel": ppl.PARALLEL, "rows": rows}  # fmt: skip


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1b,big,gptoss", help="comma-separated: 1b, big, gptoss")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: "
                    + ", ".join(SECTIONS))  # fmt: skip
    ap.add_argument("--work", default="/tmp/reap-llamacpp")
    ap.add_argument("--tools", default="/work/tools")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--out", default="reports/llamacpp", help="report path without suffix")
    ap.add_argument("--draft", action="store_true",
                    help="a harness check: write reports/llamacpp-draft.{md,json}, marked so")  # fmt: skip
    args = ap.parse_args(argv)
    if args.draft:
        args.out = "reports/llamacpp-draft"
    bad = set(args.sections.split(",")) - set(SECTIONS)
    if bad:
        ap.error(f"--sections: unknown {sorted(bad)}")
    return args


def run_model(name: str, work: Path, tools: Path, tree: Path, args) -> dict:
    """Every asked section for model `name`, with the minutes each took."""
    t0 = time.time()
    model = prepare(name, work, tree)
    res: dict = {"params": model.params, "ggufs": {k: str(v) for k, v in model.ggufs.items()}}
    run = {
        "agreement": lambda: agreement(tools, tree, model),
        "speed": lambda: speed(tree, model, args),
        "perplexity": lambda: perplexity(work, tools, tree, model, args),
    }
    res["section_minutes"] = {"prepare": (time.time() - t0) / 60}
    for section in args.sections.split(","):
        t1 = time.time()
        res[section] = run[section]()
        res["section_minutes"][section] = (time.time() - t1) / 60
    res["minutes"] = (time.time() - t0) / 60
    return res


def save_report(out: Path, res: dict, render) -> None:
    """`out`.json (the results) and `out`.md (`render(res)`), each written atomically; the
    markdown printed."""
    from reap.fileio import write_atomic

    write_atomic(out.with_suffix(".json"), json.dumps(res, indent=1).encode())
    write_atomic(out.with_suffix(".md"), render(res).encode())
    print(render(res))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from reap.provenance import code_version

    t0, l0 = time.time(), load()
    work, tools = Path(args.work), Path(args.tools)
    work.mkdir(parents=True, exist_ok=True)
    tree = ensure_llamacpp(tools)
    models = {name: run_model(name, work, tools, tree, args) for name in args.models.split(",")}
    res = {
        "command": "python -m experiments.bench_llamacpp " + " ".join(sys.argv[1:]),
        "minutes": (time.time() - t0) / 60, "code_version": code_version(), "load": [l0, load()],
        "llama_cpp_python": LLAMA_CPP_PYTHON, "decode": args.decode, "reps": args.reps,
        "draft": args.draft, "cpu": cpu(),
        "models": models,
    }  # fmt: skip
    save_report(ROOT / args.out, res, report)


if __name__ == "__main__":
    main()
