"""The k3-mini corpus study (issue #7): which experts each language and domain needs, and what a
build calibrated on some of them loses on the others.

    python -m experiments.corpus_study                     # full study: 78 builds, ~40 min with 2 workers on a loaded machine
    python -m experiments.corpus_study --preset tiny --work /tmp/cs-tiny --out-dir /tmp/cs-out

Per seed, one calibration run over the corpora zh, en, de, fr, es, it, ja and code (equal
sequence counts) writes per-corpus statistics; a corpus's statistics depend only on its own
sequences (checked once: a separate `en+code` run gives the same counts and plan), so the
calibration sets are assembled from them: `eu` = the exact merge of de+fr+es+it, `full` =
zh+en+eu+ja+code. For every set, budget (the K3 350 GB build's share of experts, 25 %, 50 %)
and seed a plan is made (REAP; frequency, EAN and random at the criterion budgets on `full`),
pruned, and evaluated against the full model on every domain (`reap.eval.evaluate`: per-domain
perplexity ratio, top-1 agreement, KL, with bootstrap CIs over documents; greedy generations
for the REAP builds at the first budget). Overlaps of the corpora's top experts are compared
with the exact hypergeometric chance level. Everything is written under `--work` (resumable:
finished calibrations, builds and evaluations are skipped) and summarized into
`reports/corpus-study/results.json`; `experiments.corpus_study.report` writes the markdown
and plots from that file. Effects get a Student-t 95 % interval over the calibration seeds.

Issue #16 added the `recon` criterion (its calibration pass cached per seed in work/recon/) and
every build's predicted damage per domain (`reap.prune.predict`, cached in work/predict/),
validated against the measured losses (`experiments.corpus_study.predictions`). A second
worker sharing `--work` (`--reverse`) builds from the other end; finished builds are skipped.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from experiments.corpus_study import ROOT
from experiments.corpus_study.predictions import (
    build_prediction,
    recon_plan,
    recon_summary,
    stats_shape,
    validation,
)
from experiments.corpus_study.stats import (
    CORPORA,
    DOMAINS,
    EUROPEAN,
    SETS,
    answers,
    build_table,
    generation_table,
    kept_matrix,
    overlap_matrix,
)


@dataclass
class Settings:
    """One study's sizes; `full` and `tiny` presets (see `PRESETS`)."""

    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    sets: list[str] = field(default_factory=lambda: list(SETS))
    budgets: list[str] = field(default_factory=lambda: ["k3", "25%", "50%"])
    criteria: list[str] = field(default_factory=lambda: ["frequency", "ean", "random", "recon"])
    criteria_set: str = "full"
    criteria_budgets: list[str] = field(default_factory=lambda: ["k3", "25%"])
    calib_seqs: int = 64  # calibration sequences per corpus
    seq_len: int = 256
    max_docs: int = 16  # eval documents per domain
    doc_tokens: int = 192
    gen_tokens: int = 40
    gen_domains: list[str] = field(default_factory=lambda: ["zh", "en", "code"])
    bootstrap: int = 1000
    check_equivalence: bool = True


PRESETS = {
    "full": Settings(),
    "tiny": Settings(
        seeds=[0, 1],
        sets=["zh", "en+code", "full"],
        budgets=["k3"],
        criteria=["frequency", "random", "recon"],
        criteria_budgets=["k3"],
        calib_seqs=2,
        seq_len=64,
        max_docs=2,
        doc_tokens=24,
        gen_tokens=4,
        gen_domains=["zh"],
        bootstrap=50,
        check_equivalence=False,
    ),
}


@functools.lru_cache(maxsize=1)
def k3_share() -> float:
    """Share of routed experts the K3 350 GB build keeps per layer, solved by the size model on
    the k3-full config (146 of 896)."""
    from reap.prune.plan import make_plan
    from reap.synth import load_config

    plan = make_plan(config=load_config("k3-full"), target_size="350GB")
    return next(iter(plan.counts.values())) / plan.n_experts


def keep_count(budget: str, n_experts: int, top_k: int) -> int:
    """Experts kept per layer: 'k3' = the K3 350 GB build's share (`k3_share`), 'P%' = a
    fraction; never below top_k."""
    share = k3_share() if budget == "k3" else float(budget.rstrip("%")) / 100
    return max(top_k, round(share * n_experts))


# ---- the pipeline ----


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def _write(path: Path, obj) -> None:
    from reap.fileio import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(obj, indent=1))


def calibrate_seed(work: Path, s: Settings, seed: int) -> dict[str, str]:
    """Calibrate all corpora once for `seed`; returns {corpus or 'eu': statistics path}."""
    from reap.calibrate.pipeline import calibrate
    from reap.stats import ExpertStats, merge

    out = work / "calib" / f"seed{seed}"
    if not (out / "all.safetensors").exists():
        _log(f"calibrate seed {seed}: {len(CORPORA)} corpora x {s.calib_seqs} x {s.seq_len} tokens")
        calibrate(
            corpus="+".join(CORPORA),
            tokens=len(CORPORA) * s.calib_seqs * s.seq_len,
            seq_len=s.seq_len,
            out=str(out),
            seed=seed,
            progress=False,
            save_token_experts=True,  # per-token routing: the predictor's whole-top-k share
        )
    paths = {c: str(out / f"{c}.safetensors") for c in CORPORA}
    eu = work / "calib" / f"seed{seed}-eu.safetensors"
    if not eu.exists():
        parts = [ExpertStats.load(paths[c]) for c in EUROPEAN]
        merge(parts, {**parts[0].meta, "corpus": "eu"}).save(eu)
    return {**paths, "eu": str(eu)}


def make_build_plan(
    stats: dict[str, str],
    config: dict,
    cal_set: str,
    criterion: str,
    keep: int,
    seed: int,
    work: Path | None = None,
):
    """The plan of one build (super experts protected, as `reap plan` does by default); recon
    plans reuse the set's calibration pass cached in `work`."""
    from reap.prune.plan import make_plan

    if criterion == "recon":
        return recon_plan(work, stats, config, cal_set, keep, seed)
    return make_plan(
        stats=[stats[c] for c in SETS[cal_set]],
        config=config,
        criterion=criterion,
        keep=keep,
        seed=seed,
    )


def check_equivalence(
    work: Path, s: Settings, model: str, config: dict, stats: dict, keep: int
) -> dict:
    """Calibrate `en+code` on its own (seed of `stats`) and compare with the mixed run."""
    from reap.calibrate.pipeline import calibrate
    from reap.stats import ExpertStats

    out = work / "calib" / "check-en+code"
    if not (out / "all.safetensors").exists():
        _log("equivalence check: calibrating en+code on its own")
        calibrate(
            corpus="en+code",
            tokens=2 * s.calib_seqs * s.seq_len,
            seq_len=s.seq_len,
            out=str(out),
            seed=s.seeds[0],
            progress=False,
        )
    alone = {c: str(out / f"{c}.safetensors") for c in ("en", "code")}
    res = {"seed": s.seeds[0], "counts_equal": True, "reap_sum_max_rel_diff": 0.0}
    for c, p in alone.items():
        a, b = ExpertStats.load(p), ExpertStats.load(stats[c])
        res["counts_equal"] &= bool((a.count == b.count).all())
        rel = ((a.reap_sum - b.reap_sum).abs() / b.reap_sum.abs().clamp(min=1e-12)).max()
        res["reap_sum_max_rel_diff"] = max(res["reap_sum_max_rel_diff"], float(rel))
    pa = make_build_plan(alone, config, "en+code", "reap", keep, 0)
    pb = make_build_plan(stats, config, "en+code", "reap", keep, 0)
    res["kept_sets_equal"] = pa.keep == pb.keep
    return res


def corpus_overlaps(stats: dict[str, str], ms: list[int]) -> list[dict]:
    """Top-m set overlap of every corpus pair (over all layers) vs the exact chance level."""
    from reap.analyze import overlap

    usage = overlap.load_corpora([stats[c] for c in CORPORA])
    rows = []
    for a, b in itertools.combinations(usage, 2):
        for crit in overlap.CRITERIA:
            for m in ms:
                _, ov = overlap.compare_sets(a, b, crit, m)
                rows.append(
                    {
                        k: getattr(ov, k)
                        for k in (
                            "corpus_a",
                            "corpus_b",
                            "criterion",
                            "m",
                            "mean_jaccard",
                            "mean_expected",
                            "p_less",
                            "p_greater",
                            "layers_above",
                            "layers_below",
                        )
                    }
                )
    return rows


def _overlaps(work: Path, stats: dict[str, str], ms: list[int], seed: int) -> list[dict]:
    """`corpus_overlaps` of one seed, cached in work/overlap/."""
    path = work / "overlap" / f"seed{seed}.json"
    rows = _read(path)
    if rows is None:
        _log(f"overlaps of seed {seed}")
        rows = corpus_overlaps(stats, ms)
        _write(path, rows)
    return rows


@dataclass
class BuildSpec:
    """One pruned build: calibration set, criterion, budget name, experts kept, seed."""

    cal_set: str
    criterion: str
    budget: str
    keep: int
    seed: int
    with_gen: bool

    @property
    def id(self) -> str:
        return f"{self.cal_set}.{self.criterion}.k{self.keep}.s{self.seed}"


def build_specs(s: Settings, keeps: dict[str, int]) -> list[BuildSpec]:
    """Every build of the study (REAP builds get generations at the first budget): the
    criteria comparison seed by seed first, so a partial run already compares criteria."""
    reap = [
        BuildSpec(c, "reap", b, keeps[b], seed, b == s.budgets[0])
        for seed in s.seeds
        for b in s.budgets
        for c in s.sets
    ]
    crit = [
        BuildSpec(s.criteria_set, c, b, keeps[b], seed, False)
        for seed in s.seeds
        for b in s.criteria_budgets
        for c in s.criteria
    ]
    first = [
        x
        for seed in s.seeds
        for x in [
            r
            for r in reap
            if r.seed == seed and r.cal_set == s.criteria_set and r.budget in s.criteria_budgets
        ]
        + [c for c in crit if c.seed == seed]
    ]
    return first + [r for r in reap if r not in first]


def run_build(work: Path, s: Settings, model: str, config: dict, stats: dict, b: BuildSpec) -> dict:
    """Plan, prune and evaluate one build (cached in work/results/ID.json)."""
    from reap.eval.pipeline import evaluate
    from reap.prune.write import prune

    done = _read(work / "results" / f"{b.id}.json")
    if done is not None:
        return done
    t0 = time.perf_counter()
    plan = make_build_plan(stats, config, b.cal_set, b.criterion, b.keep, b.seed, work)
    path = prune(model=model, plan=plan, out=str(work / "builds" / b.id), overwrite=True).out
    res = evaluate(
        builds=[f"{b.id}={path}"],
        reference=model,
        corpora=DOMAINS,
        out=str(work / "eval"),
        max_docs=s.max_docs,
        max_tokens_per_doc=s.doc_tokens,
        gen_tokens=s.gen_tokens if b.with_gen else 0,
        gen_domains=s.gen_domains,
        device="cpu",
        dtype="float32",
        bootstrap=s.bootstrap,
        progress=False,
        plots=False,
    )
    rec = {
        **asdict(b),
        "id": b.id,
        "kept": {str(k): v for k, v in plan.keep.items()},
        "predicted_bytes": plan.predicted_bytes,
        "protected": len(plan.protected),
        "quality": {d: res["quality"][d][b.id] for d in DOMAINS},
        "reference_quality": {d: res["quality"][d][res["columns"][0]] for d in DOMAINS},
        "seconds": time.perf_counter() - t0,
    }
    if plan.recon is not None:
        rec["recon"] = plan.recon
    if b.with_gen:
        rec["generations"] = {d: v[b.id] for d, v in res["generation_summary"].items()}
        rec["reference_generations"] = {
            d: v[res["columns"][0]] for d, v in res["generation_summary"].items()
        }
        rec["examples"] = {
            d: {
                "prompt": rows[0]["prompt"],
                "reference": rows[0]["outputs"][res["columns"][0]]["text"],
                "build": rows[0]["outputs"][b.id]["text"],
            }
            for d, rows in res["generations"].items()
        }
    _write(work / "results" / f"{b.id}.json", rec)
    return rec


def _check_work(work: Path, s: Settings) -> None:
    """Refuse a work directory made with other settings (its cached builds would not match)."""
    from reap.errors import ReapError

    have = _read(work / "settings.json")
    if have is not None and _fixed(have) != _fixed(asdict(s)):
        raise ReapError(f"{work} holds a study with other settings; use another --work")
    if have is None:
        _write(work / "settings.json", asdict(s))


def _fixed(settings: dict) -> dict:
    """The settings a cached build depends on: criteria may be added to a study later (each
    build is cached under its own id)."""
    return {k: v for k, v in settings.items() if k != "criteria"}


def run_study(
    s: Settings, work: Path, out_dir: Path, report: Path | None, reverse: bool = False
) -> dict:
    """The whole study (see the module docstring); returns the results written."""
    from reap.checkpoint import Checkpoint
    from reap.defaults import default_model
    from reap.provenance import code_version
    from reap.sizes import SizeModel

    _check_work(work, s)
    model = default_model()
    with Checkpoint.open(model) as ck:
        config, fingerprint = ck.config, ck.fingerprint()
    size = SizeModel.from_config(config)  # the family's own reading of the config
    n_experts, top_k = size.n_experts, size.top_k
    keeps = {b: keep_count(b, n_experts, top_k) for b in {*s.budgets, *s.criteria_budgets}}
    stats = {seed: calibrate_seed(work, s, seed) for seed in s.seeds}
    equiv = (
        check_equivalence(work, s, model, config, stats[s.seeds[0]], keeps[s.budgets[0]])
        if s.check_equivalence
        else None
    )
    ms = sorted({keeps[b] for b in s.budgets})
    overlaps = {seed: _overlaps(work, stats[seed], ms, seed) for seed in s.seeds}
    specs = build_specs(s, keeps)
    done = _run_builds(work, s, model, config, stats, specs[::-1] if reverse else specs)
    recs = done[::-1] if reverse else done
    shape = stats_shape(stats[s.seeds[0]]["zh"])
    preds = {r["id"]: build_prediction(work, r, stats[r["seed"]], shape) for r in recs}
    results = {
        "format": "reap.corpus_study/1",
        "settings": asdict(s),
        "keeps": keeps,
        "n_experts": n_experts,
        "top_k": top_k,
        "model": {"path": os.path.relpath(model, ROOT), "fingerprint": fingerprint},
        "code_version": code_version(),
        "corpora": CORPORA,
        "domains": DOMAINS,
        "sets": SETS,
        "equivalence_check": equiv,
        "overlap_m": ms,
        "overlap_rows": {str(k): v for k, v in overlaps.items()},
        "overlap_matrix": overlap_matrix(overlaps),
        "kept_overlap": kept_matrix(recs, s, n_experts),
        "reference_loss": {d: recs[0]["reference_quality"][d]["loss"]["value"] for d in DOMAINS},
        "builds": build_table(recs),
        "generations": generation_table(recs),
        "answers": answers(recs, s, overlaps, ms[0]),
        "examples": {
            r["cal_set"]: r["examples"] for r in recs if "examples" in r and r["seed"] == s.seeds[0]
        },
        "build_seconds": float(sum(r["seconds"] for r in recs)),
        "predictions": preds,
        "validation": validation(recs, preds, s.budgets),
        "recon": recon_summary(work, recs, s),
        "protected_experts": int(sum(r["protected"] for r in recs)),
    }
    _write(out_dir / "results.json", results)
    _write(out_dir / "builds.json", recs)
    if report is not None:
        from experiments.corpus_study.report import write_report

        write_report(results, out_dir, report)
    return results


def _run_builds(
    work: Path, s: Settings, model: str, config: dict, stats: dict, specs: list[BuildSpec]
) -> list[dict]:
    """Every build, with progress and an ETA from the builds computed so far."""
    recs, t0, fresh = [], time.perf_counter(), 0
    for i, b in enumerate(specs):
        cached = (work / "results" / f"{b.id}.json").exists()
        recs.append(run_build(work, s, model, config, stats[b.seed], b))
        if not cached:
            fresh += 1
            rate = (time.perf_counter() - t0) / fresh
            _log(
                f"[{i + 1}/{len(specs)}] {b.id}: {recs[-1]['seconds']:.0f} s; "
                f"ETA {rate * (len(specs) - i - 1) / 60:.1f} min"
            )
    return recs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m experiments.corpus_study", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument(
        "--work",
        default=None,
        help="work directory (resumable; default /tmp/corpus-study, with --merging "
        "/tmp/corpus-study-merging)",
    )
    p.add_argument("--out-dir", default=str(ROOT / "reports" / "corpus-study"))
    p.add_argument(
        "--report",
        default=str(ROOT / "reports" / "corpus-study.md"),
        help="markdown report path ('' for none)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument(
        "--reverse",
        action="store_true",
        help="build in reverse order (a second worker sharing --work; cached builds are skipped)",
    )
    p.add_argument(
        "--merging",
        action="store_true",
        help="the pruning-vs-merging comparison instead (experiments.corpus_study.merging): "
        "writes OUT_DIR/merging.json and rewrites the report with its section",
    )
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    from reap.errors import ReapError

    try:
        if a.merging:
            from experiments.corpus_study import merging

            merging.run_merging(
                merging.PRESETS[a.preset],
                Path(a.work or "/tmp/corpus-study-merging"),
                Path(a.out_dir),
                Path(a.report) if a.report else None,
            )
        else:
            run_study(
                PRESETS[a.preset],
                Path(a.work or "/tmp/corpus-study"),
                Path(a.out_dir),
                Path(a.report) if a.report else None,
                a.reverse,
            )
    except ReapError as e:
        print(f"corpus_study: error: {e}", file=sys.stderr)
        return e.exit_code
    _log(f"done in {(time.perf_counter() - t0) / 60:.1f} min; results in {a.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
