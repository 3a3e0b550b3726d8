"""The study's use of `reap.prune.predict` and `reap.prune.recon` (issue #16): each build's
predicted damage per domain, the recon criterion's cached calibration pass, and the validation
of the prediction against the measured per-domain perplexity ratio and KL.

Validation: Spearman rank correlation between a build's predicted damage for a domain and the
measured log perplexity ratio (and KL) of that build on that domain, over (build, domain)
pairs: pooled over all budgets, within each budget (where the easy signal, fewer experts =
more damage, is absent), and within each budget and domain (which build suffers most on one
domain). 95 % intervals are percentile bootstraps over builds (all of a build's domains
resampled together).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from experiments.corpus_study.stats import DOMAINS, SETS

REPS = 1000


def recon_tokens(work: Path, stats: dict[str, str], cal_set: str, seed: int) -> tuple[dict, float]:
    """The recon pass's records of `cal_set` (cached in work/recon/); returns ({layer:
    LayerTokens}, seconds the pass took when it ran)."""
    import torch
    from safetensors.torch import load_file, save_file

    from reap.defaults import default_model
    from reap.prune import recon, recon_pass
    from reap.stats import ExpertStats

    path = work / "recon" / f"{cal_set}.s{seed}.gram.safetensors"  # full Gram (older: diagonal)
    if not path.exists():
        t0 = time.perf_counter()
        loaded = [(c, stats[c], ExpertStats.load(stats[c])) for c in SETS[cal_set]]
        model = default_model()  # the study's model (the statistics' path may have moved)
        toks = recon_pass.collect(loaded, {c: 1.0 for c in SETS[cal_set]}, model, 4_000_000_000)
        flat = {
            f"{layer}.{f}": getattr(t, f).contiguous()
            for layer, t in toks.items()
            for f in recon.FIELDS
            if getattr(t, f) is not None
        }
        flat["seconds"] = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(flat, str(path))
    flat = load_file(str(path))
    layers = sorted({int(k.split(".")[0]) for k in flat if k != "seconds"})
    toks = {la: recon.LayerTokens(*(flat.get(f"{la}.{f}") for f in recon.FIELDS)) for la in layers}
    return toks, float(flat["seconds"][0])


def recon_plan(work: Path, stats: dict[str, str], config: dict, cal_set: str, keep: int, seed: int):
    """A recon build's plan from the set's cached calibration pass."""
    from reap.prune.recon_pass import plan_recon

    tokens, pass_seconds = recon_tokens(work, stats, cal_set, seed)
    plan = plan_recon(
        stats=[stats[c] for c in SETS[cal_set]], tokens=tokens, config=config, keep=keep, seed=seed
    )
    plan.recon["pass_seconds"] = pass_seconds
    return plan


def build_prediction(work: Path, rec: dict, stats: dict[str, str], shape: tuple) -> dict:
    """reap.prune.predict of one build's kept sets on every domain (cached in work/predict/)."""
    from reap.prune.plan_file import Plan
    from reap.prune.predict import TOKEN_FILE, predict

    path = work / "predict" / f"{rec['id']}.json"
    if path.exists():
        return json.loads(path.read_text())
    layers, E, K = shape
    keep = {int(k): v for k, v in rec["kept"].items()}
    plan = Plan(
        n_experts=E,
        top_k=K,
        layers=layers,
        counts={la: len(v) for la, v in keep.items()},
        keep=keep,
    )
    tok = os.path.join(os.path.dirname(stats["zh"]), TOKEN_FILE)  # the seed's run: all corpora
    pred = predict(
        plan,
        [stats[d] for d in DOMAINS],
        reps=REPS,
        seed=rec["seed"],
        token_files={d: tok for d in DOMAINS},
    )
    out = {
        p["corpus"]: {
            k: p[k]
            for k in (
                "damage",
                "damage_ci",
                "gate_overall",
                "reap_overall",
                "topk_overall",
                "reap_kept",
            )
        }
        for p in pred["corpora"]
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    return out


def spearman(x, y) -> float:
    """Spearman rank correlation (average ranks for ties); nan when a side is constant."""
    rx, ry = _ranks(np.asarray(x, float)), _ranks(np.asarray(y, float))
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(a: np.ndarray) -> np.ndarray:
    """0-based ranks, ties sharing their mean rank."""
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    first = np.cumsum(counts) - counts  # rank of each distinct value's first occurrence
    return (first + (counts - 1) / 2.0)[inv]


def _corr_ci(points: list[tuple[int, float, float]], seed: int = 0) -> dict:
    """Spearman of (pred, measured) over points (build index, pred, measured), with a
    percentile bootstrap over builds."""
    if len(points) < 3:
        return {"rho": None, "lo": None, "hi": None, "n": len(points)}
    b = np.array([p[0] for p in points])
    x, y = np.array([p[1] for p in points]), np.array([p[2] for p in points])
    ids = np.unique(b)
    rng, reps = np.random.default_rng(seed), []
    groups = {i: np.nonzero(b == i)[0] for i in ids}
    for _ in range(REPS):
        pick = np.concatenate([groups[i] for i in rng.choice(ids, len(ids))])
        r = spearman(x[pick], y[pick])
        if not np.isnan(r):
            reps.append(r)
    lo, hi = np.percentile(reps, [2.5, 97.5]).tolist() if reps else (None, None)
    rho = spearman(x, y)
    if np.isnan(rho):  # a constant index (or measure): no ranking to judge
        return {"rho": None, "lo": None, "hi": None, "n": len(points)}
    return {"rho": rho, "lo": lo, "hi": hi, "n": len(points)}


def validation(recs: list[dict], preds: dict[str, dict], budgets: list[str]) -> dict:
    """Rank correlations of predicted damage with log ppl ratio and KL (module docstring)."""

    def points(metric, keep=lambda r, d: True, index="damage"):
        out = []
        for i, r in enumerate(recs):
            for d in DOMAINS:
                if keep(r, d):
                    q = r["quality"][d]
                    y = np.log(q["ppl_ratio"]["value"]) if metric == "ppl" else q["kl"]["value"]
                    out.append((i, _index(preds[r["id"]][d], index), float(y)))
        return out

    res = {"all": {m: _corr_ci(points(m)) for m in ("ppl", "kl")}, "budgets": {}}
    for b in budgets:
        res["budgets"][b] = {
            m: _corr_ci(points(m, lambda r, d, b=b: r["budget"] == b)) for m in ("ppl", "kl")
        }
        res["budgets"][b]["domains"] = {
            d: {
                m: _corr_ci(points(m, lambda r, dd, b=b, d=d: r["budget"] == b and dd == d))
                for m in ("ppl", "kl")
            }
            for d in DOMAINS
        }
        res["budgets"][b]["indices"] = {  # the other kept shares as damage indices
            x: _corr_ci(points("ppl", lambda r, d, b=b: r["budget"] == b, x)) for x in INDICES
        }
    res["scatter"] = [
        {
            "id": r["id"],
            "budget": r["budget"],
            "criterion": r["criterion"],
            "domain": d,
            "damage": preds[r["id"]][d]["damage"],
            "log_ratio": float(np.log(r["quality"][d]["ppl_ratio"]["value"])),
            "kl": r["quality"][d]["kl"]["value"],
        }
        for r in recs
        for d in DOMAINS
    ]
    return res


INDICES = {
    "REAP mass lost": "reap_overall",
    "gate mass lost": "gate_overall",
    "tokens whose top-k loses an expert": "topk_overall",
}


def _index(pred: dict, name: str) -> float:
    """The damage index, or 1 - one of the overall kept shares (INDICES)."""
    if name == "damage":
        return pred["damage"]
    v = pred[INDICES[name]]
    return float("nan") if v is None else 1.0 - v


def stats_shape(path: str) -> tuple[list[int], int, int]:
    """(MoE layers, n_experts, top_k) of a statistics file."""
    from reap.stats import ExpertStats

    st = ExpertStats.load(path)
    return list(st.layers), st.n_experts, st.top_k


def recon_summary(work: Path, recs: list[dict], s) -> dict:
    """recon's cost (calibration pass and selection seconds against the calibration run's own)
    and its objective against the REAP plan's per build."""
    runs = [work / "calib" / f"seed{x}" / "run.json" for x in s.seeds]
    calib = [json.loads(p.read_text()) for p in runs if p.exists()]
    rows = [r for r in recs if r["criterion"] == "recon"]
    return {
        "differences": _recon_differences(recs, s),
        "calibrate_seconds": [c["seconds"] for c in calib if c],
        "pass_seconds": [r["recon"]["pass_seconds"] for r in rows],
        "select_seconds": [r["recon"]["seconds"] for r in rows],
        "objective": {
            r["id"]: {
                k: float(sum(v[k] for v in r["recon"]["layers"].values()))
                for k in ("greedy", "reap", "recon")
            }
            for r in rows
        },
    }


def _recon_differences(recs: list[dict], s) -> dict:
    """Per criteria budget: recon minus reap and minus ean, mean log ppl ratio over domains,
    paired by seed ([ci, verdict]; holds = recon lower)."""
    from experiments.corpus_study.stats import _by, _lr, _paired, verdict

    def f(r):
        return float(np.mean([_lr(r, d) for d in DOMAINS]))

    out = {}
    for b in s.criteria_budgets:
        mine = _by(recs, cal_set=s.criteria_set, criterion="recon", budget=b)
        if not mine:
            continue
        out[b] = {}
        for other in ("reap", "ean"):
            theirs = _by(recs, cal_set=s.criteria_set, criterion=other, budget=b)
            ci = _paired(mine, theirs, f)
            out[b][f"recon minus {other}"] = [ci, verdict(ci, -1)]
    return out
