"""The llama.cpp comparison's arithmetic (experiments/llamacpp_models.py, llamacpp_report.py):
the parameter counts behind its decode GB/s column, against a transformers model's tensors."""

import pytest
import torch

from experiments.llamacpp_models import QWEN_1B, _qwen, param_counts
from experiments.llamacpp_report import _gbps, speed_table

pytest.importorskip("transformers")

# QWEN_1B's structure at a size a test builds in a second
SMALL = {**QWEN_1B, "vocab_size": 96, "hidden_size": 32, "moe_intermediate_size": 24,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "num_experts": 6, "num_experts_per_tok": 2}  # fmt: skip


def test_param_counts_equal_the_tensors_of_a_transformers_model():
    model = _qwen(SMALL, torch.float32)
    tensors = dict(model.named_parameters())
    total = sum(t.numel() for t in tensors.values())
    experts = [n for n in tensors if ".mlp.experts." in n]
    assert experts, "the experts' tensor names moved"
    # 3 layers x 6 experts, whether transformers fuses an expert's tensors or not
    per_expert = sum(tensors[n].numel() for n in experts) // (3 * 6)
    unused = 3 * (6 - 2) * per_expert + tensors["model.embed_tokens.weight"].numel()
    assert param_counts(SMALL) == (total, total - unused)


def test_decode_gbps_is_bytes_a_token_times_tokens_per_s():
    row = {"dtype": "float32", "threads": 2, "prompt": 32, "hit": 1.0, "read_gbps": 25.04,
           "token_bytes": 712_000_000, "runs": [{"load": ["1.0", "1.5"]}],
           "prefill": {"reap": 100.0, "llama.cpp": 80.0, "ratio": 1.25},
           "decode": {"reap": 30.0, "llama.cpp": 25.0, "ratio": 1.2}}  # fmt: skip
    assert _gbps(row) == "21.4 / 17.8 (25.0)"  # 0.712 GB x 30 and x 25 tokens/s
    assert "21.4 / 17.8 (25.0)" in "\n".join(speed_table([row]))
    bare = {k: v for k, v in row.items() if k not in ("token_bytes", "read_gbps")}
    assert _gbps(bare) == "-"
