"""The report's "Pruning against merging" section (issue #31 part 3), from
reports/corpus-study/merging.json alone (`experiments.corpus_study.merging` writes it;
`experiments.corpus_study.report` calls `merging_section` when the file is there)."""

from __future__ import annotations

import math

import numpy as np

from experiments.corpus_study.report import _budget, _ci, _table

NAMES = {"reap": "REAP (pruned)", "hc-smoe": "HC-SMoE (merged)", "m-smoe": "M-SMoE (merged)"}

INTRO = """The paper behind this toolkit (REAP the Experts, arXiv 2510.13999) finds that pruning
prevails over expert merging for one-shot compression. Here the claim is tested on k3-mini with
the toolkit's own merged builds (`reap plan --method hc-smoe|m-smoe`, `reap prune`): per
calibration seed of the study, one `reap calibrate --merge-stats {ms}` run over the same
tokens as the pruning study (all eight corpora, {seqs} x {seq_len} tokens each, the same
sequences), then on the `{cal_set}` set and at the study's budgets a REAP-pruned build (the
study's plan), an HC-SMoE-merged and an M-SMoE-merged build with the same number of experts per
layer, evaluated like the study's builds (the same {docs} eval documents per domain, {toks}
tokens each). Reproduce: `python -m experiments.corpus_study --merging` (work files in
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


def _row(m: dict, method: str, budget: str) -> dict | None:
    return next((r for r in m["builds"] if r["criterion"] == method and r["budget"] == budget),
                None)


def summary_rows(m: dict, budgets: list[str]) -> list[list[str]]:
    """Rows of the report's summary table: REAP / merged ppl (mean over domains) per budget."""
    by = {(c["method"], c["budget"]): c for c in m["comparisons"] if c["domain"] == "mean"}
    rows = []
    for x in [x for x in _methods(m) if x != "reap"]:
        cells = [f"**{by[(x, b)]['verdict']}**: {_ci(by[(x, b)]['log_diff'], '{:.2f}', math.exp)}"
                 if (x, b) in by else "" for b in budgets]
        rows.append([f"REAP pruning beats {x} merging (mean ppl ratio over domains)"] + cells)
    return rows


def quality_tables(m: dict, domains: list[str]) -> list[str]:
    """Per budget: each method's per-domain perplexity ratio to the full model, and agreement."""
    out = ["### Per-domain loss of the pruned and merged builds", "",
           "Perplexity of each build / the full model's: geometric mean over seeds [95 % "
           "t-interval over seeds], as in the pruning study's tables; then top-1 agreement with "
           "the full model / KL (nats/token), mean over seeds.", ""]
    for b in m["settings"]["budgets"]:
        rows, agree = [], []
        for method in _methods(m):
            r = _row(m, method, b)
            if r is None:
                continue
            rows.append([NAMES.get(method, method)]
                        + [_ci(r["quality"][d]["log_ratio"], "{:.2f}", math.exp) for d in domains]
                        + [_ci(r["mean_log_ratio"], "{:.2f}", math.exp)])
            agree.append([NAMES.get(method, method)] + [
                f"{r['quality'][d]['agreement']['mean']:.3f} / {r['quality'][d]['kl']['mean']:.3f}"
                for d in domains])
        out += [f"#### {_budget(m, b)}", ""]
        out += _table(["build", *domains, "mean over domains"], rows) + [""]
        out += _table(["build", *domains], agree) + [""]
    return out


def comparison_table(m: dict, domains: list[str]) -> list[str]:
    """The pruning-vs-merging table: REAP / merge perplexity per budget and domain."""
    merges = [x for x in _methods(m) if x != "reap"]
    by = {(c["method"], c["budget"], c["domain"]): c for c in m["comparisons"]}
    n = max((len(c["seeds"]) for c in m["comparisons"]), default=0)
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
    cs = [c for c in m["comparisons"] if c["domain"] != "mean"]
    if not cs:
        return []
    count = {v: sum(c["verdict"] == v for c in cs) for v in ("holds", "reversed", "inconclusive")}
    out = [f"- Over {len(cs)} (method, budget, domain) comparisons: pruning prevails in "
           f"{count['holds']}, merging wins in {count['reversed']}, {count['inconclusive']} are "
           "inconclusive."]
    for c in [c for c in m["comparisons"] if c["domain"] == "mean"]:
        out.append(f"- {_budget(m, c['budget'])}, {c['method']}, mean over domains: REAP / merged "
                   f"ppl {_ratio(c['log_diff'])}, **{c['verdict']}**; top-1 agreement REAP minus "
                   f"merged {_ci(c['agreement_diff'])}.")
    wins = [c for c in cs if c["verdict"] == "reversed"]
    out.append("- Merging wins (interval above 1): " + (", ".join(
        f"{c['method']} on {c['domain']} at {_budget(m, c['budget'])} "
        f"({_ratio(c['log_diff'])})" for c in wins) if wins else "nowhere") + ".")
    lean = [c for c in cs if c["verdict"] == "inconclusive" and c["log_diff"]["mean"] > 0]
    if lean:
        out.append("- Merging ahead on the mean but inconclusive: " + ", ".join(
            f"{c['method']} on {c['domain']} at {c['budget']} ({_ratio(c['log_diff'])})"
            for c in lean) + ".")
    match = m.get("pruning_study_match")
    if match and match["builds"]:
        out.append(f"- The {match['builds']} REAP builds here are the pruning study's "
                   f"`full.reap` builds: same kept experts **{match['kept_equal']}**, per-domain "
                   f"ppl ratios equal within {match['ppl_ratio_max_rel_diff']:.1e} (relative).")
    return out + [""]


def task_lines(m: dict) -> list[str]:
    """The lm-eval task table (accuracy per method and budget)."""
    out = []
    for task, t in m.get("tasks", {}).items():
        rows = [[_budget(m, b)] + [_ci(t["rows"][f"{x}|{b}"], "{:.2f}") if f"{x}|{b}" in t["rows"]
                                   else "n/a" for x in _methods(m)]
                for b in m["settings"]["budgets"]]
        out += ["### Benchmark task", "", TASK_NOTE.format(
            task=task, n=t["samples"], ref=t["reference"], step=1 / max(1, t["samples"])), ""]
        out += _table(["budget", *(NAMES.get(x, x) for x in _methods(m))], rows) + [""]
    return out


def specialisation_lines(m: dict) -> list[str]:
    """Per seed: the specialisation measures (`merging.specialisation`)."""
    budgets = m["settings"]["budgets"]
    rows = []
    for seed, sp in m["specialisation"].items():
        rows.append([seed, f"{sp['freq_cv']:.3f}"]
                    + [f"{sp['reap_kept'][b]:.3f} (random {sp['uniform'][b]:.3f})" for b in budgets]
                    + [f"{sp.get('out_cos', float('nan')):.3f}",
                       f"{sp.get('router_cos', float('nan')):.3f}"])
    head = ["seed", "freq CV", *(f"REAP mass kept, {b}" for b in budgets), "output cos",
            "router cos"]
    out = ["### How specialised k3-mini's experts are", "",
           SPEC_INTRO.format(cal_set=m["settings"]["cal_set"]), ""]
    return out + _table(head, rows) + [""]


def strength_needed(m: dict) -> dict:
    """Per budget: the smallest REAP / merged difference the seeds resolve (median half-width of
    the per-domain intervals, in log ppl), the log ppl one unit of dropped REAP mass costs
    (`sensitivity`), the REAP-mass difference that half-width corresponds to, and REAP's own
    advantage in kept mass over a random set (mean over seeds)."""
    out = {}
    for b in m["settings"]["budgets"]:
        halves = [(c["log_diff"]["hi"] - c["log_diff"]["lo"]) / 2 for c in m["comparisons"]
                  if c["budget"] == b and c["domain"] != "mean" and c["log_diff"]["lo"] is not None]
        sens = m.get("sensitivity", {}).get(b)
        sp = m["specialisation"].values()
        excess = float(np.mean([s["reap_kept"][b] - s["uniform"][b] for s in sp]))
        if not halves:
            continue
        h = float(np.median(halves))
        slope = sens["slope"] if sens else None
        out[b] = {"half_width": h, "slope": slope, "excess": excess,
                  "mass_needed": h / slope if slope and slope > 0 else None}
    return out


def _vs_random(study: dict | None) -> str:
    """The pruning study's REAP-vs-random answers as text (empty without the study)."""
    crit = ((study or {}).get("answers") or {}).get("criteria", {})
    parts = [f"{_budget(study, b)}: REAP / random ppl "
             f"{_ratio(a['reap minus random']['ci'])}, {a['reap minus random']['verdict']}"
             for b, a in crit.items() if "reap minus random" in a]
    return f" ({'; '.join(parts)})" if parts else ""


def reading_lines(m: dict, study: dict | None = None) -> list[str]:
    """What near-uniform experts mean for the study's comparisons, and what would be needed."""
    need = strength_needed(m)
    sp = list(m["specialisation"].values())
    cv = np.mean([s["freq_cv"] for s in sp])
    rc = np.mean([s.get("router_cos", float("nan")) for s in sp])
    out = ["### What near-uniform experts mean for every comparison", "",
           "From outside, k3-mini looks close to uniform across experts: in the pruning study, "
           f"REAP's builds were no better than random ones{_vs_random(study)}, and its "
           "loss-free load balancing pushes every expert toward equal load (freq CV "
           f"{cv:.2f} here; mean router-score cosine between experts {rc:.2f}). When experts are near-interchangeable, which ones "
           "a build keeps matters little (so REAP vs frequency, EAN, random and recon, and "
           "calibration set A vs B, all measure small differences), a merge averages functions "
           "that differ little and pruning drops functions that the survivors nearly cover, so "
           "both kinds of build lose about the same and the pruning-vs-merging difference "
           "shrinks toward the seed-to-seed noise of the calibration sample. The budget, not "
           "the method or the calibration set, then sets the loss: at every budget the three "
           "methods lie within a few percent of each other while the budgets differ by tens of "
           "percent. An inconclusive verdict here therefore says the comparison lacks power on "
           "this model, not that the methods are equal on a model with specialised experts.", ""]
    rows = []
    for b, x in need.items():
        rows.append([_budget(m, b), f"{math.exp(x['half_width']):.3f}",
                     "n/a" if x["slope"] is None else f"{x['slope']:.2f}",
                     "n/a" if x["mass_needed"] is None else f"{x['mass_needed']:.3f}",
                     f"{x['excess']:.3f}"])
    out += ["What strength the comparison needs, from the numbers here: a difference is resolved "
            "with these seeds only when it exceeds the interval's half-width (median over domains "
            "and both methods, as a ppl factor). In the pruning study's builds at one budget, "
            "one unit of REAP mass dropped (share of the layer's summed REAP score, predicted "
            "damage) costs `slope` in log ppl (least-squares over builds and domains, centred "
            "per domain); so two builds must differ by about half-width / slope in the REAP mass "
            "they preserve to be told apart. REAP's own selection holds only `REAP - random` "
            "more mass than a random set of the same size:", ""]
    out += _table(["budget", "resolvable ppl factor", "slope (log ppl per unit mass)",
                   "mass difference needed", "REAP - random kept mass (k3-mini)"], rows) + [""]
    out += _needed_sentence(need) + _seeds_lines(m) + [""]
    return out


def _needed_sentence(need: dict) -> list[str]:
    ok = {b: x for b, x in need.items() if x["mass_needed"] is not None}
    if not ok:
        return []
    fac = {b: x["mass_needed"] / x["excess"] for b, x in ok.items() if x["excess"] > 0}
    parts = ", ".join(f"{b}: {f:.1f} x" for b, f in fac.items())
    return [f"A decisive comparison at these seed counts needs a model whose REAP-chosen experts "
            f"hold that much more of the REAP mass than random ones, i.e. a concentration of "
            f"routed mass on few experts several times k3-mini's ({parts} its REAP - random "
            "margin): expert specialisation of the kind the study's excess-overlap answers "
            "(European pairs share more experts than chance, zh-code fewer) show only weakly "
            "here. This slope is a proxy: merging does not drop mass, and how much it loses "
            "depends on how different the averaged experts are (output and router cosines above)."]


def _seeds_lines(m: dict) -> list[str]:
    """For the mean-over-domains comparisons: calibration seeds needed to resolve the observed
    mean at the observed spread."""
    cs = [c for c in m["comparisons"] if c["domain"] == "mean"]
    if not cs:
        return []
    parts = [f"{c['method']} at {c['budget']}: "
             f"{c['seeds_needed'] if c.get('seeds_needed') else '> 1000'}" for c in cs]
    return ["", "Seeds needed for a 95 % t-interval to exclude 1 at the observed mean and "
            "spread (mean over domains): " + "; ".join(parts) + "."]


def merging_section(m: dict, study: dict | None = None) -> list[str]:
    """The whole section as markdown lines; `study` (the pruning study's results.json, optional)
    adds its REAP-vs-random answers to the reading."""
    s = m["settings"]
    domains = (study or {}).get("domains") or ["zh", "en", "eu", "ja", "code"]
    intro = INTRO.format(ms=s["merge_stats"], seqs=s["calib_seqs"], seq_len=s["seq_len"],
                         cal_set=s["cal_set"], docs=s["max_docs"], toks=s["doc_tokens"],
                         seeds=", ".join(map(str, s["seeds"])),
                         build_min=m["build_seconds"] / 60,
                         cal_min=sum(m["calibration_seconds"]) / 60, n_builds=m["n_builds"],
                         router=m.get("router_rule", "not recorded"))
    lines = ["## Pruning against merging", "", intro, ""]
    lines += comparison_table(m, domains) + verdict_lines(m)
    lines += quality_tables(m, domains) + task_lines(m)
    lines += specialisation_lines(m) + reading_lines(m, study)
    return lines
