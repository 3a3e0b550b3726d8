"""Expert overlap analysis: exact chance baseline, metrics, bootstrap, clusters, CLI.

Everything runs on synthetic statistics with planted structure (notebooks/synthetic.py) and is
checked against independent references: brute-force enumeration and Monte Carlo for the
hypergeometric null, hand-computed vectors and scipy for the metrics, networkx for modularity,
and known truth for coverage and recovery.
"""

import ast
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from reap.analyze import chance
from reap.analyze.bootstrap import bootstrap_ci, bootstrap_pairs
from reap.analyze.cluster import (
    cluster_corpora,
    cluster_experts,
    communities,
    greedy_modularity,
    modularity,
)
from reap.analyze.overlap import (
    compare_sets,
    compare_usage,
    cosine,
    from_stats,
    important_set,
    jsd,
    sum_min,
)
from reap.analyze.pipeline import analyze
from reap.analyze.report import write_report
from reap.analyze.specialists import expert_profiles, shuffle_sequences, specialist_null
from notebooks.synthetic import (
    planted_corpora,
    planted_profiles,
    routed_stats,
    sequence_probs,
    write_corpora,
)


def uniform_corpora(
    names: list[str],
    *,
    n_layers: int = 4,
    n_experts: int = 64,
    top_k: int = 4,
    n_seqs: int = 16,
    tokens_per_seq: int = 64,
    seed: int = 0,
) -> list:
    """Corpora that all route uniformly at random: the null of no structure at all."""
    probs = np.full((n_seqs, n_layers, n_experts), 1.0 / n_experts)
    seeds = np.random.SeedSequence(seed).generate_state(len(names))
    return [
        routed_stats(probs, tokens_per_seq=tokens_per_seq, top_k=top_k, seed=int(s), corpus=n)
        for n, s in zip(names, seeds)
    ]


# ---------------------------------------------------------------- exact null vs brute force


def _brute_intersections(n, a, b):
    """|A ∩ B| for A = first a items and every b-subset B (exhaustive)."""
    return np.array([len(set(c) & set(range(a))) for c in itertools.combinations(range(n), b)])


@pytest.mark.parametrize("n,a,b", [(8, 3, 4), (10, 5, 5), (9, 2, 7), (7, 7, 3), (12, 4, 6)])
def test_null_matches_enumeration(n, a, b):
    ks = _brute_intersections(n, a, b)
    pmf = chance.intersection_pmf(n, a, b)
    brute = np.bincount(ks, minlength=len(pmf)) / len(ks)
    np.testing.assert_allclose(pmf, brute, atol=1e-12)
    js = ks / (a + b - ks)
    null = chance.jaccard_null(n, a, b)
    assert null.mean == pytest.approx(js.mean(), abs=1e-12)
    assert null.sd == pytest.approx(js.std(), abs=1e-12)
    assert np.mean((js >= null.lo) & (js <= null.hi)) >= 0.95
    for k in range(len(pmf)):
        p = chance.jaccard_p(n, a, b, k)
        assert p.less == pytest.approx(np.mean(ks <= k), abs=1e-12)
        assert p.greater == pytest.approx(np.mean(ks >= k), abs=1e-12)


def test_expected_jaccard_monte_carlo():
    rng = np.random.default_rng(1)
    n, a, b, reps = 64, 16, 20, 20000
    ks = np.array([(rng.permutation(n)[:b] < a).sum() for _ in range(reps)])
    js = ks / (a + b - ks)
    null = chance.jaccard_null(n, a, b)
    assert abs(js.mean() - null.mean) < 4 * js.std() / math.sqrt(reps)
    naive = a * b / n / (a + b - a * b / n)  # ratio of expectations: not the expectation
    assert null.mean != pytest.approx(naive, abs=1e-4)


def test_total_intersection_matches_enumeration():
    sizes = [(6, 2, 3), (5, 3, 2), (6, 4, 4)]
    per_layer = [_brute_intersections(*s) for s in sizes]
    totals = np.array([sum(t) for t in itertools.product(*per_layer)])
    for k in range(totals.max() + 1):
        p = chance.total_intersection_p(sizes, k)
        assert p.less == pytest.approx(np.mean(totals <= k), abs=1e-12)
        assert p.greater == pytest.approx(np.mean(totals >= k), abs=1e-12)


def test_fdr_matches_scipy():
    from scipy.stats import false_discovery_control

    p = np.random.default_rng(2).uniform(size=40) ** 3
    np.testing.assert_allclose(chance.fdr_bh(p), false_discovery_control(p), rtol=1e-12)


# ---------------------------------------------------------------- metrics on hand-made vectors


def test_distribution_metrics_by_hand():
    assert jsd([1, 0], [0, 1]) == pytest.approx(1.0)
    assert jsd([3, 1], [6, 2]) == pytest.approx(0.0, abs=1e-15)
    # m = (0.75, 0.25): KL(p||m) = 0.5 log2(2/3) + 0.5 log2 2, KL(q||m) = log2(4/3)
    want = 0.5 * (0.5 * math.log2(2 / 3) + 0.5) + 0.5 * math.log2(4 / 3)
    assert jsd([0.5, 0.5], [1, 0]) == pytest.approx(want, abs=1e-12)
    assert cosine([1, 2, 2], [2, 1, 2]) == pytest.approx(8 / 9)
    assert cosine([1, 0], [0, 3]) == pytest.approx(0.0)
    assert sum_min([0.2, 0.3, 0.5], [0.5, 0.3, 0.2]) == pytest.approx(0.7)
    assert sum_min([2, 0], [0, 5]) == pytest.approx(0.0)


def test_jsd_matches_scipy():
    from scipy.spatial.distance import jensenshannon

    rng = np.random.default_rng(3)
    p, q = rng.uniform(size=(2, 30))
    p[:5] = 0
    assert jsd(p, q) == pytest.approx(jensenshannon(p, q, base=2) ** 2, abs=1e-12)


def test_important_set_keeps_ties_drops_unused():
    s = np.array([[5, 3, 3, 1, 0, 0], [0, 0, 0, 0, 2, 0]])
    np.testing.assert_array_equal(important_set(s, 2), [[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 1, 0]])


# ---------------------------------------------------------------- planted structure


def _block_corpus(name, experts, n_experts=64, n_layers=3, seed=0):
    p = np.zeros((8, n_layers, n_experts))
    p[..., experts] = 1.0 / len(experts)
    return from_stats(routed_stats(p, tokens_per_seq=64, top_k=4, seed=seed, corpus=name))


def test_disjoint_sets_are_below_chance():
    a = _block_corpus("a", list(range(16)), seed=1)
    b = _block_corpus("b", list(range(16, 32)), seed=2)
    rows, ov = compare_sets(a, b, "count", 16)
    assert all(r.jaccard == 0 and r.intersection == 0 for r in rows)
    assert all(r.z < 0 and r.p_less < 0.01 and r.jaccard < r.null_lo for r in rows)
    assert ov.z < -3 and ov.p_value < 1e-6 and ov.layers_below == 3
    u = compare_usage(a, b)[-1]
    assert (u.jsd, u.cosine, u.sum_min) == (pytest.approx(1), pytest.approx(0), pytest.approx(0))


def test_identical_usage_is_one():
    s = planted_corpora(n_layers=2, seed=4)[0]
    a, b = from_stats(s, name="a"), from_stats(s, name="b")
    rows, ov = compare_sets(a, b, "reap_mass", 10)
    assert all(r.jaccard == 1 and r.p_greater < 1e-6 for r in rows)
    assert ov.mean_jaccard == 1 and ov.layers_above == 2
    u = compare_usage(a, b)[-1]
    assert (u.jsd, u.cosine, u.sum_min) == (pytest.approx(0), pytest.approx(1), pytest.approx(1))


def test_random_usage_stays_in_chance_band_at_stated_rate():
    """Independent uniform routing: per-layer tests reject at <= alpha, band covers >= 95%."""
    p_layer, inside, p_all = [], [], []
    for seed in range(30):
        a, b = (
            from_stats(s)
            for s in uniform_corpora(
                ["a", "b"], n_layers=12, n_experts=48, top_k=2, n_seqs=4, seed=seed
            )
        )
        rows, ov = compare_sets(a, b, "count", 12)
        p_layer += [r.p_value for r in rows]
        inside += [r.null_lo <= r.jaccard <= r.null_hi for r in rows]
        p_all.append(ov.p_value)
    p_layer = np.array(p_layer)
    n = len(p_layer)
    for alpha in (0.05, 0.2):
        rate = np.mean(p_layer < alpha)
        assert alpha / 3 < rate < alpha + 3 * math.sqrt(alpha * (1 - alpha) / n), (alpha, rate)
    assert np.mean(inside) > 0.95 - 3 * math.sqrt(0.05 * 0.95 / n)
    assert np.mean(np.array(p_all) < 0.05) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 30)


def test_bootstrap_ci_covers_truth():
    """Sequence bootstrap, planted pair: the truth is known (top_k=1 draws follow the profile)."""
    prof, _ = planted_profiles(
        families={"f": ["a", "b"], "g": ["c"]}, n_layers=2, n_experts=32, generalists=4, seed=1
    )
    pa, pb = prof["a"], prof["b"]
    truth = {"jsd": jsd(pa, pb), "cosine": cosine(pa, pb), "sum_min": sum_min(pa, pb)}
    m = 8
    truth_j = chance.jaccard_of((important_set(pa, m) & important_set(pb, m)).sum(-1), m, m)
    hits = {k: [] for k in [*truth, "jaccard", "jsd_percentile"]}
    for r in range(40):
        rng = np.random.default_rng(r)
        a, b = (
            from_stats(
                routed_stats(
                    sequence_probs(p, 30, concentration=30, rng=rng),
                    tokens_per_seq=200,
                    top_k=1,
                    seed=2 * r + i,
                    corpus=n,
                )
            )
            for i, (n, p) in enumerate((("a", pa), ("b", pb)))
        )
        bt = bootstrap_pairs([a, b], [m], 200, seed=r)[("a", "b")]
        for k, true in truth.items():
            est = {"jsd": jsd, "cosine": cosine, "sum_min": sum_min}[k](a.count, b.count)
            lo, hi = bootstrap_ci(getattr(bt, k), est)
            hits[k] += list((lo <= true) & (true <= hi))
        lo, hi = bootstrap_ci(bt.jsd, jsd(a.count, b.count), method="percentile")
        hits["jsd_percentile"] += list((lo <= truth["jsd"]) & (truth["jsd"] <= hi))
        ov = compare_sets(a, b, "count", m)[0]
        lo, hi = bootstrap_ci(bt.jaccard[m], [x.jaccard for x in ov])
        hits["jaccard"] += list((lo <= truth_j) & (truth_j <= hi))
    cover = {k: np.mean(v) for k, v in hits.items()}
    for k in ("jsd", "cosine"):
        assert cover[k] >= 0.85, cover
    # top-m Jaccard is discrete and sum(min) has a kink at every crossing: the bootstrap is
    # rougher there (measured 0.84 and 0.85 at 95% nominal), still far from the failure below
    assert cover["jaccard"] >= 0.8 and cover["sum_min"] >= 0.8, cover
    assert cover["jsd_percentile"] < 0.5, cover  # why the default is the basic interval


def test_cis_attached_and_skipped_without_seq_count():
    cs = [from_stats(s) for s in planted_corpora(n_layers=2, seed=5)[:3]]
    bare = planted_corpora(n_layers=2, seed=5, with_seq_count=False)[3]
    r = analyze(
        cs + [from_stats(bare)], top_m=[12], bootstrap=50, permutations=5, communities=False
    )
    with_ci = [o for o in r.set_overall if bare.meta["corpus"] not in (o.corpus_a, o.corpus_b)]
    without = [o for o in r.set_overall if bare.meta["corpus"] in (o.corpus_a, o.corpus_b)]
    assert all(np.isfinite([o.ci_lo, o.ci_hi]).all() for o in with_ci if o.criterion == "count")
    assert all(np.isnan([o.ci_lo, o.ci_hi]).all() for o in without)
    assert all(np.isnan(o.ci_lo) for o in r.set_overall if o.criterion == "reap_mass")
    assert any("no seq_count" in n and bare.meta["corpus"] in n for n in r.notes)
    assert r.specialist_null is None


# ---------------------------------------------------------------- specialists and clusters


def test_specialists_follow_definition_and_chance():
    cs = [from_stats(s) for s in planted_corpora(n_layers=2, seed=6)]
    prof = expert_profiles(cs)
    freq = np.stack([c.count / c.tokens for c in cs], -1)
    li, e = 1, 7
    np.testing.assert_allclose(prof.lift[li, e], freq[li, e] / freq[li, e].mean())
    np.testing.assert_allclose(prof.share[li, e].sum(), 1.0)
    zh = prof.corpora.index("zh")
    counts = prof.specialist_counts().sum(0)
    _, homes = planted_profiles(n_layers=2, seed=6)
    assert counts[zh] >= 0.9 * homes["chinese"].sum() and counts.sum() == counts[zh]
    null = specialist_null(prof, shuffle_sequences(cs, 30, seed=0))
    assert null.p_value[zh] <= 1 / 31 + 1e-12 and null.mean[zh] < 0.1 * counts[zh]
    flat = [
        from_stats(s)
        for s in uniform_corpora(["a", "b", "c"], n_layers=4, n_seqs=3, tokens_per_seq=16, seed=1)
    ]
    fp = expert_profiles(flat)
    fn = specialist_null(fp, shuffle_sequences(flat, 50, seed=0))
    assert fp.specialist_counts().sum() > 0  # noise alone makes "specialists" ...
    assert (fn.p_value > 0.05).all()  # ... which the permutation baseline exposes


def test_corpus_dendrogram_recovers_families():
    from scipy.cluster.hierarchy import fcluster

    cs = [from_stats(s) for s in planted_corpora(n_layers=2, seed=7)]
    cc = cluster_corpora(cs)
    labels = dict(zip(cc.corpora, fcluster(cc.linkage, 3, "maxclust")))
    assert labels["en"] == labels["de"] == labels["fr"] != labels["python"] == labels["rust"]
    assert labels["zh"] not in (labels["en"], labels["python"])


def test_expert_clusters_recover_planted_groups():
    from sklearn.metrics import adjusted_rand_score

    fam = {"x": ["a"], "y": ["b"], "z": ["c"]}
    cs = [
        from_stats(s)
        for s in planted_corpora(families=fam, n_layers=2, generalists=0, n_seqs=16, seed=8)
    ]
    ec = cluster_experts(expert_profiles(cs), seed=0, null=shuffle_sequences(cs, 5))
    _, homes = planted_profiles(families=fam, n_layers=2, generalists=0, seed=8)
    truth = sum((i + 1) * homes[f] for i, f in enumerate(fam))  # 0 = the unowned block
    used = ec.labels >= 0
    assert ec.k in (3, 4)
    assert adjusted_rand_score(truth[used], ec.labels[used]) > 0.8
    assert len(ec.null_silhouette) == 5 and ec.best > max(ec.null_silhouette)
    assert ec.dispersion > 0.5 > max(ec.null_dispersion)


def test_expert_clusters_of_one_distribution_are_noise():
    """Two samples of one corpus: k-means still reports a fair silhouette, the shuffles match it."""
    prof, _ = planted_profiles(families={"f": ["a"]}, n_layers=3, seed=2)
    cs = [
        from_stats(routed_stats(sequence_probs(prof["a"], 16, rng=np.random.default_rng(i)),
                                tokens_per_seq=64, top_k=4, seed=i, corpus=f"run{i}"))
        for i in range(2)
    ]  # fmt: skip
    ec = cluster_experts(expert_profiles(cs), seed=0, null=shuffle_sequences(cs, 10))
    assert ec.best > 0.4  # looks like structure ...
    assert ec.best <= max(ec.null_silhouette)  # ... but shuffled sequences do as well
    assert min(ec.null_dispersion) < ec.dispersion < max(ec.null_dispersion)


def test_profile_dispersion_by_hand():
    from reap.analyze.cluster import profile_dispersion

    assert profile_dispersion(np.array([[0.5, 0.5], [1.0, 0.0]])) == pytest.approx(0.25)
    assert profile_dispersion(np.array([[1 / 3] * 3])) == pytest.approx(0.0)


def test_shuffle_sequences_keep_totals_and_average_to_the_pool():
    cs = [from_stats(s) for s in planted_corpora(n_layers=2, n_seqs=8, seed=9)[:3]]
    sh = shuffle_sequences(cs, 400, seed=1)
    f = np.stack([sh.freq(p) for p in range(len(sh))])  # [P, L, E, C]
    np.testing.assert_allclose(f.sum(2), cs[0].stats.top_k, rtol=1e-12)
    np.testing.assert_array_equal(
        sh.counts.sum(-1), np.broadcast_to(sum(c.count for c in cs), f.shape[:3])
    )
    pooled = sum(c.count for c in cs) / sum(c.tokens for c in cs)  # [L, E]
    np.testing.assert_allclose(f.mean((0, 3)), pooled, atol=2e-3)
    assert shuffle_sequences([cs[0], from_stats(uniform_corpora(["u"])[0])], 0) is None


def test_modularity_matches_networkx():
    nx = pytest.importorskip("networkx")
    rng = np.random.default_rng(9)
    blocks = np.repeat(np.arange(4), 10)
    w = rng.poisson(0.5, (40, 40)) + 5 * (blocks[:, None] == blocks[None, :]) * rng.poisson(
        1.0, (40, 40)
    )
    w = np.triu(w, 1) + np.triu(w, 1).T
    labels, q = greedy_modularity(w)
    g = nx.from_numpy_array(w)
    parts = [set(np.nonzero(labels == c)[0]) for c in range(labels.max() + 1)]
    assert q == pytest.approx(nx.community.modularity(g, parts, weight="weight"), abs=1e-9)
    assert modularity(w, labels) == pytest.approx(q, abs=1e-9)
    ref = nx.community.greedy_modularity_communities(g, weight="weight")
    assert q >= nx.community.modularity(g, ref, weight="weight") - 1e-9
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(blocks, labels) == 1.0


def test_communities_against_chance():
    cs = [from_stats(s) for s in planted_corpora(n_layers=2, seed=10)]
    comms = communities(cs, seed=0)
    assert all(c.modularity > 10 * c.null_max for c in comms)
    flat = [from_stats(s) for s in uniform_corpora(["a", "b"], n_layers=2, seed=3)]
    for c in communities(flat, seed=0):
        assert c.null_mean / 2 < c.modularity < 2 * c.null_mean


# ---------------------------------------------------------------- end to end, CLI, layering


def test_report_writes_everything(tmp_path):
    fam = {"eu": ["en", "de"], "zh": ["zh"]}
    cs = planted_corpora(families=fam, n_layers=3, n_seqs=12, seed=11)
    r = analyze(cs, top_m=[0.2, 16], bootstrap=40, permutations=10)
    files = write_report(r, str(tmp_path))
    names = set(os.listdir(tmp_path))
    assert {
        "report.md",
        "summary.json",
        "set_overlap.parquet",
        "set_overlap.csv",
        "dendrogram.png",
        "expert_profiles.png",
        "specialists_by_layer.png",
    } <= names
    assert not [n for n in names if ".tmp." in n]
    assert len(files.figures) == 3 + 2 * 2 + 4
    import pandas as pd

    df = pd.read_parquet(tmp_path / "set_overlap.parquet")
    assert len(df) == 3 * 2 * 2 * 3 and set(df.m) == {13, 16}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["settings"]["m"] == [13, 16]
    assert summary["code_version"].startswith("reap ") and len(summary["inputs"]) == 3
    import pyarrow.parquet as pq

    meta = pq.read_schema(tmp_path / "set_overlap.parquet").metadata
    assert b"synthetic-model" in b"".join(meta.values())  # provenance travels with the table
    text = (tmp_path / "report.md").read_text()
    assert "en – de" in text and "less than chance" in text and "more than chance" in text


def test_report_says_not_significant(tmp_path):
    r = analyze(
        uniform_corpora(["a", "b"], n_layers=3, seed=12),
        top_m=[16],
        bootstrap=20,
        permutations=10,
        communities=False,
    )
    files = write_report(r, str(tmp_path), with_plots=False)
    assert "not significant" in Path(files.report).read_text()


def _reap(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "reap.cli", "analyze", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
    )


def test_cli_end_to_end(tmp_path):
    paths = write_corpora(uniform_corpora(["a", "b"], n_layers=2, seed=13), str(tmp_path / "s"))
    out = _reap(
        *paths,
        "--out",
        str(tmp_path / "o"),
        "--top-m",
        "8",
        "--bootstrap",
        "20",
        "--no-plots",
        "--quiet",
        "--criteria",
        "count",
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "o" / "report.md").is_file()
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["top_k"] == 4


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    from reap.cli import main

    a, b = write_corpora(uniform_corpora(["a", "b"], n_layers=2, seed=14), str(tmp_path))
    other = uniform_corpora(["c"], n_layers=2, n_experts=32, seed=14)[0]
    c = other.save(tmp_path / "c.safetensors")
    bad = planted_corpora(n_layers=2, seed=1)[0]
    bad.seq_count[0, 0, 0] += 1
    d = bad.save(tmp_path / "d.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a file")
    cases = [
        ([a], "at least two"),
        ([a, str(tmp_path / "nope.safetensors")], "no such"),
        ([a, c], "differ"),
        ([a, str(junk)], "not a reap statistics"),
        ([a, a], "twice"),
        ([a, d], "seq_count does not sum"),
        ([a, b, "--top-m", "1000"], "--top-m"),
    ]
    for args, msg in cases:
        code = main(["analyze", *args, "--out", str(tmp_path / "o"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and msg in err, (args, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("reap: error: "), err


def test_analyze_never_imports_a_later_stage():
    later = ("reap.prune", "reap.engine", "reap.eval")
    for path in Path("reap/analyze").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            assert not any(n.startswith(later) for n in names), (path, names)


def test_synthetic_stats_are_consistent():
    s = planted_corpora(n_layers=2, seed=15)[0]
    assert torch.equal(torch.diagonal(s.coact, dim1=1, dim2=2), s.count)
    assert torch.equal(s.seq_count.long().sum(0), s.count)
    assert (s.count.sum(-1) == s.tokens * s.top_k).all()
    assert (s.reap_sum <= s.ean_sum + 1e-9).all() and (s.gate_sum > 0).any()


def test_directory_input_skips_merges_and_non_statistics(tmp_path):
    from reap.stats import merge

    parts = uniform_corpora(["a", "b"], n_layers=2, seed=16)
    write_corpora(parts, str(tmp_path / "run1"))
    merge(parts, meta={"corpus": "a+b"}).save(tmp_path / "run1" / "all.safetensors")
    (tmp_path / "run1" / "token_experts.safetensors").write_bytes(b"\0" * 16)
    write_corpora(uniform_corpora(["a"], n_layers=2, seed=17), str(tmp_path / "run2"))
    r = analyze(
        [tmp_path / "run1", tmp_path / "run2"],
        top_m=[8],
        bootstrap=0,
        permutations=0,
        communities=False,
    )
    assert [c.name for c in r.corpora] == ["a@run1", "b", "a@run2"]
    assert any("all.safetensors" in n and "token_experts" in n for n in r.notes)
