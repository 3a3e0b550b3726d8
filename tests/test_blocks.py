"""Shared model blocks against slow, obviously correct references: chunked KDA vs the per-step
recurrence, the streamed short conv, MLA with a latent cache vs plain attention, the router and
expert-major dispatch vs per-token loops, the AttnRes mix vs its formula."""

import math

import pytest
import torch
from references import mxfp4_dequantize_reference

from reap.models.kimi_k3 import blocks as kimi_k3_blocks
from reap.models.shared import attention as A
from reap.models.shared import blocks as B
from reap.models.shared import kda
from reap.quant import mxfp4


def _qkv(Bn, T, H, Dk, Dv, seed=0, lower_bound=-5.0):
    g = torch.Generator().manual_seed(seed)
    q = kda.l2_normalize(torch.randn(Bn, T, H, Dk, generator=g)) * Dk**-0.5
    k = kda.l2_normalize(torch.randn(Bn, T, H, Dk, generator=g))
    v = torch.randn(Bn, T, H, Dv, generator=g)
    # decays spanning the whole allowed range, down to exp(lower_bound) per step
    log_g = lower_bound * torch.sigmoid(4 * torch.randn(Bn, T, H, Dk, generator=g))
    beta = torch.rand(Bn, T, H, generator=g)
    state = torch.randn(Bn, H, Dv, Dk, generator=g)
    return q, k, v, log_g, beta, state


@pytest.mark.parametrize("T", [1, 7, 16, 33, 50])
@pytest.mark.parametrize("chunk", [8, 16])
def test_kda_chunked_matches_recurrence(T, chunk):
    args = _qkv(2, T, 3, 32, 16, seed=T)
    o_ref, s_ref = kda.kda_recurrent(*args)
    o, s = kda.kda_chunked(*args, chunk=chunk)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=2e-5, rtol=1e-4)


def test_kda_recurrence_is_the_delta_rule():
    """One step by hand: S' = S diag(g) + beta (v - S diag(g) k) k^T, o = S' q."""
    q, k, v, log_g, beta, state = _qkv(1, 1, 1, 4, 3, seed=5)
    S = state[0, 0] * log_g[0, 0, 0].exp()[None, :]
    kk, vv, qq, b = k[0, 0, 0], v[0, 0, 0], q[0, 0, 0], beta[0, 0, 0]
    S = S + b * torch.outer(vv - S @ kk, kk)
    o, s = kda.kda_recurrent(q, k, v, log_g, beta, state)
    torch.testing.assert_close(s[0, 0], S)
    torch.testing.assert_close(o[0, 0, 0], S @ qq)


def test_short_conv_streamed_equals_whole_and_naive():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 9, 6, generator=g), torch.randn(6, 1, 4, generator=g)
    y, _ = kda.short_conv(x, w, None)
    xp = torch.cat([torch.zeros(2, 3, 6), x], 1)
    naive = torch.stack([(xp[:, t : t + 4] * w[:, 0].T).sum(1) for t in range(9)], 1)
    torch.testing.assert_close(y, torch.nn.functional.silu(naive))
    y1, tail = kda.short_conv(x[:, :5], w, None)
    parts = [y1]
    for t in range(5, 9):
        yt, tail = kda.short_conv(x[:, t : t + 1], w, tail)
        parts.append(yt)
    torch.testing.assert_close(torch.cat(parts, 1), y)


def test_short_conv_in_bf16_rounds_the_fp32_conv_once():
    """bf16 inputs: the fp32 conv rounded to bf16, within one bf16 step of torch's own bf16
    conv (which accumulates in fp32 too) and of the exact sum, then SiLU in bf16."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 7, 40, generator=g).bfloat16()
    w = torch.randn(40, 1, 4, generator=g).bfloat16()
    y, tail = kda.short_conv(x, w, None)
    assert y.dtype == torch.bfloat16 and torch.equal(tail, x[:, -3:])
    xp = torch.cat([torch.zeros(1, 3, 40), x.float()], 1).double()
    exact = torch.stack([(xp[:, t : t + 4] * w[:, 0].T.double()).sum(1) for t in range(7)], 1)
    own = torch.nn.functional.conv1d(torch.cat([torch.zeros(1, 3, 40).bfloat16(), x], 1)
                                     .transpose(1, 2), w, groups=40).transpose(1, 2)  # fmt: skip
    for ref in (exact.bfloat16(), own):
        want = torch.nn.functional.silu(ref)
        torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=2**-7)


def _mla_weights(d: A.MLADims, D=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) / math.sqrt(s[-1])
    return {
        "q_a_proj.weight": r(d.q_lora, D),
        "q_a_layernorm.weight": 1 + 0.1 * r(d.q_lora),
        "q_b_proj.weight": r(d.heads * (d.nope + d.rope), d.q_lora),
        "kv_a_proj_with_mqa.weight": r(d.kv_lora + d.rope, D),
        "kv_a_layernorm.weight": 1 + 0.1 * r(d.kv_lora),
        "kv_b_proj.weight": r(d.heads * (d.nope + d.v), d.kv_lora),
        "o_proj.weight": r(D, d.heads * d.v),
        "g_proj.weight": r(d.heads * d.v, D),
    }


def _mla_plain(x, W, d: A.MLADims):
    """Plain causal multi-head attention with k/v rows of kv_b_proj expanded head by head."""
    T = x.shape[1]
    q = B.linear(
        B.rms_norm(B.linear(x, W["q_a_proj.weight"]), W["q_a_layernorm.weight"], 1e-6),
        W["q_b_proj.weight"],
    ).reshape(1, T, d.heads, d.nope + d.rope)
    ckv = B.linear(x, W["kv_a_proj_with_mqa.weight"])
    c = B.rms_norm(ckv[..., : d.kv_lora], W["kv_a_layernorm.weight"], 1e-6)
    k_pe = ckv[..., d.kv_lora :]
    kv_b = W["kv_b_proj.weight"].reshape(d.heads, d.nope + d.v, d.kv_lora)
    out = torch.zeros(1, T, d.heads, d.v)
    for h in range(d.heads):
        keys = torch.cat([c[0] @ kv_b[h, : d.nope].T, k_pe[0]], -1)  # [T, nope+rope]
        vals = c[0] @ kv_b[h, d.nope :].T  # [T, v]
        for t in range(T):
            s = (keys[: t + 1] @ q[0, t, h]) / math.sqrt(d.nope + d.rope)
            out[0, t, h] = torch.softmax(s, 0) @ vals[: t + 1]
    o = out.reshape(1, T, -1) * torch.sigmoid(B.linear(x, W["g_proj.weight"]))
    return B.linear(o, W["o_proj.weight"])


def test_mla_latent_cache_matches_plain_attention():
    d = A.MLADims(heads=3, nope=8, rope=4, v=8, kv_lora=16, q_lora=24, output_gate=True)
    W = _mla_weights(d)
    x = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(2))
    ref = _mla_plain(x, W, d)
    torch.testing.assert_close(A.mla_attention(x, W.__getitem__, d), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(
        A.mla_attention(x, W.__getitem__, d, absorbed=True), ref, atol=1e-5, rtol=1e-4
    )
    cache = A.MLACache()
    parts = [A.mla_attention(x[:, :5], W.__getitem__, d, cache)]  # prefill, then decode 1 by 1
    for t in range(5, 9):
        parts.append(A.mla_attention(x[:, t : t + 1], W.__getitem__, d, cache))
    assert cache.length == 9 and cache.kv_latent.shape == (1, 9, 16)
    torch.testing.assert_close(torch.cat(parts, 1), ref, atol=1e-5, rtol=1e-4)


def test_route_matches_per_token_loop():
    g = torch.Generator().manual_seed(3)
    logits, bias = torch.randn(20, 16, generator=g), 0.3 * torch.randn(16, generator=g)
    ids, w, probs = kimi_k3_blocks.route(logits, bias, 4, 2.5)
    for n in range(20):
        p = [1 / (1 + math.exp(-float(v))) for v in logits[n]]
        chosen = sorted(range(16), key=lambda e: -(p[e] + float(bias[e])))[:4]
        assert ids[n].tolist() == chosen
        total = sum(p[e] for e in chosen)
        torch.testing.assert_close(w[n], torch.tensor([2.5 * p[e] / total for e in chosen]))
    torch.testing.assert_close(probs, torch.sigmoid(logits))


def _expert_tensors(E, Dl, F, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(E):
        t = {}
        for n, shape in (("w1", (F, Dl)), ("w2", (Dl, F)), ("w3", (F, Dl))):
            t[f"{n}.weight_packed"], t[f"{n}.weight_scale"] = mxfp4.quantize(
                torch.randn(*shape, generator=g) / math.sqrt(shape[1])
            )
        out.append(t)
    return out


def test_dispatch_matches_token_loop_and_measures_outputs():
    E, K, N, Dl, F = 6, 2, 11, 32, 64
    experts = _expert_tensors(E, Dl, F, seed=4)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, Dl, generator=g)
    ids, w, _ = kimi_k3_blocks.route(torch.randn(N, E, generator=g), None, K, 1.0)
    calls = []
    glu = kimi_k3_blocks.expert_glu
    run = lambda e, xs: (calls.append(e), glu(xs, experts[e], 4.0, 25.0))[1]
    up = torch.randn(40, Dl, generator=g)
    y, st = B.dispatch(x, ids, w, run, to_model=lambda o: B.linear(o, up))
    assert calls == sorted(set(ids.flatten().tolist()))  # each used expert once, ascending
    for n in range(N):
        outs = []
        for k in range(K):
            t = experts[int(ids[n, k])]
            deq = {
                s: mxfp4_dequantize_reference(
                    t[f"{s}.weight_packed"], t[f"{s}.weight_scale"]
                ).float()
                for s in ("w1", "w2", "w3")
            }
            h = B.situ(x[n] @ deq["w3"].T, x[n] @ deq["w1"].T, 4.0, 25.0)
            outs.append(h @ deq["w2"].T)
            torch.testing.assert_close(st.latent_norm[n, k], outs[-1].norm(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(st.max_act[n, k], outs[-1].abs().max())
            torch.testing.assert_close(
                st.model_norm[n, k], (up @ outs[-1]).norm(), rtol=1e-5, atol=1e-5
            )
        torch.testing.assert_close(
            y[n], sum(w[n, k] * outs[k] for k in range(K)), atol=1e-5, rtol=1e-5
        )


def test_attn_res_mix_formula():
    g = torch.Generator().manual_seed(6)
    blocks = [torch.randn(2, 3, 8, generator=g) for _ in range(3)]
    partial, proj, norm_w = (
        torch.randn(2, 3, 8, generator=g),
        torch.randn(1, 8, generator=g),
        torch.rand(8, generator=g) + 0.5,
    )
    out = kimi_k3_blocks.attn_res_mix(blocks, partial, proj, norm_w, 1e-5)
    srcs = [*blocks, partial]
    for b in range(2):
        for t in range(3):
            logits = torch.tensor(
                [float(proj[0] @ B.rms_norm(s[b, t], norm_w, 1e-5)) for s in srcs]
            )
            p = torch.softmax(logits, 0)
            torch.testing.assert_close(out[b, t], sum(p[i] * srcs[i][b, t] for i in range(4)))
    assert kimi_k3_blocks.attn_res_mix([], partial, proj, norm_w, 1e-5) is partial


def test_situ_formula():
    x, gate = torch.tensor([0.5, -30.0, 3.0]), torch.tensor([1.0, 2.0, -8.0])
    ref = [
        4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(v / 25)
        for v, g in zip(x.tolist(), gate.tolist())
    ]
    torch.testing.assert_close(B.situ(x, gate, 4.0, 25.0), torch.tensor(ref))


def test_softmax_topk_matches_a_naive_router():
    from reap.models.shared.blocks import softmax_topk

    torch.manual_seed(3)
    logits = torch.randn(7, 10)
    for renorm in (False, True):
        ids, weights, probs = softmax_topk(logits, 3, renorm)
        for n in range(7):
            p = [math.exp(v) for v in logits[n].tolist()]
            p = [v / sum(p) for v in p]
            top = sorted(range(10), key=lambda e: -p[e])[:3]
            assert ids[n].tolist() == top
            w = [p[e] for e in top]
            w = [v / sum(w) for v in w] if renorm else w
            torch.testing.assert_close(weights[n], torch.tensor(w), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(probs.sum(-1), torch.ones(7))


def test_silu_glu_matches_the_formula():
    from reap.models.shared.blocks import silu_glu

    torch.manual_seed(4)
    x, g, u, d = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5, 8), torch.randn(8, 5)
    h = [[0.0] * 5 for _ in range(3)]
    for n in range(3):
        for f in range(5):
            a, b = float(x[n] @ g[f]), float(x[n] @ u[f])
            h[n][f] = a / (1 + math.exp(-a)) * b
    torch.testing.assert_close(silu_glu(x, g, u, d), torch.tensor(h) @ d.T, rtol=1e-5, atol=1e-5)
