"""The corpus study (experiments/corpus_study/): its statistics helpers against exact
arithmetic and brute force, and a smoke run of the whole study on a tiny setting (resumed)."""

import itertools
import json
import math
from fractions import Fraction

import pytest

from experiments.corpus_study import stats as st
from experiments.corpus_study import study as cs
from reap.errors import ReapError

# Student t quantile at p with 2 degrees of freedom in closed form: (2p - 1) sqrt(2 / (4p(1 - p)))
T_975_DF2 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))


def test_seed_ci_is_the_student_t_interval():
    ci = st.seed_ci([1.0, 2.0, 3.0])
    half = T_975_DF2 * 1.0 / math.sqrt(3)  # sample sd of 1, 2, 3 is exactly 1
    assert ci["mean"] == 2.0 and ci["n"] == 3
    assert ci["lo"] == pytest.approx(2.0 - half, abs=1e-9)
    assert ci["hi"] == pytest.approx(2.0 + half, abs=1e-9)
    one = st.seed_ci([0.5, None])
    assert one["mean"] == 0.5 and one["lo"] is None and one["hi"] is None


def test_verdict_reads_the_interval_side():
    ci = lambda lo, hi: {"mean": (lo + hi) / 2, "lo": lo, "hi": hi}
    assert st.verdict(ci(0.1, 0.3), 1) == "holds"
    assert st.verdict(ci(0.1, 0.3), -1) == "reversed"
    assert st.verdict(ci(-0.3, -0.1), -1) == "holds"
    assert st.verdict(ci(-0.1, 0.3), 1) == "inconclusive"
    assert st.verdict({"mean": 1.0, "lo": None, "hi": None}, 1) == "inconclusive"


def _brute_expected_jaccard(n: int, a: int, b: int) -> Fraction:
    """E[J] of a fixed a-set and a uniformly random b-set among n items, by enumeration."""
    fixed = set(range(a))
    subsets = list(itertools.combinations(range(n), b))
    return sum(Fraction(len(fixed & set(s)), len(fixed | set(s))) for s in subsets) / len(subsets)


def test_kept_overlap_against_enumeration():
    keep_a = {1: [0, 1, 2], 2: [0, 3, 5, 7]}
    keep_b = {1: [1, 2, 6], 2: [3, 4, 5]}
    res = st.kept_overlap(keep_a, keep_b, n_experts=8)
    j = (Fraction(2, 4) + Fraction(2, 5)) / 2  # {1,2} of {0,1,2,6}; {3,5} of {0,3,4,5,7}
    e = (_brute_expected_jaccard(8, 3, 3) + _brute_expected_jaccard(8, 4, 3)) / 2
    assert res["jaccard"] == pytest.approx(float(j), abs=1e-12)
    assert res["expected"] == pytest.approx(float(e), abs=1e-12)


def test_keep_count_matches_the_k3_share():
    # the K3 350 GB build keeps 146 of 896 experts per layer (README, `reap plan --dry-run`)
    assert cs.keep_count("k3", 64, 6) == round(64 * 146 / 896) == 10
    assert cs.keep_count("k3", 896, 16) == 146
    assert cs.keep_count("25%", 64, 6) == 16 and cs.keep_count("50%", 64, 6) == 32
    assert cs.keep_count("5%", 64, 6) == 6  # never below top_k


def _overlap_row(a, b, j, e, m=4):
    return {
        "corpus_a": a,
        "corpus_b": b,
        "criterion": "count",
        "m": m,
        "mean_jaccard": j,
        "mean_expected": e,
        "p_less": 0.5,
        "p_greater": 0.5,
    }


def test_overlap_answers_are_excess_jaccard_over_seeds():
    eu_pairs = list(itertools.combinations(st.EUROPEAN, 2))
    overlaps = {}
    for seed, shift in ((0, 0.0), (1, 0.1), (2, 0.2)):
        rows = [_overlap_row(a, b, 0.3 + shift, 0.1) for a, b in eu_pairs]
        rows += [_overlap_row(a, b, 0.1, 0.1) for a in st.EUROPEAN for b in ("zh", "ja", "code")]
        rows.append(_overlap_row("zh", "code", 0.05 - shift / 10, 0.1))
        overlaps[seed] = rows
    ans = st._overlap_answers(overlaps, 4)
    eu = ans["european pairs: excess jaccard"]
    assert eu["ci"]["values"] == pytest.approx([0.2, 0.3, 0.4])
    assert eu["verdict"] == "holds"
    zc = ans["zh-code: excess jaccard"]
    assert zc["ci"]["values"] == pytest.approx([-0.05, -0.06, -0.07])
    assert zc["ci"]["hi"] < 0 and zc["verdict"] == "holds"


def test_smoke_run_and_resume(tmp_path):
    s = cs.Settings(
        seeds=[0, 1],
        sets=["zh", "en+code"],
        budgets=["k3"],
        criteria=["random", "recon"],
        criteria_set="zh",
        criteria_budgets=["k3"],
        calib_seqs=1,
        seq_len=32,
        max_docs=1,
        doc_tokens=12,
        gen_tokens=2,
        gen_domains=["zh"],
        bootstrap=20,
        check_equivalence=False,
    )
    work, out, report = tmp_path / "work", tmp_path / "out", tmp_path / "report.md"
    res = cs.run_study(s, work, out, report)
    recs = json.loads((out / "builds.json").read_text())
    assert len(recs) == 2 * 2 + 2 * 2
    # every build's prediction on every domain; recon's objective never above REAP's set's
    assert sorted(res["predictions"]) == sorted(r["id"] for r in recs)
    for p in res["predictions"].values():
        assert sorted(p) == sorted(cs.DOMAINS) and all(0 <= x["damage"] <= 1 for x in p.values())
    assert res["validation"]["all"]["ppl"]["n"] == len(recs) * len(cs.DOMAINS)
    for o in res["recon"]["objective"].values():
        assert o["recon"] <= o["reap"] + 1e-12
    # tables are recomputed naively from the per-build records
    row = next(x for x in res["builds"] if x["set"] == "en+code" and x["criterion"] == "reap")
    per_seed = [
        r["quality"]["zh"]["ppl_ratio"]["value"]
        for r in recs
        if r["cal_set"] == "en+code" and r["criterion"] == "reap"
    ]
    assert row["quality"]["zh"]["ppl_ratio"]["mean"] == pytest.approx(sum(per_seed) / 2)
    for r in recs:
        assert all(len(ids) == res["keeps"]["k3"] for ids in r["kept"].values())
        assert ("generations" in r) == (r["criterion"] == "reap")
    assert "## Does the plan's prediction rank builds?" in report.read_text()
    rand = [r for r in recs if r["criterion"] == "random"]
    assert rand[0]["kept"] != rand[1]["kept"]  # one random draw per seed
    text = report.read_text()
    assert "## Answers" in text and (out / "overlap.png").exists()
    assert f"{math.exp(row['quality']['zh']['log_ratio']['mean']):.2f}" in text
    # a second run computes nothing new: every build comes from work/results
    stamps = {p: p.stat().st_mtime_ns for p in (work / "results").iterdir()}
    cs.run_study(s, work, out, None)
    assert {p: p.stat().st_mtime_ns for p in (work / "results").iterdir()} == stamps
    with pytest.raises(ReapError, match="other settings"):
        cs.run_study(cs.Settings(**{**s.__dict__, "max_docs": 2}), work, out, None)


def test_spearman_with_ties_equals_scipy():
    import numpy as np
    from scipy.stats import spearmanr

    from experiments.corpus_study.predictions import spearman

    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, 40).astype(float)  # many ties
    y = x + rng.normal(size=40)
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, rel=1e-12)
    assert np.isnan(spearman(np.ones(5), np.arange(5.0)))


# ---- the pruning-vs-merging comparison (experiments/corpus_study/merging.py) ----


def _fake_rec(method: str, seed: int, ratios: dict, acc: float = 0.5) -> dict:
    """A build record as `merging.run_method_build` writes it, with planted ppl ratios."""
    bid = f"full.{method}.k10.s{seed}"
    q = {
        d: {
            "ppl_ratio": {"value": ratios.get(d, 2.0), "lo": 1.5, "hi": 2.5},
            "agreement": {"value": 0.4},
            "kl": {"value": 0.8},
        }
        for d in st.DOMAINS
    }
    acc_est = lambda v: {"value": v, "lo": 0.0, "hi": 1.0}
    return {
        "id": bid,
        "cal_set": "full",
        "criterion": method,
        "budget": "k3",
        "keep": 10,
        "seed": seed,
        "kept": {"1": list(range(10))},
        "groups": None if method == "reap" else {"max": 3, "singletons": 5, "mean": 6.4},
        "quality": q,
        "benchmarks": {
            "reap_tiny_mc": {
                bid: {"samples": 6, "acc": acc_est(acc)},
                "reference": {"samples": 6, "acc": acc_est(0.0)},
            }
        },
        "seconds": 1.0,
    }


def _fake_merging(tmp_path):
    """merging.json from planted records: REAP beats hc-smoe on zh by a factor 0.8 (all seeds),
    m-smoe beats REAP on code by a factor 1.25, everything else equal up to seed noise."""
    from experiments.corpus_study import merging as mg

    s = mg.MergeSettings(seeds=[0, 1, 2], budgets=["k3"])
    noise = [0.0, 0.01, -0.01]
    recs = []
    for seed, e in zip(s.seeds, noise):
        f = math.exp(e)
        recs.append(_fake_rec("reap", seed, {"zh": 1.6 * f, "code": 2.5 * f}, acc=1 / 6))
        recs.append(_fake_rec("hc-smoe", seed, {"zh": 2.0, "en": 2.0 * f, "code": 2.5}))
        recs.append(_fake_rec("m-smoe", seed, {"zh": 1.6, "code": 2.0}))
        # the merge plans pruned to their dominants: as good as REAP except on zh for hc-smoe
        recs.append(_fake_rec("hc-smoe-dom", seed, {"zh": 1.6 * f, "code": 2.5 * f}))
        recs.append(_fake_rec("m-smoe-dom", seed, {"zh": 2.0 * f, "code": 2.5 * f}))
    comps = mg.comparisons(recs, s)
    for c in comps:
        c["seeds_needed"] = mg.seeds_needed(c["log_diff"])
    spec = {
        "freq_cv": 0.1,
        "reap_kept": {"k3": 0.17},
        "uniform": {"k3": 0.15625},
        "out_cos": 0.2,
        "router_cos": 0.9,
    }
    m = {
        "settings": {**s.__dict__},
        "keeps": {"k3": 10},
        "n_experts": 64,
        "builds": st.build_table(recs),
        "comparisons": comps,
        "tasks": mg.task_table(recs),
        "specialisation": {str(seed): spec for seed in s.seeds},
        "sensitivity": {"k3": {"slope": 2.0, "pairs": 30, "damage_sd": 0.01}},
        "group_sizes": {},
        "pruning_study_match": {"builds": 3, "kept_equal": True, "ppl_ratio_max_rel_diff": 0.0},
        "n_builds": len(recs),
        "build_seconds": 60.0,
        "calibration_seconds": [30.0, 30.0, 30.0],
    }
    (tmp_path / "merging.json").write_text(json.dumps(m))
    return m, recs


def test_merging_comparisons_and_verdicts(tmp_path):
    m, _ = _fake_merging(tmp_path)
    by = {(c["b"], c["domain"]): c for c in m["comparisons"] if c["a"] == "reap"}
    zh = by[("hc-smoe", "zh")]  # REAP lower: pruning prevails
    assert zh["log_diff"]["values"] == pytest.approx([math.log(0.8) + e for e in (0, 0.01, -0.01)])
    assert zh["ratio"]["mean"] == pytest.approx(0.8, rel=1e-12)
    assert zh["verdict"] == "holds"
    code = by[("m-smoe", "code")]  # merged lower: reversed
    assert code["ratio"]["mean"] == pytest.approx(1.25, rel=1e-12) and code["verdict"] == "reversed"
    assert by[("hc-smoe", "eu")]["verdict"] == "inconclusive"  # no spread: interval is a point 0
    mean = by[("hc-smoe", "mean")]  # mean over domains of the per-seed log differences
    assert mean["log_diff"]["mean"] == pytest.approx(
        sum(by[("hc-smoe", d)]["log_diff"]["mean"] for d in st.DOMAINS) / len(st.DOMAINS)
    )
    t = m["tasks"]["reap_tiny_mc"]
    assert t["reference"] == 0.0 and t["rows"]["reap|k3"]["mean"] == pytest.approx(1 / 6)
    # the decomposition: REAP / merged = (REAP / dominants) x (dominants / merged), per seed
    for x in ("hc-smoe", "m-smoe"):
        for d in (*st.DOMAINS, "mean"):
            whole = by[(x, d)]["log_diff"]["values"]
            sel = next(
                c
                for c in m["comparisons"]
                if (c["a"], c["b"], c["domain"]) == ("reap", f"{x}-dom", d)
            )["log_diff"]["values"]
            avg = next(
                c for c in m["comparisons"] if (c["a"], c["b"], c["domain"]) == (f"{x}-dom", x, d)
            )["log_diff"]["values"]
            assert whole == pytest.approx([s + a for s, a in zip(sel, avg)], abs=1e-12)


def test_seeds_needed_is_the_first_n_whose_t_interval_excludes_zero():
    from scipy.stats import t

    from experiments.corpus_study.merging import seeds_needed

    ci = st.seed_ci([0.1, 0.3, 0.2])  # mean 0.2, sd 0.1: needs t(n-1)/sqrt(n) < 2
    n = seeds_needed(ci)
    assert t.ppf(0.975, n - 1) / math.sqrt(n) < 2 <= t.ppf(0.975, n - 2) / math.sqrt(n - 1)
    assert seeds_needed(st.seed_ci([0.1, 0.1])) is None  # no spread to judge


def test_merging_section_reports_verdicts_and_where_merging_wins(tmp_path):
    from experiments.corpus_study import merging as mg

    m, _ = _fake_merging(tmp_path)
    mg._rewrite_report(tmp_path, tmp_path / "report.md")  # no results.json: the section alone
    text = (tmp_path / "report.md").read_text()
    assert text.startswith("## Pruning against merging")
    assert "### Pruning vs merging" in text and "### How specialised" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("| K3 350 GB share"))
    assert "| zh | 0.800 [" in row and "**holds**" in row  # first domain of the k3 block
    assert "merging wins in 1," in text and "pruning prevails in 1," in text
    assert "Merging wins (interval above 1): m-smoe on code" in text
    # the strength table: median half-width of the REAP / dominants intervals, / slope, and
    # REAP's margin over a random set
    lines = text.splitlines()
    cells = lines[lines.index(next(ln for ln in lines if "resolvable ppl factor" in ln)) + 2]
    halves = sorted(
        (c["log_diff"]["hi"] - c["log_diff"]["lo"]) / 2
        for c in m["comparisons"]
        if c["domain"] != "mean" and c["a"] == "reap" and "dom" in c["b"]
    )
    h = (halves[len(halves) // 2 - 1] + halves[len(halves) // 2]) / 2  # 10: an even count
    cells = [c.strip() for c in cells.strip("|").split("|")]
    assert cells[1:] == [f"{math.exp(h):.3f}", "2.00", f"{h / 2:.3f}", f"{0.17 - 0.15625:.3f}"]
    assert "| 0.17 [" in text  # the planted task accuracy of REAP (1/6), over seeds
    # REAP / hc-smoe-dom is 1 everywhere; hc-smoe-dom / hc-smoe carries the zh win (1 domain)
    dec = next(ln for ln in text.splitlines() if ln.startswith("| hc-smoe | K3"))
    assert "| 1.000 [1.000, 1.000] **inconclusive** |" in dec and dec.endswith("| 1 of 5 |")
    assert "dominants pruned against merged: 1 hold, 2 reversed, 7 inconclusive" in text
