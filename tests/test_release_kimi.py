"""The Kimi releases as their makers publish them (tests/fixtures/releases/, see each SOURCE.md):
the families' `layout()` equals each release's tensor list (every name, dtype and shape of K3's
497,220 tensors, K2-Instruct's 139,644, Kimi-Linear-48B-A3B's 20,493; K2.5's trunk and vision
tower), and tiny models saved in each release's exact layout go through every stage: K3 with its
vision tower and projector, K2 with its `rotary_emb.inv_freq` buffers, Kimi-Linear in its
release dtypes (A_log F32, router BF16), and a K2.5-style `kimi_k25` checkpoint. Oracles: the
release tables, transformers and mlx-lm on the same files (mlx-lm drops the vision tower and the
inv_freq buffers as the release loaders do), and byte comparison of what prune carries over."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import family_runner as R
import pytest
import torch
from release_tables import RELEASES, expand, read_rows
from safetensors.torch import load_file, save_file

from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.models import family, kimi_linear
from reap.models.deepseek_v3 import kimi_k25
from reap.models.kimi_k3 import family as kimi_k3
from reap.sizes import SizeModel

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 30]


def _release(name: str) -> dict:
    return json.loads((RELEASES / name / "config.json").read_text())


def _table(name: str, names: set[str]) -> dict:
    return expand(read_rows(RELEASES / name / "tensors.md"), names)


def _specs(specs) -> dict:
    return {s.name: (tuple(s.shape), s.dtype) for s in specs}


# -- the released layouts ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def k3_release():
    config = _release("kimi-k3")
    return config, kimi_k3.layout(config)  # 497,220 specs: built once (seconds)


@pytest.mark.parametrize("name", ["kimi-k3", "kimi-k2-instruct", "kimi-linear-48b-a3b"])
def test_layout_equals_the_release_tensor_list(name, request):
    config = _release(name)
    specs = request.getfixturevalue("k3_release")[1] if name == "kimi-k3" else None
    got = _specs(specs or family(config).layout(config))
    want = _table(name, set(got))
    assert got == want, sorted(set(got) ^ set(want))[:5]


def test_k3_release_config_reads_and_counts_its_vision_tower(k3_release):
    """The released K3 config loads (its vision_config in the release's keys); its layout holds
    the release's 1,503,647,073,024 stored elements in 497,220 tensors, the 401 M-parameter
    MoonViT-V2 tower among them (the size model's census of it: the tiny K3 below);
    routed_scaling_factor is the release's 1.0 (the built-in configs use 2.827)."""
    config, specs = k3_release
    cfg = kimi_k3.Config.from_dict(config)
    assert cfg.routed_scaling_factor == 1.0
    assert sum(s.numel for s in specs) == 1_503_647_073_024
    tower = sum(s.numel for s in specs if s.name.startswith("vision_tower."))
    projector = sum(s.numel for s in specs if s.name.startswith("mm_projector."))
    assert (tower, projector) == (401_214_464, 46_144_512)


def test_k25_release_trunk_and_vision_equal_its_tensor_list():
    """kimi_k25: the DeepSeek-V3 trunk (`language_model.` prefix stripped) and the MoonViT tower
    with K2.5's biased LayerNorm projector equal the release table; its routed experts are INT4
    compressed-tensors, compared here by name and count only (their codec is another module's)."""
    config = _release("kimi-k2.5")
    assert family(config) is kimi_k25
    plain = json.loads(json.dumps(config))
    plain["text_config"].pop("quantization_config")  # the trunk's layout does not depend on it
    got = _specs(kimi_k25.layout(plain))
    want = _table("kimi-k2.5", set(got))
    experts = {n for n in want if kimi_k25.expert_key(n) is not None}
    ours = {n for n in got if kimi_k25.expert_key(n) is not None}
    assert {n: v for n, v in got.items() if n not in ours} == {
        n: v for n, v in want.items() if n not in experts
    }
    assert len(experts) == 60 * 384 * 9 and len(ours) == 60 * 384 * 3


# -- tiny checkpoints in the releases' layouts -------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return R.write_corpora(tmp_path_factory.mktemp("corpus"))


def _cli(*argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def _stages(path, corpus, tmp: Path, keep: int) -> Path:
    """run, calibrate, plan, prune and verify on `path` (CLI, exit 0 each); the pruned path."""
    assert _cli("run", path, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet") == 0
    stats = tmp / "stats"
    args = ["--corpus", corpus, "--tokens", "32", "--seq-len", "16", "--no-progress"]
    assert _cli("calibrate", path, *args, "--out", stats) == 0
    plan, out = tmp / "plan.json", tmp / "pruned"
    assert (
        _cli("plan", stats / "all.safetensors", "--model", path, "--keep", keep, "--out", plan) == 0
    )
    assert _cli("prune", path, "--plan", plan, "--out", out, "--no-progress") == 0
    assert _cli("verify", out, "--source", path) == 0
    return out


def _carried(src, out, names) -> None:
    """Each tensor of `names` is in the pruned build under the same stored key, same bytes."""
    with Checkpoint.open(src) as a, Checkpoint.open(out) as b:
        for n in names:
            assert (a.tensors[n].key, a.read_raw(n)) == (b.tensors[n].key, b.read_raw(n)), n


def test_k3_with_its_vision_tower_runs_prunes_and_keeps_the_tower(tmp_path, corpus, capsys):
    """k3-tiny with a tower and projector in the release's layout and the release's
    routed_scaling_factor 1.0: our logits == mlx-lm's kimi_k3 on the same files (it drops the
    vision tensors when loading, as the release's text path does), and every stage runs."""
    from dataclasses import replace

    from reap.models import builtin_config
    from reap.synth import synth

    config = builtin_config("k3-tiny")
    config["text_config"]["routed_scaling_factor"] = 1.0
    path = synth(config, tmp_path / "k3", vision=True, dtype="float32")
    assert R.check_mlx(path, PROMPT, steps=4) < R.ATOL
    _, cfg, model, get = R.load_ours(path)
    assert cfg.routed_scaling_factor == 1.0  # and it matters: the built-in 2.827 differs
    other = kimi_k3.Model(replace(cfg, routed_scaling_factor=2.827))
    ids = torch.tensor([PROMPT])
    # (the routed experts are a small part of these logits, still 10x the tolerance above)
    assert (model.forward(get, ids) - other.forward(get, ids)).abs().max() > 10 * R.ATOL
    with Checkpoint.open(path) as ck:
        vision = [n for n, t in ck.tensors.items() if not t.key.startswith("language_model.")]
        assert ck.prefix == "language_model." and len(vision) == 2 * 6 + 3 + 3
        size = SizeModel.from_config(ck.config)
    # the tower counts in the total, not in the active parameters
    tower = sum(math.prod(ck.tensors[n].shape) for n in vision)
    assert size.census["vision"]["params"] == tower
    assert size.total_params - size.active_params > tower
    out = _stages(path, corpus, tmp_path, keep=8)
    _carried(path, out, vision)
    # the pruned build is still the released vision-language layout
    with Checkpoint.open(out) as ck:
        assert _specs(kimi_k3.layout(ck.config)) == {
            n: (t.shape, t.dtype) for n, t in ck.tensors.items()
        }
    # verify notices a changed vision tensor, and one stored under the text prefix
    capsys.readouterr()
    for change, says in (("value", "differs from the source"), ("key", "is stored as")):
        bad = _edit_vision_tensor(out, tmp_path / f"bad-{change}", change)
        assert _cli("verify", bad, "--source", path) == 2
        assert says in capsys.readouterr().err


def _edit_vision_tensor(src: Path, out: Path, change: str) -> Path:
    """A copy of checkpoint `src` with one vision tensor's value changed, or its key given the
    text prefix (the index updated to match)."""
    shutil.copytree(src, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.startswith("vision_tower."))
    shard = out / index["weight_map"][key]
    t = load_file(shard)
    if change == "value":
        t[key] = t[key] + 1
    else:
        t["language_model." + key] = t.pop(key)
        index["weight_map"]["language_model." + key] = index["weight_map"].pop(key)
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file(t, shard, metadata={"format": "pt"})
    return out


def _k2_release(path: str, out: Path) -> str:
    """A transformers-saved DeepSeek-V3 in K2's release form: model_type kimi_k2, the legacy rope
    keys, and every layer's `self_attn.rotary_emb.inv_freq` [(D / H) / 2]."""
    shutil.copytree(path, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(R.legacy_rope(cfg), model_type="kimi_k2", torch_dtype="float32")
    cfg.update(num_nextn_predict_layers=0)  # as K2 releases (transformers saves no MTP layer)
    for k in ("rope_parameters", "dtype"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg))
    t = load_file(out / "model.safetensors")
    half = cfg["hidden_size"] // cfg["num_attention_heads"] // 2
    freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, 2 * half, 2).float() / (2 * half)))
    for i in range(cfg["num_hidden_layers"]):
        t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = freq.clone()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_k2_with_inv_freq_binds_runs_and_prune_keeps_the_buffers(tmp_path, corpus):
    import test_family_deepseek_v3 as T
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = {**T.BASE, "q_lora_rank": 32, "n_routed_experts": 8, "n_group": 1, "topk_group": 1}
    kw |= {"n_shared_experts": 1, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    src, hf = R.save_hf_tiny(DeepseekV3ForCausalLM, DeepseekV3Config, kw, tmp_path / "hf")
    path = _k2_release(src, tmp_path / "k2")
    buffers = [f"model.layers.{i}.self_attn.rotary_emb.inv_freq" for i in range(3)]
    with Checkpoint.open(path) as ck:
        assert family(ck.config).Config.from_dict(ck.config).rope_buffers
    assert R.check_logits(path, hf, PROMPT, steps=4) < R.ATOL  # never read: same logits
    assert R.check_mlx(path, PROMPT, steps=4) < R.ATOL  # mlx-lm drops them by name
    out = _stages(path, corpus, tmp_path, keep=4)
    _carried(path, out, buffers)
    # optional: a K2 checkpoint without them binds too
    bare = Path(shutil.copytree(path, tmp_path / "bare"))
    t = load_file(bare / "model.safetensors")
    save_file({k: v for k, v in t.items() if k not in buffers}, bare / "model.safetensors")
    assert _cli("run", bare, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet") == 0
    # transformers loads the pruned build (it ignores checkpoint rotary_emb.inv_freq keys) with
    # the logits of our engine on it
    cfg = json.loads((out / "config.json").read_text())
    pruned = DeepseekV3ForCausalLM.from_pretrained(
        out, config=DeepseekV3Config(**{**kw, "n_routed_experts": cfg["n_routed_experts"]})
    ).eval()
    from reap.engine import Engine

    with torch.no_grad():
        want = pruned(torch.tensor([PROMPT])).logits[0]
    with Engine.open(out, preset="ultra", context=64, dtype="float32") as eng:
        torch.testing.assert_close(eng.logits([PROMPT])[0], want, rtol=1e-4, atol=1e-4)


def _kimi_linear_release_dtypes(path: str, out: Path) -> str:
    """The release's dtypes on a release-naming copy: bf16 everywhere but A_log and dt_bias."""
    from test_family_kimi_linear import released

    rel = Path(released(path, out.with_name(out.name + "-f32")))
    shutil.copytree(rel, out)
    t = load_file(rel / "model.safetensors")
    keep = ("A_log", "dt_bias")
    t = {k: v if k.endswith(keep) else v.to(torch.bfloat16) for k, v in t.items()}
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return str(out)


def test_kimi_linear_release_dtypes_bind_compute_like_transformers_and_prune(tmp_path, corpus):
    """A_log F32 and the router BF16 as released: the layout wants exactly that for a released
    config, sizes count the router at 2 bytes a weight, our fp32 compute on those bf16 values
    equals transformers' on the same values, and every stage runs."""
    import test_family_kimi_linear as T

    src, hf = T.make_tiny(tmp_path / "hf")
    path = _kimi_linear_release_dtypes(src, tmp_path / "kl")
    with Checkpoint.open(path) as ck:
        stored = {n: (t.shape, t.dtype) for n, t in ck.tensors.items()}
        assert _specs(kimi_linear.layout(ck.config)) == stored
        assert stored["model.layers.1.block_sparse_moe.gate.weight"][1] == "BF16"
        assert stored["model.layers.0.self_attn.A_log"][1] == "F32"
        size = SizeModel.from_config(ck.config)
    assert size.census["router"]["bytes"] == 3 * (8 * 64 + 8) * 2
    with torch.no_grad():  # the same values in transformers: bf16-rounded, held in fp32
        for name, p in hf.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                p.copy_(p.bfloat16().float())
    assert R.check_logits(path, hf, T.PROMPT, steps=4) < R.ATOL
    _stages(path, corpus, tmp_path, keep=4)


def test_kimi_linear_transformers_dtypes_still_bind_under_a_release_config(tmp_path):
    """A checkpoint with transformers' dtypes (router fp32, A_log bf16) and the release's config
    binds too: those tensors are read in either dtype and cast to fp32."""
    import test_family_kimi_linear as T

    src, _ = T.make_tiny(tmp_path / "hf")
    path = _kimi_linear_release_dtypes(src, tmp_path / "kl")
    t = load_file(Path(path) / "model.safetensors")
    for k in list(t):
        if k.endswith(("gate.weight", "e_score_correction_bias")):
            t[k] = t[k].float()
        elif k.endswith("A_log"):
            t[k] = t[k].bfloat16()
    save_file(t, Path(path) / "model.safetensors", metadata={"format": "pt"})
    assert _cli("run", path, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet") == 0


def _k25_config() -> dict:
    text = {k: v for k, v in R.legacy_rope({**_ds_text(), "rope_parameters": _ROPE}).items()}
    return {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": R.with_release_keys({**_ds_text(), **text, "model_type": "deepseek_v3"}),
    }


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _ds_text() -> dict:
    import test_family_deepseek_v3 as T

    return {**T.BASE, "q_lora_rank": 32, "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 1,
            "topk_group": 1}  # fmt: skip


def test_kimi_k25_runs_equals_mlx_lm_and_prunes_with_its_vision_tower(tmp_path, corpus):
    from reap.synth import synth

    path = synth(_k25_config(), tmp_path / "k25", vision=True, dtype="float32")
    with Checkpoint.open(path) as ck:
        assert family(ck.config) is kimi_k25 and ck.prefix == "language_model."
        vision = [n for n in ck.tensors if n.startswith(("vision_tower.", "mm_projector."))]
        assert "mm_projector.pre_norm.bias" in vision  # K2.5's projector, not K3's
    assert R.check_mlx(path, PROMPT, steps=4) < R.ATOL  # mlx-lm's kimi_k25 on the same files
    out = _stages(path, corpus, tmp_path, keep=4)
    _carried(path, out, vision)
    with Checkpoint.open(out) as ck:
        assert ck.config["text_config"]["n_routed_experts"] == 4
        assert (
            ck.config["vision_config"]
            == json.loads((Path(path) / "config.json").read_text())["vision_config"]
        )


# -- bad release files -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "edit, key",
    [
        (
            lambda c: c["vision_config"].update(vt_hidden_size="1024"),
            "vision_config.vt_hidden_size",
        ),
        (
            lambda c: c["vision_config"].pop("vt_num_hidden_layers"),
            "vision_config.vt_num_hidden_layers",
        ),
        (lambda c: c["vision_config"].update(mm_projector_type="qformer"), "mm_projector_type"),
        (lambda c: c["vision_config"].update(merge_kernel_size=[2]), "merge_kernel_size"),
        (lambda c: c.update(vision_config=[1]), "vision_config"),
        (lambda c: c.update(model_type="kimi_k9"), "model_type"),
    ],
)
def test_bad_release_config_is_one_line_naming_file_and_key(tmp_path, capsys, edit, key):
    path = tmp_path / "k3"
    assert _cli("synth", "k3-tiny", "--vision", "--out", path) == 0
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    for command in (["info", path], ["run", path, "--prompt-ids", "1", "--max-tokens", "1"]):
        assert _cli(*command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and key in err and "Traceback" not in err, err
        assert f"{path}/config.json: " in err, err
