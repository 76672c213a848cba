"""Two attention parts over disjoint keys merged by their log-sum-exps in one Triton launch (CUDA).

A prefill chunk over a cached prefix runs as two fused calls, the prefix with no mask and the chunk
causally (`torch_ops._attend_over_prefix`); softmax over both is each part's output weighted by its share
of the total mass, `w = sigmoid(lse_prefix - lse_chunk)`, `out = o_chunk + w * (o_prefix - o_chunk)`. The
torch path does that in float32 copies of both outputs (six launches, two [n, Hq, D] float32 tensors);
this reads the two outputs once in their own dtype and writes the result token-major, as the output
projection reads it. The CPU keeps the torch path (the oracle). docs/design.md, "Prefill attention".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(a_ptr, la_ptr, b_ptr, lb_ptr, out_ptr, n, sa_h, sa_t, sb_h, sb_t, sla_h, sla_t, slb_h, slb_t,
                  so_t, so_h, D, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    rows = t < n
    mask = rows[:, None] & (d[None, :] < D)
    la = tl.load(la_ptr + h * sla_h + t * sla_t, mask=rows, other=0.0).to(tl.float32)
    lb = tl.load(lb_ptr + h * slb_h + t * slb_t, mask=rows, other=0.0).to(tl.float32)
    w = tl.sigmoid(la - lb)[:, None]
    a = tl.load(a_ptr + h * sa_h + t[:, None] * sa_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + h * sb_h + t[:, None] * sb_t + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = b + w * (a - b)
    tl.store(out_ptr + t[:, None] * so_t + h * so_h + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over keys A and B (disjoint) from each part's output o [1, Hq, n, D] (any strides, the
    head dim contiguous) and log-sum-exp [1, Hq, n]: [1, Hq, n, D] in o_b's dtype, a view of a token-major
    [n, Hq, D] tensor (`out` where given: rows of a larger one, say)."""
    _, heads, n, dim = o_b.shape
    assert o_a.stride(-1) == 1 and o_b.stride(-1) == 1, "the head dim must be contiguous"
    if out is None:
        out = torch.empty(n, heads, dim, dtype=o_b.dtype, device=o_b.device)
    assert out.shape == (n, heads, dim) and out.stride(-1) == 1, "out: [n, Hq, D], the head dim contiguous"
    block_d = triton.next_power_of_2(dim)
    block_t = max(1, 4096 // block_d)
    _merge_kernel[(triton.cdiv(n, block_t), heads)](
        o_a, lse_a, o_b, lse_b, out, n, o_a.stride(1), o_a.stride(2), o_b.stride(1), o_b.stride(2),
        lse_a.stride(1), lse_a.stride(2), lse_b.stride(1), lse_b.stride(2), out.stride(0), out.stride(1), dim,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4)
    return out.transpose(0, 1)[None]
