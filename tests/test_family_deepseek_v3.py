"""The DeepSeek-V3 / Kimi K2 family against its oracles, on tiny random models made and saved
offline by transformers (per-expert tensors, read in place): logits equal transformers' and
mlx-lm's (prefill and incremental decode, fp32), the streaming engine's greedy tokens equal
transformers' under a small budget, calibration statistics equal brute-force hooks on the
transformers model, and a `reap plan` + `reap prune` checkpoint loads in transformers with the
same logits as our engine on it (the shared checks of tests/family_runner.py). Grouped routing
is also checked against a per-token loop, FP8 releases against a naive dequantization."""

from __future__ import annotations

import json
import os
from pathlib import Path

import family_runner as R
import numpy as np
import pytest
import torch

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.errors import ReapError
from reap.models import family
from reap.models.base import dict_weights
from reap.models.deepseek_v3 import family as ds
from reap.models.shared import blocks as B
from reap.models.shared.attention import rope_settings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
PROMPT = [[3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]]
BASE = {
    "vocab_size": 320,  # the byte tokenizer's 257 ids fit
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
VARIANTS = {
    # q_lora, 16 experts in 4 groups (2 kept), YaRN with mscale: the DeepSeek-V3 / Kimi K2 shape
    "yarn": {
        "q_lora_rank": 48,
        "n_routed_experts": 16,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    # no q_lora, 8 experts in 2 groups (1 kept), two shared experts, plain RoPE, tied head
    "plain": {
        "q_lora_rank": None,
        "n_routed_experts": 8,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
    },
}


def _make(root: Path, name: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """(path, transformers model) of variant `name` saved under `root` (random weights and
    correction bias, see `family_runner.randomize`)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {**BASE, **VARIANTS[name]}
    path, model = R.save_hf_tiny(DeepseekV3ForCausalLM, DeepseekV3Config, kwargs, root / name, seed)
    return Path(path), model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def hf(request, tmp_path_factory):
    return _make(tmp_path_factory.mktemp("ds"), request.param)


@pytest.fixture(scope="module")
def yarn(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("ds"), "yarn", seed=1)


# -- the forward against the oracles ------------------------------------------------------------
def test_logits_equal_transformers_prefill_and_decode(hf):
    path, model = hf
    print("transformers", R.check_logits(path, model, PROMPT[0]))


def test_rotate_half_rope_equals_transformers(hf, tmp_path):
    """rope_interleave false (rotate-half pairing) on the same weights."""
    path, _ = hf
    half = R.with_config(path, tmp_path / "m", rope_interleave=False)
    R.check_logits(half, R.load_hf(half), PROMPT[0], steps=3)
    assert R.prefill_change(path, half, PROMPT[0]).max() > 1e-2  # the pairing matters


def test_logits_equal_mlx_lm_prefill_and_decode(hf, tmp_path):
    """mlx-lm reads the older rope keys, and its deepseek_v3 always has its own head: it loads a
    copy with both, ours the checkpoint as transformers wrote it (tied head or not)."""
    path, _ = hf
    tied = json.loads((path / "config.json").read_text()).get("tie_word_embeddings", False)
    ref = R.for_mlx(path, tmp_path / "mlx", untie=tied)
    print("mlx-lm", R.check_mlx(path, PROMPT[0], mlx_path=ref))


def naive_route(logits, bias, top_k, n_group, topk_group, scaling):
    """Grouped routing one token at a time with Python sorting (float64)."""
    E, size = logits.shape[1], logits.shape[1] // n_group
    ids, weights = [], []
    for row in logits.double().tolist():
        p = [1 / (1 + np.exp(-v)) for v in row]
        s = [p[e] + float(bias[e]) for e in range(E)]
        groups = sorted(
            range(n_group), key=lambda g: -sum(sorted(s[g * size : (g + 1) * size])[-2:])
        )
        allowed = [e for e in range(E) if e // size in groups[:topk_group]]
        chosen = sorted(allowed, key=lambda e: -s[e])[:top_k]
        total = sum(p[e] for e in chosen)
        ids.append(chosen)
        weights.append([p[e] / total * scaling for e in chosen])
    return torch.tensor(ids), torch.tensor(weights, dtype=torch.float64)


def test_grouped_route_equals_a_per_token_loop():
    gen = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(200, 16, generator=gen) * 2, torch.randn(16, generator=gen) * 0.3
    for n_group, topk_group, k in ((4, 2, 3), (2, 1, 2), (1, 1, 4), (8, 3, 5)):
        ids, w, probs = B.grouped_route(logits, bias, k, n_group, topk_group, 1.7, True)
        want_ids, want_w = naive_route(logits, bias, k, n_group, topk_group, 1.7)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(probs, torch.sigmoid(logits))


# -- engine, calibration, prune ----------------------------------------------------------------
def test_engine_greedy_tokens_equal_transformers(hf):
    """Streamed under the smallest budget, and prefilled in chunks of 4 (RoPE positions and the
    latent cache carried across multi-token steps); a lockstep batch equals single runs."""
    from reap.engine import Engine

    path, model = hf
    prompt = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108]
    want = R.check_engine(path, model, prompt, steps=9)
    assert len(want) == 10
    with Engine.open(path, preset="max", context=64, dtype="float32") as eng:
        other = [9, 8, 7]  # lockstep with a shorter sequence: positions are per sequence
        both = eng.generate([prompt, other], max_tokens=10)
        assert both[0].ids == want and both[1].ids == eng.generate([other], max_tokens=10)[0].ids


def _corpus(path: Path) -> str:
    import random

    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(200):
            words = " ".join(
                rng.choice(["alpha", "beta", "gamma", "delta", "x = 1;"]) for _ in range(30)
            )
            f.write(json.dumps({"id": f"d{i}", "text": words}) + "\n")
    return str(path)


T_LEN, N_TOK = 32, 256


@pytest.fixture(scope="module")
def calibrated(yarn, tmp_path_factory):
    """Calibration of the yarn model in two MLP passes of at most 5 sequences, checked against
    forward hooks on transformers (see `family_runner.check_calibration`): (brute-force
    statistics, the statistics file)."""
    root = tmp_path_factory.mktemp("cal")
    path, model = yarn
    want = R.check_calibration(
        path, model, root, N_TOK, T_LEN, probs_fn=R.sigmoid_probs, rtol=1e-4,
        corpus=_corpus(root / "text.jsonl"), batch=3, max_pass_seqs=5,
    )  # fmt: skip
    return want, str(root / "stats" / "all.safetensors")


def hook_statistics(model, ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per MoE layer {field: [E] float64} from forward hooks on the transformers model over ids
    [S, T], with DeepSeek's sigmoid router probabilities (see `family_runner.hooked_stats`)."""
    return R.hooked_stats(model, ids, R.sigmoid_probs)


def test_calibration_statistics_equal_transformers_hooks(calibrated):
    from reap.stats import ExpertStats

    want, stats = calibrated
    st = ExpertStats.load(stats)
    assert st.meta["passes"] == 2  # two MLP passes of at most 5 sequences
    assert st.layers == sorted(want) == [1, 2] and st.tokens == N_TOK
    assert st.count.sum() == N_TOK * 2 * 2  # every token, top-2, two MoE layers


def test_pruned_checkpoint_loads_in_transformers_and_equals_our_engine(yarn, calibrated, tmp_path):
    """`reap plan` on the statistics + `reap prune`: the layout, sliced router rows and
    correction bias, kept experts byte for byte, from_pretrained == our engine; verify passes."""
    from reap.prune.plan_file import Plan

    (path, _), (_, stats) = yarn, calibrated
    plan, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", stats, "--model", str(path), "--keep", "8", "--out",
                 str(plan)]) == 0  # fmt: skip
    assert main(["prune", str(path), "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    for ids in Plan.load(plan).keep.values():  # two of each routing group of four
        assert [sum(e // 4 == g for e in ids) for g in range(4)] == [2, 2, 2, 2]
    R.check_pruned(path, out, Plan.load(plan))
    dst = Checkpoint.open(out)
    assert dst.config["n_routed_experts"] == 8 and dst.config["n_group"] == 4
    assert main(["verify", str(out), "--source", str(path)]) == 0


def test_expert_counts_that_break_the_grouping_are_refused(yarn, tmp_path, capsys):
    path, _ = yarn
    cfg = json.loads((path / "config.json").read_text())
    assert ds.with_experts(cfg, 12)["n_routed_experts"] == 12
    assert ds.with_experts(cfg, {1: 4, 2: 4})["num_experts_per_tok"] == 2
    with pytest.raises(ReapError, match="multiple of n_group=4"):
        ds.with_experts(cfg, 6)
    with pytest.raises(ReapError, match="uniform"):
        ds.with_experts(cfg, {1: 8, 2: 12})
    with pytest.raises(ReapError, match="fewer than top_k"):
        ds.with_experts({**cfg, "topk_group": 1, "num_experts_per_tok": 4}, 8)
    plan = tmp_path / "plan.json"
    args = ["plan", "--model", str(path), "--criterion", "random", "--keep", "6"]
    assert main([*args, "--out", str(plan)]) == 2  # refused when planned, not when pruning
    err = capsys.readouterr().err.strip()
    assert "in 4 groups" in err and len(err.splitlines()) == 1 and not plan.exists()
    args[-1] = "8"
    assert main([*args, "--seed", "5", "--out", str(plan)]) == 0
    for ids in json.loads(plan.read_text())["keep"].values():
        assert [sum(e // 4 == g for e in ids) for g in range(4)] == [2, 2, 2, 2]


# -- layout and config -------------------------------------------------------------------------
def test_layout_is_exactly_the_checkpoint_transformers_writes(hf, tmp_path):
    path, _ = hf
    ck = Checkpoint.open(path)
    specs = ds.layout(ck.config)
    assert {s.name: (s.dtype, s.shape) for s in specs} == {
        n: (t.dtype, tuple(t.shape)) for n, t in ck.tensors.items()
    }
    cfg = ds.Config.from_dict(ck.config)
    experts = [s for s in specs if s.component == "routed_experts"]
    assert len(experts) == 3 * cfg.n_routed_experts * 2
    assert all(ds.expert_key(s.name) == (s.layer, s.expert) for s in experts)
    from transformers import DeepseekV3ForCausalLM

    # a bf16 copy made the ordinary way: transformers keeps the router in float32
    DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(tmp_path)
    bf = Checkpoint.open(tmp_path)
    assert {s.name: s.dtype for s in ds.layout(bf.config)} == {
        n: t.dtype for n, t in bf.tensors.items()
    }
    assert bf.tensors["model.layers.1.mlp.gate.weight"].dtype == "F32"


def test_config_dispatch_and_unsupported_configs(yarn):
    path, _ = yarn
    cfg = json.loads((path / "config.json").read_text())
    assert family(cfg) is ds and family({**cfg, "model_type": "kimi_k2"}) is ds
    c = ds.Config.from_dict(cfg)
    assert ds.top_k(c) == 2 and c.is_moe(1) and not c.is_moe(0)
    assert c.softmax_scale == pytest.approx(32**-0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    # Kimi K2's release spells the rope settings the older way
    k2 = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    k2.update(rope_theta=50000.0, rope_scaling={**cfg["rope_parameters"], "type": "yarn"})
    k2c = ds.Config.from_dict(k2)
    assert rope_settings(k2c)[0] == 50000.0 and k2c.softmax_scale == c.softmax_scale
    for bad, msg in (
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"topk_method": "greedy", "scoring_func": "softmax"}, "routing"),
        ({"quantization_config": {"quant_method": "compressed-tensors"}}, "compressed-tensors"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "only block-scaled"),
        ({"n_group": 3}, "n_group=3"),
    ):
        with pytest.raises(ReapError, match=msg):
            ds.Config.from_dict({**cfg, **bad})


# -- FP8 releases --------------------------------------------------------------------------------
FP8_BLOCK = (32, 16)  # the releases use 128 x 128; smaller here so the tiny widths split


def naive_dequantize(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    """Block by block, in float64: every value times its block's scale."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(0, q.shape[0], block[0]):
        for j in range(0, q.shape[1], block[1]):
            scale = float(s[i // block[0], j // block[1]])
            out[i : i + block[0], j : j + block[1]] = (
                q[i : i + block[0], j : j + block[1]].double() * scale
            )
    return out


def make_fp8(path: Path, out: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Write `path`'s model to `out` as an FP8 release stores it: every 2-D decoder-layer weight
    but the router in F8_E4M3 with float32 block scales; returns the naively dequantized
    float32 weights."""
    from safetensors.torch import load_file, save_file

    from reap.quant import fp8

    out.mkdir()
    stored, plain = {}, {}
    for name, t in load_file(path / "model.safetensors").items():
        if (
            name.startswith("model.layers.")
            and t.ndim == 2
            and not name.endswith("mlp.gate.weight")
        ):
            q, s = fp8.quantize(t, block)
            stored[name], stored[name + "_scale_inv"] = q, s
            plain[name] = naive_dequantize(q, s, block).float()
        else:
            stored[name] = plain[name] = t
    save_file(stored, out / "model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                  "dynamic", "weight_block_size": list(block)}  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_text((path / f).read_text())
    return plain


@pytest.fixture(scope="module")
def fp8_model(yarn, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "fp8"
    return out, make_fp8(yarn[0], out, FP8_BLOCK)


def test_fp8_checkpoint_equals_its_naive_dequantization(yarn, fp8_model):
    from reap.engine import Engine

    (path, _), (fp8_dir, plain) = yarn, fp8_model
    ck = Checkpoint.open(fp8_dir)
    fam = family(ck.config)
    assert {s.name: (s.dtype, s.shape) for s in fam.layout(ck.config)} == {
        n: (t.dtype, tuple(t.shape)) for n, t in ck.tensors.items()
    }
    assert ck.tensors["model.layers.1.mlp.experts.3.up_proj.weight"].dtype == "F8_E4M3"
    names = fam.expert_tensor_names(fam.Config.from_dict(ck.config), 1, 3)
    assert len(names) == 6  # an FP8 checkpoint's expert names include the scales
    ids = torch.tensor(PROMPT)
    ref = ds.Model(ds.Config.from_dict(Checkpoint.open(path).config))  # unquantized config
    want = ref.forward(dict_weights(plain), ids)[0]
    raw = {n: ck.read(n) for n in ck.tensors}
    got = fam.Model(fam.Config.from_dict(ck.config)).forward(dict_weights(raw), ids)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with Engine.open(fp8_dir, preset="ultra", context=64) as eng:
        torch.testing.assert_close(eng.logits([PROMPT[0]])[0], want, rtol=1e-5, atol=1e-5)


def test_fp8_prune_keeps_fp8_bytes_and_scales(fp8_model, tmp_path):
    from reap.engine import Engine
    from reap.prune.plan_file import Plan
    from reap.prune.verify import verify

    fp8_dir, plain = fp8_model
    plan, out = tmp_path / "plan.json", tmp_path / "pruned"
    args = ["plan", "--model", str(fp8_dir), "--criterion", "random", "--keep", "8"]
    assert main([*args, "--seed", "2", "--out", str(plan)]) == 0
    assert (
        main(["prune", str(fp8_dir), "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    )
    keep = Plan.load(plan).keep
    R.check_pruned_layout(fp8_dir, out, Plan.load(plan))  # FP8 bytes and scales kept as stored
    verify(pruned=str(out), source=str(fp8_dir))
    # the pruned model is the dequantized model with the dropped experts' weights removed
    pruned_plain = {}
    for n, t in plain.items():
        key = ds.expert_key(n)
        if key is None:
            rows = keep.get(int(n.split(".")[2])) if ".mlp.gate." in n else None
            pruned_plain[n] = t if rows is None else t[rows]
        elif key[1] in keep[key[0]]:
            new = keep[key[0]].index(key[1])
            pruned_plain[n.replace(f".experts.{key[1]}.", f".experts.{new}.")] = t
    ref = ds.Model(
        ds.Config.from_dict(
            ds.with_experts(Checkpoint.open(fp8_dir).config, 8) | {"quantization_config": None}
        )
    )
    want = ref.forward(dict_weights(pruned_plain), torch.tensor(PROMPT))[0]
    with Engine.open(out, preset="ultra", context=64) as eng:
        torch.testing.assert_close(eng.logits([PROMPT[0]])[0], want, rtol=1e-5, atol=1e-5)


def test_fp8_reading_equals_mlx_lm_dequantization(yarn, tmp_path, monkeypatch):
    """mlx-lm's own FP8 path on the same file (128 x 128 blocks, as released; partial edge
    blocks at these widths). mlx-lm rounds each dequantized weight to bf16, so ours does too."""
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.utils import load_model

    from reap.quant import fp8

    out = tmp_path / "fp8"
    make_fp8(yarn[0], out, (128, 128))
    _, _, model, get = R.load_ours(out)
    exact = fp8.dequantize
    monkeypatch.setattr(fp8, "dequantize", lambda *a: exact(*a).bfloat16().float())
    got = model.forward(get, torch.tensor(PROMPT)).numpy()
    ref = np.array(load_model(Path(R.for_mlx(out, tmp_path / "mlx")))[0](mx.array(PROMPT)))
    assert np.abs(got - ref).max() < 1e-4 < np.abs(got).max()


def test_layout_reproduces_published_sizes():
    """DeepSeek-V3 (671 B parameters without its MTP layer, 37 B active) and Kimi K2 (1 T
    total, 32 B active) from their released configs (FP8 layout)."""
    from reap.sizes import SizeModel

    v3 = R.with_release_keys({
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                "weight_block_size": [128, 128]},
    })  # fmt: skip
    k2 = {**v3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64}
    k2.update(n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1)
    s = SizeModel.from_config(v3)
    assert s.total_params == pytest.approx(671e9, rel=0.005)
    assert s.active_params == pytest.approx(37e9, rel=0.02)
    assert s.expert_own_params[3] == 3 * 7168 * 2048
    s = SizeModel.from_config(k2)
    assert 1.0e12 < s.total_params < 1.04e12
    assert s.active_params == pytest.approx(32e9, rel=0.02)


def test_bfloat16_compute_tracks_float32(yarn):
    """bf16 compute (router, norms and softmax stay fp32) on a bf16 copy transformers writes."""
    path, _ = yarn
    _, _, model, get = R.load_ours(path)
    want = model.forward(get, torch.tensor(PROMPT))[0]
    bf16 = ds.Model(model.cfg, dtype=torch.bfloat16)
    got = bf16.forward(get, torch.tensor(PROMPT))[0].float()
    # a token whose routing flips on a near tie differs more: bound the typical error
    assert (got - want).abs().median() < 0.01 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_state_bytes_equal_the_decode_caches(hf):
    """The engine's memory plan: KV bytes per position are what the latent caches hold."""
    path, _ = hf
    _, _, model, get = R.load_ours(path)
    caches = model.new_caches()
    model.forward(get, torch.tensor(PROMPT), caches)
    held = sum(t.nbytes for c in caches for t in (c.kv_latent, c.k_pe))
    per_pos, per_seq, act, pair = ds.state_bytes(model.cfg, 4)
    assert held == per_pos * len(PROMPT[0]) and per_seq == 0
    assert act > 0 and pair == 4 * 3 * model.cfg.num_attention_heads


def test_group_balanced_prune_equals_masked_routing_in_transformers(yarn, tmp_path):
    """Keeping the same number of experts in every original group keeps each group together
    after renumbering, so the pruned model (loaded by transformers) routes exactly as the
    original with the dropped experts masked out of selection (correction bias -inf)."""
    from transformers import DeepseekV3ForCausalLM

    from reap.prune.plan_file import Plan
    from reap.prune.write import prune

    path, original = yarn
    kept = [0, 2, 5, 6, 8, 11, 13, 15]  # two of each group of four
    plan = Plan(n_experts=16, top_k=2, layers=[1, 2], counts={1: 8, 2: 8}, keep={1: kept, 2: kept})
    prune(model=str(path), plan=plan, out=str(tmp_path / "p"))
    pruned = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "p").eval()
    ids = torch.tensor([[5, 17, 200, 31, 7, 7, 90, 1, 44, 60, 3, 250]])
    masked = DeepseekV3ForCausalLM.from_pretrained(path).eval()
    dropped = [e for e in range(16) if e not in kept]
    for layer in (1, 2):
        masked.model.layers[layer].mlp.gate.e_score_correction_bias[dropped] = float("-inf")
    with torch.no_grad():
        want, got = masked(ids).logits, pruned(ids).logits
        full = original(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (full - want).abs().max() > 1e-2  # the masking mattered
