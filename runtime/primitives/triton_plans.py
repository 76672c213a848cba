"""Read plans built on the GPU: the Triton counterpart of `torch_primitives.read_pages` (docs/design.md,
"Plans": how a `read` lowers). Same signature, same plan up to the order of the ranked pages and to
how ties at the cut are broken; no host read and static shapes, so it runs inside captured decode
graphs.

One program per (row, KV head) holds the row's page scores in registers and finds the k-th largest
by bisection over the scores' order-preserving integer keys (about log2(pages) + a few passes of
a compare-and-count, each one reduction), then writes the pages above the cut, the ties at it in
column order until k are listed, -1 up to k, and the newest pages. `torch.topk` over a few rows of
thousands of pages ran on too few blocks and, with the masking and concatenation around it, cost
about a dozen launches a layer; this is one.
"""

from __future__ import annotations

from math import ceil, floor

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives import torch_primitives

MAX_PAGES = 65536  # one program holds a row's scores in registers; wider rows take the torch path
# (A walk in blocks of 1,024 pages for rows whose one block is mostly padding was measured slower on
# the H200 in the model: Quest at 128K 13.14 ms a step against 10.91 with the one block,
# docs/benchmarks.md, "FP8 and KIVI on the H200"; it was removed.)


@triton.jit
def _order_key(x):
    # float32 -> int32 that orders as the floats do (negative floats: the magnitude bits reversed)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _block_keys(row, cols, W, first_newest):
    # (valid, order keys) of a block of a row's page scores: a page is ranked when it lies before the
    # always-read newest pages and its score is neither -inf nor NaN; other lanes get the smallest int32,
    # below every ranked page's key (keys stay 32-bit: the per-lane work of each pass is the kernel's cost)
    x = tl.load(row + cols, mask=cols < W, other=float("-inf"))
    valid = (cols < first_newest) & (x > float("-inf"))
    return valid, tl.where(valid, _order_key(x), -2147483647 - 1)


@triton.jit
def _read_pages_kernel(scores_ptr, lengths_ptr, out_ptr, stride_sr, stride_sh, stride_or, stride_oh,
                       W, N_TOP, N_LAST, PAGE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_W)
    stored = (tl.load(lengths_ptr + r) + PAGE - 1) // PAGE
    first_newest = stored - N_LAST  # the always-read pages start here
    valid, key = _block_keys(scores_ptr + r * stride_sr + h * stride_sh, cols, W, first_newest)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    # the cut: the N_TOP-th largest key (every valid page when there are no more than N_TOP); the bounds
    # are 64-bit scalars (hi - lo spans up to 2^32), every bound compared with a key lies in the keys' range
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64) + 1
    if n_valid > N_TOP:
        # invariant: at least N_TOP keys >= lo, fewer than N_TOP keys >= hi
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            above = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
            if above >= N_TOP:
                lo = mid
                if above == N_TOP:
                    hi = mid + 1
            else:
                hi = mid
    cut = lo.to(tl.int32)
    take = valid & (key > cut)
    ties = valid & (key == cut)
    room = N_TOP - tl.sum(take.to(tl.int32), axis=0)
    take = take | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    listed = tl.sum(take.to(tl.int32), axis=0)
    base = out_ptr + r * stride_or + h * stride_oh
    tl.store(base + slot, cols, mask=take)
    tl.store(base + cols, tl.full([BLOCK_W], -1, tl.int32), mask=(cols >= listed) & (cols < N_TOP))
    tail = tl.arange(0, BLOCK_L)
    newest = first_newest + tail
    tl.store(base + N_TOP + tail, tl.where(newest >= 0, newest, -1), mask=tail < N_LAST)


def read_pages(scores: torch.Tensor, lengths: torch.Tensor, page: int, *, count, last,
               num_warps: int | None = None) -> torch.Tensor:
    """`torch_primitives.read_pages` on the GPU: [row, kv_head, n] int32 page-table columns (-1: none)
    from scores [row, kv_head, pages] and lengths [row]; the ranked pages come first, in column
    order, then the `ceil(last / page)` newest. `num_warps` overrides the launch's (benchmarks)."""
    rows, kv_heads, width = scores.shape
    n_last = max(0, min(ceil(last / page), width))
    n_top = max(0, min(floor(count / page), width - n_last))
    if width > MAX_PAGES or rows == 0:
        return torch_primitives.read_pages(scores, lengths, page, count=count, last=last)
    scores = scores.float().contiguous()
    out = torch.empty(rows, kv_heads, n_top + n_last, dtype=torch.int32, device=scores.device)
    block_w = triton.next_power_of_2(max(width, n_top, 16))
    _read_pages_kernel[(rows, kv_heads)](
        scores, lengths, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
        width, n_top, n_last, PAGE=page, BLOCK_W=block_w, BLOCK_L=triton.next_power_of_2(max(n_last, 1)),
        num_warps=num_warps or max(4, min(16, block_w // 512)),
    )
    return out
