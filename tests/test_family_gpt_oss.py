"""GPT-OSS (reap.models.gpt_oss) on a tiny random model saved by transformers (fused dequantized
experts) and on an MXFP4 blocks/scales copy of it (the release layout): logits against
transformers (prefill and decode past the sliding window) and mlx-lm, MXFP4 decoding against
transformers' own dequantization, the streaming engine, pruning in the same fused layout through
from_pretrained and verify, and calibration statistics against forward hooks."""

import json
import shutil
from pathlib import Path

import family_runner as R
import numpy as np
import pytest
import torch

from reap.checkpoint import Checkpoint, view_name
from reap.errors import ReapError

PROMPT = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
CONFIG = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False,
    },
}  # fmt: skip
EXPERTS = "model.layers.{}.mlp.experts."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import GptOssConfig, GptOssForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss")
    path, hf = R.save_hf_tiny(GptOssForCausalLM, GptOssConfig, CONFIG, root / "m", seed=3)
    return root, path, hf


@pytest.fixture(scope="module")
def mxfp4(tiny):
    """An MXFP4 copy of the tiny model: (path, transformers model holding the weights that
    transformers' own `convert_moe_packed_tensors` decodes from its blocks and scales)."""
    from transformers import GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    root, path, hf = tiny
    out = _write_mxfp4(path, root / "mxfp4")
    ref = GptOssForCausalLM(hf.config).float().eval()
    ref.load_state_dict(hf.state_dict())
    with Checkpoint.open(out) as ck, torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for n in ("gate_up_proj", "down_proj"):
                blocks, scales = (
                    ck.read(EXPERTS.format(i) + f"{n}_blocks"),
                    ck.read(EXPERTS.format(i) + f"{n}_scales"),
                )
                w = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(layer.mlp.experts, n).copy_(w)
    return out, ref


def _write_mxfp4(src, out) -> str:
    """Quantize the fused expert matrices (reap.quant.mxfp4) into the release's names and shapes:
    X [E, R, C] (transformers' [in, out] order transposed to [out, in]) -> X_blocks
    [E, R, C/32, 16], X_scales [E, R, C/32]; config.json gets the mxfp4 quantization_config and
    the older rope keys mlx-lm reads."""
    from safetensors.torch import save_file

    from reap.quant import mxfp4

    shutil.copytree(src, out)
    with Checkpoint.open(src) as ck:
        tensors = {n: ck.read(n) for n in ck.tensors}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # [E, out, in]
        packed, scales = mxfp4.quantize(w)  # [E, R, C/2], [E, R, C/32]
        tensors[name + "_blocks"] = packed.reshape(*scales.shape, 16).contiguous()
        tensors[name + "_scales"] = scales
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(
        quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]},
        **R.legacy_rope(cfg),
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(out)


def test_logits_equal_transformers_past_the_sliding_window(tiny):
    root, path, hf = tiny
    print("transformers", R.check_logits(path, hf, PROMPT))
    # the window changes the logits past it: the comparison above exercises it
    wide = R.with_config(path, root / "wide", sliding_window=4096)
    change = R.prefill_change(path, wide, PROMPT)
    assert change[4:].max() > 1e-2 and change[:4].max() < 1e-5


def test_mxfp4_layout_decodes_like_transformers_and_matches_mlx(mxfp4):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from reap.models import family
    from reap.models.base import expert_short_names
    from reap.models.gpt_oss import sanitize

    path, ref = mxfp4
    with Checkpoint.open(path) as ck:  # expert 5 of layer 1 through its views == transformers
        fam = family(ck.config)
        names = fam.expert_tensor_names(fam.Config.from_dict(ck.config), 1, 5)
        assert names[0] == view_name(EXPERTS.format(1) + "gate_up_proj_blocks", 5)
        w = sanitize(dict(zip(expert_short_names(names), map(ck.read, names))), torch.float32)
        for n in ("gate_up", "down"):
            blocks, scales = (
                ck.read(EXPERTS.format(1) + f"{n}_proj_{k}") for k in ("blocks", "scales")
            )
            assert torch.equal(
                w[n], convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[5]
            )
    print("transformers (dequantized)", R.check_logits(path, ref, PROMPT))
    # mlx-lm always truncates YaRN's correction range (transformers honours `truncate`, which
    # the release sets false): compare with mlx-lm on a copy whose config asks for truncation
    cfg = json.loads((Path(path) / "config.json").read_text())
    rope = {**cfg["rope_parameters"], "truncate": True}
    truncated = R.for_mlx(path, Path(path).parent / "mxfp4_truncated", rope_parameters=rope)
    print("mlx-lm", R.check_mlx(truncated, PROMPT))


def test_engine_matches_transformers_and_runs_mxfp4(tiny, mxfp4):
    from reap.engine import Engine

    _, path, hf = tiny
    print("greedy", R.check_engine(path, hf, PROMPT))
    q_path, _ = mxfp4
    want = R.ours_greedy(q_path, PROMPT, 0)[0][0]
    with Engine.open(q_path, preset="ultra", context=64, dtype="float32") as eng:
        assert np.abs(eng.logits([PROMPT])[0].numpy() - want).max() < 1e-5


def test_prune_keeps_the_fused_layout_loads_in_transformers_and_verifies(tiny, mxfp4):
    from reap.prune.verify import VerifyError, verify

    root, path, _ = tiny
    R.check_prune(path, root / "pruned", keep=5)  # fused X [5, ...] holding X[keep]
    r = verify(pruned=str(root / "pruned"), source=path)
    assert r.experts == 20 and r.tensors == len(Checkpoint.open(path).tensors)
    # one flipped byte inside a kept slice of a fused tensor is caught and named
    bad = root / "bad"
    shutil.copytree(root / "pruned", bad)
    with Checkpoint.open(bad) as ck:
        info = ck.tensors[view_name(EXPERTS.format(2) + "down_proj", 3)]
    with open(info.file, "r+b") as f:
        f.seek(info.start + 17)
        byte = f.read(1)[0]
        f.seek(info.start + 17)
        f.write(bytes([byte ^ 0x10]))
    with pytest.raises(VerifyError, match=r"down_proj\[3\] differs"):
        verify(pruned=str(bad), source=path)
    # the MXFP4 layout prunes and verifies the same way
    q_path, _ = mxfp4
    q_plan = R.prune_random(q_path, root / "q_pruned", keep=5)
    R.check_pruned_layout(q_path, root / "q_pruned", q_plan)
    assert verify(pruned=str(root / "q_pruned"), source=q_path).experts == 20


def test_pruned_mxfp4_checkpoint_loads_in_transformers(tiny, mxfp4):
    """transformers dequantizes MXFP4 experts on a CPU (its quantizer needs `accelerate`)."""
    pytest.importorskip("accelerate")
    root, _, _ = tiny
    q_path, _ = mxfp4
    plan = R.prune_random(q_path, root / "q_pruned_hf", keep=3)
    R.check_pruned(q_path, root / "q_pruned_hf", plan)


def test_calibration_equals_forward_hooks_and_feeds_a_plan(tiny):
    from reap.prune.plan import make_plan
    from reap.prune.verify import verify
    from reap.prune.write import prune

    root, path, hf = tiny
    R.check_calibration(path, hf, root / "cal")
    with Checkpoint.open(path) as ck:
        stats = [str(root / "cal" / "stats" / f"{c}.safetensors") for c in ("prose", "code")]
        plan = make_plan(stats=stats, config=ck.config, model=ck.fingerprint(), keep=6)
    assert all(len(plan.keep[layer]) == 6 for layer in range(4))
    prune(model=path, plan=plan, out=str(root / "reap6"))
    assert verify(pruned=str(root / "reap6"), source=path).experts == 24


def test_config_rules(tiny):
    from reap.engine.binding import bind
    from reap.models import family, gpt_oss

    _, path, _ = tiny
    with Checkpoint.open(path) as ck:
        fam = family(ck.config)
        b = bind(ck.tensors, fam, ck.config, path)
        assert (b.expert_layers, b.n_experts) == ([0, 1, 2, 3], 8)
        assert fam.expert_key(view_name(EXPERTS.format(2) + "down_proj_bias", 7)) == (2, 7)
        assert fam.expert_key(EXPERTS.format(2) + "down_proj_bias") is None
        assert gpt_oss.with_experts(ck.config, {0: 3, 1: 3})["num_local_experts"] == 3
        with pytest.raises(ReapError, match="same number in every layer"):
            gpt_oss.with_experts(ck.config, {0: 3, 1: 4})


@pytest.mark.parametrize(
    ("layers", "n_experts", "total", "active", "gib"),
    [(24, 32, 20.91e9, 3.61e9, 12.8), (36, 128, 116.83e9, 5.13e9, 60.8)],
)
def test_size_model_reproduces_the_published_gpt_oss_sizes(layers, n_experts, total, active, gib):
    """gpt-oss-20b / -120b model card: total and active parameters, MXFP4 checkpoint GiB."""
    from reap.sizes import SizeModel

    cfg = R.with_release_keys({
        "model_type": "gpt_oss", "num_hidden_layers": layers, "num_local_experts": n_experts,
        "num_experts_per_tok": 4, "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "sliding_window": 128, "torch_dtype": "bfloat16",
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "quantization_config": {"quant_method": "mxfp4"},
    })  # fmt: skip
    m = SizeModel.from_config(cfg)
    assert abs(m.total_params / total - 1) < 5e-4
    assert abs(m.active_params / active - 1) < 5e-3
    assert abs(m.predict_bytes() / 2**30 / gib - 1) < 5e-3
