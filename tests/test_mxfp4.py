"""MXFP4 codec: golden bytes, exact round trips, fast vs reference decode, a naive quantizer, and
agreement with mlx's independent implementation where the two rounding rules coincide."""

import math

import numpy as np
import pytest
import torch
from references import mxfp4_dequantize_reference as dequantize_reference
from references import unpack_nibbles

from reap.errors import ReapError
from reap.quant.mxfp4 import (
    FP4_VALUES,
    dequantize,
    fake_quant,
    pack_nibbles,
    qdq,
    quantize,
)

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _block(*head):
    return torch.tensor([list(head) + [0.0] * (32 - len(head))], dtype=torch.float32)


def test_fp4_table_literal():
    assert FP4_VALUES.dtype == torch.float32
    assert FP4_VALUES.tolist() == GRID + [-v for v in GRID]


def test_golden_bytes_scale_one():
    # amax 6: shared exponent floor(log2 6) - 2 = 0 -> byte 127. codes 0.5->1, -1->0b1010, 6->7,
    # 3->5; low nibble = even column: (1, 10) -> 0xA1, (7, 5) -> 0x57
    packed, scales = quantize(_block(0.5, -1.0, 6.0, 3.0))
    assert scales.tolist() == [[127]]
    assert packed.tolist() == [[0xA1, 0x57] + [0] * 14]


def test_golden_bytes_scale_two_and_tie():
    # amax 12: exponent 3 - 2 = 1 -> byte 128; scaled [6, -0.375, 0.5, 3.5]:
    # 6->7, -0.375->0b1001, 0.5->1, 3.5 is a tie between 3 (code 5) and 4 (code 6): even -> 6
    packed, scales = quantize(_block(12.0, -0.75, 1.0, 7.0))
    assert scales.tolist() == [[128]]
    assert packed.tolist() == [[0x97, 0x61] + [0] * 14]


def test_golden_ties_to_even_and_saturation():
    # every midpoint of the grid: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4, 5->4
    packed, scales = quantize(_block(6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -5))
    assert scales.tolist() == [[127]]
    assert packed.tolist()[0][:5] == [0x07, 0x22, 0x44, 0x66, 0xE0]
    # 7.9 has amax exponent 2 -> scale 1 and saturates to 6
    packed, scales = quantize(_block(7.9, -7.0))
    assert scales.tolist() == [[127]] and packed.tolist()[0][0] == 0xF7


def test_zero_nan_inf_and_tiny_blocks():
    packed, scales = quantize(torch.zeros(2, 64))
    assert scales.tolist() == [[127, 127]] * 2 and not packed.any()
    packed, scales = quantize(torch.cat([_block(float("nan"), 1.0), _block(float("inf"))], 1))
    assert scales.tolist() == [[255, 255]] and not packed.any()
    assert torch.isnan(dequantize(packed, scales)).all()
    # amax 2**-126: exponent -128 clamps to -127 (byte 0); 2**-130 -> 0.125 -> 0, 2**-126 -> 2
    packed, scales = quantize(_block(2.0**-130, 2.0**-126))
    assert scales.tolist() == [[0]] and packed.tolist()[0][:1] == [0x40]


def test_negative_zero_is_stored_as_plus_zero():
    packed, _ = quantize(_block(6.0, -0.0, -0.1))
    assert packed.tolist()[0][:2] == [0x07, 0x00]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_grid_value_round_trips_at_many_scales(dtype):
    values = torch.tensor(GRID + [-v for v in GRID[1:]] + [0.0] * 17, dtype=torch.float64)
    for e in [-127, -126, -100, -3, -1, 0, 1, 7, 60, 125]:
        w = (values * 2.0**e).to(dtype).reshape(1, 32)
        packed, scales = quantize(w)
        assert scales.tolist() == [[e + 127]], e
        out = dequantize(packed, scales, dtype=dtype)
        assert out.dtype == dtype and torch.equal(out, w), e


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert pack_nibbles(torch.tensor([1, 10, 7, 5], dtype=torch.uint8)).tolist() == [0xA1, 0x57]
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(every)), every)


def test_dequantize_matches_reference_on_random_bytes():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (2, 3, 48), dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, (2, 3, 3), dtype=torch.uint8, generator=g)
    scales[0, 0, :] = torch.tensor([0, 254, 255], dtype=torch.uint8)  # extremes and NaN
    ref = dequantize_reference(packed, scales)
    fast = dequantize(packed, scales, dtype=torch.float64)
    assert fast.shape == (2, 3, 96)
    assert torch.equal(torch.isnan(fast), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(fast[ok], ref[ok])
    assert torch.equal(dequantize(packed, scales)[ok], ref.float()[ok])
    assert torch.equal(
        dequantize(packed, scales, dtype=torch.bfloat16)[ok], ref.to(torch.bfloat16)[ok]
    )


def _naive_quantize_block(block):
    """Per-element quantizer: the nearest grid value by search, ties to the even code."""
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 127, [0] * 32
    exponent = max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
    codes = []
    for v in block:
        x = v / 2.0**exponent
        best = min(range(8), key=lambda c: (abs(abs(x) - GRID[c]), c % 2))
        codes.append(best | (8 if x < 0 and best else 0))
    return exponent + 127, codes


def test_quantize_matches_naive_quantizer():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (6, 1), generator=g))
    w[0, :32] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4)  # all ties
    w[1, :32] = 0.0
    packed, scales = quantize(w)
    for r in range(6):
        for b in range(4):
            s, codes = _naive_quantize_block(w[r, 32 * b : 32 * b + 32].tolist())
            assert scales[r, b].item() == s
            assert unpack_nibbles(packed[r, 16 * b : 16 * b + 16]).tolist() == codes


def test_qdq_and_fake_quant_gradient():
    w = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    expect = dequantize(*quantize(w), dtype=torch.bfloat16)
    assert qdq(w).dtype == torch.bfloat16 and torch.equal(qdq(w), expect)
    y = fake_quant(w)
    assert torch.equal(y.detach(), expect)
    (y.float() * torch.arange(64.0)).sum().backward()
    assert torch.equal(w.grad, torch.arange(64.0).expand(4, 64).to(torch.bfloat16))


def test_bad_inputs_raise_reap_error():
    with pytest.raises(ReapError, match="multiple of 32"):
        quantize(torch.zeros(4, 40))
    with pytest.raises(ReapError, match="does not match"):
        dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ReapError, match="uint8"):
        dequantize(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ReapError, match="below 16"):
        pack_nibbles(torch.tensor([16, 0], dtype=torch.uint8))


# ---- mlx as an independent implementation ------------------------------------------------------


def _mlx():
    return pytest.importorskip("mlx.core")


def _to_mlx_packed(packed):
    mx = _mlx()
    return mx.array(packed.numpy().view(np.uint32))  # mlx packs 8 codes per uint32, little endian


def test_mlx_dequantizes_our_bytes_identically():
    mx = _mlx()
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (255, 64), dtype=torch.uint8, generator=g)
    scales = torch.arange(255, dtype=torch.uint8).reshape(255, 1).repeat(1, 4)  # bytes 0..254
    theirs = mx.dequantize(
        _to_mlx_packed(packed),
        mx.array(scales.numpy()),
        group_size=32,
        bits=4,
        mode="mxfp4",
        dtype=mx.float32,
    )
    assert torch.equal(dequantize(packed, scales), torch.from_numpy(np.array(theirs)))


def test_mlx_quantize_bytes_agree_where_rules_coincide():
    mx = _mlx()
    g = torch.Generator().manual_seed(4)
    rows, n = 16, 256
    k = torch.randint(-30, 30, (rows, n // 32, 1), generator=g).float()
    w = (torch.rand(rows, n // 32, 32, generator=g) * 2 - 1) * torch.exp2(k)
    # each block's amax = 1.25 * 2**k: mantissa <= 1.5, where mlx's scale rule equals OCP's
    w[..., 0] = 1.25 * torch.exp2(k[..., 0]) * torch.sign(torch.randn(rows, n // 32, generator=g))
    w = w.reshape(rows, n)
    packed, scales = quantize(w)
    q, s = mx.quantize(mx.array(w.numpy()), group_size=32, bits=4, mode="mxfp4")
    assert np.array_equal(np.array(s), scales.numpy())
    assert np.array_equal(np.array(q).view(np.uint8), packed.numpy())


def test_mlx_rounding_differences_are_as_documented():
    mx = _mlx()
    w = torch.cat([_block(7.0), _block(6.0, 3.5, 0.75)], 1)
    q, s = mx.quantize(mx.array(w.numpy()), group_size=32, bits=4, mode="mxfp4")
    packed, scales = quantize(w)
    # amax 7: OCP keeps exponent 0 and saturates, mlx picks exponent 1 so 7/2 -> 3.5 -> 3 (ties down)
    assert scales.tolist() == [[127, 127]] and np.array(s).tolist() == [[128, 127]]
    # ties: 3.5 -> 4 and 0.75 -> 1 here (to even); mlx rounds both down (3, 0.5)
    assert packed[0, 16].item() == 0x67 and packed[0, 17].item() == 0x02
    assert np.array(q).view(np.uint8)[0, 16] == 0x57 and np.array(q).view(np.uint8)[0, 17] == 0x01
