"""A read over cluster indices built on the GPU: the Triton counterpart of `clusters.read_clusters`, the same
plan (ties included: the lower cluster first) in three launches instead of about sixty small torch kernels a
layer (docs/design.md, "Cluster indices"). No host read and static shapes, so it runs inside captured graphs.

1. `_ranks_kernel`, one program per (row, KV head): the present clusters' scores as order-preserving 32-bit
   keys, the read's best n and the read-or-estimated best n + m by bisection (both cuts in one loop,
   `_cut_pair`; ties at the cut in cluster order), each count clamped to the present clusters; it
   writes which clusters are read (`chosen`) and the estimate's log-weights (log(size) for the next m, -inf for
   the rest).
2. `_slice_counts_kernel`, one program per (row, KV head, slice of SLICE indexed slots): how many of the
   slice's slots lie in a read cluster.
3. `_slice_tokens_kernel`, same grid: each slice writes its listed slots after the row's first slots and the
   earlier slices' (a prefix over the counts of pass 2), -1 over its share of the rest; the first slice writes
   the head's count (and, for head 0, the row's `last`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.torch_primitives import per_row
from kvc.runtime.primitives.triton_plans import NO_KEY, _order_key, _taken

SLICE = 4096  # indexed slots a program of the token passes walks (in blocks of BLOCK)
BLOCK = 1024


@triton.jit
def _row(rows_ptr, r, HAS_ROWS: tl.constexpr):
    # decode row r's row of the index: rows[r] over views of every sequence row, else r (gathered rows)
    if HAS_ROWS:
        return tl.load(rows_ptr + r).to(tl.int64)
    return r.to(tl.int64)


@triton.jit
def _step(lo, hi, mid, above, N_TOP):
    # one bisection step (`triton_plans._cut`'s invariant: at least N_TOP keys >= lo, fewer than N_TOP >= hi)
    if hi - lo > 1:
        if above >= N_TOP:
            lo = mid
            if above == N_TOP:
                hi = mid + 1
        else:
            hi = mid
    return lo, hi


@triton.jit
def _cut_pair(key, valid, N1, N2):
    # the cuts (`triton_plans._cut`) of two counts at once, the read's and the read-or-estimated's: two
    # bisections advance together, each pass one sum of the lanes' two tests packed in the halves of an int64
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    lo1 = tl.min(tl.where(valid, key, 2147483647), axis=0).to(tl.int64)
    hi1 = tl.max(key, axis=0).to(tl.int64) + 1
    lo2, hi2 = lo1, hi1
    if n_valid <= N1:  # every valid key is taken: the least of them
        hi1 = lo1 + 1
    if n_valid <= N2:
        hi2 = lo2 + 1
    while (hi1 - lo1 > 1) | (hi2 - lo2 > 1):
        mid1 = lo1 + (hi1 - lo1) // 2
        mid2 = lo2 + (hi2 - lo2) // 2
        both = tl.sum((key >= mid1.to(tl.int32)).to(tl.int64) + ((key >= mid2.to(tl.int32)).to(tl.int64) << 32), axis=0)
        lo1, hi1 = _step(lo1, hi1, mid1, both & 0xFFFFFFFF, N1)
        lo2, hi2 = _step(lo2, hi2, mid2, both >> 32, N2)
    return lo1.to(tl.int32), lo2.to(tl.int32)


@triton.jit
def _ranks_kernel(scores_ptr, sizes_ptr, rows_ptr, read_ptr, estimate_ptr, chosen_ptr, log_w_ptr, C, size,
                  stride_zr, stride_zh, BLOCK_C: tl.constexpr, HAS_ROWS: tl.constexpr):
    r, h = tl.program_id(0), tl.program_id(1)
    base = (r * tl.num_programs(1) + h) * C
    cols = tl.arange(0, BLOCK_C)
    x = tl.load(scores_ptr + base + cols, mask=cols < C, other=float("-inf"))
    sizes = tl.load(sizes_ptr + _row(rows_ptr, r, HAS_ROWS) * stride_zr + h * stride_zh + cols, mask=cols < C,
                    other=0.0)
    valid = sizes > 0
    key = tl.where(valid, _order_key(x), NO_KEY)
    present = tl.sum(valid.to(tl.int32), axis=0)
    # ceil(tokens / size) clusters, at least 0, at most the present ones (as `clusters._clusters`)
    n_read = tl.minimum(tl.maximum(tl.ceil(tl.load(read_ptr + r) / size), 0.0).to(tl.int32), present)
    n_both = tl.minimum(n_read + tl.maximum(tl.ceil(tl.load(estimate_ptr + r) / size), 0.0).to(tl.int32), present)
    cut_read, cut_both = _cut_pair(key, valid, n_read, n_both)
    read = _taken(key, valid, cut_read, n_read)
    both = _taken(key, valid, cut_both, n_both)
    tl.store(chosen_ptr + base + cols, read.to(tl.int8), mask=cols < C)
    log_w = tl.where(both & ~read, tl.log(tl.maximum(sizes, 1.0)), float("-inf"))
    tl.store(log_w_ptr + base + cols, log_w, mask=cols < C)


@triton.jit
def _listed(members_ptr, chosen_ptr, base_m, base_c, i, N):
    m = tl.load(members_ptr + base_m + i, mask=i < N, other=-1)
    c = tl.load(chosen_ptr + base_c + tl.maximum(m, 0), mask=m >= 0, other=0)
    return (m >= 0) & (c != 0)


@triton.jit
def _slice_counts_kernel(members_ptr, rows_ptr, chosen_ptr, counts_ptr, N, C, stride_mr, stride_mh,
                         SLICE: tl.constexpr, BLOCK: tl.constexpr, HAS_ROWS: tl.constexpr):
    r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rh = r * tl.num_programs(1) + h
    base_m = _row(rows_ptr, r, HAS_ROWS) * stride_mr + h * stride_mh
    n = 0
    for i0 in range(s * SLICE, s * SLICE + SLICE, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        n += tl.sum(_listed(members_ptr, chosen_ptr, base_m, rh * C, i, N).to(tl.int32), axis=0)
    tl.store(counts_ptr + rh * tl.num_programs(2) + s, n)


@triton.jit
def _slice_tokens_kernel(members_ptr, rows_ptr, chosen_ptr, slice_counts_ptr, starts_ptr, ends_ptr, lengths_ptr,
                         out_ptr, counts_ptr, last_ptr, N, C, W, FIRST, stride_mr, stride_mh, stride_s, stride_e,
                         SLICE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr,
                         HAS_ROWS: tl.constexpr):
    r, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rh = r * tl.num_programs(1) + h
    row = _row(rows_ptr, r, HAS_ROWS)
    base_m = row * stride_mr + h * stride_mh
    slices = tl.num_programs(2)
    start = tl.load(starts_ptr + row * stride_s).to(tl.int32)
    head = tl.minimum(FIRST, start)  # the row's first slots, read exactly, before the index
    earlier = tl.arange(0, BLOCK_S)
    per_slice = tl.load(slice_counts_ptr + rh * slices + earlier, mask=earlier < slices, other=0)
    total = head + tl.sum(per_slice, axis=0)
    at = head + tl.sum(tl.where(earlier < s, per_slice, 0), axis=0)
    out = out_ptr + rh * W
    for i0 in range(s * SLICE, s * SLICE + SLICE, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        listed = _listed(members_ptr, chosen_ptr, base_m, rh * C, i, N)
        tl.store(out + at + tl.cumsum(listed.to(tl.int32), axis=0) - 1, start + i, mask=listed)
        at += tl.sum(listed.to(tl.int32), axis=0)
    share = -(-W // slices)  # -1 past the listed slots, each slice over its share of the width
    for j0 in range(s * share, s * share + share, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(out + j, tl.full([BLOCK], -1, tl.int32), mask=(j >= total) & (j < W) & (j < s * share + share))
    if s == 0:
        f = tl.arange(0, BLOCK_F)
        tl.store(out + f, f, mask=f < head)
        tl.store(counts_ptr + rh, total)
        if h == 0:
            last = tl.load(lengths_ptr + r).to(tl.int64) - tl.load(ends_ptr + row * stride_e).to(tl.int64)
            tl.store(last_ptr + r, tl.maximum(last, 0).to(tl.int32))


def read_clusters(scores, inputs, count, size, first=0, estimate=None, using=None):
    """`clusters.read_clusters` on the GPU (module docstring): the same answer, (tokens [B, Hkv, first + N]
    int32 packed, last [B] int32, the estimate (keys, value sums, log_weights[, rows]) or None, counts [B, Hkv]
    int32). The index as gathered rows, or as views over every sequence row with `rows` [B] (`sizes`, `members`,
    `starts`, `ends` and the summaries; `ClusterIndices.inputs(gather=False)`): the kernels then read each decode
    row's own, and so does the estimate (its `rows`). No copy of any input either way."""
    sizes, members, index_rows = inputs["sizes"], inputs["members"], inputs.get("rows")
    if sizes.dtype != torch.float32 or sizes.stride(-1) != 1:
        sizes = sizes.float().contiguous()
    if members.dtype != torch.int32 or members.stride(-1) != 1:
        members = members.to(torch.int32).contiguous()
    _, kv_heads, clusters = sizes.shape
    rows, width = scores.shape[0], members.shape[-1]
    device = scores.device
    has_rows = index_rows is not None
    row_ids = index_rows if has_rows else sizes  # (a pointer the kernels never read without rows)
    first = max(0, int(first))
    chosen = torch.empty(rows, kv_heads, clusters, dtype=torch.int8, device=device)
    log_w = torch.empty(rows, kv_heads, clusters, dtype=torch.float32, device=device)
    read = per_row(count, rows, device).to(torch.float64).contiguous()
    guessed = per_row(0 if estimate is None else estimate, rows, device).to(torch.float64).contiguous()
    if clusters:
        _ranks_kernel[(rows, kv_heads)](scores.float().contiguous(), sizes, row_ids, read, guessed, chosen, log_w,
                                        clusters, float(size), sizes.stride(0), sizes.stride(1),
                                        BLOCK_C=triton.next_power_of_2(max(clusters, 16)), HAS_ROWS=has_rows,
                                        num_warps=max(4, min(16, triton.next_power_of_2(clusters) // 512)))
    slices = max(1, -(-width // SLICE))
    per_slice = torch.empty(rows, kv_heads, slices, dtype=torch.int32, device=device)
    tokens = torch.empty(rows, kv_heads, first + width, dtype=torch.int32, device=device)
    counts = torch.empty(rows, kv_heads, dtype=torch.int32, device=device)
    last = torch.empty(rows, dtype=torch.int32, device=device)
    grid = (rows, kv_heads, slices)
    _slice_counts_kernel[grid](members, row_ids, chosen, per_slice, width, clusters, members.stride(0),
                               members.stride(1), SLICE=SLICE, BLOCK=BLOCK, HAS_ROWS=has_rows)
    starts, ends = inputs["starts"], inputs["ends"]  # strided views (over every sequence row with `rows`)
    _slice_tokens_kernel[grid](members, row_ids, chosen, per_slice, starts, ends, inputs["lengths"].contiguous(),
                               tokens, counts, last, width, clusters, first + width, first, members.stride(0),
                               members.stride(1), starts.stride(0), ends.stride(0), SLICE=SLICE, BLOCK=BLOCK,
                               BLOCK_S=triton.next_power_of_2(slices), BLOCK_F=triton.next_power_of_2(max(first, 1)),
                               HAS_ROWS=has_rows)
    if estimate is None or clusters == 0:
        return tokens, last, None, counts
    key_name, value_name = using
    return tokens, last, (inputs[key_name], inputs[value_name], log_w, *((index_rows,) if has_rows else ())), counts
