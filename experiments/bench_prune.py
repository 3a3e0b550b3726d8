"""Benchmark `reap prune`: write speed against plainly copying the same bytes, and peak RSS, on a
checkpoint larger than the stated RAM budget. Writes reports/prune.md and reports/prune.json.

    python experiments/bench_prune.py --work /tmp/bench_prune          # k3-full, first 2 layers

The source (`reap synth k3-full --layers 2`, ~24 GB: one MoE layer of 896 full-size experts plus
the full embeddings and head) is synthesized once into --work and reused. The plan keeps 146
random experts (the 350 GB build's count). Each method runs in a fresh child process, alternating,
`--repeat` times: `prune` is `reap.prune.write.prune` (hashes every kept expert, writes through
CheckpointWriter with an fsync per shard); `copy` preads the very same byte ranges (kept experts,
trunk tensors, kept router rows) and writes them into files of the same shard size with plain
`os.pread`/`write`, one fsync per file: the floor for any tool that writes these bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from reap.provenance import code_version

ROOT = Path(__file__).resolve().parent.parent
_MERGE_MAX = 1 << 28  # the plain copy reads adjacent tensors together, up to 256 MiB at a time


def plain_copy(src: str, plan_path: str, out: str) -> int:
    """Copy the bytes a prune writes with bare pread/write; returns the bytes written."""
    from reap.checkpoint import Checkpoint
    from reap.models import family
    from reap.prune.plan_file import Plan
    from reap.prune.tensor_map import plan_items
    from reap.prune.write import _largest_shard

    plan = Plan.load(plan_path)
    os.makedirs(out)
    with Checkpoint.open(src) as ck:
        items, _ = plan_items(ck, family(ck.config), plan)
        limit, ranges = _largest_shard(ck), []
        for it in items:
            info = ck.tensors[it.source]
            if it.kind == "router":  # kept rows of an expert-major tensor: one range per row
                row = info.nbytes // info.shape[it.axis]
                ranges += [(info.file, info.start + r * row, row) for r in it.rows]
            elif (
                ranges
                and ranges[-1][0] == info.file
                and sum(ranges[-1][1:]) == info.start
                and ranges[-1][2] + info.nbytes <= _MERGE_MAX
            ):
                ranges[-1] = (info.file, ranges[-1][1], ranges[-1][2] + info.nbytes)  # adjacent
            else:
                ranges.append((info.file, info.start, info.nbytes))
    fds, total, used, n, f = {}, 0, 0, 0, None
    for file, start, size in ranges:
        if f is None or used + size > limit:
            f = _next_file(f, out, n)
            n, used = n + 1, 0
        fd = fds.setdefault(file, os.open(file, os.O_RDONLY))
        buf = memoryview(bytearray(size))
        done = 0
        while done < size:  # one syscall moves at most ~2 GiB
            n = os.preadv(fd, [buf[done:]], start + done)
            assert n > 0, (file, start, size, done)
            done += n
        f.write(buf)
        used, total = used + size, total + size
    _next_file(f, out, -1)
    for fd in fds.values():
        os.close(fd)
    return total


def _next_file(f, out: str, n: int):
    if f is not None:
        f.flush()
        os.fsync(f.fileno())
        f.close()
    return None if n < 0 else open(os.path.join(out, f"copy-{n:05d}.bin"), "wb")


def child(method: str, src: str, plan: str, out: str) -> dict:
    """One timed run in this process; returns seconds, bytes and peak RSS."""
    t0 = time.perf_counter()
    if method == "copy":
        written = plain_copy(src, plan, out)
    else:
        from reap.prune.write import prune

        written = prune(model=src, plan=plan, out=out).file_bytes
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "method": method,
        "seconds": seconds,
        "bytes": written,
        "peak_rss": rss,
        "gb_per_s": written / seconds / 1e9,
    }


def run_child(method: str, src: Path, plan: Path, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--src",
        str(src),
        "--plan",
        str(plan),
        "--out",
        str(out),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(
        f"{method:>5}: {r['seconds']:7.1f} s  {r['gb_per_s']:.3f} GB/s  "
        f"peak RSS {r['peak_rss'] / 1e9:.2f} GB",
        flush=True,
    )
    return r


def prepare(work: Path, config: str, layers: int, keep: int) -> tuple[Path, Path, dict]:
    """Synthesize the source once; make the random plan; return their paths and sizes."""
    from reap.checkpoint import Checkpoint
    from reap.prune.plan import make_plan

    src = work / f"{config}-{layers}"
    if not (src / "config.json").exists():
        subprocess.run(
            [
                "reap",
                "synth",
                config,
                "--layers",
                str(layers),
                "--out",
                str(src),
                "--seed",
                "0",
                "--overwrite",
            ],
            check=True,
        )
    with Checkpoint.open(src) as ck:
        plan = make_plan(
            config=ck.config, model=ck.fingerprint(), criterion="random", keep=keep, seed=0
        )
        source_bytes = sum(os.path.getsize(f) for f in {t.file for t in ck.tensors.values()})
        largest = max(t.nbytes for t in ck.tensors.values())
    path = plan.save(work / "plan.json")
    return (
        src,
        Path(path),
        {
            "source_bytes": source_bytes,
            "largest_tensor": largest,
            "predicted_bytes": plan.predicted_bytes,
        },
    )


def verify_seconds(out: Path, src: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(["reap", "verify", str(out), "--source", str(src)], check=True)
    return time.perf_counter() - t0


def report(result: dict) -> None:
    r = result
    md = (
        f"""# `reap prune` benchmark

Command: `{r["command"]}` ({r["date"]}, {r["machine"]}, load average
{r["load_average"][0]:.1f} before and {r["load_average"][1]:.1f} after: a shared machine).

Source: `reap synth {r["config"]} --layers {r["layers"]}`, {r["source_bytes"] / 1e9:.2f} GB
(larger than the stated RAM budget of {r["ram_budget"] / 1e9:.0f} GB and than the machine's
{r["ram"] / 1e9:.0f} GB of RAM, shared with other jobs). Plan: {r["keep"]} of 896 random experts
kept in the MoE layer. Output {r["bytes_written"] / 1e9:.3f} GB; predicted by the size model
{r["predicted_bytes"] / 1e9:.3f} GB ({r["size_error"] * 1e6:+.2f} ppm).

| method | runs (s) | median (s) | GB/s | peak RSS |
|---|---|---|---|---|
"""
        + "".join(
            f"| {m} | {', '.join(f'{s:.1f}' for s in v['seconds'])} | {v['median']:.1f} | "
            f"{v['gb_per_s']:.3f} | {v['peak_rss'] / 1e9:.2f} GB |\n"
            for m, v in r["methods"].items()
        )
        + f"""
**Speed: prune / plain copy = {r["speed_ratio"]:.2f}x** (target >= 0.8x; medians).
Peak RSS of prune: {r["methods"]["prune"]["peak_rss"] / 1e9:.2f} GB for a
{r["source_bytes"] / 1e9:.1f} GB checkpoint; the largest tensor is
{r["largest_tensor"] / 1e9:.2f} GB (embed_tokens / lm_head, read whole), so peak RSS is that
plus the interpreter (~0.3 GB), independent of the number of layers or experts.
`reap verify` of the output (reads both checkpoints' compared bytes): {r["verify_s"]:.1f} s.

`copy` is the floor: bare `os.pread` + `write` of exactly the bytes prune writes (kept experts,
trunk, kept router rows) into files of the same shard size, one fsync per file. `prune` also
computes sha256 of every kept expert, slices the routers through torch, writes the safetensors
headers, index, manifest and config, and fsyncs each shard. Runs alternate in fresh processes;
the page cache is not dropped (other jobs share the machine), so each run reads partly from cache.
"""
    )
    (ROOT / "reports").mkdir(exist_ok=True)
    (ROOT / "reports" / "prune.md").write_text(md)
    (ROOT / "reports" / "prune.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/bench_prune")
    ap.add_argument("--config", default="k3-full")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--keep", type=int, default=146)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--ram-budget", type=float, default=4e9, help="stated RAM budget, bytes")
    ap.add_argument("--clean", action="store_true", help="delete the source afterwards")
    ap.add_argument("--child", choices=("copy", "prune"))
    ap.add_argument("--src")
    ap.add_argument("--plan")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.src, a.plan, a.out)))
        return
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    src, plan, sizes = prepare(work, a.config, a.layers, a.keep)
    runs: dict[str, list[dict]] = {"copy": [], "prune": []}
    load = [os.getloadavg()[0]]
    for r in range(a.repeat):  # ABBA order: drift in machine load hits both methods alike
        for method in ("copy", "prune") if r % 2 == 0 else ("prune", "copy"):
            runs[method].append(run_child(method, src, plan, work / method))
            if method == "copy":
                shutil.rmtree(work / "copy")
    methods = {
        m: {
            "seconds": [x["seconds"] for x in v],
            "median": statistics.median(x["seconds"] for x in v),
            "gb_per_s": v[0]["bytes"] / statistics.median(x["seconds"] for x in v) / 1e9,
            "peak_rss": max(x["peak_rss"] for x in v),
            "bytes": v[0]["bytes"],
        }
        for m, v in runs.items()
    }
    load.append(os.getloadavg()[0])
    written = methods["prune"]["bytes"]
    result = {
        "command": "python experiments/bench_prune.py " + " ".join(sys.argv[1:]),
        "code_version": code_version(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "ram": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "load_average": load,
        "ram_budget": a.ram_budget,
        "config": a.config,
        "layers": a.layers,
        "keep": a.keep,
        **sizes,
        "bytes_written": written,
        "size_error": written / sizes["predicted_bytes"] - 1,
        "methods": methods,
        "speed_ratio": methods["copy"]["median"] / methods["prune"]["median"],
        "verify_s": verify_seconds(work / "prune", src),
    }
    shutil.rmtree(work / "prune")
    if a.clean:
        shutil.rmtree(src)
    report(result)
    print(json.dumps({k: v for k, v in result.items() if k != "methods"}, indent=1))


if __name__ == "__main__":
    main()
