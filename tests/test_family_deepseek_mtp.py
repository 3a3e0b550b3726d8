"""DeepSeek-V3's multi-token-prediction (MTP) layer, read in place and never used.

A tiny transformers DeepSeek-V3 model saved offline, then one MTP layer appended as the releases
store it (`model.layers.{L}`, L = num_hidden_layers: embedding, enorm, hnorm, eh_proj,
shared_head and a full MoE decoder layer; random, in its own shard; config.json with
`torch_dtype` and `num_nextn_predict_layers: 1`). transformers ignores that layer, and so must
we: the layout lists it exactly, our model, the engine and calibration give transformers'
numbers and never read it, `reap plan` + `reap prune` leave it out (config says 0 MTP layers),
`reap verify` accepts that, and sizes count it in the totals but not in the active parameters.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import family_runner as R
import pytest
import test_family_deepseek_v3 as T
import torch
from safetensors.torch import load_file, save_file

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.models.deepseek_v3 import family as ds
from reap.sizes import SizeModel

PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
MTP_FILE = "model-mtp.safetensors"


def add_mtp(src: Path, out: Path, seed: int = 7) -> tuple[str, list[str]]:
    """A copy of transformers checkpoint `src` with the release's MTP layer appended, its names
    built from the release's naming (own tensors + the last decoder layer's, renumbered), not
    from our layout. Returns (path, the MTP tensor names)."""
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    L, D, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    base = load_file(out / "model.safetensors")
    p = f"model.layers.{L}."
    shapes = {"embed_tokens": (V, D), "enorm": (D,), "hnorm": (D,), "eh_proj": (D, 2 * D)}
    shapes |= {"shared_head.norm": (D,), "shared_head.head": (V, D)}
    last = f"model.layers.{L - 1}."
    shapes |= {p + n[len(last) :]: t.shape for n, t in base.items() if n.startswith(last)}
    gen = torch.Generator().manual_seed(seed)
    mtp = {(n if n.startswith(p) else f"{p}{n}.weight"): torch.randn(s, generator=gen) * 0.1
           for n, s in shapes.items()}  # fmt: skip
    save_file(mtp, out / MTP_FILE, metadata={"format": "pt"})
    files = {n: "model.safetensors" for n in base} | {n: MTP_FILE for n in mtp}
    size = sum(t.numel() * 4 for t in (*base.values(), *mtp.values()))
    index = {"metadata": {"total_size": size}, "weight_map": files}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg["torch_dtype"] = cfg.pop("dtype")  # as the releases write it
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out), sorted(mtp)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(base path, transformers model, MTP path, MTP tensor names, transformers on MTP path)."""
    root = tmp_path_factory.mktemp("mtp")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kwargs = {**T.BASE, **T.VARIANTS["yarn"]}  # q_lora, 16 experts in 4 groups, YaRN
    base, hf = R.save_hf_tiny(DeepseekV3ForCausalLM, DeepseekV3Config, kwargs, root / "base", 1)
    path, names = add_mtp(Path(base), root / "with_mtp")
    return base, hf, path, names, R.load_hf(path)


# -- layout and sizes --------------------------------------------------------------------------
def test_layout_lists_the_mtp_layer_exactly_as_stored(models):
    base, _, path, names, _ = models
    ck = Checkpoint.open(path)
    specs = ds.layout(ck.config)
    assert {s.name: (s.dtype, s.shape) for s in specs} == {
        n: (t.dtype, tuple(t.shape)) for n, t in ck.tensors.items()
    }
    mtp = [s for s in specs if s.component == "mtp"]
    # own tensors, 2 norms, 7 MLA, router weight and bias, shared and 16 routed experts
    assert sorted(s.name for s in mtp) == names and len(names) == 6 + 2 + 7 + 2 + 3 + 16 * 3
    assert all(s.layer is None and s.expert is None for s in mtp)  # nothing sees a layer 3
    # transformers writes num_nextn_predict_layers: 1 (its default) but saves no MTP layer
    hf_cfg = Checkpoint.open(base).config
    assert hf_cfg["num_nextn_predict_layers"] == 1 and "dtype" in hf_cfg
    assert not [s for s in ds.layout(hf_cfg) if s.component == "mtp"]
    none = {**ck.config, "num_nextn_predict_layers": 0}
    assert [s.name for s in ds.layout(none)] == [s.name for s in specs if s.component != "mtp"]


V3 = R.with_release_keys({
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
})  # the released DeepSeek-V3 config.json's architecture keys


def test_sizes_count_the_mtp_layer_in_the_totals_only():
    """DeepSeek-V3 is published as 671 B + 14 B MTP = 685 B parameters."""
    with_mtp = SizeModel.from_config({**V3, "num_nextn_predict_layers": 1})
    without = SizeModel.from_config(V3)
    assert without.total_params == pytest.approx(671e9, rel=0.005)
    assert with_mtp.total_params == pytest.approx(685e9, rel=0.005)
    D, V, E, F, H = 7168, 129280, 256, 2048, 128
    mla = D * 1536 + 1536 + 1536 * H * 192 + D * 576 + 512 + 512 * H * 256 + H * 128 * D
    moe = 2 * D + mla + E * D + E + 3 * D * F + E * 3 * D * F  # norms, MLA, router, experts
    mtp = 2 * V * D + 3 * D + 2 * D * D + moe
    assert with_mtp.census["mtp"]["params"] == mtp
    assert with_mtp.total_params - without.total_params == mtp
    assert with_mtp.active_params == without.active_params == pytest.approx(37e9, rel=0.02)
    assert with_mtp.moe_layers == without.moe_layers == list(range(3, 61))
    # a pruned build leaves the MTP layer out; the source holds it, FP8 but for eh_proj
    assert with_mtp.predict_bytes(64) == without.predict_bytes(64)
    assert with_mtp.predict_params(64) == without.predict_params(64)
    assert with_mtp.predict_params() == with_mtp.total_params
    assert with_mtp.predict_bytes() - without.predict_bytes() > mtp - 2 * D * D
    dtypes = {s.name: s.dtype for s in ds.layout({**V3, "num_nextn_predict_layers": 1})}
    assert dtypes["model.layers.61.eh_proj.weight"] == "BF16"
    assert "model.layers.61.eh_proj.weight_scale_inv" not in dtypes
    assert dtypes["model.layers.61.mlp.experts.255.up_proj.weight_scale_inv"] == "F32"


def test_reap_info_counts_the_mtp_component(models, capsys):
    from reap.info_cli import info

    base, _, path, names, _ = models
    assert main(["info", path]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert any(line.split()[0] == "mtp" for line in rows)
    a, b = info(path), info(base)
    ck = Checkpoint.open(path)
    n_mtp = sum(math.prod(ck.tensors[n].shape) for n in names)
    assert a["components"]["mtp"]["params"] == a["total_params"] - b["total_params"] == n_mtp
    assert a["active_params"] == b["active_params"]
    assert abs(a["checkpoint_bytes"] / a["bytes_on_disk"] - 1) < 0.01


# -- the model, the engine, calibration --------------------------------------------------------
def test_logits_equal_transformers_which_ignores_the_mtp_layer(models):
    _, hf, path, _, hf_mtp = models
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        assert torch.equal(hf_mtp(ids).logits, hf(ids).logits)  # transformers drops layer 3
    R.check_logits(path, hf_mtp, PROMPT, steps=4)


def test_engine_equals_transformers_and_never_reads_the_mtp_layer(models):
    from reap.engine import Engine

    base, _, path, _, hf_mtp = models
    R.check_engine(path, hf_mtp, PROMPT, steps=4)
    reads = []
    for p in (base, path):
        with Engine.open(p, preset="ultra", context=64, dtype="float32") as eng:
            eng.generate([PROMPT], max_tokens=3)
            reads.append(eng.counters()["bytes"])
    assert reads[0] == reads[1]  # not one byte more with the MTP layer stored


@pytest.fixture(scope="module")
def calibrated(models, tmp_path_factory):
    """Statistics files of the checkpoint with the MTP layer (checked against forward hooks on
    transformers by `family_runner.check_calibration`) and of the one without it."""
    from reap.calibrate.pipeline import calibrate

    base, _, path, _, hf_mtp = models
    root = tmp_path_factory.mktemp("cal")
    spec = R.write_corpora(root / "corpora")
    R.check_calibration(path, hf_mtp, root / "mtp", probs_fn=R.sigmoid_probs, corpus=spec)
    res = calibrate(
        model=base,
        corpus=spec,
        tokens=256,
        seq_len=32,
        out=str(root / "base"),
        batch=4,
        progress=False,
    )  # check_calibration's arguments
    return str(root / "mtp" / "stats" / "all.safetensors"), res.files["all"]


def test_calibration_ignores_the_mtp_layer(calibrated):
    from reap.stats import ExpertStats

    a, b = (ExpertStats.load(f) for f in calibrated)
    assert a.layers == b.layers == [1, 2] and a.tokens == b.tokens == 256
    for field in ("count", "gate_sum", "reap_sum", "ean_sum", "max_act", "prob_mass", "coact"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


# -- plan, prune, verify -----------------------------------------------------------------------
def test_prune_leaves_the_mtp_layer_out_and_verify_accepts_it(models, calibrated, tmp_path):
    from transformers import DeepseekV3ForCausalLM

    from reap.engine import Engine
    from reap.prune.write import MANIFEST

    _, _, path, names, _ = models
    plan, out = tmp_path / "plan.json", tmp_path / "pruned"
    args = ["plan", calibrated[0], "--model", path, "--keep", "8", "--out", str(plan)]
    assert main(args) == 0
    assert main(["prune", path, "--plan", str(plan), "--out", str(out), "--no-progress"]) == 0
    src, dst = Checkpoint.open(path), Checkpoint.open(out)
    assert not set(dst.tensors) & set(names)
    assert set(dst.tensors) == {s.name for s in ds.layout(dst.config)}
    assert dst.config["num_nextn_predict_layers"] == 0
    assert dst.config == ds.with_experts(src.config, 8)
    man = json.loads((out / MANIFEST).read_text())
    assert man["dropped"]["tensors"] == len(names) and "MTP" in man["dropped"]["note"]
    written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    predicted = json.loads(plan.read_text())["predicted_bytes"]
    assert abs(predicted / written - 1) < 0.005  # the MTP layer (714 KB) is not predicted
    assert main(["verify", str(out), "--source", path]) == 0
    pruned = DeepseekV3ForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = pruned(torch.tensor([PROMPT])).logits[0]
    with Engine.open(out, preset="ultra", context=64, dtype="float32") as eng:
        torch.testing.assert_close(eng.logits([PROMPT])[0], want, rtol=1e-4, atol=1e-4)
    # a pruned config that still announces the MTP layer is not what prune writes
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    (bad / "config.json").write_text(json.dumps({**dst.config, "num_nextn_predict_layers": 1}))
    assert main(["verify", str(bad), "--source", path]) == 2
