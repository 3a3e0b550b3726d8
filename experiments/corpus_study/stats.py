"""The corpus study's design constants, its statistics helpers and the aggregation of the
per-build records into tables and answers (used by `experiments.corpus_study.study`).

Effects are per-seed values (one calibration sample per seed) summarized by a Student-t 95 %
interval over the seeds (`seed_ci`); an effect "holds" when that interval excludes zero on the
side the question predicts (`verdict`). Perplexity effects are differences of log perplexity
ratios to the full model (so exp(effect) is a ratio of perplexities); overlap effects are
observed minus chance-expected Jaccard of top-m expert sets (`reap.analyze.chance`).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from experiments.corpus_study.study import Settings

CORPORA = ["zh", "en", "de", "fr", "es", "it", "ja", "code"]  # calibrated, per-corpus statistics
EUROPEAN = ["de", "fr", "es", "it"]
SETS = {  # calibration set -> the statistics it plans from (equal weights)
    "en+code": ["en", "code"],
    "zh": ["zh"],
    "zh+code": ["zh", "code"],
    "eu": ["eu"],
    "ja": ["ja"],
    "full": ["zh", "en", "eu", "ja", "code"],
}
DOMAINS = ["zh", "en", "eu", "ja", "code"]  # evaluated corpora and prompt sets


# ---- statistics helpers (tested in tests/test_corpus_study.py) ----


def seed_ci(values, level: float = 0.95) -> dict:
    """Mean of per-seed values with a Student-t interval: {mean, lo, hi, n, values}.
    With one value the interval is undefined (lo = hi = None)."""
    from scipy.stats import t

    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    out = {
        "mean": float(v.mean()) if len(v) else None,
        "lo": None,
        "hi": None,
        "n": len(v),
        "values": v.tolist(),
    }
    if len(v) >= 2:
        half = float(t.ppf(0.5 + level / 2, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v)))
        out["lo"], out["hi"] = out["mean"] - half, out["mean"] + half
    return out


def verdict(ci: dict, direction: int) -> str:
    """'holds' if the interval excludes 0 on the side of `direction` (+1 / -1), 'reversed' if it
    excludes 0 on the other side, else 'inconclusive'."""
    if ci["lo"] is None:
        return "inconclusive"
    lo, hi = ci["lo"] * direction, ci["hi"] * direction
    lo, hi = min(lo, hi), max(lo, hi)
    return "holds" if lo > 0 else "reversed" if hi < 0 else "inconclusive"


def kept_overlap(keep_a: dict, keep_b: dict, n_experts: int) -> dict:
    """Jaccard of two plans' kept sets, averaged over layers, with the exact chance expectation
    for sets of the same sizes among `n_experts`: {jaccard, expected}."""
    from reap.analyze.chance import jaccard_null

    js, es = [], []
    for layer, ids in keep_a.items():
        a, b = set(ids), set(keep_b[layer])
        js.append(len(a & b) / len(a | b))
        es.append(jaccard_null(n_experts, len(a), len(b)).mean)
    return {"jaccard": float(np.mean(js)), "expected": float(np.mean(es))}


# ---- aggregation: tables and the answers, from the per-build records ----


def _by(recs: list[dict], **kw) -> list[dict]:
    """Records matching every field, in seed order."""
    out = [r for r in recs if all(r[k] == v for k, v in kw.items())]
    return sorted(out, key=lambda r: r["seed"])


def _lr(rec: dict, dom: str) -> float:
    return math.log(rec["quality"][dom]["ppl_ratio"]["value"])


def _paired(a: list[dict], b: list[dict], f) -> dict:
    """seed_ci of f(a_seed) - f(b_seed) over the seeds both have."""
    bs = {r["seed"]: r for r in b}
    return seed_ci([f(r) - f(bs[r["seed"]]) for r in a if r["seed"] in bs])


def build_table(recs: list[dict]) -> list[dict]:
    """Per (set, criterion, budget): per-domain ratio, log ratio, agreement and KL over seeds,
    and each seed's bootstrap interval over documents for the ratio."""
    keys = dict.fromkeys((r["cal_set"], r["criterion"], r["budget"], r["keep"]) for r in recs)
    rows = []
    for cal_set, crit, budget, keep in keys:
        rs = _by(recs, cal_set=cal_set, criterion=crit, budget=budget)
        q = {
            d: {
                m: seed_ci([r["quality"][d][m]["value"] for r in rs])
                for m in ("ppl_ratio", "agreement", "kl")
            }
            for d in DOMAINS
        }
        for d in DOMAINS:
            q[d]["log_ratio"] = seed_ci([_lr(r, d) for r in rs])
            q[d]["doc_ci"] = [
                [r["quality"][d]["ppl_ratio"]["lo"], r["quality"][d]["ppl_ratio"]["hi"]] for r in rs
            ]
        mean_lr = seed_ci([np.mean([_lr(r, d) for d in DOMAINS]) for r in rs])
        rows.append(
            {
                "set": cal_set,
                "criterion": crit,
                "budget": budget,
                "keep": keep,
                "seeds": [r["seed"] for r in rs],
                "quality": q,
                "mean_log_ratio": mean_lr,
            }
        )
    return rows


def generation_table(recs: list[dict]) -> dict:
    """Generation metrics of the builds with generations, per set and domain, over seeds."""
    metrics = ("looping", "longest_repeat", "distinct_2", "script", "python_valid")
    gen = [r for r in recs if "generations" in r]
    out: dict = {"reference": {}, "builds": {}}
    if not gen:
        return out
    for d, v in gen[0]["reference_generations"].items():
        out["reference"][d] = {m: v.get(m) for m in metrics}
    for cal_set in dict.fromkeys(r["cal_set"] for r in gen):
        rs = _by(gen, cal_set=cal_set)
        out["builds"][cal_set] = {
            d: {m: seed_ci([r["generations"][d].get(m) for r in rs]) for m in metrics}
            for d in rs[0]["generations"]
        }
    return out


def _gen_metric(d: str, m: str):
    return lambda r: r["generations"][d][m]


def answers(recs: list[dict], s: Settings, overlaps: dict[int, list[dict]], m: int) -> dict:
    """The issue's questions: effect, 95 % interval over seeds, verdict (see the report)."""
    reap = [r for r in recs if r["criterion"] == "reap"]
    out: dict = {}
    for b in s.budgets:
        g = {c: _by(reap, cal_set=c, budget=b) for c in s.sets}
        q = {}
        if {"en+code", "full"} <= g.keys():
            q["en+code loses zh (vs full)"] = (
                _paired(g["en+code"], g["full"], lambda r: _lr(r, "zh")),
                1,
            )
        if {"en+code", "zh+code"} <= g.keys():
            q["en+code loses zh (vs zh+code)"] = (
                _paired(g["en+code"], g["zh+code"], lambda r: _lr(r, "zh")),
                1,
            )
        if {"zh", "full"} <= g.keys():
            q["zh loses code (vs full)"] = (
                _paired(g["zh"], g["full"], lambda r: _lr(r, "code")),
                1,
            )
        if {"zh", "zh+code", "en+code"} <= g.keys():
            q["zh+code beats en+code on zh"] = (
                _paired(g["zh+code"], g["en+code"], lambda r: _lr(r, "zh")),
                -1,
            )
            q["zh+code beats zh on code"] = (
                _paired(g["zh+code"], g["zh"], lambda r: _lr(r, "code")),
                -1,
            )
            q["zh+code vs zh on zh (cost)"] = (
                _paired(g["zh+code"], g["zh"], lambda r: _lr(r, "zh")),
                0,
            )
            q["zh+code vs en+code on code (cost)"] = (
                _paired(g["zh+code"], g["en+code"], lambda r: _lr(r, "code")),
                0,
            )
        for c, d in (("zh", "zh"), ("eu", "eu"), ("ja", "ja"), ("en+code", "code")):
            if {c, "full"} <= g.keys():  # does a set's own domain gain from calibrating on it?
                ci = _paired(g[c], g["full"], lambda r, d=d: _lr(r, d))
                q[f"{c} build on {d} (vs full)"] = (ci, -1)
        out[b] = {
            k: {"ci": ci, "direction": d, "verdict": verdict(ci, d) if d else "n/a"}
            for k, (ci, d) in q.items()
        }
    out["generations"] = _generation_answers(recs, s)
    out["overlap"] = _overlap_answers(overlaps, m)
    out["criteria"] = _criteria_answers(recs, s)
    return out


def _generation_answers(recs: list[dict], s: Settings) -> dict:
    gen = [r for r in recs if "generations" in r]
    g = {c: _by(gen, cal_set=c) for c in s.sets}
    out = {}
    pairs = [
        ("en+code", "full", "zh", "looping", 1),
        ("en+code", "full", "zh", "distinct_2", -1),
        ("en+code", "full", "zh", "longest_repeat", 1),
        ("zh", "full", "code", "python_valid", -1),
        ("zh+code", "en+code", "zh", "looping", -1),
        ("zh+code", "zh", "code", "python_valid", 1),
    ]
    for a, b, d, m, direction in pairs:
        if g.get(a) and g.get(b) and d in g[a][0]["generations"]:
            ci = _paired(g[a], g[b], _gen_metric(d, m))
            out[f"{a} vs {b}: {d} {m}"] = {
                "ci": ci,
                "direction": direction,
                "verdict": verdict(ci, direction),
            }
    return out


def _overlap_answers(overlaps: dict[int, list[dict]], m: int) -> dict:
    """Excess Jaccard (observed - chance) of corpus pairs, count criterion, top-m sets."""

    def excess(rows, pairs):
        sel = [
            r
            for r in rows
            if r["criterion"] == "count" and r["m"] == m and {r["corpus_a"], r["corpus_b"]} in pairs
        ]
        return float(np.mean([r["mean_jaccard"] - r["mean_expected"] for r in sel]))

    eu = [set(p) for p in itertools.combinations(EUROPEAN, 2)]
    eu_other = [{a, b} for a in EUROPEAN for b in ("zh", "ja", "code")]
    zc = [{"zh", "code"}]
    code_other = [{"code", c} for c in CORPORA if c not in ("code", "zh")]
    seeds = sorted(overlaps)
    q = {
        "european pairs: excess jaccard": (seed_ci([excess(overlaps[s], eu) for s in seeds]), 1),
        "european pairs minus european-vs-zh/ja/code": (
            seed_ci([excess(overlaps[s], eu) - excess(overlaps[s], eu_other) for s in seeds]),
            1,
        ),
        "zh-code: excess jaccard": (seed_ci([excess(overlaps[s], zc) for s in seeds]), -1),
        "zh-code minus code's other pairs": (
            seed_ci([excess(overlaps[s], zc) - excess(overlaps[s], code_other) for s in seeds]),
            -1,
        ),
    }
    out = {k: {"ci": ci, "direction": d, "verdict": verdict(ci, d)} for k, (ci, d) in q.items()}
    out["zh-code: exact p_less per seed"] = [
        r["p_less"]
        for s in seeds
        for r in overlaps[s]
        if r["criterion"] == "count"
        and r["m"] == m
        and {r["corpus_a"], r["corpus_b"]} == {"zh", "code"}
    ]
    return out


def _criteria_answers(recs: list[dict], s: Settings) -> dict:
    """Mean log perplexity ratio over domains per criterion, and REAP minus each other."""
    out = {}
    for b in s.criteria_budgets:
        per = {
            c: _by(recs, cal_set=s.criteria_set, criterion=c, budget=b)
            for c in ["reap", *s.criteria]
        }
        f = lambda r: float(np.mean([_lr(r, d) for d in DOMAINS]))
        out[b] = {"mean_log_ratio": {c: seed_ci([f(r) for r in rs]) for c, rs in per.items()}}
        for c in s.criteria:
            ci = _paired(per["reap"], per[c], f)
            out[b][f"reap minus {c}"] = {"ci": ci, "direction": -1, "verdict": verdict(ci, -1)}
    return out


def overlap_matrix(overlaps: dict[int, list[dict]]) -> dict:
    """{criterion: {m: {"jaccard", "expected", "ratio": C x C lists, mean over seeds}}}."""
    out: dict = {}
    idx = {c: i for i, c in enumerate(CORPORA)}
    C, S = len(CORPORA), len(overlaps)
    for k, seed in enumerate(sorted(overlaps)):
        for r in overlaps[seed]:
            cell = out.setdefault(r["criterion"], {}).setdefault(
                str(r["m"]), {"j": np.zeros((C, C, S)), "e": np.zeros((C, C, S))}
            )
            i, j = idx[r["corpus_a"]], idx[r["corpus_b"]]
            cell["j"][i, j, k] = cell["j"][j, i, k] = r["mean_jaccard"]
            cell["e"][i, j, k] = cell["e"][j, i, k] = r["mean_expected"]
    for crit in out.values():
        for m, cell in crit.items():
            j, e = cell["j"].mean(-1), cell["e"].mean(-1)
            np.fill_diagonal(j, 1.0), np.fill_diagonal(e, 1.0)
            crit[m] = {"jaccard": j.tolist(), "expected": e.tolist(), "ratio": (j / e).tolist()}
    return out


def kept_matrix(recs: list[dict], s: Settings, n_experts: int) -> dict:
    """Per budget: Jaccard of the REAP builds' kept sets between calibration sets (mean over
    seeds) and its chance expectation."""
    out = {}
    for b in s.budgets:
        g = {c: _by(recs, cal_set=c, budget=b, criterion="reap") for c in s.sets}
        cells = {}
        for a, c in itertools.product(s.sets, repeat=2):
            ov = [kept_overlap(x["kept"], y["kept"], n_experts) for x, y in zip(g[a], g[c])]
            cells[f"{a}|{c}"] = {k: float(np.mean([o[k] for o in ov])) for k in ov[0]}
        out[b] = cells
    return out
