"""The shipped k3-mini model (reap/models/k3mini, made by tools/train_k3mini.py and
tools/export_k3mini.py): its files are exactly the released K3 layout of its config with
MXFP4 experts, its tokenizer round-trips every training domain, a forward from the files
reproduces the held-out losses its card records and they are far below the uniform loss, the
router spreads load over the experts and routes domains differently, and mlx-lm's reference
implementation loads the same files and computes the same logits."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from references import mxfp4_dequantize_reference

import reap.models
from reap.checkpoint import Checkpoint
from reap.corpora import sample_sequences
from reap.models import family
from reap.models.base import dict_weights
from reap.models.kimi_k3 import family as kimi_k3
from reap.quant import mxfp4
from reap.tokenizer import load_tokenizer

MODEL = Path(reap.models.__file__).parent / "k3mini"


@pytest.fixture(scope="module")
def shipped():
    if not (MODEL / "config.json").is_file():
        pytest.fail(f"{MODEL}: the bundled model is missing")
    ck = Checkpoint.open(MODEL)
    summary = json.loads((MODEL / "training_log.json").read_text())["summary"]
    weights = {n: ck.read(n) for n in ck.tensors}
    return ck, kimi_k3.Config.from_dict(ck.config), weights, summary


@pytest.fixture(scope="module")
def smoke(shipped):
    """The held-out sequences the card's smoke losses were measured on: {domain: [N, T+1]}."""
    _, _, _, summary = shipped
    tok = load_tokenizer(MODEL)
    n, t = summary["smoke_eval"]["sequences"], summary["smoke_eval"]["tokens"]
    return {
        d: torch.tensor([s.ids for s in sample_sequences(d, "eval", tok, n * (t + 1), t + 1)])
        for d in summary["domains"]
    }


class Usage:
    """Observer: tokens routed to each expert, per MoE layer and sequence ([B, E] float64)."""

    wants_norms = False

    def __init__(self, n_seqs, n_experts):
        self.b, self.n, self.counts = n_seqs, n_experts, {}

    def on_moe(self, rec):
        ids = rec.ids.reshape(self.b, -1)  # [B, T*K]
        c = torch.stack([torch.bincount(r, minlength=self.n) for r in ids]).double()  # [B, E]
        self.counts[rec.layer] = self.counts.get(rec.layer, 0) + c


def test_files_are_the_released_layout_with_mxfp4_experts(shipped):
    ck, cfg, _, _ = shipped
    assert ck.config["model_type"] == "kimi_k3" and ck.prefix == "language_model."
    specs = family(ck.config).layout(ck.config)
    assert {s.name for s in specs} == set(ck.tensors)
    for s in specs:
        info = ck.tensors[s.name]
        assert (info.dtype, tuple(info.shape)) == (s.dtype, tuple(s.shape)), s.name
    experts = [s for s in specs if s.expert is not None]
    assert experts and all(s.dtype == "U8" for s in experts)
    assert {s.name.rsplit(".", 1)[1] for s in experts} == {"weight_packed", "weight_scale"}
    # the K3 features the toolkit exercises
    assert 64 <= cfg.num_experts <= 128 and 4 <= cfg.num_experts_per_token <= 8
    assert cfg.first_k_dense_replace == 1 and cfg.num_shared_experts >= 1
    assert cfg.latent < cfg.hidden_size and cfg.latent_moe_use_norm and cfg.attn_res_block_size
    kinds = {cfg.is_kda(i) for i in range(cfg.num_hidden_layers)}
    assert kinds == {True, False}  # both KDA and MLA layers
    total = sum(p.stat().st_size for p in MODEL.iterdir())
    assert total < 40e6, total


def test_tokenizer_round_trips_each_domain(shipped):
    ck, cfg, _, summary = shipped
    tok = load_tokenizer(MODEL)
    assert tok.vocab_size == cfg.vocab_size
    assert tok.eos_id == ck.config["text_config"]["eos_token_id"]
    from reap.corpora import load_documents

    for d in summary["domains"]:
        text = load_documents(d, "eval")[0].text[:2000]
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert len(ids) < len(text.encode()) / 1.5, d  # the BPE actually merges in every domain


def test_forward_from_files_reproduces_card_losses(shipped, smoke):
    _, cfg, weights, summary = shipped
    model, get = kimi_k3.Model(cfg), dict_weights(weights)
    recorded = summary["smoke_eval"]["loss"]
    usage = {}
    for d, ids in smoke.items():
        usage[d] = Usage(ids.shape[0], cfg.num_experts)
        with torch.no_grad():
            logits = model.forward(get, ids[:, :-1], observer=usage[d])  # [N, T, V]
        loss = float(
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].reshape(-1))
        )
        assert loss == pytest.approx(recorded[d], abs=2e-3), d
        assert loss < math.log(cfg.vocab_size) - 2, (d, loss)  # perplexity 7x below uniform
    # every full-eval figure of the card is far below uniform, and MXFP4 cost little
    ev = summary["eval"]
    for d in summary["domains"]:
        assert ev["shipped"][d] < summary["uniform_loss"] - 2
        assert ev["mxfp4_experts"][d] - ev["float_experts"][d] < 0.1
    _check_routing(usage, cfg)


def _spread(counts: torch.Tensor, labels: torch.Tensor, n_groups: int) -> float:
    """Sum over layers and domains of the total-variation distance between a domain's expert
    usage and the pooled usage. counts [S, L, E] per sequence, labels [S] domain ids."""
    pooled = counts.sum(0)
    pooled = pooled / pooled.sum(-1, keepdim=True)  # [L, E]
    out = 0.0
    for g in range(n_groups):
        dom = counts[labels == g].sum(0)
        out += 0.5 * float((dom / dom.sum(-1, keepdim=True) - pooled).abs().sum())
    return out


def _check_routing(usage: dict, cfg) -> None:
    """Balanced load (every expert used, none hoarding) and domain-dependent routing: a
    permutation test over held-out sequences. Expert usage is more domain-specific under the
    true domain labels than under 198 of 200 random relabelings of the same sequences
    (sequence-to-sequence variation within a domain is the null)."""
    layers = sorted(usage["zh"].counts)
    for layer in layers:
        total = sum(u.counts[layer].sum(0) for u in usage.values())  # [E]
        assert (total > 0).all() and total.max() / total.mean() < 3, layer
    counts = torch.cat(
        [torch.stack([u.counts[i] for i in layers], 1) for u in usage.values()]
    )  # [S, L, E]
    labels = torch.cat([torch.full((u.b,), g) for g, u in enumerate(usage.values())])
    observed = _spread(counts, labels, len(usage))
    g = torch.Generator().manual_seed(0)
    null = [
        _spread(counts, labels[torch.randperm(len(labels), generator=g)], len(usage))
        for _ in range(200)
    ]
    assert observed > sorted(null)[-3], (observed, max(null))  # p < 0.015


def test_card_losses_beat_the_best_unigram_model(shipped):
    """The card's held-out losses (every domain, shipped files) are at least 1 nat below the
    entropy of the unigram distribution fit to the very tokens scored: the best any
    context-free predictor could do on them (an optimistic, in-sample bar)."""
    _, cfg, _, summary = shipped
    tok, ev = load_tokenizer(MODEL), summary["eval"]
    n, t = ev["sequences_per_domain"], ev["tokens_per_sequence"]
    for d in summary["domains"]:
        seqs = sample_sequences(d, "eval", tok, n * (t + 1), t + 1)
        targets = torch.tensor([s.ids[1:] for s in seqs]).reshape(-1)
        p = torch.bincount(targets, minlength=cfg.vocab_size).double() / targets.numel()
        entropy = float(-(p[p > 0] * p[p > 0].log()).sum())
        assert ev["shipped"][d] < entropy - 1.0, (d, ev["shipped"][d], entropy)


def test_mlx_lm_loads_the_files_and_agrees(shipped, smoke):
    mx = pytest.importorskip("mlx.core")
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    _, cfg, weights, _ = shipped
    ref, _ = load_model(MODEL)
    # compute in float32 on both sides (bf16 weights upcast exactly; MXFP4 experts untouched)
    ref.update(
        tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.bfloat16 else x, ref.parameters())
    )
    ids = smoke["en"][:1, :48]
    ours = kimi_k3.Model(cfg).forward(dict_weights(weights), ids).numpy()
    theirs = np.array(ref(mx.array(ids.numpy())))
    assert np.abs(ours - theirs).max() < 1e-3 * max(1.0, np.abs(theirs).max())
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_expert_bytes_decode_like_the_reference(shipped):
    """One expert per MoE layer: the fast MXFP4 decode equals the bit-level reference decoder,
    and decoded experts are distinct, finite, non-degenerate matrices."""
    _, cfg, weights, _ = shipped
    for layer in (i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)):
        mats = []
        for e in (0, cfg.num_experts - 1):
            p, s = (weights[n] for n in kimi_k3.expert_tensor_names(cfg, layer, e)[:2])  # w1
            fast = mxfp4.dequantize(p, s)
            torch.testing.assert_close(
                fast.double(), mxfp4_dequantize_reference(p, s).double(), rtol=0, atol=0
            )
            assert torch.isfinite(fast).all() and fast.std() > 0
            mats.append(fast)
        assert not torch.equal(mats[0], mats[1])
