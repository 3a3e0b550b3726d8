"""The self-contained HTML page of `reap eval`: inline CSS, plots as inline PNG data, no scripts
and no external assets, every piece of text escaped. Generations are laid out in a grid with the
prompt in the first column and one column per build (reference first), each build with its own
header colour; flags (looping, code that does not parse) are highlighted in the cells.
"""

from __future__ import annotations

import base64
import html

from reap.eval.report import badges, benchmark_rows, domain_rows, domains, visible

# column header colours (reference first), cycled
COLOURS = ["#34495e", "#2e86c1", "#c0392b", "#27ae60", "#8e44ad", "#d68910", "#16a085", "#7f8c8d"]

CSS = """
body { font-family: "Noto Sans", "Noto Sans CJK SC", "DejaVu Sans", sans-serif; margin: 16px;
       color: #1c2833; background: #fdfefe; }
h1 { font-size: 22px; margin: 0 0 8px 0; } h2 { font-size: 18px; margin: 22px 0 8px 0; }
table.summary { border-collapse: collapse; margin: 6px 0 14px 0; font-size: 13px; }
table.summary th, table.summary td { border: 1px solid #ccd1d1; padding: 3px 8px;
       text-align: right; } table.summary td:first-child { text-align: left; }
.meta { font-size: 12px; color: #566573; }
.grid { display: grid; gap: 4px; margin-bottom: 18px; }
.head { color: #fff; font-weight: bold; padding: 6px; border-radius: 3px; font-size: 13px; }
.cell { white-space: pre-wrap; word-break: break-word; font-family: "DejaVu Sans Mono",
        "Noto Sans Mono CJK SC", monospace; font-size: 12px; padding: 6px; border-radius: 3px;
        border: 1px solid #d5dbdb; background: #f8f9f9; }
.prompt { background: #fef9e7; } .pid { font-weight: bold; font-family: sans-serif; }
.badges { display: block; margin-top: 4px; font-family: sans-serif; font-size: 11px;
          color: #566573; white-space: normal; }
.flag { background: #fadbd8; border-color: #e74c3c; }
.plots img { max-width: 48%; margin: 4px; border: 1px solid #d5dbdb; }
"""


def _e(text) -> str:
    return html.escape(visible(str(text)))


def _summary_table(cols: list[str], rows: list) -> str:
    head = "".join(f'<th style="color:{COLOURS[j % len(COLOURS)]}">{_e(c)}</th>'
                   for j, c in enumerate(cols))
    body = "".join("<tr><td>" + _e(name) + "</td>" + "".join(f"<td>{_e(v)}</td>" for v in cells)
                   + "</tr>" for name, cells in rows)
    return f'<table class="summary"><tr><th></th>{head}</tr>{body}</table>'


def _grid(results: dict, rows: list[dict]) -> str:
    cols = results["columns"]
    style = f"grid-template-columns: minmax(160px, 0.8fr) repeat({len(cols)}, minmax(0, 1fr));"
    parts = ['<div class="head" style="background:#b7950b">prompt</div>']
    parts += [f'<div class="head" style="background:{COLOURS[j % len(COLOURS)]}">{_e(c)}</div>'
              for j, c in enumerate(cols)]
    for r in rows:
        parts.append(f'<div class="cell prompt"><span class="pid">{_e(r["id"])}</span>\n'
                     f"{_e(r['prompt'])}</div>")
        for c in cols:
            o = r["outputs"][c]
            m = o["metrics"]
            bad = m["looping"] or m["python_valid"] is False
            parts.append(f'<div class="cell{" flag" if bad else ""}">{_e(o["text"])}'
                         f'<span class="badges">{_e(badges(m))}</span></div>')
    return f'<div class="grid" style="{style}">' + "".join(parts) + "</div>"


def html_report(results: dict, pngs: dict[str, bytes]) -> str:
    """The whole page as one string."""
    ref, cols = results["reference"], results["columns"]
    builds = ", ".join(_e(b["label"]) for b in results["builds"])
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<title>reap eval</title>", f"<style>{CSS}</style></head><body>",
           "<h1>reap eval: builds side by side</h1>",
           (f'<p class="meta">reference {_e(ref["label"])} ({_e(ref["path"])}); builds: {builds}; '
            f"greedy generations of {results['arguments']['gen_tokens']} tokens; intervals: 95 % "
            f"bootstrap over documents (lm-eval: +- 1.96 stderr).</p>")]
    if results["expert_failures"]:
        out.append('<p class="cell flag">Routed experts failed to load: these results are not '
                   "trustworthy.</p>")
    for dom in domains(results):
        out += [f"<h2>{_e(dom)}</h2>", _summary_table(cols, domain_rows(results, dom))]
        if dom in results["generations"]:
            out.append(_grid(results, results["generations"][dom]))
    if rows := benchmark_rows(results):
        out += ["<h2>Benchmarks (lm-eval)</h2>", _summary_table(cols, rows)]
    if pngs:
        out.append('<h2>Plots</h2><div class="plots">')
        out += [f'<img alt="{_e(n)}" src="data:image/png;base64,{base64.b64encode(p).decode()}">'
                for n, p in pngs.items()]
        out.append("</div>")
    out.append("</body></html>")
    return "\n".join(out)
