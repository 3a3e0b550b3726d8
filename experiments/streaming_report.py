"""The markdown of `bench_streaming.py`'s results: summary over valid cells, per-cell tables, the
I/O floor, the `--resident-from` comparison, and which parts of the engine use several threads."""

from __future__ import annotations

GB, MB = 1e9, 1e6

THREADS = """## What runs on several threads, what is serial (for predicting a larger machine)

Measured here at 1-2 cores only; the split below is what a larger machine changes.

- **Split across `--threads`** (the compiled step kernels' pool, `reap.quant.step_kernel`; torch's
  intra-op threads where torch runs): every weight product of a decode token (q/k/v/o
  projections, router, each routed expert's gate/up/down, the head) by output rows; in prefill
  the same products for every token of the chunk.
  Decode compute time per token should fall close to 1/threads until RAM bandwidth binds it
  (`reports/llamacpp*.md` measures that ceiling).
- **Concurrent reads, independent of `--threads`**: the missing routed experts of a layer are read
  by 4 background threads at once (`ExpertCache.prefetch`, started as soon as the layer's routing
  is known); the next streamed trunk unit by 1 background thread while the current one computes
  (the 2-slot ring). Read throughput therefore depends on the disk's queue depth at 4, not on
  the core count.
- **Serial**: the layer order (layer i+1 needs layer i's output), and within a layer attention ->
  routing -> expert reads. Once the routing is known, the experts already resident are computed
  while the misses are read, and each miss is computed as soon as its read is done
  (`NativeDecoder._mlp`; in prefill, `NativeDecoder.routed` computes ascending runs of experts as
  their reads complete), so a layer costs about attention + max(its misses' reads, its expert
  products); but a layer's reads cannot start before its routing. Reading the next layer's
  likely experts early (its router on the current residual stream) was tried: on these random
  models only 28 % of the guessed experts were then routed to and bytes read per token doubled,
  so it is not in the engine. Also serial: Python's per-layer orchestration, the top-k
  selection, embedding-row reads on the compute thread, cache bookkeeping (LFU heap), the
  sampling step.
- Prediction: in RAM, decode scales with threads until memory bandwidth; under a cap, decode
  time per token ~ the sum over layers of attention / threads + max(misses x expert bytes /
  disk bandwidth at queue depth 4, expert products / threads), so more cores shorten only the
  compute terms; the floor column is max(all of a token's reads, all of its compute).
"""


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def caps_table(rows: list[dict]) -> list[str]:
    out = ["| dtype | cap | state | prefill reap / llama.cpp (tok/s) | ratio | decode reap / "
           "llama.cpp | ratio | disk read per decode token reap / llama.cpp (MB) | peak RSS reap / "
           "llama.cpp (GB) | cgroup peak (GB) | greedy agree | machine CPU (cores) | valid |",
           "|" + "---|" * 13]  # fmt: skip
    for r in rows:
        a, b = r["reap"], r["llama.cpp"]
        if "error" in a or "error" in b:
            out.append(f"| {r['dtype']} | {r['cap_fraction']:.0%} | {r['state']} | "
                       f"reap: {a.get('error', 'ok')[:80]}; llama.cpp: {b.get('error', 'ok')[:80]}"
                       " |" + " |" * 9 + " no |")  # fmt: skip
            continue
        out.append(
            f"| {r['dtype']} | {r['cap_fraction']:.0%} ({r['cap'] / GB:.2f} GB) | {r['state']} | "
            f"{a['prefill']:.2f} / {b['prefill']:.2f} | **{r['prefill_ratio']:.2f}** | "
            f"{a['decode']:.2f} / {b['decode']:.2f} | **{r['decode_ratio']:.2f}** | "
            f"{a['decode_read_per_token'] / MB:.0f} / {b['decode_read_per_token'] / MB:.0f} | "
            f"{a['rss'] / GB:.2f} / {b['rss'] / GB:.2f} | {a['cgroup_peak'] / GB:.2f} / "
            f"{b['cgroup_peak'] / GB:.2f} | {r['agree_first']}/{len(a['ids'])} | "
            f"{a['machine_cpu']:.1f} / {b['machine_cpu']:.1f} | "
            f"{'yes' if r['valid'] else '**invalid**'} |"
        )
    return out


def floor_table(rows: list[dict]) -> list[str]:
    out = ["| dtype | cap | state | reap reads per token (MB, its cache policy) | O_DIRECT GB/s "
           "sequential / random expert reads | I/O s/token (sequential GB/s) | compute s/token (in "
           "RAM) | floor = max | reap s/token | reap / floor | expert hit rate |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        a = r["reap"]
        if "error" in a:
            continue
        out.append(f"| {r['dtype']} | {r['cap_fraction']:.0%} | {r['state']} | "
                   f"{a['reap_read_per_token'] / MB:.0f} | {r['direct_gbps']:.2f} / "
                   f"{_f(r.get('random_gbps'))} | {_f(r.get('io_floor_s'), '.3f')} | "
                   f"{_f(r.get('compute_s'), '.3f')} | "
                   f"{_f(r.get('floor_s'), '.3f')} | {1 / a['decode']:.3f} | "
                   f"{_f(r.get('floor_ratio'))} | {a['hit_rate']:.2f} |")  # fmt: skip
    return out


def resident_table(sec: dict) -> list[str]:
    pols = [p for p in ("resident-from", "resident-from+lru", "lfu", "lfu-4096", "lru", "none")
            if any(p in r for r in sec["rows"])]  # fmt: skip
    out = [f"Statistics: `reap calibrate` on `code` ({sec['stats']}); one-token steps over "
           f"held-out sequences; dtype {sec['dtype']}.", "",
           "| corpus | stats from it | cap | " + " | ".join(f"{p} tok/s (hit, MB/token)"
                                                       for p in pols)
           + " | resident-from / lru | tokens equal | valid |",
           "|" + "---|" * (len(pols) + 6)]  # fmt: skip
    for r in sec["rows"]:
        cells = []
        for p in pols:
            x = r[p]
            cells.append(x["error"][:60] if "error" in x else
                         f"{x['decode']:.2f} ({x['hit_rate']:.2f}, "
                         f"{x['reap_read_per_token'] / MB:.0f})")  # fmt: skip
        a, b = r["resident-from"], r["lru"]
        gain = a["decode"] / b["decode"] if "decode" in a and "decode" in b else None
        out.append(f"| {r['corpus']} | {'yes' if r['stats_from'] else 'no'} | "
                   f"{r['cap_fraction']:.0%} | " + " | ".join(cells) +
                   f" | **{_f(gain)}** | {r['same_tokens']} | "
                   f"{'yes' if r['valid'] else '**invalid**'} |")  # fmt: skip
    return out


def summary(res: dict) -> list[str]:
    out = ["## Summary (valid cells only: ratio reap / llama.cpp)", "",
           "| model | dtype | cap | state | prefill | decode | reap / its floor |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    left = total = 0
    for name, m in res["models"].items():
        for r in m.get("caps", []):
            total += 1
            if not r["valid"]:
                left += 1
                continue
            out.append(f"| {name} | {r['dtype']} | {r['cap_fraction']:.0%} | {r['state']} | "
                       f"{r['prefill_ratio']:.2f} | {r['decode_ratio']:.2f} | "
                       f"{_f(r.get('floor_ratio'))} |")  # fmt: skip
    out += ["", f"{left} of {total} cells invalid (left out)." + (
        " **No valid cell: this run measured contention, not the engines.**"
        if total and left == total else "")]
    return out


def report(res: dict) -> str:
    draft = ["**DRAFT** (`--draft`): a harness check on a 2 GB model, one repetition, on a "
             "machine shared with other work; the numbers are not a result.", ""]
    lines = [
        "# A model larger than memory: reap streaming vs llama.cpp mmap under a memory cgroup",
        "", *draft * res["draft"],
        f"Command: `{res['command']}` ({res['minutes']:.1f} min; code {res['code_version']}). "
        f"CPU: {res['cpu']}, {res['cores']} cores; cgroup {res['cgroup']}; {res['threads']} "
        f"thread(s); {res['reps']} repetition(s), engines interleaved; {res['decode']} decode "
        f"tokens after a 32-token prompt. reap: `Engine.open(budget={res['budget_fraction']} x "
        f"cap)` reading with {res['reap_reads']}; llama.cpp: its bindings, default mmap (MXFP4 "
        "experts: also its --no-repack, else it copies them out of the mapping into anonymous "
        "memory, past the cap), F32 KV. "
        "Machine probes before/after (1-min load, CPU pressure some avg10): "
        + ", ".join(f"{p['load']} / {p['psi_some_avg10']}" for p in res["probes"]) + ".",
        "",
        f"A cell is **invalid** when, during any of its runs, the whole machine's CPU use (busy "
        f"jiffies / wall time, every process; I/O wait not counted) exceeded the threads it used "
        f"+ {res['load_slack']}: other work then competed for the cores.",
        "", *summary(res), "",
    ]
    for name, m in res["models"].items():
        lines += [f"## {name}: {m['params']}", ""]
        if m.get("caps"):
            lines += ["### Under a cap", "", *caps_table(m["caps"]), "",
                      "### reap's floor: the longer of a decode token's reads (the bytes its cache "
                      "policy makes it read / the disk's sequential O_DIRECT bandwidth, same run) "
                      "and its compute (reap's decode with the whole model in RAM, same run)", "",
                      *floor_table(m["caps"]), ""]
        if m.get("resident"):
            lines += ["### --resident-from vs LFU vs LRU vs no cache", "",
                      *resident_table(m["resident"]), ""]
    return "\n".join(lines + [THREADS])
