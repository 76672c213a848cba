"""Expert alignment: step 1 of the fused MoE (moe_triton.py), grouping (token, expert) pairs by expert.

The pairs of `topk_ids [T, k]`, flattened as `pair = token * k + j`, are grouped by expert (stable:
in pair order within an expert) and each expert's rows are padded to a multiple of BLOCK_M, so that
every row block of the grouped GEMMs belongs to one expert. Output (`ExpertAlignment`):
`sorted_pairs [capacity]` (pair ids, `num_pairs` on padding rows), `block_experts [capacity /
BLOCK_M]` (blocks past the rows in use get expert E - 1) and `num_padded [1]` (rows in use).

Four implementations give the same tensors, bit for bit:
- "triton" (`_align_parallel_kernel`): one program per expert, one launch. Every program builds the
  full expert histogram (`tl.histogram`: shared-memory counters, cheap; identical in every
  program, so no global atomics and no second launch), takes its padded start from the prefix sum, then scans the
  pairs in order and writes its own ones at start + (stable rank: a cumsum of `ids == e`), its
  padding rows and its row blocks' expert; the rows and blocks past the end are split among all
  programs. Each program reads all pair ids twice (from L2: a few KB at decode sizes), so the
  per-program work grows with the batch while the launch count stays one.
- "split" (`_align_counts_kernel`, then `_align_split_kernel`): the same over splits of the pairs, for
  prefill chunks: one launch writes each split's histogram, the next runs a program per (expert,
  split), which places its expert's pairs of its split after those of the earlier splits.
- "single" (`_align_single_kernel`): the previous one-program kernel (one-hot histogram and
  scatter, [pairs x experts] tiles in one program). `auto` never picks it; it stays as the
  bench's old-vs-new baseline (bench/moe_bench.py) and a known-good fallback.
- "torch": scatter_add, stable argsort, searchsorted (~10 launches). The oracle.

No host sync and no data-dependent shape in any of them: the alignment is captured in the decode
steps' CUDA graphs. Sizes come from host-known bounds (`alignment_capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

# "auto" runs the one-launch kernel up to here and the split kernels above. The one-launch kernel's
# programs each pass over all pair ids twice, so its time grows with the pairs: on an H100 (`python
# bench/moe_bench.py --tokens 8192,32768`, `align_ms`) 0.084 ms at 65,536 pairs (an 8K prefill chunk x
# top-8) and 0.32 ms at 262,144 (the torch sort: 0.74 and 0.44 ms eager). The split kernels cut the pairs
# into at most 64 splits (two launches), so each program scans a few thousand ids: 0.058 and 0.149 ms
# there (53f126c, same H100; in a 32K prefill 5.6 ms against the one launch's 16.0). Decode batches up to
# 1024 x top-8 (8,192 pairs) stay on the one launch, inside their CUDA graphs, with a factor 2 margin.
ALIGN_ONE_LAUNCH_MAX_PAIRS = 16384
MAX_SPLITS = 64
ALIGN_IMPLS = ("auto", "triton", "split", "single", "torch")
_FILL = 128  # rows / blocks per store in the padding and block-expert loops


@dataclass
class ExpertAlignment:
    """(token, expert) pairs grouped by expert, each expert's rows padded to block_m."""

    sorted_pairs: torch.Tensor  # [capacity] int32; pair id, or num_pairs on padding rows
    block_experts: torch.Tensor  # [capacity // block_m] int32; the expert of each row block
    num_padded: torch.Tensor  # [1] int32; rows in use (blocks past it are idle)
    block_m: int


def alignment_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the alignment may need: each non-empty expert pads by at most block_m - 1."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-bound // block_m) * block_m


def align_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, impl: str = "auto", skips: bool = False
) -> ExpertAlignment:
    """Group the pairs of `topk_ids [T, k]` by expert (stable), padded per expert to block_m. `skips`: an id
    may be `num_experts` (another rank's expert, expert parallelism): that pair is placed nowhere.

    `impl`: "triton" (one launch), "split" (two launches over splits of the pairs), "single" (the
    previous one-program kernel), "torch" (argsort), or "auto" (triton up to ALIGN_ONE_LAUNCH_MAX_PAIRS
    pairs, split above).
    """
    if impl not in ALIGN_IMPLS:
        raise ValueError(f"align impl must be one of {', '.join(ALIGN_IMPLS)}, got {impl!r}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    capacity = alignment_capacity(num_pairs, num_experts, block_m)
    if impl == "auto":
        impl = "triton" if num_pairs <= ALIGN_ONE_LAUNCH_MAX_PAIRS else "split"
    if impl == "torch":
        return _align_torch(flat, num_experts, block_m, capacity)
    device = flat.device
    sorted_pairs = torch.empty(capacity, dtype=torch.int32, device=device)
    block_experts = torch.empty(capacity // block_m, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    block_e = max(32, triton.next_power_of_2(num_experts + skips))
    if impl == "split":
        split, num_splits, block_p, num_warps = split_launch(num_pairs)
        counts = torch.empty(num_splits, block_e, dtype=torch.int32, device=device)
        _align_counts_kernel[(num_splits,)](flat, counts, num_pairs, split, BLOCK_E=block_e, BLOCK_P=block_p,
                                            num_warps=num_warps, **pdl_options(device))
        _align_split_kernel[(num_experts, num_splits)](
            flat, counts, sorted_pairs, block_experts, num_padded, num_pairs, capacity, num_experts, split,
            num_splits, BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            BLOCK_P=block_p, BLOCK_FILL=_FILL, num_warps=num_warps, **pdl_options(device),
        )
    elif impl == "triton":
        block_p, num_warps = parallel_launch(num_pairs)
        _align_parallel_kernel[(num_experts,)](
            flat, sorted_pairs, block_experts, num_padded, num_pairs, capacity, num_experts,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p,
            BLOCK_FILL=_FILL, num_warps=num_warps, **pdl_options(device),
        )
    else:
        block_e = triton.next_power_of_2(num_experts)
        block_p = max(16, min(triton.next_power_of_2(max(num_pairs, capacity // block_m)), 8192 // block_e))
        _align_single_kernel[(1,)](
            flat, sorted_pairs, block_experts, num_padded, num_pairs, capacity, num_experts,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p,
            BLOCK_FILL=min(triton.next_power_of_2(max(capacity, 1)), 4096), num_warps=4, **pdl_options(device),
        )
    return ExpertAlignment(sorted_pairs, block_experts, num_padded, block_m)


def parallel_launch(num_pairs: int) -> tuple[int, int]:
    """(pair ids per chunk, warps) of the parallel kernel: at least one id per thread (no
    replicated lanes in the histogram), at most 8 per thread, 8 warps once chunks are large."""
    block_p = min(max(128, triton.next_power_of_2(max(num_pairs, 1))), 2048)
    return block_p, 8 if block_p >= 2048 else 4


def split_launch(num_pairs: int) -> tuple[int, int, int, int]:
    """(pairs per split, splits, pair ids per chunk, warps) of the split kernels: at least 4 chunks a
    split, at most MAX_SPLITS splits."""
    block_p, num_warps = parallel_launch(num_pairs)
    chunks = max(4, -(-num_pairs // (MAX_SPLITS * block_p)))
    split = chunks * block_p
    return split, max(1, -(-num_pairs // split)), block_p, num_warps


def _align_torch(flat: torch.Tensor, num_experts: int, block_m: int, capacity: int) -> ExpertAlignment:
    """(An id of `num_experts` names no expert: such a pair is placed nowhere, as in the Triton kernels.)"""
    device, num_pairs = flat.device, flat.numel()
    ids = flat.long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))  # bincount would sync for its length
    skipped, counts = counts[num_experts:], counts[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = torch.argsort(ids, stable=True)
    sorted_ids = ids[order]
    placed = num_pairs - skipped  # the skipped pairs sort last
    starts = torch.cat([counts.cumsum(0) - counts, placed])
    rank = torch.arange(num_pairs, device=device) - starts[sorted_ids]
    dest = torch.cat([padded_end - padded, padded_end[-1:]])[sorted_ids] + rank
    dest = torch.where(sorted_ids < num_experts, dest, capacity)  # a skipped pair: dropped below
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    sorted_pairs = sorted_pairs[:capacity]
    block_starts = torch.arange(0, capacity, block_m, device=device)
    owner = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return ExpertAlignment(sorted_pairs, owner.to(torch.int32), padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _align_parallel_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, capacity,
                           num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_FILL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # Every output element has exactly one writer: the rows [start, end) and their blocks belong
    # to expert e's program; the rows and blocks past num_padded are dealt round-robin.
    e = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = _histogram(ids_ptr, 0, num_pairs, BLOCK_E, BLOCK_P)
    counts = tl.where(experts < num_experts, counts, 0)  # id num_experts: another rank's expert, placed nowhere
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    num_padded = tl.sum(padded, axis=0)
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
    tl.store(num_padded_ptr, num_padded, mask=e == 0)
    if count > 0:
        _place_pairs(ids_ptr, sorted_ptr, e, 0, num_pairs, start, BLOCK_P)
    _pad_and_fill(sorted_ptr, block_expert_ptr, e, start, count, num_padded, capacity, num_pairs, num_experts,
                  BLOCK_M, BLOCK_FILL)


@triton.jit
def _align_counts_kernel(ids_ptr, counts_ptr, num_pairs, split, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Split s's histogram of expert ids (pairs [s * split, (s + 1) * split)) into counts[s, :BLOCK_E]."""
    pdl_gate(PDL)
    s = tl.program_id(0)
    lo = s * split
    counts = _histogram(ids_ptr, lo, tl.minimum(lo + split, num_pairs), BLOCK_E, BLOCK_P)
    tl.store(counts_ptr + s * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _align_split_kernel(ids_ptr, counts_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, capacity,
                        num_experts, split, num_splits, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_FILL: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # Program (e, s) places expert e's pairs of split s after those of the splits before it; the
    # programs of split 0 also write the padding and the fills, as _align_parallel_kernel's do.
    e = tl.program_id(0)
    s = tl.program_id(1)
    experts = tl.arange(0, BLOCK_E)
    splits = tl.arange(0, BLOCK_S)
    table = tl.load(counts_ptr + splits[:, None] * BLOCK_E + experts[None, :],
                    mask=(splits[:, None] < num_splits) & (experts[None, :] < num_experts), other=0)
    counts = tl.sum(table, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    num_padded = tl.sum(padded, axis=0)
    start = tl.sum(tl.where(experts < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(experts[None, :] == e, table, 0), axis=1)  # [BLOCK_S]: e's pairs in each split
    before = tl.sum(tl.where(splits < s, mine, 0), axis=0)
    if tl.sum(tl.where(splits == s, mine, 0), axis=0) > 0:
        lo = s * split
        _place_pairs(ids_ptr, sorted_ptr, e, lo, tl.minimum(lo + split, num_pairs), start + before, BLOCK_P)
    if s == 0:
        tl.store(num_padded_ptr, num_padded, mask=e == 0)
        count = tl.sum(tl.where(experts == e, counts, 0), axis=0)
        _pad_and_fill(sorted_ptr, block_expert_ptr, e, start, count, num_padded, capacity, num_pairs, num_experts,
                      BLOCK_M, BLOCK_FILL)


@triton.jit
def _histogram(ids_ptr, lo, hi, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
    """Counts of each id in [0, BLOCK_E) among ids[lo:hi]."""
    lanes = tl.arange(0, BLOCK_P)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(lo, hi, BLOCK_P):
        # lanes past the end read id 0 and are taken off bin 0 below (the histogram's plain
        # form; every id it sees must lie in [0, BLOCK_E))
        ids = tl.load(ids_ptr + p0 + lanes, mask=p0 + lanes < hi, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E)
    overrun = (hi - lo + BLOCK_P - 1) // BLOCK_P * BLOCK_P - (hi - lo)
    return counts - tl.where(experts == 0, tl.maximum(overrun, 0), 0)


@triton.jit
def _place_pairs(ids_ptr, sorted_ptr, e, lo, hi, dest0, BLOCK_P: tl.constexpr):
    """Expert e's pairs among [lo, hi), in pair order, written from sorted_ptr[dest0] on (the stable rank
    is a running count of hits)."""
    lanes = tl.arange(0, BLOCK_P)
    for p0 in range(lo, hi, BLOCK_P):
        pairs = p0 + lanes
        hit = (tl.load(ids_ptr + pairs, mask=pairs < hi, other=-1) == e).to(tl.int32)
        dest = dest0 + tl.cumsum(hit, axis=0) - hit
        tl.store(sorted_ptr + dest, pairs, mask=hit != 0)
        dest0 += tl.sum(hit, axis=0)


@triton.jit
def _pad_and_fill(sorted_ptr, block_expert_ptr, e, start, count, num_padded, capacity, num_pairs, num_experts,
                  BLOCK_M: tl.constexpr, BLOCK_FILL: tl.constexpr):
    """Expert e's padding rows and row blocks, and its round-robin share of the rows and blocks past
    num_padded (padding, expert E - 1)."""
    end = start + (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_rows = start + count + tl.arange(0, BLOCK_M)  # fewer than BLOCK_M padding rows
    tl.store(sorted_ptr + pad_rows, pad_rows * 0 + num_pairs, mask=pad_rows < end)
    fill = tl.arange(0, BLOCK_FILL)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, BLOCK_FILL):
        blocks = b0 + fill
        tl.store(block_expert_ptr + blocks, blocks * 0 + e, mask=blocks < end // BLOCK_M)
    stride = num_experts * BLOCK_FILL
    for r0 in range(num_padded + e * BLOCK_FILL, capacity, stride):
        rows = r0 + fill
        tl.store(sorted_ptr + rows, rows * 0 + num_pairs, mask=rows < capacity)
    num_blocks = capacity // BLOCK_M
    for b0 in range(num_padded // BLOCK_M + e * BLOCK_FILL, num_blocks, stride):
        blocks = b0 + fill
        tl.store(block_expert_ptr + blocks, blocks * 0 + num_experts - 1, mask=blocks < num_blocks)


@triton.jit
def _align_single_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, capacity,
                         num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK_FILL: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    # Every row starts as padding; the barrier orders these stores before the scatter below,
    # which overwrites some of them from other threads of this (single) program.
    for r0 in range(0, capacity, BLOCK_FILL):
        rows = r0 + tl.arange(0, BLOCK_FILL)
        tl.store(sorted_ptr + rows, tl.zeros_like(rows) + num_pairs, mask=rows < capacity)
    tl.debug_barrier()
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):  # histogram by one-hot sums (no atomics)
        ids = tl.load(ids_ptr + p0 + lanes, mask=p0 + lanes < num_pairs, other=-1)
        counts += tl.sum(((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK_P):  # scatter: rank within the expert, in pair order
        pairs = p0 + lanes
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - hit + (padded_start + seen)[None, :]
        dest = tl.sum(hit * rank, axis=1)
        tl.store(sorted_ptr + dest, pairs, mask=(pairs < num_pairs) & (tl.sum(hit, axis=1) > 0))
        seen += tl.sum(hit, axis=0)
    for b0 in range(0, capacity // BLOCK_M, BLOCK_P):  # a block's expert: ends at or before it
        blocks = b0 + lanes
        owner = tl.sum(((blocks * BLOCK_M)[:, None] >= padded_end[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(owner, num_experts - 1),
                 mask=blocks < capacity // BLOCK_M)
