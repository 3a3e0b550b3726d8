"""Black-box sweep of corrupted INT4 and fused-expert checkpoints (issue 34 part 8).

    OMP_NUM_THREADS=1 nice -n 5 python -m experiments.fuzz_views [--only int4/] [--work DIR]

Three tiny models, each written by `reap synth` from a release config shrunk to 4 layers, 16
experts and widths of 64 (tests/fixtures/releases): Kimi K2 with INT4 compressed-tensors
`pack-quantized` routed experts (`weight_packed`, `weight_scale`, `weight_shape`), GPT-OSS with
fused MXFP4 experts (`gate_up_proj_blocks` / `_scales`, `down_proj_*`, biases) and GPT-OSS
without `quantization_config` (fused `gate_up_proj` [E, D, 2F], `down_proj` [E, F, D]). Each case
edits one layer's routed experts (every expert, so that any routing meets the edit), the config,
or a shard: NaN, Inf, 1e38 scales, weights and biases, E8M0 scale bytes past the bound, wrong
dtypes and shapes, zero-size and missing tensors, `weight_shape` values that disagree, configs
whose widths, expert counts or quantization disagree with the tensors, truncated shards.

Each case is read by `info`, `run`, `calibrate` and `prune` (a plan of the clean model without
its fingerprint), and the same edit on a clean pruned build by `verify --source`. Classes are
those of `fuzz_common.classify`; a refusal must be exit 2 (bad input), 4 (bad numbers) or 1 for
"tensor binding failed" (a stored shape or dtype the layout does not have: reap/errors.py) and
its one line must name what is wrong (the tensor, config key or shard), else the run counts as
*vague*. `info`, which computes with no weight value, may exit 0 on value edits (`weight_shape`
values included). Writes
reports/reliability-views.json.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from experiments.fuzz_common import (
    CLASSES,
    REPO,
    Run,
    classify,
    count_table,
    fuzz_args,
    run_batch,
    run_cases,
    write_report,
    write_table,
)

VERDICTS = (*CLASSES, "vague")
COMMANDS = ("info", "run", "calibrate", "prune", "verify")
RELEASES = REPO / "tests" / "fixtures" / "releases"
WIDTHS = {  # tiny widths for whichever of these keys a release config has
    "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32, "q_lora_rank": 32,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "head_dim": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "num_experts_per_tok": 4, "experts_per_token": 4, "n_routed_experts": 16,
    "num_local_experts": 16, "sliding_window": 4, "num_hidden_layers": 4,
}  # fmt: skip


def shrink(name: str) -> dict:
    config = json.loads((RELEASES / name / "config.json").read_text())
    config.update({k: v for k, v in WIDTHS.items() if config.get(k) is not None})
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:4]
    return config


def model_configs() -> dict[str, dict]:
    """The three models' configs: INT4 Kimi K2 (K2.5's quantization block at the top level, as
    Kimi-K2-Thinking has it), GPT-OSS MXFP4, GPT-OSS unquantized (fused plain tensors)."""
    int4 = shrink("kimi-k2-instruct")
    k25 = json.loads((RELEASES / "kimi-k2.5" / "config.json").read_text())
    int4["quantization_config"] = k25["text_config"]["quantization_config"]
    mxfp4 = shrink("gpt-oss-20b")
    fused = copy.deepcopy(mxfp4)
    del fused["quantization_config"]
    return {"int4": int4, "mxfp4": mxfp4, "fused": fused}


# --- editing a checkpoint directory ----------------------------------------------------------

def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def edit_tensors(d: Path, pattern: str, fn: Callable[[str, torch.Tensor], torch.Tensor | None]) -> int:
    """Apply `fn(name, tensor)` to every tensor whose name matches `pattern` (None deletes it;
    the index is left as it was); returns how many matched."""
    hits = 0
    for shard in _shards(d):
        with safe_open(shard, "pt") as f:
            names, meta = list(f.keys()), f.metadata()
            if not any(re.fullmatch(pattern, n) for n in names):
                continue
            tensors = {n: f.get_tensor(n) for n in names}
        for n in names:
            if re.fullmatch(pattern, n):
                hits += 1
                new = fn(n, tensors[n].clone())
                if new is None:
                    del tensors[n]
                else:
                    tensors[n] = new
        save_file(tensors, shard, metadata=meta)
    return hits


def values(where: Callable[[torch.Tensor], tuple], value: float):
    """fn: fill `t[where(t)]` with `value` (in the tensor's dtype)."""
    def fn(name, t):
        t[where(t)] = value
        return t
    return fn


def every(t: torch.Tensor) -> tuple:
    return (...,)


def first_of_each(t: torch.Tensor) -> tuple:
    """The first element of every expert (a fused [E, ...] tensor) or of a per-expert one."""
    return (slice(None), *([0] * (t.dim() - 1))) if t.dim() > 1 else (0,)


def cast(dtype):
    return lambda name, t: t.to(dtype)


def relabel(dtype):
    """The same bytes read as another dtype of the same width."""
    return lambda name, t: t.contiguous().view(dtype)


def reshape(fn: Callable[[torch.Tensor], torch.Tensor]):
    return lambda name, t: fn(t).contiguous()


def config_edit(fn: Callable[[dict], None]):
    def apply(d: Path) -> None:
        p = d / "config.json"
        config = json.loads(p.read_text())
        fn(config)
        p.write_text(json.dumps(config, indent=1))
    return apply


def _set(key: str, value):
    def fn(c):
        c[key] = value
    return fn


def truncate_shard(pattern: str, keep: Callable[[int], int]):
    """Cut the shard holding the first tensor that matches `pattern` to `keep(size)` bytes."""
    def apply(d: Path) -> None:
        for shard in _shards(d):
            with safe_open(shard, "pt") as f:
                if any(re.fullmatch(pattern, n) for n in f.keys()):  # noqa: SIM118 - not iterable
                    break
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(keep(size))
    return apply


@dataclass
class Case:
    name: str  # "model/what"
    apply: Callable[[Path], None]
    names: str  # a regex the refusal line must match (the tensor, key or shard it is about)
    info: str = "reject"  # "any" where info may exit 0 (values info never reads)
    prune: str = "reject"


def tensor_case(model: str, what: str, pattern: str, fn, names: str, values_only: bool = False):
    def apply(d: Path) -> None:
        if not edit_tensors(d, pattern, fn):
            raise RuntimeError(f"{model}/{what}: no tensor matches {pattern}")
    return Case(f"{model}/{what}", apply, names, "any" if values_only else "reject")


# One layer's routed experts: layer 1 in Kimi K2 (layer 0 is dense), layer 0 in GPT-OSS.
INT4 = r"model\.layers\.1\.mlp\.experts\.\d+\.{}"
OSS = r"model\.layers\.0\.mlp\.experts\.{}"
BAD = (("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")), ("1e38", 1e38))


def int4_cases() -> list[Case]:
    scale, packed, shape = (INT4.format(f"gate_proj.{n}") for n in
                            ("weight_scale", "weight_packed", "weight_shape"))
    down_scale = INT4.format("down_proj.weight_scale")
    out = [tensor_case("int4", f"scale_{k}", scale, values(first_of_each, v), "weight_scale", True)
           for k, v in BAD]
    out += [
        tensor_case("int4", "scale_all_nan", scale, values(every, float("nan")), "weight_scale",
                    True),
        tensor_case("int4", "down_scale_1e38", down_scale, values(first_of_each, 1e38),
                    "weight_scale", True),
        tensor_case("int4", "scale_int16", scale, relabel(torch.int16), "weight_scale"),
        tensor_case("int4", "scale_float64", scale, cast(torch.float64), "weight_scale"),
        tensor_case("int4", "scale_cols_plus_1", scale,
                    reshape(lambda t: torch.cat([t, t[:, :1]], 1)), "weight_scale"),
        tensor_case("int4", "scale_transposed", scale, reshape(lambda t: t.T), "weight_scale"),
        tensor_case("int4", "scale_zero_size", scale, reshape(lambda t: t[:0]), "weight_scale"),
        tensor_case("int4", "scale_missing", scale, lambda n, t: None, "weight_scale"),
        tensor_case("int4", "packed_float32", packed, relabel(torch.float32), "weight_packed"),
        tensor_case("int4", "packed_int64", packed, cast(torch.int64), "weight_packed"),
        tensor_case("int4", "packed_uint8", packed, relabel(torch.uint8), "weight_packed"),
        tensor_case("int4", "packed_cols_minus_1", packed, reshape(lambda t: t[:, :-1]),
                    "weight_packed"),
        tensor_case("int4", "packed_rows_plus_1", packed,
                    reshape(lambda t: torch.cat([t, t[:1]], 0)), "weight_packed"),
        tensor_case("int4", "packed_1d", packed, reshape(lambda t: t.flatten()), "weight_packed"),
        tensor_case("int4", "packed_zero_size", packed, reshape(lambda t: t[:0]), "weight_packed"),
        tensor_case("int4", "shape_swapped", shape, reshape(lambda t: t.flip(0)), "weight_shape", True),
        tensor_case("int4", "shape_plus_1", shape, reshape(lambda t: t + 1), "weight_shape", True),
        tensor_case("int4", "shape_zero", shape, reshape(torch.zeros_like), "weight_shape", True),
        tensor_case("int4", "shape_negative", shape, reshape(lambda t: -t), "weight_shape", True),
        tensor_case("int4", "shape_2e40", shape,
                    reshape(lambda t: torch.tensor([2**40, 2**40], dtype=torch.int64)),
                    "weight_shape"),
        tensor_case("int4", "shape_three_values", shape,
                    reshape(lambda t: torch.cat([t, t[:1]])), "weight_shape"),
        tensor_case("int4", "shape_float", shape, cast(torch.float32), "weight_shape"),
        tensor_case("int4", "shape_zero_size", shape, reshape(lambda t: t[:0]), "weight_shape"),
        Case("int4/config_moe_width_48", config_edit(_set("moe_intermediate_size", 48)),
             "moe_intermediate_size|weight_shape|weight_packed|gate_proj|up_proj|down_proj"),
        Case("int4/config_group_size_64", config_edit(
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                group_size=64)), "group_size|weight_scale"),
        Case("int4/config_num_bits_8", config_edit(
            lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
                num_bits=8)), "num_bits"),
        Case("int4/config_experts_17", config_edit(_set("n_routed_experts", 17)),
             r"n_routed_experts|experts\.16|mlp\.gate\.weight"),  # the router: [E, D]
        Case("int4/truncated_shard", truncate_shard(scale, lambda n: n - 1000),
             r"safetensors|truncated|shard"),
    ]
    return out


def fused_cases(model: str) -> list[Case]:
    """GPT-OSS fused experts: `model` "mxfp4" (blocks and E8M0 scales) or "fused" (plain)."""
    bias, down_bias = OSS.format("gate_up_proj_bias"), OSS.format("down_proj_bias")
    out = [tensor_case(model, f"bias_{k}", bias, values(first_of_each, v), "gate_up_proj_bias",
                       True) for k, v in BAD]
    out.append(tensor_case(model, "down_bias_nan", down_bias, values(first_of_each, float("nan")),
                           "down_proj_bias", True))
    if model == "mxfp4":
        blocks, scales = OSS.format("gate_up_proj_blocks"), OSS.format("gate_up_proj_scales")
        out += [tensor_case(model, f"scale_byte_{b}", scales, values(first_of_each, b),
                            "gate_up_proj", True) for b in (255, 254, 141)]
        out += [
            tensor_case(model, "blocks_int8", blocks, relabel(torch.int8), "gate_up_proj_blocks"),
            tensor_case(model, "blocks_last_dim_8", blocks, reshape(lambda t: t[..., :8]),
                        "gate_up_proj_blocks"),
            tensor_case(model, "blocks_experts_minus_1", blocks, reshape(lambda t: t[:-1]),
                        "gate_up_proj_blocks"),
            tensor_case(model, "blocks_zero_size", blocks, reshape(lambda t: t[:0]),
                        "gate_up_proj_blocks"),
            tensor_case(model, "scales_float32", scales, cast(torch.float32),
                        "gate_up_proj_scales"),
            tensor_case(model, "scales_cols_plus_1", scales,
                        reshape(lambda t: torch.cat([t, t[..., :1]], -1)), "gate_up_proj_scales"),
            tensor_case(model, "scales_missing", scales, lambda n, t: None, "gate_up_proj_scales"),
        ]
        tensor = blocks
    else:
        weight, down = OSS.format("gate_up_proj"), OSS.format("down_proj")
        out += [tensor_case(model, f"weight_{k}", weight, values(first_of_each, v), "gate_up_proj",
                            True) for k, v in BAD]
        out += [
            tensor_case(model, "down_nan", down, values(first_of_each, float("nan")), "down_proj",
                        True),
            tensor_case(model, "down_1e38", down, values(first_of_each, 1e38), "down_proj", True),
            tensor_case(model, "weight_int16", weight, relabel(torch.int16), "gate_up_proj"),
            tensor_case(model, "weight_float64", weight, cast(torch.float64), "gate_up_proj"),
            tensor_case(model, "weight_transposed", weight, reshape(lambda t: t.transpose(1, 2)),
                        "gate_up_proj"),
            tensor_case(model, "weight_width_minus_2", weight, reshape(lambda t: t[..., :-2]),
                        "gate_up_proj"),
            tensor_case(model, "weight_experts_minus_1", weight, reshape(lambda t: t[:-1]),
                        "gate_up_proj"),
            tensor_case(model, "weight_zero_size", weight, reshape(lambda t: t[:0]),
                        "gate_up_proj"),
            tensor_case(model, "weight_4d", weight, reshape(lambda t: t[None]), "gate_up_proj"),
            tensor_case(model, "weight_missing", weight, lambda n, t: None, "gate_up_proj"),
            tensor_case(model, "bias_zero_size", bias, reshape(lambda t: t[:0]),
                        "gate_up_proj_bias"),
        ]
        tensor = weight
    out += [
        Case(f"{model}/config_experts_15", config_edit(_set("num_local_experts", 15)),
             "num_local_experts|gate_up_proj|down_proj|router"),
        Case(f"{model}/config_width_96", config_edit(_set("intermediate_size", 96)),
             "intermediate_size|gate_up_proj|down_proj"),
        Case(f"{model}/truncated_shard", truncate_shard(tensor, lambda n: n // 2),
             r"safetensors|truncated|shard"),
    ]
    return out


def all_cases() -> list[Case]:
    return [*int4_cases(), *fused_cases("mxfp4"), *fused_cases("fused")]


# --- runs ------------------------------------------------------------------------------------

def setup_runs(b: Path, models: set[str]) -> list[Run]:
    runs = []
    for m, config in model_configs().items():
        if m not in models:
            continue
        (b / f"{m}.json").write_text(json.dumps(config))
        runs += [
            Run(f"setup/{m}/synth", ["synth", str(b / f"{m}.json"), "--seed", "0", "--out",
                                     str(b / m)], "accept"),
            Run(f"setup/{m}/plan", ["plan", "--model", str(b / m), "--criterion", "random",
                                    "--keep", "10", "--out", str(b / f"{m}-plan.json")], "accept"),
            Run(f"setup/{m}/prune", ["prune", str(b / m), "--plan", str(b / f"{m}-plan.json"),
                                     "--out", str(b / f"{m}-pruned"), "--no-progress"], "accept"),
        ]
    return runs


def argv_for(command: str, b: Path, model: str, d: Path) -> list[str]:
    m = str(d / "model")
    return [str(a) for a in {
        "info": ["info", m],
        "run": ["run", m, "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-tokens", "2", "--quiet",
                "--threads", "1"],
        "calibrate": ["calibrate", m, "--corpus", "en", "--tokens", "64", "--seq-len", "32",
                      "--out", d / "cal", "--no-progress"],
        "prune": ["prune", m, "--plan", b / f"{model}-plan-unbound.json", "--out", d / "out",
                  "--no-progress"],
        "verify": ["verify", d / "pruned", "--source", b / model],
    }[command]]


def case_runs(case: Case, b: Path, work: Path) -> list[Run]:
    model = case.name.split("/")[0]
    d = work / case.name.replace("/", "__")
    shutil.copytree(b / model, d / "model")
    shutil.copytree(b / f"{model}-pruned", d / "pruned")
    case.apply(d / "model")
    case.apply(d / "pruned")
    expect = {"info": case.info, "prune": case.prune}
    return [Run(f"{case.name}/{c}", argv_for(c, b, model, d), expect.get(c, "reject"), model, c)
            for c in COMMANDS]


def verdict(run: Run, result, case: Case) -> tuple[str, str]:
    v = classify(run, result)
    if v != "clean" or result.rc == 0:
        return v, ""
    if result.rc not in (2, 4) and not (result.rc == 1 and "tensor binding failed" in result.line()):
        return "vague", f"exit {result.rc}, not 2 (bad input) or 4 (bad numbers)"
    if not re.search(case.names, result.line()):
        return "vague", f"the line does not name {case.names!r}"
    return "clean", ""


def execute(work: Path, timeout: float = 60.0, only: list[str] | None = None, log=None,
            progress=None) -> list[dict]:
    """Build the three models, their plans and pruned builds, then run every case (those whose
    name starts with one of `only`); one record per run."""
    b = work / "base"
    b.mkdir(parents=True)
    cases = {c.name: c for c in all_cases() if not only or any(c.name.startswith(o) for o in only)}
    models = {name.split("/")[0] for name in cases}
    setup = run_batch(setup_runs(b, models), timeout=300, log=log)
    failed = {k: r.stderr[-400:] for k, r in setup.items() if r.rc != 0}
    if failed:
        raise RuntimeError(f"setup failed: {failed}")
    for m in models:
        plan = json.loads((b / f"{m}-plan.json").read_text())
        (b / f"{m}-plan-unbound.json").write_text(json.dumps({**plan, "model": None}))
    runs = [r for c in cases.values() for r in case_runs(c, b, work / "cases")]
    records = []

    def on_result(run: Run, result) -> None:
        case = cases[run.key.rsplit("/", 1)[0]]
        v, note = verdict(run, result, case)
        line = result.line() if result.rc is not None else f"(no exit within {timeout:.0f} s)"
        rec = {"key": run.key, "model": run.category, "command": run.command,
               "expect": run.expect, "rc": result.rc, "verdict": v, "note": note,
               "line": line.replace(str(work), "$WORK"), "seconds": round(result.seconds, 2)}
        records.append(rec)
        if progress:
            progress(rec)

    run_batch(runs, timeout, log=log, on_result=on_result)
    return records


def main(argv: list[str] | None = None) -> int:
    args = fuzz_args(__doc__, "views", "int4/scale", 60.0).parse_args(argv)
    records, seconds = run_cases(args, "views", lambda work, progress: execute(
        work, args.timeout, args.only, log=sys.stderr, progress=progress))
    for by in ("model", "command"):
        print()
        write_table(count_table(records, by, VERDICTS))
    write_report(args, {"runs": len(records), "seconds": seconds, "timeout_s": args.timeout,
                        "command": "OMP_NUM_THREADS=1 nice -n 5 python -m experiments.fuzz_views",
                        "by_model": count_table(records, "model", VERDICTS),
                        "by_command": count_table(records, "command", VERDICTS),
                        "results": records})
    return 0


if __name__ == "__main__":
    sys.exit(main())
