"""The routed-expert cache on a sharded checkpoint whose experts straddle shard boundaries: every
expert gets a slot (read once, then hits), and the engine's output does not depend on the
sharding (transformers' save_pretrained with a small max_shard_size as the sharded source, a
single-file copy of the same tensors as the reference)."""

import functools
import json
from pathlib import Path

import family_runner as R
import pytest
import torch
from safetensors.torch import load_file, save_file

from reap.checkpoint import BufferReader, Checkpoint
from reap.engine import Engine
from reap.engine.experts import ExpertCache
from reap.models import family
from reap.models.base import expert_short_names

QWEN = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}  # fmt: skip


SPLIT = "model.layers.1.mlp.experts.3.up_proj.weight"  # moved to a second shard


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """(two-shard checkpoint where expert 3 of layer 1 has one tensor in each shard, the same
    tensors in one file): every other expert is one contiguous run of bytes."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("shards")
    path, _ = R.save_hf_tiny(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN, root / "hf", seed=4,
        config_extra={"num_experts": 8, "rope_theta": 10000.0},
    )  # fmt: skip
    tensors = load_file(Path(path) / "model.safetensors")
    one, two = root / "one", root / "two"
    for d in (one, two):
        d.mkdir()
        for f in Path(path).iterdir():
            if f.suffix != ".safetensors":
                (d / f.name).write_bytes(f.read_bytes())
    save_file(tensors, one / "model.safetensors", metadata={"format": "pt"})
    rest = {n: t for n, t in tensors.items() if n != SPLIT}
    save_file(rest, two / "a.safetensors", metadata={"format": "pt"})
    save_file({SPLIT: tensors[SPLIT]}, two / "b.safetensors", metadata={"format": "pt"})
    wmap = {n: "b.safetensors" if n == SPLIT else "a.safetensors" for n in tensors}
    index = {"metadata": {}, "weight_map": wmap}
    (two / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(two), str(one)


def _names(path):
    ck = Checkpoint.open(path)
    fam = family(ck.config)
    return ck, functools.partial(fam.expert_tensor_names, fam.Config.from_dict(ck.config))


KEYS = [(lay, e) for lay in range(3) for e in range(8)]  # every (layer, expert)


def _split_experts(ck, names) -> list[tuple[int, int]]:
    keys = KEYS
    return [k for k in keys if len({ck.tensors[n].file for n in names(*k)}) > 1]


def test_an_expert_split_across_shards_is_cached_like_the_others(sharded):
    path, _ = sharded
    ck, names = _names(path)
    split = _split_experts(ck, names)
    assert split == [(1, 3)], "the fixture must split one expert across two shards"
    keys = KEYS
    raw = max(sum(ck.tensors[n].nbytes for n in names(*k)) for k in keys)
    reader = BufferReader(ck)
    cache = ExpertCache(reader, len(keys) * raw, names)
    cache.reserve(keys)
    for rep in range(3):
        for k in keys:
            t = cache.get(*k)
            for short, full in zip(expert_short_names(names(*k)), names(*k)):
                assert torch.equal(t[short], ck.read(full))
        cache.release()
        if rep == 0:
            # one positioned read per expert, two for the expert stored in two files
            assert reader.io.reads == len(keys) + 1
    assert reader.io.reads == len(keys) + 1  # nothing read twice
    assert cache.misses == len(keys) and cache.hits == 2 * len(keys)


def test_engine_at_max_reads_each_expert_once_and_matches_a_single_file_copy(sharded):
    path, single = sharded
    prompt = [3, 100, 7, 200, 55, 9, 1, 250]
    out = {}
    for p in (path, single):
        with Engine.open(p, preset="max", context=64) as eng:
            toks = eng.generate([prompt], max_tokens=12)[0].ids
            c = eng.counters()
            assert c["expert_misses"] <= 3 * 8  # never a re-read: at most one per expert
            assert c["expert_hits"] + c["expert_misses"] > 3 * 8
            out[p] = toks
    assert out[path] == out[single]


def test_resident_weights_start_on_cache_lines(sharded):
    """The checkpoint's tensors sit at any byte offset of their files; the engine's pinned
    trunk and cached experts start on 64-byte boundaries (whole cache lines per row for the
    matrix-vector products)."""
    path, _ = sharded
    assert any(t.start % 64 for t in Checkpoint.open(path).tensors.values())
    with Engine.open(path, preset="max", context=64) as eng:
        eng.generate([[3, 100, 7]], max_tokens=2)
        tensors = [t for unit in eng.trunk.pinned.values() for t in unit.values()]
        tensors += [t for e in eng.experts.tensors.values() for t in e.values()]
        assert len(tensors) > 3 * 8 * 3 and all(t.data_ptr() % 64 == 0 for t in tensors)
