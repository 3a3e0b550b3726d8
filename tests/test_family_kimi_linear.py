"""Kimi Linear family (`reap.models.kimi_linear`) on a tiny random model created and saved offline
by transformers (fp32: hidden 64, 4 layers KDA/MLA/KDA/MLA, layer 0 dense, 8 experts, top-2, one
shared expert): our logits == transformers' `KimiLinearForCausalLM` (prefill over two KDA chunks
+ 8 decode steps) and == mlx-lm's `kimi_linear` on the released naming; the streaming engine;
prune -> `from_pretrained` == engine; calibration == forward hooks; state_bytes == the caches."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import family_runner as R
import pytest
import torch
from safetensors.torch import load_file, save_file

KWARGS = {
    "vocab_size": 288,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "linear_attn_config": {
        "kda_layers": [1, 3],
        "full_attn_layers": [2, 4],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "pad_token_id": 0,
    "bos_token_id": 256,
    "eos_token_id": 256,
}
PROMPT = [72, 101, 108, 108, 111, 44, 32, 75, 105, 109, 105, 32, 76, 105, 110, 101, 97, 114, 33, 10]


def make_tiny(path, **changes):
    """(path, transformers model): random weights and router correction bias (see
    `family_runner.randomize`), so that selection and weights differ."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return R.save_hf_tiny(KimiLinearForCausalLM, KimiLinearConfig, {**KWARGS, **changes}, path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("kl") / "m")


def released(path, out, **changes) -> str:
    """A copy in the release's naming (dense MLP under `mlp.`) with a release-style config (no
    transformers-5 type lists; rope_theta/mla_use_nope/torch_dtype as the hub config has), plus
    `changes` to the config."""
    out = Path(out)
    out.mkdir()
    for f in Path(path).iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    t = load_file(Path(path) / "model.safetensors")
    p = "model.layers.0."
    t = {k.replace(p + "block_sparse_moe.", p + "mlp."): v for k, v in t.items()}
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    for k in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "dtype"):
        cfg.pop(k)
    cfg.update(rope_theta=10000.0, mla_use_nope=True, torch_dtype="float32", **changes)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def test_layout_is_what_transformers_saves_in_fp32_and_bf16(tiny, tmp_path):
    from transformers import KimiLinearForCausalLM

    from reap.checkpoint import Checkpoint
    from reap.models import builtin_config, family, kimi_linear
    from reap.models.kimi_k3 import family as kimi_k3

    path, _ = tiny
    bf16 = tmp_path / "bf16"
    KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(bf16)
    for p, dtypes in ((path, {"F32"}), (bf16, {"BF16", "F32"})):
        with Checkpoint.open(p) as ck:
            assert family(ck.config) is kimi_linear
            specs = kimi_linear.layout(ck.config)
            got = {n: (tuple(t.shape), t.dtype) for n, t in ck.tensors.items()}
        assert {s.name: (s.shape, s.dtype) for s in specs} == got
        assert {s.dtype for s in specs} == dtypes
    experts = [s for s in specs if s.component == "routed_experts"]
    assert len(experts) == 3 * 3 * 8 and all(s.dtype == "BF16" for s in experts)
    # a K3 config, whole or its bare kimi_linear text config, stays with kimi_k3
    k3 = builtin_config("k3-tiny")
    assert family(k3) is kimi_k3 and family(k3["text_config"]) is kimi_k3


def test_logits_equal_transformers_prefill_and_decode(tiny):
    path, hf = tiny
    assert R.check_logits(path, hf, PROMPT, steps=8) < R.ATOL
    # a batch of two in one prefill (no padding) too
    _, _, model, get = R.load_ours(path)
    ids = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    got = model.forward(get, ids)
    assert ref.std() > 0.5  # logits of magnitude ~1: the tolerance is meaningful
    torch.testing.assert_close(got, ref, rtol=0, atol=R.ATOL)


def test_released_naming_equals_mlx_lm_and_transformers(tiny, tmp_path):
    path, hf = tiny
    rel = released(path, tmp_path / "released")
    assert R.check_logits(rel, hf, PROMPT, steps=2) < R.ATOL
    # mlx-lm normalizes the MLA latent with rms_norm_eps where transformers (and we, as the
    # DeepSeek lineage does) use 1e-6: with rms_norm_eps 1e-6 everywhere the three agree
    rel6 = released(path, tmp_path / "released_eps", rms_norm_eps=1e-6)
    assert R.check_mlx(rel6, PROMPT, steps=8) < R.ATOL


def test_engine_greedy_equals_transformers(tiny):
    path, hf = tiny
    tokens = R.check_engine(path, hf, PROMPT, steps=8)
    assert len(tokens) >= 2


def test_pruned_checkpoint_loads_in_transformers_with_the_engines_logits(tiny, tmp_path):
    from reap.errors import ReapError
    from reap.models import kimi_linear

    path, _ = tiny
    R.check_prune(path, tmp_path / "pruned", keep=5)
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert kimi_linear.with_experts(cfg, {1: 4, 2: 4, 3: 4})["num_experts"] == 4
    with pytest.raises(ReapError, match="one expert count for all layers"):
        kimi_linear.with_experts(cfg, {1: 4, 2: 6, 3: 5})


def test_grouped_routing_equals_transformers_and_pruning_keeps_whole_groups(tmp_path):
    """Two groups of four experts, tokens routed within the best one (transformers' DeepSeek-style
    group score: the sum of a group's two best biased scores)."""
    from reap.errors import ReapError
    from reap.models import kimi_linear

    path, hf = make_tiny(tmp_path / "grouped", n_group=2, topk_group=1)
    cfg = json.loads((Path(path) / "config.json").read_text())
    assert (cfg["num_expert_group"], cfg["topk_group"]) == (2, 1)
    assert R.check_logits(path, hf, PROMPT, steps=4) < R.ATOL
    R.check_prune(path, tmp_path / "pruned", keep=4)
    with pytest.raises(ReapError, match="num_expert_group=2"):
        kimi_linear.with_experts(cfg, 5)


def test_calibration_statistics_equal_forward_hooks(tiny, tmp_path):
    path, hf = tiny
    want = R.check_calibration(path, hf, tmp_path / "cal", probs_fn=R.sigmoid_probs)
    assert sorted(want) == [1, 2, 3]
    assert all(float(s["count"].sum()) == 256 * 2 for s in want.values())


def test_state_bytes_are_the_decode_caches_and_the_engine_requires_them(tiny):
    import types

    from reap.engine.binding import state_costs
    from reap.models import kimi_linear
    from reap.models.base import check_family

    path, _ = tiny
    _, cfg, model, get = R.load_ours(path)
    caches, T = model.new_caches(), 7
    model.forward(get, torch.tensor([PROMPT[:T]]), caches)
    kv = sum(c.kv_latent.nbytes + c.k_pe.nbytes for c in caches if hasattr(c, "kv_latent"))
    rec = sum(c.state.nbytes + c.conv.nbytes for c in caches if hasattr(c, "state"))
    per_pos, per_seq, act, pair = state_costs(kimi_linear, cfg, 4)
    assert (per_pos * T, per_seq) == (kv, rec) and act > 0 and pair == 12 * 2
    with pytest.raises(TypeError, match=r"state_bytes\(\) is missing"):
        check_family(types.ModuleType("nostate"))  # the family contract, checked on load


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_expert_group": 3}, "8 experts in num_expert_group=3"),
        ({"mla_use_nope": False}, "RoPE MLA"),
    ],
)
def test_unsupported_configs_are_one_line_errors(tiny, change, message):
    from reap.errors import ReapError
    from reap.models import kimi_linear

    cfg = json.loads((Path(tiny[0]) / "config.json").read_text())
    with pytest.raises(ReapError, match=message):
        kimi_linear.Config.from_dict({**cfg, **change})


def test_synth_writes_a_kimi_linear_checkpoint_the_engine_runs(tiny, tmp_path):
    """`reap synth` on a Kimi Linear config.json: float experts, the [1, 1, H, 1] A_log, the
    layout exactly; the engine's greedy tokens equal the in-memory forward's."""
    from reap.checkpoint import Checkpoint
    from reap.engine import Engine
    from reap.models import kimi_linear
    from reap.synth import synth

    out = synth(str(Path(tiny[0]) / "config.json"), tmp_path / "s", seed=2, dtype="float32")
    with Checkpoint.open(out) as ck:
        want = {s.name: (s.shape, s.dtype) for s in kimi_linear.layout(ck.config)}
        assert want == {n: (tuple(t.shape), t.dtype) for n, t in ck.tensors.items()}
    _, ref = R.ours_greedy(out, PROMPT, 6)
    with Engine.open(out, preset="ultra", context=64) as eng:
        assert eng.generate([PROMPT], max_tokens=7)[0].ids == ref[:7]
