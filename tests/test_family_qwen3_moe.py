"""Qwen3-MoE and OLMoE (reap.models.qwen3_moe) against transformers and mlx-lm on tiny random
models saved by transformers: logits (prefill and decode), the streaming engine, pruning round
trips through from_pretrained, calibration statistics against forward hooks and the published
Qwen3-30B-A3B / OLMoE-1B-7B sizes."""

import family_runner as R
import pytest

PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
QWEN = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip
# what released Qwen3-MoE config.json files spell (and mlx-lm reads)
QWEN_LEGACY = {"num_experts": 8, "rope_theta": 10000.0}
OLMOE = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "norm_topk_prob": False, "clip_qkv": 1.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("qwen3_moe")
    path, hf = R.save_hf_tiny(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, root / "m", seed=1, config_extra=QWEN_LEGACY
    )
    return root, path, hf


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    root = tmp_path_factory.mktemp("olmoe")
    path, hf = R.save_hf_tiny(OlmoeForCausalLM, OlmoeConfig, OLMOE, root / "m", seed=2)
    return root, path, hf


def test_qwen3_moe_logits_equal_transformers_and_mlx(qwen):
    _, path, hf = qwen
    print("transformers", R.check_logits(path, hf, PROMPT))
    print("mlx-lm", R.check_mlx(path, PROMPT))


def test_olmoe_logits_equal_transformers_and_mlx(olmoe):
    """clip_qkv=1 changes the logits and we follow transformers; mlx-lm ignores clip_qkv, so it
    is compared on the same weights with the clip removed from config.json."""
    root, path, hf = olmoe
    print("transformers", R.check_logits(path, hf, PROMPT))
    unclipped = R.with_config(path, root / "noclip", clip_qkv=None)
    print("mlx-lm", R.check_mlx(unclipped, PROMPT))
    assert R.prefill_change(path, unclipped, PROMPT).max() > 1e-2  # the clip is exercised


def test_qwen3_moe_engine(qwen):
    _, path, hf = qwen
    R.check_engine(path, hf, PROMPT)


def test_qwen3_moe_prune(qwen):
    root, path, _ = qwen
    R.check_prune(path, root / "pruned", keep=5)


def test_qwen3_moe_calibration(qwen):
    root, path, hf = qwen
    R.check_calibration(path, hf, root / "cal")


def test_olmoe_engine_prune_calibration(olmoe):
    root, path, hf = olmoe
    R.check_engine(path, hf, PROMPT)
    R.check_prune(path, root / "pruned", keep=6)
    R.check_calibration(path, hf, root / "cal")


def test_qwen3_moe_variants_equal_transformers(tmp_path):
    """Unnormalized top-k weights, q/k/v/o biases, every second layer sparse, tied embeddings,
    YaRN rope scaling and a sliding window of 5 positions (shorter than the prompt) that
    transformers applies only with use_sliding_window; also through the engine."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = {
        **QWEN, "norm_topk_prob": False, "attention_bias": True, "decoder_sparse_step": 2,
        "mlp_only_layers": [], "num_hidden_layers": 4, "use_sliding_window": True,
        "sliding_window": 5, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                            "original_max_position_embeddings": 32},
    }  # fmt: skip
    path, hf = R.save_hf_tiny(Qwen3MoeForCausalLM, Qwen3MoeConfig, kw, tmp_path / "m", seed=5)
    fam, cfg, _, _ = R.load_ours(path)
    assert [cfg.is_moe(i) for i in range(4)] == [False, True, False, True]
    assert cfg.sliding_window == 5 and not cfg.norm_topk_prob and cfg.rope_scaling["factor"] == 4
    print("transformers", R.check_logits(path, hf, PROMPT))
    R.check_engine(path, hf, PROMPT)
    full = R.with_config(path, tmp_path / "full", use_sliding_window=False)
    assert fam.Config.from_dict(R.load_hf(full).config.to_dict()).sliding_window is None
    assert R.prefill_change(path, full, PROMPT)[5:].max() > 1e-2  # the window is exercised


def test_with_experts_sets_every_count_key_and_refuses_per_layer_counts(qwen):
    from reap.checkpoint import Checkpoint
    from reap.errors import ReapError
    from reap.models import qwen3_moe

    _, path, _ = qwen
    with Checkpoint.open(path) as ck:
        config = ck.config
    out = qwen3_moe.with_experts(config, 1)
    assert (out["num_experts"], out["num_local_experts"], out["num_experts_per_tok"]) == (1, 1, 1)
    assert qwen3_moe.with_experts(config, {0: 6, 2: 6})["num_experts"] == 6
    with pytest.raises(ReapError, match="one expert count for all layers"):
        qwen3_moe.with_experts(config, {0: 6, 2: 5})
    with pytest.raises(ReapError, match="unsupported hidden_act"):
        qwen3_moe.Config.from_dict({**config, "hidden_act": "gelu"})


# the released config.json values (Qwen/Qwen3-30B-A3B, allenai/OLMoE-1B-7B-0924)
QWEN3_30B = R.with_release_keys({
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rope_theta": 1e6, "sliding_window": None,
    "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
})  # fmt: skip
OLMOE_7B = R.with_release_keys({
    "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
})  # fmt: skip


@pytest.mark.parametrize("config, total, active", [(QWEN3_30B, 30.5, 3.3), (OLMOE_7B, 6.9, 1.3)])
def test_size_model_reproduces_the_published_parameter_counts(config, total, active):
    """The layout of the released configs gives the model cards' totals and active parameters
    (which count the embedding table) within the rounding of their published 0.1 B."""
    from reap.sizes import SizeModel

    m = SizeModel.from_config(config)
    assert abs(m.total_params / 1e9 - total) < 0.06  # 30.53 B, 6.92 B
    assert abs((m.active_params + m.input_embedding_params) / 1e9 - active) < 0.06  # 3.35, 1.28
