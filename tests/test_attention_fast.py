"""Decode fast paths of `reap.models.attention` against their references: RoPE from the grown
cos/sin table == RoPE computed per call (bit for bit), and the preallocated KV / MLA caches
(written in place, grown in 256-position steps) == the concatenation of everything appended."""

import itertools

import pytest
import torch

from reap.models.attention import KVCache, MLACache, Rope, gqa_attention


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_table_equals_per_call_rope(interleaved):
    torch.manual_seed(0)
    rope = Rope.create(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 64})  # fmt: skip
    for start, T in [(0, 5), (5, 1), (255, 3), (300, 1), (7, 600)]:
        x = torch.randn(2, T, 3, 20)  # 16 rotated dims, 4 passed through
        want = rope.apply_reference(x, start, interleaved)
        assert torch.equal(rope.apply(x, start, interleaved), want)


def test_kv_cache_grows_in_place_and_matches_whole_attention():
    torch.manual_seed(1)
    B, S, H, Hkv, D = 1, 300, 4, 2, 8  # crosses a 256-position growth
    q, k, v = torch.randn(B, S, H, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, 6)
    whole = gqa_attention(q, k, v, None, 0.3)
    cache, parts, cuts = KVCache(), [], [0, 7, *range(8, S + 1)]
    buffers = set()
    for lo, hi in itertools.pairwise(cuts):
        parts.append(gqa_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], cache, 0.3))
        buffers.add(cache._k.data_ptr())
    assert cache.length == S and len(buffers) == 2  # one buffer per 256 positions, not per token
    assert torch.equal(cache.k, k.transpose(1, 2)) and torch.equal(cache.v, v.transpose(1, 2))
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-5, rtol=1e-5)


def test_mla_cache_append_equals_concatenation():
    torch.manual_seed(2)
    c, pe = torch.randn(2, 270, 12), torch.randn(2, 270, 4)
    cache = MLACache()
    for lo, hi in [(0, 200), (200, 201), (201, 270)]:
        got_c, got_pe = cache.append(c[:, lo:hi], pe[:, lo:hi])
        assert torch.equal(got_c, c[:, :hi]) and torch.equal(got_pe, pe[:, :hi])
    assert cache.length == 270 and cache._c.shape[1] == 512
