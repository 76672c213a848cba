"""Read plans built on the GPU: the Triton counterpart of `torch_primitives.read_pages` (docs/design.md,
"Plans": how a `read` lowers). Same signature, same plan up to the order of the ranked pages and to
how ties at the cut are broken; no host read and static shapes, so it runs inside captured decode
graphs.

One program per (row, KV head) holds the row's page scores in registers and finds the k-th largest
by bisection over the scores' order-preserving 32-bit keys (about log2(pages) + a few passes of
a compare-and-count, each one reduction), then writes the pages above the cut, the ties at it in
column order until k are listed, -1 up to k, and the newest pages. `torch.topk` over a few rows of
thousands of pages ran on too few blocks and, with the masking and concatenation around it, cost
about a dozen launches a layer; this is one.

A wide row (a 128K table: 8,321 pages, 16,384 lanes) keeps one program's lanes busy for every pass,
on a few SMs. It is cut in two passes instead: one program per slice of `SLICE` pages lists the
slice's best k as candidates (a slice's cut is at or below the row's, and the ties the row takes at
its cut are a prefix of each slice's, so the candidates hold the whole plan), then one program per
(row, KV head) cuts the candidates, far fewer lanes than the row.
"""

from __future__ import annotations

from math import ceil, floor

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

from kvc.runtime.primitives import torch_primitives

MAX_PAGES = 65536  # one program holds a row's scores in registers; wider rows take the torch path
NO_KEY = tl.constexpr(-2147483647 - 1)  # the smallest int32: the key of a lane that ranks no page
SLICE, SLICE_FROM = 1024, 8192  # rows of SLICE_FROM lanes and more are cut in two passes over slices of SLICE pages
# (A walk in blocks of 1,024 pages inside the row's one program was measured slower on the H200 in the
# model: Quest at 128K 13.14 ms a step against 10.91 with the one block, docs/benchmarks.md, "FP8 and KIVI
# on the H200"; it was removed. The two passes spread the slices over programs instead: 34 -> 15.5 µs on an
# H100 for a 128K table, docs/benchmarks.md, "the read plan in two passes".)


@triton.jit
def _order_key(x):
    # float32 -> int32 that orders as the floats do (negative floats: the magnitude bits reversed)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _block_keys(row, cols, W, first_newest):
    # (valid, order keys) of a block of a row's page scores: a page is ranked when it lies before the
    # always-read newest pages and its score is neither -inf nor NaN; other lanes get NO_KEY,
    # below every ranked page's key (keys stay 32-bit: the per-lane work of each pass is the kernel's cost)
    x = tl.load(row + cols, mask=cols < W, other=float("-inf"))
    valid = (cols < first_newest) & (x > float("-inf"))
    return valid, tl.where(valid, _order_key(x), NO_KEY)


@triton.jit
def _first_newest(lengths_ptr, r, N_LAST, PAGE: tl.constexpr):
    # the row's first always-read page: its stored pages less the N_LAST newest
    return (tl.load(lengths_ptr + r) + PAGE - 1) // PAGE - N_LAST


@triton.jit
def _cut(key, valid, N_TOP):
    # the N_TOP-th largest of the valid keys (every valid key when there are no more than N_TOP: the least
    # of them). A search over the keys' range in quarters: each pass counts the keys at or above three
    # pivots in one sum (the counts packed in 21-bit fields of an int64: a row holds fewer than 2^21 lanes),
    # two bits a pass for half the passes' cross-warp reductions of a bisection. The bounds are 64-bit
    # scalars (hi - lo spans up to 2^32); every bound compared with a key lies in the keys' range
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    lo = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64) + 1
    if n_valid > N_TOP:
        # invariant: at least N_TOP keys >= lo, fewer than N_TOP keys >= hi
        while hi - lo > 1:
            m1 = lo + (hi - lo) // 4
            m2 = lo + (hi - lo) // 2
            m3 = lo + (hi - lo) * 3 // 4
            packed = tl.sum((key >= m1.to(tl.int32)).to(tl.int64) + ((key >= m2.to(tl.int32)).to(tl.int64) << 21)
                            + ((key >= m3.to(tl.int32)).to(tl.int64) << 42), axis=0)
            a1, a2, a3 = packed & 0x1FFFFF, (packed >> 21) & 0x1FFFFF, packed >> 42
            above = a1
            if a3 >= N_TOP:
                lo, above = m3, a3
            elif a2 >= N_TOP:
                lo, hi, above = m2, m3, a2
            elif a1 >= N_TOP:
                lo, hi = m1, m2
            else:
                hi = m1
            if above == N_TOP:  # exactly N_TOP keys at or above lo: the cut
                hi = lo + 1
    return lo.to(tl.int32)


@triton.jit
def _taken(key, valid, cut, N_TOP):
    # the lanes above the cut, then the ties at it in lane order until N_TOP are taken
    take = valid & (key > cut)
    ties = valid & (key == cut)
    room = N_TOP - tl.sum(take.to(tl.int32), axis=0)
    return take | (ties & (tl.cumsum(ties.to(tl.int32), axis=0) <= room))


@triton.jit
def _store_plan(base, cols, take, first_newest, N_TOP, N_LAST, BLOCK: tl.constexpr, BLOCK_L: tl.constexpr):
    # the taken lanes' columns in lane order, -1 up to N_TOP, then the newest pages
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    listed = tl.sum(take.to(tl.int32), axis=0)
    lanes = tl.arange(0, BLOCK)
    tl.store(base + slot, cols, mask=take)
    tl.store(base + lanes, tl.full([BLOCK], -1, tl.int32), mask=(lanes >= listed) & (lanes < N_TOP))
    tail = tl.arange(0, BLOCK_L)
    newest = first_newest + tail
    tl.store(base + N_TOP + tail, tl.where(newest >= 0, newest, -1), mask=tail < N_LAST)


@triton.jit
def _read_pages_kernel(scores_ptr, lengths_ptr, out_ptr, stride_sr, stride_sh, stride_or, stride_oh,
                       W, N_TOP, N_LAST, PAGE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_L: tl.constexpr,
                       PDL: tl.constexpr = False):
    pdl_gate(PDL)
    r, h = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK_W)
    first_newest = _first_newest(lengths_ptr, r, N_LAST, PAGE)
    valid, key = _block_keys(scores_ptr + r * stride_sr + h * stride_sh, cols, W, first_newest)
    take = _taken(key, valid, _cut(key, valid, N_TOP), N_TOP)
    _store_plan(out_ptr + r * stride_or + h * stride_oh, cols, take, first_newest, N_TOP, N_LAST, BLOCK_W, BLOCK_L)


@triton.jit
def _slice_candidates_kernel(scores_ptr, lengths_ptr, key_ptr, col_ptr, stride_sr, stride_sh, W, N_TOP, N_LAST, CAND,
                             PAGE: tl.constexpr, SLICE: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # the first of a wide row's two passes: each slice of SLICE pages lists its best CAND (= min(N_TOP,
    # SLICE)) ranked pages as (key, column) in column order, the smallest int32 key and -1 after them
    r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = s * SLICE + tl.arange(0, SLICE)
    first_newest = _first_newest(lengths_ptr, r, N_LAST, PAGE)
    valid, key = _block_keys(scores_ptr + r * stride_sr + h * stride_sh, cols, W, first_newest)
    take = _taken(key, valid, _cut(key, valid, N_TOP), N_TOP)
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    listed = tl.sum(take.to(tl.int32), axis=0)
    base = ((r * tl.num_programs(1) + h) * tl.num_programs(2) + s) * CAND
    tl.store(key_ptr + base + slot, key, mask=take)
    tl.store(col_ptr + base + slot, cols, mask=take)
    pad = tl.arange(0, SLICE)
    tl.store(key_ptr + base + pad, tl.full([SLICE], NO_KEY, tl.int32), mask=(pad >= listed) & (pad < CAND))
    tl.store(col_ptr + base + pad, tl.full([SLICE], -1, tl.int32), mask=(pad >= listed) & (pad < CAND))


@triton.jit
def _cut_candidates_kernel(key_ptr, col_ptr, lengths_ptr, out_ptr, stride_or, stride_oh, N_CAND, N_TOP, N_LAST,
                           PAGE: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # the second pass: the row's plan from its slices' candidates, which hold every page the one-pass
    # plan takes (a slice's cut is at or below the row's, and the ties a row takes are a prefix of each
    # slice's), in column order
    r, h = tl.program_id(0), tl.program_id(1)
    lanes = tl.arange(0, BLOCK_C)
    base = (r * tl.num_programs(1) + h) * N_CAND
    key = tl.load(key_ptr + base + lanes, mask=lanes < N_CAND, other=NO_KEY)
    cols = tl.load(col_ptr + base + lanes, mask=lanes < N_CAND, other=-1)
    valid = key > NO_KEY
    first_newest = _first_newest(lengths_ptr, r, N_LAST, PAGE)
    take = _taken(key, valid, _cut(key, valid, N_TOP), N_TOP)
    _store_plan(out_ptr + r * stride_or + h * stride_oh, cols, take, first_newest, N_TOP, N_LAST, BLOCK_C, BLOCK_L)


def read_pages(scores: torch.Tensor, lengths: torch.Tensor, page: int, *, count, last,
               num_warps: int | None = None, slice_pages: int | None = None) -> torch.Tensor:
    """`torch_primitives.read_pages` on the GPU: [row, kv_head, n] int32 page-table columns (-1: none)
    from scores [row, kv_head, pages] and lengths [row]; the ranked pages come first, in column
    order, then the `ceil(last / page)` newest. A row of `SLICE_FROM` lanes or more is cut in two passes
    (module docstring); `slice_pages` (a power of two; 0: one pass) and `num_warps` override the choice
    (tests, benchmarks), except that two passes whose candidates would not halve the row's lanes run as one."""
    rows, kv_heads, width = scores.shape
    n_last = max(0, min(ceil(last / page), width))
    n_top = max(0, min(floor(count / page), width - n_last))
    if width > MAX_PAGES or rows == 0:
        return torch_primitives.read_pages(scores, lengths, page, count=count, last=last)
    scores = scores.float().contiguous()
    out = torch.empty(rows, kv_heads, n_top + n_last, dtype=torch.int32, device=scores.device)
    block_w = triton.next_power_of_2(max(width, n_top, 16))
    block_l = triton.next_power_of_2(max(n_last, 1))
    if slice_pages is None:
        slice_pages = SLICE if block_w >= SLICE_FROM else 0
    slices = -(-width // slice_pages) if slice_pages else 0
    cand = min(n_top, slice_pages)
    block_c = triton.next_power_of_2(max(slices * cand, n_top, 16))
    if not slices or not n_top or 2 * block_c > block_w:  # one pass: the candidates would not halve the lanes
        _read_pages_kernel[(rows, kv_heads)](
            scores, lengths, out, scores.stride(0), scores.stride(1), out.stride(0), out.stride(1),
            width, n_top, n_last, PAGE=page, BLOCK_W=block_w, BLOCK_L=block_l,
            num_warps=num_warps or _warps(block_w), **pdl_options(scores.device),
        )
        return out
    keys = torch.empty(rows, kv_heads, slices * cand, dtype=torch.int32, device=scores.device)
    cols = torch.empty_like(keys)
    _slice_candidates_kernel[(rows, kv_heads, slices)](
        scores, lengths, keys, cols, scores.stride(0), scores.stride(1), width, n_top, n_last, cand,
        PAGE=page, SLICE=slice_pages, num_warps=_warps(slice_pages), **pdl_options(scores.device),
    )
    _cut_candidates_kernel[(rows, kv_heads)](
        keys, cols, lengths, out, out.stride(0), out.stride(1), slices * cand, n_top, n_last,
        PAGE=page, BLOCK_C=block_c, BLOCK_L=block_l, num_warps=num_warps or _warps(block_c),
        **pdl_options(scores.device),
    )
    return out


def _warps(lanes: int) -> int:
    return max(4, min(16, lanes // 512))
