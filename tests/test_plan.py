"""`reap plan`: criteria against naive formulas, corpus combination and quotas on hand-made
scores, budgets solved exactly (checked by brute force), global scope against a naive greedy,
super-expert protection, the plan file, and the full-scale K3 size check from a config alone."""

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from reap.cli import main
from reap.errors import ReapError
from reap.prune import criteria as C
from reap.prune.plan import make_plan
from reap.prune.plan_file import Plan
from reap.stats import ExpertStats


def make_stats(layers, E, top_k, tokens=1000, seed=0, corpus="c", model="m1", scores=None):
    """Random but consistent statistics; `scores` [L, E] sets the REAP score exactly."""
    g = torch.Generator().manual_seed(seed)
    s = ExpertStats.zeros(layers, E, top_k, meta={"corpus": corpus, "model": model})
    L = len(layers)
    s.tokens = tokens
    s.count = torch.randint(1, 200, (L, E), generator=g)
    s.gate_sum = torch.rand(L, E, generator=g, dtype=torch.float64) * s.count
    s.ean_sum = torch.rand(L, E, generator=g, dtype=torch.float64) * s.count * 3
    s.ean_latent_sum = s.ean_sum * 0.5
    r = scores if scores is not None else torch.rand(L, E, generator=g, dtype=torch.float64)
    s.reap_sum = r.double() * s.count
    s.reap_latent_sum = s.reap_sum * 2
    s.max_act = torch.exp(torch.randn(L, E, generator=g) * 0.3)  # log-normal, no outliers
    s.prob_mass = torch.rand(L, E, generator=g, dtype=torch.float64) * tokens
    return s


def save(s, tmp_path, name):
    return s.save(tmp_path / f"{name}.safetensors")


def test_scores_match_naive_formulas():
    s = make_stats([1, 2], 6, 2)
    s.count[0, 3] = 0
    s.reap_sum[0, 3] = s.ean_sum[0, 3] = s.reap_latent_sum[0, 3] = 0
    for criterion in ("reap", "ean", "frequency", "gate"):
        got = C.scores(s, criterion)
        for li in range(2):
            for e in range(6):
                n = int(s.count[li, e])
                want = {
                    "reap": float(s.reap_sum[li, e]) / n if n else 0.0,
                    "ean": float(s.ean_sum[li, e]) / n if n else 0.0,
                    "frequency": n / s.tokens,
                    "gate": float(s.gate_sum[li, e]) / s.tokens,
                }[criterion]
                assert got[li, e].item() == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert torch.allclose(C.scores(s, "reap", latent=True), 2 * C.scores(s, "reap"))


def test_shares_and_weighted_combination_exact():
    a = torch.tensor([[1.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[0.0, 0.0, 2.0, 2.0]], dtype=torch.float64)
    got = C.combine({"a": a, "b": b}, {"a": 3, "b": 1})
    assert got.tolist() == [[3 / 16, 9 / 16, 1 / 8, 1 / 8]]
    assert C.shares(torch.zeros(1, 4)).tolist() == [[0.25] * 4]
    assert C.order(torch.tensor([1.0, 3.0, 3.0, 0.5])) == [1, 2, 0, 3]  # ties by id


def test_quota_keeps_what_each_corpus_needs(tmp_path):
    E = 8
    zh = torch.tensor([[8, 7, 6, 5, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float64)
    code = torch.tensor([[0.1, 0.1, 0.1, 0.2, 9, 8, 7, 6]], dtype=torch.float64)
    paths = [
        save(make_stats([1], E, 2, corpus="zh", scores=zh), tmp_path, "zh"),
        save(make_stats([1], E, 2, corpus="code", scores=code), tmp_path, "code"),
    ]
    kw = {"stats": paths, "weights": "zh=3,code=1", "keep": 4, "protect": False}
    # weighted shares: zh's experts 0-3 carry 3/4 * (26/26.4); code's 4 best only 1/4 * (30/30.5)
    assert make_plan(**kw).keep == {1: [0, 1, 2, 3]}
    # quota: zh gets 3 of 4 (its top 3), code 1 (its top: 4)
    assert make_plan(**kw, quota=True).keep == {1: [0, 1, 2, 4]}
    # quotas that overlap are filled by the combined score
    both = make_plan(stats=paths[:1], keep=4, quota=True, protect=False)
    assert both.keep == {1: [0, 1, 2, 3]}


def test_uniform_keep_and_ratio():
    s = make_stats([1, 2, 3], 10, 2)
    r = C.scores(s, "reap")
    plan = make_plan_from(s, keep=4)
    for li, layer in enumerate([1, 2, 3]):
        assert plan.keep[layer] == sorted(C.order(r[li])[:4])
    assert make_plan_from(s, ratio=0.3).counts == {1: 3, 2: 3, 3: 3}


def make_plan_from(s, **kw):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = s.save(os.path.join(d, "s.safetensors"))
        return make_plan(stats=[path], **{"protect": False, **kw})


def k3_tiny():
    from reap.models import builtin_config

    return builtin_config("k3-tiny")


def test_target_size_is_the_largest_uniform_build_that_fits():
    from reap.sizes import SizeModel

    cfg = k3_tiny()
    size = SizeModel.from_config(cfg)
    full, smallest = size.predict_bytes(), size.predict_bytes(size.top_k)
    for f in (0.0, 0.37, 0.73, 1.0):
        target = full - 1 if f == 1.0 else smallest + f * (full - smallest)
        plan = make_plan(config=cfg, target_size=f"{int(target)}B")
        n = plan.counts[size.moe_layers[0]]
        fits = [k for k in range(size.n_experts + 1) if size.predict_bytes(k) <= target]
        assert n == max(fits)  # brute force over every uniform count
        assert plan.predicted_bytes == size.predict_bytes(n) <= target
    with pytest.raises(ReapError, match="below the smallest build"):
        make_plan(config=cfg, target_size="1KB")


def naive_global(shares, floor, total=None, unit=None, base=None, target=None):
    """Greedy reference: repeatedly add the best remaining expert of any layer that fits."""
    L, E = shares.shape
    taken = [set(C.order(shares[li])[: floor[li]]) for li in range(L)]
    blocked = set()
    spent = base
    while True:
        best = None
        for li in range(L):
            if li in blocked:
                continue
            for e in range(E):
                if e not in taken[li] and (best is None or shares[li, e] > best[0]):
                    best = (float(shares[li, e]), li, e)
        if best is None:
            return [len(t) for t in taken]
        _, li, e = best
        if total is not None and sum(len(t) for t in taken) >= total:
            return [len(t) for t in taken]
        if target is not None and spent + unit[li] > target:
            blocked.add(li)
            continue
        taken[li].add(e)
        spent = spent + unit[li] if target is not None else spent


def test_global_scope_counts_follow_the_scores():
    L, E = 4, 16
    g = torch.Generator().manual_seed(3)
    r = torch.rand(L, E, generator=g, dtype=torch.float64)
    r[0] = torch.rand(E, generator=g, dtype=torch.float64) ** 8  # concentrated layer
    r[3] = 1 + 0.01 * torch.rand(E, generator=g, dtype=torch.float64)  # flat layer
    s = make_stats(list(range(1, L + 1)), E, 2, scores=r)
    plan = make_plan_from(s, keep=6, scope="global")
    counts = [plan.counts[layer] for layer in range(1, L + 1)]
    assert sum(counts) == 6 * L and min(counts) >= 2
    assert counts == naive_global(C.shares(r), [2] * L, total=6 * L)
    assert counts[0] < 6  # the concentrated layer gives up more experts
    for li in range(L):  # each layer keeps its best experts
        assert plan.keep[li + 1] == sorted(C.order(r[li])[: counts[li]])
    assert make_plan_from(s, keep=6, scope="global", min_keep=5).counts[1] >= 5


def test_global_scope_minimizes_the_dropped_share():
    """Brute force over every count vector: the global plan drops the least total share."""
    import itertools

    L, E, total = 3, 8, 13
    r = torch.rand(L, E, generator=torch.Generator().manual_seed(9), dtype=torch.float64) ** 3
    plan = make_plan_from(
        make_stats([1, 2, 3], E, 2, scores=r), keep=None, ratio=total / (L * E), scope="global"
    )
    sh = C.shares(r)
    top = [torch.sort(sh[li], descending=True).values.cumsum(0) for li in range(L)]

    def dropped(counts):
        return sum(1 - float(top[li][c - 1]) for li, c in enumerate(counts))

    best = min(dropped(c) for c in itertools.product(range(2, E + 1), repeat=L) if sum(c) == total)
    got = [plan.counts[la] for la in (1, 2, 3)]
    assert sum(got) == total and dropped(got) == pytest.approx(best, abs=1e-12)


def test_global_scope_target_size_fills_exactly(tmp_path):
    from reap.sizes import SizeModel

    cfg = k3_tiny()
    size = SizeModel.from_config(cfg)
    layers, E = size.moe_layers, size.n_experts
    r = torch.rand(len(layers), E, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    path = save(make_stats(layers, E, size.top_k, scores=r), tmp_path, "s")
    target = int(size.predict_bytes(7) + 0.5 * (size.predict_bytes(8) - size.predict_bytes(7)))
    plan = make_plan(
        stats=[path], config=cfg, target_size=f"{target}B", scope="global", protect=False
    )
    counts = [plan.counts[la] for la in layers]
    assert plan.predicted_bytes == size.predict_bytes(plan.counts) <= target
    for li, la in enumerate(layers):  # maximal: one more expert anywhere does not fit
        if counts[li] < E:
            assert size.predict_bytes({**plan.counts, la: counts[li] + 1}) > target
    zero = {la: 0 for la in layers}
    unit = [size.predict_bytes({**zero, la: 1}) - size.predict_bytes(zero) for la in layers]
    base = size.predict_bytes(dict(zip(layers, [size.top_k] * len(layers))))
    assert counts == naive_global(
        C.shares(r), [size.top_k] * len(layers), unit=unit, base=base, target=target
    )


def test_super_experts_are_protected_and_count_toward_the_budget():
    E = 64
    s = make_stats([1, 2, 3], E, 2)
    s.reap_sum[1, 17] = 0.0  # lowest score: dropped unless protected
    s.max_act[1, 17] = 500.0  # a far-out outlier of the log-normal population
    assert C.super_experts(s.max_act, s.count, s.layers) == [C.SuperExpert(2, 17, 500.0)]
    plan = make_plan_from(s, keep=8, protect=True)
    assert 17 in plan.keep[2] and len(plan.keep[2]) == 8
    assert plan.protected == [{"layer": 2, "expert": 17, "max_act": 500.0}]
    assert plan.protect_rule == C.PROTECT_RULE
    assert 17 not in make_plan_from(s, keep=8, protect=False).keep[2]
    # no false positives on a clean log-normal population of 20k experts
    clean = torch.exp(torch.randn(100, 200, generator=torch.Generator().manual_seed(1)))
    assert C.super_experts(clean, torch.ones(100, 200), list(range(100))) == []
    s.max_act[1, :5] = 500.0
    with pytest.raises(ReapError, match="protected experts exceed"):
        make_plan_from(s, keep=4, protect=True)


def test_random_criterion_is_seeded():
    cfg = k3_tiny()
    a = make_plan(config=cfg, criterion="random", keep=6, seed=1)
    assert a.keep == make_plan(config=cfg, criterion="random", keep=6, seed=1).keep
    assert a.keep != make_plan(config=cfg, criterion="random", keep=6, seed=2).keep
    assert all(len(v) == 6 for v in a.keep.values())


def test_plan_file_roundtrip_and_provenance(tmp_path):
    s = make_stats([1, 2], 8, 2)
    path = save(s, tmp_path, "zh")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--keep", "4", "--out", str(out), "--no-protect"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["plan.json", "zh.safetensors"]  # no temp file left
    plan = Plan.load(out)
    assert plan.counts == {1: 4, 2: 4} and plan.criterion == "reap"
    prov = plan.provenance
    assert prov["stats"][0]["sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert prov["stats"][0]["meta"] == s.meta and prov["arguments"]["keep"] == 4
    assert prov["code_version"].startswith("reap 0.")
    assert plan.model == "m1" and len(plan.scores[1]) == 8
    d = json.loads(out.read_text())
    d["keep"]["1"] = [0, 0, 1, 2]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(ReapError, match="layer 1: invalid kept expert list"):
        Plan.load(bad)


def test_k3_full_350GB_from_config_alone(capsys):
    from reap.models import builtin_config
    from reap.sizes import SizeModel

    assert main(["plan", "--config", "k3-full", "--target-size", "350GB", "--dry-run"]) == 0
    out = capsys.readouterr().out
    size = SizeModel.from_config(builtin_config("k3-full"))
    n = size.max_uniform_keep(350 * 10**9)
    assert size.predict_bytes(n) <= 350e9 < size.predict_bytes(n + 1)
    assert 140 <= n <= 150 and f"keep {n:>5}/896" in out  # the published build: ~146


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--config", "k3-tiny", "--target-size", "12 parsecs", "--dry-run"], "cannot read size"),
        (["--config", "k3-tiny", "--keep", "2", "--dry-run"], "outside [4, 16]"),
        (["--config", "k3-tiny", "--keep", "5", "--out", "p.json"], "counts only"),
        (["--config", "k3-tiny", "--dry-run"], "exactly one budget"),
        (["--config", "k3-tiny", "--keep", "5", "--scope", "global", "--dry-run"], "needs scores"),
        (["--keep", "5", "--dry-run"], "nothing to plan from"),
        (["missing.safetensors", "--keep", "5", "--dry-run"], "missing.safetensors"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_mismatched_statistics_and_weights(tmp_path, capsys):
    a = save(make_stats([1, 2], 8, 2, corpus="zh"), tmp_path, "a")
    b = save(make_stats([1, 2], 8, 2, corpus="code", model="m2"), tmp_path, "b")
    c = save(make_stats([1, 2], 8, 2, corpus="code"), tmp_path, "c")
    for argv, message in (
        ([a, b], "different model fingerprint"),
        ([a, c, "--weights", "zh=1,en=2"], "not among"),
        ([a, c, "--weights", "zh=1"], "no weight for corpus code"),
        ([a, a], "given twice"),
        ([a, "--config", "k3-tiny"], "do not match the model config"),
    ):
        assert main(["plan", *map(str, argv), "--keep", "4", "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_plan_finds_the_calibrated_checkpoint(tmp_path):
    """Statistics name the checkpoint they came from: sizes and fingerprint come from it."""
    from reap.checkpoint import Checkpoint, CheckpointWriter
    from reap.models import family

    cfg = k3_tiny()
    specs = family(cfg).layout(cfg)
    w = CheckpointWriter(tmp_path / "ck", specs, prefix="language_model.")
    for s in specs:
        w.write(s.name, bytes(s.nbytes))
    path = w.close(cfg)
    with Checkpoint.open(path) as ck:
        fp = ck.fingerprint()
    s = make_stats([1, 2, 3, 4, 5], 16, 4, model=fp)
    s.meta["arguments"] = {"model": path}
    stats = save(s, tmp_path, "zh")
    out = tmp_path / "plan.json"
    assert main(["plan", str(stats), "--target-size", "1MB", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.model == fp and plan.predicted_bytes <= 10**6 and plan.counts[1] >= 4
    s.meta["model"] = "another"
    save(s, tmp_path, "zh")
    assert main(["plan", str(stats), "--target-size", "1MB", "--out", str(out)]) == 2


def test_counts_a_family_cannot_write_are_refused_when_planning():
    """A Qwen3-MoE config.json holds one expert count: a global plan whose per-layer counts
    differ is refused by `reap plan` (as `reap prune` would), a uniform one is not."""
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                         num_experts=64, num_experts_per_tok=2).to_dict()  # fmt: skip
    kept = make_plan(config=cfg, criterion="random", keep=16, seed=0).keep
    assert sorted(kept) == [0, 1, 2, 3] and all(len(ids) == 16 for ids in kept.values())
    with pytest.raises(ReapError, match="one expert count|uniform|differ"):
        make_plan(config=cfg, criterion="random", scope="global", ratio=0.5, seed=0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("keep", {"1": [0.0, 1.0, 2.0, 3.0], "2": [0, 1, 2, 3]}, "keep: layer 1"),  # floats
        ("keep", {"1": [False, 1, 2, 3], "2": [0, 1, 2, 3]}, "keep: layer 1"),  # bools
        ("counts", {"1": 0, "2": 4}, "counts: layer 1 keeps 0"),
        ("top_k", 0, "top_k: 0"),
        ("top_k", True, "top_k: True"),
        ("n_experts", 8.0, "n_experts: 8.0"),
        ("layers", [1, 1], "layers: [1, 1]"),
    ],
)
def test_plan_load_refuses_ill_typed_fields(field, value, message, tmp_path):
    """Before: float or bool expert ids and zero counts loaded (prune then wrote them)."""
    path = save(make_stats([1, 2], 8, 2), tmp_path, "zh")
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--keep", "4", "--out", str(out), "--no-protect"]) == 0
    d = json.loads(out.read_text())
    d[field] = value
    if field == "counts":
        d["keep"]["1"] = []
    out.write_text(json.dumps(d))
    with pytest.raises(ReapError, match=f"^{out}: {message}".replace("[", r"\[")):
        Plan.load(out)


def test_plan_never_replaces_an_input_or_reads_an_infinite_size(tmp_path, capsys):
    path = save(make_stats([1, 2], 8, 2), tmp_path, "zh")
    before = Path(path).read_bytes()
    assert main(["plan", path, "--keep", "4", "--out", path]) == 2
    assert "would replace the input" in capsys.readouterr().err
    assert Path(path).read_bytes() == before
    for size in ("infGB", "-1GB"):
        assert main(["plan", "--config", "k3-tiny", f"--target-size={size}", "--dry-run"]) == 2
        err = capsys.readouterr().err.strip()
        assert "--target-size" in err and len(err.splitlines()) == 1, err
