"""A decode step's per-layer bookkeeping writes as one Triton launch each (the GPU backend of
`slot_order.record` and of `query_window.record`'s decode rows; same contracts). In torch each is a
handful of small launches per layer (index casts, a gather, a remainder, index writes), about a
tenth of a decode step's launches at every layer; here one program per token or row does it.

- `record_positions`: the step's tokens' logical positions into a positions plane `[pages + 1, Hkv, S]`,
  every KV head, at their slots (-1: the scratch page's slot 0), as `slot_order.record`.
- `record_queries`: each decode row's query `q[i]` [Hq, D] into its row's query window in `layer` at slot
  `count % window`, and its count one up, as `query_window.record` does for decode rows (rows distinct).

Both read device tensors only (no host value): they run inside captured decode graphs. Import needs `triton`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

BLOCK_T = 64  # tokens a program of `record_positions`
NUM_WARPS = 4


@triton.jit
def _positions_kernel(plane_ptr, slots_ptr, pos_ptr, n, scratch, stride_p, stride_h, stride_s,
                      PAGE: tl.constexpr, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl_gate(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = t < n
    slot = tl.load(slots_ptr + t, mask=ok, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    page = tl.where(slot >= 0, slot // PAGE, scratch)
    within = tl.where(slot >= 0, slot % PAGE, 0)
    h = tl.arange(0, BLOCK_H)
    at = page[:, None] * stride_p + h[None, :].to(tl.int64) * stride_h + within[:, None] * stride_s
    value = tl.broadcast_to(pos[:, None], (BLOCK_T, BLOCK_H)).to(plane_ptr.dtype.element_ty)
    tl.store(plane_ptr + at, value, mask=ok[:, None] & (h[None, :] < HEADS))


def record_positions(plane: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> None:
    """`slot_order.record` in one launch: `positions [T]` at `slots [T]` of `plane [pages + 1, Hkv, S]`."""
    n = slots.shape[0]
    if n == 0:
        return
    heads = plane.shape[1]
    _positions_kernel[(triton.cdiv(n, BLOCK_T),)](
        plane, slots, positions, n, plane.shape[0] - 1, *plane.stride()[:3], PAGE=plane.shape[2], HEADS=heads,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_T=BLOCK_T, num_warps=NUM_WARPS, **pdl_options(plane.device))


@triton.jit
def _queries_kernel(ring_ptr, count_ptr, q_ptr, rows_ptr, layer,
                    stride_rr, stride_rl, stride_rh, stride_rg, stride_rn, stride_cr, stride_cl, stride_qt, stride_qh,
                    WINDOW: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    counter = count_ptr + row * stride_cr + layer * stride_cl
    written = tl.load(counter)
    slot = (written % WINDOW).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    ok = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + i * stride_qt + h[:, None] * stride_qh + d[None, :], mask=ok, other=0.0)
    kv_head, member = h // GROUP, h % GROUP
    at = (row * stride_rr + layer * stride_rl + kv_head[:, None].to(tl.int64) * stride_rh + member[:, None] * stride_rg
          + slot * stride_rn + d[None, :])
    tl.store(ring_ptr + at, q.to(ring_ptr.dtype.element_ty), mask=ok)
    tl.store(counter, written + 1)


def record_queries(queries: torch.Tensor, counts: torch.Tensor, layer: int, q: torch.Tensor,
                   rows: torch.Tensor) -> None:
    """The decode rows' part of `query_window.record` in one launch: `q [B, Hq, D]` (one query a row, rows
    `rows [B]`, distinct) into `queries [rows + 1, layers, Hkv, group, n, D]` at each row's `counts [rows + 1,
    layers, ...]` (its first entry) modulo n, the count then one up."""
    num = q.shape[0]
    if num == 0:
        return
    kv_heads, group, window, head_dim = queries.shape[2], queries.shape[3], queries.shape[4], queries.shape[5]
    if queries.stride(5) != 1 or q.stride(2) != 1:
        raise ValueError("the query window and the queries need contiguous channels")
    heads = kv_heads * group
    _queries_kernel[(num,)](
        queries, counts, q, rows, layer, *queries.stride()[:5], counts.stride(0), counts.stride(1), q.stride(0),
        q.stride(1), WINDOW=window, GROUP=group, HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS,
        **pdl_options(q.device))
