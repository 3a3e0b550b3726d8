"""The written results of `reap eval`, all made from the results document alone:

    <out>/results.json     everything (provenance, per-domain summaries, generations)
    <out>/report.md        one table per domain, builds as columns, then lm-eval's tasks; plots
    <out>/generations.md   the generations side by side (markdown table per domain)
    <out>/report.html      self-contained page: tables, plots (inline PNG), generations in columns
    <out>/plots/<metric>.png   one grouped bar plot per metric (domains x builds, 95 % intervals)

Every file is written atomically; `reap.eval.pipeline.write_report(results, out)` rewrites all
of them (the HTML page: `reap.eval.page`).
"""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

from reap.fileio import write_atomic

# (key, row label, format) of the quality rows; values are Estimates (value, lo, hi)
QUALITY_ROWS = [
    ("loss", "loss (nats/token)", "{:.4f}"),
    ("ppl", "perplexity", "{:.3f}"),
    ("ppl_ratio", "perplexity / reference", "{:.4f}"),
    ("agreement", "top-1 agreement with reference", "{:.4f}"),
    ("kl", "KL(reference || build), nats/token", "{:.5f}"),
]
GENERATION_ROWS = [
    ("tokens", "generated tokens (mean)", "{:.1f}"),
    ("distinct_2", "distinct-2 (units)", "{:.3f}"),
    ("longest_repeat", "longest repeated n-gram (units, mean)", "{:.1f}"),
    ("looping", "looping (share of prompts)", "{:.2f}"),
    ("script", "script fidelity", "{:.3f}"),
    ("python_valid", "Python parses (share)", "{:.2f}"),
    ("same_as_reference", "identical to reference (share)", "{:.2f}"),
]
# plots: (file name, source, key, title)
PLOTS = [
    ("ppl_ratio", "quality", "ppl_ratio", "Perplexity relative to the reference"),
    ("agreement", "quality", "agreement", "Top-1 agreement with the reference"),
    ("kl", "quality", "kl", "KL(reference || build), nats per token"),
    ("loss", "quality", "loss", "Next-token loss, nats per token"),
    ("distinct_2", "generation_summary", "distinct_2", "Distinct-2 of generations"),
    ("looping", "generation_summary", "looping", "Share of generations that loop"),
    ("script", "generation_summary", "script", "Script fidelity of generations"),
    ("python_valid", "generation_summary", "python_valid", "Share of code generations that parse"),
    ("longest_repeat", "generation_summary", "longest_repeat", "Longest repeated n-gram (units)"),
    ("benchmark_acc", "benchmarks", "acc", "lm-eval accuracy (value +- 1.96 stderr)"),
]
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def visible(text: str) -> str:
    """Control characters as their visible Unicode pictures (tabs and newlines kept)."""
    return _CONTROL.sub(lambda m: "\u2421" if m.group() == "\x7f"
                        else chr(0x2400 + ord(m.group())), text)


def fmt_value(v, fmt: str) -> str:
    """A summary value as text: an Estimate dict as `value [lo, hi]`, None as `-`."""
    if v is None:
        return "-"
    if isinstance(v, dict):
        s = fmt.format(v["value"])
        if v.get("lo") is not None:
            s += f" [{fmt.format(v['lo'])}, {fmt.format(v['hi'])}]"
        return s
    return fmt.format(v)


def domains(results: dict) -> list[str]:
    """Corpora first, then prompt domains without a corpus."""
    return list(dict.fromkeys([*results["quality"], *results["generation_summary"]]))


def domain_rows(results: dict, dom: str) -> list[tuple[str, list[str]]]:
    """(row label, one cell per column) of the domain's summary table."""
    rows = []
    q, g = results["quality"].get(dom), results["generation_summary"].get(dom)
    cols = results["columns"]
    if q:
        rows.append(("documents / tokens", [f"{q[c]['docs']} / {q[c]['tokens']}" for c in cols]))
        rows += [(name, [fmt_value(q[c][k], f) for c in cols]) for k, name, f in QUALITY_ROWS]
    if g:
        rows.append(("prompts", [str(g[c]["prompts"]) for c in cols]))
        rows += [(name, [fmt_value(g[c][k], f) for c in cols]) for k, name, f in GENERATION_ROWS
                 if any(g[c][k] is not None for c in cols)]
        if any("kana" in g[c]["extra"] for c in cols):
            kana = [fmt_value(g[c]["extra"].get("kana"), "{:.3f}") for c in cols]
            rows.append(("kana share", kana))
    return rows


def benchmark_rows(results: dict) -> list[tuple[str, list[str]]]:
    """(row label, one cell per column) of the lm-eval table: per task its documents and every
    metric, `value [lo, hi]` (value +- 1.96 lm-eval stderr)."""
    rows, cols = [], results["columns"]
    for task, t in results.get("benchmarks", {}).items():
        metrics = dict.fromkeys(m for c in cols for m in t[c] if m != "samples")
        rows += [(f"{task}: documents", [str(t[c]["samples"]) for c in cols])] + [
            (f"{task}: {m}", [fmt_value(t[c].get(m), "{:.4f}") for c in cols]) for m in metrics]
    return rows


def _md_cell(text: str) -> str:
    return html.escape(visible(text)).replace("|", "&#124;").replace("\n", "<br>")


def _md_header(results: dict) -> list[str]:
    ref, a, pr = results["reference"], results["arguments"], results["prompts"]
    out = ["# reap eval", ""] + [
        f"- `{b['label']}`: {b['path']} (fingerprint `{(b['fingerprint'] or '')[:16]}`)"
        + (" **reference**" if b is ref else "") for b in [ref, *results["builds"]]]
    note = (f"Held-out eval splits, at most {a['max_docs'] or 'all'} documents per corpus, "
            f"{a['max_tokens_per_doc']} tokens each; intervals: 95 % bootstrap over documents "
            f"({a['bootstrap']} replicates). Generations: greedy, {a['gen_tokens']} tokens, "
            f"prompts {pr['source']} ({pr['count']}). lm-eval tasks: value +- 1.96 stderr.")
    return [*out, "", note, ""]


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table with every cell escaped (pipes, newlines, HTML)."""
    out = ["| " + " | ".join(map(_md_cell, head)) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(map(_md_cell, r)) + " |" for r in rows] + [""]


def markdown_report(results: dict, plots: list[str]) -> str:
    """report.md: provenance, one table per domain (builds as columns), plot links."""
    out = _md_header(results)
    for dom in domains(results):
        rows = [[name, *cells] for name, cells in domain_rows(results, dom)]
        out += [f"## {dom}", "", *_md_table(["", *results["columns"]], rows)]
    if rows := [[name, *cells] for name, cells in benchmark_rows(results)]:
        out += ["## Benchmarks (lm-eval)", "", *_md_table(["", *results["columns"]], rows)]
    if results["corpora"]:
        head = ["corpus", "documents", "tokens", "sha256"]
        rows = [[c, str(v["docs"]), str(v["tokens"]), v["sha256"][:16]]
                for c, v in results["corpora"].items()]
        out += ["## Corpora (eval split)", "", *_md_table(head, rows)]
    if plots:
        out += ["## Plots", ""] + [f"![{p}](plots/{p}.png)" for p in plots] + [""]
    if results["generations"]:
        out += ["Side by side: [generations.md](generations.md), [report.html](report.html).", ""]
    if results["expert_failures"]:
        out += ["**Routed experts failed to load; these results are not trustworthy:** "
                + json.dumps(results["expert_failures"]), ""]
    return "\n".join(out)


def badges(m: dict) -> str:
    """The one-line metric summary shown under a generation."""
    parts = [f"{m['tokens']} tok", f"d2 {m['distinct_2']:.2f}", f"rep {m['longest_repeat']}"]
    if m["looping"]:
        parts.append(f"LOOP p={m['loop_period']}")
    if m["script"] is not None:
        parts.append(f"script {m['script']:.2f}")
    if m["python_valid"] is not None:
        parts.append("parses" if m["python_valid"] else "NO PARSE")
    return ", ".join(parts)


def markdown_generations(results: dict) -> str:
    """generations.md: per domain a table, prompt then one column per build."""
    cols = results["columns"]
    out = ["# Generations side by side", ""]
    for dom, rows in results["generations"].items():
        out += [f"## {dom}", "", "| prompt | " + " | ".join(_md_cell(c) for c in cols) + " |",
                "|---|" + "---|" * len(cols)]
        for r in rows:
            cells = [_md_cell(r["outputs"][c]["text"]) + "<br><sub>"
                     + badges(r["outputs"][c]["metrics"]) + "</sub>" for c in cols]
            out.append(f"| **{r['id']}**<br>{_md_cell(r['prompt'])} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _bars(table: dict, doms: list[str], col: str, key: str) -> tuple[list, list | None]:
    """Bar heights of one build over the domains and its [2, n] interval whiskers (or None)."""
    vals, err = [], [[], []]
    for d in doms:
        v = table[d][col].get(key)
        v = v if isinstance(v, dict) else {"value": v}
        x = float("nan") if v["value"] is None else v["value"]
        vals.append(x)
        err[0].append(x - v["lo"] if v.get("lo") is not None else 0.0)
        err[1].append(v["hi"] - x if v.get("hi") is not None else 0.0)
    return vals, err if any(map(any, err)) else None


def plot_metric(results: dict, source: str, key: str, title: str) -> bytes | None:
    """A grouped bar plot (domains on x, one bar per build, interval whiskers) as PNG bytes;
    None when no domain has the metric."""
    from matplotlib.figure import Figure

    cols = results["columns"]
    table = results.get(source, {})
    doms = [d for d in table if any(table[d][c].get(key) is not None for c in cols)]
    if not doms:
        return None
    fig = Figure(figsize=(max(6.0, 0.6 * len(doms) * (len(cols) + 1)) + 2.0, 4.0), dpi=90)
    ax = fig.add_axes((0.08, 0.1, 0.66, 0.8))  # fixed margins: no second "tight" layout pass
    width = 0.8 / len(cols)
    for j, c in enumerate(cols):
        vals, err = _bars(table, doms, c, key)
        xs = [i + (j - (len(cols) - 1) / 2) * width for i in range(len(doms))]
        ax.bar(xs, vals, width, yerr=err, capsize=3 if err else 0, label=c)
    ax.set_xticks(range(len(doms)), doms)
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_plots(results: dict, out: Path) -> dict[str, bytes]:
    """Write plots/<metric>.png for every metric with data; returns name -> PNG bytes
    (empty, with a warning, when matplotlib is not installed)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        import sys

        print("reap eval: matplotlib is not installed: no plots", file=sys.stderr)
        return {}
    pngs = {}
    for name, source, key, title in PLOTS:
        png = plot_metric(results, source, key, title)
        if png is not None:
            write_atomic(out / "plots" / f"{name}.png", png)
            pngs[name] = png
    return pngs
