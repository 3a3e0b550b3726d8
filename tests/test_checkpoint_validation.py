"""Checkpoint input validation (issue 18): crafted headers, indexes and non-regular files are
refused at open or first use with a one-line CheckpointError (exit 2) naming the file and the
field, as the safetensors library refuses them; nothing hangs, nothing is read off by a byte."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import reap
from reap.checkpoint import Checkpoint
from reap.cli import main
from reap.errors import EXIT_USAGE, CheckpointError

OK = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _shard(path: Path, header: dict, data: bytes = b"", pad: int = 0, delta: int = 0) -> Path:
    """A safetensors file: header JSON padded with `pad` spaces, its length prefix off by
    `delta`, then `data`."""
    text = json.dumps(header, separators=(",", ":")).encode() + b" " * pad
    path.write_bytes(struct.pack("<Q", len(text) + delta) + text + data)
    return path


def _refused(path, *fields) -> str:
    """Open, fully validate and read `path`: the CheckpointError, checked to be one line with
    exit code 2 naming the file and each of `fields`."""
    with pytest.raises(CheckpointError) as e, Checkpoint.open(path) as ck:
        ck.validate()
        for name in ck.tensors:
            ck.read(name)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_USAGE and "\n" not in msg
    assert str(path) in msg, msg
    for field in fields:
        assert field in msg, msg
    return msg


def test_header_length_one_byte_short_is_refused_not_read_off_by_one(tmp_path):
    data = struct.pack("<2f", 1.5, -2.0)
    f = _shard(tmp_path / "model.safetensors", {"w": OK}, data, pad=3)
    assert Checkpoint.open(f).read("w").tolist() == [1.5, -2.0]
    _shard(f, {"w": OK}, data, pad=3, delta=-1)  # "}  " -> "} ": still a JSON object
    assert "header describes a file of 72 bytes, but it has 73" in _refused(f, "data_offsets")
    with pytest.raises(CheckpointError, match="data_offsets"):  # the first use, not only validate
        Checkpoint.open(tmp_path).read("w")
    _shard(f, {"w": OK}, data, pad=3, delta=+1)  # the data region starts one byte late
    _refused(f)


@pytest.mark.parametrize(
    ("header", "data", "fields"),
    [
        ({"w": OK, "v": {**OK, "data_offsets": [12, 20]}}, 20, ["data_offsets", "8-12", "v"]),
        ({"w": OK}, 12, ["data_offsets", "describes a file of"]),  # bytes after the last tensor
        (
            {"w": OK, "v": {"dtype": "F32", "shape": [2.0], "data_offsets": [8, 16]}},
            16,
            ["tensor v", "shape"],
        ),  # (F32, (2,)) was validated already: 2.0 == 2 in a cache key
        ({"w": {**OK, "shape": [True, 2]}}, 8, ["tensor w", "shape"]),
        ({"w": {**OK, "data_offsets": [0, 8.0]}}, 8, ["tensor w", "data_offsets"]),
        ({"w": {**OK, "data_offsets": [False, 8]}}, 8, ["tensor w", "data_offsets"]),
        ({"w": {**OK, "data_offsets": [0, 8, 8]}}, 8, ["tensor w", "data_offsets"]),
        ({"w": {**OK, "data_offsets": "0-8"}}, 8, ["tensor w", "data_offsets"]),
        ({"w": {**OK, "dtype": ["F32"]}}, 8, ["tensor w", "dtype"]),
        ({"w": {**OK, "shape": 2}}, 8, ["tensor w", "shape"]),
        ({"w": 5}, 8, ["tensor w", "malformed header entry"]),
        ({"w": {"dtype": "F32", "shape": [2]}}, 8, ["tensor w", "data_offsets"]),
        ({"__metadata__": {"format": 1}, "w": OK}, 8, ["__metadata__"]),
        ({"__metadata__": [], "w": OK}, 8, ["__metadata__"]),
    ],
)
@pytest.mark.parametrize("layout", ["file", "dir"])
def test_bad_entries_are_refused_naming_file_and_field(tmp_path, header, data, fields, layout):
    f = _shard(tmp_path / "model.safetensors", header, b"\0" * data)
    _refused(f if layout == "file" else tmp_path, *fields)


def test_deeply_nested_json_is_bad_input_not_an_internal_error(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    f = tmp_path / "model.safetensors"
    f.write_bytes(struct.pack("<Q", len(deep) + 8) + b'{"w":' + deep + b"}  ")
    _refused(f, "nested too deeply")
    save_file({"a": torch.ones(2)}, str(f))
    (tmp_path / "config.json").write_bytes(b'{"a":' + deep + b"}")
    _refused(tmp_path, "config.json", "nested too deeply")
    (tmp_path / "config.json").write_text("{}")
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(b'{"metadata":' + deep + b',"weight_map":{"a":"model.safetensors"}}')
    _refused(tmp_path, "index", "nested too deeply")


def test_header_and_json_sizes_are_capped(tmp_path):
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as out:  # sparse: a 101 MB header the file really has room for
        out.write(struct.pack("<Q", 101_000_000) + b"{")
        out.truncate(8 + 101_000_000)
    _refused(f, "header length 101000000 exceeds the limit")
    save_file({"a": torch.ones(2)}, str(f))
    with open(tmp_path / "config.json", "wb") as out:
        out.write(b"{")
        out.truncate(17 << 20)
    _refused(tmp_path, "config.json", "exceeds the limit")


def _indexed(root: Path) -> Path:
    root.mkdir(exist_ok=True)
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(root / "s1.safetensors"))
    save_file({"c": torch.arange(4)}, str(root / "s2.safetensors"))
    return root


def _index(root: Path, weight_map: dict) -> None:
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


GOOD = {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}


@pytest.mark.parametrize(
    ("change", "fields"),
    [
        ({"a": "../d/s1.safetensors"}, ["weight_map", "unsafe file name"]),
        ({"a": "{root}/s1.safetensors"}, ["weight_map", "unsafe file name"]),
        ({"a": "sub/s1.safetensors"}, ["weight_map", "unsafe file name"]),
        ({"a": 5}, ["weight_map", "unsafe file name"]),
        ({"a": "config.json"}, ["weight_map", "unsafe file name"]),
        ({"c": "s3.safetensors"}, ["weight_map", "shard s3.safetensors is missing"]),
        ({"a": "s2.safetensors"}, ["index places tensor a in s2.safetensors"]),
        ({"b": None}, ["tensor b in s1.safetensors is not listed"]),
    ],
)
def test_index_is_validated_at_open(tmp_path, change, fields):
    root = _indexed(tmp_path / "ck")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "s1.safetensors").write_bytes((root / "s1.safetensors").read_bytes())
    (root / "sub").mkdir()
    (root / "sub" / "s1.safetensors").write_bytes((root / "s1.safetensors").read_bytes())
    wm = {
        k: v.format(root=tmp_path / "d") if isinstance(v, str) else v
        for k, v in {**GOOD, **change}.items()
        if v is not None
    }
    _index(root, wm)
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(root)
    msg = str(e.value)
    assert "model.safetensors.index.json" in msg and "\n" not in msg
    assert all(f in msg for f in fields), msg
    _index(root, GOOD)
    with Checkpoint.open(root) as ck:
        assert sorted(ck.tensors) == ["a", "b", "c"]


def test_renamed_and_swapped_shards_are_refused_at_open(tmp_path):
    root = _indexed(tmp_path / "ck")
    _index(root, GOOD)
    os.rename(root / "s2.safetensors", root / "s9.safetensors")  # same tensor count as before
    with pytest.raises(CheckpointError, match="shard s2.safetensors is missing"):
        Checkpoint.open(root)
    os.rename(root / "s9.safetensors", root / "s2.safetensors")
    os.rename(root / "s1.safetensors", root / "tmp.safetensors")
    os.rename(root / "s2.safetensors", root / "s1.safetensors")
    os.rename(root / "tmp.safetensors", root / "s2.safetensors")
    with pytest.raises(CheckpointError, match="index places tensor a in s1.safetensors"):
        Checkpoint.open(root)


def _reap(*args: str) -> subprocess.CompletedProcess:
    """`reap ARGS` in a subprocess that cannot hang the suite (the bug this guards against)."""
    env = {**os.environ, "PYTHONPATH": str(Path(reap.__file__).resolve().parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "reap.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_or_directory_in_place_of_a_file_is_refused_without_hanging(tmp_path):
    root = _indexed(tmp_path / "ck")
    _index(root, GOOD)
    os.remove(root / "s2.safetensors")
    os.mkfifo(root / "s2.safetensors")  # opening it for reading would block until a writer
    r = _reap("info", str(root))
    assert r.returncode == EXIT_USAGE, r.stderr
    assert r.stderr.count("\n") == 1 and "s2.safetensors: shard is not a regular file" in r.stderr
    os.remove(root / "s2.safetensors")
    os.mkdir(root / "s2.safetensors")
    _refused(root, "s2.safetensors", "not a regular file")
    os.rmdir(root / "s2.safetensors")
    save_file({"c": torch.arange(4)}, str(root / "s2.safetensors"))
    os.mkfifo(root / "config.json")
    _refused(root, "config.json", "not a regular file")
    os.remove(root / "config.json")
    os.mkfifo(tmp_path / "single.safetensors")
    _refused(tmp_path / "single.safetensors", "not a regular file")


def test_cli_reports_bad_checkpoints_as_exit_2_one_line(tmp_path, capsys):
    root = _indexed(tmp_path / "ck")
    (root / "config.json").write_text("{}")
    _index(root, {**GOOD, "a": "../s1.safetensors"})
    assert main(["info", str(root)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("reap: error: ") and err.count("\n") == 1
    assert "model.safetensors.index.json: weight_map: unsafe file name '../s1" in err


def test_run_refuses_a_header_one_byte_short_instead_of_emitting_zeros(tmp_path, capsys):
    """The audit's case: `reap run` read every tensor one byte off and printed token 0s."""
    from reap.synth import synth

    path = Path(synth("k3-tiny", tmp_path / "k3", seed=0, dtype="float32"))
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    f.write_bytes(struct.pack("<Q", n + 7) + raw[8 : 8 + n] + b" " * 8 + raw[8 + n :])
    code = main(["run", str(path), "--prompt-ids", "1,2,3", "--max-tokens", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and err.count("\n") == 1
    assert f"{f}: data_offsets: the header describes a file of" in err
