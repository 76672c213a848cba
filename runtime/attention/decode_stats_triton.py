"""Decode attention statistics as Triton kernels (the GPU backend of `decode_stats.py`).

Two passes over each sequence's pages, both reading only the step's device tensors:

1. `_row_stats_kernel`, one program per (sequence, KV head): the softmax max and normaliser of
   each query head of the GQA group over the row's keys (online, tile by tile).
2. `_probs_kernel`, one program per (sequence, output row, key tile): recomputes q·k for the
   tile, turns it into probabilities with pass 1's max and normaliser, and folds the heads of the
   output row (the group, every head, or none) before one store. No atomics: the fold order is
   fixed, so results are deterministic.

Scores use `tl.dot` in fp32 ("ieee") with the group padded to 16 rows; all arithmetic is fp32.
Import needs `triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.attention.decode_stats import check_args

_REDUCE_CODES = {"none": 0, "group": 1, "head": 2}


@triton.jit
def _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh,
                GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask,
                other=0.0)
    return q.to(tl.float32)


@triton.jit
def _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    pages = tl.load(table + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    ptrs = (k_cache_ptr + kv_head * stride_kh + pages[:, None] * stride_kp
            + (tokens % PAGE_SIZE)[:, None] * stride_ks + offs_d[None, :])
    k = tl.load(ptrs, mask=token_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    return k.to(tl.float32)


@triton.jit
def _row_stats_kernel(
    q_ptr, k_cache_ptr, block_tables_ptr, context_lens_ptr, m_ptr, l_ptr, scale,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_bt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    q = _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: exp(m_old - m_new) never sees inf - inf
    l = tl.zeros([BLOCK_H], tl.float32)
    for tile in range(0, context_len, BLOCK_N):
        tokens = tile + offs_n
        token_mask = tokens < context_len
        k = _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
                       HEAD_DIM, BLOCK_D, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(token_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
        m = m_new
    row = seq.to(tl.int64) * num_heads + kv_head * GROUP + offs_h
    tl.store(m_ptr + row, m, mask=offs_h < GROUP)
    tl.store(l_ptr + row, l, mask=offs_h < GROUP)


@triton.jit
def _probs_kernel(
    q_ptr, k_cache_ptr, block_tables_ptr, context_lens_ptr, m_ptr, l_ptr, out_ptr, scale, width, num_kv_heads,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_ks, stride_bt, stride_ob, stride_or,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, KV_PER_PROGRAM: tl.constexpr,
    REDUCE: tl.constexpr, MEAN: tl.constexpr,
):
    seq = tl.program_id(0)
    program_row = tl.program_id(1)
    num_heads = num_kv_heads * GROUP
    context_len = tl.load(context_lens_ptr + seq)
    offs_h = tl.arange(0, BLOCK_H)
    head_mask = offs_h < GROUP
    tokens = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < context_len
    in_width = tokens < width
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    out_row = out_ptr + seq.to(tl.int64) * stride_ob
    acc = tl.zeros([BLOCK_N], tl.float32)
    for i in range(KV_PER_PROGRAM):
        kv_head = program_row * KV_PER_PROGRAM + i
        q = _load_group(q_ptr, seq, kv_head, stride_qb, stride_qh, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D)
        k = _load_keys(k_cache_ptr, table, kv_head, tokens, token_mask, stride_kp, stride_kh, stride_ks,
                       HEAD_DIM, BLOCK_D, PAGE_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        heads = kv_head * GROUP + offs_h
        stats = seq.to(tl.int64) * num_heads + heads
        m = tl.load(m_ptr + stats, mask=head_mask, other=0.0)
        l = tl.load(l_ptr + stats, mask=head_mask, other=1.0)
        s = tl.where(head_mask[:, None] & token_mask[None, :], s, float("-inf"))
        p = tl.exp(s - m[:, None]) / tl.where(l > 0, l, 1.0)[:, None]  # masked entries: exactly 0
        if REDUCE == 0:
            tl.store(out_row + heads[:, None] * stride_or + tokens[None, :], p,
                     mask=head_mask[:, None] & in_width[None, :])
        else:
            acc += tl.sum(p, axis=0)
    if REDUCE != 0:
        if MEAN:
            acc = acc / (GROUP * KV_PER_PROGRAM)
        tl.store(out_row + program_row * stride_or + tokens, acc, mask=in_width)


def decode_stats_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    reduce: str,
    fn: str | None = "mean",
) -> torch.Tensor:
    """Same contract as `decode_stats.decode_stats_torch`."""
    check_args(q, k_cache, out, reduce, fn)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    width = out.shape[-1]
    if num_seqs == 0 or width == 0:
        return out
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("q, the cache and out need a contiguous last axis")
    group = num_heads // num_kv_heads
    stats = torch.empty((2, num_seqs * num_heads), dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if head_dim <= 128 else 32
    common = dict(GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=page_size,
                  BLOCK_N=block_n)
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0))
    _row_stats_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, block_tables, context_lens, stats[0], stats[1], scale, *strides, **common)
    per_program = num_kv_heads if reduce == "head" else 1
    grid = (num_seqs, num_kv_heads // per_program, triton.cdiv(width, block_n))
    _probs_kernel[grid](
        q, k_cache, block_tables, context_lens, stats[0], stats[1], out, scale, width, num_kv_heads,
        *strides, out.stride(0), out.stride(1), KV_PER_PROGRAM=per_program, REDUCE=_REDUCE_CODES[reduce],
        MEAN=fn == "mean", **common)
    return out
