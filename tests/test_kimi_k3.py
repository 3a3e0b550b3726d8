"""The Kimi K3 family: our torch model against mlx-lm's reference implementation on a synthetic
k3-tiny checkpoint (prefill and incremental decoding), the layer-at-a-time protocol with weights
pulled from the checkpoint store, the MoE observer record against a brute-force recomputation,
and the released layout's published K3 figures."""

import math

import numpy as np
import pytest
import torch
from references import mxfp4_dequantize_reference

from reap.checkpoint import Checkpoint
from reap.errors import ReapError
from reap.models import builtin_config, family
from reap.models.base import dict_weights
from reap.models.kimi_k3 import family as kimi_k3
from reap.models.shared import blocks as B
from reap.synth import synth

PROMPT = [[3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3") / "tiny"
    synth("k3-tiny", path, seed=7, dtype="float32")
    ck = Checkpoint.open(path)
    cfg = kimi_k3.Config.from_dict(ck.config)
    weights = {n: ck.read(n) for n in ck.tensors}
    return path, ck, cfg, weights


def test_matches_mlx_lm_prefill_and_decode(tiny):
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model

    path, _, cfg, weights = tiny
    ref_model, _ = load_model(path)
    model, get = kimi_k3.Model(cfg), dict_weights(weights)
    ref_cache, caches = ref_model.make_cache(), model.new_caches()
    ref = np.array(ref_model(mx.array(PROMPT), cache=ref_cache))
    ours = model.forward(get, torch.tensor(PROMPT), caches).numpy()
    assert ours.shape == ref.shape == (1, 12, cfg.vocab_size)
    worst = np.abs(ours - ref).max()
    tokens_ref, tokens = [int(ref[0, -1].argmax())], [int(ours[0, -1].argmax())]
    for _ in range(8):  # greedy decoding, each side feeding its own tokens
        ref = np.array(ref_model(mx.array([[tokens_ref[-1]]]), cache=ref_cache))
        ours = model.forward(get, torch.tensor([[tokens[-1]]]), caches).numpy()
        worst = max(worst, np.abs(ours - ref).max())
        tokens_ref.append(int(ref[0, -1].argmax()))
        tokens.append(int(ours[0, -1].argmax()))
    assert worst < 1e-4, worst  # measured ~1e-5 with logits of magnitude ~4
    assert tokens == tokens_ref


def test_prefill_in_pieces_equals_one_prefill(tiny):
    """Caches carry KDA conv/recurrent state and the MLA latent KV across multi-token calls."""
    _, _, cfg, weights = tiny
    model, get = kimi_k3.Model(cfg), dict_weights(weights)
    ids = torch.tensor(PROMPT * 2)
    whole = model.forward(get, ids)
    caches = model.new_caches()
    pieces = [model.forward(get, ids[:, a:b], caches) for a, b in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-5)
    assert caches[3].length == 12 and caches[0].state.shape == (2, 2, 32, 32)


class Recorder:
    def __init__(self, wants_norms=True):
        self.wants_norms, self.records = wants_norms, []

    def on_moe(self, record):
        self.records.append(record)


def test_layer_at_a_time_from_store_equals_forward(tiny):
    _, ck, cfg, weights = tiny
    model = kimi_k3.Model(cfg)
    ids = torch.tensor(PROMPT * 2)
    whole = model.forward(dict_weights(weights), ids)
    calls = {}
    default = model.default_experts(ck.read)

    def experts(layer, e):
        calls[layer, e] = calls.get((layer, e), 0) + 1
        return default(layer, e)

    obs, state = Recorder(), model.embed(ck.read, ids)
    for i in range(model.n_layers):
        state, x = model.attn_block(i, ck.read, state.to("cpu"))
        state = model.finish_layer(i, state, model.mlp_block(i, ck.read, x, experts, obs))
    torch.testing.assert_close(model.head(ck.read, state), whole, rtol=0, atol=0)
    used = {(r.layer, e) for r in obs.records for e in r.ids.flatten().tolist()}
    assert set(calls) == used and set(calls.values()) == {1}
    assert [r.layer for r in obs.records] == [
        i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)
    ]


def _naive_moe(cfg, W, x):
    """Token by token: router by sorting, experts from the reference MXFP4 decoder; returns
    per token the chosen ids, weights, each expert's exact share of the layer output, and the
    layer output."""
    p = "block_sparse_moe."
    deq = {}
    rows = []
    for xt in x:
        xt = xt.double()
        probs = torch.sigmoid(W[p + "gate.weight"].double() @ xt)
        sel = probs + W[p + "gate.e_score_correction_bias"].double()
        ids = sorted(range(cfg.num_experts), key=lambda e: -float(sel[e]))[
            : cfg.num_experts_per_token
        ]
        w = probs[ids] / probs[ids].sum() * cfg.routed_scaling_factor
        xl = W[p + "routed_expert_down_proj.weight"].double() @ xt
        outs = []
        for e in ids:
            if e not in deq:
                deq[e] = {
                    s: mxfp4_dequantize_reference(
                        W[f"{p}experts.{e}.{s}.weight_packed"],
                        W[f"{p}experts.{e}.{s}.weight_scale"],
                    )
                    for s in ("w1", "w2", "w3")
                }
            d = deq[e]
            outs.append(d["w2"] @ B.situ(d["w3"] @ xl, d["w1"] @ xl, 4.0, 25.0))
        y = sum(wk * o for wk, o in zip(w, outs))
        rms = math.sqrt(float(y.pow(2).mean()) + cfg.rms_norm_eps)
        g, up = W[p + "routed_expert_norm.weight"].double(), W[p + "routed_expert_up_proj.weight"]
        shares = [wk * (up.double() @ (g * o)) / rms for wk, o in zip(w, outs)]
        sh = [W[f"{p}shared_experts.{n}_proj.weight"].double() for n in ("gate", "up", "down")]
        shared = sh[2] @ B.situ(sh[1] @ xt, sh[0] @ xt, 4.0, 25.0)
        rows.append((ids, w, outs, shares, sum(shares) + shared))
    return rows


def test_observer_record_matches_brute_force(tiny):
    _, _ck, cfg, weights = tiny
    model, get = kimi_k3.Model(cfg), dict_weights(weights)
    layer = 2
    state = model.embed(get, torch.tensor(PROMPT))
    for i in range(layer):
        state, x = model.attn_block(i, get, state)
        state = model.finish_layer(i, state, model.mlp_block(i, get, x))
    _, x = model.attn_block(layer, get, state)
    obs = Recorder()
    y = model.mlp_block(layer, get, x, observer=obs).reshape(-1, cfg.hidden_size)
    (rec,) = obs.records
    pre = f"model.layers.{layer}."
    W = {n[len(pre) :]: t for n, t in weights.items() if n.startswith(pre)}
    for n, (ids, w, outs, shares, out) in enumerate(_naive_moe(cfg, W, x.reshape(-1, x.shape[-1]))):
        assert rec.ids[n].tolist() == ids
        torch.testing.assert_close(rec.weights[n].double(), w, rtol=1e-5, atol=1e-6)
        for k in range(len(ids)):
            torch.testing.assert_close(
                rec.latent_norm[n, k].item(), outs[k].norm().item(), rtol=1e-4, atol=1e-6
            )
            torch.testing.assert_close(
                rec.max_act[n, k].item(), outs[k].abs().max().item(), rtol=1e-4, atol=1e-6
            )
            torch.testing.assert_close(
                rec.model_norm[n, k].item(), (shares[k].norm() / w[k]).item(), rtol=1e-4, atol=1e-6
            )
        torch.testing.assert_close(y[n].double(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        rec.probs,
        torch.sigmoid(x.reshape(-1, cfg.hidden_size) @ W["block_sparse_moe.gate.weight"].T),
    )


def test_bfloat16_compute_tracks_float32(tiny):
    """Each block in bf16, fed the fp32 run's inputs, stays within bf16 rounding of fp32 (whole
    forwards are not compared: a near-tie in routing may flip an expert)."""
    _, _, cfg, weights = tiny
    get = dict_weights(weights)
    ref, half = kimi_k3.Model(cfg), kimi_k3.Model(cfg, dtype=torch.bfloat16)
    state = ref.embed(get, torch.tensor(PROMPT))
    torch.testing.assert_close(
        half.embed(get, torch.tensor(PROMPT)).hidden.float(), state.hidden, rtol=1e-2, atol=1e-2
    )
    for i in range(ref.n_layers):
        bf = kimi_k3.State(state.hidden.bfloat16(), [b.bfloat16() for b in state.blocks])
        state, x = ref.attn_block(i, get, state)
        x_half = half.attn_block(i, get, bf)[1].float()
        assert (x_half - x).abs().max() < 0.03 * x.abs().max()
        obs, obs_half = Recorder(False), Recorder(False)
        y = ref.mlp_block(i, get, x, observer=obs)
        y_half = half.mlp_block(i, get, x.bfloat16(), observer=obs_half)
        assert y_half.dtype == torch.bfloat16
        same = torch.ones(x.shape[1], dtype=torch.bool)
        if obs.records:  # compare the tokens whose routing did not flip (nearly all of them)
            same = (
                obs.records[0].ids.sort(-1).values == obs_half.records[0].ids.sort(-1).values
            ).all(-1)
            assert same.float().mean() >= 0.75
        err = (y_half.float() - y).abs()[0, same].max()
        assert err < 0.03 * y.abs().max()
        state = ref.finish_layer(i, state, y)


def test_k3_full_layout_reproduces_published_figures():
    cfg_d = builtin_config("k3-full")
    specs = kimi_k3.layout(cfg_d)
    assert len(specs) == 497_220 and len({s.name for s in specs}) == 497_220
    by = {}
    for s in specs:
        # MXFP4 packs two parameters per byte; its scale bytes are not parameters
        n = (
            2 * s.numel
            if s.name.endswith("weight_packed")
            else (0 if s.name.endswith("weight_scale") else s.numel)
        )
        by[s.component] = by.get(s.component, 0) + n
    total = sum(by.values())
    assert abs(total / 2780.0e9 - 1) < 0.005
    assert by["routed_experts"] == 82_432 * 33_030_144
    trunk = total - by["routed_experts"] - by["vision"]
    assert trunk == 56_743_648_000
    assert by["embed_head"] == 2 * 163_840 * 7168
    assert abs(by["shared_experts"] / 12.2e9 - 1) < 0.005
    assert abs(by["latent_proj"] / 4.7e9 - 1) < 0.01
    assert abs(sum(s.nbytes for s in specs) / 1.56e12 - 1) < 0.005
    expert = [s for s in specs if (s.layer, s.expert) == (5, 17)]
    assert sum(s.nbytes for s in expert) == 17_547_264
    assert [s.name for s in expert] == kimi_k3.expert_tensor_names(kimi_k3.Config.from_dict(cfg_d), 5, 17)
    assert [s.shape for s in expert] == [
        (3072, 1792),
        (3072, 112),
        (3584, 1536),
        (3584, 96),
        (3072, 1792),
        (3072, 112),
    ]
    cfg = kimi_k3.Config.from_dict(cfg_d)
    mla = [i + 1 for i in range(93) if not cfg.is_kda(i)]
    assert mla == list(range(4, 93, 4)) + [93] and sum(map(cfg.is_kda, range(93))) == 69


def test_names_and_pruning_helpers():
    assert kimi_k3.expert_key(
        "language_model.model.layers.12.block_sparse_moe.experts.345.w2.weight_scale"
    ) == (12, 345)
    assert kimi_k3.expert_key("model.layers.12.block_sparse_moe.gate.weight") is None
    cfg_d = builtin_config("k3-tiny")
    assert kimi_k3.router_tensors(kimi_k3.Config.from_dict(cfg_d), 3) == {
        "model.layers.3.block_sparse_moe.gate.weight": 0,
        "model.layers.3.block_sparse_moe.gate.e_score_correction_bias": 0,
    }
    small = kimi_k3.with_experts(cfg_d, 3)
    assert small["text_config"]["num_experts"] == 3
    assert small["text_config"]["num_experts_per_token"] == 3
    assert cfg_d["text_config"]["num_experts"] == 16  # the input is not modified
    assert kimi_k3.with_experts(cfg_d, 8)["text_config"]["num_experts_per_token"] == 4
    specs = kimi_k3.layout(small)
    assert {s.expert for s in specs if s.expert is not None} == {0, 1, 2}


def test_config_and_family_dispatch():
    full = builtin_config("k3-tiny", layers=3)
    assert kimi_k3.Config.from_dict(full) == kimi_k3.Config.from_dict(full["text_config"])
    assert family(full) is kimi_k3 and family(full["text_config"]) is kimi_k3
    assert kimi_k3.Config.from_dict(full).num_hidden_layers == 3
    with pytest.raises(ReapError, match="unsupported model_type 'llama'"):
        family({"model_type": "llama"})
    with pytest.raises(ReapError, match="unknown built-in config"):
        builtin_config("k3-huge")
    bad = dict(full["text_config"], hidden_act="silu")
    with pytest.raises(ReapError, match="hidden_act"):
        kimi_k3.Config.from_dict(bad)
