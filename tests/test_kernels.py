"""Every compiled kernel x vector width x dtype against its torch reference, in one table (as
ggml's test-backend-ops checks each op against a reference backend): the fused MXFP4 product
and the MXFP4 decode bit for bit, the dense GEMV, the many-row tiles and the fused SwiGLU within
rounding of float64 on the same values; each build of another vector width gives the native
build's values bit for bit. And the step kernels' argument layout: Python and C read one
declaration (`step_args.h`), and a library built with another order is refused."""

from __future__ import annotations

import shutil

import pytest
import torch
from references import mxfp4_linear_reference

from reap.models.shared import blocks
from reap.quant import ckernel, dense_kernel, mxfp4, step_kernel
from reap.quant.mxfp4_decode import decode_mxfp4
from reap.quant.mxfp4_matmul import mxfp4_linear

pytestmark = pytest.mark.skipif(ckernel.library("dense") is None, reason="no C compiler")
WIDTHS = {"native": (), "avx2": ("-mno-avx512f",), "plain": ("-mno-avx2",)}
DTYPES = [torch.float32, torch.bfloat16]


def _mxfp4(m: int, rows: int, cols: int, dtype, g):
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(117, 136, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return torch.randn(m, cols, generator=g).bfloat16().to(dtype), packed, scales


def mxfp4_product(dtype, g):
    """The fused kernel (bf16 values: every product exact, so its reference is bit for bit)."""
    x, packed, scales = _mxfp4(5, 67, 160, dtype, g)
    return mxfp4_linear(x, packed, scales), mxfp4_linear_reference(x, packed, scales), 0.0


def mxfp4_decoded(dtype, g):
    _, packed, scales = _mxfp4(1, 70, 96, dtype, g)
    return decode_mxfp4(packed, scales, dtype), mxfp4.dequantize(packed, scales, dtype), 0.0


def _dense(rows: int, cols: int, m: int, dtype, g):
    w = (torch.randn(rows, cols, generator=g) / 30).to(dtype)
    return torch.randn(m, cols, generator=g).to(dtype), w


def gemv(dtype, g):
    """A few rows (`dense_kernels.c`), rows split over threads."""
    x, w = _dense(1030, 384, 3, dtype, g)
    with dense_kernel.enabled():
        assert dense_kernel.usable(x, w)
        return dense_kernel.dense_linear(x, w), x.double() @ w.double().T, _tol(dtype)


def _tol(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2.0**-7  # relative to the largest value


def tiles(dtype, g):
    """Many rows (the step library's tiles, `reap_linear`): 70 rows, 1100 columns."""
    x, w = _dense(70, 1100, min(40, step_kernel.BF16_ROWS), dtype, g)
    with dense_kernel.enabled():
        assert dense_kernel.usable(x, w) and x.shape[0] > dense_kernel.MAX_ROWS
        return dense_kernel.dense_linear(x, w), x.double() @ w.double().T, _tol(dtype)


def swiglu(dtype, g):
    """Gate, up, silu and product in one pass, then down; bf16 rounds every intermediate, so
    its reference is torch's op by op in bf16."""
    x, gate = _dense(30, 70, 4, dtype, g)
    up, down = _dense(30, 70, 1, dtype, g)[1], _dense(70, 30, 1, dtype, g)[1]
    with dense_kernel.enabled():
        assert dense_kernel.swiglu_usable(x, gate, up, down)
        got = dense_kernel.swiglu(x, gate, up, down)
    if dtype == torch.bfloat16:
        return got, blocks.silu_glu_reference(x, gate, up, down), 2e-2
    h = x.double() @ gate.double().T
    return got, (h.sigmoid() * h * (x.double() @ up.double().T)) @ down.double().T, 1e-4


KERNELS = [mxfp4_product, mxfp4_decoded, gemv, tiles, swiglu]


def _run(kernel, dtype):
    return kernel(dtype, torch.Generator().manual_seed(7))


@pytest.fixture(params=list(WIDTHS))
def width(request, monkeypatch):
    """Every library built for one vector width, in use through the usual calls."""
    flags = WIDTHS[request.param]
    for name in ("mxfp4", "dense", "step"):
        lib = ckernel.library(name, flags)
        if lib is None:
            pytest.skip(f"compiler refuses {flags}")
        monkeypatch.setitem(ckernel._LOADED, (name, (), ckernel._HERE), lib)
    if request.param == "plain":
        assert ckernel.library().reap_mxfp4_split_x() == 0  # really the plain C loops
        assert ckernel.library("step").reap_simd() == 0
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.__name__)
def test_kernel_against_its_reference(kernel, dtype, width, monkeypatch):
    got, want, tol = _run(kernel, dtype)
    if tol == 0.0:
        assert torch.equal(got, want)
    else:
        err = (got.double() - want.double()).abs().max()
        assert err <= tol * want.double().abs().max(), (kernel.__name__, width, err)
    monkeypatch.undo()  # the native build: the same bits
    assert torch.equal(got, _run(kernel, dtype)[0])
    threads = torch.get_num_threads()
    try:  # split over the pool's threads: the same bits
        torch.set_num_threads(2)
        assert torch.equal(got, _run(kernel, dtype)[0])
    finally:
        torch.set_num_threads(threads)


def test_python_and_c_read_one_argument_layout(tmp_path, monkeypatch):
    """The loaded step library reports the layout Python parsed from `step_args.h`; a library
    built from sources whose header has another order, or a Python side with another order, is
    refused by the loader (the test fails when either side's order changes alone)."""
    lib = step_kernel.library()
    assert lib.reap_arg_layout().decode() == ckernel.layout_text(ckernel.ARGS)
    assert list(step_kernel.ATTN)[:5] == ["h", "x2", "scratch", "in_norm", "wq"]
    assert len(step_kernel.PREFILL) == 15 and step_kernel.TOKEN["emb_bf16"] == 14
    for p in ckernel._HERE.iterdir():
        if p.suffix in (".c", ".h"):
            shutil.copy(p, tmp_path / p.name)
    header = tmp_path / "step_args.h"
    header.write_text(header.read_text().replace("arg(WQ) arg(WK)", "arg(WK) arg(WQ)"))
    assert ckernel.library("step", where=tmp_path) is None  # C reordered
    header.write_text((ckernel._HERE / "step_args.h").read_text())
    assert ckernel.library("step", flags=("-DSAME",), where=tmp_path) is not None
    attn = list(ckernel.ARGS["attn"])
    attn[4], attn[5] = attn[5], attn[4]
    monkeypatch.setitem(ckernel.ARGS, "attn", tuple(attn))  # Python reordered
    assert ckernel.library("step", flags=("-DOTHER",), where=tmp_path) is None
    with pytest.raises(TypeError, match="argument block fields"):
        step_kernel.pack(step_kernel.PREFILL, x=0)
