"""The report's "Pruning against merging" section (issue #31 part 3), from
reports/corpus-study/merging.json alone (`experiments.corpus_study.merging` writes it;
`experiments.corpus_study.report` calls `merging_section` when the file is there)."""

from __future__ import annotations

import math

import numpy as np

from experiments.corpus_study.report import _budget, _ci, _table

NAMES = {
    "reap": "REAP (pruned)",
    "hc-smoe": "HC-SMoE (merged)",
    "m-smoe": "M-SMoE (merged)",
    "hc-smoe-dom": "HC-SMoE's dominants (pruned)",
    "m-smoe-dom": "M-SMoE's dominants (pruned)",
}
MERGES = ("hc-smoe", "m-smoe")

INTRO = """The paper behind this toolkit (REAP the Experts, arXiv 2510.13999) finds that pruning
prevails over expert merging for one-shot compression. Here the claim is tested on k3-mini with
the toolkit's own merged builds (`reap plan --method hc-smoe|m-smoe`, `reap prune`): per
calibration seed of the study, one `reap calibrate --merge-stats {ms}` run over the same
tokens as the pruning study (all eight corpora, {seqs} x {seq_len} tokens each, the same
sequences), then on the `{cal_set}` set and at the study's budgets a REAP-pruned build (the
study's plan), an HC-SMoE-merged and an M-SMoE-merged build with the same number of experts per
layer and, as controls, each merge plan pruned to its dominant experts without merging; all
evaluated like the study's builds (the same {docs} eval documents per domain, {toks} tokens
each). Reproduce: `python -m experiments.corpus_study --merging` (work files in
`/tmp/corpus-study-merging`, resumable), which writes `corpus-study/merging.json` (summaries),
`merging-builds.json` (every build's record) and this section. Reduced against the pruning
study: only the `{cal_set}` calibration set (not the five others), no greedy generations; seeds
({seeds}), budgets and domains are the study's. Compute: {build_min:.1f} minutes of build time
(plan, build, evaluation) and {cal_min:.1f} minutes of calibration for all {n_builds} builds.

Router of the merged builds (`reap.prune.merge_plan.ROUTER_RULE`): {router}. So a merged build
has the router of a pruned build that keeps each group's dominant expert, and only that
expert's weights differ (the group's weighted average); the papers' rule (all router rows kept, pointing at the
shared merged expert) routes differently, and these numbers compare this toolkit's merging, not
the papers' exact builds."""

VERDICT_INTRO = """Effect per seed: log(ppl ratio of the REAP build) minus log(ppl ratio of the
merged build) on the same documents, so exp(effect) = REAP's perplexity / the merged build's;
below 1 = pruning better. Mean [95 % Student-t interval over the {n} seeds]; "pruning prevails"
**holds** when the interval lies below 1, is **reversed** (merging wins) when it lies above 1,
**inconclusive** otherwise. The `mean` row averages the log ratio over the five domains."""

TASK_NOTE = """The shipped lm-eval task (`tests/fixtures/lm_eval/{task}.yaml`, {n} invented
English multiple-choice questions, 4 choices, through `reap eval --tasks`): accuracy, mean
[interval over seeds]. The full model scores {ref:.2f} (chance 0.25). One question is a step of
{step:.2f} in accuracy, and a 6 M-parameter model trained on 5 M tokens has no knowledge to
answer them with, so differences between builds here are noise: the rows only show that pruned
and merged builds run through lm-eval like the full model. The task's real use is on a model
that can answer it."""

SPEC_INTRO = """How unlike one another k3-mini's experts are, from each seed's `{cal_set}`
statistics (per layer, averaged over the five MoE layers): `freq CV` = coefficient of variation
of the experts' routed-token counts (0 = perfectly balanced); `REAP mass kept` = share of the
summed REAP score (gate weight x output norm) held by the top experts at each budget, against
the share a random set of that size holds on average; `output cos` = mean pairwise cosine of the
experts' mean outputs over the sampled tokens (HC-SMoE's representations); `router cos` = mean
pairwise cosine of the experts' router-score vectors over all calibration tokens (M-SMoE's
similarity)."""


def _ratio(ci: dict) -> str:
    return _ci(ci, "{:.3f}", math.exp)


def _methods(m: dict) -> list[str]:
    return m["settings"]["methods"]


def _merges(m: dict) -> list[str]:
    return [x for x in _methods(m) if x in MERGES]


def _pair(m: dict, a: str, b: str, mean: bool | None = None) -> list[dict]:
    """Comparisons of a against b (mean: only the mean-over-domains rows, False: only domains)."""
    return [
        c
        for c in m["comparisons"]
        if c["a"] == a and c["b"] == b and (mean is None or (c["domain"] == "mean") == mean)
    ]


def _main(m: dict, mean: bool | None = None) -> list[dict]:
    """REAP against each merge method: the headline comparisons."""
    return [c for x in _merges(m) for c in _pair(m, "reap", x, mean)]


def _row(m: dict, method: str, budget: str) -> dict | None:
    return next(
        (r for r in m["builds"] if r["criterion"] == method and r["budget"] == budget), None
    )


def summary_rows(m: dict, budgets: list[str]) -> list[list[str]]:
    """Rows of the report's summary table: REAP / merged ppl (mean over domains) per budget."""
    by = {(c["b"], c["budget"]): c for c in _main(m, mean=True)}
    rows = []
    for x in _merges(m):
        cells = [
            f"**{by[(x, b)]['verdict']}**: {_ci(by[(x, b)]['log_diff'], '{:.2f}', math.exp)}"
            if (x, b) in by
            else ""
            for b in budgets
        ]
        rows.append([f"REAP pruning beats {x} merging (mean ppl ratio over domains)"] + cells)
    return rows


def quality_tables(m: dict, domains: list[str]) -> list[str]:
    """Per budget: each method's per-domain perplexity ratio to the full model, and agreement."""
    out = [
        "### Per-domain loss of the pruned and merged builds",
        "",
        (
            "Perplexity of each build / the full model's: geometric mean over seeds [95 % "
            "t-interval over seeds], as in the pruning study's tables; then top-1 agreement with "
            "the full model / KL (nats/token), mean over seeds."
        ),
        "",
    ]
    for b in m["settings"]["budgets"]:
        rows, agree = [], []
        for method in _methods(m):
            r = _row(m, method, b)
            if r is None:
                continue
            rows.append(
                [NAMES.get(method, method)]
                + [_ci(r["quality"][d]["log_ratio"], "{:.2f}", math.exp) for d in domains]
                + [_ci(r["mean_log_ratio"], "{:.2f}", math.exp)]
            )
            agree.append(
                [NAMES.get(method, method)]
                + [
                    f"{r['quality'][d]['agreement']['mean']:.3f} / {r['quality'][d]['kl']['mean']:.3f}"
                    for d in domains
                ]
            )
        out += [f"#### {_budget(m, b)}", ""]
        out += _table(["build", *domains, "mean over domains"], rows) + [""]
        out += _table(["build", *domains], agree) + [""]
    return out


def comparison_table(m: dict, domains: list[str]) -> list[str]:
    """The pruning-vs-merging table: REAP / merge perplexity per budget and domain."""
    merges = _merges(m)
    by = {(c["b"], c["budget"], c["domain"]): c for c in _main(m)}
    n = max((len(c["seeds"]) for c in _main(m)), default=0)
    head = ["budget", "domain"]
    for x in merges:
        head += [f"REAP / {x} ppl", "verdict"]
    rows = []
    for b in m["settings"]["budgets"]:
        for d in [*domains, "mean"]:
            row = [_budget(m, b) if d == domains[0] else "", f"**{d}**" if d == "mean" else d]
            for x in merges:
                c = by.get((x, b, d))
                row += ["n/a", ""] if c is None else [_ratio(c["log_diff"]), f"**{c['verdict']}**"]
            rows.append(row)
    return ["### Pruning vs merging", "", VERDICT_INTRO.format(n=n), ""] + _table(head, rows) + [""]


def verdict_lines(m: dict) -> list[str]:
    """The headline counts, where merging wins, and where it leans that way."""
    cs = _main(m, mean=False)
    if not cs:
        return []
    count = {v: sum(c["verdict"] == v for c in cs) for v in ("holds", "reversed", "inconclusive")}
    out = [
        (
            f"- Over {len(cs)} (method, budget, domain) comparisons: pruning prevails in "
            f"{count['holds']}, merging wins in {count['reversed']}, {count['inconclusive']} are "
            "inconclusive."
        )
    ]
    for c in _main(m, mean=True):
        out.append(
            f"- {_budget(m, c['budget'])}, {c['method']}, mean over domains: REAP / merged "
            f"ppl {_ratio(c['log_diff'])}, **{c['verdict']}**; top-1 agreement REAP minus "
            f"merged {_ci(c['agreement_diff'])}."
        )
    wins = [c for c in cs if c["verdict"] == "reversed"]
    out.append(
        "- Merging wins (interval above 1): "
        + (
            ", ".join(
                f"{c['method']} on {c['domain']} at {_budget(m, c['budget'])} "
                f"({_ratio(c['log_diff'])})"
                for c in wins
            )
            if wins
            else "nowhere"
        )
        + "."
    )
    lean = [c for c in cs if c["verdict"] == "inconclusive" and c["log_diff"]["mean"] > 0]
    if lean:
        out.append(
            "- Merging ahead on the mean but inconclusive: "
            + ", ".join(
                f"{c['method']} on {c['domain']} at {c['budget']} ({_ratio(c['log_diff'])})"
                for c in lean
            )
            + "."
        )
    match = m.get("pruning_study_match")
    if match and match["builds"]:
        out.append(
            f"- The {match['builds']} REAP builds here are the pruning study's "
            f"`full.reap` builds: same kept experts **{match['kept_equal']}**, per-domain "
            f"ppl ratios equal within {match['ppl_ratio_max_rel_diff']:.1e} (relative)."
        )
    return out + [""]


def task_lines(m: dict) -> list[str]:
    """The lm-eval task table (accuracy per method and budget)."""
    out = []
    for task, t in m.get("tasks", {}).items():
        rows = [
            [_budget(m, b)]
            + [
                _ci(t["rows"][f"{x}|{b}"], "{:.2f}") if f"{x}|{b}" in t["rows"] else "n/a"
                for x in _methods(m)
            ]
            for b in m["settings"]["budgets"]
        ]
        out += [
            "### Benchmark task",
            "",
            TASK_NOTE.format(
                task=task, n=t["samples"], ref=t["reference"], step=1 / max(1, t["samples"])
            ),
            "",
        ]
        out += _table(["budget", *(NAMES.get(x, x) for x in _methods(m))], rows) + [""]
    return out


def decomposition_lines(m: dict) -> list[str]:
    """REAP / merged = (REAP / the merge's dominants pruned) x (dominants pruned / merged): which
    experts keep their router rows, against what averaging the others into them costs."""
    rows = []
    for x in _merges(m):
        dom = f"{x}-dom"
        for b in m["settings"]["budgets"]:
            sel = next((c for c in _pair(m, "reap", dom, True) if c["budget"] == b), None)
            avg = next((c for c in _pair(m, dom, x, True) if c["budget"] == b), None)
            if sel is None or avg is None:
                continue
            hurt = sum(c["verdict"] == "holds" for c in _pair(m, dom, x, False) if c["budget"] == b)
            rows.append(
                [
                    x,
                    _budget(m, b),
                    f"{_ratio(sel['log_diff'])} **{sel['verdict']}**",
                    f"{_ratio(avg['log_diff'])} **{avg['verdict']}**",
                    f"{hurt} of 5",
                ]
            )
    if not rows:
        return []
    return (
        [
            "### Which experts, or the averaging?",
            "",
            (
                "A merged build keeps the router rows of its groups' dominant experts, so the same "
                "plan without the merge (`X-dom`: the dominants kept, the other members dropped) is "
                "a pruned build with the merged build's router. REAP / merged = (REAP / X-dom: which "
                "experts are kept) x (X-dom / merged: what averaging the other members into the "
                "dominants does, neurons aligned first for M-SMoE); below 1 = the first build "
                "better; mean over domains [interval over seeds]."
            ),
            "",
        ]
        + _table(
            [
                "method",
                "budget",
                "REAP / X-dom (which experts)",
                "X-dom / merged (averaging)",
                "domains where averaging hurts",
            ],
            rows,
        )
        + [""]
    )


def specialisation_lines(m: dict) -> list[str]:
    """Per seed: the specialisation measures (`merging.specialisation`), and how alike the
    experts each merge averages are (`merging.group_cosine`)."""
    budgets = m["settings"]["budgets"]
    rows = []
    for seed, sp in m["specialisation"].items():
        rows.append(
            [seed, f"{sp['freq_cv']:.3f}"]
            + [f"{sp['reap_kept'][b]:.3f} (random {sp['uniform'][b]:.3f})" for b in budgets]
            + [
                f"{sp.get('out_cos', float('nan')):.3f}",
                f"{sp.get('router_cos', float('nan')):.3f}",
            ]
        )
    head = [
        "seed",
        "freq CV",
        *(f"REAP mass kept, {b}" for b in budgets),
        "output cos",
        "router cos",
    ]
    out = [
        "### How specialised k3-mini's experts are",
        "",
        SPEC_INTRO.format(cal_set=m["settings"]["cal_set"]),
        "",
    ]
    out += _table(head, rows) + [""]
    member = _member_cos(m)
    if member:
        out += [
            "Cosine of each merged member's mean output with its group dominant's "
            "(weighted by merge weight, mean over seeds): "
            + "; ".join(f"{x} at {b}: {v:.3f}" for (x, b), v in member.items())
            + ". Near 1 would mean a merge averages near-identical functions.",
            "",
        ]
    return out


def _member_cos(m: dict) -> dict:
    """{(method, budget): mean member cosine over seeds}."""
    out: dict = {}
    for bid, g in m.get("group_cosine", {}).items():
        _, method, keep, _ = bid.split(".")
        b = next(b for b, k in m["keeps"].items() if f"k{k}" == keep)
        if g["member_cos"] is not None:
            out.setdefault((method, b), []).append(g["member_cos"])
    return {k: float(np.mean(v)) for k, v in out.items()}


def strength_needed(m: dict) -> dict:
    """Per budget: the smallest difference between two selections the seeds resolve (median
    half-width of the per-domain REAP / dominant-set intervals, or of REAP / merged without the
    controls; in log ppl), the log ppl one unit of dropped REAP mass costs (`sensitivity`), the
    REAP-mass difference that half-width corresponds to, and REAP's own advantage in kept mass
    over a random set (mean over seeds)."""
    out = {}
    sel = [c for x in _merges(m) for c in _pair(m, "reap", f"{x}-dom", False)]
    for b in m["settings"]["budgets"]:
        halves = [
            (c["log_diff"]["hi"] - c["log_diff"]["lo"]) / 2
            for c in sel or _main(m, False)
            if c["budget"] == b and c["log_diff"]["lo"] is not None
        ]
        sens = m.get("sensitivity", {}).get(b)
        excess = float(
            np.mean([s["reap_kept"][b] - s["uniform"][b] for s in m["specialisation"].values()])
        )
        if not halves:
            continue
        h = float(np.median(halves))
        slope = sens["slope"] if sens else None
        out[b] = {
            "half_width": h,
            "slope": slope,
            "excess": excess,
            "mass_needed": h / slope if slope and slope > 0 else None,
        }
    return out


def _vs_random(study: dict | None) -> str:
    """The pruning study's REAP-vs-random answers as text (empty without the study)."""
    crit = ((study or {}).get("answers") or {}).get("criteria", {})
    parts = [
        f"{_budget(study, b)}: REAP / random ppl "
        f"{_ratio(a['reap minus random']['ci'])}, {a['reap minus random']['verdict']}"
        for b, a in crit.items()
        if "reap minus random" in a
    ]
    return f" ({'; '.join(parts)})" if parts else ""


def _verdicts(cs: list[dict]) -> str:
    n = {v: sum(c["verdict"] == v for c in cs) for v in ("holds", "reversed", "inconclusive")}
    return f"{n['holds']} hold, {n['reversed']} reversed, {n['inconclusive']} inconclusive"


def reading_lines(m: dict, study: dict | None = None) -> list[str]:
    """What near-uniform experts mean for the study's comparisons, and what would be needed:
    sentences generated from the numbers."""
    sp = list(m["specialisation"].values())
    cv, rc = np.mean([s["freq_cv"] for s in sp]), np.mean([s.get("router_cos", np.nan) for s in sp])
    oc = np.mean([s.get("out_cos", np.nan) for s in sp])
    member = _member_cos(m)
    mc = float(np.mean(list(member.values()))) if member else float("nan")
    sel = [c for x in _merges(m) for c in _pair(m, "reap", f"{x}-dom", False)]
    avg = [c for x in _merges(m) for c in _pair(m, f"{x}-dom", x, False)]
    out = [
        "### What near-uniform experts mean for every comparison",
        "",
        (
            "From outside, k3-mini looks close to uniform across experts: in the pruning study "
            f"REAP's builds were no better than random ones{_vs_random(study)}; loss-free load "
            f"balancing keeps the routed counts even (freq CV {cv:.2f}), the top experts by REAP "
            "score hold little more than their share of the REAP mass (table above), and the "
            f"experts' router scores move together (mean cosine {rc:.2f}). That is uniform "
            "*importance*. It is not redundancy of *function*: the experts' mean outputs are "
            f"nearly orthogonal (mean pairwise cosine {oc:.2f}; {mc:.2f} between a merged member "
            "and its dominant), so a merge averages functions that are not alike."
        ),
        "",
    ]
    out += [_selection_bullet(sel), _averaging_bullet(avg, mc), ""]
    out += _strength_lines(m)
    return out


def _share(cs: list[dict], verdict: str) -> float:
    return sum(c["verdict"] == verdict for c in cs) / max(1, len(cs))


def _selection_bullet(sel: list[dict]) -> str:
    text = (
        "- Comparisons of *which* experts to keep (calibration set A against B; REAP against "
        "frequency, EAN, random and recon; here REAP against each merge's dominant set: "
        f"{_verdicts(sel)} over domains and budgets) differ only through importance"
    )
    if _share(sel, "inconclusive") >= 0.5:
        return text + (
            ", which is near-uniform: their effects are a few percent and mostly "
            "below what three seeds resolve."
        )
    return text + (
        ": even near-uniform importance separates REAP's set from the dominant sets "
        "here, mostly because the merge plans pick dominants by routed count alone."
    )


def _averaging_bullet(avg: list[dict], mc: float) -> str:
    text = (
        "- Comparisons of pruning against *merging* also differ through what averaging does "
        f"to the kept experts (dominants pruned against merged: {_verdicts(avg)}). "
    )
    if _share(avg, "holds") >= 0.5:
        return text + (
            f"With unlike experts (member cosine {mc:.2f}) averaging mixes into each kept expert "
            "functions the router never sent those tokens to, and the merged expert is none of "
            "its members: that loss is large and resolved, and it carries the headline verdicts. "
            "The expectation that near-uniform experts make merging harmless (merges averaging "
            "near-identical functions, differences shrinking toward noise) needs near-identical "
            "members (cosine near 1); k3-mini's uniformity is in how much each expert is used, "
            "not in what it computes."
        )
    return text + (
        "Averaging costs little or nothing resolvable here, as expected when merged "
        "experts are near-interchangeable, so the pruning-vs-merging difference is "
        "the selection difference above."
    )


def _strength_lines(m: dict) -> list[str]:
    need = strength_needed(m)
    rows = [
        [
            _budget(m, b),
            f"{math.exp(x['half_width']):.3f}",
            "n/a" if x["slope"] is None else f"{x['slope']:.2f}",
            "n/a" if x["mass_needed"] is None else f"{x['mass_needed']:.3f}",
            f"{x['excess']:.3f}",
        ]
        for b, x in need.items()
    ]
    out = [
        (
            "What model strength each kind of comparison needs, from the numbers here. A "
            "difference is resolved with three seeds when it exceeds the interval's half-width "
            "(median over domains of the intervals of REAP against the merges' dominant sets, the "
            "selection comparison made here; as a ppl factor). In the pruning "
            "study's builds at one budget, one unit of REAP mass dropped (the share of a layer's "
            "summed REAP score; the predicted damage) costs `slope` in log ppl (least squares over "
            "builds and domains, centred per domain), so two *selections* must differ by about "
            "half-width / slope in the REAP mass they keep to be told apart; REAP's own selection "
            "keeps `REAP - random` more than a random set:"
        ),
        "",
    ]
    out += _table(
        [
            "budget",
            "resolvable ppl factor",
            "slope (log ppl per unit mass)",
            "mass difference needed",
            "REAP - random kept mass (k3-mini)",
        ],
        rows,
    ) + [""]
    ok = {b: x for b, x in need.items() if x["mass_needed"] and x["excess"] > 0}
    if ok:
        factor = max(x["mass_needed"] / x["excess"] for x in ok.values())
        low = min(x["excess"] / x["mass_needed"] for x in ok.values())
        edge = "below" if low < 0.8 else "at the edge of" if low < 2 else "above"
        cv = np.mean([s["freq_cv"] for s in m["specialisation"].values()])
        out += [
            "REAP's margin over a random set is "
            + ", ".join(
                f"{x['excess'] / x['mass_needed']:.1f} x the resolvable difference at {b}"
                for b, x in ok.items()
            )
            + f": even the selection difference of REAP against random sits {edge} what three "
            "seeds resolve. Verdicts between criteria or calibration sets, which differ from "
            "each other by a fraction of that margin, need a model whose REAP margin over random "
            f"sets is several times k3-mini's ({factor:.1f} x k3-mini's only reaches the edge "
            "at every budget), i.e. routed mass concentrated on fewer experts, a routed-count "
            f"spread well above k3-mini's CV of {cv:.2f}. Only then would the excess "
            "overlaps the study found (European pairs sharing experts, zh-code fewer than "
            "chance) show up in the builds. Pruning against merging needs "
            "no such strength when, as here, the averaged experts are unlike each other.",
            "",
        ]
    return out + _seeds_lines(m) + [""]


def _seeds_lines(m: dict) -> list[str]:
    """For the mean-over-domains comparisons: calibration seeds needed to resolve the observed
    mean at the observed spread."""
    cs = _main(m, mean=True)
    if not cs:
        return []
    parts = [
        f"{c['method']} at {c['budget']}: "
        f"{c['seeds_needed'] if c.get('seeds_needed') else '> 1000'}"
        for c in cs
    ]
    return [
        "Seeds needed for a 95 % t-interval to exclude 1 at the observed mean and spread "
        "(REAP / merged, mean over domains): " + "; ".join(parts) + "."
    ]


def merging_section(m: dict, study: dict | None = None) -> list[str]:
    """The whole section as markdown lines; `study` (the pruning study's results.json, optional)
    adds its REAP-vs-random answers to the reading."""
    s = m["settings"]
    domains = (study or {}).get("domains") or ["zh", "en", "eu", "ja", "code"]
    intro = INTRO.format(
        ms=s["merge_stats"],
        seqs=s["calib_seqs"],
        seq_len=s["seq_len"],
        cal_set=s["cal_set"],
        docs=s["max_docs"],
        toks=s["doc_tokens"],
        seeds=", ".join(map(str, s["seeds"])),
        build_min=m["build_seconds"] / 60,
        cal_min=sum(m["calibration_seconds"]) / 60,
        n_builds=m["n_builds"],
        router=m.get("router_rule", "not recorded"),
    )
    lines = ["## Pruning against merging", "", intro, ""]
    lines += comparison_table(m, domains) + verdict_lines(m) + decomposition_lines(m)
    lines += quality_tables(m, domains) + task_lines(m)
    lines += specialisation_lines(m) + reading_lines(m, study)
    return lines
