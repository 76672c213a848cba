"""Compaction as one Triton kernel: the GPU backend of `compaction.py` (same contract).

One launch applies every keep plan of a layer (one per sequence), in place, reading the paged
cache directly; nothing is read back to the host. Program (plan, KV head, K or V, a slice of the
head dim) moves one head's kept rows of one cache; programs touch disjoint bytes (pages belong to
one sequence, pages are head-major, and K/V and the D slices are separate), so the only hazard is
inside a program, where a destination slot may be the source of another kept token.

Why one ordered walk per head is safe. Head h keeps n tokens at ascending slots src_0 < ... <
src_{n-1} and writes token i to dst_i = off + i (off = 0 for equal counts; M - n right-aligned
for per-head counts; old starts only change which slots src may be). Let delta_i = dst_i - src_i.
Since src ascends strictly, delta is non-increasing in i, so the tokens that move up or stay
(delta >= 0) are a prefix [0, p) and those that move down are the rest [p, n). Then:
- a down-mover's destination is never a later token's source (src_j > dst_j > dst_i for j > i),
  so the down-movers go in ascending order;
- an up-mover's destination is never an earlier token's source (src_j <= dst_j < dst_i for
  j < i), so the up-movers go in descending order;
- the two groups never meet: up-mover destinations lie below every down-mover's source
  (dst_i = off + i < off + j = dst_j < src_j), and down-mover destinations above every up-mover's
  source (src_i <= dst_i < dst_j).
Each walk takes BLOCK_T tokens at a time: every row of the chunk is loaded, then a CTA barrier,
then stored, so a chunk's stores never overtake its own loads (sources and destinations may meet
within a chunk); the next chunk's sources are never this chunk's destinations (above), and its
stores wait at its own barrier for every warp's loads. Equal counts (SnapKV's case) are all
down-movers apart from tokens that already sit in place, which are skipped. Under
TRITON_INTERPRET=1 a program runs its block operations in order, which is the same semantics.

Inputs packed by `compact_triton`: `meta [N, Hkv + 1 + W]` int32 (counts per head, the new
physical length M, the page table), one pinned host-to-device copy; `keep [N, Hkv, K]` int64.
Launch knobs (BLOCK_T, the head-dim slice, warps): `launch_config` gives this GPU's `kvc tune`
entry for the (plans, kept, Hkv, D, dtype) bucket (runtime/tuning/, keyed by this file's sha256),
else the constants below. State planes (`state_planes.py`) take one more launch each, with the
same `meta` and `keep`: a plane is a cache whose rows are one float32 value ([pages, Hkv, S]
viewed as [pages, Hkv, S, 1]). Import needs `triton`.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvc.runtime.kv.compaction import HostPlan
from kvc.runtime.transfer import to_device
from kvc.runtime.tuning import buckets as tuning_buckets
from kvc.runtime.tuning.lookup import source_hash, tuned

BLOCK_T = 128  # tokens per chunk of a walk
MAX_BLOCK_D = 64  # head-dim slice per program (more programs per head for large D)
NUM_WARPS = 4
KERNEL = "kv.compaction"  # the tuning cache's name for this kernel
SOURCE_HASH = source_hash(__file__)  # tuned entries recorded for another version of this file are ignored


def default_config(head_dim: int) -> dict:
    """The heuristic knobs (what a launch uses without a tuned entry)."""
    return {"block_t": BLOCK_T, "block_d": min(triton.next_power_of_2(head_dim), MAX_BLOCK_D), "num_warps": NUM_WARPS}


def launch_config(num_plans: int, kept: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> dict:
    """This GPU's tuned knobs for the bucket (`kvc tune`), else `default_config`."""
    cfg = default_config(head_dim)
    knobs = tuned(KERNEL, tuning_buckets.compaction(num_plans, kept, num_kv_heads, head_dim, dtype), SOURCE_HASH)
    return {**cfg, **knobs} if knobs else cfg


@triton.jit
def _move_chunk(cache, keep_row, table, i, valid, off, d_offs, d_mask, stride_p, stride_s,
                PAGE_SIZE: tl.constexpr):
    """Moves tokens `i` (where `valid`) of one head from slot keep_row[i] to slot off + i."""
    src = tl.load(keep_row + i, mask=valid, other=0)
    dst = off + i
    valid = valid & (src != dst)  # already in place: nothing to move
    src_page = tl.load(table + src // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    dst_page = tl.load(table + dst // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    src_rows = cache + src_page * stride_p + (src % PAGE_SIZE) * stride_s
    dst_rows = cache + dst_page * stride_p + (dst % PAGE_SIZE) * stride_s
    mask = valid[:, None] & d_mask[None, :]
    rows = tl.load(src_rows[:, None] + d_offs[None, :], mask=mask)
    tl.debug_barrier()  # every warp has loaded the chunk before any row of it is overwritten
    tl.store(dst_rows[:, None] + d_offs[None, :], rows, mask=mask)


@triton.jit
def _move_head(cache, keep_row, table, n, off, d_offs, d_mask, stride_p, stride_s,
               PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """One head of one cache: down-movers ascending, then up-movers descending (module docstring)."""
    offs = tl.arange(0, BLOCK_T)
    p = n * 0  # tokens that move up or stay: a prefix
    for c in range(0, n, BLOCK_T):
        i = c + offs
        valid = i < n
        src = tl.load(keep_row + i, mask=valid, other=0)
        p += tl.sum((valid & (src <= off + i)).to(tl.int32), axis=0)
    for c in range(p, n, BLOCK_T):
        i = c + offs
        _move_chunk(cache, keep_row, table, i, i < n, off, d_offs, d_mask, stride_p, stride_s, PAGE_SIZE)
    for c in range(0, tl.cdiv(p, BLOCK_T)):
        i = p - (c + 1) * BLOCK_T + offs
        _move_chunk(cache, keep_row, table, i, i >= 0, off, d_offs, d_mask, stride_p, stride_s, PAGE_SIZE)


@triton.jit
def _compact_kernel(
    k_ptr, v_ptr, keep_ptr, meta_ptr,
    stride_keep_job, stride_keep_head, stride_meta_job, stride_p, stride_h, stride_s,
    NUM_KV_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    job = tl.program_id(0) // NUM_KV_HEADS
    head = tl.program_id(0) % NUM_KV_HEADS
    d_offs = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d_offs < HEAD_DIM
    meta = meta_ptr + job.to(tl.int64) * stride_meta_job
    n = tl.load(meta + head)
    off = tl.load(meta + NUM_KV_HEADS) - n  # right-aligned below the new physical length
    table = meta + NUM_KV_HEADS + 1
    keep_row = keep_ptr + job.to(tl.int64) * stride_keep_job + head * stride_keep_head
    head_base = head.to(tl.int64) * stride_h
    if tl.program_id(1) == 0:
        _move_head(k_ptr + head_base, keep_row, table, n, off, d_offs, d_mask, stride_p, stride_s, PAGE_SIZE,
                   BLOCK_T)
    else:
        _move_head(v_ptr + head_base, keep_row, table, n, off, d_offs, d_mask, stride_p, stride_s, PAGE_SIZE,
                   BLOCK_T)


def compact_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, plans: list[HostPlan],
                   block_t: int | None = None, block_d: int | None = None, num_warps: int | None = None,
                   planes: Seq[torch.Tensor] = ()) -> None:
    """Applies `plans` (one layer, distinct sequences, already checked) in one launch for K and V,
    and one per state plane (`[pages (+ scratch), Hkv, page_size]` float32: rows of one value); the
    knobs given override the launch config."""
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("the compaction kernel needs k_cache and v_cache with equal strides and a contiguous head dim")
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    device = k_cache.device
    width = max(len(p.page_ids) for p in plans)
    meta = np.zeros((len(plans), num_kv_heads + 1 + width), dtype=np.int32)
    for j, plan in enumerate(plans):
        meta[j, :num_kv_heads] = plan.counts
        meta[j, num_kv_heads] = plan.physical
        meta[j, num_kv_heads + 1 : num_kv_heads + 1 + len(plan.page_ids)] = plan.page_ids
    meta_t = to_device(meta, device)
    kept = max(p.keep.shape[1] for p in plans)
    if len(plans) == 1:
        keep = plans[0].keep.contiguous()[None]
    else:
        keep = torch.stack([F.pad(p.keep, (0, kept - p.keep.shape[1])) for p in plans])
    cfg = launch_config(len(plans), kept, num_kv_heads, head_dim, k_cache.dtype)
    block_t, block_d, num_warps = block_t or cfg["block_t"], block_d or cfg["block_d"], num_warps or cfg["num_warps"]
    _launch(k_cache, v_cache, 2, keep, meta_t, len(plans), block_d, block_t, num_warps)
    for plane in planes:  # [pages, Hkv, S] as [pages, Hkv, S, 1]: one program per (plan, head)
        rows = plane.unsqueeze(-1)
        if rows.stride(2) != 1 or plane.stride(1) != plane.shape[2]:
            raise ValueError("the compaction kernel needs contiguous state planes")
        _launch(rows, rows, 1, keep, meta_t, len(plans), 2, block_t, num_warps)


def _launch(k_cache, v_cache, caches: int, keep, meta_t, num_plans: int, block_d: int, block_t: int,
            num_warps: int) -> None:
    """One launch over (plan x head, the first `caches` of K and V, head-dim slices)."""
    _, num_kv_heads, page_size, head_dim = k_cache.shape
    grid = (num_plans * num_kv_heads, caches, triton.cdiv(head_dim, block_d))
    _compact_kernel[grid](
        k_cache, v_cache, keep, meta_t,
        keep.stride(0), keep.stride(1), meta_t.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t,
        num_warps=num_warps,
    )
