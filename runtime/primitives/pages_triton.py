"""A row's cache pages gathered head-major in one Triton launch (CUDA): the GPU path of `torch_ops.gather_kv`.

A prefill chunk over a cached prefix reads the row's keys and values as dense [Hkv, tokens, D] operands of
the fused attention call. The cache holds them as pages [P, Hkv, page_size, D], so the torch path selects
the pages (one copy, page-major) and then lays them out head-major (a second copy). Here each program
copies one (page, head) block of page_size x D contiguous elements straight to its place in the
head-major output: every byte is read and written once. The torch path stays the CPU's and the oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(cache_ptr, ids_ptr, out_ptr, stride_p, stride_h, out_stride_h, ROW: tl.constexpr,
                   BLOCK: tl.constexpr):
    p = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    page = tl.load(ids_ptr + p).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < ROW
    block = tl.load(cache_ptr + page * stride_p + h * stride_h + offs, mask=ok)
    tl.store(out_ptr + h * out_stride_h + p.to(tl.int64) * ROW + offs, block, mask=ok)


def fits(cache: torch.Tensor, page_ids: torch.Tensor) -> bool:
    """Whether `gather` serves this call: one row's page ids, each (page, head) block contiguous."""
    return (page_ids.dim() == 1 and cache.dim() == 4 and cache.stride(3) == 1
            and cache.stride(2) == cache.shape[3])


def gather(cache: torch.Tensor, page_ids: torch.Tensor) -> torch.Tensor:
    """cache [P, Hkv, S, D], page_ids [n] -> [Hkv, n * S, D]: the pages' slots in order, head-major."""
    _, heads, page_size, dim = cache.shape
    n = page_ids.numel()
    out = cache.new_empty(heads, n * page_size, dim)
    if n == 0:
        return out
    row = page_size * dim
    block = triton.next_power_of_2(row)
    _gather_kernel[(n, heads)](cache, page_ids, out, cache.stride(0), cache.stride(1), out.stride(0),
                               ROW=row, BLOCK=block, num_warps=4 if block <= 4096 else 8)
    return out
