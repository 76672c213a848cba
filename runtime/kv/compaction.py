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

Every per-token tensor of a KV spec (runtime/kv/spec.py: K/V, quantized codes and scales, a
method's per-token state) follows the same plan: `compact_tensors` moves the kept slots of each
exactly as it moves K/V, so slot s's state and scales stay beside slot s's keys.

One layer's jobs travel as one `CompactionBatch`: host facts (counts, lengths, page tables,
starts) as numpy arrays and every plan in one `keep [N, Hkv, K]` tensor, so the host work per
layer is a few numpy and torch calls, not a few per sequence (decode-time eviction compacts every
row of a decode batch at every step). Plans that share a tensor are moved and gathered once
(`stack_keeps`: the rows of one stacked selection, or one plan several rows share, expanded).
`compact_many(jobs)` builds the batch from a list of `CompactionJob`s (Python per job); the
runner builds it straight from its cached page-table arrays (`compact_batch`).

Two backends, one contract: the Triton kernel of `compaction_triton.py` (on CUDA, and under
TRITON_INTERPRET=1 when asked), one launch for every plan of a layer, in place, with no host sync,
its inputs packed here (that file, whose hash keys the kernel's tuned entries, stays as it is);
and plain torch here (every job's kept rows gathered into one temporary, then scattered). Host syncs: the new
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

import numpy as np
import torch

from kvc.runtime.transfer import to_device

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
    """One job with its host facts resolved and checked (`compaction_triton.compact_triton`'s input)."""

    page_ids: list[int]
    keep: torch.Tensor  # [Hkv, K] on the cache's device, int64
    counts: list[int]  # per head
    physical: int  # M

    @property
    def offsets(self) -> list[int]:
        """First destination slot of each head (right-aligned below M)."""
        return [self.physical - c for c in self.counts]


@dataclass
class CompactionBatch:
    """One layer's jobs in one piece, what both backends execute. Job j (the callers' order) keeps
    `keep[pos[j], h, :counts[j, h]]` of the `lengths[j]` slots its page table `tables[j, :pages[j]]`
    stores. Host facts are numpy arrays; `keep` is one device tensor whose rows are grouped by the
    tensor their plan came from (`stack_keeps`), and may share memory (stride 0)."""

    keep: torch.Tensor  # [N, Hkv, K] int64 on the cache's device, K the widest plan
    pos: np.ndarray  # [N]: job j's row of `keep`
    widths: np.ndarray  # [N]: job j's own plan width (its row past it is padding)
    counts: np.ndarray  # [N, Hkv]: tokens kept per head
    lengths: np.ndarray  # [N]: physical slots stored
    tables: np.ndarray  # [N, W] page tables, zero-padded
    pages: np.ndarray  # [N]: pages in each table
    starts: np.ndarray | None = None  # [N, Hkv]: the layers' current start slots; None: all 0
    # [N, Hkv, >= max length]: each job's slots in time order where its plan's selection already sorted
    # them (a keep in place: runtime/kv/slot_order.py); None: the executor finds them
    order: torch.Tensor | None = None
    # [N]: each job's new length at least this, its plan's width (`batch_of_jobs`): a tensor-parallel rank's part
    # of a keep over every rank's heads is as wide as the widest head on any rank (plans.HeadKeeps), so every
    # rank's layer holds as many slots and pages; None: the most-keeping head's count
    floor: np.ndarray | None = None

    @property
    def physical(self) -> np.ndarray:
        """[N]: each job's new physical length M (its most-keeping head, or its `floor`)."""
        most = self.counts.max(axis=1, initial=0)
        return most if self.floor is None else np.maximum(most, self.floor)

    def keep_of(self, job: int) -> torch.Tensor:
        """Job `job`'s plan, [Hkv, its width]."""
        return self.keep[int(self.pos[job]), :, : int(self.widths[job])]

    def result(self, job: int, physical: np.ndarray | None = None) -> Compacted:
        """Job `job` after compaction (`physical`: `self.physical`, when the caller has it)."""
        length = int(self.physical[job] if physical is None else physical[job])
        counts = self.counts[job]
        if (counts == length).all():
            return Compacted(length, None)
        return Compacted(length, [length - int(c) for c in counts])


def stack_keeps(sources: Seq[tuple[torch.Tensor, int | None]], device: torch.device) -> tuple[
        torch.Tensor, np.ndarray, np.ndarray]:
    """(keep [N, Hkv, K] on `device`, pos [N], widths [N]) of N plans, each given as (`plan`
    [Hkv, k], None) or (`stack` [G, Hkv, k], row): plans naming the same tensor are moved and
    gathered once (every row of a stack in order: the stack itself; one plan or one row for all: an
    expanded view, no copy). K is the widest plan; narrower groups are padded."""
    tensors = [tensor for tensor, _ in sources]
    if tensors and all(tensor is tensors[0] for tensor in tensors):  # the common case: one shared tensor
        groups = {0: (tensors[0], list(range(len(sources))), [row for _, row in sources])}
    else:
        groups: dict[int, tuple[torch.Tensor, list[int], list]] = {}
        for job, (tensor, row) in enumerate(sources):
            group = groups.get(id(tensor))
            if group is None:
                groups[id(tensor)] = (tensor, [job], [row])
            else:
                group[1].append(job)
                group[2].append(row)
    parts = []
    pos, widths = np.empty(len(sources), dtype=np.int64), np.empty(len(sources), dtype=np.int64)
    for tensor, jobs, rows in groups.values():
        stack = tensor if rows[0] is not None else tensor[None]
        if rows[0] is None:
            rows = [0] * len(jobs)  # one plan for every job of the group
        if stack.dim() != 3:
            raise ValueError(f"keep plan must be [Hkv, kept], got {tuple(stack.shape[1:])}")
        if stack.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"keep plan indices must be integers, got {stack.dtype}")
        stack = stack.to(device=device, dtype=torch.long)
        if rows == list(range(stack.shape[0])):
            part = stack
        elif len(set(rows)) == 1:
            part = stack[rows[0]].expand(len(rows), *stack.shape[1:])
        else:
            part = stack[to_device(rows, device)]
        at = sum(p.shape[0] for p in parts)
        pos[jobs] = np.arange(at, at + len(jobs))
        widths[jobs] = stack.shape[2]
        parts.append(part)
    if not parts:
        return torch.zeros(0, 0, 0, dtype=torch.long, device=device), pos, widths
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"keep plans of one layer must have one KV head count, got {[p.shape[1] for p in parts]}")
    if len(parts) == 1:
        keep = parts[0]
    else:
        width = max(p.shape[2] for p in parts)
        keep = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[2])) for p in parts])
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    return keep, pos, widths


def batch_of_jobs(k_cache: torch.Tensor, jobs: Seq[CompactionJob]) -> CompactionBatch:
    """The batch of a list of jobs (Python per job: their tables, counts and starts are lists)."""
    num_kv_heads = k_cache.shape[1]
    for job in jobs:
        if job.keep.dim() != 2 or job.keep.shape[0] != num_kv_heads:
            raise ValueError(f"keep plan must be [{num_kv_heads}, kept], got {tuple(job.keep.shape)}")
    keep, pos, widths = stack_keeps([(job.keep, None) for job in jobs], k_cache.device)
    counts = np.repeat(widths[:, None], num_kv_heads, axis=1)
    for j, job in enumerate(jobs):
        if job.counts is not None:
            values = [int(c) for c in job.counts.detach().cpu().tolist()]  # free for CPU counts
            if len(values) != num_kv_heads:
                raise ValueError(f"keep plan lengths must be [{num_kv_heads}] counts in [0, {int(widths[j])}], "
                                 f"got {values}")
            counts[j] = values
    width = max((len(job.page_ids) for job in jobs), default=1)
    tables = np.zeros((len(jobs), max(width, 1)), dtype=np.int64)
    for j, job in enumerate(jobs):
        tables[j, : len(job.page_ids)] = job.page_ids
    starts = None
    if any(job.starts is not None for job in jobs):
        starts = np.zeros((len(jobs), num_kv_heads), dtype=np.int64)
        for j, job in enumerate(jobs):
            if job.starts is not None:
                if len(job.starts) != num_kv_heads:
                    raise ValueError(f"per-head starts must be [{num_kv_heads}] slots, got {list(job.starts)}")
                starts[j] = job.starts
    return CompactionBatch(keep, pos, widths, counts, np.array([job.length for job in jobs], dtype=np.int64),
                           tables, np.array([len(job.page_ids) for job in jobs], dtype=np.int64), starts,
                           floor=widths)


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
    """Applies every job (one layer, distinct sequences) in place, to K, V and every other
    per-token tensor in `planes` (`[pages (+ scratch), Hkv, page_size, *shape]`); `checked` None:
    check values where that costs no device sync, or when KVC_CHECK_COMPACTION=1."""
    if not jobs:
        return []
    batch = batch_of_jobs(k_cache, jobs)
    physical = compact_batch(k_cache, v_cache, batch, checked=checked, backend=backend, planes=planes)
    return [batch.result(j, physical) for j in range(len(jobs))]


def compact_batch(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: CompactionBatch,
    checked: bool | None = None,
    backend: str = "auto",
    planes: Seq[torch.Tensor] = (),
) -> np.ndarray:
    """`compact_tensors` of dense K, V and `planes`."""
    return compact_tensors([k_cache, v_cache, *planes], batch, checked=checked, backend=backend)


def compact_tensors(tensors: Seq[torch.Tensor], batch: CompactionBatch, checked: bool | None = None,
                    backend: str = "auto") -> np.ndarray:
    """Applies a ready batch (host work per layer, not per job) to every per-token tensor in
    `tensors` (`[pages (+ scratch), Hkv, page_size, *shape]`, one page layout: a KV spec's TOKEN
    tensors); returns each job's new physical length M ([N], the callers' order; `batch.result`
    gives the start slots)."""
    _check_tensors(tensors)
    first = tensors[0]
    use_triton = _use_triton(backend, first.device)
    if len(batch.lengths) == 0:
        return np.zeros(0, dtype=np.int64)
    if checked is None:
        checked = first.device.type == "cpu" or os.environ.get(CHECK_ENV) == "1"
    _check_host(batch, first.shape[1], first.shape[2])
    if checked:
        _check_values(batch)
    physical = batch.physical
    if not physical.any():
        return physical
    if use_triton:
        _compact_triton(tensors, batch, physical)
    else:
        _compact_torch(tensors, batch, physical)
    return physical


def _check_tensors(tensors: Seq[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("compaction needs at least one per-token tensor")
    first = tensors[0]
    if first.dim() < 3:
        raise ValueError(f"a per-token tensor is [pages, Hkv, page_size, ...], got {tuple(first.shape)}")
    for t in tensors:
        if t.dim() < 3 or t.shape[1:3] != first.shape[1:3] or t.shape[0] < first.shape[0] - 1:
            raise ValueError(f"per-token tensors must share [pages, {first.shape[1]}, {first.shape[2]}, ...], got "
                             f"{tuple(t.shape)} beside {tuple(first.shape)}")


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


def _check_host(batch: CompactionBatch, num_kv_heads: int, page_size: int) -> None:
    """The checks that cost nothing (host facts only), vectorised; the first failing job is named."""
    keep, counts, lengths = batch.keep, batch.counts, batch.lengths
    if keep.dim() != 3 or keep.shape[1] != num_kv_heads:
        raise ValueError(f"keep plan must be [{num_kv_heads}, kept], got {tuple(keep.shape[1:])}")
    bad = ((counts < 0) | (counts > batch.widths[:, None])).any(axis=1)
    if bad.any():
        j = int(bad.argmax())
        raise ValueError(f"keep plan lengths must be [{num_kv_heads}] counts in [0, {int(batch.widths[j])}], got "
                         f"{counts[j].tolist()}")
    starts = np.zeros_like(counts) if batch.starts is None else batch.starts
    bad = ((starts < 0) | (starts > lengths[:, None])).any(axis=1)
    if bad.any():
        j = int(bad.argmax())
        raise ValueError(f"per-head starts must be [{num_kv_heads}] slots in [0, {int(lengths[j])}], got "
                         f"{starts[j].tolist()}")
    bad = batch.pages * page_size < lengths
    if bad.any():
        j = int(bad.argmax())
        raise ValueError(f"{int(batch.pages[j])} pages of {page_size} slots cannot hold {int(lengths[j])} tokens")
    over = counts > lengths[:, None] - starts
    if over.any():
        j, head = (int(i) for i in np.argwhere(over)[0])
        start, length = int(starts[j, head]), int(lengths[j])
        raise ValueError(f"keep plan keeps {int(counts[j, head])} tokens of KV head {head}, which stores only "
                         f"{length - start} (slots [{start}, {length}))")


def _check_values(batch: CompactionBatch) -> None:
    """Each head's kept indices lie in [start_h, length) and strictly ascend (reads them back)."""
    keep = batch.keep.cpu()[torch.as_tensor(batch.pos)]  # [N, Hkv, K], the callers' order
    valid = torch.as_tensor(np.arange(keep.shape[2])[None, None, :] < batch.counts[:, :, None])
    starts = np.zeros_like(batch.counts) if batch.starts is None else batch.starts
    low = torch.as_tensor(starts)[:, :, None]
    high = torch.as_tensor(batch.lengths)[:, None, None]
    outside = (valid & ((keep < low) | (keep >= high))).any(dim=2)
    descending = (valid[:, :, 1:] & (keep[:, :, 1:] <= keep[:, :, :-1])).any(dim=2)
    for bad, what in ((outside, "outside"), (descending, "ascend")):
        if bad.any():
            j, head = (int(i) for i in bad.nonzero()[0])
            row = keep[j, head, : int(batch.counts[j, head])].tolist()
            if what == "outside":
                raise ValueError(f"keep plan indexes outside the stored tokens of KV head {head} (slots "
                                 f"[{int(starts[j, head])}, {int(batch.lengths[j])})): {row}")
            raise ValueError(f"keep plan indices of KV head {head} must ascend strictly: {row}")


def _resolve(k_cache: torch.Tensor, job: CompactionJob, checked: bool) -> HostPlan:
    """One job's host facts (counts, M) after the free checks, values too if asked: the input of
    `compaction_triton.compact_triton` (the tuner and the kernel tests call it per plan)."""
    batch = batch_of_jobs(k_cache, [job])
    _check_host(batch, k_cache.shape[1], k_cache.shape[2])
    if checked:
        _check_values(batch)
    counts = batch.counts[0].tolist()
    return HostPlan(list(job.page_ids), batch.keep_of(0), counts, max(counts, default=0))


def _compact_triton(tensors: Seq[torch.Tensor], batch: CompactionBatch, physical: np.ndarray) -> None:
    """The kernel's launches for a batch: its inputs packed here, vectorised (`meta [N, Hkv + 1 +
    W]` int32: counts, M, page table; one pinned copy), `keep` as it is (its row stride may be 0),
    so compaction_triton.py (the kernel, its tuned entries keyed by the file's hash) is untouched;
    `compact_triton` there is the same launch for a list of `HostPlan`s. Two tensors of one shape,
    dtype and strides (dense K and V) share a launch; any other per-token tensor gets its own, its
    per-slot values seen as one row."""
    from kvc.runtime.kv import compaction_triton as kernel

    first = tensors[0]
    live = np.flatnonzero(physical > 0)  # jobs that keep nothing move nothing
    rows = batch.pos[live]
    keep = batch.keep if np.array_equal(rows, np.arange(batch.keep.shape[0])) else \
        batch.keep[to_device(rows, first.device)]
    meta = np.concatenate([batch.counts[live], physical[live, None], batch.tables[live]], axis=1).astype(np.int32)
    meta_t = to_device(meta, first.device)
    num_kv_heads = first.shape[1]
    rest = list(tensors)
    if len(rest) >= 2 and _pairs(rest[0], rest[1]):
        k_cache, v_cache = rest.pop(0), rest.pop(0)
        cfg = kernel.launch_config(len(live), keep.shape[2], num_kv_heads, k_cache.shape[3], k_cache.dtype)
        kernel._launch(k_cache, v_cache, 2, keep, meta_t, len(live), cfg["block_d"], cfg["block_t"],
                       cfg["num_warps"])
    for tensor in rest:  # [pages, Hkv, S, *shape] as [pages, Hkv, S, n]: one program per (plan, head, slice)
        rows_n = tensor.reshape(*tensor.shape[:3], -1)
        if not tensor.is_contiguous():
            raise ValueError("the compaction kernel needs contiguous per-token tensors")
        width = rows_n.shape[3]
        cfg = kernel.launch_config(len(live), keep.shape[2], num_kv_heads, max(width, 2), tensor.dtype)
        block_d = max(2, min(cfg["block_d"], 1 << (width - 1).bit_length()))
        kernel._launch(rows_n, rows_n, 1, keep, meta_t, len(live), block_d, cfg["block_t"], cfg["num_warps"])


def _pairs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Can two tensors share one launch (dense K and V)?"""
    return (a.dim() == 4 and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
            and a.stride(3) == 1)


def _compact_torch(caches: Seq[torch.Tensor], batch: CompactionBatch, physical: np.ndarray) -> None:
    """Gather every kept row of every job into a temporary, then scatter it: in place is safe
    whatever moves where, as all reads happen before any write (and jobs own disjoint pages).
    `caches`: per-token tensors (a slot's value may be a vector, as K's, or a single value)."""
    page_size = caches[0].shape[2]
    device = caches[0].device
    keep = batch.keep[to_device(batch.pos, device)]  # [N, Hkv, K], the callers' order
    num_jobs, num_heads, width = keep.shape
    token = np.arange(width)
    valid = token[None, None, :] < batch.counts[:, :, None]  # [N, Hkv, K]
    offsets = physical[:, None] - batch.counts  # right-aligned below M
    dst = np.broadcast_to(offsets[:, :, None] + token, valid.shape)
    jobs = np.broadcast_to(np.arange(num_jobs)[:, None, None], valid.shape)
    heads = np.broadcast_to(np.arange(num_heads)[None, :, None], valid.shape)
    src = keep.reshape(-1)
    if not valid.all():
        flat = np.flatnonzero(valid)
        src = src[to_device(flat, device)]
        dst, jobs, heads = dst.reshape(-1)[flat], jobs.reshape(-1)[flat], heads.reshape(-1)[flat]
    dst, jobs, heads = (to_device(a.reshape(-1).copy(), device) for a in (dst, jobs, heads))
    tables = to_device(batch.tables.astype(np.int64), device)
    src_page, src_slot = tables[jobs, src // page_size], src % page_size
    dst_page, dst_slot = tables[jobs, dst // page_size], dst % page_size
    for cache in caches:
        gathered = cache[src_page, heads, src_slot]  # [n, D] or [n], a copy
        cache[dst_page, heads, dst_slot] = gathered
