"""Oracle 4 for FP8 weights: the Triton linear layer (runtime/models/fp8_triton.py) against `F.linear` over
the weights dequantized first (runtime/models/fp8_weights.py `dequantize`), under TRITON_INTERPRET=1 on a
CPU: row counts of a decode and of a prefill chunk, column blocks that do not divide the layer, tiles across
scale blocks and inside one, a bias."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
from kvc.runtime.models import fp8_triton  # noqa: E402
from kvc.runtime.models.fp8_weights import dequantize  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("rows", [1, 3, 70])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cols", [24, 64])  # tiles across scale blocks (a scale a weight); tiles inside one
def test_linear_equals_the_dequantized_layer(dtype, rows, bias, cols):
    gen = torch.Generator().manual_seed(rows)
    n, k = 90, 100
    codes = (torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn).to(DEVICE)
    scales = ((torch.rand(n, -(-k // cols), generator=gen) + 0.5) / (40 * k ** 0.5)).to(DEVICE)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    x = torch.randn(2, rows, k, generator=gen).to(DEVICE, dtype)
    got = fp8_triton.linear(x, codes, scales, cols, b, block_n=32, block_k=32)
    want = F.linear(x, dequantize(codes, scales, cols, dtype), b)
    assert got.shape == (2, rows, n) and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_mismatched_scales_are_an_error():
    codes = torch.zeros(8, 16, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="disagree"):
        fp8_triton.linear(torch.zeros(1, 16, device=DEVICE), codes, torch.ones(8, 3, device=DEVICE), 8)


def test_the_fp8_kernels_compile_for_sm90() -> None:
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_fp8")
