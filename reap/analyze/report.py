"""Write an `AnalysisResult`: tidy tables (Parquet + CSV), a JSON summary, PNG plots, report.md.

`write_report(result, out_dir)` writes everything atomically (temp name, then rename) and
returns the paths it wrote.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, is_dataclass

import numpy as np

from reap.analyze import plots
from reap.analyze.markdown import render
from reap.analyze.pipeline import AnalysisResult
from reap.errors import WriteError
from reap.fileio import atomic_path, write_atomic
from reap.provenance import code_version

# the sources that decide the analysis results (`reap.provenance.code_version` parts)
ANALYSIS_CODE = ("analyze", "stats")


@dataclass
class ReportFiles:
    """What `write_report` wrote."""

    out_dir: str
    tables: list[str] = field(default_factory=list)  # .parquet and .csv
    figures: list[str] = field(default_factory=list)  # .png
    summary: str = ""  # summary.json
    report: str = ""  # report.md


def _atomic(path: str, write) -> str:
    with atomic_path(path) as tmp:
        write(tmp)
    return path


def provenance(r: AnalysisResult) -> dict:
    """What made these results: code version, arguments, and each input's model and corpus."""
    return _jsonable({
        "format": "reap.analysis/1", "code_version": code_version(ANALYSIS_CODE),
        "settings": r.settings,
        "inputs": [{"corpus": c.name, "path": c.path, "model": c.meta.get("model"),
                    "corpus_sha256": c.meta.get("corpus_sha256"), "tokens": c.tokens}
                   for c in r.corpora],
    })  # fmt: skip


def tables(r: AnalysisResult) -> dict:
    """The tidy tables, name -> pandas DataFrame (one row per observation).

    Each frame carries `provenance(r)` in `attrs["reap"]` (written into the Parquet metadata).
    """
    import pandas as pd

    def frame(records):
        return pd.DataFrame([asdict(x) for x in records])

    per_layer = [u for u in r.usage if u.layer != -1]
    out = {
        "set_overlap": frame(r.set_overlap),
        "set_overlap_overall": frame(r.set_overall),
        "usage_similarity": frame(per_layer),
        "usage_similarity_overall": frame([u for u in r.usage if u.layer == -1]).drop(
            columns="layer"
        ),
        "corpus_distance": _corpus_distance(r),
    }
    out.update(_expert_tables(r))
    out.update(_community_tables(r))
    prov = provenance(r)
    for df in out.values():
        df.attrs["reap"] = prov
    return out


def _corpus_distance(r: AnalysisResult):
    import pandas as pd

    cc = r.corpus_clusters
    rows = [
        {"corpus_a": a, "corpus_b": b, "js_distance": cc.distance[i, j]}
        for (i, a), (j, b) in itertools.combinations(enumerate(cc.corpora), 2)
    ]
    return pd.DataFrame(rows)


def _expert_tables(r: AnalysisResult) -> dict:
    import pandas as pd

    p = r.profiles
    L, E, C = p.freq.shape
    li, ei, ci = np.meshgrid(np.arange(L), np.arange(E), np.arange(C), indexing="ij")
    names = np.array(p.corpora + [""])
    usage = pd.DataFrame(
        {
            "layer": np.array(p.layers)[li].ravel(),
            "expert": ei.ravel(),
            "corpus": names[ci.ravel()],
            "freq": p.freq.ravel(),
            "share": p.share.ravel(),
            "lift": p.lift.ravel(),
            "specialist_of": np.repeat(names[p.specialist_of].ravel(), C),
            "generalist": np.repeat(p.generalist.ravel(), C),
        }
    )
    counts = p.specialist_counts()  # [L, C]
    spec = [
        {"layer": layer, "corpus": c, "n_specialists": int(counts[i, j])}
        for i, layer in enumerate(p.layers)
        for j, c in enumerate(p.corpora)
    ]
    gen = pd.DataFrame({"layer": p.layers, "n_generalists": p.generalist.sum(-1)})
    out = {"expert_usage": usage, "specialist_counts": pd.DataFrame(spec), "generalist_counts": gen}
    ec = r.expert_clusters
    if ec is not None:
        lab = np.argwhere(ec.labels >= 0)  # [n, 2] (layer row, expert)
        out["expert_clusters"] = pd.DataFrame(
            {
                "layer": np.array(p.layers)[lab[:, 0]],
                "expert": lab[:, 1],
                "cluster": ec.labels[ec.labels >= 0],
            }
        )
        centroids = [
            {"cluster": k, "corpus": c, "share": ec.centroids[k, j]}
            for k in range(ec.k)
            for j, c in enumerate(ec.corpora)
        ]
        out["expert_cluster_centroids"] = pd.DataFrame(centroids)
    return out


def _community_tables(r: AnalysisResult) -> dict:
    import pandas as pd

    if not r.communities:
        return {}
    members = [
        {"layer": c.layer, "expert": e, "community": int(g)}
        for c in r.communities
        for e, g in enumerate(c.labels)
    ]
    composition = [
        {"layer": c.layer, "community": g, "corpus": n, "share": c.share[g, j]}
        for c in r.communities
        for g in range(c.n_communities)
        for j, n in enumerate(r.profiles.corpora)
    ]
    return {
        "communities": pd.DataFrame(members),
        "community_summary": pd.DataFrame([_community_summary(c) for c in r.communities]),
        "community_composition": pd.DataFrame(composition),
    }


def _community_summary(c) -> dict:
    """One layer's community result: its size, modularity and the null's."""
    return {
        "layer": c.layer,
        "n_communities": c.n_communities,
        "modularity": c.modularity,
        "null_modularity_mean": c.null_mean,
        "null_modularity_max": c.null_max,
    }


def _jsonable(x):
    if is_dataclass(x):
        return _jsonable(asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    if isinstance(x, (float, np.floating)):
        return None if not math.isfinite(float(x)) else float(x)
    return x


# what summary.json keeps of an ExpertClustering (not the per-expert points and labels)
_CLUSTER_FIELDS = ("k", "silhouette", "null_silhouette", "dispersion", "null_dispersion")
_CLUSTER_FIELDS += ("centroids", "corpora")


def summary(r: AnalysisResult, files: ReportFiles | None = None) -> dict:
    """The JSON summary: provenance, settings, overall results, clusters, notes, files."""
    p = r.profiles
    ec = r.expert_clusters
    return _jsonable(
        {
            **provenance(r),
            "corpora": r.corpora,
            "layers": r.layers,
            "n_experts": r.n_experts,
            "top_k": r.top_k,
            "settings": r.settings,
            "set_overlap_overall": r.set_overall,
            "usage_similarity_overall": [u for u in r.usage if u.layer == -1],
            "corpus_clusters": {k: getattr(r.corpus_clusters, k) for k in ("order", "distance")},
            "specialists": {
                "per_corpus": dict(zip(p.corpora, p.specialist_counts().sum(0))),
                "generalists": int(p.generalist.sum()),
                "ratio": p.ratio,
                "min_load": p.min_load,
                "chance": r.specialist_null,
            },
            "expert_clusters": None if ec is None else {k: getattr(ec, k) for k in _CLUSTER_FIELDS},
            "communities": [_community_summary(c) for c in r.communities],
            "notes": r.notes,
            "files": files,
        }
    )


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def figures(r: AnalysisResult) -> dict:
    """All figures, file name -> matplotlib Figure."""
    out = {}
    for a, b in dict.fromkeys((x.corpus_a, x.corpus_b) for x in r.set_overlap):
        rows = [x for x in r.set_overlap if (x.corpus_a, x.corpus_b) == (a, b)]
        out[f"overlap_{_slug(a)}__{_slug(b)}.png"] = plots.overlap_vs_chance(rows, f"{a} vs {b}")
    for crit in r.settings.criteria:
        for m in r.settings.m:
            out[f"heatmap_{crit}_top{m}.png"] = plots.overlap_heatmaps(
                r.profiles.corpora, r.set_overall, r.usage, crit, m
            )
    out["dendrogram.png"] = plots.dendrogram(r.corpus_clusters)
    if r.expert_clusters is not None:
        out["expert_profiles.png"] = plots.expert_profile_map(r.expert_clusters)
    out["specialists_by_layer.png"] = plots.specialist_counts(r.profiles, r.specialist_null)
    if r.communities:
        out["communities.png"] = plots.community_modularity(r.communities)
    return out


def write_report(
    r: AnalysisResult, out_dir: str, *, with_plots: bool = True, progress: bool = False
) -> ReportFiles:
    """Write tables, figures, summary.json and report.md under out_dir; returns the paths."""
    from tqdm.auto import tqdm

    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise WriteError(f"cannot create {out_dir}: {e.strerror or e}") from e
    files = ReportFiles(out_dir)
    for name, df in tables(r).items():
        base = os.path.join(out_dir, name)
        files.tables.append(_atomic(base + ".parquet", lambda t, d=df: d.to_parquet(t)))
        files.tables.append(_atomic(base + ".csv", lambda t, d=df: d.to_csv(t, index=False)))
    if with_plots:
        figs = figures(r)
        for name, fig in tqdm(figs.items(), desc="figures", disable=not progress):
            files.figures.append(plots.save_figure(fig, os.path.join(out_dir, name)))
    files.report = os.path.join(out_dir, "report.md")
    files.summary = os.path.join(out_dir, "summary.json")
    write_atomic(files.report, render(r, [os.path.basename(f) for f in files.figures]))
    write_atomic(files.summary, json.dumps(summary(r, files), indent=1, allow_nan=False))
    return files
