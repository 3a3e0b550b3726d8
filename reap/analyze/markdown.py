"""report.md: the findings of an `AnalysisResult` stated in numbers.

Every overlap claim comes with its chance baseline (exact expected Jaccard and band), an exact
p-value and, where the statistics allow, a bootstrap interval; results that do not reach the
significance level are written as "not significant", and every skipped part says why.
"""

from __future__ import annotations

import numpy as np

from reap.analyze.pipeline import AnalysisResult


def fmt_p(p: float) -> str:
    """A p-value for prose: two significant digits, floor at 1e-300."""
    if not np.isfinite(p):
        return "n/a"
    return "< 1e-300" if p < 1e-300 else f"{p:.2g}"


def _ci(lo: float, hi: float, digits: int = 2) -> str:
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return ""
    return f" (95% CI {lo:.{digits}f}–{hi:.{digits}f})"


def _header(r: AnalysisResult) -> list[str]:
    s = r.settings
    model = r.corpora[0].meta.get("model", "unknown")
    lines = [
        "# Expert overlap between corpora",
        "",
        (
            f"Model `{model}`: {len(r.layers)} MoE layers ({r.layers[0]}–{r.layers[-1]}), "
            f"{r.n_experts} routed experts per layer, top-{r.top_k} routing."
        ),
        "",
        "| corpus | tokens | sequences | file |",
        "|---|---:|---:|---|",
    ]
    lines += [
        f"| {c.name} | {c.tokens:,} | {c.sequences if c.sequences is not None else '—'} "
        f"| {c.path or '(in memory)'} |"
        for c in r.corpora
    ]
    lines += [
        "",
        "## Method",
        "",
        (
            f"- Important experts of a corpus in a layer: its top-m by {', '.join(s.criteria)} "
            f"(m = {', '.join(map(str, s.m))}; ties at the boundary included, unused experts "
            "excluded). Overlap = Jaccard index of two corpora's sets."
        ),
        (
            "- Chance: the Jaccard of a random set of the same size, exactly (hypergeometric "
            "intersection); the band is its central 95%. Per-layer p-values are exact and "
            "two-sided, q-values Benjamini-Hochberg adjusted over layers. The overall test sums "
            "the intersections over layers (exact convolution); its z uses the exact null spread."
        ),
        f"- Intervals: {s.bootstrap} bootstrap replicates over calibration sequences, "
        f"{s.ci_method} 95% intervals (bias-corrected, so they need not contain the raw "
        "estimate)."
        if s.bootstrap > 0
        else "- Intervals: none (bootstrap disabled).",
        f"- Significance level {s.alpha}; seed {s.seed}.",
        "",
    ]
    return lines


def verdict(o, alpha: float) -> str:
    """ "more than chance" / "less than chance" / "not significant" for an overall record."""
    if not o.p_value < alpha:
        return "not significant"
    return "more than chance" if o.mean_jaccard > o.mean_expected else "less than chance"


def _set_table(rows, alpha: float) -> list[str]:
    lines = [
        (
            "| pair | mean Jaccard | chance (95% band) | shared / expected | z | p | verdict "
            f"| layers above / below (q < {alpha:g}) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for o in sorted(rows, key=lambda o: -o.z if np.isfinite(o.z) else 0):
        lines.append(
            f"| {o.corpus_a} – {o.corpus_b} | {o.mean_jaccard:.3f}{_ci(o.ci_lo, o.ci_hi, 3)} "
            f"| {o.mean_expected:.3f} ({o.null_lo:.3f}–{o.null_hi:.3f}) "
            f"| {o.intersection} / {o.expected_intersection:.1f} | {o.z:+.1f} "
            f"| {fmt_p(o.p_value)} | {verdict(o, alpha)} "
            f"| {o.layers_above} / {o.layers_below} of {o.n_layers} |"
        )
    return lines


def _findings(r: AnalysisResult) -> list[str]:
    alpha = r.settings.alpha
    lines = ["## Set overlap against chance", ""]
    for crit in r.settings.criteria:
        for m in r.settings.m:
            rows = [o for o in r.set_overall if (o.criterion, o.m) == (crit, m)]
            groups = {
                v: [f"{o.corpus_a}–{o.corpus_b}" for o in rows if verdict(o, alpha) == v]
                for v in ("more than chance", "less than chance", "not significant")
            }
            lines += [f"### Top-{m} experts by {crit}", ""]
            lines += [
                f"- {v.capitalize()} ({len(g)}): {', '.join(g) or 'none'}."
                for v, g in groups.items()
            ]
            lines += [""] + _set_table(rows, alpha) + [""]
    return lines


def _usage(r: AnalysisResult) -> list[str]:
    lines = [
        "## Routing similarity (whole distributions, mean over layers)",
        "",
        "| pair | JSD (bits) | cosine | sum(min) |",
        "|---|---|---|---|",
    ]
    for u in sorted((u for u in r.usage if u.layer == -1), key=lambda u: u.jsd):
        lines.append(
            f"| {u.corpus_a} – {u.corpus_b} | {u.jsd:.4f}{_ci(u.jsd_lo, u.jsd_hi, 4)} "
            f"| {u.cosine:.3f}{_ci(u.cosine_lo, u.cosine_hi, 3)} "
            f"| {u.sum_min:.3f}{_ci(u.sum_min_lo, u.sum_min_hi, 3)} |"
        )
    cc = r.corpus_clusters
    d = cc.distance + np.diag(np.full(len(cc.corpora), np.inf))
    near = [
        f"{c} → {cc.corpora[int(np.argmin(d[i]))]} ({d[i].min():.3f})"
        for i, c in enumerate(cc.corpora)
    ]
    lines += [
        "",
        "Corpus clustering (average linkage on the mean Jensen-Shannon distance), "
        f"dendrogram order: {', '.join(cc.order)}. Nearest corpus: " + "; ".join(near) + ".",
        "",
    ]
    return lines


def _specialists(r: AnalysisResult) -> list[str]:
    p, n = r.profiles, r.specialist_null
    counts = p.specialist_counts().sum(0)
    lines = [
        "## Specialists and generalists",
        "",
        (
            f"Specialist of a corpus: used by it ≥ {p.ratio:g}x as often as by any other corpus "
            f"and ≥ {p.min_load:g}x the uniform rate. Generalist: every corpus uses it ≥ "
            f"{p.min_load:g}x the uniform rate. Counts are over all {len(p.layers)} layers "
            f"({len(p.layers) * p.freq.shape[1]} experts)."
        ),
        "",
    ]
    for c, name in enumerate(p.corpora):
        base = "no chance baseline (needs seq_count)"
        if n is not None:
            significance = "" if n.p_value[c] < r.settings.alpha else ", not significant"
            base = (
                f"chance {n.mean[c]:.1f} (95th percentile {n.hi[c]:.0f}) with sequences shuffled "
                f"between corpora, p = {fmt_p(n.p_value[c])}{significance}"
            )
        lines.append(f"- {name}: {int(counts[c])} specialists; {base}.")
    gen = p.generalist.sum(-1)
    lines += [f"- generalists: {int(gen.sum())} in all, {gen.min()}–{gen.max()} per layer.", ""]
    return lines


# Kaufman & Rousseeuw's reading of the mean silhouette
_SILHOUETTE = ((0.7, "strong"), (0.5, "reasonable"), (0.25, "weak"), (-1.1, "no substantial"))


def _dispersion(ec) -> str:
    null = np.array([v for v in ec.null_dispersion if np.isfinite(v)])
    head = (
        f"Experts' corpus profiles sit {ec.dispersion:.3f} (mean total-variation distance) "
        "from an even split"
    )
    if not len(null):
        return head + "; no chance level (needs seq_count)."
    p = (1 + (null >= ec.dispersion).sum()) / (1 + len(null))
    verdict = "more corpus-specific than chance" if p < 0.05 else "not significant"
    return (
        f"{head}, against {null.mean():.3f} (max {null.max():.3f}) with sequences shuffled "
        f"between corpora ({len(null)} shuffles): {verdict}, p = {fmt_p(p)}."
    )


def _cluster_chance(ec) -> str:
    null = np.array([v for v in ec.null_silhouette if np.isfinite(v)])
    if not len(null):
        return "no chance level (needs seq_count): do not read structure into it"
    where = (
        "above every shuffle: structure beyond sampling noise"
        if ec.best > null.max()
        else "not above the shuffles: no structure beyond sampling noise (not significant)"
    )
    return (
        f"the same search on {len(null)} sequence shuffles scores {null.mean():.2f} on average "
        f"(max {null.max():.2f}), so this is {where}"
    )


def _clusters(r: AnalysisResult) -> list[str]:
    lines = ["## Expert clusters by corpus profile", ""]
    ec = r.expert_clusters
    if ec is None:
        return lines + ["Too few used experts with distinct profiles to cluster.", ""]
    strength = next(w for t, w in _SILHOUETTE if ec.best > t)
    tried = ", ".join(f"k={k}: {v:.2f}" for k, v in ec.silhouette.items())
    lines += [
        _dispersion(ec),
        "",
        (
            f"k-means chose k = {ec.k} by silhouette {ec.best:.2f} ({strength} structure by "
            f"the Kaufman-Rousseeuw reading; tried {tried}); {_cluster_chance(ec)}."
        ),
        "",
    ]
    for k in range(ec.k):
        top = np.argsort(-ec.centroids[k])[:2]
        size = int((ec.labels == k).sum())
        shares = ", ".join(f"{ec.corpora[i]} {ec.centroids[k, i]:.0%}" for i in top)
        lines.append(f"- cluster {k} ({size} experts): {shares}")
    return lines + [""]


def _communities(r: AnalysisResult) -> list[str]:
    if not r.communities:
        return []
    q = np.array([c.modularity for c in r.communities])
    q0 = np.array([c.null_mean for c in r.communities])
    above = sum(c.modularity > c.null_max for c in r.communities)
    nc = np.array([c.n_communities for c in r.communities])
    n_null = len(r.communities[0].null)
    chance = "no random-graph baseline was computed: do not read structure into Q alone"
    if n_null:
        chance = (
            f"the same search on random graphs with the expected co-occurrences (Poisson, "
            f"{n_null} per layer) finds Q = {np.nanmean(q0):.3f} on average; observed Q is "
            f"above every random graph in {above}/{len(q)} layers"
        )
    return [
        "## Co-activation communities",
        "",
        (
            f"Greedy modularity per layer on the pooled co-activation graph: Q = {q.mean():.3f} "
            f"on average (range {q.min():.3f}–{q.max():.3f}), {nc.min()}–{nc.max()} "
            f"communities; {chance}."
        ),
        "",
    ]


def render(r: AnalysisResult, figures: list[str]) -> str:
    """The whole report.md text."""
    lines = _header(r) + _findings(r) + _usage(r) + _specialists(r) + _clusters(r)
    lines += _communities(r)
    if r.notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in r.notes] + [""]
    if figures:
        lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures] + [""]
    return "\n".join(lines)
