"""The markdown of `bench_llamacpp.py`'s results: a summary of the ratios, then per model its
greedy agreement, speed and perplexity tables (those present in the run)."""

from __future__ import annotations

NOTE = {
    "1b": "random Qwen3-MoE saved by transformers in float32 and a bfloat16 copy",
    "big": "random Qwen3-MoE made in bfloat16 and saved by transformers in 1 GB shards, its "
    "float32 copy upcast shard by shard (same values)",
    "gptoss": "random GPT-OSS, bfloat16 trunk, MXFP4 experts (blocks and E8M0 scales in the "
    "release's layout); GGUF trunk F32 or BF16, experts MXFP4 on both sides; reap computes "
    "in the dtype of the row from the MXFP4 codes",
}
DRAFT = [
    (
        "> **Harness check, not final numbers**: one repetition of a subset of the cells, run "
        "while other work shared the 2 cores, to show that every section runs and what it reports."
    ),
    "",
]


def report(res: dict) -> str:
    lines = [
        "# reap vs llama.cpp on the same checkpoints and threads",
        "",
        *DRAFT * res.get("draft", False),
        (
            f"Command: `{res['command']}` ({res['minutes']:.1f} min; code {res['code_version']}; "
            f"load average {res['load'][0]} -> {res['load'][1]} on a shared 2-core machine: "
            "other processes may run at the same time, so absolute rates are noisy; each ratio "
            "comes from runs interleaved in the same minutes)."
        ),
        *([f"CPU: {res['cpu']}."] * ("cpu" in res)),
        "",
        (
            f"llama.cpp from the llama-cpp-python {res['llama_cpp_python']} source package "
            "(CPU build, -DGGML_NATIVE=ON); GGUFs by its own `convert_hf_to_gguf.py`. reap: "
            "`reap run --preset max --warmup` (fresh process); llama.cpp: `llama-bench -r 1` (prefill "
            f"`-p P -n 0`, decode `-n {res['decode']} -d P`, F16 KV cache). Medians of "
            f"{res['reps']} interleaved runs; ratio = reap / llama.cpp."
        ),
        "",
        *summary(res),
        "",
        (f"A cell is **invalid** (left out of the summary, marked in its table) when a 1-minute "
         f"load recorded around any of its runs exceeded the threads it used + {LOAD_SLACK}."),
    ]
    for name, m in res["models"].items():
        took = ", ".join(f"{k} {v:.1f}" for k, v in m.get("section_minutes", {}).items())
        note = f"{NOTE.get(name, '')} ({m['minutes']:.1f} min: {took})."
        lines += ["", f"## {name}: {m['params']}", "", note, ""]
        if "agreement" in m:
            lines += agreement_table(m["agreement"])
        if "speed" in m:
            lines += speed_table(m["speed"])
        if "perplexity" in m:
            lines += perplexity_table(m["perplexity"])
    return "\n".join(lines) + "\n"


LOAD_SLACK = 0.3  # load above a cell's threads tolerated (kernel threads, the bench itself)


def valid(row: dict) -> bool:
    """Whether every load recorded around the cell's runs stayed within the threads it used
    (+ LOAD_SLACK): above it, other processes took CPU the engines' threads wanted, and a
    spinning engine (llama.cpp's threads) loses far more than one that sleeps: a ratio measured
    so reports contention as speed."""
    return all(float(x) <= row["threads"] + LOAD_SLACK for r in row["runs"] for x in r["load"])


def summary(res: dict) -> list[str]:
    """Lowest and highest ratio per model, dtype and measure (prefill, decode, perplexity), over
    the valid cells only (`valid`)."""
    out = ["## Summary (lowest - highest ratio reap / llama.cpp over threads and prompts; "
           "valid cells only)", "",
           "| model | dtype | prefill | decode | perplexity pass | cells left out (load) |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for name, m in res["models"].items():
        dtypes = {r["dtype"] for r in m.get("speed", [])}
        dtypes |= {r["dtype"] for r in m.get("perplexity", {}).get("rows", [])}
        for dtype in sorted(dtypes, reverse=True):
            speed = [r for r in m.get("speed", []) if r["dtype"] == dtype]
            perp = [r for r in m.get("perplexity", {}).get("rows", []) if r["dtype"] == dtype]
            left = sum(not valid(r) for r in speed + perp)
            speed, perp = [r for r in speed if valid(r)], [r for r in perp if valid(r)]
            cells = [
                _span([r["prefill"]["ratio"] for r in speed]),
                _span([r["decode"]["ratio"] for r in speed]),
                _span([r["ratio"] for r in perp]),
                f"{left} of {left + len(speed) + len(perp)}",
            ]
            out.append(f"| {name} | {dtype} | " + " | ".join(cells) + " |")
    return out


def _span(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{min(xs):.2f}" if len(xs) == 1 else f"{min(xs):.2f} - {max(xs):.2f}"


def _loads(runs: list[dict]) -> str:
    loads = sorted(float(x) for run in runs for x in run["load"])
    return f"{loads[0]:.1f}-{loads[-1]:.1f}"


def agreement_table(res: dict) -> list[str]:
    out = ["### Greedy agreement (float32, llama.cpp with an F32 KV cache)", ""]
    if "mxfp4_decode" in res:
        d = res["mxfp4_decode"]
        out += [
            (
                f"llama.cpp's decoding of the GGUF's {d['tensors']} MXFP4 expert tensors "
                "(gguf-py `dequantize`) against reap's decoding of the checkpoint's blocks and "
                f"scales: max |difference| {d['max_abs_diff']:.3g}. llama.cpp multiplies MXFP4 "
                "weights by activations quantized to Q8_0, reap by float32 activations: the "
                "rows below compare the MXFP4 GGUF, then a copy of the checkpoint with the "
                "experts decoded (exactly, to bfloat16) and converted to an F32 GGUF, which "
                "takes that quantization out."
            ),
            "",
        ]
    out += _greedy(res["rows"], "MXFP4 GGUF" if "dense_rows" in res else "")
    if "dense_rows" in res:
        out += _greedy(res["dense_rows"], "Experts decoded, F32 GGUF")
    return out


def _greedy(rows: list[dict], label: str) -> list[str]:
    head = "| prompt | agreeing of 16 | max abs logit diff (of max) | reap | llama.cpp |"
    out = [f"{label}:", ""] if label else []
    out += [head, "|---|---|---|---|---|"]
    for a in rows:
        out.append(
            f"| {len(a['prompt'])} tokens | {a['agree_first']} | {a['max_logit_diff']:.2e} "
            f"({a['max_logit']:.1f}) | {a['reap']} | {a['llama.cpp']} |"
        )
    return [*out, ""]


def speed_table(rows: list[dict]) -> list[str]:
    out = [
        "### Speed (tokens/s, median; ratio = reap / llama.cpp)",
        "",
        (
            "| dtype | threads | prompt | prefill reap | llama.cpp | ratio | decode reap | "
            "llama.cpp | ratio | decode GB/s reap / llama.cpp (RAM) | expert hit | load (1-min) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, d = r["prefill"], r["decode"]
        out.append(
            f"| {r['dtype']} | {r['threads']} | {r['prompt']} | {p['reap']:.1f} | "
            f"{p['llama.cpp']:.1f} | **{p['ratio']:.2f}** | {d['reap']:.1f} | "
            f"{d['llama.cpp']:.1f} | **{d['ratio']:.2f}** | {_gbps(r)} | {r['hit']:.2f} | "
            f"{_loads(r['runs'])}{'' if valid(r) else ' **invalid**'} |"
        )
    if any("token_bytes" in r for r in rows):
        out += ["", GBPS_NOTE]
    return [*out, ""]


GBPS_NOTE = (
    "Decode GB/s: the weight bytes one token reads (active parameters at the stored width: "
    "attention, router, the top-k experts, the head) times decode tokens/s; RAM: what the same "
    "threads read from memory right after the cell (a torch sum over 1 GiB, median of 5). A "
    "decode near the RAM figure is bound by memory, where both engines can only meet."
)


def _gbps(r: dict) -> str:
    """decode weight GB/s of both engines and the machine's read GB/s, where known"""
    ram = f" ({r['read_gbps']:.1f})" if "read_gbps" in r else ""
    if "token_bytes" not in r:
        return "-" + ram
    reap, llama = (r["token_bytes"] * r["decode"][k] / 1e9 for k in ("reap", "llama.cpp"))
    return f"{reap:.1f} / {llama:.1f}{ram}"


def perplexity_table(p: dict) -> list[str]:
    out = [
        "### Prefill as perplexity: reap's pass vs `llama-perplexity`, same token ids",
        "",
        (
            f"{p['chunks']} chunks of {p['n_ctx']} ids ({p['parallel']} in parallel), the "
            "second half of each scored; llama.cpp's tokenization of the text equals reap's: "
            f"{'yes' if p['same_tokens'] else '**no**'} (BOS added: "
            f"{'yes' if p['add_bos'] else 'no'}). llama.cpp with an F32 KV cache in float32, "
            "F16 in bfloat16. tokens/s of the whole pass after loading."
        ),
        "",
        (
            "| dtype | threads | ppl reap | ppl llama.cpp | abs log ratio | tok/s reap | "
            "llama.cpp | ratio | load (1-min) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in p["rows"]:
        a, b = r["reap"], r["llama.cpp"]
        out.append(
            f"| {r['dtype']} | {r['threads']} | {a['ppl']:.4f} | {b['ppl']:.4f} | "
            f"{r['ppl_rel_diff']:.1e} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
            f"**{r['ratio']:.2f}** | {_loads(r['runs'])}{'' if valid(r) else ' **invalid**'} |"
        )
    return [*out, ""]
