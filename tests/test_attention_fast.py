"""Decode fast paths of `reap.models.shared.attention` against their references: RoPE from the grown
cos/sin table == RoPE computed per call (bit for bit), and the preallocated KV / MLA caches
(written in place, grown in 256-position steps) == the concatenation of everything appended."""

import itertools

import pytest
import torch
from references import rope_reference

from reap.models.shared.attention import KVCache, MLACache, Rope, gqa_attention


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_table_equals_per_call_rope(interleaved):
    torch.manual_seed(0)
    rope = Rope.create(16, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 64})  # fmt: skip
    for start, T in [(0, 5), (5, 1), (255, 3), (300, 1), (7, 600)]:
        x = torch.randn(2, T, 3, 20)  # 16 rotated dims, 4 passed through
        want = rope_reference(rope, x, start, interleaved)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_fused_gqa_attention_matches_the_op_by_op_reference(dtype, window):
    """torch's fused attention (no sinks) against `gqa_attention_reference`: a prefill chunk
    of 20 then single tokens over the cache; fp32 within 1e-5, bf16 within a bf16 step (the
    reference rounds its scores and probabilities to bf16, the fused kernel keeps fp32); the
    fused result does not depend on the thread count."""
    from reap.models.shared.attention import gqa_attention_reference

    g = torch.Generator().manual_seed(3)
    B, S, H, Hkv, D = 2, 30, 8, 2, 16
    q, k, v = (torch.randn(B, S, h, D, generator=g).to(dtype) for h in (H, Hkv, Hkv))
    outs = []
    for fn, threads in ((gqa_attention, 1), (gqa_attention_reference, 1), (gqa_attention, 3)):
        cache, parts = KVCache(), []
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        for lo, hi in itertools.pairwise([0, 20, *range(21, S + 1)]):
            parts.append(fn(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], cache, 0.25, window=window))
        torch.set_num_threads(saved)
        outs.append(torch.cat(parts, 1).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[0], outs[1], atol=tol, rtol=tol)
    assert torch.equal(outs[0], outs[2])


def test_mla_cache_append_equals_concatenation():
    torch.manual_seed(2)
    c, pe = torch.randn(2, 270, 12), torch.randn(2, 270, 4)
    cache = MLACache()
    for lo, hi in [(0, 200), (200, 201), (201, 270)]:
        got_c, got_pe = cache.append(c[:, lo:hi], pe[:, lo:hi])
        assert torch.equal(got_c, c[:, :hi]) and torch.equal(got_pe, pe[:, :hi])
    assert cache.length == 270 and cache._c.shape[1] == 512
