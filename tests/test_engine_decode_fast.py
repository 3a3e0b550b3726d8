"""The decode fast paths against their slow references: the compiled bf16/fp32 GEMV
(`reap.quant.dense_kernel`) against fp64 torch on the same values, the fused SwiGLU against
the op-by-op one, and the one-token MoE
dispatch against the sorting `dispatch_reference` (bit for bit), alone and inside the engine."""

import pytest
import torch

from reap.models.shared import blocks
from reap.quant import dense_kernel

needs_kernel = pytest.mark.skipif(dense_kernel.library() is None, reason="no C compiler")


@needs_kernel
@pytest.mark.parametrize("rows,cols,tokens", [(384, 1024, 1), (37, 70, 3), (1030, 384, 8)])
def test_gemv_equals_fp64_torch_on_the_same_values(rows, cols, tokens):
    with dense_kernel.enabled():
        _gemv_equals_fp64_torch(rows, cols, tokens)


def _gemv_equals_fp64_torch(rows, cols, tokens):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(tokens, cols, generator=g)
    assert dense_kernel.usable(x.bfloat16(), w) and dense_kernel.usable(x, w.float())
    want = x.double() @ w.double().T  # exact products, fp64 sums
    got = dense_kernel.dense_linear(x, w)
    assert torch.equal(got, dense_kernel.dense_linear(x, w.float()))  # bf16 widens exactly
    assert torch.allclose(blocks.linear(x, w.float()).double(), want, atol=1e-4 * cols**0.5)
    assert got.dtype == torch.float32 and got.shape == (tokens, rows)
    assert torch.allclose(got.double(), want, atol=1e-4 * cols**0.5, rtol=1e-5)
    # bf16 x: the result is rounded to bf16 like torch's bf16 matmul (within one bf16 step)
    xb = x.bfloat16()
    ref = blocks.linear_reference(xb, w).float()
    assert torch.allclose(blocks.linear(xb, w).float(), ref, atol=1e-2, rtol=1e-2)
    # a token's result does not depend on the batch it is in
    one = dense_kernel.dense_linear(x[-1:], w)
    assert torch.equal(one[0], got[-1])


def test_gemv_declines_what_it_does_not_do():
    w = torch.randn(8, 16).bfloat16()
    assert not dense_kernel.usable(torch.randn(1, 16).bfloat16(), w)  # not opted in: torch
    with dense_kernel.enabled():
        _declines(w)


def _declines(w):
    assert not dense_kernel.usable(torch.randn(9, 16), w)  # too many rows: torch
    assert not dense_kernel.usable(torch.randn(1, 16), w)  # dtypes differ: torch casts
    assert not dense_kernel.usable(torch.randn(1, 16).double(), w.double())  # fp64: torch
    assert not dense_kernel.usable(torch.randn(1, 8), w.T)  # not contiguous
    x = torch.randn(20, 16).bfloat16()
    assert torch.equal(blocks.linear(x, w), blocks.linear_reference(x, w))


def _experts(dtype, E=6, D=32, F=24):
    g = torch.Generator().manual_seed(1)
    ws = [[torch.randn(*s, generator=g).to(dtype) for s in ((F, D), (F, D), (D, F))]
          for _ in range(E)]  # fmt: skip
    return lambda e, x: blocks.silu_glu(x, *ws[e])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_token_dispatch_equals_the_sorting_reference_bit_for_bit(dtype):
    run = _experts(dtype)
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        x = torch.randn(1, 32, generator=g).to(dtype)
        ids = torch.randperm(6, generator=g)[:3][None]  # [1, K]
        weights = torch.rand(1, 3, generator=g)
        fast, none = blocks.dispatch(x, ids, weights, run)
        calls = []  # on one thread each expert runs once fetched (the later reads go on)
        src = lambda layer, e: calls.append(("get", e)) or {"w": torch.tensor([float(e)])}
        saved = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            via_source, _ = blocks.routed_experts(
                x, ids, weights, 0, src, lambda xs, t: calls.append(("run", int(t["w"])))
                or run(int(t["w"]), xs))  # fmt: skip
        finally:
            torch.set_num_threads(saved)
        assert torch.equal(via_source, fast)
        assert calls == [(op, e) for e in sorted(ids[0].tolist()) for op in ("get", "run")]
        ref, _ = blocks.dispatch_reference(x, ids, weights, run)
        assert none is None and torch.equal(fast, ref)


def test_engine_decode_with_fast_paths_matches_the_references(tmp_path, monkeypatch):
    """The engine on a tiny Qwen3-MoE, one token per decode step: logits with the fast paths
    on and off (torch matmuls, sorting dispatch) within fp32 / bf16 tolerance; the one-token
    dispatch alone changes nothing (fp32 logits bit-identical)."""
    import family_runner as R
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from reap.engine import Engine, native

    monkeypatch.setattr(native, "ENABLED", False)  # the torch path's fast paths, not the step's
    cfg = {
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
        "norm_topk_prob": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
    }  # fmt: skip
    path, _ = R.save_hf_tiny(
        Qwen3MoeForCausalLM, Qwen3MoeConfig, cfg, tmp_path / "m", seed=5,
        config_extra={"num_experts": 8, "rope_theta": 1e4},
    )  # fmt: skip
    seqs = [[3, 100, 7, 200, 55, 9, 1, 250, 17, 42]]

    def decode_logits(dtype):
        with Engine.open(path, preset="max", context=64, dtype=dtype) as eng:
            s = eng.new_sequence()
            out = [eng.step([s], [seqs[0][:4]])[0]]
            out += [eng.step([s], [[t]])[0] for t in seqs[0][4:]]  # one token per step
            return torch.stack(out)

    fast = {d: decode_logits(d) for d in ("float32", "bfloat16")}
    threads = torch.get_num_threads()
    try:  # the one-token dispatch computes experts in threads: the same numbers
        torch.set_num_threads(3)
        assert torch.equal(decode_logits("float32"), fast["float32"])
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(dense_kernel, "usable", lambda x, w: False)
    torch_gemv = decode_logits("float32")
    monkeypatch.setattr(blocks, "FAST_ONE_TOKEN", False)
    slow = {d: decode_logits(d) for d in ("float32", "bfloat16")}
    assert torch.equal(torch_gemv, slow["float32"])
    assert torch.allclose(fast["float32"], slow["float32"], atol=1e-4)
    scale = slow["bfloat16"].abs().max()
    assert (fast["bfloat16"] - slow["bfloat16"]).abs().max() < 0.05 * scale


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F,D", [(384, 1024), (30, 70)])
def test_fused_swiglu_matches_op_by_op_and_is_batch_invariant(dtype, F, D):
    """`dense_kernel.swiglu` (gate, up, silu, product in one pass, then down) against
    `silu_glu_reference` (three GEMVs, torch's silu and product): fp32 within a few ulps (only
    silu's exp differs), bf16 within one bf16 step; a token's result is the same alone or in
    a batch of up to 8. Outside `dense_kernel.enabled()` (the opt-in), torch's ops run."""
    with dense_kernel.enabled():
        _fused_swiglu_agrees(dtype, F, D)
    x, ws = torch.randn(2, D).to(dtype), [torch.randn(*s).to(dtype) for s in ((F, D),) * 2]
    assert not dense_kernel.swiglu_usable(x, *ws, ws[0].T.contiguous())


def _fused_swiglu_agrees(dtype, F, D):
    g = torch.Generator().manual_seed(F)
    ws = [(torch.randn(*s, generator=g) / 8).to(dtype) for s in ((F, D), (F, D), (D, F))]
    x = torch.randn(8, D, generator=g).to(dtype)
    assert dense_kernel.swiglu_usable(x, *ws)
    got, ref = blocks.silu_glu(x, *ws), blocks.silu_glu_reference(x, *ws)
    exact = (x.double() @ ws[0].double().T).sigmoid() * (x.double() @ ws[0].double().T)
    exact = (exact * (x.double() @ ws[1].double().T)) @ ws[2].double().T  # fp64 of the same values
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    if dtype == torch.float32:  # bf16 rounds every intermediate: op-by-op is its reference
        torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)
    for i in range(8):
        assert torch.equal(blocks.silu_glu(x[i : i + 1], *ws)[0], got[i])
    assert torch.equal(blocks.silu_glu(x[2:5], *ws), got[2:5])


def test_fused_swiglu_declines_what_it_does_not_do():
    with dense_kernel.enabled():
        _fused_swiglu_declines()


def _fused_swiglu_declines():
    ws = [torch.randn(*s) for s in ((6, 16), (6, 16), (16, 6))]
    assert not dense_kernel.swiglu_usable(torch.randn(9, 16), *ws)  # too many rows: torch
    assert not dense_kernel.swiglu_usable(torch.randn(1, 16).bfloat16(), *ws)  # dtypes differ
    assert not dense_kernel.swiglu_usable(torch.randn(1, 16), ws[0], ws[1], ws[2].T)  # layout
    x = torch.randn(12, 16)
    assert torch.equal(blocks.silu_glu(x, *ws), blocks.silu_glu_reference(x, *ws))
