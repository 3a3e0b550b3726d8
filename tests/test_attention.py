"""reap.models.shared.attention against independent references: RoPE inverse frequencies and scaling
factors equal transformers' own computation for every supported rope_type, the rotation equals
complex multiplication, and grouped-query attention (cache, sliding window, sinks) equals a
naive per-head softmax loop."""

import math

import pytest
import torch

from reap.errors import ReapError
from reap.models.shared.attention import KVCache, Rope, gqa_attention, rope_settings

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
    {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_parameters_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", "rope_theta": 150000.0, **(scaling or {})}
    cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=2,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters=params,
    )
    theta, sc = rope_settings(cfg.to_dict())
    ours = Rope.create(64, theta, sc)
    if params["rope_type"] == "default":
        inv = 1.0 / (150000.0 ** (torch.arange(0, 64, 2).float() / 64))
        factor = 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours.inv_freq.float(), inv.float(), rtol=1e-5, atol=1e-9)
    assert ours.attention_factor == pytest.approx(factor)


def test_rope_settings_reads_old_style_configs():
    assert rope_settings({"rope_theta": 5e5}) == (5e5, None)
    theta, sc = rope_settings({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2}})
    assert theta == 1e4 and sc["factor"] == 2
    with pytest.raises(ReapError, match="unsupported rope_type"):
        Rope.create(8, 1e4, {"rope_type": "dynamic", "factor": 2})


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_apply_is_complex_rotation(interleaved):
    torch.manual_seed(0)
    rope = Rope.create(8, 100.0)
    x = torch.randn(1, 5, 2, 12)  # 8 rotated dims + 4 passed through
    out = rope.apply(x, start=3, interleaved=interleaved)
    for t in range(5):
        ang = (t + 3) * rope.inv_freq.float()
        if interleaved:
            z = torch.complex(x[0, t, :, 0:8:2], x[0, t, :, 1:8:2])
        else:
            z = torch.complex(x[0, t, :, :4], x[0, t, :, 4:8])
        r = z * torch.polar(torch.ones(4), ang)
        torch.testing.assert_close(out[0, t, :, :8], torch.cat([r.real, r.imag], -1))
    torch.testing.assert_close(out[..., 8:], x[..., 8:])


def naive_attention(q, k, v, scale, sinks=None, window=None):
    """Per batch, head and query: an explicit softmax over the visible keys (and the sink)."""
    B, S, H, _ = q.shape
    group = H // k.shape[2]
    out = torch.zeros(B, S, H, v.shape[-1])
    for b in range(B):
        for h in range(H):
            for t in range(S):
                lo = 0 if window is None else max(0, t - window + 1)
                keys = range(lo, t + 1)
                logits = [float(q[b, t, h] @ k[b, s, h // group]) * scale for s in keys]
                extra = [] if sinks is None else [float(sinks[h])]
                m = max(logits + extra)
                w = [math.exp(x - m) for x in logits]
                z = sum(w) + sum(math.exp(x - m) for x in extra)
                for j, s in enumerate(keys):
                    out[b, t, h] += w[j] / z * v[b, s, h // group]
    return out


@pytest.mark.parametrize("sinks,window", [(False, None), (True, None), (False, 3), (True, 4)])
def test_gqa_attention_matches_naive_with_incremental_cache(sinks, window):
    torch.manual_seed(1)
    B, S, H, Hkv, D = 2, 9, 4, 2, 8
    q, k, v = torch.randn(B, S, H, D), torch.randn(B, S, Hkv, D), torch.randn(B, S, Hkv, 6)
    sk = torch.randn(H) if sinks else None
    want = naive_attention(q, k, v, 0.3, sk, window)
    whole = gqa_attention(q, k, v, None, 0.3, sk, window)
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)
    cache, parts = KVCache(), []
    for lo, hi in [(0, 5), (5, 6), (6, 9)]:  # a prefill chunk, then decode steps
        parts.append(gqa_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], cache, 0.3, sk, window))
    assert cache.length == S
    torch.testing.assert_close(torch.cat(parts, 1), want, atol=1e-5, rtol=1e-5)
