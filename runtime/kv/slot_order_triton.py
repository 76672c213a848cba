"""Eviction in place as one Triton launch: the GPU backend of `slot_order.fill` (same contract).

`fill` (runtime/kv/slot_order.py; docs/design.md, "Eviction in place") moves, for each of N jobs
and KV head h, every kept slot at or past the job's new length `count` into a dropped slot below
it: the i-th such mover in ascending slot order into the i-th hole. In torch that is a few dozen
small launches per layer; here one program per (job, KV head) does it all, reading the paged
tensors through the job's page table:
1. it clears a scratch row of flags over the job's slots [0, length), then sets the flag of each
   kept slot `keep[n, h, :count]`;
2. it ranks the movers (flagged slots in [count, length)) and the holes (unflagged slots below
   count) by prefix sums, writing each one's slot at its rank into a scratch pair list;
3. it copies mover i's row into hole i's, in every TOKEN tensor of the launch.
A CTA barrier separates the phases (each reads what the others' threads wrote). Holes lie below
count and movers at or above it, so no copy reads a row another one writes; programs touch
disjoint bytes (a job's pages are its own, heads are separate). Under TRITON_INTERPRET=1 a program
runs its block operations in order, which is the same semantics.

Inputs: `meta [N, 2 + W]` int32 (count, length, the page table), one pinned host-to-device copy;
`keep [N, Hkv, K]` (int64 slots) as it is; scratch flags and pair lists from the allocator (the
kernel clears what it reads). A launch takes up to `MAX_TENSORS` tensors, each with its own
strides, page size and row (`prod(shape[3:])` contiguous elements, moved as they are: dtypes
Triton lacks, FP8 codes or bool, as ints of their size); more tensors take more launches. The host
side stays lean (no torch operation per tensor): at decode this runs once per layer and step.
Import needs `triton`.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvc.runtime.transfer import to_device

MAX_TENSORS = 4  # TOKEN tensors per launch (a spec's K, V, positions and a state plane: one launch)
BLOCK_S = 1024  # slots per block of the flag and ranking passes
BLOCK_E = 16  # moves per block of the copy pass
MAX_BLOCK_R = 128  # row elements per block of a copy
NUM_WARPS = 4
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a copy moves bits, whatever the dtype
NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64}  # dtypes passed as they are; others as the ints of their size


@triton.jit
def _copy_rows(ptr, stride_p, stride_h, stride_s, head, table, src, dst, valid,
               ROW: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    """Row of slot src[i] into slot dst[i] (where `valid`) of one KV head of one tensor."""
    src_page = tl.load(table + src // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    dst_page = tl.load(table + dst // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    base = ptr + head.to(tl.int64) * stride_h
    src_rows = base + src_page * stride_p + (src % PAGE_SIZE) * stride_s
    dst_rows = base + dst_page * stride_p + (dst % PAGE_SIZE) * stride_s
    for r in tl.static_range(0, ROW, BLOCK_R):
        cols = r + tl.arange(0, BLOCK_R)
        mask = valid[:, None] & (cols < ROW)[None, :]
        rows = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
        tl.store(dst_rows[:, None] + cols[None, :], rows, mask=mask)


@triton.jit
def _fill_kernel(
    keep_ptr, meta_ptr, flags_ptr, pairs_ptr,
    t0_ptr, t1_ptr, t2_ptr, t3_ptr,
    stride_p0, stride_h0, stride_s0, stride_p1, stride_h1, stride_s1,
    stride_p2, stride_h2, stride_s2, stride_p3, stride_h3, stride_s3,
    stride_keep_job, stride_keep_head, stride_keep_slot, stride_meta_job, stride_flags, capacity,
    NUM_KV_HEADS: tl.constexpr, NUM_TENSORS: tl.constexpr,
    ROW0: tl.constexpr, ROW1: tl.constexpr, ROW2: tl.constexpr, ROW3: tl.constexpr,
    PAGE0: tl.constexpr, PAGE1: tl.constexpr, PAGE2: tl.constexpr, PAGE3: tl.constexpr,
    BLOCK_R0: tl.constexpr, BLOCK_R1: tl.constexpr, BLOCK_R2: tl.constexpr, BLOCK_R3: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    job = tl.program_id(0)
    head = tl.program_id(1)
    meta = meta_ptr + job.to(tl.int64) * stride_meta_job
    count = tl.load(meta)
    length = tl.load(meta + 1)
    table = meta + 2
    if length > count:  # else nothing was dropped: nothing moves
        row = job.to(tl.int64) * NUM_KV_HEADS + head
        flags = flags_ptr + row * stride_flags
        pairs = pairs_ptr + row * 2 * capacity  # holes at [0, capacity), movers at [capacity, 2 capacity)
        keep_row = keep_ptr + job.to(tl.int64) * stride_keep_job + head.to(tl.int64) * stride_keep_head
        offs = tl.arange(0, BLOCK_S)
        for b in range(0, length, BLOCK_S):
            s = b + offs
            tl.store(flags + s, tl.zeros([BLOCK_S], dtype=tl.int8), mask=s < length)
        tl.debug_barrier()  # cleared before any thread sets a flag
        for b in range(0, count, BLOCK_S):
            i = b + offs
            slot = tl.load(keep_row + i * stride_keep_slot, mask=i < count, other=-1)
            tl.store(flags + slot, tl.full([BLOCK_S], 1, dtype=tl.int8), mask=(slot >= 0) & (slot < length))
        tl.debug_barrier()  # every flag set before any is read
        movers = count * 0
        for b in range(count, length, BLOCK_S):
            s = b + offs
            mover = (tl.load(flags + s, mask=s < length, other=0) != 0) & (s < length)
            rank = movers + tl.cumsum(mover.to(tl.int32), axis=0) - 1
            tl.store(pairs + capacity + rank, s, mask=mover & (rank < capacity))
            movers += tl.sum(mover.to(tl.int32), axis=0)
        holes = count * 0
        for b in range(0, count, BLOCK_S):
            s = b + offs
            hole = (tl.load(flags + s, mask=s < count, other=1) == 0) & (s < count)
            rank = holes + tl.cumsum(hole.to(tl.int32), axis=0) - 1
            tl.store(pairs + rank, s, mask=hole & (rank < capacity))
            holes += tl.sum(hole.to(tl.int32), axis=0)
        moves = tl.minimum(tl.minimum(holes, movers), capacity)
        tl.debug_barrier()  # the pair lists written before any is read
        for b in range(0, moves, BLOCK_E):
            i = b + tl.arange(0, BLOCK_E)
            valid = i < moves
            dst = tl.load(pairs + i, mask=valid, other=0)
            src = tl.load(pairs + capacity + i, mask=valid, other=0)
            _copy_rows(t0_ptr, stride_p0, stride_h0, stride_s0, head, table, src, dst, valid, ROW0, PAGE0, BLOCK_R0)
            if NUM_TENSORS > 1:
                _copy_rows(t1_ptr, stride_p1, stride_h1, stride_s1, head, table, src, dst, valid, ROW1, PAGE1,
                           BLOCK_R1)
            if NUM_TENSORS > 2:
                _copy_rows(t2_ptr, stride_p2, stride_h2, stride_s2, head, table, src, dst, valid, ROW2, PAGE2,
                           BLOCK_R2)
            if NUM_TENSORS > 3:
                _copy_rows(t3_ptr, stride_p3, stride_h3, stride_s3, head, table, src, dst, valid, ROW3, PAGE3,
                           BLOCK_R3)


def fill_triton(tensors: list[torch.Tensor], keep: torch.Tensor, counts: np.ndarray, lengths: np.ndarray,
                tables: np.ndarray) -> None:
    """`slot_order.fill` in one launch per `MAX_TENSORS` tensors: job n keeps the physical slots
    `keep[n, h, :counts[n]]` (any order) of the `lengths[n]` its table `tables[n]` stores, in place;
    each kept slot at or past counts[n] moves into a dropped slot below it (the i-th such in slot
    order into the i-th hole), in every TOKEN tensor [pages + 1, Hkv, S, ...]."""
    num, heads, _ = keep.shape
    if num == 0:
        return
    lengths = np.asarray(lengths)
    dropped = int((lengths - counts).max())
    if dropped <= 0:
        return
    rows = [r for r in (_rows(t, heads) for t in tensors) if r[2] > 0]
    tables = np.asarray(tables).reshape(num, -1)
    meta = np.empty((num, 2 + tables.shape[1]), dtype=np.int32)
    meta[:, 0], meta[:, 1], meta[:, 2:] = counts, lengths, tables
    device = keep.device
    meta_t = to_device(meta, device)
    flags = torch.empty(num * heads, int(lengths.max()), dtype=torch.int8, device=device)  # cleared by the kernel
    pairs = torch.empty(num * heads, 2 * dropped, dtype=torch.int32, device=device)
    shared = (*keep.stride(), meta.shape[1], flags.shape[1], dropped)
    for tensor_args, consts in tensor_launches(rows):
        _fill_kernel[(num, heads)](keep, meta_t, flags, pairs, *tensor_args, *shared, NUM_KV_HEADS=heads,
                                   BLOCK_S=BLOCK_S, BLOCK_E=BLOCK_E, num_warps=NUM_WARPS, **consts)


def tensor_launches(rows: list) -> list[tuple[list, dict]]:
    """The `_copy_rows` arguments of launches over up to `MAX_TENSORS` tensors each (`_rows` of every TOKEN
    tensor): (pointers then their (page, head, slot) strides, positional; the NUM_TENSORS, ROWi, PAGEi and
    BLOCK_Ri constants). Unused slots repeat the first tensor and are never read."""
    launches = []
    for first in range(0, len(rows), MAX_TENSORS):
        group = rows[first : first + MAX_TENSORS]
        padded = group + [group[0]] * (MAX_TENSORS - len(group))
        args = [t for t, _, _, _ in padded] + [x for _, strides, _, _ in padded for x in strides]
        consts = {"NUM_TENSORS": len(group)}
        for i, (_, _, width, page) in enumerate(padded):
            consts.update({f"ROW{i}": width, f"PAGE{i}": page, f"BLOCK_R{i}": _block_r(width)})
        launches.append((args, consts))
    return launches


def _rows(tensor: torch.Tensor, heads: int) -> tuple[torch.Tensor, tuple[int, int, int], int, int]:
    """A TOKEN tensor [pages + 1, Hkv, S, *rest] for the kernel: itself (its bits where Triton has no
    such dtype), its (page, head, slot) strides, its row width (prod(rest), one contiguous row) and
    page size."""
    shape, strides = tensor.shape, tensor.stride()
    if len(shape) < 3 or shape[1] != heads:
        raise ValueError(f"a TOKEN tensor is [pages + 1, {heads}, page_size, ...], got {tuple(shape)}")
    width, step = 1, 1
    for size, stride in zip(reversed(shape[3:]), reversed(strides[3:])):
        if size > 1 and stride != step:
            raise ValueError("the fill kernel needs each slot's values contiguous")
        width, step = width * size, step * size
    if tensor.dtype not in NATIVE:
        tensor = tensor.view(BITS[tensor.element_size()])  # same shape and strides
    return tensor, strides[:3], width, shape[2]


def _block_r(width: int) -> int:
    return min(1 << max(width - 1, 0).bit_length(), MAX_BLOCK_R)
