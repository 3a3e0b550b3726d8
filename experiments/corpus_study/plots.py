"""Plots of the corpus study (overlap heatmap, per-domain ratios, criteria), from its
results.json; used by `experiments.corpus_study.report`."""

from __future__ import annotations

import os
from pathlib import Path


def write_plots(r: dict, out_dir: Path, report_dir: Path) -> dict[str, str]:
    """overlap.png, quality.png, criteria.png under out_dir; returns name -> path relative to
    the report's directory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(out_dir.resolve(), report_dir.resolve())).as_posix()
    m = str(r["overlap_m"][0])
    ratio = np.array(r["overlap_matrix"]["count"][m]["ratio"])
    np.fill_diagonal(ratio, np.nan)
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    im = ax.imshow(np.log2(ratio), cmap="RdBu_r", vmin=-2, vmax=2)
    ax.set_xticks(range(len(r["corpora"])), r["corpora"])
    ax.set_yticks(range(len(r["corpora"])), r["corpora"])
    ax.set_title(f"top-{m} expert sets: log2(observed / chance Jaccard)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out_dir / "overlap.png", dpi=110)
    plt.close(fig)
    _quality_plot(r, out_dir, plt, np)
    _criteria_plot(r, out_dir, plt, np)
    return {k: f"{rel}/{k}.png" for k in ("overlap", "quality", "criteria")}


_ENDS = ("mean", "lo", "hi")


def _end(ci: dict, key: str) -> float:
    """An interval end, or the mean where there is no interval (one seed)."""
    return ci[key] if ci[key] is not None else ci["mean"]


def _quality_plot(r, out_dir, plt, np) -> None:
    budgets, sets, doms = r["settings"]["budgets"], r["settings"]["sets"], r["domains"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.6), squeeze=False)
    for ax, b in zip(axes[0], budgets):
        rows = {x["set"]: x for x in r["builds"] if x["criterion"] == "reap" and x["budget"] == b}
        w = 0.8 / len(sets)
        for i, s in enumerate(sets):
            q = rows[s]["quality"]
            mean, lo, hi = (np.exp([_end(q[d]["log_ratio"], k) for d in doms]) for k in _ENDS)
            x = np.arange(len(doms)) + (i - len(sets) / 2 + 0.5) * w
            ax.bar(x, mean, w, label=s, yerr=[mean - lo, hi - mean], capsize=2)
        ax.set_xticks(range(len(doms)), doms)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(f"{r['keeps'][b]}/{r['n_experts']} experts kept")
        ax.set_ylabel("perplexity / full model")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "quality.png", dpi=110)
    plt.close(fig)


def _criteria_plot(r, out_dir, plt, np) -> None:
    a = r["answers"]["criteria"]
    fig, ax = plt.subplots(figsize=(5, 3.6))
    budgets = list(a)
    crits = list(next(iter(a.values()))["mean_log_ratio"])
    w = 0.8 / len(crits)
    for i, c in enumerate(crits):
        cis = [a[b]["mean_log_ratio"][c] for b in budgets]
        mean, lo, hi = (np.exp([_end(ci, k) for ci in cis]) for k in _ENDS)
        x = np.arange(len(budgets)) + (i - len(crits) / 2 + 0.5) * w
        ax.bar(x, mean, w, label=c, yerr=[mean - lo, hi - mean], capsize=3)
    ax.set_xticks(range(len(budgets)), [f"{r['keeps'][b]}/{r['n_experts']} kept" for b in budgets])
    ax.set_ylabel("geometric-mean ppl ratio (5 domains)")
    ax.set_title(f"criteria on `{r['settings']['criteria_set']}` statistics")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "criteria.png", dpi=110)
    plt.close(fig)
