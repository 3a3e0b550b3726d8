"""`reap synth`: deterministic bytes, files exactly as the layout declares, sane value scales
(O(1) activations, realistic decays, unit-variance MXFP4 experts on both drawing paths), the CLI,
and the byte-level tokenizer it ships."""

import hashlib
import json
import math

import pytest
import torch
from references import unpack_nibbles
from safetensors import safe_open

from reap import synth
from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.errors import CheckpointError
from reap.models import builtin_config
from reap.models.kimi_k3 import family as kimi_k3
from reap.models.shared import kda
from reap.quant import mxfp4
from reap.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "a"
    synth.synth("k3-tiny", path, seed=3, max_shard_bytes=300_000)
    return path


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes(tiny, tmp_path):
    synth.synth("k3-tiny", tmp_path / "b", seed=3, max_shard_bytes=300_000)
    synth.synth("k3-tiny", tmp_path / "c", seed=4, max_shard_bytes=300_000)
    a, b, c = _digests(tiny), _digests(tmp_path / "b"), _digests(tmp_path / "c")
    assert a == b and len(a) > 5  # several shards, index, config, tokenizer
    shards = [n for n in a if n.startswith("model-")]
    assert all(a[n] != c[n] for n in shards)
    assert a["model.safetensors.index.json"] == c["model.safetensors.index.json"]


def test_files_are_the_layout(tiny):
    ck = Checkpoint.open(tiny)
    specs = kimi_k3.layout(ck.config)
    assert ck.prefix == "language_model."
    assert set(ck.tensors) == {s.name for s in specs}
    on_disk = sorted(ck.tensors.values(), key=lambda t: (str(t.file), t.start))
    assert [t.name for t in on_disk] == [s.name for s in specs]  # file order is layout order
    keys = {}
    for shard in sorted(tiny.glob("model-*.safetensors")):  # an independent reader
        with safe_open(shard, "pt") as f:
            keys.update({k: f.get_slice(k) for k in f.keys()})  # noqa: SIM118
    assert set(keys) == {"language_model." + s.name for s in specs}
    dtypes = {"BF16": "BF16", "F32": "F32", "U8": "U8"}
    for s in specs:
        info = ck.tensors[s.name]
        assert (info.dtype, tuple(info.shape)) == (s.dtype, s.shape), s.name
        sl = keys["language_model." + s.name]
        assert (dtypes[sl.get_dtype()], tuple(sl.get_shape())) == (s.dtype, s.shape)
    text = ck.config["text_config"]
    assert ck.config["model_type"] == "kimi_k3" and text["model_type"] == "kimi_linear"
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert text["torch_dtype"] == "bfloat16"
    assert {s.dtype for s in specs if s.name.endswith(("A_log", "conv1d.weight"))} == {"F32"}


def test_values_keep_activations_order_one(tiny):
    ck = Checkpoint.open(tiny)
    cfg = kimi_k3.Config.from_dict(ck.config)
    model = kimi_k3.Model(cfg)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    state = model.embed(ck.read, ids)
    for i in range(model.n_layers):
        state, x = model.attn_block(i, ck.read, state)
        y = model.mlp_block(i, ck.read, x)
        state = model.finish_layer(i, state, y)
        for t in (x, y, state.hidden):
            assert 0.2 < t.pow(2).mean().sqrt() < 5, i
    logits = model.head(ck.read, state)
    assert torch.isfinite(logits).all() and 0.2 < logits.std() < 5
    # KDA decays per step span short and long memory, inside [exp(-5), 1]
    p = "model.layers.0.self_attn."
    a = kimi_k3.blocks.linear(
        kimi_k3.blocks.linear(torch.randn(500, cfg.hidden_size), ck.read(p + "f_a_proj.weight").float()),
        ck.read(p + "f_b_proj.weight").float(),
    ).reshape(500, cfg.kda_heads, cfg.kda_head_dim)
    dt = ck.read(p + "dt_bias").reshape(cfg.kda_heads, -1)
    g = kda.kda_log_decay(a, ck.read(p + "A_log")[: cfg.kda_heads], dt, -5.0).exp()
    assert g.min() >= math.exp(-5) * (1 - 1e-6) and g.max() <= 1
    assert (g < 0.5).float().mean() > 0.05 and (g > 0.9).float().mean() > 0.05


def _expert_std(get, cfg, layer=1, expert=0):
    out = {}
    for n in ("w1", "w2", "w3"):
        name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{n}."
        w = mxfp4.dequantize(get(name + "weight_packed"), get(name + "weight_scale"))
        out[n] = (w.std().item(), w.shape[1])
    return out


@pytest.mark.parametrize("direct", [False, True])
def test_experts_have_unit_variance_outputs(tmp_path, monkeypatch, direct):
    if direct:  # the k3-full path: random codes and scales drawn directly
        monkeypatch.setattr(synth, "_DIRECT_CODES_ABOVE", 0)
    synth.synth("k3-tiny", tmp_path / "x", seed=1, layers=2)
    ck = Checkpoint.open(tmp_path / "x")
    for std, fan_in in _expert_std(ck.read, None).values():
        assert 0.5 < std * math.sqrt(fan_in) < 2
    packed = ck.read("model.layers.1.block_sparse_moe.experts.3.w1.weight_packed")
    codes = unpack_nibbles(packed).flatten().bincount(minlength=16).float()
    if direct:  # uniform over the 16 codes
        assert (codes / codes.mean() - 1).abs().max() < 0.5
        scales = ck.read("model.layers.1.block_sparse_moe.experts.3.w1.weight_scale")
        assert scales.max() - scales.min() <= 2


def test_cli(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["synth", "k3-tiny", "--out", str(out), "--seed", "2", "--layers", "2"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 2
    assert len(Checkpoint.open(out).tensors) == len(kimi_k3.layout(config))
    capsys.readouterr()
    assert main(["synth", "k3-tiny", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "Traceback" not in err and err.count("\n") == 1
    assert main(["synth", "k3-tiny", "--out", str(out), "--overwrite"]) == 0
    capsys.readouterr()
    assert main(["synth", "k3-nope", "--out", str(tmp_path / "n")]) == 2
    err = capsys.readouterr().err
    assert "k3-tiny" in err and err.count("\n") == 1
    assert main(["synth", "k3-tiny", "--out", str(tmp_path / "m"), "--layers", "99"]) == 2


def test_config_path_and_layers():
    cfg = builtin_config("k3-full", layers=2)
    specs = kimi_k3.layout(cfg)
    assert {s.layer for s in specs} == {None, 0, 1} and not any(
        s.component == "vision" for s in specs
    )
    assert sum(s.expert is not None for s in specs) == 896 * 6


def test_tokenizer(tiny, tmp_path):
    tok = load_tokenizer(tiny)
    text = "Grüße, 世界! <|endoftext|>\n\tend"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text and tok.decode([*ids, tok.eos_id]) == text
    assert tok.eos_id == 256 and tok.vocab_size == 257
    from transformers import AutoTokenizer  # an independent loader of the same files

    hf = AutoTokenizer.from_pretrained(str(tiny))
    assert hf.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    assert hf.eos_token_id == 256
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
