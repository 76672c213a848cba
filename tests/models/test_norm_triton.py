"""The fused RMSNorm and q/k norm + rotary kernels (runtime/models/norm_triton.py, used on CUDA)
against the torch path of layers.py they replace (the CPU runs them under TRITON_INTERPRET): equal
in float32 up to the sum order, and in bf16 within a few roundings (one rounding of the norm
before the weight can move each later rounded step)."""

import pytest
import torch

from kvc.runtime.models.layers import RMSNorm, apply_rope

norm_triton = pytest.importorskip("kvc.runtime.models.norm_triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def torch_norm(weight, eps, x):
    norm = RMSNorm(weight.shape[0], eps).to(x.device)
    norm.weight.data = weight.clone()
    return norm(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_rms_norm(dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 96, generator=g) * 3).to(dtype).to(DEV)
    w = torch.randn(96, generator=g).to(dtype).to(DEV)
    got = norm_triton.rms_norm(x, w, 1e-6)
    want = torch_norm(w, 1e-6, x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("tokens", [3, 37], ids=["decode", "blocks"])  # 37: two full blocks of 16 and a partial
@torch.no_grad()
def test_norm_rope(dtype, qk_norm, tokens) -> None:
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 4, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype).to(DEV)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)  # strided views, as Attention.forward has them
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)
    qw, kw = (torch.randn(d, generator=g).to(dtype).to(DEV) for _ in range(2))
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * torch.rand(d // 2, generator=g)[None, :] * 10
    cos, sin = angles.cos().to(dtype).to(DEV), angles.sin().to(dtype).to(DEV)
    got_q, got_k = norm_triton.norm_rope(q, k, qw if qk_norm else None, kw if qk_norm else None, 1e-6, cos, sin)
    want_q, want_k = (torch_norm(qw, 1e-6, q), torch_norm(kw, 1e-6, k)) if qk_norm else (q, k)
    want_q, want_k = apply_rope(want_q, cos, sin), apply_rope(want_k, cos, sin)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.is_contiguous() and got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **TOL[dtype])
    # no sum: the rotary's operations are the torch path's, bit for bit where the compiler does not
    # contract x1 * cos - x2 * sin into a fused multiply-add (the interpreter; a GPU build may)
    if not qk_norm and dtype == torch.float32 and DEV == "cpu":
        assert torch.equal(got_q.cpu(), want_q.cpu()) and torch.equal(got_k.cpu(), want_k.cpu())
    # with v, its contiguous copy comes from the same launch, q and k unchanged
    v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)[2].view(tokens, hkv, d)
    q3, k3, v3 = norm_triton.norm_rope(q, k, qw if qk_norm else None, kw if qk_norm else None, 1e-6, cos, sin, v=v)
    assert torch.equal(q3, got_q) and torch.equal(k3, got_k)
    assert v3.is_contiguous() and v3.data_ptr() != v.data_ptr() and torch.equal(v3, v)


def test_norm_rope_compiles_for_sm90() -> None:
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_norm", "norm_rope")
