"""Seeded fuzzing of `reap` inputs: corrupt checkpoints, indexes, configs, weights, plans, stats, args.

    OMP_NUM_THREADS=1 nice -n 10 python -m experiments.fuzz_inputs --seed 0 [--limit N] [--jobs 1]
    python -m experiments.fuzz_inputs --seed 0 --only header/len_minus1   # one case, full stderr

From a tiny synthesized model (`reap synth k3-tiny`, 3 shards) and its statistics, plan and pruned
build, each case writes one invalid input (the seed picks the shard, tensor, cut point and the
random header edits) and runs the commands that read it (`info`, `run --max-tokens 2`, `calibrate`
with 128 tokens, `prune`, `verify`, `plan`) through the public CLI with a hard timeout and a 4 GB
address-space cap (experiments/fuzz_common.py). Every input here is invalid by construction, so
exit 0 is a *silent* result, except where a command legitimately does not read what was broken
(`info` and `prune` do not compute with weight values). Writes reports/reliability-inputs.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from experiments.fuzz_common import (
    REPO,
    Run,
    classify,
    count_table,
    data_bytes,
    encode_header,
    read_header,
    run_batch,
    run_isolated,
    write_file,
    write_table,
)

CHECKPOINT_COMMANDS = ("info", "run", "calibrate", "prune", "verify")
NORM = "language_model.model.layers.2.input_layernorm.weight"
ROUTER = "language_model.model.layers.2.block_sparse_moe.gate.weight"
FINAL_NORM = "language_model.model.norm.weight"
ONE_ROW = "language_model.model.layers.2.self_attention_res_proj.weight"  # shape [1, 64]


@dataclass
class Case:
    """One invalid input and the commands that read it."""

    name: str  # "category/what"
    mutate: Callable  # (Base, case_dir, rng) -> dict of paths for the argv templates
    commands: tuple = CHECKPOINT_COMMANDS
    expect: dict | None = None  # command -> "reject" | "any" | "accept" (default "reject")
    check: str = ""

    @property
    def category(self) -> str:
        return self.name.split("/")[0]


@dataclass
class Base:
    """The valid inputs every case starts from."""

    root: Path

    model = property(lambda self: self.root / "model")
    pruned = property(lambda self: self.root / "pruned")
    stats = property(lambda self: self.root / "stats" / "en.safetensors")
    plan = property(lambda self: self.root / "plan.json")
    # the plan without its model fingerprint (an optional field): prune then reads a mutated
    # model instead of refusing it for not being the model the plan was made for
    plan_unbound = property(lambda self: self.root / "plan-unbound.json")


def setup_runs(base: Base, seed: int) -> list[Run]:
    """The CLI runs that build the base inputs (all must exit 0)."""
    r = str(base.root)
    return [
        Run("setup/synth", ["synth", "k3-tiny", "--out", f"{r}/model", "--seed", str(seed),
                            "--shard-gb", "0.0003"], "accept"),
        Run("setup/calibrate", ["calibrate", f"{r}/model", "--corpus", "en", "--tokens", "128",
                                "--seq-len", "64", "--out", f"{r}/stats", "--no-progress"], "accept"),
        Run("setup/plan", ["plan", str(base.stats), "--model", f"{r}/model", "--keep", "8",
                           "--out", str(base.plan)], "accept"),
        Run("setup/prune", ["prune", f"{r}/model", "--plan", str(base.plan), "--out", f"{r}/pruned",
                            "--max-shard-size", "300KB", "--no-progress"], "accept"),
    ]


# --- helpers on checkpoint directories -------------------------------------------------------

def _index(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def _shard_of(d: Path, tensor: str) -> Path:
    return d / _index(d)["weight_map"][tensor]


def _shards(d: Path) -> list[Path]:
    return [d / s for s in sorted(set(_index(d)["weight_map"].values()))]


def _rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    """Apply `edit` to the header dict and write it back with a correct length."""
    header, _ = read_header(path)
    data = data_bytes(path)
    edit(header)
    write_file(path, encode_header(header), data)


def _tensors(header: dict) -> list[str]:
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _poke(path: Path, tensor: str, value: bytes, every: int | None = None) -> None:
    """Overwrite the first element of `tensor` (or every `every`-th byte run) with `value`."""
    header, n = read_header(path)
    start, end = header[tensor]["data_offsets"]
    with open(path, "r+b") as f:
        for pos in range(start, end, every or (end - start)):
            f.seek(8 + n + pos)
            f.write(value)


def _copy_pair(base: Base, case_dir: Path) -> dict:
    """Copies of the base model and pruned build for one case (both get the same mutation)."""
    shutil.copytree(base.model, case_dir / "model")
    shutil.copytree(base.pruned, case_dir / "pruned")
    return {"model": case_dir / "model", "pruned": case_dir / "pruned"}


def _each(paths: dict, fn: Callable[[Path], None]) -> dict:
    fn(paths["model"])
    fn(paths["pruned"])
    return paths


def checkpoint_case(name: str, fn: Callable[[Path, random.Random], None], **kw) -> Case:
    """A case that applies `fn(checkpoint_dir, rng)` to a copy of the model and of the pruned build."""
    def mutate(base, case_dir, rng):
        seed = rng.random()
        return _each(_copy_pair(base, case_dir), lambda d: fn(d, random.Random(seed)))
    return Case(name, mutate, **kw)


# --- header mutations ------------------------------------------------------------------------

def _pick_shard(d: Path, rng: random.Random) -> Path:
    return rng.choice(_shards(d))


def _raw(d: Path, rng: random.Random, fn: Callable[[bytes, int, bytes], bytes]) -> None:
    """Replace a random shard by fn(header_bytes, header_len, data) (raw file bytes after it)."""
    path = _pick_shard(d, rng)
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    path.write_bytes(fn(blob[8:8 + n], n, blob[8 + n:]))


def _len(delta: int) -> Callable:
    return lambda h, n, data: struct.pack("<Q", n + delta) + h + data


def _edit_tensor(d: Path, rng: random.Random, fn: Callable[[dict, str, dict], None],
                 pick: Callable[[dict, str], bool] = lambda h, k: True) -> None:
    """Apply fn(header, name, header) to one random tensor (of any shard) that `pick` accepts."""
    candidates = [(path, k) for path in _shards(d) for h in [read_header(path)[0]]
                  for k in _tensors(h) if pick(h, k)]
    path, name = rng.choice(candidates)
    _rewrite(path, lambda header: fn(header, name, header))


def _set(field_: str, fn: Callable) -> Callable:
    def apply(d, rng):
        _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(field_, fn(h[k][field_])),
                     pick=lambda h, k: h[k]["data_offsets"][1] > h[k]["data_offsets"][0])
    return apply


def _overlap(d: Path, rng: random.Random) -> None:
    def edit(header):
        names = _tensors(header)
        pairs = [(a, b) for a, b in itertools.pairwise(names)
                 if _size(header[a]) == _size(header[b]) and _size(header[a]) > 0]
        a, b = rng.choice(pairs)
        header[b]["data_offsets"] = list(header[a]["data_offsets"])
    _rewrite(_pick_shard(d, rng), edit)


def _size(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def _gap_middle(d: Path, rng: random.Random) -> None:
    path = _pick_shard(d, rng)
    header, _ = read_header(path)
    data = data_bytes(path)
    names = _tensors(header)
    cut = header[names[len(names) // 2]]["data_offsets"][0]
    for k in names[len(names) // 2:]:
        header[k]["data_offsets"] = [o + 16 for o in header[k]["data_offsets"]]
    write_file(path, encode_header(header), data[:cut] + bytes(16) + data[cut:])


def _nested(d: Path, rng: random.Random) -> None:
    """An extra key whose value is 100,000 nested lists (the data offsets stay valid)."""
    deep = b'{"zz":' + b"[" * 100_000 + b"]" * 100_000 + b","
    _raw(d, rng, lambda h, n, data: struct.pack("<Q", len(deep) + n - 1) + deep + h[1:] + data)


def _flip(d: Path, rng: random.Random) -> None:
    """Replace one non-blank header byte so that a tensor entry changes (or the JSON breaks)."""
    path = _pick_shard(d, rng)
    blob = bytearray(path.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    original = json.loads(blob[8:8 + n])
    for _ in range(1000):
        trial = bytearray(blob)
        pos = 8 + rng.randrange(n)
        if chr(trial[pos]).isspace():
            continue
        trial[pos] = rng.choice(b'0123456789{}[]",:-.eE abcxyzFU')
        try:  # a change of __metadata__ alone can leave a valid file: not a case
            flipped = json.loads(trial[8:8 + n])
            if {**flipped, "__metadata__": 0} == {**original, "__metadata__": 0}:
                continue
        except (ValueError, TypeError):
            pass
        path.write_bytes(trial)
        return
    raise RuntimeError("no meaningful header flip found")


def header_cases(n_flips: int) -> list[Case]:
    mk = lambda name, fn: checkpoint_case("header/" + name, fn)
    cases = [
        mk("len_minus1", lambda d, rng: _raw(d, rng, _len(-1))),
        mk("len_plus1", lambda d, rng: _raw(d, rng, _len(+1))),
        mk("len_huge", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", 2**62) + h + data)),
        mk("len_past_eof", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n + len(data) + 8) + h + data)),
        mk("truncated_1_byte", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n) + h + data[:-1])),
        mk("truncated_random", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n) + h + data[:rng.randrange(len(data))])),
        mk("truncated_in_header", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n) + h[:n // 2])),
        mk("bad_json", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n) + b"(" + h[1:] + data)),
        mk("not_an_object", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", 8) + b"[1,2,3] " + data)),
        mk("deeply_nested", _nested),
        mk("float_offsets", _set("data_offsets", lambda o: [float(o[0]) + 0.5, float(o[1])])),
        mk("float_offsets_integral", _set("data_offsets", lambda o: [float(o[0]), float(o[1])])),
        mk("bool_offset", lambda d, rng: _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(
            "data_offsets", [False, h[k]["data_offsets"][1]]), pick=lambda h, k: h[k]["data_offsets"][0] == 0)),
        mk("negative_offsets", _set("data_offsets", lambda o: [-o[1], -o[0]] if o[0] else [-8, o[1]])),
        mk("float_shape", _set("shape", lambda s: [float(x) for x in s] or [1.0])),
        mk("bool_shape", lambda d, rng: _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(
            "shape", [True, *h[k]["shape"][1:]]), pick=lambda h, k: h[k]["shape"][:1] == [1])),
        mk("negative_shape_same_numel", lambda d, rng: _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(
            "shape", [-1, -h[k]["shape"][1]]), pick=lambda h, k: len(h[k]["shape"]) == 2 and h[k]["shape"][0] == 1)),
        mk("shape_numel_mismatch", _set("shape", lambda s: [*s[:-1], s[-1] * 2] if s else [2])),
        mk("overlapping_entries", _overlap),
        mk("gap_in_middle", _gap_middle),
        mk("gap_at_end", lambda d, rng: _raw(d, rng, lambda h, n, data: struct.pack("<Q", n) + h + data + bytes(16))),
        mk("dtype_unknown", _set("dtype", lambda t: "F33")),
        mk("dtype_lowercase", _set("dtype", lambda t: t.lower())),
        mk("dtype_relabel_same_size", lambda d, rng: _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(
            "dtype", "F16"), pick=lambda h, k: h[k]["dtype"] == "BF16")),
        mk("dtype_relabel_other_size", lambda d, rng: _edit_tensor(d, rng, lambda h, k, _: h[k].__setitem__(
            "dtype", "F64"), pick=lambda h, k: h[k]["dtype"] == "BF16")),
        mk("metadata_not_strings", lambda d, rng: _rewrite(_pick_shard(d, rng), lambda h: h.__setitem__("__metadata__", {"format": 1, "x": [1]}))),
        mk("entry_removed", lambda d, rng: _rewrite(_pick_shard(d, rng), lambda h: h.pop(rng.choice(_tensors(h))))),
        mk("entry_added", lambda d, rng: _rewrite(_pick_shard(d, rng), lambda h: h.__setitem__(
            "language_model.model.zz_extra.weight", {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}))),
    ]
    cases += [mk(f"random_flip_{i}", _flip) for i in range(n_flips)]
    return cases


# --- index mutations -------------------------------------------------------------------------

def _edit_index(d: Path, fn: Callable[[dict], None]) -> None:
    path = d / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    fn(index)
    path.write_text(json.dumps(index))


def _wrong_shard(d: Path, rng: random.Random) -> None:
    shards = sorted(set(_index(d)["weight_map"].values()))
    def fn(index):
        names = [k for k, v in index["weight_map"].items() if v == shards[0]]
        index["weight_map"][rng.choice(names)] = shards[1]
    _edit_index(d, fn)


def _outside(d: Path, rng: random.Random, absolute: bool) -> None:
    """Move shard 1 out of the checkpoint and point the index at it (`../` or absolute)."""
    first = _shards(d)[0]
    elsewhere = d.parent / f"elsewhere-{d.name}"
    elsewhere.mkdir(exist_ok=True)
    shutil.move(first, elsewhere / first.name)
    target = str(elsewhere / first.name) if absolute else f"../{elsewhere.name}/{first.name}"
    _edit_index(d, lambda index: index["weight_map"].update(
        {k: target for k, v in index["weight_map"].items() if v == first.name}))


def _swap(d: Path, rng: random.Random) -> None:
    a, b = _shards(d)[:2]
    tmp = a.with_suffix(".tmp")
    a.rename(tmp), b.rename(a), tmp.rename(b)


def _fifo(d: Path, rng: random.Random) -> None:
    shard = _shards(d)[1]
    shard.unlink()
    os.mkfifo(shard)


def index_cases() -> list[Case]:
    mk = lambda name, fn: checkpoint_case("index/" + name, fn)
    return [
        mk("missing_shard", lambda d, rng: _shards(d)[1].unlink()),
        mk("wrong_shard", _wrong_shard),
        mk("dotdot_path", lambda d, rng: _outside(d, rng, absolute=False)),
        mk("absolute_path", lambda d, rng: _outside(d, rng, absolute=True)),
        mk("swapped_shards", _swap),
        mk("renamed_shard", lambda d, rng: _shards(d)[2].rename(_shards(d)[2].with_suffix(".bak"))),
        mk("not_json", lambda d, rng: (d / "model.safetensors.index.json").write_text("{not json")),
        mk("weight_map_list", lambda d, rng: _edit_index(d, lambda i: i.__setitem__("weight_map", list(i["weight_map"])))),
        mk("weight_map_value_int", lambda d, rng: _edit_index(d, lambda i: i["weight_map"].__setitem__(NORM, 1))),
        mk("names_absent_tensor", lambda d, rng: _edit_index(d, lambda i: i["weight_map"].__setitem__(
            "language_model.model.layers.2.zz_absent.weight", min(i["weight_map"].values())))),
        mk("omits_present_tensor", lambda d, rng: _edit_index(d, lambda i: i["weight_map"].pop(NORM))),
        mk("fifo_shard", _fifo),
    ]


# --- config mutations ------------------------------------------------------------------------

MISSING = object()
CONFIG_VALUES = {
    "num_experts_per_token": [MISSING, 0, -1, 17, 1.5, "4", True, math.nan, 10**12],
    "num_experts": [MISSING, 0, -1, 15, "16", 16.5, math.nan, 10**12],
    "num_hidden_layers": [0, -1, 7, "6", math.inf, 10**12],
    "rms_norm_eps": [-1e-5, math.nan, math.inf, "1e-5", 10**12],
    "routed_scaling_factor": [1e308, math.nan, -math.inf, "2.8", 10**12],
    "moe_layer_freq": [0, -1, "1", math.nan, 10**12],
}


def _config_edit(key: str, value) -> Callable[[Path, random.Random], None]:
    def fn(d, rng):
        path = d / "config.json"
        config = json.loads(path.read_text())
        text = config.get("text_config", config)
        if value is MISSING:
            text.pop(key, None)
        else:
            text[key] = value
        path.write_text(json.dumps(config))
    return fn


def _label(value) -> str:
    if value is MISSING:
        return "missing"
    if isinstance(value, str):
        return f"str_{value}"
    if isinstance(value, int) and value >= 10**12 and not isinstance(value, bool):
        return "1e12"
    return str(value).lower()


def config_cases() -> list[Case]:
    cases = [checkpoint_case(f"config/{k}={_label(v)}", _config_edit(k, v))
             for k, values in CONFIG_VALUES.items() for v in values]
    cases += [
        checkpoint_case("config/not_json", lambda d, rng: (d / "config.json").write_text("{'model_type': ")),
        checkpoint_case("config/list", lambda d, rng: (d / "config.json").write_text("[1, 2]")),
        checkpoint_case("config/deeply_nested", lambda d, rng: (d / "config.json").write_text(
            '{"model_type": "kimi_k3", "text_config": ' + "[" * 100_000 + "]" * 100_000 + "}")),
    ]
    return cases


# --- weight mutations ------------------------------------------------------------------------

BF16_NAN, BF16_INF = b"\xc0\x7f", b"\x80\x7f"
WEIGHTS = {"reject_compute": {"info": "any", "prune": "any"}}


def _weight(tensor: str, value: bytes, every: int | None = None) -> Callable:
    return lambda d, rng: _poke(_shard_of(d, tensor), tensor, value, every)


def _e8m0(d: Path, rng: random.Random) -> None:
    """Scale byte 0xFF (E8M0 NaN) in every routed expert of layer 2 present in this checkpoint."""
    index = _index(d)["weight_map"]
    for name in index:
        if ".layers.2." in name and ".experts." in name and name.endswith("w1.weight_scale"):
            _poke(d / index[name], name, b"\xff")


def weight_cases() -> list[Case]:
    exp = WEIGHTS["reject_compute"]
    mk = lambda name, fn: checkpoint_case("weights/" + name, fn, expect=exp, check="stats_finite")
    return [
        mk("nan_norm", _weight(NORM, BF16_NAN)),
        mk("nan_norm_all", _weight(NORM, BF16_NAN, every=2)),
        # the final norm feeds only the LM head, which calibration never reads
        checkpoint_case("weights/nan_final_norm", _weight(FINAL_NORM, BF16_NAN),
                        expect={**exp, "calibrate": "any"}, check="stats_finite"),
        mk("inf_router", _weight(ROUTER, BF16_INF)),
        mk("nan_router", _weight(ROUTER, BF16_NAN)),
        mk("e8m0_ff_expert_scale", _e8m0),
    ]


def control_cases() -> list[Case]:
    accept = dict.fromkeys(CHECKPOINT_COMMANDS, "accept")
    return [checkpoint_case("control/unchanged", lambda d, rng: None, expect=accept)]


# --- plan and statistics mutations -----------------------------------------------------------

def plan_case(name: str, fn: Callable[[dict], object]) -> Case:
    """A plan edited by `fn` (which may return a replacement: any JSON value or raw text)."""
    def mutate(base, case_dir, rng):
        plan = json.loads(base.plan.read_text())
        new = fn(plan)
        new = plan if new is None else new
        path = case_dir / "plan.json"
        path.write_text(new if isinstance(new, str) else json.dumps(new))
        return {"plan": path}
    return Case("plan/" + name, mutate, commands=("prune",))


def _keep(fn: Callable[[list], list], layers: str = "first") -> Callable[[dict], None]:
    def edit(plan):
        for i, layer in enumerate(sorted(plan["keep"], key=int)):
            if layers == "all" or i == 0:
                plan["keep"][layer] = fn(plan["keep"][layer])
                if "counts" in plan:
                    plan["counts"][layer] = len(plan["keep"][layer])
    return edit


DEEP = "[" * 100_000 + "]" * 100_000


def plan_cases() -> list[Case]:
    return [
        plan_case("keep_zero_one_layer", _keep(lambda ids: [])),
        plan_case("keep_zero_all_layers", _keep(lambda ids: [], "all")),
        plan_case("keep_below_top_k", _keep(lambda ids: ids[:3])),
        plan_case("float_ids", _keep(lambda ids: [float(i) for i in ids])),
        plan_case("fractional_ids", _keep(lambda ids: [i + 0.5 for i in ids])),
        plan_case("bool_ids", _keep(lambda ids: [False, True, *ids[2:]] if ids[:2] == [0, 1] else [True, *ids[1:]])),
        plan_case("negative_id", _keep(lambda ids: [-1, *ids[1:]])),
        plan_case("id_out_of_range", _keep(lambda ids: [*ids[:-1], 16])),
        plan_case("duplicate_ids", _keep(lambda ids: [ids[0], *ids[:-1]])),
        plan_case("string_ids", _keep(lambda ids: [str(i) for i in ids])),
        plan_case("top_k_changed", lambda p: p.__setitem__("top_k", 2)),
        plan_case("top_k_zero", lambda p: p.__setitem__("top_k", 0)),
        plan_case("n_experts_changed", lambda p: p.__setitem__("n_experts", 32)),
        plan_case("layer_not_moe", lambda p: p["keep"].__setitem__("0", list(range(8)))),
        plan_case("layer_out_of_range", lambda p: p["keep"].__setitem__("99", list(range(8)))),
        plan_case("keep_missing", lambda p: p.pop("keep")),
        plan_case("keep_is_list", lambda p: p.__setitem__("keep", list(p["keep"].values()))),
        plan_case("deeply_nested", lambda p: '{"keep": ' + DEEP + "}"),
        plan_case("not_json", lambda p: "{keep: "),
        plan_case("top_level_list", lambda p: [p]),
    ]


def _stats_meta(fn: Callable[[dict], object]) -> Callable:
    def edit(header):
        meta = json.loads(header["__metadata__"]["reap"])
        new = fn(meta)
        header["__metadata__"]["reap"] = new if isinstance(new, str) else json.dumps(meta)
    return edit


def _stats_value(tensor: str, value: bytes) -> Callable[[Path], None]:
    return lambda path: _poke(path, tensor, value)


def stats_case(name: str, fn: Callable[[Path], None]) -> Case:
    def mutate(base, case_dir, rng):
        path = case_dir / "en.safetensors"
        shutil.copy(base.stats, path)
        fn(path)
        return {"stats": path}
    return Case("stats/" + name, mutate, commands=("plan",))


def stats_cases() -> list[Case]:
    meta = lambda name, fn: stats_case(name, lambda p: _rewrite(p, _stats_meta(fn)))
    return [
        meta("top_k_changed", lambda m: m.__setitem__("top_k", 2)),
        meta("top_k_bool", lambda m: m.__setitem__("top_k", True)),
        meta("n_experts_changed", lambda m: m.__setitem__("n_experts", 32)),
        meta("n_experts_float", lambda m: m.__setitem__("n_experts", 16.0)),
        meta("layers_changed", lambda m: m.__setitem__("layers", [1, 2, 3, 4, 99])),
        meta("meta_deeply_nested", lambda m: '{"format": "reap.expert_stats/1", "layers": ' + DEEP + "}"),
        meta("meta_not_json", lambda m: "{format"),
        stats_case("nan_reap_sum", _stats_value("reap_sum", struct.pack("<d", math.nan))),
        stats_case("inf_max_act", _stats_value("max_act", struct.pack("<f", math.inf))),
        stats_case("negative_count", _stats_value("count", struct.pack("<q", -5))),
        stats_case("shape_mismatch", lambda p: _rewrite(p, lambda h: h["count"].__setitem__("shape", [5, 8, 2]))),
        stats_case("tensor_missing", lambda p: _rewrite(p, lambda h: h.pop("reap_sum"))),
    ]


# --- bad arguments ---------------------------------------------------------------------------

def args_case(name: str, build: Callable[[Base, Path], list], check: str = "",
              expect: str = "reject") -> Case:
    """`build(base, case_dir)` returns the argv; the command is its first word."""
    def mutate(base, case_dir, rng):
        return {"argv": [str(a) for a in build(base, case_dir)]}
    return Case("args/" + name, mutate, commands=("argv",), expect={"argv": expect}, check=check)


# A huge seed may be accepted (reduced consistently) or refused cleanly; never an internal error.
MAY_ACCEPT = {"run_seed_2e70", "calibrate_seed_2e70", "plan_seed_2e70"}


def _run(*extra):
    return lambda b, d: ["run", b.model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet",
                         "--threads", "1", *extra]


def _calibrate(*extra, out=None):
    return lambda b, d: ["calibrate", b.model, "--corpus", "en", "--tokens", "128", "--seq-len",
                         "64", "--no-progress", "--out", out(b, d) if out else d / "cal", *extra]


def _plan(*extra, out=None):
    return lambda b, d: ["plan", b.stats, "--model", b.model, "--out",
                         out(b, d) if out else d / "plan.json", *extra]


def _prune(*extra, out=None):
    return lambda b, d: ["prune", b.model, "--plan", b.plan, "--no-progress", "--out",
                         out(b, d) if out else d / "out", *extra]


def _a_file(b: Base, d: Path) -> Path:
    (d / "a-file").write_text("x")
    return d / "a-file"


def _source_copy(b: Base, d: Path, inside: bool = False) -> Path:
    """A copy of the model at d/parent/model; returns the source dir (the check compares it)."""
    src = d / "parent" / "model"
    shutil.copytree(b.model, src)
    return src


def args_cases() -> list[Case]:
    proc = lambda b, d: "/proc/reap-fuzz-x"
    cases = [
        ("run_budget_1KB", _run("--budget", "1KB")),
        ("run_budget_nan", _run("--budget", "nanGB")),
        ("run_budget_negative", _run("--budget=-1GB")),
        ("run_seed_2e70", _run("--temperature", "1", "--seed", str(2**70))),
        ("run_temperature_nan", _run("--temperature", "nan")),
        ("run_temperature_inf", _run("--temperature", "inf")),
        ("run_temperature_negative", _run("--temperature", "-1")),
        ("run_top_p_nan", _run("--temperature", "1", "--top-p", "nan")),
        ("run_top_p_2", _run("--temperature", "1", "--top-p", "2")),
        ("run_max_tokens_negative", _run("--max-tokens", "-1")),
        ("run_context_zero", _run("--context", "0")),
        ("run_prompt_id_out_of_vocab", _run("--prompt-ids", "1,99999")),
        ("run_prompt_id_negative", _run("--prompt-ids", "1,-1")),
        ("run_out_proc", _run("--out", "/proc/reap-fuzz-x")),
        ("run_out_is_dir", lambda b, d: _run("--out", d)(b, d)),
        ("calibrate_seed_2e70", _calibrate("--seed", str(2**70))),
        ("calibrate_tokens_zero", lambda b, d: [*_calibrate()(b, d), "--tokens", "0"]),
        ("calibrate_seq_len_zero", lambda b, d: [*_calibrate()(b, d), "--seq-len", "0"]),
        ("calibrate_budget_1KB", _calibrate("--budget", "1KB")),
        ("calibrate_shard_3_of_2", _calibrate("--shard", "3/2")),
        ("calibrate_shard_0_of_0", _calibrate("--shard", "0/0")),
        ("calibrate_corpus_weight_nan", lambda b, d: [*_calibrate()(b, d), "--corpus", "en:nan"]),
        ("calibrate_out_is_file", _calibrate(out=_a_file)),
        ("calibrate_out_proc", _calibrate(out=proc)),
        ("plan_target_size_inf", _plan("--target-size", "infGB")),
        ("plan_target_size_nan", _plan("--target-size", "nanGB")),
        ("plan_target_size_negative", _plan("--target-size=-1GB")),
        ("plan_ratio_nan", _plan("--ratio", "nan")),
        ("plan_ratio_2", _plan("--ratio", "2")),
        ("plan_keep_zero", _plan("--keep", "0")),
        ("plan_keep_999", _plan("--keep", "999")),
        ("plan_seed_2e70", _plan("--criterion", "random", "--keep", "8", "--seed", str(2**70))),
        ("plan_weights_nan", _plan("--keep", "8", "--weights", "en=nan")),
        ("plan_out_proc", _plan("--keep", "8", out=proc)),
        ("plan_out_is_dir", _plan("--keep", "8", out=lambda b, d: d)),
        ("prune_max_shard_negative", _prune("--max-shard-size=-1GB")),
        ("prune_max_shard_zero", _prune("--max-shard-size", "0GB")),
        ("prune_max_shard_nan", _prune("--max-shard-size", "nanGB")),
        ("prune_out_is_file", _prune(out=_a_file)),
        ("prune_out_proc", _prune(out=proc)),
        ("verify_source_missing", lambda b, d: ["verify", b.pruned, "--source", d / "absent"]),
        ("verify_against_itself", lambda b, d: ["verify", b.model, "--source", b.model]),
        ("info_layers_1e12", lambda b, d: ["info", "k3-full", "--layers", str(10**12)]),
        ("info_layers_negative", lambda b, d: ["info", "k3-tiny", "--layers", "-1"]),
    ]
    out = [args_case(name, build, expect="any" if name in MAY_ACCEPT else "reject")
           for name, build in cases]
    out += [
        args_case("prune_out_is_source_overwrite", lambda b, d: ["prune", _source_copy(b, d), "--plan", b.plan,
                  "--no-progress", "--out", d / "parent" / "model", "--overwrite"], check="source_intact"),
        args_case("prune_out_is_parent_of_source_overwrite", lambda b, d: ["prune", _source_copy(b, d), "--plan",
                  b.plan, "--no-progress", "--out", d / "parent", "--overwrite"], check="source_intact"),
        args_case("prune_out_inside_source", lambda b, d: ["prune", _source_copy(b, d), "--plan", b.plan,
                  "--no-progress", "--out", d / "parent" / "model" / "pruned"], check="source_intact"),
    ]
    return out


# --- runs, checks, report --------------------------------------------------------------------

def all_cases(seed: int, n_flips: int = 8) -> list[Case]:
    return (control_cases() + header_cases(n_flips) + index_cases() + config_cases() + weight_cases()
            + plan_cases() + stats_cases() + args_cases())


def command_argv(command: str, base: Base, paths: dict, d: Path) -> list[str]:
    model = paths.get("model", base.model)
    argv = {
        "info": ["info", model],
        "run": ["run", model, "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet", "--threads", "1"],
        "calibrate": ["calibrate", model, "--corpus", "en", "--tokens", "128", "--seq-len", "64",
                      "--out", d / "cal", "--no-progress"],
        "prune": ["prune", model, "--plan", paths.get("plan", base.plan_unbound), "--out", d / "out",
                  "--no-progress"],
        "verify": ["verify", paths.get("pruned", base.pruned), "--source", base.model],
        "plan": ["plan", paths.get("stats", base.stats), "--model", base.model, "--keep", "8",
                 "--out", d / "plan-out.json"],
        "argv": paths.get("argv"),
    }[command]
    return [str(a) for a in argv]


def case_runs(case: Case, base: Base, work: Path, seed: int) -> list[Run]:
    """Write the case's input under work/ and return one Run per command that reads it."""
    d = work / case.name.replace("/", "__")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    rng = random.Random(f"{seed}:{case.name}")
    paths = case.mutate(base, d, rng)
    runs = []
    for command in case.commands:
        argv = command_argv(command, base, paths, d)
        name = argv[0] if command == "argv" else command
        expect = (case.expect or {}).get(command, "reject")
        runs.append(Run(f"{case.name}/{name}", argv, expect, case.category, name, case.check))
    return runs


def _finite(path: Path) -> bool:
    header, _ = read_header(path)
    data = data_bytes(path)
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] in ("F32", "F64"):
            a, b = v["data_offsets"]
            values = array("f" if v["dtype"] == "F32" else "d", data[a:b])
            if not all(math.isfinite(x) for x in values):
                return False
    return True


def _tree_bytes(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def verdict(run: Run, result, base: Base) -> tuple[str, str]:
    """The class of one finished run and a note (post-checks on what it wrote)."""
    v = classify(run, result)
    note = ""
    argv = run.argv
    if run.check == "stats_finite" and run.command == "calibrate" and result.rc == 0:
        out = Path(argv[argv.index("--out") + 1])
        bad = [p.name for p in out.glob("*.safetensors") if not _finite(p)]
        note = f"non-finite statistics in {bad}" if bad else "statistics finite"
    if run.check == "source_intact":
        src = Path(argv[1])
        if not src.is_dir() or _tree_bytes(src) != _tree_bytes(base.model):
            v, note = "silent", "SOURCE CHANGED OR DELETED"
    if run.expect == "accept" and result.rc != 0 and v == "clean":
        v, note = "internal", "valid input refused"
    return v, note


def execute(cases: list[Case], work: Path, seed: int, timeout: float, jobs: int = 1,
            isolate: bool = False, log=None, progress=None,
            keys: set[str] | None = None,
            timeouts: dict[str, float] | None = None) -> tuple[Base, list[dict]]:
    """Build the base inputs, then every case's input, run them all (only `keys`, "case/command",
    when given; `timeouts` overrides the timeout of some); returns one result record per run."""
    base = Base(work / "base")
    setup = run_batch(setup_runs(base, seed), timeout=300, log=log)
    failed = [k for k, r in setup.items() if r.rc != 0]
    if failed:
        raise RuntimeError(f"setup failed: {failed}: {[setup[k].stderr[-500:] for k in failed]}")
    plan = json.loads(base.plan.read_text())
    base.plan_unbound.write_text(json.dumps({**plan, "model": None}))
    if keys is not None:
        cases = [c for c in cases if any(k.startswith(c.name + "/") for k in keys)]
    runs = [r for c in cases for r in case_runs(c, base, work / "cases", seed)]
    runs = [r for r in runs if keys is None or r.key in keys]
    for r in runs:
        r.timeout = (timeouts or {}).get(r.key)
    by_key = {r.key: r for r in runs}
    records = []

    def on_result(run, result):
        v, note = verdict(run, result, base)
        rec = {"key": run.key, "case": run.key.rsplit("/", 1)[0], "category": run.category,
               "command": run.command, "expect": run.expect, "rc": result.rc, "verdict": v,
               "line": result.line().replace(str(work), "$WORK") if result.rc is not None
               else f"(no exit within {run.timeout or timeout:.0f} s)",
               "note": note, "seconds": round(result.seconds, 2),
               "argv": [a.replace(str(work), "$WORK") for a in run.argv]}
        records.append(rec)
        if progress:
            progress(rec, result)

    if isolate:
        for run in runs:
            on_result(run, run_isolated(run, timeout))
    else:
        chunks = [runs[i::jobs] for i in range(jobs)]
        if jobs == 1:
            run_batch(runs, timeout, log=log, on_result=on_result)
        else:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(jobs) as pool:
                list(pool.map(lambda ch: run_batch(ch, timeout, log=log, on_result=on_result), chunks))
    order = {k: i for i, k in enumerate(by_key)}
    records.sort(key=lambda r: order[r["key"]])
    return base, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, help="first N cases only")
    ap.add_argument("--only", action="append", help="case name prefix (repeatable); prints stderr")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per run (over it: hang)")
    ap.add_argument("--flips", type=int, default=8, help="random header edits")
    ap.add_argument("--isolate", action="store_true", help="one python -m reap.cli process per run")
    ap.add_argument("--out", default=str(REPO / "reports" / "reliability-inputs.json"))
    ap.add_argument("--work", help="keep the inputs here (default: a temporary directory)")
    args = ap.parse_args(argv)
    cases = all_cases(args.seed, args.flips)
    if args.only:
        cases = [c for c in cases if any(c.name.startswith(p) for p in args.only)]
    cases = cases[:args.limit] if args.limit else cases
    work = Path(args.work or tempfile.mkdtemp(prefix="reap-fuzz-"))
    start = time.time()

    def progress(rec, result):
        print(f"{rec['verdict']:8} rc={rec['rc']!s:4} {rec['key']}: {rec['line'][:140]}", flush=True)
        if args.only:
            print(result.stdout[-2000:], result.stderr[-4000:], sep="\n", flush=True)

    try:
        _, records = execute(cases, work, args.seed, args.timeout, args.jobs, args.isolate,
                             log=sys.stderr, progress=progress)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print()
    write_table(count_table(records, "command"))
    print()
    write_table(count_table(records, "category"))
    if not args.only:
        report = {"seed": args.seed, "cases": len(cases), "runs": len(records),
                  "seconds": round(time.time() - start, 1), "timeout_s": args.timeout,
                  "mem_cap_bytes": 4 * 1024**3,
                  "command": "OMP_NUM_THREADS=1 python -m experiments.fuzz_inputs --seed "
                             f"{args.seed}" + (f" --limit {args.limit}" if args.limit else ""),
                  "by_command": count_table(records, "command"),
                  "by_category": count_table(records, "category"), "results": records}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
