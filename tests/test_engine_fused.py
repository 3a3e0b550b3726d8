"""Fused MXFP4 expert matmuls (bf16 engine path): the C kernel against its torch spelling
(`mxfp4_linear_reference`, bit for bit) and float64 arithmetic at several shapes (every vector
width: tests/test_kernels.py), an `MXFP4Matrix` applied by `blocks.linear` against its decoded
matrix, and the bf16 engine against the in-memory bf16 forward (close) and against itself
across budgets (identical)."""

from __future__ import annotations

import pytest
import torch
from references import mxfp4_linear_reference

from reap.checkpoint import Checkpoint
from reap.engine import Engine
from reap.models import family
from reap.models.base import dict_weights
from reap.models.shared import blocks
from reap.quant import ckernel, mxfp4, mxfp4_matmul
from reap.quant.mxfp4 import MXFP4Matrix
from reap.quant.mxfp4_matmul import FUSED_MAX_ROWS, MXFP4Kernels, mxfp4_linear

needs_c = pytest.mark.skipif(ckernel.library() is None, reason="no C compiler")


def _matrix(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 136, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return packed, scales


def _x(m: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, cols, generator=g).bfloat16()


@needs_c
@pytest.mark.parametrize(
    ("rows", "cols", "m"), [(64, 96, 1), (67, 128, 3), (9, 32, 9), (40, 64, 6), (1030, 64, 2)]
)
def test_fused_linear_is_its_reference_bit_for_bit(rows, cols, m):
    packed, scales = _matrix(rows, cols, rows)
    x = _x(m, cols, cols)
    got = mxfp4_linear(x.float(), packed, scales)  # [M, O] fp32
    assert torch.equal(got, mxfp4_linear_reference(x.float(), packed, scales))
    # a token's result does not depend on the other tokens of the call
    alone = torch.cat([mxfp4_linear(x[i : i + 1].float(), packed, scales) for i in range(m)])
    assert torch.equal(got, alone)
    threads = torch.get_num_threads()
    try:  # rows split over threads: the same numbers
        torch.set_num_threads(2)
        assert torch.equal(got, mxfp4_linear(x.float(), packed, scales))
    finally:
        torch.set_num_threads(threads)
    exact = x.double() @ mxfp4.dequantize(packed, scales).double().T  # [M, O]
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=1e-5 * exact.abs().max())


@needs_c
def test_mxfp4_matrix_multiplies_like_its_decoded_matrix(monkeypatch):
    packed, scales = _matrix(48, 64, 3)
    w = MXFP4Matrix(packed, scales, MXFP4Kernels(torch.bfloat16, fused=True))
    dense = mxfp4.dequantize(packed, scales, torch.bfloat16)  # [O, I]
    assert w.shape == dense.shape and torch.equal(w.dense(torch.bfloat16), dense)
    assert not isinstance(w, torch.Tensor)  # a typed record, applied through blocks.linear
    calls = []
    inner = mxfp4_matmul.mxfp4_linear
    monkeypatch.setattr(mxfp4_matmul, "mxfp4_linear", lambda *a: calls.append(1) or inner(*a))
    x = _x(FUSED_MAX_ROWS + 1, 64, 4)
    few = x[:FUSED_MAX_ROWS]
    fused = mxfp4_linear_reference(few.float(), packed, scales).bfloat16()
    assert torch.equal(blocks.linear(few, w), fused) and len(calls) == 1
    # too many rows, another dtype, or no kernels (the reference): the decoded matrix, dense
    assert torch.equal(blocks.linear(x, w), x @ dense.T) and len(calls) == 1
    assert torch.equal(blocks.linear(few.float(), w), few.float() @ dense.float().T)
    assert torch.equal(blocks.linear(few, MXFP4Matrix(packed, scales)), few @ dense.T)
    assert len(calls) == 1


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory) -> str:
    from reap.synth import synth

    return synth("k3-tiny", tmp_path_factory.mktemp("fused") / "tiny", seed=5, dtype="bfloat16")


@needs_c
def test_bf16_engine_runs_experts_fused_and_is_identical_across_budgets(tiny_bf16, monkeypatch):
    calls = []
    inner = mxfp4_matmul.mxfp4_linear
    monkeypatch.setattr(mxfp4_matmul, "mxfp4_linear", lambda *a: calls.append(1) or inner(*a))
    ids = [5, 17, 200, 31, 7, 7, 90]
    runs = {}
    for preset in ("ultra", "desktop", "max"):
        # one prefill chunk for all: budgets change what stays resident, never the arithmetic,
        # while a different chunk size changes the trunk matmuls' shapes (and their rounding)
        with Engine.open(tiny_bf16, preset=preset, context=64, prefill_chunk=16) as eng:
            assert eng.dtype == torch.bfloat16 and eng._fused
            logits = eng.logits([ids])[0]
            gen = eng.generate([ids], max_tokens=6)[0].ids
            runs[preset] = (logits, gen)
    assert calls, "the fused kernel never ran"
    want_logits, want_ids = runs["ultra"]
    for logits, gen in runs.values():
        assert torch.equal(logits, want_logits) and gen == want_ids
    # the in-memory bf16 forward (decode + dense matmul) agrees up to bf16 rounding
    ck = Checkpoint.open(tiny_bf16)
    fam = family(ck.config)
    model = fam.Model(fam.Config.from_dict(ck.config), dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = model.forward(dict_weights({n: ck.read(n) for n in ck.tensors}), torch.tensor([ids]))
    ref = ref[0].float()
    assert (want_logits - ref).abs().max() <= 0.05 * ref.abs().max()
    assert (want_logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.8


def test_without_the_c_kernel_the_engine_decodes(tiny_bf16, monkeypatch):
    monkeypatch.setitem(ckernel._LOADED, ("mxfp4", (), ckernel._HERE), None)
    with Engine.open(tiny_bf16, preset="ultra", context=64) as eng:
        assert not eng._fused
        assert len(eng.generate([[1, 2, 3]], max_tokens=3)[0].ids) == 3
