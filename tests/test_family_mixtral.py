"""Mixtral (reap.models.mixtral) against transformers and mlx-lm on tiny random models saved by
transformers in several shards, as released: logits (prefill and decode, with and without a
sliding window), the streaming engine, pruning round trips through from_pretrained, calibration
statistics against forward hooks, bf16 checkpoints and the published Mixtral-8x7B sizes."""

import json
from pathlib import Path

import family_runner as R
import pytest

from reap.models import family, mixtral

PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
MIXTRAL = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("mixtral")
    path, hf = R.save_hf_tiny(
        MixtralForCausalLM, MixtralConfig, MIXTRAL, root / "m", seed=3, max_shard_size="100KB"
    )
    assert len(list(root.glob("m/model-*-of-*.safetensors"))) > 1  # sharded, with an index
    return root, path, hf


def test_logits_equal_transformers_and_mlx(tiny):
    _, path, hf = tiny
    assert family({"model_type": "mixtral"}) is mixtral
    print("transformers", R.check_logits(path, hf, PROMPT))
    print("mlx-lm", R.check_mlx(path, PROMPT))


def test_sliding_window_equals_transformers(tmp_path):
    """A window of 5 positions, shorter than the prompt: prefill and decode both cut keys."""
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = {**MIXTRAL, "sliding_window": 5}
    path, hf = R.save_hf_tiny(MixtralForCausalLM, MixtralConfig, kw, tmp_path / "m", seed=4)
    assert mixtral.Config.from_dict(R.load_hf(path).config.to_dict()).sliding_window == 5
    print("transformers", R.check_logits(path, hf, PROMPT))
    full = R.with_config(path, tmp_path / "full")
    cfg = json.loads((Path(full) / "config.json").read_text())
    (Path(full) / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    change = R.prefill_change(path, full, PROMPT)
    assert change[5:].max() > 1e-2  # positions past the window differ
    assert change[:5].max() < 1e-5  # those before it do not


def test_engine(tiny):
    _, path, hf = tiny
    R.check_engine(path, hf, PROMPT)


def test_prune_keeps_the_layout_and_loads_in_transformers(tiny):
    root, path, _ = tiny
    R.check_prune(path, root / "pruned", keep=5)
    pruned = R.check_prune(path, root / "pruned2", keep=2, seed=1)  # plans stop at top_k
    config = R.load_hf(pruned).config
    assert (config.num_local_experts, config.num_experts_per_tok) == (2, 2)


def test_calibration_equals_hooks(tiny):
    root, path, hf = tiny
    R.check_calibration(path, hf, root / "cal")


def test_bfloat16_checkpoint_runs_in_bfloat16(tmp_path):
    """A bf16 checkpoint binds with BF16 layout dtypes and the engine computes in bf16: its
    logits stay as close to the fp32 model's as transformers' own bf16 forward does."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from reap.engine import Engine

    _, hf = R.save_hf_tiny(MixtralForCausalLM, MixtralConfig, MIXTRAL, tmp_path / "m", seed=3)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0]
        hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        theirs = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert {s.dtype for s in mixtral.layout(config)} == {"BF16"}
    with Engine.open(tmp_path / "bf16", preset="ultra", context=64) as eng:
        assert eng.dtype == torch.bfloat16
        ours = eng.logits([PROMPT])[0]
    bound = 2 * (theirs - ref).abs().max()  # measured: ours 0.048, transformers' 0.038
    assert (ours - ref).abs().max() < bound
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_size_model_reproduces_the_published_parameter_counts():
    """mistralai/Mixtral-8x7B-v0.1's config.json: 46.7 B parameters, 12.9 B used per token."""
    from reap.sizes import SizeModel

    config = R.with_release_keys({
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })  # fmt: skip
    m = SizeModel.from_config(config)
    assert abs(m.total_params / 1e9 - 46.7) < 0.06  # 46.70 B
    assert abs((m.active_params + m.input_embedding_params) / 1e9 - 12.9) < 0.06  # 12.88 B
