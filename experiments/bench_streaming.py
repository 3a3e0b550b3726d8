"""A model larger than memory: reap's streaming engine against llama.cpp's mmap, each in its own
memory cgroup capped at a fraction of the checkpoint's bytes -> reports/streaming.{md,json}.

    # the full bench (as root, on a quiet machine: about 2-3 hours at 2 cores; disk under --work)
    python -m experiments.bench_streaming --models big,gptoss --caps 0.5,0.25 --reps 3

    # harness check -> reports/streaming-draft.{md,json}: a 2 GB bf16 model, one rep
    python -m experiments.bench_streaming --draft

Why a cgroup: the page cache is charged to the cgroup that faults it in, so neither engine can
keep the file in RAM beyond the cap (llama.cpp's mmap pages are evicted and re-read like anything
else). cgroup v1 (`/sys/fs/cgroup/memory/NAME`, `memory.limit_in_bytes`) and v2
(`/sys/fs/cgroup/NAME`, `memory.max`, with `+memory` in the root's `cgroup.subtree_control`) are
both handled; elsewhere (no root, a container without a writable cgroup tree) the same caps can
be applied by `systemd-run --scope -p MemoryMax=BYTES CMD` around each runner (the runners are
plain `python -c` programs, printed by --print-runners), or by running in a VM of that RAM size.

Per cell (model x dtype x cap x cold/warm), the two engines run interleaved (order alternating by
repetition), median of `--reps`:
- cold: `echo 3 > /proc/sys/vm/drop_caches` and a fresh cgroup; warm: the same cgroup right after
  (what the cap let stay in the page cache stays).
- llama.cpp: its Python bindings over the library built in `--tools` (mmap, the default), token
  ids in, argmax out (F32 KV cache; MXFP4 experts with its --no-repack: repacked, they are copied
  out of the mapping into anonymous memory and the cgroup kills it); reap: `Engine.open(budget=
  0.85 x cap)` (what `reap run --budget` opens; `--direct` reads by default, see --buffered)
  stepping the same ids.
- prefill and decode tok/s; bytes read from disk per token (`/proc/self/io` read_bytes around each
  phase); peak RSS (`ru_maxrss`) and the cgroup's peak; greedy tokens equal (reap vs llama.cpp, and
  reap's tokens across every cap: the determinism claim).
- reap's I/O floor: the bytes its cache policy makes a decode token read (its reader's counters)
  divided by the disk's O_DIRECT bandwidth measured in the same run (4 MB aligned reads of the
  checkpoint's largest file, page cache bypassed).
- load: the CPU the whole machine used during the run (/proc/stat busy jiffies / wall time: this
  counts every process, ours included, and not I/O wait, which the load average would), the
  1-minute load average and /proc/pressure/cpu around it. A cell where any run's machine CPU
  exceeded the threads it used (+ `LOAD_SLACK`) is marked invalid and left out of every summary.

`--resident-from` section (first dtype, 50 % cap or the largest cap): statistics from `reap
calibrate` on the `code` corpus; one-token steps over held-out sequences (teacher-forced: the
corpus's own tokens, not a random model's output) of `code` (where the statistics came from) and
`zh` (where they did not), with the expert cache pinned by the statistics, LFU (the default), LRU
(half-life 1: each use outweighs all earlier ones) and no cache; hit rate, decode tok/s, bytes
per token, tokens equal across policies.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from experiments.bench_llamacpp import cpu, ensure_llamacpp, save_report
from experiments.llamacpp_models import (
    QWEN_1B,
    Model,
    _finish,
    _qwen,
    bindings,
    convert,
    describe,  # fmt: skip
    prepare,
)
from experiments.llamacpp_report import LOAD_SLACK

ROOT = Path(__file__).resolve().parent.parent
V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
BUDGET_FRACTION = 0.85  # reap's --budget of a cap: the rest for the kernel's own charges
DRAFT = {**QWEN_1B}  # 1.0 B parameters: 2.0 GB in bf16
PROMPT = [(97 * j) % 250 + 3 for j in range(32)]  # byte-tokenizer ids


# -- the machine ---------------------------------------------------------------------------
def cgroup(name: str, limit: int) -> Path:
    """A fresh memory cgroup capped at `limit` bytes (v1 or v2); its directory."""
    v2 = not V1.is_dir()
    path = (V2 if v2 else V1) / name
    if path.is_dir():
        path.rmdir()  # empty: its runner exited; charged page cache moves to the parent
    path.mkdir()
    (path / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
    return path


def cgroup_peak(path: Path) -> int | None:
    for f in ("memory.max_usage_in_bytes", "memory.peak"):
        if (path / f).is_file():
            return int((path / f).read_text().split()[0])
    return None


def drop_caches() -> None:
    subprocess.run(["sync"], check=False)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine: busy excludes idle and iowait."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


def probes() -> dict:
    psi = Path("/proc/pressure/cpu")
    some = psi.read_text().split("\n")[0] if psi.is_file() else ""
    return {"load": float(Path("/proc/loadavg").read_text().split()[0]),
            "psi_some_avg10": float(some.split()[1].split("=")[1]) if some else None}  # fmt: skip


def direct_bandwidth(path: Path, limit: int = 1 << 30, block: int = 4 << 20) -> float:
    """GB/s of 4 MB aligned O_DIRECT reads of `path` (at most `limit` bytes), page cache bypassed."""
    return _direct_gbps(path, block, lambda size: range(0, min(limit, size), block))


def random_bandwidth(path: Path, piece: int, n: int = 48, seed: int = 0) -> float:
    """GB/s of O_DIRECT reads of `piece` bytes (one expert, rounded up to 4096) at random 4096-
    aligned offsets of `path`, one at a time: what reap's misses ask of the disk."""
    import random

    piece, rng = -(-piece // 4096) * 4096, random.Random(seed)
    return _direct_gbps(path, piece, lambda size: [rng.randrange(0, size - piece) // 4096 * 4096
                                                   for _ in range(n)])  # fmt: skip


def _direct_gbps(path: Path, block: int, offsets) -> float:
    """GB/s of O_DIRECT reads of `block` bytes at `offsets(file size)`, one after another."""
    import mmap

    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        where, t0 = offsets(os.fstat(fd).st_size), time.perf_counter()
        got = sum(os.preadv(fd, [buf], at) for at in where)
        return got / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)


# -- the runners (each a fresh interpreter in its cgroup, one JSON line out) -----------------
COMMON = """
import json, os, resource, sys, time
def io():
    return int(dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())["read_bytes"])
a = json.loads(sys.argv[1])
T, R = [time.perf_counter()], [io()]
def mark():
    T.append(time.perf_counter()); R.append(io())
def done(ids, **extra):
    d = a["decode"] if "seqs" not in a else sum(len(s) for s in a["seqs"])
    print(json.dumps({"ids": ids, "open_s": T[1] - T[0], "prefill": len(a["prompt"]) / (T[2] - T[1]),
                      "decode": d / (T[3] - T[2]), "prefill_read": R[2] - R[1],
                      "decode_read_per_token": (R[3] - R[2]) / d, "open_read": R[1] - R[0],
                      "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **extra}))
"""
LLAMA = COMMON + """
import llama_cpp, numpy as np
if a["no_repack"]:  # its --no-repack: MXFP4 weights stay in the mapping (else copied out of it)
    default = llama_cpp.llama_cpp.llama_model_default_params
    def no_repack():
        p = default()
        p.use_extra_bufts = False
        return p
    llama_cpp.llama_cpp.llama_model_default_params = no_repack
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=a["ctx"], n_threads=a["threads"],
                      n_threads_batch=a["threads"], n_batch=a["ctx"], verbose=False,
                      type_k=0, type_v=0)
V = llm.n_vocab()
def last():  # the batch's one logits row (only the last position asks for logits)
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(V,))))
mark()
llm.eval(a["prompt"])
ids = [last()]
mark()
for _ in range(a["decode"]):
    llm.eval([ids[-1]])
    ids.append(last())
mark()
done(ids)
"""
REAP = COMMON + """
import torch
from reap.engine import Engine
from reap.engine.experts import ExpertCache
torch.set_num_threads(a["threads"])
eng = Engine.open(a["model"], budget=a["budget"], context=a["ctx"], dtype=a["dtype"],
                  direct=a["direct"], resident_from=a.get("resident_from"))
if "half_life" in a:  # else the engine's: one decode token's expert uses
    eng.experts.half_life = a["half_life"]  # 1: each use outweighs all earlier ones (LRU)
if a["policy"] == "none":
    old = eng.experts
    eng.experts = ExpertCache(eng.reader, 0, old.names_of, old.matrices_of)
    old.close()
mark()
s = eng.new_sequence()
ids = [int(eng.step([s], [a["prompt"]])[0].argmax())]
mark()
c0, h0, m0 = sum(eng.reader.io.bytes.values()), eng.experts.hits, eng.experts.misses
if "seqs" in a:  # teacher-forced one-token steps over corpus sequences
    for seq in a["seqs"]:
        s = eng.new_sequence()
        ids += [int(eng.step([s], [[t]])[0].argmax()) for t in seq]
else:
    for _ in range(a["decode"]):
        ids.append(int(eng.step([s], [[ids[-1]]])[0].argmax()))
mark()
d = a["decode"] if "seqs" not in a else sum(len(x) for x in a["seqs"])
h, m = eng.experts.hits - h0, eng.experts.misses - m0
done(ids, reap_read_per_token=(sum(eng.reader.io.bytes.values()) - c0) / d,
     hit_rate=h / max(1, h + m), pinned=len(eng.experts.pinned), plan=eng.plan.to_dict(),
     expert_bytes=max(eng.plan_bytes.expert_bytes or [0]))
"""


def run(who: str, code: str, arg: dict, cg: Path | None, threads: int, tools: Path) -> dict:
    """One runner in cgroup `cg` (None: uncapped): its JSON, the machine CPU and probes around."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if who == "llama.cpp":
        tree = tools / "llama.cpp"
        env.update(PYTHONPATH=str(bindings(tools)), LLAMA_CPP_LIB_PATH=str(tree / "build" / "bin"))

    def enter():
        if cg is not None:
            (cg / "cgroup.procs").write_text(str(os.getpid()))

    before, (b0, _) = probes(), busy()
    w0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], env=env, cwd=ROOT,
                       capture_output=True, text=True, preexec_fn=enter, timeout=3600, check=False)  # fmt: skip
    wall = time.perf_counter() - w0
    b1, _ = busy()
    hz = os.sysconf("SC_CLK_TCK")
    out = {"machine_cpu": (b1 - b0) / hz / wall, "wall_s": wall, "before": before,
           "after": probes(), "cgroup_peak": cgroup_peak(cg) if cg else None}  # fmt: skip
    if p.returncode != 0:
        return {**out, "error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
    return {**out, **json.loads(p.stdout.strip().splitlines()[-1])}


# -- the cells -------------------------------------------------------------------------------
def ckpt_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def cell_runs(model: Model, dtype: str, cap: int, args, rep: int) -> dict:
    """One repetition of a cap: per engine (order by repetition) a cold run in a fresh cgroup
    after dropping the page cache, then a warm run in the same cgroup."""
    ck, gguf = model.ckpts[dtype], model.ggufs[dtype]
    arg = decode_args(args)
    mxfp4 = model.name.startswith("gptoss")  # MXFP4 experts: llama.cpp's --no-repack
    eng = {"reap": (REAP, reap_args(model, dtype, args, int(BUDGET_FRACTION * cap))),
           "llama.cpp": (LLAMA, {**arg, "gguf": str(gguf), "no_repack": mxfp4})}
    order = list(eng) if rep % 2 == 0 else list(eng)[::-1]
    out: dict = {}
    for who in order:
        drop_caches()
        cg = cgroup(f"reap-bench-{who.replace('.', '')}", cap)
        code, a = eng[who]
        out[who] = {"cold": run(who, code, a, cg, args.threads, Path(args.tools))}
        out[who]["warm"] = run(who, code, a, cg, args.threads, Path(args.tools))
    files = sorted(ck.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    out["direct_gbps"] = direct_bandwidth(files[-1])
    piece = max((out["reap"][s].get("expert_bytes", 0) for s in ("cold", "warm")), default=0)
    out["random_gbps"] = random_bandwidth(files[-1], piece, seed=rep) if piece else None
    return out


def decode_args(args) -> dict:
    """What both runners of a cell take: the prompt, decode tokens, threads, context."""
    return {"prompt": PROMPT, "decode": args.decode, "threads": args.threads,
            "ctx": len(PROMPT) + args.decode + 8}  # fmt: skip


def reap_args(model: Model, dtype: str, args, budget: int) -> dict:
    """The reap runner's arguments for a cell under `budget` bytes (the engine's cache policy)."""
    return {**decode_args(args), "model": str(model.ckpts[dtype]), "budget": budget,
            "dtype": dtype, "direct": not args.buffered, "policy": "lfu"}  # fmt: skip


def valid(run: dict, threads: int) -> bool:
    return "error" not in run and run["machine_cpu"] <= threads + LOAD_SLACK


def summarize(runs: list[dict], threads: int, compute_s: float | None = None) -> list[dict]:
    """Per (state, engine) the medians over repetitions; a cell (state) is valid when every run
    of both engines in it is. `compute_s`: reap's decode s/token with every weight in RAM."""
    rows = []
    for state in ("cold", "warm"):
        row: dict = {"state": state, "valid": all(valid(r[w][state], threads)
                                                  for r in runs for w in ("reap", "llama.cpp"))}
        for who in ("reap", "llama.cpp"):
            ok = [r[who][state] for r in runs if "error" not in r[who][state]]
            errs = [r[who][state]["error"] for r in runs if "error" in r[who][state]]
            if not ok:
                row[who] = {"error": errs[0]}
                row["valid"] = False
                continue
            med = {k: statistics.median(x[k] for x in ok)
                   for k in ("prefill", "decode", "decode_read_per_token", "rss", "machine_cpu")}
            med["cgroup_peak"] = max((x["cgroup_peak"] or 0) for x in ok)
            med["ids"] = ok[0]["ids"]
            if who == "reap":
                med["reap_read_per_token"] = statistics.median(x["reap_read_per_token"] for x in ok)
                med["hit_rate"] = statistics.median(x["hit_rate"] for x in ok)
            row[who] = med
        if "ids" in row["reap"] and "ids" in row["llama.cpp"]:
            a, b = row["reap"]["ids"], row["llama.cpp"]["ids"]
            row["agree_first"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            for k in ("prefill", "decode"):
                row[k + "_ratio"] = row["reap"][k] / row["llama.cpp"][k]
        gbps = statistics.median(r["direct_gbps"] for r in runs)
        rand = [r["random_gbps"] for r in runs if r.get("random_gbps")]
        row["random_gbps"] = statistics.median(rand) if rand else None
        if "reap_read_per_token" in row["reap"]:
            io = row["reap"]["reap_read_per_token"] / (gbps * 1e9)
            floor = max(io, compute_s or 0.0)  # reads can at best hide behind compute
            row.update(io_floor_s=io, compute_s=compute_s, floor_s=floor,
                       floor_ratio=(1 / row["reap"]["decode"]) / floor if floor else None)
        row["direct_gbps"] = gbps
        rows.append(row)
    return rows


def in_ram(model: Model, dtype: str, args) -> float | None:
    """reap's decode s/token with the whole model in RAM (no cap; median of --reps runs, valid
    ones): the compute term of the floor. None if no run was valid."""
    a = reap_args(model, dtype, args, 2 * ckpt_bytes(model.ckpts[dtype]) + (2 << 30))
    runs = [run("reap", REAP, a, None, args.threads, Path(args.tools)) for _ in range(args.reps)]
    ok = [1 / r["decode"] for r in runs if valid(r, args.threads)]
    print(model.name, dtype, "in RAM s/token", ok, flush=True)
    return statistics.median(ok) if ok else None


def caps_section(model: Model, args) -> list[dict]:
    out = []
    for dtype in [d for d in args.dtypes.split(",") if d in model.ckpts]:
        size = ckpt_bytes(model.ckpts[dtype])
        compute_s = in_ram(model, dtype, args)
        for frac in map(float, args.caps.split(",")):
            cap = int(frac * size)
            runs = [cell_runs(model, dtype, cap, args, r) for r in range(args.reps)]
            for row in summarize(runs, args.threads, compute_s):
                row.update(dtype=dtype, cap_fraction=frac, cap=cap, ckpt_bytes=size)
                out.append({**row, "runs": runs if row["state"] == "cold" else None})
                print(model.name, json.dumps({k: v for k, v in row.items() if k not in
                                              ("runs", "reap", "llama.cpp")}), flush=True)
    return out


# -- --resident-from -------------------------------------------------------------------------
def statistics_of(model: Model, dtype: str, work: Path, tokens: int) -> Path:
    """`reap calibrate` on the `code` corpus (made once)."""
    out = work / f"stats-{model.name}-{dtype}"
    if not any(out.glob("*.safetensors")):
        from reap.calibrate.pipeline import calibrate

        calibrate(model=str(model.ckpts[dtype]), corpus="code", tokens=tokens, seq_len=64,
                  out=str(out), dtype="float32", progress=False)  # fmt: skip
    return out


def held_out(model: Model, dtype: str, corpus: str, n: int, length: int) -> list[list[int]]:
    from reap.corpora.mix import sample_sequences
    from reap.tokenizer import load_tokenizer

    seqs = sample_sequences(corpus, "eval", load_tokenizer(model.ckpts[dtype]), n * length, length)
    return [s.ids for s in seqs]


def resident_section(model: Model, args, work: Path) -> dict:
    dtype = args.dtypes.split(",")[0]
    size = ckpt_bytes(model.ckpts[dtype])
    frac = 0.5 if "0.5" in args.caps.split(",") else max(map(float, args.caps.split(",")))
    cap = int(frac * size)
    stats = statistics_of(model, dtype, work, args.stats_tokens)
    base = {"prompt": PROMPT[:8], "decode": 0, "threads": args.threads, "ctx": 256,
            "model": str(model.ckpts[dtype]), "budget": int(BUDGET_FRACTION * cap),
            "dtype": dtype, "direct": not args.buffered}  # fmt: skip
    policies = {"resident-from": {"policy": "lfu", "resident_from": str(stats)},
                "resident-from+lru": {"policy": "lru", "half_life": 1, "resident_from": str(stats)},
                "lfu": {"policy": "lfu"}, "lfu-4096": {"policy": "lfu", "half_life": 4096},
                "lru": {"policy": "lru", "half_life": 1}, "none": {"policy": "none"}}
    rows = []
    for corpus in ("code", "zh"):
        seqs = held_out(model, dtype, corpus, args.policy_seqs, args.policy_len)
        runs = []
        for r in range(args.reps):
            names = list(policies) if r % 2 == 0 else list(policies)[::-1]
            rep = {}
            for name in names:
                drop_caches()
                cg = cgroup("reap-bench-policy", cap)
                a = {**base, **policies[name], "seqs": seqs}
                rep[name] = run("reap", REAP, a, cg, args.threads, Path(args.tools))
            runs.append(rep)
        row = {"corpus": corpus, "stats_from": corpus == "code", "cap_fraction": frac,
               "valid": all(valid(r[p], args.threads) for r in runs for p in policies)}
        for p in policies:
            ok = [r[p] for r in runs if "error" not in r[p]]
            row[p] = {k: statistics.median(x[k] for x in ok)
                      for k in ("decode", "hit_rate", "reap_read_per_token", "open_s")} if ok \
                else {"error": runs[0][p].get("error")}  # fmt: skip
            if ok:
                row[p]["ids"] = ok[0]["ids"]
        ids = [row[p]["ids"] for p in policies if "ids" in row[p]]
        row["same_tokens"] = all(i == ids[0] for i in ids)
        row["runs"] = runs
        rows.append(row)
        print(model.name, "resident", corpus, json.dumps(
            {p: {k: v for k, v in row[p].items() if k != "ids"} for p in policies}), flush=True)
    return {"dtype": dtype, "stats": str(stats), "rows": rows}


# -- models ----------------------------------------------------------------------------------
def draft_model(work: Path, tree: Path) -> Model:
    """The 1 B Qwen3-MoE of bench_llamacpp saved in bf16 only (2.0 GB) and its BF16 GGUF."""
    import torch

    path = work / "draft-bf16"
    if not (path / "config.json").is_file():
        print("making the draft model (bf16, minutes)", flush=True)
        _qwen(DRAFT, torch.bfloat16).save_pretrained(path, max_shard_size="1GB")
        _finish(path, {"num_experts": DRAFT["num_experts"], "rope_theta": DRAFT["rope_theta"]})
    gguf = convert(tree, path, work / "draft-bf16.gguf", "bf16")
    return Model("draft", {"bfloat16": path}, {"bfloat16": gguf}, describe(DRAFT))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="big,gptoss", help="comma-separated: big, gptoss, 1b")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--caps", default="0.5,0.25", help="cgroup caps, fractions of the checkpoint")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--sections", default="caps,resident")
    ap.add_argument("--stats-tokens", type=int, default=4096)
    ap.add_argument("--policy-seqs", type=int, default=4)
    ap.add_argument("--policy-len", type=int, default=32)
    ap.add_argument("--buffered", action="store_true", help="reap reads through the page cache")
    ap.add_argument("--work", default="/tmp/reap-llamacpp")
    ap.add_argument("--tools", default="/work/tools")
    ap.add_argument("--out", default="reports/streaming")
    ap.add_argument("--print-runners", action="store_true")
    ap.add_argument("--draft", action="store_true", help="2 GB bf16 model, 1 rep, 8 decode tokens")
    args = ap.parse_args(argv)
    if args.draft:
        args.models, args.dtypes, args.reps, args.decode = "draft", "bfloat16", 1, 8
        args.stats_tokens, args.policy_seqs, args.policy_len = 512, 2, 16
        args.out = "reports/streaming-draft"
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.print_runners:
        print(f"# llama.cpp runner\n{LLAMA}\n# reap runner\n{REAP}")
        return
    from experiments.streaming_report import report
    from reap.provenance import code_version

    t0, p0 = time.time(), probes()
    work, tools = Path(args.work), Path(args.tools)
    work.mkdir(parents=True, exist_ok=True)
    tree = ensure_llamacpp(tools)
    res = {"command": "python -m experiments.bench_streaming " + " ".join(sys.argv[1:]),
           "code_version": code_version(), "cpu": cpu(), "cores": os.cpu_count(),
           "cgroup": "v1" if V1.is_dir() else "v2", "threads": args.threads, "reps": args.reps,
           "decode": args.decode, "draft": args.draft, "load_slack": LOAD_SLACK,
           "budget_fraction": BUDGET_FRACTION, "reap_reads": "buffered" if args.buffered
           else "O_DIRECT", "models": {}}  # fmt: skip
    for name in args.models.split(","):
        model = draft_model(work, tree) if name == "draft" else prepare(name, work, tree)
        m: dict = {"params": model.params}
        if "caps" in args.sections:
            m["caps"] = caps_section(model, args)
        if "resident" in args.sections:
            m["resident"] = resident_section(model, args, work)
        res["models"][name] = m
    res.update(minutes=(time.time() - t0) / 60, probes=[p0, probes()],
               self_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    save_report(ROOT / args.out, res, report)


if __name__ == "__main__":
    main()
