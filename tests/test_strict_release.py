"""No silent defaults (issue 34 part 6): a config key every release of a family carries is
required (exit 2 naming it); NaN, Inf or absurd magnitudes in any routed expert weight (a fused
GPT-OSS view, an INT4 or MXFP4 scale) stop `run` and `calibrate` with exit 4 naming the tensor,
and `prune` refuses to copy such an expert; `verify` checks every non-tensor file prune wrote
against the manifest's sha256."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import family_runner as R
import pytest
import test_validation as V
import torch

from reap.errors import ExpertLoadError
from reap.models import builtin_config, family
from reap.models.validate import ConfigError

RELEASES = Path(__file__).parent / "fixtures" / "releases"
CONFIGS = {p.parent.name: json.loads(p.read_text()) for p in sorted(RELEASES.glob("*/config.json"))}
tiny, corpus = V.tiny, V.corpus  # a synthesized float32 k3-tiny and a small corpus

# Config fields every release of a family carries that stay optional, and why
EXEMPT = {
    "torch_dtype": "spelled `dtype` by transformers 5 and the K3 release; binding checks dtypes",
    "quantization_config": "absent means unquantized, which the stored tensors must agree with",
    "scoring_func": "transformers 5 writes no DeepSeek-V3 routing keys: the only value reap runs",
    "topk_method": "as scoring_func",
    "moe_layer_freq": "DeepSeek-V3: as scoring_func (transformers has no such key)",
    "model_type": "dispatch reads it; the class default is the family's own",
}
EXEMPT_FAMILY = {  # OLMoE shares Qwen3-MoE's module and lacks these; a wrong one fails binding
    "reap.models.qwen3_moe": {"num_experts",  # required under either name: `validate` says so
                              "head_dim", "decoder_sparse_step", "mlp_only_layers",
                              "moe_intermediate_size", "sliding_window", "use_sliding_window"},
    # transformers 5 writes these as layer_types / mlp_layer_types / linear_* (normalized)
    "reap.models.kimi_linear": {"first_k_dense_replace", "linear_attn_config", "mla_use_nope",
                                "moe_router_activation_func"},
}  # fmt: skip


def _text(config: dict) -> dict:
    return config.get("text_config", config)


def _names(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else entry


def test_every_key_all_releases_of_a_family_carry_is_required():
    """The rule, per family: a Config field present in every release fixture is in REQUIRED
    (alone or as one spelling of an entry) unless EXEMPT says why it may be absent."""
    by_family: dict[str, list[dict]] = {}
    for config in CONFIGS.values():
        by_family.setdefault(family(config).__name__, []).append(_text(config))
    for name, texts in by_family.items():
        cls = family(next(c for c in CONFIGS.values() if family(c).__name__ == name)).Config
        required = {n for entry in cls.REQUIRED for n in _names(entry)}
        common = set.intersection(*(set(t) for t in texts))
        fields = {f.name for f in dataclasses.fields(cls)}
        loose = common & fields - required - set(EXEMPT) - EXEMPT_FAMILY.get(name, set())
        assert not loose, f"{name}: every release carries {sorted(loose)}, yet they are optional"


@pytest.mark.parametrize("release", sorted(CONFIGS))
def test_a_release_config_missing_a_required_key_is_refused_naming_it(release):
    config = CONFIGS[release]
    cls = family(config).Config
    cls.from_dict(copy.deepcopy(config))
    for entry in cls.REQUIRED:
        edited = copy.deepcopy(config)
        for n in _names(entry):
            _text(edited).pop(n, None)
        with pytest.raises(ConfigError, match="is missing") as refused:
            cls.from_dict(edited)
        assert refused.value.field == _names(entry)[0] and refused.value.exit_code == 2


def test_configs_transformers_writes_and_the_presets_carry_every_required_key():
    import transformers

    names = ("GptOssConfig", "Qwen3MoeConfig", "MixtralConfig", "DeepseekV3Config")
    for name in (*names, "KimiLinearConfig", "OlmoeConfig"):
        written = getattr(transformers, name)().to_dict()
        written["dtype"] = "bfloat16"
        family(written).Config.from_dict(written)
    for name in ("k3-tiny", "k3-small", "k3-full"):
        family(builtin_config(name)).Config.from_dict(builtin_config(name))


@pytest.mark.parametrize("key", ["routed_scaling_factor", "activation_situ_linear_beta"])
def test_run_info_and_calibrate_refuse_a_k3_config_without_a_release_key(
    tiny, corpus, tmp_path, capsys, key
):
    """Before: a K3 config without these ran with 1.0 and no linear SiTU branch, exit 0."""
    d = V._with_config(tiny, tmp_path, V._put(key, V._DELETE))
    for code, err in (
        V._run(capsys, d),
        V._cli(capsys, "info", d),
        V._calibrate(capsys, d, corpus, tmp_path / "out"),
    ):
        assert code == 2 and f"config.json: {key}: is missing" in err and err.count("\n") == 1


# -- finiteness of every routed expert weight --------------------------------------------------
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    """A tiny GPT-OSS saved by transformers: fused bf16-style expert tensors read through views."""
    import test_family_gpt_oss as G
    from transformers import GptOssConfig, GptOssForCausalLM

    root = tmp_path_factory.mktemp("oss")
    return Path(R.save_hf_tiny(GptOssForCausalLM, GptOssConfig, G.CONFIG, root / "m", seed=3)[0])


def _edited(model: Path, out: Path, name: str, edit) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    shard = next(p for p in sorted(out.glob("*.safetensors")) if name in load_file(p))
    tensors = load_file(shard)
    edit(tensors[name])
    save_file(tensors, shard, metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_a_bad_value_in_a_fused_gpt_oss_expert_is_exit_4_in_run_and_calibrate(
    gpt_oss, corpus, tmp_path, capsys, value
):
    """Before: NaN in `gate_up_proj` gave tokens [0, 0, ...] with exit 0."""
    name = "model.layers.0.mlp.experts.gate_up_proj"  # [E, D, 2F]: every expert's slice
    bad = _edited(gpt_oss, tmp_path / "bad", name, lambda t: t[:, 3, 5].fill_(value))
    for code, err in (V._run(capsys, bad), V._calibrate(capsys, bad, corpus, tmp_path / "out")):
        assert code == 4 and "layer 0 expert" in err and "gate_up_proj: values" in err, err
    assert not (tmp_path / "out" / "all.safetensors").exists()


@pytest.mark.parametrize("value", [1e38, float("inf")])
def test_an_int4_weight_scale_beyond_the_bound_is_exit_4_in_run_and_calibrate(
    tmp_path, corpus, capsys, value
):
    """Before: a weight_scale of 1e38 (finite) ran to tokens [0, 0, 0] with exit 0."""
    import test_int4 as I

    from reap.synth import synth

    src = Path(synth(copy.deepcopy(I.TINY), tmp_path / "m", seed=3))
    name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale"
    bad = _edited(src, tmp_path / "bad", name, lambda t: t.fill_(value))
    ids = ",".join(map(str, I.PROMPT))  # expert 0 of layer 1 is routed (test_int4)
    code, err = V._cli(capsys, "run", bad, "--prompt-ids", ids, "--max-tokens", "2", "--quiet")
    assert code == 4 and "expert 0: gate_proj.weight_scale: values" in err, err
    code, err = V._calibrate(capsys, bad, corpus, tmp_path / "out")
    assert code == 4 and "gate_proj.weight_scale" in err, err


def test_mxfp4_scale_bytes_that_overflow_are_corrupt():
    from reap.quant.mxfp4 import MXFP4Matrix

    for byte, ok in ((127, True), (140, True), (141, False), (254, False), (255, False)):
        m = MXFP4Matrix(torch.zeros(2, 16, dtype=torch.uint8), torch.tensor([[127], [byte]]).byte())
        if ok:
            m.check("w")
        else:
            with pytest.raises(Exception, match=f"w: E8M0 scale byte {byte}"):
                m.check("w")


# -- prune and verify --------------------------------------------------------------------------
def _prune(src: str, out: Path, keep: int = 15) -> str:
    from reap.checkpoint import Checkpoint
    from reap.prune.plan import make_plan
    from reap.prune.write import prune

    with Checkpoint.open(src) as ck:
        plan = make_plan(config=ck.config, model=ck.fingerprint(), criterion="random", keep=keep)
    return prune(model=src, plan=plan, out=str(out)).out


def test_prune_refuses_to_copy_a_kept_expert_with_an_e8m0_nan_scale(tiny, tmp_path):
    """Before: the scale byte 0xFF was copied verbatim, exit 0."""
    from safetensors.torch import load_file, save_file

    name = "language_model.model.layers.1.block_sparse_moe.experts.{}.w1.weight_scale"
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    tensors = load_file(bad / "model.safetensors")
    for e in range(16):  # every expert: whichever the plan keeps
        tensors[name.format(e)][0, 0] = 255
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ExpertLoadError, match=r"kept expert of .*layers\.1\..*w1.weight: E8M0 scale byte 255"
    ) as refused:
        _prune(str(bad), tmp_path / "out")
    assert refused.value.exit_code == 4 and not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def pruned(tiny, tmp_path_factory) -> str:
    return _prune(tiny, tmp_path_factory.mktemp("pr") / "out", keep=6)


@pytest.mark.parametrize(
    ("name", "edit", "words"),
    [
        ("tokenizer.json", lambda b: b"not json", "differs from the file prune wrote"),
        ("config.json", lambda b: b.replace(b'"moe_layer_freq": 1', b'"moe_layer_freq": true'),
         "differs from the file prune wrote"),
        ("chat_template.jinja", lambda b: b"{{ 'x' }}", "not from prune"),
        ("tokenizer_config.json", None, "missing"),
    ],
)  # fmt: skip
def test_verify_checks_every_file_prune_wrote_byte_for_byte(
    tiny, pruned, tmp_path, capsys, name, edit, words
):
    """Before: verify said OK for a tokenizer.json that is not JSON, and for a config edited to
    `moe_layer_freq: true` (equal to 1 in a dict comparison)."""
    assert V._cli(capsys, "verify", pruned, "--source", tiny)[0] == 0
    out = tmp_path / "copy"
    shutil.copytree(pruned, out)
    path = out / name
    if edit is None:
        path.unlink()
    else:
        new = edit(path.read_bytes() if path.exists() else b"")
        assert new != (path.read_bytes() if path.exists() else None)
        path.write_bytes(new)
    code, err = V._cli(capsys, "verify", out, "--source", tiny)
    assert code == 2 and f"{name}: {words}" in err and err.count("\n") == 1, err


def test_verify_refuses_a_manifest_without_file_digests(tiny, pruned, tmp_path, capsys):
    """A build pruned before the digests existed: verify cannot vouch for its config and
    tokenizer, so it says so (exit 2) instead of OK."""
    from reap.prune.write import MANIFEST

    out = tmp_path / "old"
    shutil.copytree(pruned, out)
    man = json.loads((out / MANIFEST).read_text())
    assert set(man["files"]) >= {"config.json", "tokenizer.json", "tokenizer_config.json"}
    del man["files"]
    (out / MANIFEST).write_text(json.dumps(man, indent=1))
    code, err = V._cli(capsys, "verify", out, "--source", tiny)
    assert code == 2 and "records no file digests" in err, err
