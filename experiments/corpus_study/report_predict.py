"""The report's sections on the plan predictor and the recon criterion (issue #16), and the
predictor's scatter plot, from results.json alone (`experiments.corpus_study.report` calls
them)."""

from __future__ import annotations

import math
from pathlib import Path

PRED_INTRO = """Before anything is built, `reap plan` predicts per corpus what a plan keeps
(`reap.prune.predict`): the share of the corpus's routed gate mass, of its REAP mass (routing
weight x expert output norm) and of its tokens whose whole top-k survives, per layer. The
predicted-damage index is the REAP mass lost, 1 - mean over layers of the kept share, with a
95 % bootstrap interval over the corpus's calibration sequences. Here every build's kept sets
are scored on the five domains' statistics of its seed and compared with what the build
measured on the same domain: Spearman rank correlation of predicted damage with log(perplexity
ratio) and with KL to the full model, over (build, domain) pairs, with a 95 % percentile
bootstrap over builds. Pooled over budgets the correlation mostly measures that fewer experts
hurt more; within one budget it asks whether the predictor orders calibration sets and
criteria correctly, and within one budget and domain whether it picks the build that suffers
most on that domain. What a user sees before building, `reap plan --compare` of four seed-0 plans
(zh, en+code and full at the K3 share, full at 25 %): `corpus-study/compare-example.md` and
`.png`."""

RECON_INTRO = """`recon` chooses each layer's kept set to minimise the layer's routed output error
on the calibration tokens when dropped experts are removed and each token's weights are
renormalised over its surviving experts (`reap.prune.recon`): computed exactly from each
token's Gram of expert contributions in the model space and the rescale of the LatentMoE's
RMS-normalised routed sum (the first version of this study took contributions as orthogonal
and the rescale as 1). It needs one more streamed calibration pass (its records are cached per
seed and reused for both budgets). Its perplexities are in the criteria tables above; here its
cost and its objective against REAP's set for the same budget (sum over layers)."""


def _ci(ci: dict, fmt: str = "{:.3f}", f=lambda x: x) -> str:
    if ci is None or ci.get("rho", ci.get("mean")) is None:
        return "n/a"
    mid = ci["rho"] if "rho" in ci else ci["mean"]
    if ci.get("lo") is None:
        return fmt.format(f(mid))
    return f"{fmt.format(f(mid))} [{fmt.format(f(ci['lo']))}, {fmt.format(f(ci['hi']))}]"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]


def _judge(ci: dict) -> str:
    if ci is None or ci.get("rho") is None or ci.get("lo") is None:
        return "undetermined"
    if ci["lo"] > 0.5:
        return "ranks well"
    if ci["lo"] > 0:
        return "ranks weakly"
    return "does not rank" if ci["hi"] < 0.3 else "inconclusive"


def predictor_section(r: dict, plot: str | None, budget_name) -> list[str]:
    """The validation of the predicted damage against measured perplexity ratio and KL."""
    v = r.get("validation")
    if not v:
        return []
    rows = [
        [
            "all budgets",
            _ci(v["all"]["ppl"]),
            _ci(v["all"]["kl"]),
            v["all"]["ppl"]["n"],
            _judge(v["all"]["ppl"]),
        ]
    ]
    for b, x in v["budgets"].items():
        rows.append(
            [budget_name(r, b), _ci(x["ppl"]), _ci(x["kl"]), x["ppl"]["n"], _judge(x["ppl"])]
        )
    out = ["## Does the plan's prediction rank builds?", "", PRED_INTRO, ""]
    out += _table(
        ["builds", "rho with log ppl ratio", "rho with KL", "pairs", "verdict (ppl)"], rows
    )
    doms = r["domains"]
    drows = [
        [budget_name(r, b)] + [_ci(x["domains"][d]["ppl"], "{:.2f}") for d in doms]
        for b, x in v["budgets"].items()
    ]
    out += ["", "Within one budget and domain (rho with log ppl ratio over the builds):", ""]
    out += _table(["budget", *doms], drows) + [""]
    names = list(next(iter(v["budgets"].values())).get("indices", {}))
    if names:
        irows = [
            [budget_name(r, b)] + [_ci(x["indices"][n], "{:.2f}") for n in names]
            for b, x in v["budgets"].items()
        ]
        out += [
            "Other kept shares as the index, within one budget (rho with log ppl ratio; n/a "
            + "where the share is the same for every build):",
            "",
        ]
        out += _table(["budget", *names], irows) + [""]
    out += _reading(r, v, budget_name)
    if plot:
        out += [f"![predicted damage against measured loss]({plot})", ""]
    return out


def _reading(r: dict, v: dict, budget_name) -> list[str]:
    """Plain sentences from the numbers: how well it predicts, where it fails."""
    out = []
    a = v["all"]["ppl"]
    out.append(
        f"- Pooled: rho = {_ci(a, '{:.2f}')} with log ppl ratio, "
        f"{_ci(v['all']['kl'], '{:.2f}')} with KL: {_judge(a)}."
    )
    for b, x in v["budgets"].items():
        fails = [
            d
            for d, y in x["domains"].items()
            if _judge(y["ppl"]) in ("does not rank", "inconclusive", "undetermined")
        ]
        good = [d for d in x["domains"] if d not in fails]
        out.append(
            f"- {budget_name(r, b)}: rho = {_ci(x['ppl'], '{:.2f}')} "
            f"({_judge(x['ppl'])}); within a domain it ranks builds on "
            f"{', '.join(good) or 'no domain'}"
            + (f" and fails or is inconclusive on {', '.join(fails)}." if fails else ".")
        )
    return out + [""]


def recon_section(r: dict, budget_name) -> list[str]:
    """recon's cost against reap/ean and its objective against REAP's set."""
    x = r.get("recon")
    if not x or not x["objective"]:
        return []
    mean = lambda a: sum(a) / len(a) if a else float("nan")
    cost = [
        [
            "calibration run (all 8 corpora; reap/ean/frequency need only its sums)",
            f"{mean(x['calibrate_seconds']):.0f} s",
        ],
        ["recon pass (the same tokens again, records kept)", f"{mean(x['pass_seconds']):.0f} s"],
        ["recon search (all layers, per plan)", f"{mean(x['select_seconds']):.1f} s"],
    ]
    out = ["## The recon criterion", "", RECON_INTRO, ""]
    out += _table(
        ["step (mean over runs; wall seconds on the shared, loaded machine)", "seconds"], cost
    ) + [""]
    rows = [
        [
            k,
            f"{o['reap']:.3f}",
            f"{o['greedy']:.3f}",
            f"{o['recon']:.3f}",
            f"{100 * (1 - o['recon'] / o['reap']):.1f} %",
        ]
        for k, o in x["objective"].items()
    ]
    out += _table(["build", "objective of REAP's set", "greedy", "recon", "lower than REAP"], rows)
    cut = [100 * (1 - o["recon"] / o["reap"]) for o in x["objective"].values()]
    worse = [
        b
        for b, d in x.get("differences", {}).items()
        if d.get("recon minus reap", [None, ""])[1] == "reversed"
    ]
    better = [
        b
        for b, d in x.get("differences", {}).items()
        if d.get("recon minus reap", [None, ""])[1] == "holds"
    ]
    out += [
        "",
        f"recon's sets lower its objective by {min(cut):.1f}-{max(cut):.1f} % against "
        "REAP's; "
        + (
            "yet its builds have higher perplexity than REAP's at "
            + ", ".join(budget_name(r, b) for b in worse)
            + ": the objective does not track what this model loses"
            if worse
            else "its builds have lower perplexity than REAP's at "
            + ", ".join(budget_name(r, b) for b in better)
            if better
            else "no perplexity difference from REAP's builds is resolved"
        )
        + ".",
    ]
    for b, d in x.get("differences", {}).items():
        out += [
            "",
            f"{budget_name(r, b)}: "
            + "; ".join(
                f"{k}: log ppl ratio {_ci(ci)} (x{_ci(ci, '{:.3f}', math.exp)}), **{verdict}**"
                for k, (ci, verdict) in d.items()
            ),
        ]
    return out + [""]


def scatter_plot(r: dict, out_dir: Path, rel: str) -> str | None:
    """predictor.png: predicted damage against log ppl ratio and KL, per budget and criterion."""
    v = r.get("validation")
    if not v:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = v["scatter"]
    budgets = list(dict.fromkeys(p["budget"] for p in pts))
    crits = list(dict.fromkeys(p["criterion"] for p in pts))
    marks = "os^vDPX*"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "log_ratio", "log(ppl / full model)"),
        (axes[1], "kl", "KL to the full model (nats/token)"),
    ):
        for bi, b in enumerate(budgets):
            for ci, c in enumerate(crits):
                sel = [p for p in pts if p["budget"] == b and p["criterion"] == c]
                if sel:
                    ax.scatter(
                        [p["damage"] for p in sel],
                        [p[key] for p in sel],
                        s=12,
                        color=f"C{bi}",
                        marker=marks[ci % len(marks)],
                        alpha=0.7,
                        label=f"{r['keeps'][b]} kept, {c}",
                    )
        ax.set_xlabel("predicted damage (REAP mass lost)")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out_dir / "predictor.png", dpi=110)
    plt.close(fig)
    return f"{rel}/predictor.png"
