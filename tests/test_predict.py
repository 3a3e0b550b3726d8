"""Plan predictions (`reap.prune.predict`, `reap plan --against/--compare`): kept gate, REAP and
whole-top-k shares against a brute-force count from per-token routing records of a tiny model,
and the two ends of the damage index."""

import json

import pytest
import torch

from reap.cli import main
from reap.prune.plan_file import Plan
from reap.prune.predict import TOKEN_FILE, predict
from reap.stats import ExpertStats

T_LEN, N_TOK = 16, 192  # 12 sequences


def _corpus(path, kind, n=60):
    import random

    rng = random.Random(kind)
    with open(path, "w") as f:
        for i in range(n):
            if kind == "zh":
                text = "".join(chr(0x4E00 + rng.randrange(800)) for _ in range(40))
            else:
                text = " ".join(f"x{rng.randrange(99)} = y * {rng.randrange(9)}" for _ in range(9))
            f.write(json.dumps({"id": f"{kind}-{i}", "text": text}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """k3-tiny (float32) calibrated on zh+code with per-token routing records, and the
    records of a plain in-memory forward of the same sequences (weights, norms per token)."""
    from reap.calibrate.pipeline import calibrate
    from reap.synth import synth

    root = tmp_path_factory.mktemp("pred")
    model = synth("k3-tiny", root / "model", seed=5, dtype="float32")
    spec = f"{_corpus(root / 'zh.jsonl', 'zh')}+{_corpus(root / 'code.jsonl', 'code')}"
    res = calibrate(
        model=model,
        corpus=spec,
        tokens=N_TOK,
        seq_len=T_LEN,
        out=str(root / "run"),
        save_token_experts=True,
        progress=False,
    )
    return {
        "root": root,
        "model": model,
        "spec": spec,
        "res": res,
        "records": forward_records(model, spec),
    }


def forward_records(model, spec, tokens=N_TOK, seq_len=T_LEN):
    """{layer: MoERecord} of one in-memory forward over the calibration sequences, and their
    corpus index per token."""
    from reap.checkpoint import Checkpoint
    from reap.corpora import calibration_sequences, parse_spec
    from reap.models import family
    from reap.models.base import dict_weights
    from reap.tokenizer import load_tokenizer

    names = [n for n, _ in parse_spec(spec)]
    seqs = calibration_sequences(spec, load_tokenizer(model), tokens, seq_len, 0)
    with Checkpoint.open(model) as ck:
        t = {n: ck.read(n) for n in ck.tensors}
        fam = family(ck.config)
        cfg = fam.Config.from_dict(ck.config)
    m, get = fam.Model(cfg), dict_weights(t)
    recs = {}

    class Keep:
        wants_norms = True

        def on_moe(self, rec):
            recs[rec.layer] = rec

    state = m.embed(get, torch.tensor([s.ids for s in seqs]))
    for i in range(m.n_layers):
        state, x = m.attn_block(i, get, state)
        state = m.finish_layer(i, state, m.mlp_block(i, get, x, observer=Keep()))
    corpus = torch.tensor([names.index(s.corpus) for s in seqs]).repeat_interleave(seq_len)
    return recs, corpus, names


def brute(records, corpus_idx, keep: dict[int, list[int]], layers):
    """Per-layer kept gate, REAP and whole-top-k shares by per-token loops."""
    recs, corpus, _ = records
    out = {"gate": [], "reap": [], "topk": []}
    for layer in layers:
        r, kept = recs[layer], set(keep[layer])
        g = [0.0, 0.0]
        rp = [0.0, 0.0]
        alive = n = 0
        for t in range(r.ids.shape[0]):
            if int(corpus[t]) != corpus_idx:
                continue
            n += 1
            ids = r.ids[t].tolist()
            alive += all(e in kept for e in ids)
            for k, e in enumerate(ids):
                w, nm = float(r.weights[t, k]), float(r.model_norm[t, k])
                g[1] += w
                rp[1] += w * nm
                if e in kept:
                    g[0] += w
                    rp[0] += w * nm
        out["gate"].append(g[0] / g[1])
        out["reap"].append(rp[0] / rp[1])
        out["topk"].append(alive / n)
    return out


def _plan(stats: ExpertStats, keep: dict[int, list[int]]) -> Plan:
    return Plan(
        n_experts=stats.n_experts,
        top_k=stats.top_k,
        layers=list(stats.layers),
        counts={la: len(v) for la, v in keep.items()},
        keep=keep,
        model=stats.meta.get("model"),
    )


def test_kept_shares_equal_brute_force_from_token_records(run):
    files, (_, _, names) = run["res"].files, run["records"]
    st = ExpertStats.load(files[names[0]])
    g = torch.Generator().manual_seed(1)
    keep = {la: sorted(torch.randperm(st.n_experts, generator=g)[:6].tolist()) for la in st.layers}
    pred = predict(_plan(st, keep), [files[n] for n in names], reps=200)
    assert [p["corpus"] for p in pred["corpora"]] == names
    # the token_experts file holds the routing the forward computed
    from safetensors.torch import load_file

    tok = load_file(str(run["root"] / "run" / TOKEN_FILE))["ids"]  # [L, N, K]
    for li, layer in enumerate(st.layers):
        assert torch.equal(tok[li].long(), run["records"][0][layer].ids)
    for p in pred["corpora"]:
        want = brute(run["records"], names.index(p["corpus"]), keep, st.layers)
        torch.testing.assert_close(
            torch.tensor(p["gate_kept"]), torch.tensor(want["gate"]), rtol=1e-4, atol=1e-6
        )
        torch.testing.assert_close(
            torch.tensor(p["reap_kept"]), torch.tensor(want["reap"]), rtol=1e-3, atol=1e-5
        )
        assert p["topk_kept"] == pytest.approx(want["topk"], abs=1e-12)  # exact counts
        assert p["damage"] == pytest.approx(1 - sum(want["reap"]) / len(want["reap"]), abs=1e-4)
        lo, hi = p["damage_ci"]
        assert lo <= p["damage"] <= hi and hi > lo  # sequences differ: a real interval


def test_keeping_everything_predicts_zero_damage(run):
    st = ExpertStats.load(run["res"].files["all"])
    keep = {la: list(range(st.n_experts)) for la in st.layers}
    for p in predict(_plan(st, keep), [str(run["root"] / "run")], reps=100)["corpora"]:
        assert p["damage"] == 0.0 and p["damage_ci"] == [0.0, 0.0]
        assert p["gate_overall"] == p["reap_overall"] == p["topk_overall"] == 1.0


def test_a_corpus_whose_experts_all_go_predicts_the_maximum(tmp_path):
    L, E, K, S = 3, 8, 2, 5
    st = ExpertStats.zeros([1, 2, 3], E, K, meta={"corpus": "lost", "model": "m"})
    g = torch.Generator().manual_seed(0)
    used = torch.zeros(L, E)
    used[:, :4] = torch.rand(L, 4, generator=g) + 0.1  # the corpus routes to experts 0-3 only
    st.count = (used * 100).long()
    st.gate_sum, st.reap_sum = used.double(), used.double() * 3
    st.seq_count = (torch.rand(S, L, E, generator=g) * 10 * (used > 0)).int()
    st.tokens = 100
    path = st.save(tmp_path / "lost.safetensors")
    plan = _plan(st, {la: [4, 5, 6, 7] for la in st.layers})
    (p,) = predict(plan, [path], reps=50)["corpora"]
    assert p["damage"] == 1.0 and p["damage_ci"] == [1.0, 1.0]
    assert p["gate_overall"] == p["reap_overall"] == 0.0 and p["topk_kept"] is None


def test_plot_and_md_replace_only_what_reap_wrote(run, tmp_path, capsys):
    """`plan --plot/--md` follow the output-path rule: a user's file there is refused with or
    without --overwrite and kept; reap's own (tagged) needs --overwrite."""
    a = tmp_path / "a.json"
    zh = str(run["root"] / "run" / "zh.safetensors")
    assert main(["plan", zh, "--keep", "6", "--bootstrap", "0", "--out", str(a)]) == 0
    png, md = tmp_path / "c.png", tmp_path / "c.md"
    cmd = ["plan", "--compare", str(a), "--bootstrap", "0", "--plot", str(png), "--md", str(md)]
    for path in (png, md):
        path.write_text("mine")
        for extra in ([], ["--overwrite"]):
            capsys.readouterr()
            assert main(cmd + extra) == 2
            err = capsys.readouterr().err.strip()
            assert str(path) in err and "not made by reap" in err and len(err.splitlines()) == 1
        assert path.read_text() == "mine"
        path.unlink()
    assert main(cmd) == 0
    assert main(cmd) == 2 and "--overwrite" in capsys.readouterr().err
    assert main(cmd + ["--overwrite"]) == 0 and png.read_bytes().startswith(b"\x89PNG")


def test_plan_cli_stores_prints_plots_and_compares(run, tmp_path, capsys):
    d = run["root"] / "run"
    zh, code = str(d / "zh.safetensors"), str(d / "code.safetensors")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert (
        main(
            [
                "plan",
                zh,
                "--against",
                code,
                "--keep",
                "6",
                "--out",
                str(a),
                "--plot",
                str(tmp_path / "a.png"),
            ]
        )
        == 0
    )
    assert main(["plan", str(d), "--keep", "12", "--out", str(b), "--bootstrap", "50"]) == 0
    out = capsys.readouterr().out
    assert "damage" in out and "whole top-k kept" in out
    pa = Plan.load(a)
    assert [p["corpus"] for p in pa.predictions["corpora"]] == run["records"][2]
    assert (tmp_path / "a.png").stat().st_size > 0
    # a format-1 plan (before predictions) still loads, without predictions
    old = json.loads(a.read_text())
    old.pop("predictions"), old.pop("recon")
    old["format"] = "reap.plan/1"
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.load(tmp_path / "old.json").predictions is None
    png, md = tmp_path / "cmp.png", tmp_path / "cmp.md"
    assert main(["plan", "--compare", str(a), str(b), "--plot", str(png), "--md", str(md)]) == 0
    text = md.read_text()
    assert "a.json" in text and "b.json" in text and "code.jsonl |" in text
    assert png.stat().st_size > 0
    # more experts kept, less predicted damage on every corpus
    pb = Plan.load(b)
    for x, y in zip(pa.predictions["corpora"], pb.predictions["corpora"]):
        assert y["damage"] <= x["damage"]
    capsys.readouterr()
    assert main(["plan", "--compare", str(tmp_path / "old.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "old.json" in err and "predictions" in err and len(err.splitlines()) == 1
    assert main(["plan", "--compare", str(tmp_path / "old.json"), "--against", code]) == 0
