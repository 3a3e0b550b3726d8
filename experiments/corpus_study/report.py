"""The markdown report and plots of the corpus study, from its results.json alone.

    python -m experiments.corpus_study.report                # reports/corpus-study/results.json
    python -m experiments.corpus_study.report --results R.json --report R.md

Every number in the report is read from the results file (written by
`python -m experiments.corpus_study`); the only hand-written text, the framing and the limits, is
in `experiments.corpus_study.prose`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from experiments.corpus_study import ROOT
from experiments.corpus_study.prose import (
    ANSWERS_INTRO,
    CRIT_INTRO,
    GEN_INTRO,
    INTRO,
    LIMITS,
    METHOD,
    OVERLAP_INTRO,
    QUALITY_INTRO,
    SUMMARY_INTRO,
    TITLE,
)

BUDGET_NAMES = {"k3": "K3 350 GB share"}


def _budget(results: dict, b: str) -> str:
    k, n = results["keeps"][b], results["n_experts"]
    return f"{BUDGET_NAMES.get(b, b)} ({k}/{n} = {100 * k / n:.1f} % kept)"


def _ci(ci: dict, fmt: str = "{:.3f}", f=lambda x: x) -> str:
    if ci["mean"] is None:
        return "n/a"
    if ci["lo"] is None:
        return fmt.format(f(ci["mean"]))
    return f"{fmt.format(f(ci['mean']))} [{fmt.format(f(ci['lo']))}, {fmt.format(f(ci['hi']))}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _answer_rows(block: dict, exp: bool) -> list[list[str]]:
    rows = []
    for name, a in block.items():
        if not isinstance(a, dict) or "ci" not in a:
            continue
        ratio = _ci(a["ci"], "{:.2f}", math.exp) if exp else ""
        rows.append([name, _ci(a["ci"]), ratio, f"**{a['verdict']}**"])
    return rows


# fmt: off
CLAIMS = [  # (claim of the K3 study, where its effect is, key, shown as a ratio)
    ("en+code build loses Chinese (zh ppl vs the full-mix build)", "budgets",
     "en+code loses zh (vs full)", True),
    ("... and starts repeating (zh looping rate vs the full-mix build)", "generations",
     "en+code vs full: zh looping", False),
    ("zh build loses code (code ppl vs the full-mix build)", "budgets",
     "zh loses code (vs full)", True),
    ("zh+code keeps Chinese (zh ppl vs the en+code build)", "budgets",
     "zh+code beats en+code on zh", True),
    ("zh+code keeps code (code ppl vs the zh build)", "budgets", "zh+code beats zh on code", True),
    ("European languages share experts (excess Jaccard of de/fr/es/it pairs)", "overlap",
     "european pairs: excess jaccard", False),
    ("Chinese overlaps code less than chance (excess Jaccard zh-code)", "overlap",
     "zh-code: excess jaccard", False),
    ("... and less than code overlaps the other corpora (zh-code minus code's other pairs)",
     "overlap", "zh-code minus code's other pairs", False),
]
# fmt: on


def _claim_cells(r: dict, where: str, key: str, exp: bool) -> list[str]:
    a = r["answers"]
    blocks = [a[b] for b in r["settings"]["budgets"]] if where == "budgets" else [a[where]]
    cells = []
    for blk in blocks:
        x = blk.get(key)
        cells.append(
            "-"
            if x is None
            else f"**{x['verdict']}**: "
            + _ci(x["ci"], "{:.2f}" if exp else "{:.3f}", math.exp if exp else _same)
        )
    return cells + [""] * (len(r["settings"]["budgets"]) - len(cells))


def _same(x: float) -> float:
    return x


def summary_section(r: dict, merging: dict | None = None) -> list[str]:
    """One row per claim of the K3 pruning study: verdict and effect at each budget (and, with
    the merging comparison's results, REAP against each merge method)."""
    budgets = [_budget(r, b) for b in r["settings"]["budgets"]]
    rows = [[claim] + _claim_cells(r, where, key, exp) for claim, where, key, exp in CLAIMS]
    for b, blk in r["answers"]["criteria"].items():
        for name, x in blk.items():
            if name.startswith("reap minus"):
                cells = [""] * len(budgets)
                cells[r["settings"]["budgets"].index(b) if b in r["settings"]["budgets"] else 0] = (
                    f"**{x['verdict']}**: " + _ci(x["ci"], "{:.2f}", math.exp)
                )
                rows.append(
                    [f"REAP beats {name.split()[-1]} (mean ppl ratio over domains)"] + cells
                )
    if merging is not None:
        from experiments.corpus_study.report_merging import summary_rows

        rows += summary_rows(merging, r["settings"]["budgets"])
    return ["## Summary", "", SUMMARY_INTRO, ""] + _table(["claim"] + budgets, rows) + [""]


def reading_section(r: dict) -> list[str]:
    """What the tables say, in sentences generated from the results."""
    out = ["## Reading", ""]
    for b in r["settings"]["budgets"]:
        rows = [x for x in r["builds"] if x["criterion"] == "reap" and x["budget"] == b]
        ratio = {
            (x["set"], d): math.exp(x["quality"][d]["log_ratio"]["mean"])
            for x in rows
            for d in r["domains"]
        }
        spread = {
            d: max(v for (s, e), v in ratio.items() if e == d)
            / min(v for (s, e), v in ratio.items() if e == d)
            for d in r["domains"]
        }
        d = max(spread, key=spread.get)
        out.append(
            f"- {_budget(r, b)}: every REAP build's perplexity is "
            f"{min(ratio.values()):.2f}-{max(ratio.values()):.2f} x the full model's on "
            f"every domain; the calibration set moves a domain's ratio by a factor of at "
            f"most {spread[d]:.2f} (on {d})."
        )
    verdicts = {}
    for claim, where, key, _ in CLAIMS:
        blocks = (
            [r["answers"][b] for b in r["settings"]["budgets"]]
            if where == "budgets"
            else [r["answers"][where]]
        )
        verdicts[claim] = [blk[key]["verdict"] for blk in blocks if key in blk]
    held = [c for c, v in verdicts.items() if "holds" in v]
    rest = [c for c, v in verdicts.items() if "holds" not in v]
    out += [
        "- Holds at some budget (95 % interval over seeds on the predicted side of zero): "
        + ("; ".join(held) or "none")
        + ".",
        "- Not shown at any budget: " + ("; ".join(rest) or "none") + ".",
    ]
    return out + [""]


def answers_section(r: dict) -> list[str]:
    """The questions of the issue with their effects, intervals and verdicts."""
    a = r["answers"]
    out = ["## Answers", "", ANSWERS_INTRO, ""]
    for b in r["settings"]["budgets"]:
        out += [f"### Perplexity effects at {_budget(r, b)}", ""]
        hdr = ["effect", "difference of log ppl ratios", "as a ppl ratio", "verdict"]
        out += _table(hdr, _answer_rows(a[b], True)) + [""]
    out += ["### Generations (greedy, first budget)", ""]
    hdr = ["effect (build A minus build B)", "difference", "", "verdict"]
    out += _table(hdr, _answer_rows(a["generations"], False)) + [""]
    out += ["### Expert overlap (count criterion, top-m sets)", ""]
    hdr = ["effect", "observed minus chance Jaccard", "", "verdict"]
    out += _table(hdr, _answer_rows(a["overlap"], False))
    ps = ", ".join(f"{p:.2g}" for p in a["overlap"]["zh-code: exact p_less per seed"])
    out += [
        "",
        (
            f"Exact one-sided p-values (fewer shared experts than chance, all layers) for "
            f"zh-code, one per seed: {ps}."
        ),
        "",
    ]
    return out


def overlap_section(r: dict, plot: str | None) -> list[str]:
    """Observed / chance Jaccard of top-m sets for every corpus pair, and the key rows."""
    m = str(r["overlap_m"][0])
    cell = r["overlap_matrix"]["count"][m]
    names = r["corpora"]
    rows = [
        [a] + [f"{cell['ratio'][i][j]:.2f}" if i != j else "-" for j in range(len(names))]
        for i, a in enumerate(names)
    ]
    out = ["## Which experts the corpora share", "", OVERLAP_INTRO.format(m=m), ""]
    out += _table(["observed / chance"] + names, rows) + [""]
    if plot:
        out += [f"![overlap]({plot})", ""]
    out += [
        (
            "Chance-expected Jaccard for these set sizes: "
            f"{cell['expected'][0][1]:.3f} (zh-en; ties can enlarge a set slightly)."
        ),
        "",
    ]
    rows = []
    for seed, rs in r["overlap_rows"].items():
        for x in rs:
            if (
                x["criterion"] == "count"
                and str(x["m"]) == m
                and {x["corpus_a"], x["corpus_b"]}
                in ({"zh", "code"}, {"de", "fr"}, {"es", "it"}, {"en", "code"}, {"zh", "ja"})
            ):
                rows.append(
                    [
                        f"{x['corpus_a']}-{x['corpus_b']}",
                        seed,
                        f"{x['mean_jaccard']:.3f}",
                        f"{x['mean_expected']:.3f}",
                        f"{x['p_less']:.2g}",
                        f"{x['p_greater']:.2g}",
                        x["layers_above"],
                        x["layers_below"],
                    ]
                )
    hdr = [
        "pair",
        "seed",
        "Jaccard",
        "chance",
        "p (less)",
        "p (more)",
        "layers more",
        "layers less",
    ]
    return out + _table(hdr, sorted(rows)) + [""]


def quality_section(r: dict, plot: str | None) -> list[str]:
    """Per-domain perplexity ratio to the full model, every REAP build and budget."""
    out = ["## Per-domain loss of every build", "", QUALITY_INTRO, ""]
    ref = r["reference_loss"]
    out += [
        "Full model loss (nats/token) on the eval documents: "
        + ", ".join(f"{d} {ref[d]:.3f}" for d in r["domains"])
        + ".",
        "",
    ]
    for b in r["settings"]["budgets"]:
        rows = [
            [x["set"]]
            + [_ci(x["quality"][d]["log_ratio"], "{:.2f}", math.exp) for d in r["domains"]]
            for x in r["builds"]
            if x["criterion"] == "reap" and x["budget"] == b
        ]
        out += [f"### {_budget(r, b)}", ""] + _table(["build"] + r["domains"], rows) + [""]
    if plot:
        out += [f"![per-domain perplexity ratios]({plot})", ""]
    b = r["settings"]["budgets"][0]
    rows = []
    for x in r["builds"]:
        if x["criterion"] == "reap" and x["budget"] == b:
            q = x["quality"]
            rows.append(
                [x["set"]]
                + [
                    f"{q[d]['agreement']['mean']:.3f} / {q[d]['kl']['mean']:.3f}"
                    for d in r["domains"]
                ]
            )
    out += (
        [
            (
                f"Top-1 agreement / KL (nats/token) with the full model at {_budget(r, b)}, mean over "
                "seeds:"
            ),
            "",
        ]
        + _table(["build"] + r["domains"], rows)
        + [""]
    )
    rows = [
        [x["set"]]
        + [
            ", ".join(f"[{lo:.2f}, {hi:.2f}]" for lo, hi in x["quality"][d]["doc_ci"])
            for d in ("zh", "code")
        ]
        for x in r["builds"]
        if x["criterion"] == "reap" and x["budget"] == b
    ]
    out += (
        [
            (
                "Bootstrap 95 % intervals over eval documents of the perplexity ratio, one per seed "
                f"({_budget(r, b)}):"
            ),
            "",
        ]
        + _table(["build", "zh", "code"], rows)
        + [""]
    )
    return out


def generation_section(r: dict) -> list[str]:
    """Repetition, script and Python-validity metrics of the greedy generations."""
    g = r["generations"]
    if not g["builds"]:
        return []
    out = ["## Generations", "", GEN_INTRO.format(n=r["settings"]["gen_tokens"]), ""]
    metrics = ("looping", "longest_repeat", "distinct_2", "script", "python_valid")
    for d in g["reference"]:
        rows = [["full model"] + [_fmt(g["reference"][d][m]) for m in metrics]]
        rows += [
            [s] + [_ci(v[d][m], "{:.2f}") if v[d][m]["mean"] is not None else "-" for m in metrics]
            for s, v in g["builds"].items()
        ]
        out += [f"### {d} prompts", ""] + _table(["build", *metrics], rows) + [""]
    for s, ex in r["examples"].items():
        for d in ("zh", "code"):
            if d in ex:
                e = ex[d]
                out += [
                    (
                        f"- `{s}` on {d}: prompt `{_q(e['prompt'])}` -> full model "
                        f"`{_q(e['reference'])}`; build `{_q(e['build'])}`"
                    )
                ]
    return out + [""]


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _q(text: str) -> str:
    return text.replace("\n", "\\n").replace("`", "'").replace("|", "\\|")[:120]


def criteria_section(r: dict, plot: str | None) -> list[str]:
    """REAP vs frequency vs EAN vs random at the same budgets."""
    a = r["answers"]["criteria"]
    out = [
        "## REAP against other criteria",
        "",
        CRIT_INTRO.format(s=r["settings"]["criteria_set"], p=r.get("protected_experts", "?")),
        "",
    ]
    for b, blk in a.items():
        rows = [
            [c, _ci(ci), _ci(ci, "{:.2f}", math.exp)] for c, ci in blk["mean_log_ratio"].items()
        ]
        out += [f"### {_budget(r, b)}", ""]
        out += _table(["criterion", "mean log ppl ratio", "geometric-mean ppl ratio"], rows)
        out += (
            [""]
            + _table(
                ["difference", "log ppl ratio", "as a ratio", "verdict"], _answer_rows(blk, True)
            )
            + [""]
        )
    if plot:
        out += [f"![criteria]({plot})", ""]
    return out


def kept_section(r: dict) -> list[str]:
    """Jaccard between the REAP builds' kept sets, vs chance."""
    b = r["settings"]["budgets"][0]
    cells, sets = r["kept_overlap"][b], r["settings"]["sets"]
    rows = [[a] + [f"{cells[f'{a}|{c}']['jaccard']:.2f}" for c in sets] for a in sets]
    exp = cells[f"{sets[0]}|{sets[0]}"]["expected"]
    return (
        [
            "## Kept sets of the builds",
            "",
            (
                f"Jaccard of the kept experts between REAP builds at {_budget(r, b)}, mean over layers "
                f"and seeds (chance for two random sets of that size: {exp:.3f}):"
            ),
            "",
        ]
        + _table(["kept by"] + sets, rows)
        + [""]
    )


def method_section(r: dict) -> list[str]:
    s, eq = r["settings"], r["equivalence_check"]
    out = [
        "## Method",
        "",
        METHOD.format(
            seeds=len(s["seeds"]),
            seqs=s["calib_seqs"],
            seq_len=s["seq_len"],
            tok=s["calib_seqs"] * s["seq_len"],
            docs=s["max_docs"],
            dtok=s["doc_tokens"],
            gen=s["gen_tokens"],
            gd=", ".join(s["gen_domains"]),
            boot=s["bootstrap"],
            budgets=", ".join(_budget(r, b) for b in s["budgets"]),
            sets=", ".join(
                f"`{k}` = {'+'.join(v)}" for k, v in r["sets"].items() if k in s["sets"]
            ),
            model=r["model"]["path"],
            fp=r["model"]["fingerprint"][:12],
            code=r["code_version"],
            minutes=r["build_seconds"] / 60,
        ),
        "",
    ]
    if eq:
        out += [
            (
                f"Equivalence check (seed {eq['seed']}): `en+code` calibrated on its own gives "
                f"counts equal to the mixed run's: **{eq['counts_equal']}**; REAP sums differ by "
                f"at most {eq['reap_sum_max_rel_diff']:.1e} (relative); the same kept experts: "
                f"**{eq['kept_sets_equal']}**."
            ),
            "",
        ]
    return out


def write_report(results: dict, out_dir: Path, report: Path) -> str:
    """Plots under out_dir and the markdown at `report`; returns the report path."""
    from experiments.corpus_study.plots import write_plots
    from experiments.corpus_study.report_predict import (
        predictor_section,
        recon_section,
        scatter_plot,
    )
    from reap.fileio import write_atomic

    plots = write_plots(results, Path(out_dir), Path(report).parent)
    path = Path(out_dir) / "merging.json"  # the pruning-vs-merging comparison, when run
    merging = json.loads(path.read_text()) if path.exists() else None
    lines = [f"# {TITLE}", "", INTRO, ""]
    lines += (
        summary_section(results, merging)
        + reading_section(results)
        + answers_section(results)
        + overlap_section(results, plots["overlap"])
    )
    lines += quality_section(results, plots["quality"]) + generation_section(results)
    lines += criteria_section(results, plots["criteria"])
    if merging is not None:
        from experiments.corpus_study.report_merging import merging_section

        lines += merging_section(merging, results)
    rel = Path(os.path.relpath(Path(out_dir).resolve(), Path(report).parent.resolve())).as_posix()
    scatter = scatter_plot(results, Path(out_dir), rel)
    lines += recon_section(results, _budget) + predictor_section(results, scatter, _budget)
    lines += kept_section(results)
    lines += method_section(results) + ["## Limits", "", LIMITS, ""]
    return write_atomic(report, "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.corpus_study.report",
        description="write the corpus study's report from results.json",
    )
    p.add_argument("--results", default=str(ROOT / "reports" / "corpus-study" / "results.json"))
    p.add_argument("--report", default=str(ROOT / "reports" / "corpus-study.md"))
    a = p.parse_args(argv)
    results = json.loads(Path(a.results).read_text())
    print(write_report(results, Path(a.results).parent, Path(a.report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
