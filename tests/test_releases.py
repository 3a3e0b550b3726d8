"""Real releases (issue 14): the released config.json files under tests/fixtures/releases/ answer
`reap info`, `reap plan --dry-run` and `reap run --plan-only` without any weight; the size model
gives the parameter counts their makers publish (README "Published sizes of the releases"); a
directory with only config.json and the index, or an http(s) URL, gives what the checkpoint
gives; grouped routers round a target size down to a balanced count.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from reap.cli import main
from reap.info_cli import info

RELEASES = Path(__file__).parent / "fixtures" / "releases"
DIRS = sorted(p.name for p in RELEASES.iterdir() if (p / "config.json").is_file())

# Published figures (billions; README table): (release, what, figure, how the publisher counts,
# rounding). `what`: "total" (every stored parameter), "main" (total less the MTP layer),
# "active" (a token's matmul parameters: chosen and shared experts, attention, the head) or
# "active+embed" (also the looked-up embedding row's table, as Mistral and Qwen count).
# Tolerance: 0.5 % or the figure's own precision (half a unit of its last digit), whichever is
# larger; "trunc" rows are published truncated, so [figure, figure + one unit).
PUBLISHED = [
    ("deepseek-v3", "main", 671, 1, "round"),
    ("deepseek-v3", "active", 36.6, 0.1, "round"),
    ("deepseek-r1", "main", 671, 1, "round"),
    ("deepseek-r1", "active", 36.6, 0.1, "round"),
    ("qwen3-30b-a3b", "total", 30.5, 0.1, "round"),
    ("qwen3-30b-a3b", "non-embedding", 29.9, 0.1, "round"),
    ("qwen3-30b-a3b", "active+embed", 3.3, 0.1, "trunc"),
    ("qwen3-235b-a22b", "total", 235, 1, "round"),
    ("qwen3-235b-a22b", "active+embed", 22, 1, "round"),
    ("mixtral-8x7b", "total", 46.7, 0.1, "round"),
    ("mixtral-8x7b", "active+embed", 12.9, 0.1, "round"),
    ("gpt-oss-20b", "total", 21, 1, "round"),
    ("gpt-oss-20b", "active", 3.6, 0.1, "round"),
    ("gpt-oss-120b", "total", 117, 1, "round"),
    ("gpt-oss-120b", "active", 5.1, 0.1, "round"),
    # Kimi fixtures come with the Kimi variants (their rows skip where the fixture is absent)
    ("kimi-k3", "total", 2780.0, 0.1, "round"),
    ("kimi-k3", "active", 104, 1, "round"),
    ("kimi-k2-instruct", "total", 1000, 1000, "round"),
    ("kimi-k2-instruct", "active", 32, 1, "round"),
    ("kimi-k2.5", "total", 1000, 1000, "round"),
    ("kimi-k2.5", "active", 32, 1, "round"),
    ("kimi-linear-48b-a3b", "non-embedding", 48, 1, "round"),
    ("kimi-linear-48b-a3b", "active", 3, 1, "round"),
]


def _measure(out: dict, what: str) -> float:
    comp = out["components"]
    mtp = comp.get("mtp", {}).get("params", 0)
    embed = comp.get("embed_head", {}).get("params", 0)
    value = {
        "total": out["total_params"],
        "main": out["total_params"] - mtp,
        "non-embedding": out["total_params"] - mtp - embed,
        "active": out["active_params"],
        "active+embed": out["active_with_embedding"],
    }[what]
    return value / 1e9


class _Infos(dict):
    """`reap info` of each release fixture, computed when first asked for."""

    def __missing__(self, release: str) -> dict:
        if release not in DIRS:
            pytest.skip(f"no fixture {release} with a config.json")
        self[release] = info(str(RELEASES / release))
        return self[release]


@pytest.fixture(scope="module")
def infos() -> dict[str, dict]:
    return _Infos()


def test_fixtures_have_provenance():
    """Every fixture file is named in its directory's SOURCE.md (repository, path, commit)."""
    assert len(DIRS) >= 7
    for d in DIRS:
        source = (RELEASES / d / "SOURCE.md").read_text()
        for f in (RELEASES / d).iterdir():
            if f.name != "SOURCE.md":
                assert f.name in source, (d, f.name)
        assert "commit" in source


@pytest.mark.parametrize(("release", "what", "figure", "unit", "rounding"), PUBLISHED)
def test_published_parameter_counts(infos, release, what, figure, unit, rounding):
    got = _measure(infos[release], what)
    if rounding == "trunc":
        assert figure <= got < figure + unit, (got, figure)
    else:
        tol = max(0.005 * figure, unit / 2)
        assert abs(got - figure) <= tol, (got, figure, tol)


def test_exact_counts_published_to_the_parameter(infos):
    """Counts published to the parameter (keras-team/keras-hub's gpt-oss presets: 20,914,757,184
    and 116,829,156,672; its earlier preset of Mixtral-8x7B's dimensions: 46,702,792,704), and
    the tensor bytes of gpt-oss-20b (13,761,264,768 in 459 tensors)."""
    assert infos["gpt-oss-20b"]["total_params"] == 20_914_757_184
    assert infos["gpt-oss-120b"]["total_params"] == 116_829_156_672
    assert infos["mixtral-8x7b"]["total_params"] == 46_702_792_704
    assert infos["gpt-oss-20b"]["tensor_bytes"] == 13_761_264_768
    assert infos["gpt-oss-20b"]["tensors"] == 459


@pytest.mark.parametrize("release", DIRS)
def test_every_command_runs_on_the_release_config(release, capsys):
    path = str(RELEASES / release)
    assert main(["info", path, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config_only"] and out["total_params"] > 0
    assert main(["plan", "--config", path, "--ratio", "0.5", "--dry-run"]) == 0
    assert "predicted" in capsys.readouterr().out
    assert main(["run", path, "--prompt-ids", "1", "--plan-only", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["total"] > 0


TORCH_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3",
               "uint8": "U8", "int8": "I8", "int32": "I32", "int64": "I64"}  # fmt: skip
ROW = re.compile(r"^\| `([^`]+)`[^|]*\| `\[([0-9, ]*)\]` \| `torch\.(\w+)` \|")


def read_tensor_table(path: Path) -> tuple[dict[str, tuple[str, tuple]], dict[str, int]]:
    """A `model_inspector.py` report's tensor table: {name: (dtype code, shape)} with its
    compressed rows expanded (`layers.3-61`, `experts.0-255` stand for every index in range),
    and its summary numbers (tensors, parameters)."""
    table, summary = {}, {}
    for line in path.read_text().splitlines():
        m = ROW.match(line)
        if m:
            shape = tuple(int(x) for x in m.group(2).split(",") if x.strip())
            for name in _expand(m.group(1).split(".")):
                table[name] = (TORCH_CODES[m.group(3)], shape)
        for key, label in (("tensors", "权重张量数"), ("params", "参数总量")):
            if f"**{label}**" in line:
                summary[key] = int(line.split(":")[-1].replace(",", "").strip())
    return table, summary


def _expand(parts: list[str]) -> list[str]:
    if not parts:
        return [""]
    head, rest = parts[0], _expand(parts[1:])
    lo, _, hi = head.partition("-")
    heads = (
        [str(i) for i in range(int(lo), int(hi) + 1)] if lo.isdigit() and hi.isdigit() else [head]
    )
    return [h + ("." + r if r else "") for h in heads for r in rest]


LISTED = [d for d in DIRS if (RELEASES / d / "tensors.md").is_file() and not d.startswith("kimi")]


@pytest.mark.parametrize("release", LISTED)
def test_layout_equals_the_release_tensor_list(release):
    """The family layout of the released config.json is exactly the release's stored tensors:
    names, dtypes and shapes of every one (the report's table, expanded), their count and their
    element count as the report states them. (Kimi fixtures carry release variants, such as K2's
    inv_freq buffers, that the Kimi family tests check.)"""
    from reap.checkpoint import TEXT_PREFIX
    from reap.checkpoint.config_only import LayoutTable
    from reap.sizes import layout

    table, summary = read_tensor_table(RELEASES / release / "tensors.md")
    config = json.loads((RELEASES / release / "config.json").read_text())
    stored = LayoutTable(layout(config))
    ours = {name: (stored[name].dtype, tuple(stored[name].shape)) for name in stored}
    listed = {k.removeprefix(TEXT_PREFIX): v for k, v in table.items()}
    assert sorted(set(listed) ^ set(ours))[:5] == []
    assert {k: v for k, v in listed.items() if ours[k] != v} == {}
    assert len(ours) == summary["tensors"]
    assert sum(stored[n].numel for n in stored) == summary["params"]


def test_grouped_router_target_size_rounds_down(capsys):
    """DeepSeek-V3 at 400 GB: 149 experts per layer fit, the plan keeps 144 (8 groups of 18)
    and says so; 149 fitting and 150 not is checked against the size model directly."""
    from reap.sizes import SizeModel

    path = str(RELEASES / "deepseek-v3")
    assert main(["plan", "--config", path, "--target-size", "400GB", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "keep   144/256" in out and "149 experts per layer would fit" in out
    size = SizeModel.from_config(json.loads((RELEASES / "deepseek-v3" / "config.json").read_text()))
    assert size.predict_bytes(149) <= 400e9 < size.predict_bytes(150)


def test_a_plan_from_statistics_and_a_release_config(tmp_path, capsys):
    """Statistics of DeepSeek-V3's shape plus its config.json alone -> a plan file: at 400 GB,
    144 experts per layer, 18 in each group of 32 consecutive ids, the rounding recorded."""
    from reap.prune.plan_file import Plan
    from tests.test_plan import make_stats

    stats = make_stats(list(range(3, 61)), 256, 8, seed=4).save(tmp_path / "s.safetensors")
    out = tmp_path / "plan.json"
    cfg = str(RELEASES / "deepseek-v3")
    assert (
        main(["plan", str(stats), "--config", cfg, "--target-size", "400GB", "--out", str(out)])
        == 0
    )
    plan = Plan.load(out)
    assert set(plan.counts.values()) == {144} and "rounded down to 144" in plan.budget["note"]
    for ids in plan.keep.values():
        assert [sum(g * 32 <= e < g * 32 + 32 for e in ids) for g in range(8)] == [18] * 8
    capsys.readouterr()


# ---- a config-only directory and a URL answer as the checkpoint does ------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from reap.synth import synth

    return Path(synth("k3-tiny", tmp_path_factory.mktemp("k3") / "k3-tiny", seed=0))


def _config_only(src: Path, out: Path, index: bool = True) -> Path:
    out.mkdir()
    shutil.copy(src / "config.json", out)
    if index:
        shutil.copy(src / "model.safetensors.index.json", out)
    return out


def test_config_only_directory_answers_as_the_checkpoint(tiny, tmp_path, capsys):
    """info: same census; the index's total_size is the layout's tensor bytes; plan --dry-run:
    same table; run --plan-only: the same memory plan from the layout as from the headers."""
    bare = _config_only(tiny, tmp_path / "bare")
    a, b = info(str(tiny)), info(str(bare))
    assert b["index_total_size"] == b["tensor_bytes"] == a["stored_tensor_bytes"]
    assert b["index_missing"] == 0
    for k in ("components", "total_params", "active_params", "checkpoint_bytes", "tensors"):
        assert a[k] == b[k], k
    tables = []
    for p in (tiny, bare):
        assert main(["plan", "--config", str(p), "--keep", "8", "--dry-run"]) == 0
        tables.append(capsys.readouterr().out)
    assert tables[0] == tables[1]
    plans = []
    for p in (tiny, bare):
        args = ["run", str(p), "--prompt-ids", "1", "--plan-only", "--json", "--budget", "2GB"]
        assert main(args) == 0
        plan = json.loads(capsys.readouterr().out)["plan"]
        # the baseline is this process's RSS at the call, which moves between calls
        plan["total"] -= plan.pop("baseline")
        plans.append(plan)
    assert plans[0] == plans[1]
    assert main(["info", str(_config_only(tiny, tmp_path / "noindex", index=False))]) == 0


def test_config_only_refuses_an_index_naming_a_stranger(tiny, tmp_path, capsys):
    bare = _config_only(tiny, tmp_path / "bad")
    index = json.loads((bare / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.stranger.weight"] = "model-00001-of-00001.safetensors"
    (bare / "model.safetensors.index.json").write_text(json.dumps(index))
    for argv in (
        ["info", str(bare)],
        ["plan", "--config", str(bare), "--keep", "8", "--dry-run"],
        ["run", str(bare), "--prompt-ids", "1", "--plan-only"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0
        assert "model.safetensors.index.json" in err and "stranger" in err


def test_a_url_answers_from_headers_alone(tiny, tmp_path, monkeypatch, capsys):
    """info, plan --dry-run and run --plan-only on an http URL read config, index and headers:
    the census and the plan equal the local ones, and every range requested is a shard's head
    (widened to the cache's block), none a tensor read."""
    from tests.test_remote import FileServer

    monkeypatch.setenv("REAP_CACHE", str(tmp_path / "cache"))
    fs = FileServer(tiny)
    try:
        a, b = info(str(tiny)), info(fs.url)
        for k in ("components", "total_params", "stored_tensor_bytes", "tensors_on_disk"):
            assert a[k] == b[k], k
        assert main(["plan", "--config", fs.url, "--keep", "8", "--dry-run"]) == 0
        assert "predicted" in capsys.readouterr().out
        plans = []
        for p in (str(tiny), fs.url):
            args = ["run", p, "--prompt-ids", "1", "--plan-only", "--json", "--budget", "2GB"]
            assert main(args) == 0
            plan = json.loads(capsys.readouterr().out)["plan"]
            for key in ("baseline", "total"):  # this process's RSS when planned (not the model's)
                plan.pop(key)
            plans.append(plan)
        assert plans[0] == plans[1]
        ranges = [r for _, r in fs.requests if r]
        assert ranges and all(r.startswith("bytes=0-") for r in ranges), ranges  # headers only
    finally:
        fs.close()


# ---- where a pruned build can go next (README): mlx-lm reads a uniform pruned K3 build ------


def test_mlx_lm_loads_a_uniform_pruned_k3_build(tmp_path):
    """A k3-tiny pruned to 6 of 16 experts in every layer: mlx-lm's kimi_k3 loads the build as
    it is (config.json's `num_experts`, the sliced router) and agrees with us: our model over a
    prompt and 8 greedy decoding steps (`family_runner.check_mlx`), and the streaming engine's
    prompt logits, within 1e-4."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np
    from mlx_lm.utils import load_model

    from reap.engine import Engine
    from reap.prune.plan import make_plan
    from reap.prune.write import prune
    from reap.synth import synth
    from tests.family_runner import check_mlx

    src = Path(synth("k3-tiny", tmp_path / "k3", seed=3, dtype="float32"))
    config = json.loads((src / "config.json").read_text())
    plan = make_plan(config=config, criterion="random", keep=6, seed=1)
    out = tmp_path / "pruned"
    prune(model=str(src), plan=plan, out=str(out))
    assert json.loads((out / "config.json").read_text())["text_config"]["num_experts"] == 6
    ids = [3, 100, 7, 200, 55, 9, 1, 250, 17, 42, 11, 300]
    check_mlx(str(out), ids, steps=8, atol=1e-4)
    ref_model, _ = load_model(out)
    ref = np.array(ref_model(mx.array([ids]), cache=ref_model.make_cache()))[0]  # [T, V]
    with Engine.open(str(out), preset="ultra", context=64, dtype="float32") as eng:
        got = eng.logits([ids])[0].numpy()
    assert got.shape == ref.shape
    assert float(np.abs(got - ref).max()) < 1e-4


def test_mlx_lm_loads_a_pruned_qwen3_moe_build(tmp_path):
    """A tiny Qwen3-MoE saved by transformers, pruned to 4 of 8 experts: mlx-lm's qwen3_moe
    loads the build (config.json's `num_experts`) and its logits over a prompt and 8 greedy
    steps equal our model's (`family_runner.check_mlx`)."""
    pytest.importorskip("mlx.core")
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import tests.family_runner as R
    from tests.test_family_qwen3_moe import PROMPT, QWEN, QWEN_LEGACY

    path, _ = R.save_hf_tiny(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, tmp_path / "m", seed=5, config_extra=QWEN_LEGACY
    )
    out = tmp_path / "pruned"
    R.prune_random(path, out, keep=4, seed=2)
    assert json.loads((out / "config.json").read_text())["num_experts"] == 4
    R.check_mlx(str(out), PROMPT)
