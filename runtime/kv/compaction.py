"""Compaction: applying methods' keep plans to the pages of one layer.

A keep plan says which stored tokens of one sequence's layer survive, per KV head (pages are
head-major, [page, Hkv, slot, D], so heads can keep different tokens in the same slots). The kept
K/V are moved into the first ceil(M / page_size) pages of the layer's table, M being the layer's
new physical length; the scheduler then frees the rest.

Layout after compaction. Equal counts: every head's `kept` tokens fill slots [0, kept), M = kept.
Per-head variable counts (`counts`): M = max_h count_h and head h's tokens are stored
right-aligned in slots [M - count_h, M), so new tokens keep appending at the common slot M for
every head; the new start slots M - count_h are returned (the runner records them,
runtime/attention/metadata.py) and the kernels skip the slots before them.

Re-compaction: a layer compacted before may already have per-head starts; head h's stored tokens
are then slots [start_h, length) and its kept indices must lie there (a chain cache compresses a
layer again at each turn; decode-time eviction does it every step). The result is laid out as
above, whatever the old starts were.

State planes (`state_planes.py`: a method's per-token float32 state, `[pages + 1, Hkv,
page_size]`, addressed like K/V) follow the same plan: `compact_many(..., planes=)` moves their
kept slots exactly as it moves K/V, so slot s's state stays beside slot s's keys.

Two backends, one contract (`compact_many`): the Triton kernel of `compaction_triton.py` (on CUDA,
and under TRITON_INTERPRET=1 when asked), one launch for every plan of a layer, in place, with no
host sync; and plain torch here (gather into a temporary, then scatter). Host syncs: the new
physical length and starts must be known on the host (the scheduler frees pages with them), so
per-head `counts` should be a CPU tensor (the compiled methods' plans are); counts on a GPU are
read back, once per plan. The value checks (indices inside [start_h, length), ascending) read the
indices back, so they run where that is free (CPU) or when asked (`checked=True`, or
KVC_CHECK_COMPACTION=1 for the engine); shape and count checks are free and always run.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

BACKENDS = ("auto", "torch", "triton")
CHECK_ENV = "KVC_CHECK_COMPACTION"


@dataclass
class CompactionJob:
    """One sequence's keep plan for one layer."""

    page_ids: list[int]  # the layer's page table (pages owned by this sequence alone)
    length: int  # physical slots stored
    keep: torch.Tensor  # [Hkv, K] physical slot indices, ascending per head
    counts: torch.Tensor | None = None  # [Hkv]: head h keeps keep[h, :counts[h]]; None: all K
    starts: list[int] | None = None  # the layer's current per-head start slots; None: all 0


@dataclass(frozen=True)
class Compacted:
    """A layer after compaction: its physical length and per-head start slots (None: all 0)."""

    length: int
    starts: list[int] | None


@dataclass(frozen=True)
class HostPlan:
    """A job with its host facts resolved and checked: what both backends execute."""

    page_ids: list[int]
    keep: torch.Tensor  # [Hkv, K] on the cache's device, int64
    counts: list[int]  # per head
    physical: int  # M

    @property
    def offsets(self) -> list[int]:
        """First destination slot of each head (right-aligned below M)."""
        return [self.physical - c for c in self.counts]


def compact_layer(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: list[int],
    length: int,
    keep: torch.Tensor,
    lengths: torch.Tensor | None = None,
    checked: bool | None = None,
    starts: list[int] | None = None,
    backend: str = "auto",
) -> int:
    """Keeps tokens `keep [Hkv, kept]` of the sequence whose `length` tokens sit in `page_ids`;
    with `lengths [Hkv]` head h keeps only `keep[h, :lengths[h]]`; with `starts`, head h's stored
    tokens are slots [starts[h], length). Returns the new physical length M (`kept`, or
    max(lengths)). One plan of `compact_many`."""
    job = CompactionJob(page_ids, length, keep, lengths, starts)
    return compact_many(k_cache, v_cache, [job], checked=checked, backend=backend)[0].length


def compact_many(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    jobs: list[CompactionJob],
    checked: bool | None = None,
    backend: str = "auto",
    planes: Seq[torch.Tensor] = (),
) -> list[Compacted]:
    """Applies every job (one layer, distinct sequences) in place, to K, V and every state plane
    (`[pages (+ scratch), Hkv, page_size]`); `checked` None: check values where that costs no
    device sync, or when KVC_CHECK_COMPACTION=1."""
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must both be [pages, Hkv, page_size, D], got {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    for plane in planes:
        if plane.dim() != 3 or plane.shape[1:] != k_cache.shape[1:3] or plane.shape[0] < k_cache.shape[0]:
            raise ValueError(f"a state plane must be [>= {k_cache.shape[0]} pages, {k_cache.shape[1]}, "
                             f"{k_cache.shape[2]}], got {tuple(plane.shape)}")
    use_triton = _use_triton(backend, k_cache.device)
    if checked is None:
        checked = k_cache.device.type == "cpu" or os.environ.get(CHECK_ENV) == "1"
    plans = [_resolve(k_cache, job, checked) for job in jobs]
    results = [Compacted(p.physical, p.offsets if any(p.offsets) else None) for p in plans]
    work = [p for p in plans if p.physical > 0]
    if not work:
        return results
    if use_triton:
        from kvc.runtime.kv.compaction_triton import compact_triton

        compact_triton(k_cache, v_cache, work, planes=planes)
    else:
        for plan in work:
            _compact_torch((k_cache, v_cache, *planes), plan)
    return results


def _use_triton(backend: str, device: torch.device) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"compaction backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "auto":  # the kernel where it runs natively; torch without triton installed
        return device.type == "cuda" and importlib.util.find_spec("triton") is not None
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton compaction kernel runs on CUDA (or under TRITON_INTERPRET=1), not {device.type}")
    return True


def _resolve(k_cache: torch.Tensor, job: CompactionJob, checked: bool) -> HostPlan:
    """Host facts of a job (counts, M), after the checks that cost nothing; value checks if asked."""
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    keep, length = job.keep, job.length
    if keep.dim() != 2 or keep.shape[0] != num_kv_heads:
        raise ValueError(f"keep plan must be [{num_kv_heads}, kept], got {tuple(keep.shape)}")
    if keep.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"keep plan indices must be integers, got {keep.dtype}")
    width = keep.shape[1]
    if job.counts is None:
        counts = [width] * num_kv_heads
    else:
        counts = [int(c) for c in job.counts.detach().cpu().tolist()]  # free for CPU counts
        if len(counts) != num_kv_heads or any(c < 0 or c > width for c in counts):
            raise ValueError(f"keep plan lengths must be [{num_kv_heads}] counts in [0, {width}], got {counts}")
    starts = job.starts if job.starts is not None else [0] * num_kv_heads
    if len(starts) != num_kv_heads or any(s < 0 or s > length for s in starts):
        raise ValueError(f"per-head starts must be [{num_kv_heads}] slots in [0, {length}], got {list(starts)}")
    if len(job.page_ids) * page_size < length:
        raise ValueError(f"{len(job.page_ids)} pages of {page_size} slots cannot hold {length} tokens")
    for head, (count, start) in enumerate(zip(counts, starts)):
        if count > length - start:
            raise ValueError(f"keep plan keeps {count} tokens of KV head {head}, which stores only "
                             f"{length - start} (slots [{start}, {length}))")
    keep = keep.to(device=k_cache.device, dtype=torch.long)
    if checked:
        _check_values(keep, counts, starts, length)
    return HostPlan(list(job.page_ids), keep, counts, max(counts, default=0))


def _check_values(keep: torch.Tensor, counts: list[int], starts: list[int], length: int) -> None:
    """Each head's kept indices lie in [start_h, length) and strictly ascend (reads them back)."""
    rows = keep.cpu()
    for head, (count, start) in enumerate(zip(counts, starts)):
        row = rows[head, :count]
        if count and (int(row.min()) < start or int(row.max()) >= length):
            raise ValueError(f"keep plan indexes outside the stored tokens of KV head {head} "
                             f"(slots [{start}, {length})): {row.tolist()}")
        if count > 1 and not bool((row[1:] > row[:-1]).all()):
            raise ValueError(f"keep plan indices of KV head {head} must ascend strictly: {row.tolist()}")


def device_ints(values, device: torch.device) -> torch.Tensor:
    """A host int array on `device` without a sync: pinned and copied asynchronously on CUDA."""
    host = torch.as_tensor(values)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _compact_torch(caches: Seq[torch.Tensor], plan: HostPlan) -> None:
    """Gather every kept row into a temporary, then scatter it: in place is safe whatever moves
    where, as all reads happen before any write. `caches`: K, V, then any state planes (their
    rows are single values instead of head-dim vectors)."""
    import numpy as np

    page_size = caches[0].shape[2]
    device = caches[0].device
    counts = plan.counts
    heads = np.repeat(np.arange(len(counts)), counts)
    dst = np.concatenate([off + np.arange(c) for off, c in zip(plan.offsets, counts)])
    if len(set(counts)) == 1:
        src = plan.keep[:, : counts[0]].reshape(-1)
    else:
        src = torch.cat([plan.keep[h, :c] for h, c in enumerate(counts)])
    pages = device_ints(np.asarray(plan.page_ids, dtype=np.int64), device)
    heads_t, dst_t = device_ints(heads, device), device_ints(dst, device)
    src_page, src_slot = pages[src // page_size], src % page_size
    dst_page, dst_slot = pages[dst_t // page_size], dst_t % page_size
    for cache in caches:
        gathered = cache[src_page, heads_t, src_slot]  # [n, D] or [n], a copy
        cache[dst_page, heads_t, dst_slot] = gathered
