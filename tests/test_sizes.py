"""Size model: the published Kimi K3 figures from the config alone, and byte predictions that
match what is written."""

import json
import subprocess
import sys
from collections.abc import Mapping

import pytest
from family_runner import with_release_keys

from reap.checkpoint import split_view
from reap.errors import ReapError
from reap.info_cli import info
from reap.models import builtin_config
from reap.sizes import SizeModel
from reap.units import parse_bytes


@pytest.fixture(scope="module")
def k3_full():
    return info("k3-full")


def rel(a, b):
    return abs(a - b) / b


def test_k3_full_reproduces_published_figures(k3_full):
    """../shared/k3.md starred figures, within 0.5 %."""
    assert rel(k3_full["total_params"], 2780.0e9) < 0.005
    assert rel(k3_full["routed_params"], 2722.7e9) < 0.005
    assert k3_full["bytes_per_routed_expert"] == 17_547_264
    assert k3_full["params_per_routed_expert"] == 33_030_144
    assert rel(k3_full["routed_bytes"], 1.447e12) < 0.005
    assert rel(k3_full["checkpoint_bytes"], 1.56e12) < 0.005
    assert rel(k3_full["active_params"], 104e9) < 0.01
    assert k3_full["tensors"] == 497_220
    comps = k3_full["components"]
    assert rel(comps["shared_experts"]["params"], 12.2e9) < 0.005
    assert rel(comps["latent_proj"]["params"], 4.7e9) < 0.01
    assert rel(comps["embed_head"]["params"], 2.35e9) < 0.005


def test_target_size_350gb_keeps_about_146_experts():
    from reap.models import builtin_config

    m = SizeModel.from_config(builtin_config("k3-full"))
    keep = m.max_uniform_keep(parse_bytes("350GB"))
    assert 140 <= keep <= 150
    assert m.predict_bytes(keep) <= 350e9 < m.predict_bytes(keep + 1)


def test_predict_bytes_is_linear_in_kept_experts():
    from reap.models import builtin_config

    m = SizeModel.from_config(builtin_config("k3-tiny"))
    full, none = m.predict_bytes(), m.predict_bytes(0)
    per_layer = sum(m.expert_bytes.values()) + sum(m.header_bytes_expert.values())
    assert full - none == per_layer * m.n_experts


def test_parse_size_units():
    assert parse_bytes("350GB") == 350 * 10**9
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5 TB") == 1.5e12
    with pytest.raises(ReapError):
        parse_bytes("lots")


def test_info_cli_json_and_bad_config():
    out = subprocess.run([sys.executable, "-m", "reap.cli", "info", "k3-tiny", "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["n_experts"] > 0
    bad = subprocess.run([sys.executable, "-m", "reap.cli", "info", "k3-nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_predicted_bytes_match_a_written_checkpoint(tmp_path):
    """Tensor data exactly, headers estimated: the whole file set within 0.1 %."""
    from reap.synth import synth

    out = tmp_path / "tiny"
    synth(config="k3-tiny", out=str(out), seed=0)
    got = info(str(out))
    assert got["tensors_on_disk"] == got["tensors"]
    assert abs(got["checkpoint_bytes"] - got["bytes_on_disk"]) <= 0.001 * got["bytes_on_disk"]


FP8_DEEPSEEK = with_release_keys({
    "model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "n_routed_experts": 4, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]},
})  # fmt: skip
MXFP4_GPT_OSS = with_release_keys({
    "model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "quantization_config": {"quant_method": "mxfp4"},
})  # fmt: skip


class _Table(Mapping):
    """A layout as a checkpoint's tensor table: stored tensors listed, views `X[e]` looked up."""

    def __init__(self, specs):
        self.views = {s.name: s for s in specs}
        self.stored = sorted({split_view(n)[0] for n in self.views})

    def __getitem__(self, name):
        return self.views[name]

    def __iter__(self):
        return iter(self.stored)

    def __len__(self):
        return len(self.stored)


@pytest.mark.parametrize(
    ("config", "weights"),
    [
        (FP8_DEEPSEEK, 3 * 64 * 32),  # F8 weights, one each; F32 block scales hold none
        (MXFP4_GPT_OSS, 2 * 32 * 64 + 2 * 32 + 64 * 32 + 64),  # blocks two a byte, biases
        (builtin_config("k3-tiny"), 3 * 32 * 32),  # w1, w2, w3 [32, 32] as packed + scales
    ],
)
def test_sizes_and_the_engine_binding_count_quantized_experts_alike(config, weights):
    """Which tensors are quantization blocks or scales is declared once, by the layout's roles:
    the size model's parameters and the engine's decoded expert agree (FP8 and MXFP4)."""
    import torch

    from reap.engine.binding import bind, model_bytes
    from reap.models import family

    fam = family(config)
    specs = fam.layout(config)
    size = SizeModel.from_layout(specs, fam, config)
    tensors = _Table(specs)  # a layout binds like the checkpoint it describes
    b = bind(tensors, fam, config, "layout")
    layer = size.moe_layers[0]
    assert b.expert_weights == size.expert_own_params[layer] == weights
    mb = model_bytes(
        tensors, b, (0, 0, 0, 0), fam.top_k(fam.Config.from_dict(config)), torch.bfloat16
    )
    assert mb.decoded_expert_bytes == 2 * weights
    assert mb.expert_bytes[layer] == size.expert_own_bytes[layer]
