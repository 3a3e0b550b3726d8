"""Pruning against expert merging on k3-mini (issue #31 part 3): does "pruning prevails" (REAP
the Experts, arXiv 2510.13999) reproduce here, per domain, with intervals?

    python -m experiments.corpus_study --merging           # 45 builds, ~15 min on a loaded 2-core machine
    python -m experiments.corpus_study --merging --preset tiny --work /tmp/m-tiny --out-dir /tmp/o

Per calibration seed of the study, one `--merge-stats` calibration of the same tokens as the
pruning study (all eight corpora, the same sequences, so REAP's counts and sums are those the
pruning builds used); on the `full` set (zh+en+eu+ja+code) and at the study's budgets, a
REAP-pruned build (the study's `full.reap` plan), an HC-SMoE-merged and an M-SMoE-merged build
(`reap.prune.merge_plan`: the same expert count per layer) and each merge plan pruned to its
dominant experts without merging (`X-dom`, a control) are built and evaluated like the
study's builds (per-domain perplexity ratio, agreement and KL against the full model; no
generations) plus the shipped lm-eval multiple-choice task (tests/fixtures/lm_eval). Per seed
it also records how specialised the experts are (`specialisation`). Everything is cached under
`--work` (resumable); the summary goes to reports/corpus-study/merging.json and the report
(`experiments.corpus_study.report`) gets its "Pruning against merging" section from it.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from experiments.corpus_study import ROOT
from experiments.corpus_study.stats import DOMAINS, SETS, build_table, seed_ci, verdict

# reap first: the pruning side of every comparison; X-dom = the merge plan of X pruned to its
# groups' dominant experts, unmerged (the same router rows as X: separates which experts a
# build keeps from what averaging the others into them costs)
METHODS = ["reap", "hc-smoe", "m-smoe", "hc-smoe-dom", "m-smoe-dom"]
MERGES = ["hc-smoe", "m-smoe"]
# (a, b) compared as log ppl(a) - log ppl(b); "a prevails" holds when a is lower
PAIRS = [
    ("reap", "hc-smoe"),
    ("reap", "m-smoe"),
    ("hc-smoe-dom", "hc-smoe"),
    ("m-smoe-dom", "m-smoe"),
    ("reap", "hc-smoe-dom"),
    ("reap", "m-smoe-dom"),
]
TASK = "reap_tiny_mc"
TASK_DIR = ROOT / "tests" / "fixtures" / "lm_eval"


@dataclass
class MergeSettings:
    """The merging comparison's sizes (the pruning study's seeds, budgets, calibration and eval
    sizes; `full` and `tiny` presets in `PRESETS`)."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    budgets: list[str] = field(default_factory=lambda: ["k3", "25%", "50%"])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    cal_set: str = "full"
    merge_stats: int = 2048  # sampled tokens every expert is run on (HC-SMoE's representations)
    calib_seqs: int = 64
    seq_len: int = 256
    max_docs: int = 16
    doc_tokens: int = 192
    bootstrap: int = 1000
    tasks: list[str] = field(default_factory=lambda: [TASK])


PRESETS = {
    "full": MergeSettings(),
    "tiny": MergeSettings(
        seeds=[0, 1],
        budgets=["k3"],
        merge_stats=64,
        calib_seqs=2,
        seq_len=64,
        max_docs=2,
        doc_tokens=24,
        bootstrap=50,
        tasks=[],
    ),
}


def _study():
    from experiments.corpus_study import study

    return study


def calibrate_merge_seed(work: Path, s: MergeSettings, seed: int) -> dict[str, str]:
    """The study's calibration of `seed` (`study.calibrate_seed`'s corpora, tokens and sequences)
    with `--merge-stats`; returns {corpus or 'eu': statistics path}."""
    from reap.calibrate.pipeline import calibrate
    from reap.stats import ExpertStats, merge

    st = _study()
    out = work / "calib" / f"seed{seed}"
    if not (out / "all.safetensors").exists():
        st._log(f"calibrate seed {seed} with --merge-stats {s.merge_stats}")
        calibrate(
            corpus="+".join(st.CORPORA),
            tokens=len(st.CORPORA) * s.calib_seqs * s.seq_len,
            seq_len=s.seq_len,
            out=str(out),
            seed=seed,
            progress=False,
            merge_stats=s.merge_stats,
        )
    paths = {c: str(out / f"{c}.safetensors") for c in st.CORPORA}
    eu = work / "calib" / f"seed{seed}-eu.safetensors"
    if not eu.exists():
        parts = [ExpertStats.load(paths[c]) for c in st.EUROPEAN]
        merge(parts, {**parts[0].meta, "corpus": "eu"}).save(eu)
    return {**paths, "eu": str(eu)}


def make_method_plan(
    stats: dict, config: dict, s: MergeSettings, method: str, keep: int, seed: int
):
    """REAP: the study's plan (`study.make_build_plan`); a merge method: its groups planned on
    the same statistics files with the same expert count per layer; X-dom: X's plan without
    the merge (its dominant experts kept, the others dropped)."""
    if method == "reap":
        return _study().make_build_plan(stats, config, s.cal_set, "reap", keep, seed)
    from reap.prune.merge_plan import make_merge_plan

    plan = make_merge_plan(
        method=method.removesuffix("-dom"),
        stats=[stats[c] for c in SETS[s.cal_set]],
        config=config,
        keep=keep,
    )
    if method.endswith("-dom"):
        plan.merge, plan.criterion = None, method
    return plan


@contextlib.contextmanager
def _in_dir(path: Path):
    """The fixture task YAMLs name their JSONL relative to the working directory."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def run_method_build(
    work: Path,
    s: MergeSettings,
    model: str,
    config: dict,
    stats: dict,
    method: str,
    budget: str,
    keep: int,
    seed: int,
) -> dict:
    """Plan, build and evaluate one build (cached in work/results/ID.json)."""
    from reap.eval.pipeline import evaluate
    from reap.prune.write import prune

    st = _study()
    bid = f"{s.cal_set}.{method}.k{keep}.s{seed}"
    done = st._read(work / "results" / f"{bid}.json")
    if done is not None:
        return done
    t0 = time.perf_counter()
    plan = make_method_plan(stats, config, s, method, keep, seed)
    path = prune(model=model, plan=plan, out=str(work / "builds" / bid), overwrite=True).out
    with _in_dir(TASK_DIR):
        res = evaluate(
            builds=[f"{bid}={path}"],
            reference=model,
            corpora=DOMAINS,
            out=str(work / "eval"),
            max_docs=s.max_docs,
            max_tokens_per_doc=s.doc_tokens,
            gen_tokens=0,
            device="cpu",
            dtype="float32",
            bootstrap=s.bootstrap,
            tasks=s.tasks,
            task_path=str(TASK_DIR) if s.tasks else None,
            progress=False,
            plots=False,
        )
    ref = res["columns"][0]
    rec = {
        "id": bid,
        "cal_set": s.cal_set,
        "criterion": method,
        "budget": budget,
        "keep": keep,
        "seed": seed,
        "kept": {str(k): v for k, v in plan.keep.items()},
        "groups": _group_sizes(plan),
        "quality": {d: res["quality"][d][bid] for d in DOMAINS},
        "reference_quality": {d: res["quality"][d][ref] for d in DOMAINS},
        "benchmarks": {t: {c: v[c] for c in (bid, ref)} for t, v in res["benchmarks"].items()},
        "seconds": time.perf_counter() - t0,
    }
    st._write(work / "results" / f"{bid}.json", rec)
    return rec


def _group_sizes(plan) -> dict | None:
    """Sources per output expert of a merge plan: {max, singletons, mean} over layers."""
    if not plan.merge:
        return None
    sizes = [len(g) for gs in plan.merge["groups"].values() for g in gs]
    return {"max": max(sizes), "singletons": sizes.count(1), "mean": float(np.mean(sizes))}


def specialisation(stats: dict, cal_set: str, keeps: dict[str, int]) -> dict:
    """How unlike each other the experts are, from one seed's statistics of `cal_set` (summed):
    `freq_cv` = coefficient of variation of routed counts over a layer's experts; `reap_kept[b]`
    = share of the REAP mass (gate weight x output norm, summed) held by the `keeps[b]` experts of
    highest REAP score, against keep / E for a random set; `out_cos` = mean pairwise cosine of
    the experts' mean outputs on sampled tokens (HC-SMoE's representations; 1 = identical);
    `router_cos` = mean pairwise cosine of the experts' router scores (M-SMoE's similarity).
    All averaged over layers."""
    import torch

    from reap.stats import ExpertStats

    parts = [ExpertStats.load(stats[c]) for c in SETS[cal_set]]
    count = sum(p.count.double() for p in parts)  # [L, E]
    mass = sum(p.reap_sum.double() for p in parts)  # [L, E]
    n = count.shape[1]
    cv = (count.std(1) / count.mean(1)).mean()
    srt = mass.sort(1, descending=True).values
    kept = {b: float((srt[:, :k].sum(1) / srt.sum(1)).mean()) for b, k in keeps.items()}
    out = {"freq_cv": float(cv), "reap_kept": kept, "uniform": {b: k / n for b, k in keeps.items()}}
    off = ~torch.eye(n, dtype=torch.bool)
    if parts[0].out_sum is not None:
        reps = (
            sum(p.out_sum.double() for p in parts)
            / sum(p.out_count.double() for p in parts).clamp(min=1)[..., None]
        )  # [L, E, Dx]
        unit = torch.nn.functional.normalize(reps, dim=-1)
        out["out_cos"] = float((unit @ unit.transpose(1, 2))[:, off].mean())
    if parts[0].prob_gram is not None:
        g = sum(p.prob_gram.double() for p in parts)  # [L, E, E]
        d = g.diagonal(dim1=1, dim2=2).clamp(min=1e-300).sqrt()  # [L, E]
        out["router_cos"] = float((g / d[:, :, None] / d[:, None, :])[:, off].mean())
    return out


def group_cosine(stats: dict, cal_set: str, plan_path: Path) -> dict:
    """How alike the experts a merge averages are: cosine of each non-dominant member's mean
    output (HC-SMoE's representation) with its group dominant's, weighted by merge weight and
    averaged over all members of all groups; and the same for random pairs of experts."""
    import json

    import torch

    from reap.stats import ExpertStats

    parts = [ExpertStats.load(stats[c]) for c in SETS[cal_set]]
    reps = (
        sum(p.out_sum.double() for p in parts)
        / sum(p.out_count.double() for p in parts).clamp(min=1)[..., None]
    )  # [L, E, Dx]
    unit = torch.nn.functional.normalize(reps, dim=-1)
    layers = list(parts[0].layers)
    groups = json.loads(plan_path.read_text())["merge"]["groups"]
    cos, w = [], []
    for layer, gs in groups.items():
        u = unit[layers.index(int(layer))]
        for g in gs:
            for e, wt in g[1:]:
                cos.append(float(u[e] @ u[g[0][0]]))
                w.append(wt)
    return {"member_cos": float(np.average(cos, weights=w)) if cos else None, "members": len(cos)}


def comparisons(recs: list[dict], s: MergeSettings) -> list[dict]:
    """Each pair of `PAIRS` whose builds were made, per budget and domain (and the mean over
    domains): the per-seed difference of log perplexity ratios (a minus b), its seed interval
    and the verdict of "a prevails" (a lower: holds). `method` names the merge method of the
    pair."""
    rows = []
    for a, b in [p for p in PAIRS if set(p) <= set(s.methods)]:
        for budget in s.budgets:
            pairs = _pairs(recs, a, b, budget)
            if not pairs:
                continue
            for dom in [*DOMAINS, "mean"]:
                diffs = [_lr(p, dom) - _lr(m, dom) for p, m in pairs]
                agree = [_agr(p, dom) - _agr(m, dom) for p, m in pairs]
                ci = seed_ci(diffs)
                rows.append(
                    {
                        "a": a,
                        "b": b,
                        "method": b.removesuffix("-dom"),
                        "budget": budget,
                        "domain": dom,
                        "log_diff": ci,
                        "ratio": _exp(ci),
                        "agreement_diff": seed_ci(agree),
                        "verdict": verdict(ci, -1),
                        "seeds": [p["seed"] for p, _ in pairs],
                    }
                )
    return rows


def _pairs(recs: list[dict], a: str, b: str, budget: str) -> list[tuple[dict, dict]]:
    by = {(r["criterion"], r["budget"], r["seed"]): r for r in recs}
    return [
        (r, by[(b, budget, r["seed"])])
        for r in recs
        if r["criterion"] == a and r["budget"] == budget and (b, budget, r["seed"]) in by
    ]


def _lr(rec: dict, dom: str) -> float:
    if dom == "mean":
        return float(np.mean([_lr(rec, d) for d in DOMAINS]))
    return math.log(rec["quality"][dom]["ppl_ratio"]["value"])


def _agr(rec: dict, dom: str) -> float:
    if dom == "mean":
        return float(np.mean([_agr(rec, d) for d in DOMAINS]))
    return rec["quality"][dom]["agreement"]["value"]


def _exp(ci: dict) -> dict:
    f = lambda x: None if x is None else math.exp(x)
    return {"mean": f(ci["mean"]), "lo": f(ci["lo"]), "hi": f(ci["hi"])}


def task_table(recs: list[dict]) -> dict:
    """Per task, method and budget: accuracy (acc) over seeds, with the reference's."""
    out: dict = {}
    for r in recs:
        for task, cols in r.get("benchmarks", {}).items():
            ref = next(v for k, v in cols.items() if k != r["id"])
            t = out.setdefault(
                task, {"reference": ref["acc"]["value"], "samples": ref["samples"], "rows": {}}
            )
            t["rows"].setdefault(f"{r['criterion']}|{r['budget']}", []).append(
                cols[r["id"]]["acc"]["value"]
            )
    for t in out.values():
        t["rows"] = {k: seed_ci(v) for k, v in t["rows"].items()}
    return out


def pruning_study_match(recs: list[dict], study_builds: list[dict]) -> dict:
    """Whether this run's REAP builds are the pruning study's (same kept sets, same per-domain
    ratios): the merge-stats calibration must not change what pruning sees."""
    old = {b["id"]: b for b in study_builds}
    same_kept, max_rel = True, 0.0
    n = 0
    for r in recs:
        o = old.get(r["id"]) if r["criterion"] == "reap" else None
        if o is None:
            continue
        n += 1
        same_kept &= o["kept"] == r["kept"]
        for d in DOMAINS:
            a, b = r["quality"][d]["ppl_ratio"]["value"], o["quality"][d]["ppl_ratio"]["value"]
            max_rel = max(max_rel, abs(a - b) / b)
    return {"builds": n, "kept_equal": bool(same_kept), "ppl_ratio_max_rel_diff": max_rel}


def sensitivity(study_builds: list[dict], predictions: dict, budgets: list[str]) -> dict:
    """Per budget, how much a build's log perplexity ratio moves per unit of REAP mass it drops,
    from the pruning study's builds: the least-squares slope of log ratio on predicted damage
    (`reap.prune.predict`) over (build, domain) pairs, both centred within each domain (so
    domains' different baselines do not count). {budget: {slope, pairs, damage_sd}}."""
    out = {}
    for b in budgets:
        xs, ys = [], []
        for d in DOMAINS:
            rs = [r for r in study_builds if r["budget"] == b and r["id"] in predictions]
            x = np.array([predictions[r["id"]][d]["damage"] for r in rs])
            y = np.array([math.log(r["quality"][d]["ppl_ratio"]["value"]) for r in rs])
            if len(x) >= 2:
                xs.append(x - x.mean())
                ys.append(y - y.mean())
        if not xs:
            continue
        x, y = np.concatenate(xs), np.concatenate(ys)
        out[b] = {"slope": float(x @ y / (x @ x)), "pairs": len(x), "damage_sd": float(x.std())}
    return out


def seeds_needed(ci: dict, max_n: int = 1000) -> int | None:
    """Seeds a Student-t 95 % interval needs to exclude zero at this mean and seed-to-seed
    spread (None: not within max_n, or no spread to judge)."""
    from scipy.stats import t

    v = np.asarray(ci["values"], dtype=np.float64)
    if len(v) < 2 or v.std(ddof=1) == 0 or ci["mean"] == 0:
        return None
    ratio = abs(ci["mean"]) / v.std(ddof=1)
    for n in range(2, max_n + 1):
        if t.ppf(0.975, n - 1) / math.sqrt(n) < ratio:
            return n
    return None


def run_merging(s: MergeSettings, work: Path, out_dir: Path, report: Path | None) -> dict:
    """The comparison (see the module docstring); returns the results written to
    out_dir/merging.json."""
    from reap.checkpoint import Checkpoint
    from reap.defaults import default_model
    from reap.provenance import code_version
    from reap.prune.merge_plan import ROUTER_RULE
    from reap.sizes import SizeModel

    st = _study()
    work = work.resolve()
    _check_work(work, s)
    model = os.path.abspath(default_model())
    with Checkpoint.open(model) as ck:
        config, fingerprint = ck.config, ck.fingerprint()
    size = SizeModel.from_config(config)
    keeps = {b: st.keep_count(b, size.n_experts, size.top_k) for b in s.budgets}
    recs, spec, calib_s, cosines = [], {}, [], {}
    for seed in s.seeds:  # seed by seed: a partial run already compares every method
        stats = calibrate_merge_seed(work, s, seed)
        calib_s.append(st._read(work / "calib" / f"seed{seed}" / "run.json")["seconds"])
        spec[str(seed)] = specialisation(stats, s.cal_set, keeps)
        for b in s.budgets:
            for method in s.methods:
                recs.append(
                    run_method_build(work, s, model, config, stats, method, b, keeps[b], seed)
                )
                st._log(f"{recs[-1]['id']}: {recs[-1]['seconds']:.0f} s")
                if method in MERGES:
                    plan = work / "builds" / recs[-1]["id"] / "reap_plan.json"
                    cosines[recs[-1]["id"]] = group_cosine(stats, s.cal_set, plan)
    study = st._read(out_dir / "results.json") or {}
    study_builds = st._read(out_dir / "builds.json") or []
    comps = comparisons(recs, s)
    for c in comps:
        c["seeds_needed"] = seeds_needed(c["log_diff"])
    results = {
        "format": "reap.corpus_study.merging/1",
        "settings": asdict(s),
        "keeps": keeps,
        "n_experts": size.n_experts,
        "top_k": size.top_k,
        "model": {"path": os.path.relpath(model, ROOT), "fingerprint": fingerprint},
        "code_version": code_version(),
        "router_rule": ROUTER_RULE,
        "builds": build_table(recs),
        "comparisons": comps,
        "tasks": task_table(recs),
        "specialisation": spec,
        "sensitivity": sensitivity(study_builds, study.get("predictions", {}), s.budgets),
        "group_sizes": {r["id"]: r["groups"] for r in recs if r["groups"]},
        "group_cosine": cosines,
        "pruning_study_match": pruning_study_match(recs, study_builds),
        "n_builds": len(recs),
        "build_seconds": float(sum(r["seconds"] for r in recs)),
        "calibration_seconds": calib_s,
    }
    st._write(out_dir / "merging.json", results)
    st._write(out_dir / "merging-builds.json", recs)
    if report is not None:
        _rewrite_report(out_dir, report)
    return results


def _check_work(work: Path, s: MergeSettings) -> None:
    from reap.errors import ReapError

    st = _study()
    have = st._read(work / "settings.json")
    fixed = lambda d: {k: v for k, v in d.items() if k != "methods"}
    if have is not None and fixed(have) != fixed(asdict(s)):
        raise ReapError(f"{work} holds a merging run with other settings; use another --work")
    if have is None:
        st._write(work / "settings.json", asdict(s))


def _rewrite_report(out_dir: Path, report: Path) -> None:
    """The whole report from the pruning study's results.json (unchanged) and merging.json;
    without results.json (e.g. a tiny run elsewhere) only the merging section is written."""
    import json

    from experiments.corpus_study.report import write_report
    from experiments.corpus_study.report_merging import merging_section
    from reap.fileio import write_atomic

    study = out_dir / "results.json"
    if study.exists():
        write_report(json.loads(study.read_text()), out_dir, report)
    else:
        merged = json.loads((out_dir / "merging.json").read_text())
        write_atomic(report, "\n".join(merging_section(merged)) + "\n")
