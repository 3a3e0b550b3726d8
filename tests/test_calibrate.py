"""Calibration: accumulation, spill store, streamed vs brute-force statistics, I/O, resume, merge,
bad input. Everything runs on k3-tiny checkpoints synthesized once per session (seconds)."""

from __future__ import annotations

import pytest
import torch

from reap.calibrate.accumulate import StatsAccumulator
from reap.calibrate.spill import SpillStore, state_arrays, state_from_arrays
from reap.checkpoint import Checkpoint
from reap.models.base import MoERecord, State
from reap.stats import ExpertStats


# -- naive per-token reference for the accumulator ---------------------------------------------
def naive_rows(records, spans, seq_corpus, seq_len, E, n_corpora):
    """Per (layer, corpus) dict of statistics from plain Python loops over tokens."""
    local, sizes = [], [0] * n_corpora
    for c in seq_corpus:
        local.append(sizes[c])
        sizes[c] += 1
    out = {}
    for rec, (s0, s1) in zip(records, spans):
        for c in range(n_corpora):
            out.setdefault((rec.layer, c), {
                "count": [0] * E, "gate_sum": [0.0] * E, "reap_sum": [0.0] * E,
                "reap_latent_sum": [0.0] * E, "ean_sum": [0.0] * E, "ean_latent_sum": [0.0] * E,
                "max_act": [0.0] * E, "prob_mass": [0.0] * E,
                "coact": [[0] * E for _ in range(E)], "seq_count": [[0] * E for _ in range(sizes[c])]})
        for n in range(rec.ids.shape[0]):
            s = s0 + n // seq_len
            r = out[(rec.layer, seq_corpus[s])]
            ids = rec.ids[n].tolist()
            for k, e in enumerate(ids):
                w = float(rec.weights[n, k])
                mn, ln = float(rec.model_norm[n, k]), float(rec.latent_norm[n, k])
                r["count"][e] += 1
                r["gate_sum"][e] += w
                r["reap_sum"][e] += w * mn
                r["reap_latent_sum"][e] += w * ln
                r["ean_sum"][e] += mn
                r["ean_latent_sum"][e] += ln
                r["max_act"][e] = max(r["max_act"][e], float(rec.max_act[n, k]))
                r["seq_count"][local[s]][e] += 1
                for f in ids:
                    r["coact"][e][f] += 1
            for e in range(E):
                r["prob_mass"][e] += float(rec.probs[n, e])
    return out


def random_record(layer, n, E, K, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(n)])
    f = lambda *s: torch.rand(*s, generator=gen)
    return MoERecord(layer, ids, f(n, K), f(n, E), f(n, K), f(n, K), f(n, K) * 5)


def test_accumulator_matches_per_token_loops():
    gen = torch.Generator().manual_seed(1)
    E, K, T = 7, 3, 5
    seq_corpus = [0, 1, 1, 0, 2, 1]
    spans = [(0, 4), (4, 6), (0, 2), (2, 6)]
    records = [random_record(layer, (s1 - s0) * T, E, K, gen)
               for layer, (s0, s1) in zip([3, 3, 5, 5], spans)]
    acc = StatsAccumulator(E, K, seq_corpus, T, n_corpora=3)
    for rec, (s0, s1) in zip(records, spans):
        acc.span(s0, s1)
        acc.on_moe(rec)
    ref = naive_rows(records, spans, seq_corpus, T, E, 3)
    for (layer, c), want in ref.items():
        got = acc.layer(layer)[c].tensors()
        for name, v in want.items():
            exact = name in ("count", "coact", "seq_count")
            torch.testing.assert_close(got[name].double(), torch.tensor(v, dtype=torch.float64),
                                       rtol=0 if exact else 1e-6, atol=0 if exact else 1e-6,
                                       msg=f"{name} layer {layer} corpus {c}")
    # co-activation: diagonal = count, symmetric
    row = acc.layer(3)[1]
    assert torch.equal(row.coact.diagonal(), row.count) and torch.equal(row.coact, row.coact.T)


# -- spill store --------------------------------------------------------------------------------
def test_flatten_roundtrip_and_spill_generations(tmp_path):
    st = State(torch.randn(3, 4, 2), [torch.randn(3, 4, 2), torch.randn(3, 4, 2)])
    flat = state_arrays(st)
    assert sorted(flat) == ["blocks.0", "blocks.1", "hidden"]
    back = state_from_arrays(flat)
    assert isinstance(back, State) and back.blocks[1] is st.blocks[1]

    store = SpillStore(str(tmp_path), n_seq=3)
    for k, v in flat.items():
        store.write(k, 0, v[:2], "g0")
        store.write(k, 2, v[2:], "g0")
    store.commit()
    for k, v in flat.items():
        assert torch.equal(store.read(k, 1, 3), v[1:3])
    new = torch.randn(3, 4, 2)
    store.write("hidden", 0, new, "g1")
    assert torch.equal(store.read("hidden", 0, 3), flat["hidden"])  # pending is invisible
    store.commit()
    man = store.manifest()
    store.cleanup()
    store.close()
    again = SpillStore.from_manifest(str(tmp_path), 3, man)
    assert torch.equal(again.read("hidden", 0, 3), new)
    assert torch.equal(again.read("blocks.1", 0, 3), flat["blocks.1"])
    assert len(list(tmp_path.glob("*.bin"))) == 3  # the superseded hidden file is gone
    again.close()


# -- end to end on k3-tiny ----------------------------------------------------------------------
T_LEN, N_TOK = 32, 320  # 10 sequences of 32 tokens


def _write_corpus(path, kind, n=400):
    import json
    import random

    rng = random.Random(kind)
    with open(path, "w") as f:
        for i in range(n):
            if kind == "zh":
                text = "".join(chr(0x4E00 + rng.randrange(2000)) for _ in range(rng.randrange(20, 60)))
            else:
                text = "\n".join(f"def f{rng.randrange(999)}(x):\n    return x * {rng.randrange(99)}"
                                 for _ in range(rng.randrange(2, 6)))
            f.write(json.dumps({"id": f"{kind}-{i}", "text": text}) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    """A float32 k3-tiny checkpoint and a two-corpus spec of local jsonl files."""
    from reap.synth import synth

    root = tmp_path_factory.mktemp("cal")
    model = synth("k3-tiny", root / "model", seed=3, dtype="float32")
    spec = f"{_write_corpus(root / 'zh.jsonl', 'zh')}+{_write_corpus(root / 'code.jsonl', 'code')}"
    return {"root": root, "model": model, "spec": spec}


def _cal(env, out, **kw):
    from reap.calibrate.pipeline import calibrate

    args = {"model": env["model"], "corpus": env["spec"], "tokens": N_TOK, "seq_len": T_LEN,
            "batch": 3, "save_token_experts": True, "progress": False, **kw}
    return calibrate(out=str(env["root"] / out), **args)


@pytest.fixture(scope="session")
def base(env):
    """The uninterrupted reference run: one MLP pass, attention batches of 3 sequences."""
    return _cal(env, "base")


def naive_moe_record(x, t, cfg, layer):
    """Routing and expert output norms of one MoE layer recomputed from its input x [N, D] in
    float64 from the raw tensors, every statistic from its definition (REAP-style hooks)."""
    from references import mxfp4_dequantize_reference as dequantize_reference

    from reap.models.shared import blocks

    p = f"model.layers.{layer}.block_sparse_moe."
    def d(n):
        return t[p + n].double()

    x = x.double()
    probs = torch.sigmoid(x @ d("gate.weight").T)  # [N, E]
    ids = (probs + d("gate.e_score_correction_bias")).topk(cfg.num_experts_per_token).indices
    w = probs.gather(1, ids)
    w = w / w.sum(1, keepdim=True) * cfg.routed_scaling_factor  # [N, K]
    xl = x @ d("routed_expert_down_proj.weight").T  # [N, Dl]
    outs = torch.zeros(*ids.shape, xl.shape[1], dtype=torch.float64)  # [N, K, Dl]
    for e in ids.unique().tolist():
        q = {n: dequantize_reference(t[f"{p}experts.{e}.{n}.weight_packed"],
                                     t[f"{p}experts.{e}.{n}.weight_scale"]) for n in ("w1", "w2", "w3")}
        o = blocks.glu_mlp(xl, q["w1"], q["w3"], q["w2"], cfg.activation_situ_beta,
                           cfg.activation_situ_linear_beta)  # every token through expert e
        outs[ids == e] = o[(ids == e).any(1)]
    y = (outs * w[..., None]).sum(1)  # [N, Dl]
    rms = (y.pow(2).mean(-1) + cfg.rms_norm_eps).sqrt()  # [N]
    up = (outs * d("routed_expert_norm.weight")) @ d("routed_expert_up_proj.weight").T
    return MoERecord(layer, ids, w, probs, outs.norm(dim=-1), up.norm(dim=-1) / rms[:, None],
                     outs.abs().amax(-1))


def brute_force(env):
    """Statistics of a plain whole-model in-memory forward (all sequences in one batch) with
    per-token loops: {(layer, corpus index): {field: list}}, plus the sequences' corpora."""
    from reap.checkpoint import Checkpoint
    from reap.corpora import calibration_sequences, parse_spec
    from reap.models import family
    from reap.models.base import dict_weights
    from reap.tokenizer import load_tokenizer

    names = [n for n, _ in parse_spec(env["spec"])]
    seqs = calibration_sequences(env["spec"], load_tokenizer(env["model"]), N_TOK, T_LEN, 0)
    seq_corpus = [names.index(s.corpus) for s in seqs]
    with Checkpoint.open(env["model"]) as ck:
        t = {n: ck.read(n) for n in ck.tensors}
        fam = family(ck.config)
        cfg = fam.Config.from_dict(ck.config)
    model, get = fam.Model(cfg), dict_weights(t)
    state = model.embed(get, torch.tensor([s.ids for s in seqs]))
    records = []

    class Keep:
        wants_norms = True

        def on_moe(self, rec):
            records.append(rec)

    for i in range(model.n_layers):
        state, x = model.attn_block(i, get, state)
        if cfg.is_moe(i):
            records.append(naive_moe_record(x.reshape(-1, x.shape[-1]), t, cfg, i))
        state = model.finish_layer(i, state, model.mlp_block(i, get, x, observer=Keep()))
    for ref, got in zip(records[0::2], records[1::2]):  # the model's own record agrees
        assert torch.equal(ref.ids, got.ids)
        for f in ("weights", "probs", "latent_norm", "model_norm", "max_act"):
            torch.testing.assert_close(getattr(got, f).double(), getattr(ref, f), rtol=2e-4,
                                       atol=1e-5)
    rows = naive_rows(records[0::2], [(0, len(seqs))] * (len(records) // 2), seq_corpus, T_LEN,
                      cfg.num_experts, len(names))
    return rows, names, seq_corpus


@pytest.fixture(scope="session")
def brute(env):
    return brute_force(env)


def _check_against(files, brute):
    rows, names, seq_corpus = brute
    for c, name in enumerate(names):
        st = ExpertStats.load(files[name])
        assert st.tokens == seq_corpus.count(c) * T_LEN
        for li, layer in enumerate(st.layers):
            for field, want in rows[(layer, c)].items():
                got = getattr(st, field)
                got = got[:, li] if field == "seq_count" else got[li]
                exact = field in ("count", "coact", "seq_count")
                torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64),
                                           rtol=0 if exact else 2e-4, atol=0 if exact else 1e-4,
                                           msg=f"{name} layer {layer} {field}")


def test_streamed_statistics_equal_brute_force(base, brute, env):
    _check_against(base.files, brute)
    several = _cal(env, "passes", max_pass_seqs=3, batch=4)  # 4 MLP passes, other batches
    assert several.passes == 4
    _check_against(several.files, brute)
    merged = ExpertStats.load(base.files["all"])
    parts = [ExpertStats.load(base.files[n]) for n in brute[1]]
    assert torch.equal(merged.count, sum(p.count for p in parts))
    assert merged.tokens == N_TOK and merged.meta["corpus"] == env["spec"]
    from safetensors.torch import load_file

    tok = load_file(base.token_experts)  # ids [L, N, K] int16, seq_corpus [S]
    assert tok["ids"].dtype == torch.int16 and tok["seq_corpus"].tolist() == brute[2]
    for li in range(len(merged.layers)):
        counts = torch.bincount(tok["ids"][li].long().reshape(-1), minlength=merged.n_experts)
        assert torch.equal(counts, merged.count[li])


def test_each_expert_read_once_and_checkpoint_read_once(base):
    st = ExpertStats.load(base.files["all"])
    used = int((st.count > 0).sum())
    assert base.expert_reads_max == 1
    assert st.meta["expert_reads"] == used  # every routed expert read exactly once, no other
    assert base.checkpoint_bytes == sum(t.nbytes for t in Checkpoint.open(base_model(st)).tensors.values())
    assert 0.85 <= base.read_ratio <= 1.05, base.read_ratio
    assert st.meta["bytes_read"] == base.bytes_read and st.meta["passes"] == 1


def base_model(st):
    return st.meta["arguments"]["model"]


OUTPUTS = ("all.safetensors", "zh.safetensors", "code.safetensors", "token_experts.safetensors")


def _same_bytes(a, b):
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_resume_after_sigkill_is_byte_identical(env, base):
    import subprocess
    import sys

    out = env["root"] / "killed"
    code = (
        "import os, signal\n"
        "from reap.calibrate.pipeline import calibrate\n"
        "def kill(layer):\n"
        "    if layer == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"calibrate(model={env['model']!r}, corpus={env['spec']!r}, tokens={N_TOK}, "
        f"seq_len={T_LEN}, out={str(out)!r}, batch=3, save_token_experts=True, progress=False, "
        "hooks=kill)\n")
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, timeout=120,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not (out / "all.safetensors").exists()
    res = _cal(env, "killed")
    assert res.resumed_after == 2
    _same_bytes(out, env["root"] / "base")
    assert not (out / ".work").exists()


def test_resume_after_failure_mid_layer_and_refusal(env, base, monkeypatch):
    from reap.calibrate import runner
    from reap.errors import ExpertLoadError, ReapError

    real, calls = runner.StoreExperts.__call__, []

    def flaky(self, layer, expert):
        calls.append(layer)
        if layer == 3 and calls.count(3) == 5:  # in the middle of layer 3's MoE pass
            raise ExpertLoadError(f"layer {layer} expert {expert} failed to load: injected")
        return real(self, layer, expert)

    monkeypatch.setattr(runner.StoreExperts, "__call__", flaky)
    with pytest.raises(ExpertLoadError):
        _cal(env, "failed")
    monkeypatch.setattr(runner.StoreExperts, "__call__", real)
    work = env["root"] / "failed" / ".work"
    assert '"done": 2' in (work / "progress.json").read_text()
    with pytest.raises(ReapError, match="different arguments.*seed"):
        _cal(env, "failed", seed=1)
    res = _cal(env, "failed")
    assert res.resumed_after == 2
    _same_bytes(env["root"] / "failed", env["root"] / "base")


def test_two_shards_merged_equal_one_run(env, base):
    from reap.stats import merge

    halves = [_cal(env, f"shard{k}", shard=(k, 2)) for k in (1, 2)]
    for name in env["spec"].split("+"):
        full = ExpertStats.load(base.files[name])
        got = merge([ExpertStats.load(h.files[name]) for h in halves])
        assert got.tokens == full.tokens
        for field, want in full.tensors().items():
            have = getattr(got, field)
            if want.dtype == torch.float64:  # sums: float64 rounding of a different order
                torch.testing.assert_close(have, want, rtol=1e-12, atol=1e-12)
            elif want.is_floating_point():  # per-token maxima from batches of another shape
                torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(have, want), field


@pytest.mark.parametrize("args, message", [
    (["--corpus", "no-such-corpus"], "no-such-corpus"),
    (["--model-missing"], "no-such-model"),
    (["--seq-len", "2000000", "--tokens", "4000000"], "exceeds the model's limit"),
    (["--tokens", "16", "--seq-len", "32"], "less than one sequence"),
    (["--budget", "1MB"], "too small"),
])
def test_bad_input_is_one_line_exit_2(env, capsys, args, message):
    from reap.cli import main

    model = str(env["root"] / "no-such-model") if "--model-missing" in args else env["model"]
    args = [a for a in args if a != "--model-missing"]
    base_args = {"--corpus": env["spec"], "--tokens": "64", "--seq-len": "16"}
    for k, v in zip(args[::2], args[1::2]):
        base_args[k] = v
    argv = ["calibrate", model, "--out", str(env["root"] / "bad"), "--no-progress"]
    rc = main(argv + [x for kv in base_args.items() for x in kv])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("reap: error:") and "\n" not in err and message in err, err


def test_default_model_is_synthesized_on_first_use(env, tmp_path, monkeypatch, capsys):
    import reap.defaults
    from reap.cli import main

    monkeypatch.setenv("REAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(reap.defaults, "BUNDLED", tmp_path / "no-bundled-model")
    rc = main(["calibrate", "--corpus", env["spec"], "--tokens", "64", "--seq-len", "16",
               "--out", str(tmp_path / "out"), "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "synthesizing a random k3-tiny" in cap.err
    assert (tmp_path / "cache" / "models" / "k3-tiny-seed0" / "config.json").exists()
    st = ExpertStats.load(tmp_path / "out" / "all.safetensors")
    assert st.tokens == 64 and int(st.count.sum()) == 64 * st.top_k * len(st.layers)
