"""INT4 compressed-tensors `pack-quantized` experts (Kimi-K2-Thinking's format, issue 14 item 6).

The codec (`reap.quant.int4`) is proven against the `compressed-tensors` package itself (its
`pack_to_int32` / `unpack_from_int32`, `quantize` / `dequantize` and the pack-quantized
compressor) and against a per-element reference decoder; a tiny DeepSeek-V3 / Kimi K2 model with
INT4 routed experts (written by `reap synth` from a config carrying the release-style
compressed-tensors block) runs through the engine (== an fp32 forward on the dequantized
weights), `calibrate`, `eval`, `prune` (kept experts byte for byte) and `verify`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import family_runner as R
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from references import int4_dequantize_reference
from safetensors.torch import load_file, save_file

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.errors import ReapError
from reap.models import family
from reap.models.base import dict_weights
from reap.models.deepseek_v3 import family as ds
from reap.quant import int4

# The compressed-tensors block of Kimi's INT4 releases (as the Kimi-K2.5 report shows it:
# routed experts only, symmetric INT4 in groups of 32, everything else BF16).
QC = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                "symmetric": True, "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
               "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}  # fmt: skip
TINY = R.with_release_keys({  # a Kimi K2 of hidden 64: MLA with q_lora, YaRN, one dense layer
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 320,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
    "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1,
    "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.827, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
    "rope_theta": 50000.0, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0},
    "quantization_config": QC,
})  # fmt: skip
PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
ARGS = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from reap.synth import synth

    return Path(synth(copy.deepcopy(TINY), tmp_path_factory.mktemp("k2t") / "m", seed=3))


# -- the codec against compressed-tensors ------------------------------------------------------
@pytest.mark.parametrize("cols", [96, 100, 7])
def test_pack_and_unpack_equal_compressed_tensors(cols):
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-8, 8, (5, cols), generator=g, dtype=torch.int8)
    words = int4.pack(q)
    assert words.dtype == torch.int32 and torch.equal(words, pack_to_int32(q, 4))
    assert torch.equal(int4.unpack(words, cols), unpack_from_int32(words, 4, torch.Size((5, cols))))
    assert torch.equal(int4.unpack(words, cols), q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_equals_compressed_tensors_and_the_reference(dtype):
    """Same arithmetic (q * scale in the scale's dtype): equal bit for bit, on every code."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (7, 128), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every code appears
    scales = (torch.rand(7, 4, generator=g) * 0.05 + 1e-3).to(dtype)
    words = pack_to_int32(q, 4)
    want = dequantize(unpack_from_int32(words, 4, torch.Size((7, 128))), scales, None, ARGS)
    got = int4.dequantize(words, scales, 32)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    ref = int4_dequantize_reference(words, scales, 32)
    assert torch.equal(ref.to(dtype), got)
    assert torch.equal(int4.dequantize(words, scales, 32, dtype=torch.float32), got.float())


def test_quantize_and_the_compressor_round_trip_equal_compressed_tensors():
    """Our symmetric min-max quantizer gives compressed-tensors' codes; the package's
    pack-quantized compressor writes our words and decompresses to our decoded weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(2))
    words, scales = int4.quantize(w, 32)
    assert torch.equal(int4.unpack(words, 96), quantize(w, scales, None, ARGS, dtype=torch.int8))
    scheme = QuantizationScheme(targets=["Linear"], weights=ARGS)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scales}, scheme)
    assert torch.equal(packed["weight_packed"], words)
    assert [int(v) for v in packed["weight_shape"]] == [16, 96]
    dense = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    assert torch.equal(dense, int4.dequantize(words, scales, 32))
    # within half a step of its group of the original (the group's largest magnitude, clamped
    # from 7.5 to 7 steps, a little more: its scale was rounded to bf16)
    step = scales.float().repeat_interleave(32, dim=1)
    assert bool(((dense.float() - w).abs() <= 0.54 * step).all())


def test_int4_matrix_applies_itself_and_checks_its_bytes():
    g = torch.Generator().manual_seed(4)
    words, scales = int4.quantize(torch.randn(24, 64, generator=g), 32)
    m = int4.INT4Matrix.from_stored(words, scales, torch.tensor([24, 64], dtype=torch.int32))
    assert m.group == 32 and m.shape == (24, 64)
    x = torch.randn(3, 64, generator=g)
    w = int4_dequantize_reference(words, scales, 32).to(scales.dtype).float()  # [24, 64]
    assert torch.allclose(m.linear(x), x @ w.T, atol=1e-5)
    m.check("w")
    bad_shape = int4.INT4Matrix.from_stored(words, scales, torch.tensor([24, 65]))
    with pytest.raises(ReapError, match="w: weight_shape"):
        bad_shape.check("w")
    nan = scales.clone()
    nan[3, 1] = float("nan")
    with pytest.raises(ReapError, match="Inf or NaN"):
        int4.INT4Matrix.from_stored(words, nan, torch.tensor([24, 64])).check("w")
    # the engine's stand-in for an expert that failed to load: zero bytes decode to zeros
    zeros = int4.INT4Matrix.from_stored(*(torch.zeros(s, dtype=torch.uint8) for s in
                                          ((24, 8), (24, 2), (2,))))  # fmt: skip
    assert torch.equal(zeros.dense(), torch.zeros(24, 64))


# -- config and layout -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, field",
    [
        ({"format": "int-quantized"}, "quantization_config.format"),
        ({"weights.num_bits": 8}, "weights.num_bits"),
        ({"weights.symmetric": False}, "weights.symmetric"),
        ({"weights.strategy": "channel"}, "weights.strategy"),
        ({"weights.type": "float"}, "weights.type"),
        ({"weights.group_size": 12}, "weights.group_size"),
        ({"weights.actorder": "group"}, "weights.actorder"),
        ({"input_activations": {"num_bits": 8}}, "group_0.input_activations"),
        ({"quant_method": "awq"}, "quantization_config.quant_method"),
        ({"ignore": "lm_head"}, "quantization_config.ignore"),
    ],
)
def test_unsupported_quantization_configs_are_refused_naming_the_key(
    change, field, tiny, tmp_path, capsys
):
    """Config.from_dict and the CLI (on a copy of the INT4 model with the changed config)."""
    import shutil

    qc = copy.deepcopy(QC)
    for key, value in change.items():
        where = qc["config_groups"]["group_0"]
        if key.startswith("weights."):
            where["weights"][key[8:]] = value
        elif key == "input_activations":
            where[key] = value
        else:
            qc[key] = value
    with pytest.raises(ReapError, match=field.replace(".", r"\.")):
        ds.Config.from_dict({**TINY, "quantization_config": qc})
    bad = Path(shutil.copytree(tiny, tmp_path / "m"))
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    assert main(["run", str(bad), "--prompt-ids", "1,2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("reap: error:") and err.count("\n") == 1 and field in err, err


def test_layout_stores_the_routed_experts_int4_and_everything_else_as_before():
    specs = {s.name: s for s in ds.layout(TINY)}
    plain = {s.name: s for s in ds.layout({**TINY, "quantization_config": None})}
    p = "model.layers.1.mlp.experts.5."
    for n, (O, I) in {"down_proj": (64, 32), "gate_proj": (32, 64), "up_proj": (32, 64)}.items():
        packed, scale, shape = (specs[f"{p}{n}.weight_{k}"] for k in ("packed", "scale", "shape"))
        assert (packed.dtype, packed.shape, packed.role) == ("I32", (O, I // 8), "int4.packed")
        assert (scale.dtype, scale.shape, scale.role) == ("BF16", (O, I // 32), "int4.scales")
        assert (shape.dtype, shape.shape, shape.role) == ("I32", (2,), "int4.shape")
        assert packed.weights == O * I and scale.weights == shape.weights == 0
        assert f"{p}{n}.weight" not in specs and plain[f"{p}{n}.weight"].shape == (O, I)
    # the attention, shared experts, dense MLP, router and head stay as without quantization
    assert {n: s for n, s in specs.items() if ".experts." not in n} == {
        n: s for n, s in plain.items() if ".experts." not in n
    }
    cfg = ds.Config.from_dict(TINY)
    names = ds.expert_tensor_names(cfg, 1, 5)
    assert names == [f"{p}{n}_proj.weight_{k}" for n in ("down", "gate", "up")
                     for k in ("packed", "scale", "shape")]  # fmt: skip
    assert sum(specs[n].weights for n in names) == 3 * 64 * 32


# -- end to end on a tiny model of the release's layout ----------------------------------------
def _dequantized(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config without quantization, every tensor with each INT4 triple replaced by its weight
    decoded one element at a time by `dequantize_reference`, in float32)."""
    with Checkpoint.open(path) as ck:
        config, tensors = ck.config, {n: ck.read(n) for n in ck.tensors}
    out = {}
    for name, t in tensors.items():
        if name.endswith("weight_packed"):
            base = name.removesuffix("_packed")
            scales, shape = tensors[base + "_scale"], tensors[base + "_shape"].tolist()
            w = int4_dequantize_reference(t, scales, shape[1] // scales.shape[1], shape[1])
            out[base] = w.to(scales.dtype).float()
        elif not name.endswith(("weight_scale", "weight_shape")):
            out[name] = t.float()
    return {k: v for k, v in config.items() if k != "quantization_config"}, out


def test_engine_equals_an_fp32_forward_on_the_dequantized_weights(tiny):
    from reap.engine import Engine

    config, weights = _dequantized(tiny)
    cfg = ds.Config.from_dict(config)
    ref = ds.Model(cfg).forward(dict_weights(weights), torch.tensor([PROMPT]))[0].numpy()  # [T, V]
    assert np.abs(ref).max() > 0.5
    for preset in ("ultra", "max"):
        with Engine.open(tiny, preset=preset, context=64, dtype="float32") as eng:
            got = eng.logits([PROMPT])[0].numpy()
        assert float(np.abs(got - ref).max()) < 1e-4, preset
    _, _, model, get = R.load_ours(tiny)  # our model on the stored INT4 tensors, in memory
    assert float(np.abs(model.forward(get, torch.tensor([PROMPT]))[0].numpy() - ref).max()) < 1e-4


def _transformers(path: Path, out: Path):
    """transformers' DeepseekV3ForCausalLM on a copy of `path` saying model_type deepseek_v3 (the
    rename Kimi's deploy notes give for engines without kimi_k2), in float32: transformers with
    compressed-tensors decompresses the INT4 experts itself (into bf16 parameters; it refuses
    `.float()` on a quantized model, so they are cast here one by one)."""
    import shutil

    import transformers

    shutil.copytree(path, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    for p in hf.parameters():
        p.data = p.data.float()
    return hf


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0].numpy()  # [T, V]


def test_transformers_decompresses_the_experts_as_we_do_and_agrees_with_the_engine(tiny, tmp_path):
    """The peer oracle: transformers + compressed-tensors loads the INT4 checkpoint; its decoded
    experts equal ours bit for bit and its logits equal our engine's."""
    from reap.engine import Engine

    hf = _transformers(tiny, tmp_path / "hf")
    experts = hf.model.layers[1].mlp.experts  # fused [E, 2F, D] gate_up and [E, D, F] down
    with Checkpoint.open(tiny) as ck:
        for e in range(8):
            p = f"model.layers.1.mlp.experts.{e}."
            stored = {n.removeprefix(p): ck.read(n) for n in ck.tensors if n.startswith(p)}
            w = {n: m.dense() for n, m in ds.expert_matrices(stored).items()}  # [O, I] each
            gate_up = torch.cat([w["gate_proj.weight"], w["up_proj.weight"]])  # [2F, D]
            assert torch.equal(experts.gate_up_proj[e], gate_up)
            assert torch.equal(experts.down_proj[e], w["down_proj.weight"])
    ref = _hf_logits(hf, PROMPT)
    with Engine.open(tiny, preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([PROMPT])[0].numpy()
    assert float(np.abs(got - ref).max()) < 1e-4


def test_calibrate_plan_prune_verify_eval_and_run(tiny, tmp_path, capsys):
    """Every stage on the INT4 model: statistics, a plan keeping 4 of 8 experts, a pruned build
    whose kept experts are the source's bytes (INT4 triples verbatim) and that `verify` passes,
    then `eval` and `run` on it."""
    from reap.prune.plan_file import Plan
    from reap.stats import ExpertStats

    spec = R.write_corpora(tmp_path / "corpora")
    stats = tmp_path / "stats"
    assert main(["calibrate", str(tiny), "--corpus", spec, "--tokens", "64", "--seq-len", "16",
                 "--out", str(stats), "--no-progress"]) == 0  # fmt: skip
    st = ExpertStats.load(stats / "all.safetensors")
    assert st.layers == [1, 2] and int(st.count.sum()) == 64 * 2 * 2
    plan, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", str(stats / "all.safetensors"), "--model", str(tiny), "--keep", "4",
                 "--out", str(plan)]) == 0  # fmt: skip
    assert main(["prune", str(tiny), "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    R.check_pruned_layout(tiny, out, Plan.load(plan))
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))  # the size model's bytes
    assert abs(written / Plan.load(plan).predicted_bytes - 1) < 5e-3, written
    assert main(["verify", str(out), "--source", str(tiny)]) == 0
    pruned = Checkpoint.open(out)
    assert pruned.config["n_routed_experts"] == 4 and pruned.config["quantization_config"] == QC
    assert pruned.tensors["model.layers.2.mlp.experts.3.up_proj.weight_packed"].dtype == "I32"
    from reap.engine import Engine

    with Engine.open(out, preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([PROMPT])[0].numpy()
    ref = _hf_logits(_transformers(out, tmp_path / "hf"), PROMPT)  # the pruned build loads too
    assert float(np.abs(got - ref).max()) < 1e-4
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "domain": "en", "prompt": "hello"}) + "\n")
    assert main(["eval", str(out), "--reference", str(tiny), "--out", str(tmp_path / "eval"),
                 "--prompts", str(prompts), "--gen-tokens", "3", "--bootstrap", "0",
                 "--no-plots", "--quiet"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["run", str(out), "--prompt-ids", "1,2,3", "--max-tokens", "3", "--quiet"]) == 0


def _edited(tiny: Path, out: Path, name: str, edit) -> Path:
    """A copy of checkpoint `tiny` at `out` with stored tensor `name` replaced by edit(tensor)."""
    import shutil

    shutil.copytree(tiny, out)
    shard = next(p for p in sorted(out.glob("*.safetensors")) if name in load_file(p))
    tensors = load_file(shard)
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, shard)
    return out


def test_a_packed_tensor_of_the_wrong_shape_fails_binding_in_one_line(tiny, tmp_path, capsys):
    """A stored shape the layout does not want is a binding failure (exit 1, as for any tensor)."""
    name = "model.layers.1.mlp.experts.2.gate_proj.weight_packed"
    bad = _edited(tiny, tmp_path / "bad", name, lambda t: t[:, :-1])
    code = main(["run", str(bad), "--prompt-ids", "1,2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("reap: error:") and err.count("\n") == 1, err
    assert f"{name} is I32 [32, 7], the layout wants I32 [32, 8]" in err


def test_a_corrupt_weight_shape_is_an_expert_load_failure(tiny, tmp_path, capsys):
    """Right shapes, wrong bytes: the INT4 record's check refuses the expert when it is read
    (exit 4: the output is not trustworthy), naming the matrix."""
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_shape"
    bad = _edited(tiny, tmp_path / "bad", name, lambda t: torch.tensor([32, 65], dtype=t.dtype))
    ids = ",".join(map(str, PROMPT))  # 12 tokens x top-2 of 8: expert 0 of layer 1 is used
    code = main(["run", str(bad), "--prompt-ids", ids, "--max-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 4 and err.count("\n") == 1, err
    assert "expert 0: gate_proj.weight: weight_shape [32, 65] != [32, 64]: corrupt bytes" in err


def test_family_of_the_release_config():
    assert family(TINY) is ds
    assert ds.Config.from_dict(TINY).quant_scheme.int4.group == 32


# -- the release's own tensor list -------------------------------------------------------------
def test_the_int4_release_layout_equals_its_tensor_list():
    """Kimi-K2.5 (`kimi_k25`: a Kimi K2 text model with the same compressed-tensors INT4 block;
    no verbatim Kimi-K2-Thinking config or tensor list was found in the public index): its
    verbatim config.json, quantization included, lays out exactly the release's tensor table
    (names, shapes, dtypes): INT4 routed experts, BF16 trunk, vision tower."""
    from release_tables import RELEASES, expand, read_rows

    config = json.loads((RELEASES / "kimi-k2.5" / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "pack-quantized"
    got = {s.name: (tuple(s.shape), s.dtype) for s in family(config).layout(config)}
    assert expand(read_rows(RELEASES / "kimi-k2.5" / "tensors.md"), set(got)) == got
    assert len(got) == 208_550 and sum(n.endswith(".weight_packed") for n in got) == 60 * 384 * 3


def _compressed_tensors_modules(config: dict, ignore: list[str]) -> set[str]:
    """The modules compressed-tensors itself matches (targets ["Linear"], `ignore`) in
    transformers' DeepseekV3 of `config`, built on the meta device (its experts are fused 3D
    parameters, not Linear modules, so they never match there)."""
    import transformers
    from compressed_tensors.utils.match import match_named_modules

    plain = {k: v for k, v in config.items() if k not in ("quantization_config", "model_type")}
    hf_config = transformers.AutoConfig.for_model("deepseek_v3", **plain)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return {name for name, _ in match_named_modules(model, ["Linear"], ignore)}


@pytest.mark.parametrize("ignore", [QC["ignore"], ["lm_head"]])
def test_what_is_int4_follows_compressed_tensors_matching(ignore):
    """Our layout stores INT4 exactly the (non-expert) modules compressed-tensors matches: none
    with the release's ignore list; with only `lm_head` ignored, the attention, dense and shared
    MLPs (the router is no torch Linear)."""
    config = {**TINY, "q_lora_rank": 32, "quantization_config": {**QC, "ignore": ignore}}
    ours = {
        s.name.removesuffix(".weight_packed")
        for s in ds.layout(config)
        if s.role == "int4.packed" and s.expert is None
    }
    assert ours == _compressed_tensors_modules(config, ignore)
    assert len(ours) == (0 if ignore == QC["ignore"] else 24)


def test_a_checkpoint_quantizing_every_linear_but_the_head(tmp_path):
    """With only `lm_head` ignored (attention, dense and shared MLPs INT4 too): the engine equals
    the fp32 forward on the dequantized weights."""
    from reap.engine import Engine
    from reap.synth import synth

    config = {**TINY, "q_lora_rank": 32, "quantization_config": {**QC, "ignore": ["lm_head"]}}
    specs = {s.name: s for s in ds.layout(config)}
    assert specs["model.layers.1.mlp.gate.weight"].dtype == "BF16" and "lm_head.weight" in specs
    path = Path(synth(copy.deepcopy(config), tmp_path / "m", seed=5))
    _, weights = _dequantized(path)
    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    ref = ds.Model(ds.Config.from_dict(plain)).forward(
        dict_weights(weights), torch.tensor([PROMPT])
    )
    with Engine.open(path, preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([PROMPT])[0].numpy()
    assert float(np.abs(got - ref[0].numpy()).max()) < 1e-4


def test_a_k25_style_release_with_int4_experts_runs_and_prunes(tmp_path):
    """A tiny `kimi_k25` checkpoint in the release's layout (text under `language_model.`, INT4
    routed experts, a MoonViT tower and projector): the engine equals the fp32 forward on the
    dequantized weights, and calibrate, plan, prune (experts and tower byte for byte) and verify
    run on it."""
    from reap.engine import Engine
    from reap.prune.plan_file import Plan
    from reap.synth import synth

    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": copy.deepcopy(TINY)}  # fmt: skip
    path = Path(synth(config, tmp_path / "k25", vision=True, seed=7))
    with Checkpoint.open(path) as ck:
        assert ck.prefix == "language_model." and ck.config["model_type"] == "kimi_k25"
        assert ck.tensors["model.layers.1.mlp.experts.0.up_proj.weight_packed"].dtype == "I32"
        tower = [n for n in ck.tensors if n.startswith(("vision_tower.", "mm_projector."))]
    text, weights = _dequantized(path)
    plain = {k: v for k, v in text["text_config"].items() if k != "quantization_config"}
    model = ds.Model(ds.Config.from_dict(plain))
    ref = model.forward(dict_weights(weights), torch.tensor([PROMPT]))[0].numpy()  # [T, V]
    with Engine.open(path, preset="ultra", context=64, dtype="float32") as eng:
        assert float(np.abs(eng.logits([PROMPT])[0].numpy() - ref).max()) < 1e-4
    spec, stats = R.write_corpora(tmp_path / "corpora"), tmp_path / "stats"
    assert main(["calibrate", str(path), "--corpus", spec, "--tokens", "32", "--seq-len", "16",
                 "--out", str(stats), "--no-progress"]) == 0  # fmt: skip
    plan, out = tmp_path / "plan.json", tmp_path / "pruned"
    assert main(["plan", str(stats / "all.safetensors"), "--model", str(path), "--keep", "4",
                 "--out", str(plan)]) == 0  # fmt: skip
    assert main(["prune", str(path), "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    R.check_pruned_layout(path, out, Plan.load(plan))  # kept INT4 experts: the source's bytes
    with Checkpoint.open(path) as a, Checkpoint.open(out) as b:
        assert all(a.read_raw(n) == b.read_raw(n) for n in tower)
    assert main(["verify", str(out), "--source", str(path)]) == 0
