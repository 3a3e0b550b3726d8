"""Tables and plots of plan predictions (`reap.prune.predict`): the per-corpus table `reap plan`
prints, the side-by-side markdown of `reap plan --compare`, and the PNG of per-layer kept mass
per corpus (one panel per plan, plus the damage index with its interval)."""

from __future__ import annotations

from reap.fileio import PNG_TAG, atomic_path


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _damage(p: dict) -> str:
    ci = p.get("damage_ci")
    band = f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""
    return f"{p['damage']:.3f}{band}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def prediction_table(pred: dict, layers: list[int]) -> str:
    """Markdown: per corpus the overall kept shares and the damage index, then per layer the
    kept gate / REAP / whole-top-k shares of every corpus."""
    corpora = pred["corpora"]
    head = ["corpus", "tokens", "gate mass kept", "REAP mass kept", "whole top-k kept",
            "damage [95% CI]"]
    rows = [[p["corpus"], f"{p['tokens']:,}", _pct(p["gate_overall"]), _pct(p["reap_overall"]),
             _pct(p["topk_overall"]), _damage(p)] for p in corpora]
    out = [f"prediction (damage = {pred['index']}; bootstrap over sequences):", *_table(head, rows)]
    per_layer = []
    for li, layer in enumerate(layers):
        cells = []
        for p in corpora:
            topk = None if p["topk_kept"] is None else p["topk_kept"][li]
            cells.append(f"{_pct(p['gate_kept'][li])} / {_pct(p['reap_kept'][li])} / {_pct(topk)}")
        per_layer.append([str(layer), *cells])
    out += ["", "kept per layer (gate / REAP / whole top-k):"]
    out += _table(["layer", *[p["corpus"] for p in corpora]], per_layer)
    return "\n".join(out)


def compare_markdown(named: list[tuple[str, object]]) -> str:
    """Markdown of several plans' predictions side by side: damage index [CI], REAP and gate
    mass kept and whole top-k kept per corpus (rows) and plan (columns)."""
    from reap.units import format_bytes

    corpora = []
    for _, plan in named:
        for p in plan.predictions["corpora"]:
            if p["corpus"] not in corpora:
                corpora.append(p["corpus"])
    cols = [name for name, _ in named]
    by = {(name, p["corpus"]): p for name, plan in named for p in plan.predictions["corpora"]}
    budget = [
        f"{sum(plan.counts.values())}/{plan.n_experts * len(plan.layers)} experts"
        + (f", {format_bytes(plan.predicted_bytes)}" if plan.predicted_bytes else "")
        + f", {plan.criterion}"
        for _, plan in named
    ]
    out = ["# Plan predictions side by side", "", *_table(["", *cols], [["kept", *budget]])]
    metrics = [("predicted damage [95% CI]", _damage),
               ("REAP mass kept", lambda p: _pct(p["reap_overall"])),
               ("gate mass kept", lambda p: _pct(p["gate_overall"])),
               ("whole top-k kept", lambda p: _pct(p["topk_overall"]))]
    for title, f in metrics:
        rows = [[c, *[f(by[(n, c)]) if (n, c) in by else "-" for n in cols]] for c in corpora]
        out += ["", f"## {title}", "", *_table(["corpus", *cols], rows)]
    out += ["", f"damage = {named[0][1].predictions['index']}."]
    return "\n".join(out) + "\n"


def write_plot(named: list[tuple[str, object]], path: str) -> str:
    """PNG: per plan a panel of the per-layer share of REAP mass kept per corpus (gate mass
    dashed), and a last panel of each corpus's damage index per plan with its interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(named)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.2 * (n + 1), 3.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    corpora = list(dict.fromkeys(p["corpus"] for _, pl in named for p in pl.predictions["corpora"]))
    for ax, (name, plan) in zip(axes[0], named):
        for p in plan.predictions["corpora"]:
            c = colors[corpora.index(p["corpus"]) % len(colors)]
            ax.plot(plan.layers, p["reap_kept"], "o-", color=c, label=p["corpus"])
            ax.plot(plan.layers, p["gate_kept"], "--", color=c, lw=0.8)
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("layer")
        ax.set_ylabel("share kept (REAP mass; gate mass dashed)")
        ax.set_title(name, fontsize=9)
    axes[0][0].legend(fontsize=7)
    _damage_panel(axes[0][n], named, corpora)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, metadata=PNG_TAG)
    plt.close(fig)
    return path


def _damage_panel(ax, named, corpora) -> None:
    w = 0.8 / len(named)
    for i, (name, plan) in enumerate(named):
        by = {p["corpus"]: p for p in plan.predictions["corpora"]}
        xs, ys, err = [], [], [[], []]
        for j, c in enumerate(corpora):
            if c not in by:
                continue
            p = by[c]
            ci = p["damage_ci"] or [p["damage"], p["damage"]]
            xs.append(j + (i - len(named) / 2 + 0.5) * w)
            ys.append(p["damage"])
            err[0].append(p["damage"] - ci[0])
            err[1].append(ci[1] - p["damage"])
        ax.bar(xs, ys, w, yerr=err, capsize=2, label=name)
    ax.set_xticks(range(len(corpora)), corpora, rotation=30)
    ax.set_ylabel("predicted damage (REAP mass lost)")
    ax.legend(fontsize=7)
