"""Two attention parts merged by their log-sum-exps in one launch (runtime/primitives/merge_triton.py) against
the torch path's float32 lerp (`torch_ops._attend_over_prefix`) and against attention over both parts at once:
outputs in cuDNN's token-major strides and in plain [1, Hq, n, D], a head dim that is not a power of two, one
part holding nearly all the mass. Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py sets it); on a
GPU the compiled kernel, and a chunk over a prefix through the engine's SDPA path (cuDNN's two calls and this
merge) against float64 attention."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from kvc.runtime.primitives import merge_triton  # noqa: E402


def _part(q, k, v, scale):
    """(out [1, Hq, n, Dv], lse [1, Hq, n]) of q [1, Hq, n, D] over all of k, v [1, Hq, m, D] (float64)."""
    logits = (q.double() @ k.double().transpose(-1, -2)) * scale
    return torch.softmax(logits, dim=-1) @ v.double(), torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("token_major", [True, False], ids=["cudnn-strides", "contiguous"])
@pytest.mark.parametrize("dim", [16, 24])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_equals_attention_over_both_parts(token_major, dim, dtype):
    g = torch.Generator().manual_seed(dim)
    heads, n, m_a, m_b = 3, 37, 50, 29
    q = torch.randn(1, heads, n, dim, generator=g)
    k = torch.randn(1, heads, m_a + m_b, dim, generator=g)
    v = torch.randn(1, heads, m_a + m_b, dim, generator=g)
    k[:, 1, :m_a] *= 4  # head 1: part A holds nearly all the mass
    scale = dim ** -0.5
    o_a, lse_a = _part(q, k[:, :, :m_a], v[:, :, :m_a], scale)
    o_b, lse_b = _part(q, k[:, :, m_a:], v[:, :, m_a:], scale)
    want, _ = _part(q, k, v, scale)

    def laid(o):  # the part's output as its kernel hands it
        o = o.to(dtype)
        return o[0].transpose(0, 1).contiguous().transpose(0, 1)[None] if token_major else o.contiguous()

    got = merge_triton.merge(laid(o_a).to(DEVICE), lse_a.float().to(DEVICE), laid(o_b).to(DEVICE),
                             lse_b.float().to(DEVICE))
    assert got.shape == (1, heads, n, dim) and got.dtype == dtype
    assert got[0].transpose(0, 1).is_contiguous()  # token-major, as the output projection reads it
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol)
    # the torch path's float32 lerp, rounded as it is (bf16: within one unit of the last place, where torch's
    # lerp takes the other end for weights over 1/2)
    w = torch.sigmoid(lse_a.float() - lse_b.float()).unsqueeze(-1)
    lerp = torch.lerp(laid(o_b).float(), laid(o_a).float(), w).to(dtype)
    ulp = 1e-6 if dtype == torch.float32 else 2.0 ** -7
    torch.testing.assert_close(got.cpu(), lerp, atol=ulp, rtol=ulp)


def test_merge_into_rows_of_a_larger_output():
    """`out`: the merge writes rows of a larger token-major tensor (a query block's), and nothing else."""
    g = torch.Generator().manual_seed(3)
    heads, n, dim = 2, 9, 16
    o_a, o_b = (torch.randn(1, heads, n, dim, generator=g).to(DEVICE) for _ in range(2))
    lse_a, lse_b = (torch.randn(1, heads, n, generator=g).to(DEVICE) for _ in range(2))
    whole = torch.full((n + 7, heads, dim), 5.0, device=DEVICE)
    got = merge_triton.merge(o_a, lse_a, o_b, lse_b, whole[3:3 + n])
    want = merge_triton.merge(o_a, lse_a, o_b, lse_b)
    assert got.data_ptr() == whole[3].data_ptr() and got.shape == (1, heads, n, dim)
    torch.testing.assert_close(whole[3:3 + n], want[0].transpose(0, 1), atol=0, rtol=0)
    assert (whole[:3] == 5).all() and (whole[3 + n:] == 5).all()


@pytest.mark.skipif(DEVICE.type != "cuda", reason="cuDNN's two calls and the merge: GPU only")
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_a_chunk_over_a_prefix_on_the_gpu(heads, kv_heads):
    """The engine's SDPA prefill over a cached prefix: GQA keys as they are (no repeat), the merge kernel."""
    from kvc.runtime.attention.torch_ops import attend_chunk

    g = torch.Generator().manual_seed(heads + kv_heads)
    n, m, dim = 300, 1000, 128
    q = torch.randn(1, heads, n, dim, generator=g, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, m, dim, generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, m, dim, generator=g, dtype=torch.bfloat16)
    got = attend_chunk(q.cuda(), k.cuda(), v.cuda(), dim ** -0.5)
    group = heads // kv_heads
    kk, vv = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    logits = (q.double() @ kk.transpose(-1, -2)) * dim ** -0.5
    logits = logits.masked_fill(torch.arange(m)[None, :] > torch.arange(m - n, m)[:, None], float("-inf"))
    want = torch.softmax(logits, dim=-1) @ vv
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)
