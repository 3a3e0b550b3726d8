"""Checkpoint store: our writer and reader against the `safetensors` library and `mlx.core.load`,
read coalescing, crafted corrupt files, resume after a crash, and prefix handling."""

import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reap.checkpoint import BufferReader, Checkpoint, CheckpointWriter, TensorSpec
from reap.checkpoint.files import adjacent_runs
from reap.errors import CheckpointError, ReapError, WriteError

P = "language_model."


def _layout(seed=0):
    """A small mixed-dtype layout: (specs in write order, name -> tensor)."""
    g = torch.Generator().manual_seed(seed)
    data = {
        "model.embed_tokens.weight": torch.randn(11, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.A_log": torch.randn(4, generator=g),
        "model.layers.0.experts.0.w1.weight_packed": torch.randint(
            0, 256, (6, 16), dtype=torch.uint8, generator=g
        ),
        "model.layers.0.count": torch.tensor(7, dtype=torch.int64),
        "model.layers.0.empty": torch.zeros(0, 5),
        "model.layers.0.idx": torch.randint(-99, 99, (3, 2), generator=g),
        "model.layers.0.half": torch.randn(5, generator=g).half(),
        "model.layers.0.mask": torch.tensor([True, False, True]),
        "model.layers.0.i32": torch.arange(-3, 4, dtype=torch.int32),
        "vision_tower.patch.weight": torch.randn(2, 3, generator=g).to(torch.bfloat16),
    }
    codes = {
        torch.bfloat16: "BF16",
        torch.float32: "F32",
        torch.uint8: "U8",
        torch.int64: "I64",
        torch.float16: "F16",
        torch.bool: "BOOL",
        torch.int32: "I32",
    }
    specs = [
        TensorSpec(
            n, codes[t.dtype], tuple(t.shape), "vision" if n.startswith("vision") else "other"
        )
        for n, t in data.items()
    ]
    return specs, data


def _write(out, specs, data, **kw):
    w = CheckpointWriter(out, specs, **kw)
    for s in specs:
        w.write(s.name, data[s.name])
    return w.close({"model_type": "toy", "hidden_size": 8}, {"tokenizer.json": '{"v": 1}'})


@pytest.mark.parametrize("prefix", ["", P])
def test_round_trip_against_safetensors_and_our_reader(tmp_path, prefix):
    specs, data = _layout()
    out = _write(tmp_path / "ck", specs, data, max_shard_bytes=200, prefix=prefix)
    index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in data.values()
    )
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    seen = {}
    for key, shard in index["weight_map"].items():
        with safe_open(os.path.join(out, shard), "pt") as f:
            seen[key] = f.get_tensor(key)
    assert set(seen) == {(n if n.startswith("vision") else prefix + n) for n in data}
    naive = {}  # an independent parse: json.loads of every header, offsets made absolute
    for f in sorted(set(index["weight_map"].values())):
        raw = Path(out, f).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        for key, e in json.loads(raw[8 : 8 + n]).items():
            if key != "__metadata__":
                b, end = e["data_offsets"]
                naive[key.removeprefix(P)] = (
                    key,
                    e["dtype"],
                    tuple(e["shape"]),
                    8 + n + b,
                    8 + n + end,
                )
    with Checkpoint.open(out) as ck:
        assert all(sh.infos is None for sh in ck._shards)  # the fast scan, nothing parsed yet
        got = {t.name: (t.key, t.dtype, t.shape, t.start, t.end) for t in ck.tensors.values()}
        assert got == naive
        assert ck.prefix == prefix and ck.config["model_type"] == "toy"
        assert set(ck.tensors) == set(data)
        for name, t in data.items():
            key = ck.tensors[name].key
            assert torch.equal(seen[key], t) and torch.equal(ck.read(name), t)
            assert ck.read(name).dtype == t.dtype and ck.tensors[name].shape == tuple(t.shape)
            assert ck.read_raw(name) == seen[key].reshape(-1).view(torch.uint8).numpy().tobytes()
    assert (tmp_path / "ck" / "tokenizer.json").read_text() == '{"v": 1}'
    assert not (tmp_path / "ck.partial").exists()


def test_mlx_loads_written_shards(tmp_path):
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    specs, data = _layout()
    keep = [s for s in specs if s.dtype in ("BF16", "F32", "U8", "I64", "F16", "I32")]
    out = _write(tmp_path / "ck", keep, data, max_shard_bytes=100, prefix=P)
    loaded = {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            loaded.update(mx.load(os.path.join(out, f)))
    for s in keep:
        key = s.name if s.component == "vision" else P + s.name
        arr = loaded[key]
        assert tuple(arr.shape) == s.shape
        ours = data[s.name].float() if s.dtype == "BF16" else data[s.name]
        theirs = np.array(arr.astype(mx.float32) if s.dtype == "BF16" else arr)
        assert np.array_equal(theirs, ours.numpy())


def test_sharding_is_greedy_by_size_and_deterministic(tmp_path):
    specs = [TensorSpec(f"t{i}", "U8", (n,)) for i, n in enumerate([40, 50, 20, 100, 5, 5])]
    data = {s.name: torch.full(s.shape, i, dtype=torch.uint8) for i, s in enumerate(specs)}
    a = _write(tmp_path / "a", specs, data, max_shard_bytes=60)
    b = _write(tmp_path / "b", specs, data, max_shard_bytes=60)
    index = json.loads(Path(a, "model.safetensors.index.json").read_text())
    # 40 | 50 (40+50 > 60) | 20 (50+20 > 60) | 100 alone (over the limit) | 5 + 5
    names = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert index["weight_map"] == dict(zip([f"t{i}" for i in range(6)], names + names[-1:]))
    for f in names + ["model.safetensors.index.json", "config.json"]:
        assert Path(a, f).read_bytes() == Path(b, f).read_bytes()
    single = _write(tmp_path / "c", specs, data)
    assert sorted(os.listdir(single)) == [
        "config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]


def test_names_are_unique_and_never_prefixed(tmp_path):
    save_file({P + "a": torch.ones(1), "vision.b": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    with Checkpoint.open(tmp_path / "x.safetensors") as ck:
        assert sorted(ck.tensors) == ["a", "vision.b"]
        assert ck.tensors["a"].file.endswith("x.safetensors")
        assert P + "a" not in ck.tensors and "b" not in ck.tensors
        with pytest.raises(CheckpointError, match="no tensor language_model.a"):
            ck.read(P + "a")
    save_file({P + "a": torch.ones(1), "a": torch.ones(2)}, str(tmp_path / "y.safetensors"))
    with pytest.raises(CheckpointError, match="y.safetensors: tensor name a is stored twice"):
        Checkpoint.open(tmp_path / "y.safetensors")
    save_file({"a": torch.ones(1)}, str(tmp_path / "s1.safetensors"))
    save_file({"a": torch.ones(1)}, str(tmp_path / "s2.safetensors"))
    wm = {"a": "s1.safetensors", "b": "s2.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="tensor name a is stored twice"):
        Checkpoint.open(tmp_path)


def test_reads_hf_layouts_written_by_safetensors(tmp_path):
    big = {f"{P}model.layers.{i}.w": torch.full((2,), float(i)) for i in range(1500)}
    save_file(big, str(tmp_path / "single.safetensors"))  # header > 64 KiB: second read path
    with Checkpoint.open(tmp_path / "single.safetensors") as ck:
        assert ck.config == {} and ck.prefix == P and len(ck.tensors) == 1500
        assert torch.equal(ck.read("model.layers.1234.w"), torch.full((2,), 1234.0))
    d = tmp_path / "hf"
    d.mkdir()
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(d / "x-1.safetensors"))
    save_file({"c": torch.arange(4)}, str(d / "x-2.safetensors"))
    wm = {"a": "x-1.safetensors", "b": "x-1.safetensors", "c": "x-2.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    with Checkpoint.open(d) as ck:
        assert ck.prefix == "" and torch.equal(ck.read("c"), torch.arange(4))
        assert ck.tensors["c"].file == str(d / "x-2.safetensors")


def test_read_many_coalesces_adjacent_ranges(tmp_path):
    parts = [
        "w1.weight_packed",
        "w1.weight_scale",
        "w2.weight_packed",
        "w2.weight_scale",
        "w3.weight_packed",
        "w3.weight_scale",
    ]
    specs, data = [], {}
    for e in (5, 2):  # experts stored out of id order, each contiguous
        for j, part in enumerate(parts):
            name = f"model.layers.1.block_sparse_moe.experts.{e}.{part}"
            specs.append(TensorSpec(name, "U8", (3, 8 + j)))
            data[name] = torch.randint(0, 256, (3, 8 + j), dtype=torch.uint8)
    out = _write(tmp_path / "ck", specs, data)
    with Checkpoint.open(out) as ck:
        expert2 = [f"model.layers.1.block_sparse_moe.experts.2.{p}" for p in reversed(parts)]
        got = ck.read_many(expert2)
        assert ck.reads == 1 and ck.bytes_read == sum(data[n].numel() for n in expert2)
        assert list(got) == expert2 and all(torch.equal(got[n], data[n]) for n in expert2)
        # w1 of expert 5 and w1 of expert 2 are not adjacent: two reads
        ck.read_many([specs[0].name, specs[6].name, specs[1].name])
        assert ck.reads == 3


def test_buffered_reads_put_every_tensor_on_a_cache_line(tmp_path, monkeypatch):
    """safetensors packs tensors at any byte offset; a buffered read_into places each one on a
    64-byte boundary of the buffer with one scattered read per run, contents as `safetensors`
    reads them, also through short reads and with more tensors than one preadv call takes."""
    g = torch.Generator().manual_seed(0)
    data = {f"t.{i:04d}": torch.randn(1 + i % 7, generator=g) for i in range(700)}
    data["w"] = torch.randn(5, 33, generator=g).to(torch.bfloat16)
    save_file(data, str(tmp_path / "m.safetensors"))
    ck = Checkpoint.open(tmp_path / "m.safetensors")
    reader = BufferReader(ck)
    infos = sorted((reader.info(n) for n in data), key=lambda t: t.start)
    assert len(adjacent_runs(infos)) == 1 and len({t.start % 64 for t in infos}) > 1
    real = os.preadv

    def short(fd, bufs, offset):  # at most 100 bytes a call, cut anywhere in a buffer
        room, cut = 100, []
        for b in bufs:
            cut.append(b[: max(room, 0)])
            room -= len(cut[-1])
        return real(fd, [c for c in cut if len(c)], offset)

    monkeypatch.setattr(os, "preadv", short)
    buf = torch.empty(reader.span(infos) + 3, dtype=torch.uint8)[3:]  # not aligned itself
    got = reader.read_into(infos, buf)
    assert reader.io.reads == 1
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        for n in data:
            assert got[n].data_ptr() % 64 == 0, n
            assert torch.equal(got[n], f.get_tensor(n)), n
    with pytest.raises(CheckpointError, match="read buffer too small"):
        reader.read_into(infos, buf[: reader.span(infos) - 64])


def test_direct_reads_match_buffered(tmp_path):
    specs, data = _layout()
    out = _write(tmp_path / "ck", specs, data, max_shard_bytes=200)
    with Checkpoint.open(out, direct=True) as ck:
        for name, t in data.items():
            assert torch.equal(ck.read(name), t)
        got = ck.read_many(list(data))
        assert all(torch.equal(got[n], data[n]) for n in data)
        if ck.direct:  # O_DIRECT worked here: whole aligned blocks were read
            assert ck.bytes_read % 4096 == 0 or ck.bytes_read > sum(
                t.nbytes for t in ck.tensors.values()
            )


def test_direct_falls_back_when_unsupported(tmp_path, monkeypatch):
    specs, data = _layout()
    out = _write(tmp_path / "ck", specs, data)

    opened = os.open

    def refuse(path, flags, *args):  # a file system that refuses O_DIRECT
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return opened(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    with Checkpoint.open(out, direct=True) as ck:
        assert torch.equal(ck.read("model.layers.0.A_log"), data["model.layers.0.A_log"])
        assert ck.direct is False


def test_fingerprint_tracks_layout_and_config_not_data(tmp_path):
    specs, data = _layout(0)
    _, other = _layout(1)
    fps = []
    for i, d in enumerate([data, other]):
        with Checkpoint.open(_write(tmp_path / f"ck{i}", specs, d)) as ck:
            fps.append(ck.fingerprint())
            assert fps[-1] == ck.fingerprint() and len(fps[-1]) == 64
    assert fps[0] == fps[1]
    with Checkpoint.open(tmp_path / "ck0") as ck:
        ck.config["hidden_size"] = 9
        assert ck.fingerprint() != fps[0]
    specs2 = [s if s.dtype != "I32" else TensorSpec(s.name, "I32", (1, 7)) for s in specs]
    data["model.layers.0.i32"] = data["model.layers.0.i32"].reshape(1, 7)
    with Checkpoint.open(_write(tmp_path / "ck2", specs2, data)) as ck:
        assert ck.fingerprint() != fps[0]


# ---- crafted corrupt files -------------------------------------------------------------------


SEPARATORS = (",", ":")  # the canonical form of every writer; (", ", ": ") takes the json path


def _raw_shard(path, header, data=b"", length=None):
    text = json.dumps(header, separators=SEPARATORS).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def _err(path):
    """The error of opening and fully validating `path`."""
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(path).validate()
    return str(e.value)


@pytest.mark.parametrize("separators", [(",", ":"), (", ", ": ")])
def test_corrupt_shards_are_named(tmp_path, monkeypatch, separators):
    monkeypatch.setattr(sys.modules[__name__], "SEPARATORS", separators)
    f = tmp_path / "t.safetensors"
    f.write_bytes(b"\x05\x00")
    assert "t.safetensors: truncated safetensors header" in _err(f)
    _raw_shard(f, {}, length=10**6)
    assert "header length 1000000 beyond file size" in _err(f)
    f.write_bytes(struct.pack("<Q", 5) + b"{abc}")
    assert "t.safetensors: invalid safetensors JSON" in _err(f)
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _raw_shard(f, {"w": {**ok, "data_offsets": [0, 16]}}, b"\0" * 16)
    assert "tensor w: 16 bytes do not hold F32 [2]" in _err(f)
    _raw_shard(f, {"w": {**ok, "data_offsets": [8, 16]}}, b"\0" * 8)
    assert "t.safetensors: tensor w: offsets [8, 16] outside" in _err(f)
    _raw_shard(f, {"w": {**ok, "dtype": "Q4"}}, b"\0" * 8)
    assert "tensor w: unknown dtype 'Q4'" in _err(f)
    _raw_shard(f, {"w": ok, "v": {**ok, "data_offsets": [4, 12]}}, b"\0" * 12)
    assert "tensors w and v overlap" in _err(f)
    _raw_shard(f, {"w": {"dtype": "F32"}}, b"\0" * 8)
    assert "tensor w: malformed header entry" in _err(f)
    assert str(f) in _err(f)


def test_entry_errors_surface_at_first_use_of_the_shard(tmp_path):
    ok = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    _raw_shard(tmp_path / "model.safetensors", {"w": {**ok, "dtype": "Q4"}}, b"\0" * 8)
    ck = Checkpoint.open(tmp_path)  # framing and names are fine
    assert "w" in ck.tensors and len(ck.tensors) == 1
    with pytest.raises(CheckpointError, match="model.safetensors: tensor w: unknown dtype"):
        ck.read("w")


def test_non_canonical_headers_parse_like_canonical(tmp_path):
    entries = {
        "b.x": {"shape": [2], "dtype": "F32", "data_offsets": [0, 8]},  # other key order
        'q"uote': {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]},  # escaped quote
    }
    text = json.dumps(entries, indent=1).encode()
    (tmp_path / "model.safetensors").write_bytes(
        struct.pack("<Q", len(text)) + text + struct.pack("<2f", 1.5, -2.0) + b"abc"
    )
    with Checkpoint.open(tmp_path) as ck:
        assert list(ck.tensors) == ["b.x", 'q"uote']
        assert ck.read("b.x").tolist() == [1.5, -2.0] and ck.read_raw('q"uote') == b"abc"


def test_index_errors_are_named(tmp_path):
    assert "no such checkpoint" in _err(tmp_path / "nothing")
    assert "neither model.safetensors.index.json nor model.safetensors" in _err(tmp_path)
    save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    assert "shard s2.safetensors is missing" in _err(tmp_path)
    save_file({"c": torch.ones(2)}, str(tmp_path / "s2.safetensors"))
    assert "index places tensor b in s2.safetensors, but that shard lacks it" in _err(tmp_path)
    with pytest.raises(CheckpointError, match="index places tensor b in s2.safetensors"):
        Checkpoint.open(tmp_path)  # same entry count (a, c vs a, b): the index is checked at open
    wm = {"a": "s1.safetensors", "c": "s2.safetensors", "d": "s2.safetensors"}
    index.write_text(json.dumps({"weight_map": wm}))
    with pytest.raises(CheckpointError, match="places tensor d in s2.safetensors, but that"):
        Checkpoint.open(tmp_path)  # entry count differs: found at open
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors"}}))
    assert "places tensor b in s1.safetensors" in _err(tmp_path)  # open: counts agree (a, c)
    (tmp_path / "s3.safetensors").write_bytes(b"junk")  # stray file: the exact path ignores it
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "c": "s2.safetensors"}}))
    with Checkpoint.open(tmp_path) as ck:
        ck.validate()
        assert sorted(ck.tensors) == ["a", "c"] and len(ck.files) == 2
    index.write_text(json.dumps({"weight_map": {"a": "s2.safetensors", "c": "s2.safetensors"}}))
    assert "index places tensor a in s2.safetensors" in _err(tmp_path)
    index.write_text("[1]")
    assert "index is not a JSON object" in _err(tmp_path)
    (tmp_path / "config.json").write_text("{")
    assert "config.json: invalid JSON" in _err(tmp_path)


def test_read_errors_are_named(tmp_path):
    save_file({"a": torch.ones(1000)}, str(tmp_path / "model.safetensors"))
    with Checkpoint.open(tmp_path) as ck:
        with pytest.raises(CheckpointError, match="no tensor zz"):
            ck.read("zz")
        assert ck.tensors["a"].nbytes == 4000  # parses the shard
        os.truncate(tmp_path / "model.safetensors", 500)  # shrinks after opening
        with pytest.raises(
            CheckpointError, match="model.safetensors: truncated while reading tensor a"
        ):
            ck.read("a")
    with Checkpoint.open(tmp_path) as ck:
        os.truncate(tmp_path / "model.safetensors", 200)  # changed before its first use
        with pytest.raises(CheckpointError, match="model.safetensors: shard changed since"):
            ck.read("a")


# ---- writer: resume, refusal, misuse ---------------------------------------------------------


def test_resume_after_crash_keeps_completed_shards(tmp_path):
    specs, data = _layout()
    clean = _write(tmp_path / "clean", specs, data, max_shard_bytes=200, prefix=P)
    out = tmp_path / "ck"
    w = CheckpointWriter(out, specs, max_shard_bytes=200, prefix=P)
    first = w.shards[0]
    for s in specs[: len(first.names) + 1]:  # shard 1 complete, shard 2 started
        w.write(s.name, data[s.name])
    del w  # the job dies: no close()
    done_file = tmp_path / "ck.partial" / first.file
    inode = os.stat(done_file).st_ino
    w = CheckpointWriter(out, specs, max_shard_bytes=200, prefix=P)
    assert [w.done(s.name) for s in specs] == [s.name in first.names for s in specs]
    written = [s.name for s in specs if not w.done(s.name)]
    for name in written:
        w.write(name, data[name])
    w.close({"model_type": "toy", "hidden_size": 8}, {"tokenizer.json": '{"v": 1}'})
    assert len(written) == len(specs) - len(first.names)
    assert os.stat(out / first.file).st_ino == inode  # kept, not rewritten
    for f in os.listdir(clean):
        assert (out / f).read_bytes() == Path(clean, f).read_bytes()


def test_stale_partial_of_other_layout_is_discarded(tmp_path):
    specs, data = _layout()
    w = CheckpointWriter(tmp_path / "ck", specs, max_shard_bytes=200)
    w.write(specs[0].name, data[specs[0].name])
    del w
    w = CheckpointWriter(tmp_path / "ck", specs, max_shard_bytes=10**6)  # new plan
    assert not any(w.done(s.name) for s in specs)
    assert sorted(os.listdir(tmp_path / "ck.partial")) == [".reap-plan"]


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    specs, data = _layout()
    _write(tmp_path / "ck", specs, data)
    with pytest.raises(ReapError, match="already exists"):
        CheckpointWriter(tmp_path / "ck", specs)
    data["model.layers.0.count"] = torch.tensor(8)
    _write(tmp_path / "ck", specs, data, overwrite=True)
    with Checkpoint.open(tmp_path / "ck") as ck:
        assert ck.read("model.layers.0.count").item() == 8
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    (tmp_path / "x.partial").mkdir()
    (tmp_path / "x.partial" / "notes.txt").write_text("mine")
    with pytest.raises(WriteError, match="not made by this writer"):
        CheckpointWriter(tmp_path / "x", specs)


def test_raw_bytes_are_copied_verbatim(tmp_path):
    specs, data = _layout()
    src = _write(tmp_path / "src", specs, data, prefix=P)
    with Checkpoint.open(src) as ck:
        w = CheckpointWriter(tmp_path / "dst", specs, prefix=P)
        for s in specs:
            w.write(s.name, ck.read_raw(s.name))
        w.close({"model_type": "toy", "hidden_size": 8}, {"tokenizer.json": '{"v": 1}'})
    for f in os.listdir(src):
        assert (tmp_path / "dst" / f).read_bytes() == Path(src, f).read_bytes()


def test_writer_misuse_raises(tmp_path):
    specs, data = _layout()
    w = CheckpointWriter(tmp_path / "ck", specs)
    with pytest.raises(ReapError, match=f"expected tensor {specs[0].name}, got {specs[1].name}"):
        w.write(specs[1].name, data[specs[1].name])
    with pytest.raises(WriteError, match=f"tensor {specs[0].name}: got torch.float32"):
        w.write(specs[0].name, data[specs[0].name].float())
    with pytest.raises(WriteError, match="got 3 bytes, declared 176"):
        w.write(specs[0].name, b"abc")
    with pytest.raises(ReapError, match="tensor nope was not declared"):
        w.done("nope")
    with pytest.raises(WriteError, match="declared tensors not written"):
        w.close({})
    with pytest.raises(ReapError, match="declared twice"):
        CheckpointWriter(tmp_path / "dup", specs + specs[:1])
