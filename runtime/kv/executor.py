"""The plan executor: carries out methods' plans on the KV store, for every tensor of the spec.

The one place that knows what moving a page or a slot means for a spec's tensors:

- keep plans (`compact`): every TOKEN tensor's kept slots move together (runtime/kv/compaction.py),
  or, in place over a spec with positions (a decode-time keep: runtime/kv/slot_order.py), only the
  kept slots past the new length move, into the dropped ones below it;
  then the PAGE summaries of every page the compaction rewrote are recomputed; over a spec that
  writes codes a block at a time (KIVI's keys: scales per page, newest block only in the window),
  the kept tokens are decoded and stored again as a fresh prefill of them (`restore`);
- copies (`copy_pages`, copy-on-write `own_page`): every TOKEN and PAGE tensor of a page at once;
- rewrite plans (`rewrite`): a range re-encoded from its full-precision copies.

Read plans need no executor step: the attention kernels take them as they are. docs/design.md,
"Plans".
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvc.runtime.kv import encodings, slot_order
from kvc.runtime.kv.compaction import CompactionBatch, compact_tensors
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.plans import RewritePlan
from kvc.runtime.kv.spec import K, V, Quantized
from kvc.runtime.kv.store import KVStore
from kvc.runtime.transfer import to_device


class KVExecutor:
    def __init__(self, store: KVStore, pool: PagePool | None = None, compaction_backend: str = "auto",
                 restore: Callable | None = None, copy_pages: Callable | None = None) -> None:
        """`restore(layer, k, v, table, row)`: stores kept tokens as a fresh prefill of them
        (`PagedAttention.store_fresh`), for specs written a block at a time; `copy_pages(src, dst)`:
        whole pages by pool id (`PagedAttention.copy_pages`, which finds each page's storage class;
        default: the store's)."""
        self.store = store
        self._copy_pages = copy_pages or store.copy_pages
        self.pool = pool
        self.backend = compaction_backend
        self.restore = restore

    # ---- keep plans ----------------------------------------------------------------------------
    def compact(self, batch: CompactionBatch, checked: bool | None = None, layer: int | None = None,
                windows: list[tuple[int | None, int]] | None = None, in_place: bool = False) -> np.ndarray:
        """Applies one layer's keep plans to every per-token tensor; returns each job's new physical
        length (the callers' order). Page summaries of the rewritten pages are recomputed. A spec
        written a block at a time needs the `layer` and each job's (row, window count). `in_place`
        (a spec with positions): the plans' indices are in time order, and the kept slots past the
        new length fill the dropped ones (runtime/kv/slot_order.py)."""
        if in_place:
            return self._fill(batch, layer)
        if self.store.flushes_blocks:
            return self._restore(batch, checked, layer, windows)
        physical = compact_tensors(self.store.token_tensors(), batch, checked=checked, backend=self.backend)
        if self.store.spec.summaries and len(physical):
            self._refresh_rewritten(batch, physical, layer)
        return physical

    def _fill(self, batch: CompactionBatch, layer: int | None) -> np.ndarray:
        """Keep plans in place (`compact(..., in_place=True)`): equal counts per KV head, no start slots."""
        store = self.store
        if not store.spec.in_place:
            raise ValueError("a keep in place needs a spec that evicts in place (KVSpec.in_place, with positions)")
        if batch.starts is not None or not (batch.counts == batch.counts[:, :1]).all():
            raise ValueError("a keep in place keeps the same count in every KV head")
        if not len(batch.lengths):
            return np.zeros(0, dtype=np.int64)
        counts = batch.counts[:, 0].astype(np.int64)
        keep = batch.keep[to_device(batch.pos, batch.keep.device)]  # [N, Hkv, K] in time order
        order = batch.order
        if order is None:
            order = slot_order.orders(store[store.spec.positions], batch.tables, batch.lengths)
        slot_order.fill(store.token_tensors(), slot_order.to_slots(keep, order), counts, batch.lengths, batch.tables,
                        backend=self.backend)
        if store.spec.summaries and len(counts):
            self._refresh_rewritten(batch, counts, layer)
        return counts

    def settle(self, tables: np.ndarray, lengths: np.ndarray) -> None:
        """Layers `tables [N, W]` (store indices) storing `lengths [N]` slots put back in time order (a
        spec with positions; runtime/kv/slot_order.py `settle`)."""
        store = self.store
        if store.spec.in_place and len(tables):
            slot_order.settle(store.token_tensors(), store[store.spec.positions], tables, lengths)

    def _restore(self, batch: CompactionBatch, checked: bool | None, layer: int | None,
                 windows: list[tuple[int | None, int]] | None) -> np.ndarray:
        """Keep plans over a spec that writes codes a block at a time: codes cannot move slot by slot
        (a page's scales belong to its group; the newest block has codes only in the window), so
        each job's kept K and V are decoded (codes and window) and stored again from slot 0 as a
        fresh prefill of them would be (the method's state planes move as slots do). Equal counts
        in every KV head only."""
        if layer is None or windows is None or self.restore is None:
            raise ValueError("a keep plan over a spec written a block at a time needs the layer, each job's row and "
                             "window count, and the executor's `restore`")
        if batch.starts is not None or not (batch.counts == batch.counts[:, :1]).all():
            raise ValueError("a keep plan over a spec written a block at a time keeps the same count in every KV head")
        store = self.store
        planes = [store[t.name] for t in store.spec.method_tensors]
        if planes:
            compact_tensors(planes, batch, checked=checked, backend=self.backend)
        for j, (row, resid) in enumerate(windows):
            table, length = batch.tables[j, : batch.pages[j]].tolist(), int(batch.lengths[j])
            keep = batch.keep_of(j)[:, : int(batch.counts[j, 0])].to(store.device)  # [Hkv, m]
            if keep.shape[1] == length and bool((keep == torch.arange(length, device=keep.device)).all()):
                continue  # keeps every slot in place: nothing to store again
            k, v = (store.decoded(which, table, length, layer, row, resid) for which in (K, V))  # [Hkv, L, D]
            k, v = (x.gather(1, keep[:, :, None].expand(-1, -1, x.shape[-1])).transpose(0, 1).contiguous()
                    for x in (k, v))
            self.restore(layer, k, v, table, row)
        physical = batch.counts[:, 0].astype(np.int64)
        if store.spec.summaries and len(physical) and not store.folds_summaries:  # folded: by `restore`'s store
            self._refresh_rewritten(batch, physical, layer)
        return physical

    def _refresh_rewritten(self, batch: CompactionBatch, physical: np.ndarray, layer: int | None) -> None:
        """Summaries of pages [0, ceil(M / S)) of every job (layer `layer`'s): what its compaction rewrote."""
        page = self.store.page_size
        pages, lengths = [], []
        for j, m in enumerate(physical.tolist()):
            full = -(-m // page)
            pages.extend(batch.tables[j, :full].tolist())
            lengths.extend([page] * (m // page) + ([m % page] if m % page else []))
        self.refresh_pages(pages, lengths, layer)

    def refresh_pages(self, pages: list[int], lengths: list[int], layer: int | None) -> None:
        """Recomputes the summaries of `pages` (layer `layer`'s), page i storing `lengths[i]` slots."""
        if pages and self.store.spec.summaries:
            device = self.store.device
            self.store.refresh_summaries(to_device(pages, device, torch.long), to_device(lengths, device, torch.long),
                                         layer)

    # ---- rewrite plans --------------------------------------------------------------------------
    def rewrite(self, layer: int, page_ids: list[int], length: int, row: int | None, resid_len: int,
                plan: RewritePlan) -> int:
        """Re-encodes slots [plan.start, plan.end) of one sequence's layer (`length` slots stored,
        the newest `resid_len` of them in its residual window) from their full-precision copies;
        returns the residual slots left (the window now holds only the slots past `plan.end`)."""
        store = self.store
        first = length - resid_len
        if plan.start != first or not plan.start <= plan.end <= length or row is None:
            raise ValueError(f"a rewrite plan re-encodes the oldest slots of the residual window: [{first}, e) with "
                             f"e <= {length}, got [{plan.start}, {plan.end})")
        if plan.end == plan.start:
            return resid_len
        slots = torch.arange(plan.start, plan.end, device=store.device)
        pages = to_device(page_ids, store.device, torch.long)[slots // store.page_size]
        offsets = slots % store.page_size
        for enc, which in ((store.spec.keys, K), (store.spec.values, V)):
            if not isinstance(enc, Quantized) or enc.residual is None:
                continue
            resid = store[enc.residual][row, layer]  # [Hkv, R, D]
            x = resid[:, slots % resid.shape[1]].transpose(0, 1)  # [n, Hkv, D]
            codes = store[enc.codes]
            scale = store[enc.scale]
            zero = None if enc.zero is None else store[enc.zero]
            new = encodings.quantize(x, enc, codes.dtype, packing=store.spec.tensor(enc.codes).packing,
                                     scale_dtype=scale.dtype, zero_dtype=scale.dtype if zero is None else zero.dtype)
            for dst, value in zip((codes, scale, zero), new):
                if dst is not None:
                    dst[pages, :, offsets] = value.to(dst.dtype)
        if store.spec.summaries:  # the pages' decoded values changed
            touched = sorted(set(pages.tolist()))
            stored = [min(store.page_size, length - page_ids.index(p) * store.page_size) for p in touched]
            self.refresh_pages(touched, stored, layer)
        return length - plan.end

    # ---- copies --------------------------------------------------------------------------------
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page src[i] -> page dst[i], every tensor of the spec."""
        self._copy_pages(src, dst)

    def _take_spare(self, spare: list[int], old: int) -> int:
        """A spare page of `old`'s storage class, taken from `spare`."""
        cls = self.pool.class_of(old)
        for i in range(len(spare) - 1, -1, -1):
            if self.pool.class_of(spare[i]) == cls:
                return spare.pop(i)
        raise RuntimeError(f"a write into shared page {old} without a spare page of its class (the scheduler "
                           "reserves them)")

    def own_page(self, table: list[int], index: int, spare: list[int]) -> bool:
        """Copy-on-write: `table[index]` becomes a page of its own, copied into a page taken from
        `spare` when it is shared (another holder, or named by the prefix cache); the reference on the
        old page is dropped. Returns whether the table changed."""
        pool = self.pool
        old = table[index]
        if pool is None or not pool.is_shared(old):
            return False
        if not spare:
            raise RuntimeError(f"a write into shared page {old} without a spare page (the scheduler reserves them)")
        new = self._take_spare(spare, old)
        self._copy_pages([old], [new])
        table[index] = new
        pool.free([old])
        return True
