"""Issue 34 part 7: every release config under tests/fixtures/releases/, shrunk to a few layers,
16 experts and tiny widths, makes through `reap synth` a checkpoint that `info`, `calibrate` and
`run` accept, with finite routing statistics (FP8 block-scaled DeepSeek-V3 / Kimi-K2, MXFP4
GPT-OSS, INT4 Kimi-K2.5, grouped routing, Kimi-Linear, K3); a GPT-OSS config without
`quantization_config` too. Calibration refuses NaN statistics before writing them (exit 4 naming
the layer and the expert); a budget too small names the flags that change it; a config-only
directory answers over http as it does on disk."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from reap.cli import main
from reap.errors import ReapError

RELEASES = Path(__file__).parent / "fixtures" / "releases"
DIRS = sorted(p.name for p in RELEASES.iterdir() if (p / "config.json").is_file())
# tiny widths for whichever of these keys a release config has
WIDTHS = {
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "routed_expert_hidden_size": 32, "q_lora_rank": 32, "kv_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "head_dim": 16,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "num_experts_per_tok": 4, "num_experts_per_token": 4, "experts_per_token": 4,
    "n_routed_experts": 16, "num_experts": 16, "num_local_experts": 16,
    "attn_res_block_size": 2, "sliding_window": 4,
}  # fmt: skip


def shrink(config: dict, layers: int = 4) -> dict:
    """A release config.json at tiny widths: `layers` layers (their per-layer lists cut to
    match), 16 experts (4 groups of 4 where the release groups them), no vision tower."""
    out = copy.deepcopy(config)
    out.pop("vision_config", None)
    text = out.get("text_config", out)
    text.update({k: v for k, v in WIDTHS.items() if text.get(k) is not None})
    text["num_hidden_layers"] = layers
    if "layer_types" in text:
        text["layer_types"] = text["layer_types"][:layers]
    if text.get("first_k_dense_replace"):
        text["first_k_dense_replace"] = 1
    if text.get("n_group", 1) > 1:
        text.update(n_group=4, topk_group=2)
    lac = text.get("linear_attn_config")
    if lac:  # one-based layer numbers: MLA last, KDA before it
        lac.update(num_heads=2, head_dim=16, full_attn_layers=[layers])
        lac["kda_layers"] = list(range(1, layers))
    return out


def _synth(config: dict, tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "model"
    assert main(["synth", str(tmp_path / "config.json"), "--out", str(out)]) == 0
    return str(out)


def _calibrate(model: str, out: Path) -> int:
    args = ["calibrate", model, "--corpus", "en", "--tokens", "64", "--seq-len", "32"]
    return main(args + ["--out", str(out), "--no-progress"])


def _check_usable(model: str, tmp_path: Path, capsys) -> None:
    from reap.stats import ExpertStats

    capsys.readouterr()
    assert main(["info", model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] > 0
    assert _calibrate(model, tmp_path / "stats") == 0
    st = ExpertStats.load(tmp_path / "stats" / "all.safetensors")  # refuses NaN (exit 2)
    assert torch.isfinite(st.prob_mass).all() and st.gate_sum.sum() > 0
    capsys.readouterr()
    args = ["run", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--ignore-eos"]
    assert main(args + ["--json", "--threads", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generations"][0]["ids"]) == 2


@pytest.mark.parametrize("release", DIRS)
def test_every_release_config_makes_a_usable_model(release, tmp_path, capsys):
    """Before: FP8 configs "internal error: KeyError: 'F8_E4M3'", GPT-OSS "mxfp4: last dimension
    must be a multiple of 32", Kimi-Linear NaN statistics (KDA chunk overflow)."""
    config = shrink(json.loads((RELEASES / release / "config.json").read_text()))
    _check_usable(_synth(config, tmp_path), tmp_path, capsys)


def test_kimi_k2_thinking_int4(tmp_path, capsys):
    """Kimi-K2-Thinking (no config fixture): K2's config with the compressed-tensors INT4
    `quantization_config` at the top level, as K2.5 carries it in its text_config."""
    config = shrink(json.loads((RELEASES / "kimi-k2-instruct" / "config.json").read_text()))
    k25 = json.loads((RELEASES / "kimi-k2.5" / "config.json").read_text())
    config["quantization_config"] = k25["text_config"]["quantization_config"]
    model = _synth(config, tmp_path)
    names = json.loads((Path(model) / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.0.down_proj.weight_packed" in names
    _check_usable(model, tmp_path, capsys)


def test_gpt_oss_without_quantization_config(tmp_path, capsys):
    """Dequantized fused experts [E, D, 2F] that info binds (before: 384 unused `X[e]` tensors)."""
    config = shrink(json.loads((RELEASES / "gpt-oss-20b" / "config.json").read_text()))
    del config["quantization_config"]
    model = _synth(config, tmp_path)
    names = json.loads((Path(model) / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    _check_usable(model, tmp_path, capsys)


def test_mxfp4_widths_not_multiples_of_32_are_refused(tmp_path, capsys):
    config = shrink(json.loads((RELEASES / "gpt-oss-20b" / "config.json").read_text()))
    config["hidden_size"] = 48
    (tmp_path / "c.json").write_text(json.dumps(config))
    assert main(["synth", str(tmp_path / "c.json"), "--out", str(tmp_path / "m")]) == 2
    assert "hidden_size" in capsys.readouterr().err
    config = shrink(json.loads((RELEASES / "kimi-k3" / "config.json").read_text()))
    config["text_config"]["moe_intermediate_size"] = 48
    (tmp_path / "k.json").write_text(json.dumps(config))
    assert main(["synth", str(tmp_path / "k.json"), "--out", str(tmp_path / "k")]) == 2
    assert "experts.0.w2.weight_packed" in capsys.readouterr().err


def test_kda_chunks_stay_finite_at_fast_decays():
    """Per-step log decays of -17 (Kimi Linear's gate is unbounded): the chunked form equals the
    step-by-step reference instead of overflowing to NaN."""
    from reap.models.shared.kda import kda_chunked, kda_recurrent

    g = torch.Generator().manual_seed(0)
    B, T, H, D = 1, 40, 2, 8
    q, k, v = (torch.nn.functional.normalize(torch.randn(B, T, H, D, generator=g), dim=-1)
               for _ in range(3))
    log_g = -torch.rand(B, T, H, D, generator=g) * 17.7
    beta = torch.rand(B, T, H, generator=g)
    state = torch.zeros(B, H, D, D)
    ref, ref_state = kda_recurrent(q, k, v, log_g, beta, state)
    out, out_state = kda_chunked(q, k, v, log_g, beta, state)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_state, ref_state, atol=1e-5, rtol=1e-4)


# ---- calibrate checks its statistics before writing them --------------------------------------


def test_save_rows_refuses_nan_naming_layer_and_expert(tmp_path):
    from reap.calibrate import artifacts as art
    from reap.stats import ExpertSums, zero_sums

    row = ExpertSums(**zero_sums(8))
    row.reap_sum[5] = float("nan")
    with pytest.raises(ReapError) as e:
        art.save_rows(str(tmp_path), 7, [row])
    assert e.value.exit_code == 4 and "layer 7, expert 5" in str(e.value)
    assert "reap_sum" in str(e.value) and not list(tmp_path.iterdir())


def test_calibrate_exits_4_on_nan_statistics(tmp_path, capsys):
    """A router weight of 1e38 makes layer 1's routing logits infinite: calibrate exits 4 naming
    the layer and an expert, and writes no statistics (before: exit 0 with NaN in them)."""
    from safetensors.torch import load_file, save_file

    config = shrink(json.loads((RELEASES / "qwen3-30b-a3b" / "config.json").read_text()))
    model = Path(_synth(config, tmp_path))
    shard = model / json.loads((model / "model.safetensors.index.json").read_text())[
        "weight_map"]["model.layers.1.mlp.gate.weight"]
    tensors = load_file(shard)
    tensors["model.layers.1.mlp.gate.weight"].fill_(1e38)
    save_file(tensors, shard, metadata={"format": "pt"})
    capsys.readouterr()
    assert _calibrate(str(model), tmp_path / "stats") == 4
    err = capsys.readouterr().err
    assert "layer 1, expert" in err and "NaN or infinite" in err
    assert not (tmp_path / "stats" / "all.safetensors").exists()


# ---- a budget error names its flags ------------------------------------------------------------


def test_a_budget_below_the_minimum_names_its_flags(tmp_path):
    """As `reap eval` opens its engines (context 512, --gen-batch 16) under a small budget."""
    from reap.engine import Engine

    config = shrink(json.loads((RELEASES / "qwen3-30b-a3b" / "config.json").read_text()))
    config["vocab_size"] = 151936
    model = _synth(config, tmp_path)
    with pytest.raises(ReapError) as e:
        Engine.open(model, budget=int(1e6), context=512, batch=16, baseline=0)
    msg = str(e.value)
    assert "context 512 x batch 16" in msg
    for flag in ("--budget", "--context", "--gen-batch", "--max-tokens-per-doc"):
        assert flag in msg, flag


# ---- a config-only URL answers as the directory does -------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from reap.synth import synth

    return Path(synth("k3-tiny", tmp_path_factory.mktemp("k3") / "k3-tiny", seed=0))


@pytest.mark.parametrize("index", [True, False])
def test_a_config_only_url_answers_as_the_directory(tiny, tmp_path, monkeypatch, capsys, index):
    from reap.info_cli import info
    from tests.test_remote import FileServer

    monkeypatch.setenv("REAP_CACHE", str(tmp_path / "cache"))
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ["config.json"] + (["model.safetensors.index.json"] if index else []):
        shutil.copy(tiny / name, bare)
    fs = FileServer(bare)
    try:
        a, b = info(str(bare)), info(fs.url)
        assert b["config_only"] and b["model"] == fs.url
        for k in ("components", "total_params", "tensors", "checkpoint_bytes"):
            assert a[k] == b[k], k
        assert a.get("index_total_size") == b.get("index_total_size")
        plans = []
        for p in (str(bare), fs.url):
            args = ["run", p, "--prompt-ids", "1", "--plan-only", "--json", "--budget", "2GB"]
            assert main(args) == 0
            plan = json.loads(capsys.readouterr().out)["plan"]
            plan.pop("baseline"), plan.pop("total")  # this process's RSS when planned
            plans.append(plan)
        assert plans[0] == plans[1]
        assert main(["plan", "--config", fs.url, "--keep", "8", "--dry-run"]) == 0
        assert "predicted" in capsys.readouterr().out
    finally:
        fs.close()
