"""Figures of the overlap analysis (matplotlib, no pyplot state: safe in scripts and notebooks).

Every function builds and returns a `matplotlib.figure.Figure` (rendered by the Agg canvas
when saved; displayed inline when a notebook cell returns it); `save_figure` writes a PNG
atomically. Nothing here computes statistics: it draws the records of the other modules.
"""

from __future__ import annotations

import numpy as np

from reap.analyze.cluster import Communities, CorpusClustering, ExpertClustering
from reap.analyze.overlap import SetOverlap, SetOverlapOverall, UsageSimilarity
from reap.analyze.specialists import ExpertProfiles, SpecialistNull
from reap.fileio import atomic_path


def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=100, layout="constrained")


def _layer_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save_figure(fig, path: str) -> str:
    """Write a figure as PNG atomically (temp file, then rename); returns the path."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return path


def overlap_vs_chance(rows: list[SetOverlap], title: str = ""):
    """Per-layer Jaccard of one pair against the chance mean and band, one panel per set rule.

    rows: the `SetOverlap` records of one pair (any criteria and set sizes).
    """
    keys = sorted({(r.criterion, r.m) for r in rows})
    fig = _figure(4.2 * len(keys), 3.2)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    for ax, (crit, m) in zip(axes, keys):
        rs = sorted((r for r in rows if (r.criterion, r.m) == (crit, m)), key=lambda r: r.layer)
        x = np.array([r.layer for r in rs])
        band = ([r.null_lo for r in rs], [r.null_hi for r in rs])
        ax.fill_between(x, *band, color="0.85", step="mid", label="chance 95% band")
        ax.plot(x, [r.expected for r in rs], "--", color="0.4", label="chance mean")
        j = np.array([r.jaccard for r in rs])
        lo, hi = np.array([r.ci_lo for r in rs]), np.array([r.ci_hi for r in rs])
        if np.isfinite(lo).any():
            err = np.stack([np.clip(j - lo, 0, None), np.clip(hi - j, 0, None)])
            ax.errorbar(
                x, j, yerr=np.nan_to_num(err), fmt="o-", ms=3, capsize=2, label="observed (95% CI)"
            )
        else:
            ax.plot(x, j, "o-", ms=3, label="observed (no CI)")
        sig = np.array([r.q_value < 0.05 for r in rs])
        ax.plot(x[sig], j[sig], "k*", ms=7 if len(x) <= 24 else 3, label="q < 0.05")
        ax.set(xlabel="layer", ylabel="Jaccard", ylim=(-0.02, 1.02), title=f"top-{m} by {crit}")
        _layer_axis(ax)
    axes[0].legend(fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    return fig


def overlap_heatmaps(
    corpora: list[str],
    overall: list[SetOverlapOverall],
    usage: list[UsageSimilarity],
    criterion: str,
    m: int,
):
    """Corpus x corpus heatmaps: Jaccard minus chance (stars: p < 0.05) and mean JSD."""
    C, pos = len(corpora), {c: i for i, c in enumerate(corpora)}
    dev, js = np.full((C, C), np.nan), np.zeros((C, C))
    stars = np.zeros((C, C), dtype=bool)
    for r in overall:
        if (r.criterion, r.m) == (criterion, m):
            i, j = pos[r.corpus_a], pos[r.corpus_b]
            dev[i, j] = dev[j, i] = r.mean_jaccard - r.mean_expected
            stars[i, j] = stars[j, i] = r.p_value < 0.05
    for r in usage:
        if r.layer == -1:
            i, j = pos[r.corpus_a], pos[r.corpus_b]
            js[i, j] = js[j, i] = r.jsd
    fig = _figure(4.6 * 2, 0.45 * C + 2.6)
    ax1, ax2 = fig.subplots(1, 2)
    lim = max(float(np.nanmax(np.abs(dev))), 1e-3) if np.isfinite(dev).any() else 1.0
    im = ax1.imshow(dev, cmap="RdBu_r", vmin=-lim, vmax=lim)
    fig.colorbar(im, ax=ax1, shrink=0.8, label="mean Jaccard − chance")
    for i in range(C):
        for j in range(C):
            if i != j and np.isfinite(dev[i, j]):
                text = f"{dev[i, j]:+.2f}" + ("*" if stars[i, j] else "")
                color = "white" if abs(dev[i, j]) > 0.6 * lim else "black"
                ax1.text(j, i, text, ha="center", va="center", fontsize=7, color=color)
    im2 = ax2.imshow(js, cmap="viridis_r", vmin=0)
    fig.colorbar(im2, ax=ax2, shrink=0.8, label="mean JSD (bits)")
    for ax, t in ((ax1, f"top-{m} by {criterion}: overlap vs chance"), (ax2, "routing divergence")):
        ax.set_xticks(range(C), corpora, rotation=45, ha="right", fontsize=8)
        ax.set_yticks(range(C), corpora, fontsize=8)
        ax.set_title(t, fontsize=9)
    return fig


def dendrogram(cc: CorpusClustering):
    """Average-linkage dendrogram of corpora on the mean Jensen-Shannon distance."""
    from scipy.cluster.hierarchy import dendrogram as draw

    fig = _figure(max(4.0, 0.6 * len(cc.corpora) + 2), 3.4)
    ax = fig.subplots()
    draw(cc.linkage, labels=cc.corpora, ax=ax, color_threshold=0, above_threshold_color="C0")
    ax.set(ylabel="Jensen-Shannon distance (layer mean)", title="corpora by routing similarity")
    return fig


def expert_profile_map(ec: ExpertClustering):
    """Experts' corpus-share profiles in 2-D (PCA) by cluster, and the cluster centroids."""
    from sklearn.decomposition import PCA

    fig = _figure(10, 4)
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1.2, 1])
    pts = ec.points
    xy = PCA(2).fit_transform(pts) if pts.shape[1] >= 2 else np.c_[pts[:, 0], 0 * pts[:, 0]]
    labels = ec.labels[ec.labels >= 0]
    ax1.scatter(xy[:, 0], xy[:, 1], c=labels, cmap="tab10", s=6, alpha=0.7, vmin=0, vmax=9)
    title = f"experts by corpus share (k={ec.k}, silhouette {ec.silhouette[ec.k]:.2f})"
    ax1.set(xlabel="PC1", ylabel="PC2", title=title)
    im = ax2.imshow(ec.centroids, cmap="magma", vmin=0, vmax=1, aspect="auto")
    fig.colorbar(im, ax=ax2, label="share of use")
    ax2.set_xticks(range(len(ec.corpora)), ec.corpora, rotation=45, ha="right", fontsize=8)
    counts = np.bincount(labels, minlength=ec.k)
    ax2.set_yticks(range(ec.k), [f"cluster {i} ({n})" for i, n in enumerate(counts)], fontsize=8)
    ax2.set_title("cluster centroids", fontsize=9)
    return fig


def specialist_counts(profiles: ExpertProfiles, null: SpecialistNull | None = None):
    """Specialists of each corpus and generalists per layer (dotted: chance per layer)."""
    fig = _figure(8, 3.6)
    ax = fig.subplots()
    counts = profiles.specialist_counts()  # [L, C]
    x = profiles.layers
    for c, name in enumerate(profiles.corpora):
        style = "osv^<>Dph*"[c % 10] + "-"  # a marker per corpus, joined by lines
        (line,) = ax.plot(x, counts[:, c], style, ms=4, alpha=0.8, label=f"{name} specialists")
        if null is not None:
            ax.axhline(null.mean[c] / len(x), ls=":", color=line.get_color(), lw=1)
    ax.plot(x, profiles.generalist.sum(-1), "k--", label="generalists (all corpora)")
    title = f"specialists (≥{profiles.ratio:g}x any other corpus) by layer"
    ax.set(xlabel="layer", ylabel="experts", title=title)
    _layer_axis(ax)
    ax.legend(fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def community_modularity(comms: list[Communities]):
    """Modularity of the co-activation communities per layer against its chance level."""
    fig = _figure(6, 3.2)
    ax = fig.subplots()
    x = [c.layer for c in comms]
    ax.plot(x, [c.modularity for c in comms], "o-", ms=3, label="observed")
    null = [c.null_mean for c in comms]
    ax.plot(x, null, "s--", ms=3, color="0.5", label="random graph, same expected co-occurrence")
    ax2 = ax.twinx()
    ax2.step(x, [c.n_communities for c in comms], where="mid", color="C2", alpha=0.6)
    ax2.set_ylabel("communities", color="C2")
    ax.set(xlabel="layer", ylabel="modularity Q", title="co-activation communities")
    _layer_axis(ax)
    ax.legend(fontsize=7)
    return fig
