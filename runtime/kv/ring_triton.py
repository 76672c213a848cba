"""A ranked ring's step in two Triton launches: the GPU backend of `ring.promote` (same contract).

`promote` (runtime/kv/ring.py; docs/design.md, "Decode rings") decides per decode row and KV head whether the
token leaving the recent window takes the lowest ranked slot, and moves it there in every TOKEN tensor. In
torch that is about 34 small launches a layer (index arithmetic, a min, an argmax, a gather and an index_put
per tensor), inside the decode graph at every step. Here:
1. `_choose_kernel`, one program per (row, KV head): the lowest score over the ranked slots [0, first[row]), ties
   to the newest position (the slot the selection would give up), against the leaving slot's score; it writes
   (leaving slot, chosen slot or -1) to a [B, Hkv, 2] buffer;
2. `_move_kernel`, one program per (row, KV head) and up to `MAX_TENSORS` tensors a launch: where a slot was
   chosen, the leaving slot's row of each tensor is copied into it (`slot_order_triton._copy_rows`).
The decision is made once, before any tensor moves (the positions it reads for ties move too). Rows without
a leaving slot (-1) do nothing. Static shapes, no host value: CUDA-graph safe. Import needs `triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.kv.slot_order_triton import _copy_rows, _rows, tensor_launches

BLOCK = 256  # ranked slots per block of the choice
NUM_WARPS = 4


@triton.jit
def _choose_kernel(scores_ptr, stride_sb, stride_sh, stride_sw, pos_ptr, stride_pp, stride_ph, stride_ps,
                   tables_ptr, stride_tb, leave_ptr, first_ptr, out_ptr,
                   NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    leave = tl.load(leave_ptr + row).to(tl.int64)
    first = tl.load(first_ptr + row).to(tl.int64)
    out = out_ptr + (row.to(tl.int64) * NUM_KV_HEADS + head) * 2
    chosen = leave * 0 - 1
    if (leave >= 0) & (first > 0):
        scores = scores_ptr + row.to(tl.int64) * stride_sb + head.to(tl.int64) * stride_sh
        table = tables_ptr + row.to(tl.int64) * stride_tb
        best = float("inf")
        best_pos = leave * 0 - 1
        best_slot = leave * 0
        for start in range(0, first, BLOCK):
            slot = start + tl.arange(0, BLOCK)
            inside = slot < first
            score = tl.load(scores + slot * stride_sw, mask=inside, other=float("inf"))
            page = tl.load(table + slot // PAGE, mask=inside, other=0).to(tl.int64)
            pos = tl.load(pos_ptr + page * stride_pp + head.to(tl.int64) * stride_ph + (slot % PAGE) * stride_ps,
                          mask=inside, other=-1).to(tl.int64)
            low = tl.min(score, axis=0)
            tied = inside & (score == low)
            newest = tl.max(tl.where(tied, pos, -1), axis=0)
            at = tl.max(tl.where(tied & (pos == newest), slot, -1), axis=0).to(tl.int64)
            better = (low < best) | ((low == best) & (newest > best_pos))
            best = tl.where(better, low, best)
            best_pos = tl.where(better, newest, best_pos)
            best_slot = tl.where(better, at, best_slot)
        leaving = tl.load(scores + leave * stride_sw)
        chosen = tl.where(leaving > best, best_slot, chosen)
    tl.store(out, leave)
    tl.store(out + 1, chosen)


@triton.jit
def _move_kernel(
    out_ptr, tables_ptr, stride_tb,
    t0_ptr, t1_ptr, t2_ptr, t3_ptr,
    stride_p0, stride_h0, stride_s0, stride_p1, stride_h1, stride_s1,
    stride_p2, stride_h2, stride_s2, stride_p3, stride_h3, stride_s3,
    NUM_KV_HEADS: tl.constexpr, NUM_TENSORS: tl.constexpr,
    ROW0: tl.constexpr, ROW1: tl.constexpr, ROW2: tl.constexpr, ROW3: tl.constexpr,
    PAGE0: tl.constexpr, PAGE1: tl.constexpr, PAGE2: tl.constexpr, PAGE3: tl.constexpr,
    BLOCK_R0: tl.constexpr, BLOCK_R1: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_R3: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    pair = out_ptr + (row.to(tl.int64) * NUM_KV_HEADS + head) * 2
    lane = tl.arange(0, 2)
    src = tl.load(pair + lane * 0)
    dst = tl.load(pair + 1 + lane * 0)
    valid = (lane == 0) & (dst >= 0)
    src = tl.where(valid, src, 0)
    dst = tl.where(valid, dst, 0)
    table = tables_ptr + row.to(tl.int64) * stride_tb
    _copy_rows(t0_ptr, stride_p0, stride_h0, stride_s0, head, table, src, dst, valid, ROW0, PAGE0, BLOCK_R0)
    if NUM_TENSORS > 1:
        _copy_rows(t1_ptr, stride_p1, stride_h1, stride_s1, head, table, src, dst, valid, ROW1, PAGE1, BLOCK_R1)
    if NUM_TENSORS > 2:
        _copy_rows(t2_ptr, stride_p2, stride_h2, stride_s2, head, table, src, dst, valid, ROW2, PAGE2, BLOCK_R2)
    if NUM_TENSORS > 3:
        _copy_rows(t3_ptr, stride_p3, stride_h3, stride_s3, head, table, src, dst, valid, ROW3, PAGE3, BLOCK_R3)


def promote_triton(tensors: list[torch.Tensor], positions: torch.Tensor, block_tables: torch.Tensor,
                   scores: torch.Tensor, leave: torch.Tensor, first: torch.Tensor) -> None:
    """`ring.promote` over the TOKEN tensors `tensors` (positions among them) of one layer's store: `scores
    [B, Hkv, W]`, `leave [B]`, `first [B]` ranked slots, `block_tables [B, P]` (contiguous rows)."""
    batch, heads, _ = scores.shape
    if batch == 0:
        return
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    page = positions.shape[2]
    out = torch.empty((batch, heads, 2), dtype=torch.int64, device=scores.device)
    _choose_kernel[(batch, heads)](
        scores, *scores.stride(), positions, *positions.stride()[:3], block_tables, block_tables.stride(0),
        leave, first, out, NUM_KV_HEADS=heads, PAGE=page, BLOCK=BLOCK, num_warps=NUM_WARPS)
    rows = [r for r in (_rows(t, heads) for t in tensors) if r[2] > 0]
    for tensor_args, consts in tensor_launches(rows):
        _move_kernel[(batch, heads)](out, block_tables, block_tables.stride(0), *tensor_args, NUM_KV_HEADS=heads,
                                     num_warps=NUM_WARPS, **consts)
