"""Fused-tensor views `X[e]` in the checkpoint reader: byte ranges and shapes equal numpy slicing
of the file (plain and `language_model.`-prefixed), reads equal the stored slice, membership,
iteration over stored names only, coalesced reads of adjacent slices, and clear errors."""

import json
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from reap.checkpoint import Checkpoint, split_view, view_name
from reap.errors import CheckpointError

FUSED = "model.layers.0.mlp.experts.down_proj"


def _write(path, prefix=""):
    g = torch.Generator().manual_seed(0)
    data = {
        FUSED: torch.randn(5, 3, 4, generator=g),
        "model.layers.0.mlp.experts.down_proj_bias": torch.randn(5, 4, generator=g).bfloat16(),
        "model.layers.0.mlp.experts.gate_up_proj_blocks": torch.randint(
            0, 256, (5, 6, 2, 16), dtype=torch.uint8, generator=g
        ),
        "model.norm.weight": torch.randn(4, generator=g),
    }
    save_file({prefix + k: v for k, v in data.items()}, str(path))
    return data


def _numpy_slice(path, key, index):
    """The bytes and shape of slice `index` of tensor `key`, from the raw file with numpy."""
    raw = np.fromfile(path, dtype=np.uint8)
    n = struct.unpack("<Q", raw[:8].tobytes())[0]
    entry = json.loads(raw[8 : 8 + n].tobytes())[key]
    a, b = entry["data_offsets"]
    whole = raw[8 + n + a : 8 + n + b].reshape(entry["shape"][0], -1)  # [E, bytes per slice]
    return whole[index].tobytes(), tuple(entry["shape"][1:]), 8 + n + a


@pytest.mark.parametrize("prefix", ["", "language_model."])
def test_view_info_and_bytes_equal_numpy_slicing(tmp_path, prefix):
    path = tmp_path / "m.safetensors"
    data = _write(path, prefix)
    with Checkpoint.open(path) as ck:
        for base, t in data.items():
            if t.dim() < 2:
                continue
            for e in range(t.shape[0]):
                info = ck.tensors[view_name(base, e)]
                want, shape, start = _numpy_slice(path, prefix + base, e)
                row = len(want)
                assert (info.name, info.key) == (f"{base}[{e}]", f"{prefix}{base}[{e}]")
                assert info.shape == shape and info.dtype == ck.tensors[base].dtype
                assert (info.start, info.end) == (start + e * row, start + (e + 1) * row)
                assert ck.read_raw(view_name(base, e)) == want
                assert torch.equal(ck.read(view_name(base, e)), t[e])


def test_membership_iteration_and_coalesced_reads(tmp_path):
    path = tmp_path / "m.safetensors"
    data = _write(path)
    with Checkpoint.open(path) as ck:
        assert sorted(ck.tensors) == sorted(data) and len(ck.tensors) == len(data)
        assert f"{FUSED}[4]" in ck.tensors and f"{FUSED}[5]" not in ck.tensors
        assert "nothing[0]" not in ck.tensors and f"{FUSED}[x]" not in ck.tensors
        assert ck.tensors.get(f"{FUSED}[9]") is None
        reads = ck.reads
        got = ck.read_many([f"{FUSED}[{e}]" for e in (3, 1, 2)])  # adjacent slices
        assert ck.reads == reads + 1 and list(got) == [f"{FUSED}[{e}]" for e in (3, 1, 2)]
        for e in (1, 2, 3):
            assert torch.equal(got[f"{FUSED}[{e}]"], data[FUSED][e])
        # the stored tensor is still read whole, and its fingerprint ignores views
        assert torch.equal(ck.read(FUSED), data[FUSED])


def test_bad_index_is_a_clear_error(tmp_path):
    path = tmp_path / "m.safetensors"
    _write(path)
    with Checkpoint.open(path) as ck:
        with pytest.raises(CheckpointError, match=r"index 5 is out of range .* shape \[5, 3, 4\]"):
            ck.read(f"{FUSED}[5]")
        with pytest.raises(CheckpointError, match=r"no tensor missing\[0\]$"):
            ck.read("missing[0]")


def test_view_names_round_trip():
    assert split_view(view_name("a.b", 12)) == ("a.b", 12)
    assert split_view("a.b") == ("a.b", None)
    assert split_view("a[1].b") == ("a[1].b", None)


def test_expert_short_names_drop_the_prefix_and_the_view_index():
    from reap.models.base import expert_short_names

    k3 = [f"model.layers.3.block_sparse_moe.experts.7.w{i}.weight_packed" for i in (1, 2)]
    assert expert_short_names(k3) == ["w1.weight_packed", "w2.weight_packed"]
    fused = [view_name(f"model.layers.3.mlp.experts.{n}", 12) for n in ("down_proj", "down_bias")]
    assert expert_short_names(fused) == ["down_proj", "down_bias"]
    assert expert_short_names([view_name("a.b.gate_up_proj", 0)]) == ["gate_up_proj"]
