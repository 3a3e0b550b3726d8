"""Our HC-SMoE and M-SMoE merges against the Cerebras REAP repository's own merging code, on the
same tiny transformers Qwen3-MoE and the same calibration token ids (issue 31, part 1, last
bullet). Nothing of their code is in this repository: `theirs` imports it, inside the function,
from a scratch export given on the command line. Three steps (exact commands, their commit and
the results: reports/merging-cerebras.md):

  prepare WORK          the model (tests/test_merge.py's QWEN, seed 3), the corpora and the
                        calibration ids [S, T]; ours: `reap calibrate --merge-stats N` for
                        N in MERGE_STATS, `reap plan --method`, `reap prune`, `reap verify`
  theirs WORK --src SRC --method hc-smoe|m-smoe
                        (run with a python whose transformers is 4.55, their pin, and with
                        PYTHONPATH=SRC, not our tree: both packages are named `reap`) their
                        src/reap/main.py with the flags of experiments/hc_smoe.sh or m_smoe.sh,
                        fed our ids instead of a Hub data set
  compare WORK --theirs-hc DIR --theirs-m DIR [--json OUT]
                        per layer: groups (theirs recovered from identical expert weights in
                        their merged checkpoint), merge weights, merged tensors; and the
                        counterfactuals that attribute each difference to a design choice
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import torch

KEEP, SEED = 5, 42
MERGE_STATS = (
    256,
    32,
)  # 256 = every calibration token (their characteristic activation); 32 = the suite's
DATASET = "reap-tiny/calib"
FLAGS = {  # experiments/hc_smoe.sh and m_smoe.sh at their commit, placeholders filled in
    "hc-smoe": ["--merge-method", "frequency_weighted_average", "--server_log_file_name",
                "server.log", "--vllm-port", "8000", "--expert-sim", "characteristic_activation",
                "--distance_measure", "euclidean", "--linkage-method", "average",
                "--frequency-penalty", "false", "--skip-first", "false", "--skip-last", "false",
                "--cluster-description", "hc_smoe", "--do-eval", "false",
                "--cluster_method", "agglomerative"],
    "m-smoe": ["--merge-method", "frequency_weighted_average", "--permute", "wm",
               "--cluster-method", "mc_smoe", "--profile", "false", "--server_log_file_name",
               "server.log", "--vllm-port", "8000", "--expert-sim", "router_logits",
               "--distance_measure", "cosine", "--frequency-penalty", "false",
               "--cluster-description", "m_smoe", "--do-eval", "false"],
}  # fmt: skip
PROJ = ("gate_proj", "up_proj", "down_proj")


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "reap.cli", *args], check=True)


def prepare(work: Path) -> None:
    """The model, ids and our builds under `work` (run from the repository root, PYTHONPATH=.)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.corpora import calibration_sequences
    from reap.tokenizer import load_tokenizer
    from tests.family_runner import MERGE_QWEN, MERGE_SEQ, MERGE_TOKENS, save_hf_tiny, write_corpora

    path, _ = save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, MERGE_QWEN, work / "m", seed=3)
    spec = write_corpora(work / "corpora")
    seqs = calibration_sequences(spec, load_tokenizer(path), MERGE_TOKENS, MERGE_SEQ, 0)
    (work / "ids.json").write_text(json.dumps([s.ids for s in seqs]))
    # transformers 4.55 (their pin) reads num_experts and rope_theta, 5.x writes the new names
    old = work / "m455"
    old.mkdir(exist_ok=True)
    for f in Path(path).iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    cfg.update(
        num_experts=cfg["num_local_experts"], rope_theta=cfg["rope_parameters"]["rope_theta"]
    )
    (old / "config.json").write_text(json.dumps(cfg, indent=2))
    for n in MERGE_STATS:
        stats = work / f"stats{n}"
        _cli(
            "calibrate",
            path,
            "--corpus",
            spec,
            "--tokens",
            str(MERGE_TOKENS),
            "--seq-len",
            str(MERGE_SEQ),
            "--out",
            str(stats),
            "--merge-stats",
            str(n),
            "--no-progress",
        )
        for method in FLAGS:
            plan, out = work / f"ours-{method}-{n}.json", work / f"ours-{method}-{n}"
            _cli(
                "plan",
                str(stats),
                "--model",
                path,
                "--method",
                method,
                "--keep",
                str(KEEP),
                "--out",
                str(plan),
            )
            _cli("prune", path, "--plan", str(plan), "--out", str(out), "--no-progress")
            _cli("verify", str(out), "--source", path)


def theirs(work: Path, src: Path, method: str) -> None:
    """Their main.py on our ids. Stubs replace only modules that their evaluation and Hub data
    loading import (vllm, datasets, reap.eval); their files are not modified."""
    for name, attrs in {
        "vllm": ["TokensPrompt"],
        "datasets": ["Dataset", "DatasetDict", "load_dataset"],
    }.items():
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # transformers probes it
        for a in attrs:
            setattr(mod, a, type(a, (), {}))
        sys.modules[name] = mod
    import reap

    if not Path(reap.__file__).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"theirs: `reap` is {reap.__file__}: run with PYTHONPATH={src}")
    stub = types.ModuleType("reap.eval")
    stub.run_evaluate = lambda *a, **k: None
    sys.modules["reap.eval"] = stub
    import reap.main as their_main

    ids = torch.tensor(json.loads((work / "ids.json").read_text()))  # [S, T]
    bs = 8  # their ObserverArgs.batch_size default
    batches = [
        {"input_ids": ids[i : i + bs], "attention_mask": torch.ones_like(ids[i : i + bs])}
        for i in range(0, ids.shape[0], bs)
    ]
    their_main.load_category_batches = lambda **kw: {"all": batches}
    # their main() calls dump_args_to_yaml(dir, *dataclasses) but it takes (dir, **dataclasses):
    # a TypeError after the model and clusters are saved; pass them by class name instead
    dump = their_main.dump_args_to_yaml
    their_main.dump_args_to_yaml = lambda d, *args: dump(d, **{type(x).__name__: x for x in args})
    E = json.loads((work / "m455" / "config.json").read_text())["num_experts"]
    ratio = 1 - KEEP / E
    tag = method.replace("-", "_")
    sys.argv = [
        "src/reap/main.py",
        "--compression_ratio",
        str(ratio),
        "--model-name",
        str(work / "m455"),
        "--dataset-name",
        DATASET,
        *FLAGS[method],
        "--merged-model-dir-name",
        f"{tag}-seed_{SEED}_{ratio}",
        "--seed",
        str(SEED),
        "--output-file-name",
        f"observations_1024_cosine-seed_{SEED}.pt",
        "--singleton_super_experts",
        "false",
        "--singleton_outlier_experts",
        "false",
    ]
    run = work / f"theirs-{method}"
    shutil.rmtree(run, ignore_errors=True)  # else main() reuses a previous run's observations
    run.mkdir()
    import os

    os.chdir(run)
    print("argv:", " ".join(sys.argv), flush=True)
    their_main.main()


# ---- comparison (our reap, transformers 5) ----


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _their_groups(w: dict, layer: int, E: int) -> list[list[int]]:
    """Groups of their merged checkpoint: experts whose three tensors are bitwise equal."""
    key = lambda e, p: f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"
    groups: list[list[int]] = []
    for e in range(E):
        for g in groups:
            if all(torch.equal(w[key(e, p)], w[key(g[0], p)]) for p in PROJ):
                g.append(e)
                break
        else:
            groups.append([e])
    return groups


def _labels(groups: list[list[int]], E: int) -> list[int]:
    lab = [0] * E
    for i, g in enumerate(groups):
        for e in g:
            lab[e] = i
    return lab


def _partition(groups) -> list[frozenset]:
    return sorted((frozenset(g) for g in groups), key=min)


def _their_obs(d: Path) -> dict:
    return torch.load(next((d / "artifacts").rglob("observations_*.pt")), weights_only=False)


def _counterfactuals(obs: dict, stats, li: int, layer: int, n: int, dom_global: list[int]):
    """What differs in the inputs and rules, per layer: their characteristic activation vs our
    mean outputs; our clustering run on their activations; M-SMoE under each combination of
    dominant choice (their global / our per-layer) and similarity (their second-order cosine
    of raw-logit distances / our cosine of the router-score Gram)."""
    from reap.prune.criteria import order
    from reap.prune.merge_plan import hc_labels, msmoe_labels

    o = obs[layer]
    ca = o["characteristic_activation"].double()  # [E, D]
    mine = stats["out_sum"][li] / stats["out_count"][li].clamp(min=1)[:, None]
    freq = o["expert_frequency"].double()
    E = freq.shape[0]
    dom_ours = sorted(order(stats["count"][li])[:n])
    rl = o["router_logit_similiarity"].double()  # [E, E] mean cosine distance of logit columns
    second = 1 - torch.nn.functional.cosine_similarity(rl[None], rl[:, None], dim=-1)
    gram = stats["prob_gram"][li]

    def assign(sim, dom):
        if sim == "ours":
            return msmoe_labels(gram, dom)
        d = second if sim == "theirs" else rl  # rl: first order, the MC-SMoE paper's
        return [e if e in dom else dom[int(torch.argmin(d[e, dom]))] for e in range(E)]

    part = lambda lab: _partition([[e for e in range(E) if lab[e] == v] for v in set(lab)])
    return {
        "counts_equal": bool(torch.equal(freq, stats["count"][li])),
        "ca_rel_diff": float((ca - mine).abs().max() / ca.abs().max()),
        "hc_ours_on_their_ca": part(hc_labels(ca, n)),
        "dominants_ours": dom_ours,
        "dominants_theirs": dom_global,
        "m_theirsim_ourdom": part(assign("theirs", dom_ours)),
        "m_oursim_theirdom": part(assign("ours", dom_global)),
        "m_logitcos_ourdom": part(assign("first", dom_ours)),
        "m_theirsim_theirdom": part(assign("theirs", dom_global)),
    }


def _tensor_diff(ours: dict, their: dict, layer: int, j: int, dom: int) -> tuple[float, float]:
    mx, rel = 0.0, 0.0
    for p in PROJ:
        a = ours[f"model.layers.{layer}.mlp.experts.{j}.{p}.weight"].double()
        b = their[f"model.layers.{layer}.mlp.experts.{dom}.{p}.weight"].double()
        d = float((a - b).abs().max())
        mx, rel = max(mx, d), max(rel, d / float(b.abs().max()))
    return mx, rel


def compare_one(work: Path, method: str, n_stats: int, their_dir: Path) -> list[dict]:
    """Per-layer rows comparing our build (stats of --merge-stats n_stats) with theirs."""
    from sklearn.metrics import adjusted_rand_score

    from reap.prune.plan import load_stats

    plan = json.loads((work / f"ours-{method}-{n_stats}.json").read_text())
    ours = _read(work / f"ours-{method}-{n_stats}")
    model = next(their_dir.rglob("model*.safetensors")).parent
    their = _read(model)
    labels_pkl = pickle.loads((model / "clusters" / "clusters.pkl").read_bytes())
    obs = _their_obs(their_dir)
    parts = [p for _, _, p in load_stats([str(work / f"stats{n_stats}")])]  # one per corpus
    stats = {
        k: sum(getattr(p, k).double() for p in parts)
        for k in ("count", "out_sum", "out_count", "prob_gram")
    }
    E = obs[0]["expert_frequency"].shape[0]
    rows = []
    for li, layer in enumerate(sorted(int(k) for k in plan["merge"]["groups"])):
        og = plan["merge"]["groups"][str(layer)]
        tg = _their_groups(their, layer, E)
        lab = np.asarray(labels_pkl[layer])
        assert _partition(tg) == _partition(
            [np.flatnonzero(lab == v).tolist() for v in np.unique(lab)]
        ), "weights vs clusters.pkl"
        freq = obs[layer]["expert_frequency"].double()
        dom_t = [g[int(torch.argmax(freq[g]))] for g in tg]  # their dominant: argmax frequency
        same = {frozenset(e for e, _ in g) for g in og} & {frozenset(g) for g in tg}
        wdiff, tdiff, trel = 0.0, 0.0, 0.0
        for j, g in enumerate(og):
            ids = [e for e, _ in g]
            if frozenset(ids) not in same or len(ids) == 1:  # they copy a singleton as is
                continue
            # the weights their average applies: float32 proba / (sum of the group's + fp32 eps)
            p = obs[layer]["expert_frequency"] / obs[layer]["total_tokens"]
            tw = p[ids].double() / (p[ids].sum().double() + torch.finfo(torch.float32).eps)
            ow = torch.tensor([w for _, w in g], dtype=torch.float64)
            wdiff = max(wdiff, float((ow - tw).abs().max()))
            d, r = _tensor_diff(ours, their, layer, j, ids[0])
            tdiff, trel = max(tdiff, d), max(trel, r)
        row = {
            "method": method,
            "merge_stats": n_stats,
            "layer": layer,
            "ours": [[e for e, _ in g] for g in og],
            "theirs": [sorted(g) for g in tg],
            "groups_identical": _partition([[e for e, _ in g] for g in og]) == _partition(tg),
            "ari": adjusted_rand_score(_labels([[e for e, _ in g] for g in og], E), _labels(tg, E)),
            "groups_agreeing": f"{len(same)}/{len(og)}",
            "weights_max_abs_diff": wdiff,
            "tensor_max_abs_diff": tdiff,
            "tensor_max_rel_diff": trel,
            "their_dominants": sorted(dom_t) if method == "m-smoe" else None,
        }
        cf = _counterfactuals(obs, stats, li, layer, KEEP, sorted(dom_t))
        for k, v in cf.items():
            if k.startswith(("hc_", "m_")):
                cf[k] = {
                    "groups": [sorted(g) for g in v],
                    "equals_theirs": v == _partition(tg),
                    "equals_ours": v == _partition(row["ours"]),
                }
        row["check"] = cf
        rows.append(row)
    return rows


def build_logits(work: Path, dirs: dict[str, Path]) -> list[dict]:
    """Whole builds on the calibration ids, loaded in transformers: top-1 agreement with the
    source model and max |logits - source's|, for their build (E router rows, tied copies) and
    ours (--merge-stats 256: the dominant experts' router rows)."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(json.loads((work / "ids.json").read_text()))

    def logits(path: Path) -> torch.Tensor:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            return m(input_ids=ids).logits.double()

    src = logits(work / "m")
    rows = []
    for method, d in dirs.items():
        builds = {
            "theirs": next(d.rglob("model*.safetensors")).parent,
            "ours": work / f"ours-{method}-{MERGE_STATS[0]}",
        }
        for who, path in builds.items():
            got = logits(path)
            rows.append(
                {
                    "method": method,
                    "build": who,
                    "top1_agreement": float((got.argmax(-1) == src.argmax(-1)).double().mean()),
                    "max_abs_logit_diff": float((got - src).abs().max()),
                }
            )
    return rows


def compare(work: Path, dirs: dict[str, Path], out: Path | None) -> list[dict]:
    rows = [r for m, d in dirs.items() for n in MERGE_STATS for r in compare_one(work, m, n, d)]
    rows += build_logits(work, dirs)
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "check"}))
        if "check" in r:
            print("   check:", json.dumps(r["check"], default=str))
    if out:
        out.write_text(json.dumps(rows, indent=1, default=lambda s: sorted(s)) + "\n")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("work", type=Path)
    s = sub.add_parser("theirs")
    s.add_argument("work", type=Path)
    s.add_argument("--src", type=Path, required=True, help="their src/ directory (scratch copy)")
    s.add_argument("--method", choices=list(FLAGS), required=True)
    s = sub.add_parser("compare")
    s.add_argument("work", type=Path)
    s.add_argument("--theirs-hc", type=Path, required=True)
    s.add_argument("--theirs-m", type=Path, required=True)
    s.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.step == "prepare":
        prepare(work)
    elif a.step == "theirs":
        theirs(work, a.src, a.method)
    else:
        compare(work, {"hc-smoe": a.theirs_hc, "m-smoe": a.theirs_m}, a.json)


if __name__ == "__main__":
    main()
