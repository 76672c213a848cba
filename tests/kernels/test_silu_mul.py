"""The fused silu(gate) * up kernel (runtime/models/norm_triton.py `silu_mul`, used on CUDA by `GatedMLP`)
against the torch path it replaces, `F.silu(gate).mul_(up)` over the halves of the fused gate_up output:
- on a GPU, torch's bits in every dtype: the float32 silu with the same expf and IEEE division as torch's
  CUDA kernel, rounded to the activation dtype before the product, as torch rounds;
- under TRITON_INTERPRET=1 on a CPU, the interpreter's exp is numpy's, which differs from the CPU torch's in
  the last bit of a sixth of the float32 silus, so the bits are pinned against `x / (1 + exp(-x))` with
  numpy's exp, and the interpreter's float32 -> bf16 cast truncates (a GPU's rounds to nearest even), so
  there the reference truncates at both roundings too; the torch path itself within a rounding.
Rows of a decode and of a prefill chunk, odd and non-power-of-two widths, widths over one program's block,
rows of a wider buffer (strided), leading axes, no rows. Also GatedMLP's CUDA forward against its torch
path (on a GPU), and the kernel compiles for sm90 with CUDA's expf and a correctly rounded division
(tests/kernels/sm90_compile_norm.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
from kvc.runtime.models import norm_triton  # noqa: E402
from kvc.runtime.models.layers import GatedMLP  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRUNCATES = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's float32 -> bf16 cast


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch path of GatedMLP.forward on its fused output: silu in place on the gate half, then `* up`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clone()).mul_(up)


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 x cast as the kernel casts it: to nearest even, or truncated to bf16 under the interpreter."""
    if dtype != torch.bfloat16 or not TRUNCATES:
        return x.to(dtype)
    return (x.view(torch.int32) & -(1 << 16)).view(torch.float32).to(dtype)


def want_of(gate_up: torch.Tensor) -> torch.Tensor:
    """The kernel's bits: torch's path on a GPU; under the interpreter the same steps with numpy's exp and
    the interpreter's casts."""
    if not TRUNCATES:
        return torch_silu_mul(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    silu = gate / (1 + torch.from_numpy(np.exp(-gate.numpy())))
    return to_dtype(to_dtype(silu, gate_up.dtype).float() * up, gate_up.dtype)


def gate_up_of(tokens: int, width: int, dtype: torch.dtype, seed: int, spare: int = 0) -> torch.Tensor:
    """[tokens, 2 * width] in `dtype`, gate values around the silu's bend; with `spare` columns more per row
    in the buffer, a strided view of it."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(tokens, 2 * width + spare, generator=g) * 4).to(dtype).to(DEVICE)
    return full[:, spare:] if spare else full


# the torch path within its roundings: an ulp of float32 and fp16; in bf16 the interpreter's two truncations
# may each be a bf16 ulp (2^-7 relative) below torch's nearest
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -6 + 2 ** -8),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


def assert_same(got: torch.Tensor, gate_up: torch.Tensor) -> None:
    """got is the kernel's bits (`want_of`) and, within a rounding, torch's silu(gate) * up."""
    want = want_of(gate_up)
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.cpu(), want.cpu()), (got.float() - want.float()).abs().max()
    torch.testing.assert_close(got.float().cpu(), torch_silu_mul(gate_up).float().cpu(), **TOL[got.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 130])
@pytest.mark.parametrize("width", [1, 33, 96])
@torch.no_grad()
def test_silu_mul_equals_the_torch_path(dtype, tokens, width) -> None:
    gate_up = gate_up_of(tokens, width, dtype, seed=tokens * 1000 + width)
    before = gate_up.clone()
    got = norm_triton.silu_mul(gate_up)
    assert torch.equal(gate_up, before)  # the input is read, not written
    assert_same(got, gate_up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rows_wider_than_a_program_and_strided_rows(dtype) -> None:
    width = norm_triton.SILU_MUL_BLOCK + 37  # two programs a row, the second one masked
    gate_up = gate_up_of(3, width, dtype, seed=11, spare=5)  # rows 2 * width + 5 apart
    assert gate_up.stride(0) == 2 * width + 5
    assert_same(norm_triton.silu_mul(gate_up), gate_up)


@torch.no_grad()
def test_leading_axes_no_rows_and_an_odd_last_axis() -> None:
    gate_up = gate_up_of(6, 40, torch.float32, seed=12).view(2, 3, 80)
    got = norm_triton.silu_mul(gate_up)
    assert got.shape == (2, 3, 40)
    assert_same(got.view(6, 40), gate_up.view(6, 80))
    assert norm_triton.silu_mul(torch.empty(0, 80, device=DEVICE)).shape == (0, 40)
    with pytest.raises(ValueError, match="two equal halves"):
        norm_triton.silu_mul(torch.empty(2, 81, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GatedMLP calls the kernel on CUDA only")
@pytest.mark.parametrize("tokens", [1, 100])
@torch.no_grad()
def test_gated_mlp_on_cuda_gives_the_bits_of_its_torch_path(tokens) -> None:
    torch.manual_seed(13)
    mlp = GatedMLP(64, 96).to("cuda", torch.bfloat16)
    x = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    want = mlp.down_proj(torch_silu_mul(mlp.gate_up_proj(x)))
    assert torch.equal(mlp(x), want)


def test_the_kernel_compiles_for_sm90() -> None:
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_norm", "silu_mul")
