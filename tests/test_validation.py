"""One validation layer for configs and weights (issue 18): every command refuses the same bad
config values, `info` refuses what the others refuse, NaN/Inf in norm or router weights and
corrupt expert scales are found before they become statistics or tokens, and calibration binds
through the same checks as `reap run`.

Each case edits a copy of a tiny synthesized K3 (or a tiny transformers config of another
family) and asserts the exit code and the one-line message naming the file and the field.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from reap.cli import main
from reap.errors import ReapError

RELEASES = Path(__file__).parent / "fixtures" / "releases"
TEXT = "language_model."  # synth writes K3 tensors under the released prefix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from reap.synth import synth

    return str(synth("k3-tiny", tmp_path_factory.mktemp("val") / "tiny", seed=5, dtype="float32"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            words = " ".join(f"w{rng.randrange(99)}" for _ in range(rng.randrange(20, 40)))
            f.write(json.dumps({"id": f"d{i}", "text": words}) + "\n")
    return str(path)


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _run(capsys, model) -> tuple[int, str]:
    return _cli(capsys, "run", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet")


def _calibrate(capsys, model, corpus, out) -> tuple[int, str]:
    return _cli(
        capsys,
        "calibrate",
        model,
        "--corpus",
        corpus,
        "--tokens",
        "32",
        "--seq-len",
        "16",
        "--out",
        out,
        "--no-progress",
    )


def _with_config(tiny, tmp_path, edit) -> str:
    """A copy of `tiny` whose config.json text config is changed by `edit(text)`."""
    d = tmp_path / "edited"
    shutil.copytree(tiny, d)
    config = json.loads((d / "config.json").read_text())
    edit(config["text_config"])
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _with_tensors(tiny, tmp_path, edit) -> str:
    """A copy of `tiny` whose tensors (prefix-free names) are changed in place by `edit`."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "weights"
    shutil.copytree(tiny, d)
    stored = load_file(d / "model.safetensors")
    tensors = {k.removeprefix(TEXT): v for k, v in stored.items()}
    edit(tensors)
    save_file(
        {TEXT + k: v for k, v in tensors.items()},
        d / "model.safetensors",
        metadata={"format": "pt"},
    )
    return str(d)


def _put(key, value):
    def edit(text):
        if value is _DELETE:
            del text[key]
        else:
            text[key] = value

    return edit


_DELETE = object()
BAD_VALUES = [  # (field, value, words of the message)
    ("num_experts_per_token", _DELETE, "is missing"),
    ("num_experts_per_token", 0, "1..num_experts (got 0)"),
    ("num_experts_per_token", 17, "1..num_experts (got 17)"),
    ("num_experts_per_token", 4.0, "must be an int (got 4.0)"),
    ("num_experts_per_token", True, "must be an int (got True)"),
    ("num_experts_per_token", "4", "must be an int (got '4')"),
    ("rms_norm_eps", -1e-5, "> 0"),
    ("rms_norm_eps", float("nan"), "finite"),
    ("routed_scaling_factor", 1e308, "<= 1e+06"),
    ("routed_scaling_factor", float("inf"), "finite"),
    ("moe_layer_freq", 0, "1..4096 (got 0)"),
    ("num_experts", 10**12, "got 1000000000000"),
    ("num_experts", [16], "must be an int (got [16])"),
    ("num_hidden_layers", 10**12, "got 1000000000000"),
    ("num_hidden_layers", 5000, "1..4096 (got 5000)"),
    ("num_experts_per_layer", {"1": 10**12}, "got 1000000000000"),
    ("num_experts_per_layer", {"99": 8}, "keys must be layers"),
    ("hidden_size", "64", "must be an int"),
    ("linear_attn_config", [1], "must be a JSON object"),
]


@pytest.mark.parametrize(("field", "value", "words"), BAD_VALUES)
def test_info_refuses_a_bad_config_value_with_exit_2_naming_file_and_field(
    tiny, tmp_path, capsys, field, value, words
):
    d = _with_config(tiny, tmp_path, _put(field, value))
    code, err = _cli(capsys, "info", d)
    assert code == 2, err
    assert err.startswith(f"reap: error: {d}/config.json: {field}: ") and words in err
    assert err.count("\n") == 1


def test_routed_experts_over_all_layers_are_bounded(tiny, tmp_path, capsys):
    """Each count below its own limit, their product far above any model: refused at once
    (`info` lists every tensor; it must not grow with a typo)."""

    def edit(text):
        text["num_experts"], text["num_hidden_layers"] = 60000, 4000

    code, err = _cli(capsys, "info", _with_config(tiny, tmp_path, edit))
    assert code == 2 and "num_experts: 60000 experts x 4000 layers exceeds" in err


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_experts_per_token", _DELETE),
        ("num_experts_per_token", 0),
        ("rms_norm_eps", float("nan")),
    ],
)
def test_run_and_calibrate_refuse_the_same_config_values(
    tiny, corpus, tmp_path, capsys, field, value
):
    d = _with_config(tiny, tmp_path, _put(field, value))
    for code, err in (_run(capsys, d), _calibrate(capsys, d, corpus, tmp_path / "out")):
        assert code == 2 and f"{d}/config.json: {field}: " in err, err
    assert not (tmp_path / "out" / "all.safetensors").exists()


def test_hf_families_refuse_missing_top_k_and_bad_ranges():
    """Families read from transformers' configs: no silent default for top-k, same ranges."""
    from reap.models import family
    from reap.models.validate import ConfigError

    configs = {  # a release of each, shrunk (releases carry keys with no safe default)
        "qwen3-30b-a3b": ("num_experts", "num_experts_per_tok"),
        "mixtral-8x7b": ("num_local_experts", "num_experts_per_tok"),
        "deepseek-v3": ("n_routed_experts", "num_experts_per_tok"),
        "gpt-oss-20b": ("num_local_experts", "num_experts_per_tok"),
    }
    for release, (experts, top_k) in configs.items():
        good = {
            **json.loads((RELEASES / release / "config.json").read_text()),
            "layer_types": ["sliding_attention", "full_attention"],
            "vocab_size": 300,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            experts: 8,
            top_k: 2,
        }
        fam = family(good)
        fam.Config.from_dict(good)
        for bad, words in (
            ({top_k: None}, "is missing"),
            ({top_k: 0}, "1.."),
            ({top_k: 9}, "1.."),
            ({"rms_norm_eps": -1.0}, "> 0"),
            ({"hidden_size": 64.5}, "must be an int"),
            ({"num_hidden_layers": 10**12}, "got 1000000000000"),
        ):
            config = {k: v for k, v in {**good, **bad}.items() if not (k in bad and v is None)}
            with pytest.raises(ConfigError, match=words) as refused:
                fam.Config.from_dict(config)
            assert refused.value.exit_code == 2 and refused.value.field == next(iter(bad))


def test_family_dispatch_refuses_non_object_configs():
    from reap.models import family

    for config in ({"model_type": ["qwen3_moe"]}, {"text_config": [1]}):
        with pytest.raises(ReapError) as refused:
            family(config)
        assert refused.value.exit_code == 2


# -- info refuses what the other commands refuse ------------------------------------------------
def test_info_refuses_a_checkpoint_that_run_refuses(tiny, tmp_path, capsys):
    def drop(tensors):
        del tensors["model.layers.2.post_attention_layernorm.weight"]

    d = _with_tensors(tiny, tmp_path, drop)
    (tmp_path / "weights" / "model.safetensors.index.json").unlink()
    run_code = _run(capsys, d)[0]
    code, err = _cli(capsys, "info", d)
    assert run_code == code == 1
    assert "post_attention_layernorm.weight is missing" in err
    assert _cli(capsys, "info", tiny)[0] == 0


def test_info_refuses_a_header_that_run_refuses(tiny, tmp_path, capsys):
    """Two tensors' byte ranges overlap: `run` reads the shard's entries and refuses (exit 2);
    `info` must check them too instead of printing a census from the config."""
    import struct

    d = tmp_path / "overlap"
    shutil.copytree(tiny, d)
    raw = (d / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8 : 8 + n].decode()
    name = TEXT + "model.layers.1.input_layernorm.weight"
    start, end = json.loads(header)[name]["data_offsets"]
    old = f'"{name}":{{"dtype":"F32","shape":[64],"data_offsets":[{start},{end}]}}'
    assert old in header
    shifted = header.replace(old, old.replace(f"[{start},{end}]", f"[{start + 4},{end + 4}]"))
    (d / "model.safetensors").write_bytes(raw[:8] + shifted.encode() + raw[8 + n :])
    run_code, run_err = _run(capsys, d)
    code, err = _cli(capsys, "info", d)
    assert run_code == code == 2 and "overlap" in err, (run_err, err)


# -- weights feeding norms and routing: NaN/Inf found before tokens or statistics --------------
POISON = [
    ("model.layers.1.input_layernorm.weight", float("nan")),
    ("model.norm.weight", float("nan")),
    ("model.layers.2.block_sparse_moe.gate.weight", float("inf")),
    ("model.layers.3.block_sparse_moe.gate.e_score_correction_bias", float("-inf")),
]


@pytest.mark.parametrize(("name", "value"), POISON)
def test_run_and_calibrate_refuse_nan_or_inf_in_norm_and_router_weights(
    tiny, corpus, tmp_path, capsys, name, value
):
    def poison(tensors):
        tensors[name][0] = value

    d = _with_tensors(tiny, tmp_path, poison)
    for code, err in (_run(capsys, d), _calibrate(capsys, d, corpus, tmp_path / "out")):
        assert code == 2 and f"{name}: holds NaN or Inf" in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "out" / "all.safetensors").exists()


def test_calibrate_exit_4_on_an_e8m0_nan_expert_scale(tiny, corpus, tmp_path, capsys):
    """`run` exits 4 on a scale byte 0xFF; calibration must not turn it into statistics."""
    from reap.models import family

    with open(f"{tiny}/config.json") as f:
        fam = family(json.load(f))

    def corrupt(tensors):
        for name, t in tensors.items():
            key = fam.expert_key(name)
            if key is not None and key[0] == 1 and name.endswith("w1.weight_scale"):
                t.fill_(255)

    d = _with_tensors(tiny, tmp_path, corrupt)
    code, err = _calibrate(capsys, d, corpus, tmp_path / "out")
    assert code == 4 and "layer 1 expert" in err and "E8M0" in err, err
    assert not (tmp_path / "out" / "all.safetensors").exists()
    assert _run(capsys, d)[0] == 4


# -- calibrate binds through the checks `run` makes --------------------------------------------
def _relabel(tensors):
    name = "model.layers.1.post_attention_layernorm.weight"
    tensors[name] = tensors[name].to(torch.float16)  # stored F16, the layout wants F32


def _narrow_experts(text):
    text["moe_intermediate_size"] = 16  # the stored experts are 32 wide


@pytest.mark.parametrize("case", ["dtype relabel", "config edit"])
def test_calibrate_refuses_what_run_refuses_as_a_binding_failure(
    tiny, corpus, tmp_path, capsys, case
):
    if case == "dtype relabel":
        d = _with_tensors(tiny, tmp_path, _relabel)
    else:
        d = _with_config(tiny, tmp_path, _narrow_experts)
    run_code, run_err = _run(capsys, d)
    code, err = _calibrate(capsys, d, corpus, tmp_path / "out")
    assert run_code == code == 1 and "tensor binding failed" in err, (run_err, err)
    assert not (tmp_path / "out" / "all.safetensors").exists()
