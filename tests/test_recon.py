"""`--criterion recon` (`reap.prune.recon`): its objective against per-token loops, its search
against brute force (never worse than REAP's plan; the optimum of an enumerable layer, or its
gap), and its streamed pass against an in-memory forward of a tiny model."""

import itertools
import json

import pytest
import torch

from reap.cli import main
from reap.prune import recon, recon_pass
from reap.prune.plan_file import Plan


def naive_error(ids, w, vecs, kept) -> float:
    """sum_t ||sum_k w u - c sum_{k in S} w u||^2 by loops over explicit vectors [N, K, D]."""
    total = 0.0
    for t in range(ids.shape[0]):
        full = sum(w[t, k] * vecs[t, k] for k in range(ids.shape[1]))
        alive = [k for k in range(ids.shape[1]) if int(ids[t, k]) in kept]
        wa = sum(float(w[t, k]) for k in alive)
        part = torch.zeros_like(full)
        if wa > 0:
            c = float(w[t].sum()) / wa
            part = c * sum(w[t, k] * vecs[t, k] for k in alive)
        total += float((full - part).pow(2).sum())
    return total


def layer(N, K, E, D, seed, diagonal=False):
    """Random tokens: ids [N, K] distinct per token, w [N, K], vectors [N, K, D]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    bias = torch.rand(E, generator=g, dtype=torch.float64) * 3  # some experts matter more
    w = torch.rand(N, K, generator=g, dtype=torch.float64) + 0.05
    vecs = torch.randn(N, K, D, generator=g, dtype=torch.float64) * bias[ids][..., None]
    if diagonal:  # orthogonal contributions: one coordinate per slot
        vecs = torch.diag_embed(vecs.norm(dim=-1))  # [N, K, K]
    wv = w[..., None] * vecs
    gram = torch.einsum("nkd,njd->nkj", wv, wv)
    return ids, w, vecs, recon.LayerTokens(ids, w, gram, torch.ones(N, dtype=torch.float64))


def test_objective_and_flip_deltas_equal_loops():
    ids, w, vecs, t = layer(40, 3, 8, 5, 0)
    for kept in ([0, 1, 2, 3], [4, 5], list(range(8)), [7]):
        assert recon.objective(t, kept, 8) == pytest.approx(
            naive_error(ids, w, vecs, kept), rel=1e-9
        )
    ids, w, vecs, full = layer(40, 3, 8, 5, 1, diagonal=True)
    diag = recon.LayerTokens(ids, w, torch.diagonal(full.gram, dim1=1, dim2=2), full.scale)
    alive = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    for t in (full, diag):
        err = recon.token_error(t, alive)
        d = recon.flip_deltas(t, alive, err)
        for e in range(8):
            flipped = alive.clone()
            flipped[e] = ~flipped[e]
            want = naive_error(ids, w, vecs, flipped.nonzero().squeeze(1).tolist()) - float(
                err.sum()
            )
            assert float(d[e]) == pytest.approx(want, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("diagonal", [True, False])
def test_eight_experts_keep_four_optimum_or_gap(diagonal, capsys, monkeypatch):
    """All 70 kept sets enumerated: recon's search (enumeration switched off) finds the optimum
    or its gap is reported (printed); it is never worse than the REAP-like start it is given;
    with enumeration on (the default for a layer this small) it returns the optimum."""
    _, _, _, t = layer(60, 3, 8, 6, 99, diagonal)
    values = {s: recon.objective(t, list(s), 8) for s in itertools.combinations(range(8), 4)}
    kept, rec = recon.select_layer(t, 8, 4, set(), [0, 1, 2, 3])
    assert rec["exact"] and rec["recon"] == pytest.approx(min(values.values()), rel=1e-12)
    monkeypatch.setattr(recon, "EXACT_LIMIT", 0)
    found, gaps = 0, []
    for seed in range(12):
        _, _, _, t = layer(60, 3, 8, 6, seed, diagonal)
        values = {s: recon.objective(t, list(s), 8) for s in itertools.combinations(range(8), 4)}
        best = min(values.values())
        start = [0, 1, 2, 3]
        kept, rec = recon.select_layer(t, 8, 4, set(), start)
        assert rec["recon"] == pytest.approx(values[tuple(kept)], rel=1e-12)
        assert rec["recon"] <= values[tuple(start)] + 1e-12
        gap = rec["recon"] / best - 1
        found += gap < 1e-12
        gaps.append(gap)
    with capsys.disabled():
        print(
            f"\nrecon 8-choose-4 ({'diagonal' if diagonal else 'full'} Gram): optimum in "
            f"{found}/12, largest gap {max(gaps):.2%}"
        )
    assert found >= 10 and max(gaps) < 0.2


def test_protected_experts_stay():
    _, _, _, t = layer(50, 2, 8, 4, 3)
    kept, _ = recon.select_layer(t, 8, 3, {6}, [0, 1, 6])
    assert 6 in kept and len(kept) == 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from reap.calibrate.pipeline import calibrate
    from reap.synth import synth

    root = tmp_path_factory.mktemp("recon")
    model = synth("k3-tiny", root / "model", seed=7, dtype="float32")
    path = root / "c.jsonl"
    with open(path, "w") as f:
        f.writelines(
            json.dumps({"id": str(i), "text": " ".join(f"w{(i * j) % 97}" for j in range(60))})
            + "\n"
            for i in range(40)
        )
    calibrate(
        model=model, corpus=str(path), tokens=128, seq_len=16, out=str(root / "run"), progress=False
    )
    return root, model


def test_streamed_pass_records_the_forward_and_beats_reap(tiny, tmp_path, capsys):
    from reap.stats import ExpertStats
    from tests.test_predict import forward_records

    root, model = tiny
    stats = str(root / "run" / "c.safetensors")
    st = ExpertStats.load(stats)
    toks = recon_pass.collect([("c", stats, st)], {"c": 1.0}, None, 4_000_000_000)
    recs, _, _ = forward_records(model, str(root / "c.jsonl"), tokens=128, seq_len=16)
    for la in st.layers:
        r = recs[la]
        assert torch.equal(toks[la].ids, r.ids)
        want = (r.weights.double() * r.model_norm.double()).pow(2)  # w^2 ||u||^2
        assert toks[la].gram.dim() == 3 and toks[la].norm is not None  # the full Gram
        diag = torch.diagonal(toks[la].gram, dim1=1, dim2=2)
        torch.testing.assert_close(diag, want, rtol=1e-4, atol=1e-8)
    out = tmp_path / "p.json"
    assert (
        main(
            [
                "plan",
                str(root / "run"),
                "--criterion",
                "recon",
                "--keep",
                "6",
                "--out",
                str(out),
                "--budget",
                "2GB",
            ]
        )
        == 0
    )
    plan = Plan.load(out)
    assert plan.criterion == "recon" and plan.predictions is not None
    assert plan.recon["gram"] == "full" and plan.recon["method"].endswith("full Gram")
    for la, rec in plan.recon["layers"].items():
        # brute force: the objective of each kept set recomputed from the recorded tokens
        t = toks[int(la)]
        assert recon.objective(t, plan.keep[int(la)], st.n_experts) == pytest.approx(rec["recon"])
        assert rec["recon"] <= rec["reap"] + 1e-12
    from reap.prune.plan import make_plan

    reap_plan = make_plan(stats=[stats], keep=6)  # REAP's set for the same budget
    for la in st.layers:
        t = toks[la]
        assert (
            recon.objective(t, plan.keep[la], st.n_experts)
            <= recon.objective(t, reap_plan.keep[la], st.n_experts) + 1e-12
        )


# -- the per-token Gram (MoERecord.gram) and the exact objective ---------------------------------
class Keep:
    """In-memory observer: every MoE record, with its Gram."""

    wants_norms, wants_gram = True, True

    def __init__(self):
        self.recs = {}

    def on_moe(self, rec):
        self.recs[rec.layer] = rec


def k3_inputs(model, n_seq=2, seq_len=12):
    """(Model, getter, {layer: MoE input x [N, D]}, {layer: MoERecord with its Gram}) of one
    in-memory forward of a checkpoint on random token ids."""
    from tests.family_runner import load_ours

    _, _, m, get = load_ours(model)
    ids = torch.randint(0, 250, (n_seq, seq_len), generator=torch.Generator().manual_seed(5))
    xs, obs = {}, Keep()
    state = m.embed(get, ids)
    for i in range(m.n_layers):
        state, x = m.attn_block(i, get, state)
        xs[i] = x.reshape(-1, x.shape[-1])
        state = m.finish_layer(i, state, m.mlp_block(i, get, x, observer=obs))
    return m, get, xs, obs.recs


def naive_k3_gram(m, get, x, rec):
    """G [N, K, K] of one LatentMoE layer by per-token, per-slot loops: u_k = up(g * o_k) / rms
    of the token's weighted latent sum (K3's RMSNorm), o_k = expert k on down(x)."""
    from reap.models.kimi_k3.blocks import expert_glu

    pre = f"model.layers.{rec.layer}.block_sparse_moe."
    down, up = (
        get(pre + "routed_expert_down_proj.weight"),
        get(pre + "routed_expert_up_proj.weight"),
    )
    g, d = get(pre + "routed_expert_norm.weight").float(), m.moe
    src = m.default_experts(get)
    N, K = rec.ids.shape
    G = torch.zeros(N, K, K, dtype=torch.float64)
    for n in range(N):
        xl = x[n : n + 1] @ down.T
        o = [expert_glu(xl, src(rec.layer, int(e)), d.beta, d.linear_beta)[0] for e in rec.ids[n]]
        y = sum(rec.weights[n, k] * o[k] for k in range(K))
        rms = (y.pow(2).mean() + d.eps).sqrt()
        u = torch.stack([(up @ (g * ok)) / rms for ok in o]).double()  # [K, D]
        G[n] = u @ u.T
    return G


def test_k3_gram_equals_per_token_loop(tiny):
    m, get, xs, recs = k3_inputs(tiny[1])
    for la, rec in recs.items():
        want = naive_k3_gram(m, get, xs[la], rec)
        tol = 1e-5 * float(want.abs().max())  # float32 kernels of different shapes
        torch.testing.assert_close(rec.gram.double(), want, rtol=1e-4, atol=tol)
        diag = torch.diagonal(rec.gram, dim1=1, dim2=2)
        torch.testing.assert_close(diag, rec.model_norm.pow(2), rtol=1e-4, atol=1e-6)
        w = rec.weights.double()  # the full sum's rms, relative to itself: 1
        one = torch.einsum("nk,nkj,nj->n", w, rec.norm_gram.double(), w) + rec.norm_eps
        torch.testing.assert_close(one, torch.ones_like(one), rtol=1e-5, atol=0)


def brute_force(m, get, x, layer, alive, monkeypatch, module, name):
    """sum_t ||y_t - y'_t||^2 of MoE layer `layer` actually run on x [N, D] twice: as is, and
    with the router's `name` in `module` patched to zero the dropped experts' weights and
    renormalise the survivors to the token's total (same top-k)."""
    y = m.mlp_block(layer, get, x[None])[0].double()
    orig = getattr(module, name)

    def pruned(*args, **kw):
        ids, w, probs = orig(*args, **kw)
        a = alive[ids].float()
        total, kept = w.sum(-1, keepdim=True), (w * a).sum(-1, keepdim=True)
        return ids, torch.where(kept > 0, w * a * total / kept.clamp(min=1e-30), 0 * w), probs

    monkeypatch.setattr(module, name, pruned)
    yp = m.mlp_block(layer, get, x[None])[0].double()
    monkeypatch.setattr(module, name, orig)
    return float((y - yp).pow(2).sum())


def record_tokens(rec):
    """LayerTokens of one record through the recon pass's collector, with unit token scale."""
    sink = recon_pass.Collector({0: 1.0})
    sink(rec, torch.zeros(rec.ids.shape[0], dtype=torch.int64))
    t = sink.layer(rec.layer)
    t.scale = torch.ones_like(t.scale)
    return t


def check_exact_objective(m, get, xs, recs, E, monkeypatch, module, name, norm):
    g = torch.Generator().manual_seed(3)
    for la, rec in recs.items():
        t = record_tokens(rec)
        assert t.gram.dim() == 3 and (t.norm is not None) == norm
        for size in (1, E // 4, E // 2, E - 1):
            kept = torch.randperm(E, generator=g)[:size].tolist()
            alive = torch.zeros(E, dtype=torch.bool)
            alive[kept] = True
            want = brute_force(m, get, xs[la], la, alive, monkeypatch, module, name)
            assert recon.objective(t, kept, E) == pytest.approx(want, rel=2e-3, abs=1e-6)
            err = t.scale * recon.token_error(t, alive)  # single flips: the objective again
            d = recon.flip_deltas(t, alive, err)
            for e in (kept[0], next(i for i in range(E) if i not in kept)):
                flip = alive.clone()
                flip[e] = ~flip[e]
                v = recon.objective(t, flip.nonzero().squeeze(1).tolist(), E)
                assert float(err.sum() + d[e]) == pytest.approx(v, rel=1e-9, abs=1e-12)


def test_k3_objective_is_the_pruned_block_error(tiny, monkeypatch):
    """The key proof (LatentMoE with its RMSNorm): objective = ||y - y'||^2 of the block run."""
    from reap.models.kimi_k3 import blocks as kimi_k3_blocks

    m, get, xs, recs = k3_inputs(tiny[1])
    E = m.cfg.num_experts
    check_exact_objective(m, get, xs, recs, E, monkeypatch, kimi_k3_blocks, "route", norm=True)


QWEN = {
    "vocab_size": 320, "hidden_size": 48, "intermediate_size": 64, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12,
    "num_experts": 8, "num_experts_per_tok": 3, "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip


def test_qwen3_moe_gram_and_objective(tmp_path, monkeypatch):
    """Qwen3-MoE: our records' Gram equals one from transformers' experts per token (hooks on
    its forward), and the objective equals the pruned block's error."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.models.shared import blocks
    from tests import family_runner as R

    path, hf = R.save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, tmp_path / "m", seed=2)
    m, get, xs, recs = k3_inputs(path)
    seen = {}

    def grab(la):
        def hook(mod, a, kw):  # the experts module's (hidden [N, D], ids [N, K])
            seen[la] = (list(a) + list(kw.values()))[:2]

        return hook

    hooks = [
        ex.register_forward_pre_hook(grab(la), with_kwargs=True) for la, _, ex in R.moe_modules(hf)
    ]
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf(input_ids=ids)
    for h in hooks:
        h.remove()
    experts = {la: ex for la, _, ex in R.moe_modules(hf)}
    for la, rec in recs.items():
        x, hf_ids = seen[la]
        assert torch.equal(hf_ids.reshape(rec.ids.shape), rec.ids)
        want = torch.zeros(rec.gram.shape, dtype=torch.float64)
        with torch.no_grad():
            for n in range(x.shape[0]):
                u = torch.cat(
                    [R.expert_output(experts[la], x[n : n + 1], int(e)) for e in rec.ids[n]]
                )
                want[n] = (u @ u.T).double()
        tol = 1e-5 * float(want.abs().max())
        torch.testing.assert_close(rec.gram.double(), want, rtol=1e-4, atol=tol)
        assert rec.norm_gram is None
    check_exact_objective(m, get, xs, recs, 8, monkeypatch, blocks, "softmax_topk", norm=False)


def test_gram_only_when_asked(tiny):
    """The calibration pass hands records a Gram only for an observer that sets wants_gram."""
    from reap.calibrate.pipeline import calibrate

    root, model = tiny
    got = {}

    def plain(rec, corpus):
        got.setdefault("plain", rec.gram)

    class Asks:
        wants_gram = True

        def __call__(self, rec, corpus):
            got.setdefault("asks", rec.gram)

    for name, obs in (("p", plain), ("a", Asks())):
        calibrate(model=model, corpus=str(root / "c.jsonl"), tokens=32, seq_len=16,
                  out=str(root / name), progress=False, observe=obs)  # fmt: skip
    assert got["plain"] is None and got["asks"].shape[1:] == (4, 4)
