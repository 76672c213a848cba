"""The method's hooks around a step's forward, and what their plans change in the sequences.

Pipeline position: called by the model runner (runtime/model_runner.py) inside the forward
(`prefill`, per layer, after the layer's attention) and after it (`step_end`); before a step, it
makes the pages a step writes the sequence's own (copy-on-write) and copies a continuation's row.
The plans themselves are carried out by the executor (runtime/kv/executor.py); here they become
bookkeeping: compacted lengths and residual counts for the scheduler (`StepOutput`), per-head
start slots, verbatim tails and position maps on the sequences. docs/design.md, "Plans" and
"Chain cache".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvc.runtime.host_ranges import host_range
from kvc.runtime.kv.compaction import CompactionBatch, CompactionJob, batch_of_jobs, stack_keeps
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.positions import compact_map
from kvc.runtime.kv.ring import Rings
from kvc.runtime.kv.store import KVStore
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.method_api import (Hook, KVMethod, LayerCacheView, PrefillView, RewritePlan, StackedPlan, StepView,
                                    StepViews)
from kvc.runtime.scheduler import ScheduledBatch
from kvc.runtime.text_spans import TextSpans
from kvc.runtime.transfer import to_device

if TYPE_CHECKING:
    from kvc.runtime.model_runner import StepOutput

STACKED_ROWS = 4096  # rows x layers of one stacked step end at most (`StepHooks._layer_groups`)


class StepHooks:
    def __init__(self, method: KVMethod, stores: list[KVStore], executors: list[KVExecutor], tables: TableCache,
                 pool: PagePool | None, num_layers: int, copy_rows: Callable | None = None,
                 layer_class: tuple[int, ...] | None = None) -> None:
        """One store and executor per storage class (`layer_class[l]`: layer l's); the tables a hook
        sees hold its class store's page indices (`TableCache.local`)."""
        self.method, self.tables, self.pool = method, tables, pool
        self.stores, self.executors = stores, executors
        self.text_spans: dict[str, TextSpans] = {}  # the method's text partitions (the engine sets them)
        # its lane's decode rings (runtime/kv/ring.py; the engine sets them): an unchained decode row's
        # window keep is where its next token is written, not a step-end plan
        self.rings: Rings | None = None
        self.layer_class = tuple(layer_class) if layer_class is not None else (0,) * num_layers
        store = stores[0]
        # rows by id in every store that has them (`PagedAttention.copy_rows`; default: the store's)
        self._copy_rows = copy_rows or store.copy_rows
        self.num_layers, self.num_kv_heads, self.page_size = num_layers, store.num_kv_heads, store.page_size
        # the method's per-token state (every decode row writes it), in any class's store
        self.planes = any(stores[c].method_tensors() for c in set(self.layer_class))  # of its layers' stores

    def settle(self, seq) -> None:
        """seq's layers back in time order where a keep evicted in place (runtime/kv/slot_order.py): a
        chain's turn ends, and its record's readers (the next turn's prefill hooks, pruning, rollback)
        read slots in order. One call per storage class."""
        if not any(store.spec.in_place for store in self.stores):
            return
        arr = self.tables.array(seq)
        lengths = np.asarray(seq.kv_lens, dtype=np.int64)
        for cls, executor in enumerate(self.executors):
            layers = [layer for layer in range(self.num_layers) if self.layer_class[layer] == cls]
            if layers and executor.store.spec.in_place:
                executor.settle(arr[layers], lengths[layers])

    def store_of(self, layer: int) -> KVStore:
        return self.stores[self.layer_class[layer]]

    def executor_of(self, layer: int) -> KVExecutor:
        return self.executors[self.layer_class[layer]]

    # ---- copy-on-write -----------------------------------------------------------------------
    # The scheduler sets aside one spare page per shared page a step writes (`Scheduler._copies`),
    # so a sequence without spare pages writes into no shared page: its tables are not walked
    # (the hot path of every decode step, and of every keep plan of decode-time eviction).
    def own_append_pages(self, batch: ScheduledBatch) -> None:
        """Each sequence's partial last page, which this step appends to, becomes its own (every
        page of a decode row when the decode hook writes state planes; a ringed layer's page of the
        slot it writes over)."""
        page = self.page_size
        for i, seq in enumerate(batch.seqs):
            if not seq.spare_pages:
                continue
            if self.planes and i < batch.num_decodes:
                for layer, table in enumerate(seq.page_tables):
                    self._own_pages(seq, layer, len(table))
                continue
            rings = None if seq.ring is None else seq.ring.slots(seq.num_computed_tokens).tolist()
            for layer, kv in enumerate(seq.kv_lens):
                if rings is not None and rings[layer] >= 0:
                    self._own_page(seq, layer, rings[layer] // page)
                elif kv % page:
                    self._own_page(seq, layer, kv // page)

    def _own_pages(self, seq, layer: int, count: int) -> None:
        """The first `count` pages of seq's layer table become its own (a compaction rewrites them)."""
        if self.pool is not None and seq.spare_pages:
            for index in range(min(count, len(seq.page_tables[layer]))):
                self._own_page(seq, layer, index)

    def _own_page(self, seq, layer: int, index: int) -> None:
        if self.executor_of(layer).own_page(seq.page_tables[layer], index, seq.spare_pages):
            seq.tables_version += 1

    def copy_rows(self, batch: ScheduledBatch) -> None:
        """A chain continuation's row starts as its record's (rows are never shared)."""
        for seq in batch.seqs:
            if seq.row_source is not None:
                self._copy_rows([seq.row_source], [seq.row])
                seq.row_source = None

    # ---- hooks and their plans ---------------------------------------------------------------
    def prefill(self, layer: int, q, k, v, batch: ScheduledBatch, output: StepOutput) -> None:
        """prefill_chunk for every prefill chunk of the step, then prefill_end for the chunks that
        end their sequence's prefill; their keep plans (and a chunk-keeping method's prefill_chunk
        plans) are compacted together (one call), their rewrite plans re-encoded."""
        method = self.method
        starts = np.cumsum([0, *batch.num_new_tokens]).tolist()  # host rows of each sequence's chunk
        jobs: list[tuple[object, CompactionJob]] = []
        for i in range(batch.num_decodes, len(batch.seqs)):
            seq, n = batch.seqs[i], batch.num_new_tokens[i]
            rows = slice(starts[i], starts[i] + n)
            table = seq.page_tables[layer]
            length = seq.kv_lens[layer] + n  # stored after this chunk (postprocess advances it)
            view = PrefillView(
                seq_id=seq.seq_id, layer=layer, num_layers=self.num_layers,
                q=q[rows], k=k[rows], v=v[rows], start=seq.num_computed_tokens,
                prompt_len=seq.prefill_end,
                cache=self._cache_view(seq, layer, length, n),
                memo=None if seq.replay is None else seq.replay.memo,
            )
            plan = None
            if Hook.PREFILL_CHUNK in method.hooks:
                plan = method.prefill_chunk(layer, view)  # a plan only from a method with `chunk_keeps`
            if view.is_last and Hook.PREFILL_END in method.hooks:
                if plan is not None:
                    raise RuntimeError(f"method {method.name!r} gave keep plans at both prefill_chunk and "
                                       "prefill_end of one chunk")
                if self.planes:  # prefill_end stores the state in the layer's planes
                    self._own_pages(seq, layer, len(table))
                plan = method.prefill_end(layer, view)
            if plan is None:
                continue
            if isinstance(plan, RewritePlan):
                self._rewrite(seq, layer, view.cache, plan, output)
                continue
            self._own_pages(seq, layer, -(-plan.kept // self.page_size))  # copy-on-write before compaction
            logical = seq.num_computed_tokens + n
            jobs.append((seq, CompactionJob(self.tables.local(layer, table), length, plan.indices, plan.lengths,
                                            seq.kv_starts[layer]),
                         logical - plan.tail, logical, n))
        if jobs:
            batch = batch_of_jobs(self.store_of(layer).token_tensors()[0], [j[1] for j in jobs])
            self._compact(layer, batch, [j[0] for j in jobs], [j[2] for j in jobs], [j[3] for j in jobs],
                          output.compacted, [j[4] for j in jobs])

    def keep_stored(self, seq, plans: list, length: int, new: int, output: StepOutput) -> None:
        """Keep plans for every layer of one sequence that stores `length` tokens, `new` of them from this
        step (a replay pass's, after the prefill that ended in it: runtime/context_replay.py), compacted
        and reported like prefill_end's."""
        for layer, plan in enumerate(plans):
            if plan is None:
                continue
            self._own_pages(seq, layer, -(-plan.kept // self.page_size))  # copy-on-write before compaction
            job = CompactionJob(self.tables.local(layer, seq.page_tables[layer]), length, plan.indices, plan.lengths,
                                seq.kv_starts[layer])
            batch = batch_of_jobs(self.store_of(layer).token_tensors()[0], [job])
            self._compact(layer, batch, [seq], [length - plan.tail], [length], output.compacted, [new])

    def _held(self, seq, layer: int, new: int) -> int:
        """The slots seq's residual window holds in `layer` once the step's `new` tokens are stored."""
        return min(seq.resid_lens[layer] + new, self.store_of(layer).residual_window)

    def _cache_view(self, seq, layer: int, length: int, new: int) -> LayerCacheView:
        """seq's layer as a hook sees it once `new` more tokens are stored (`length` slots)."""
        return LayerCacheView(self.store_of(layer), self.tables.local(layer, seq.page_tables[layer]), length,
                              seq.kv_starts[layer], layer, seq.row,
                              self._held(seq, layer, new))

    def _rewrite(self, seq, layer: int, cache: LayerCacheView, plan: RewritePlan, output: StepOutput) -> None:
        """A rewrite plan re-encoded now (copy-on-write first); the residual slots it leaves are
        reported like compacted lengths (the scheduler records them)."""
        self._own_pages(seq, layer, -(-cache.length // self.page_size))
        left = self.executor_of(layer).rewrite(layer, self.tables.local(layer, seq.page_tables[layer]), cache.length,
                                               seq.row, cache.resid_len, plan)
        output.rewritten.setdefault(seq.seq_id, {})[layer] = left

    def _compact(self, layers: int | np.ndarray, batch: CompactionBatch, seqs: list, verbatim: list[int],
                 logical: list[int], compacted: dict[int, dict[int, int]], new: list[int] | None = None,
                 in_place: bool = False) -> None:
        """Applies keep plans of one storage class (one kernel launch on a GPU), reports the kept lengths,
        records the per-head start slots of plans with per-head variable counts and moves each
        sequence's verbatim tail (`verbatim_from`: the first logical token a keep may have dropped
        or moved, for the chain cache's rollback); a chained sequence's position map follows the plan.
        Job j of `batch` is `seqs[j]`'s in layer `layers` (one for all, or `layers[j]`: a store without
        page summaries, not written a block at a time), which stored `new[j]` tokens this step (default 1).
        (Over a spec written a block at a time, the executor needs each job's row and window.)
        `in_place`: the plans are carried out in place (runtime/kv/slot_order.py); a position map
        follows them as if in order, the layout the chain's record gets (`settle`)."""
        of_job = [layers] * len(seqs) if isinstance(layers, int) else layers.tolist()
        layer = of_job[0] if of_job else 0
        windows = None
        if self.store_of(layer).flushes_blocks:
            windows = [(seq.row, self._held(seq, layer, 1 if new is None else new[j])) for j, seq in enumerate(seqs)]
        physical = self.executor_of(layer).compact(batch, layer=layer, windows=windows, in_place=in_place)
        uniform = batch.starts is None and bool((batch.counts == batch.widths[:, None]).all())  # no starts anywhere
        for j, (seq, layer, length, tail_from) in enumerate(zip(seqs, of_job, physical.tolist(), verbatim)):
            per_seq = compacted.get(seq.seq_id)
            if per_seq is None:
                compacted[seq.seq_id] = {layer: length}
            else:
                per_seq[layer] = length
            if tail_from > seq.verbatim_from:
                seq.verbatim_from = tail_from
            if uniform and seq.positions is None and seq.kv_starts[layer] is None:
                continue  # equal counts over no starts: nothing more to record
            result = batch.result(j, physical)
            if seq.positions is not None:
                keep = batch.keep_of(j)
                counts = [length] * keep.shape[0] if result.starts is None else [length - s for s in result.starts]
                seq.positions[layer] = compact_map(seq.positions[layer], int(batch.lengths[j]), logical[j], keep,
                                                   counts, length)
            if result.starts is not None or seq.kv_starts[layer] is not None:
                seq.set_kv_starts(layer, result.starts)

    def step_end(self, batch: ScheduledBatch, output: StepOutput) -> None:
        """step_end per layer of every sequence that decoded in this step (`step_end_batch`, one call
        per layer, when the method has it); each layer's keep plans are compacted at once and
        reported (the scheduler frees the pages past them). Host work per layer is numpy and a few
        torch calls, plus Python per row for the bookkeeping: the page tables come from the runner's
        cached arrays, the rows' views (`StepViews`) are made only where a method reads them, and
        plans sharing a tensor (`StackedPlan`) move as one."""
        method, page = self.method, self.page_size
        decoded = batch.seqs[: batch.num_decodes]
        if self.rings is not None:  # a ringed row evicts by where it writes (runtime/kv/ring.py): no plan
            decoded = [seq for seq in decoded if seq.ring is None]
            if not decoded:
                return
        batched = method.step_end_batch
        num_layers, cache_view = self.num_layers, self._cache_view
        packed = versions = None  # [L, B, W] page tables of `decoded`, built at the first layer with candidates
        due_fn = method.step_end_due
        # host facts of every row and layer, for the method's cheap "may it evict now"
        gaps = np.array([seq.history_gap for seq in decoded], dtype=np.int64)  # [B, L]
        lengths = np.array([seq.kv_lens for seq in decoded], dtype=np.int64) + 1  # the step's token is stored
        contexts = np.array([seq.num_computed_tokens + 1 for seq in decoded], dtype=np.int64)[:, None] - gaps
        prompts = np.array([seq.prefill_end for seq in decoded], dtype=np.int64)[:, None] - gaps
        everyone = list(range(len(decoded)))
        seq_rows = np.array([-1 if seq.row is None else seq.row for seq in decoded], dtype=np.int64)  # -1: none
        dues = [due_fn(layer, lengths[:, layer], prompts[:, layer], contexts[:, layer]) for layer in range(num_layers)]
        for layers, due in self._layer_groups(dues, len(decoded)):
            candidates = everyone if due is None or due.all() else np.flatnonzero(due).tolist()
            if packed is None:
                width = max(self.tables.longest(seq) for seq in decoded)
                packed, versions = self.tables.pack_numpy(decoded, width), [s.tables_version for s in decoded]
                page_counts = np.array([self.tables.lengths(seq) for seq in decoded], dtype=np.int64)  # [B, L]
            # the step's rows: every candidate in each layer of the group, layer by layer
            row_of = np.tile(np.asarray(candidates, dtype=np.int64), len(layers))
            layer_of = np.repeat(np.asarray(layers, dtype=np.int64), len(candidates))

            def make(i: int, row_of=row_of, layer_of=layer_of) -> StepView:
                seq, layer = decoded[row_of[i]], int(layer_of[i])
                return StepView(seq.seq_id, layer, num_layers, seq.num_computed_tokens + 1 - seq.history_gap[layer],
                                seq.prefill_end - seq.history_gap[layer],  # a chain's prompt: stored history + suffix
                                cache_view(seq, layer, seq.kv_lens[layer] + 1, 1),  # the step's token is stored
                                self._spans_of(seq))

            # one layer: index with it and a slice (every row) or the candidates, views where numpy gives them
            rix, lix = (row_of, layer_of) if len(layers) > 1 else (
                slice(None) if candidates is everyone else np.asarray(candidates), layers[0])
            views = StepViews(layers[0], self.store_of(layers[0]), [decoded[r].seq_id for r in row_of.tolist()],
                              lengths[rix, lix], contexts[rix, lix], prompts[rix, lix], packed[lix, rix],
                              page_counts[rix, lix], make, seq_rows[rix], layers=layer_of if len(layers) > 1 else None)
            with host_range("kvc.step_end.select"):
                plans = batched(layers[0], views)
            if len(plans) != len(views):
                raise RuntimeError(f"method {method.name!r}: step_end_batch gave {len(plans)} plans for "
                                   f"{len(views)} sequences")
            found = [i for i, plan in enumerate(plans) if plan is not None]  # indices into the step's rows
            if found and any(isinstance(plans[i], RewritePlan) for i in found):
                for i in [i for i in found if isinstance(plans[i], RewritePlan)]:
                    self._rewrite(decoded[row_of[i]], int(layer_of[i]), views[i].cache, plans[i], output)
                found = [i for i in found if not isinstance(plans[i], RewritePlan)]
            if not found:
                continue
            every = len(found) == len(plans)  # the common case: every row evicts
            jobs_rows, jobs_layers = (row_of, layer_of) if every else (row_of[found], layer_of[found])
            rix_jobs, lix_jobs = (rix, lix) if every else (jobs_rows, jobs_layers)  # every row: the views' indexing
            if self.pool is not None:
                for i, row, layer in zip(found, jobs_rows.tolist(), jobs_layers.tolist()):
                    seq = decoded[row]
                    if seq.spare_pages:  # copy-on-write before compaction; a table it changes is re-read
                        self._own_pages(seq, layer, -(-plans[i].kept // page))
                        if seq.tables_version != versions[row]:
                            self._refresh_table(packed, row, seq)
                            versions[row] = seq.tables_version
            seqs = [decoded[row] for row in jobs_rows.tolist()]
            kept = plans if every else [plans[i] for i in found]
            logical = [seq.num_computed_tokens + 1 for seq in seqs]
            with host_range("kvc.step_end.compact"):
                jobs = self._plan_batch(jobs_layers, kept, seqs, lengths[rix_jobs, lix_jobs],
                                        page_counts[rix_jobs, lix_jobs], packed[lix_jobs, rix_jobs])
                self._compact(jobs_layers, jobs, seqs, [n - plan.tail for n, plan in zip(logical, kept)], logical,
                              output.compacted, in_place=self.store_of(layers[0]).spec.in_place)

    def _layer_groups(self, dues: list[np.ndarray | None], rows: int) -> list[tuple[list[int], np.ndarray | None]]:
        """The layers whose step ends run together, each group with its rows' due mask (None: each of the `rows`
        may be): one layer at a time, or, where the method stacks layers (`step_end_layers`), the layers of
        one storage class due in the same rows, in one call (one scoring and selection for all of them, one
        compaction), where the class's store moves slots without a per-layer pass (no page summaries, not
        written a block at a time); at most STACKED_ROWS rows x layers a call (the stacked temporaries: a few
        rows evict in every layer at once, a whole batch a few layers at a time). Layers where no row is due
        are left out."""
        groups: dict[tuple, tuple[list[int], np.ndarray | None]] = {}
        stacks = self.method.step_end_layers
        for layer, due in enumerate(dues):
            if due is not None and not due.any():
                continue  # no row evicts in this layer at this step (an eviction interval's steps between)
            store = self.store_of(layer)
            if not stacks or store.flushes_blocks or store.spec.summaries:
                groups[("layer", layer)] = ([layer], due)
                continue
            key = (self.layer_class[layer], None if due is None else due.tobytes())
            group = groups.get(key)
            if group is None:
                groups[key] = ([layer], due)
            else:
                group[0].append(layer)
        out = []
        for layers, due in groups.values():
            per_call = max(1, STACKED_ROWS // (rows if due is None else int(due.sum())))
            out += [(layers[i:i + per_call], due) for i in range(0, len(layers), per_call)]
        return out

    def _spans_of(self, seq) -> Callable[[str], np.ndarray] | None:
        """A step view's `spans`: the span of each logical position of seq up to the step's token, per text
        partition of the method (runtime/text_spans.py); None where the method has none."""
        if not self.text_spans:
            return None
        return lambda name: self.text_spans[name].index(seq.token_ids, seq.num_computed_tokens + 1, seq.seq_id)

    def _refresh_table(self, packed: np.ndarray, row: int, seq) -> None:
        """Row `row` of the step's packed tables after copy-on-write changed seq's tables."""
        arr = self.tables.array(seq)
        width = min(packed.shape[2], arr.shape[1])
        packed[:, row] = 0
        packed[:, row, :width] = arr[:, :width]

    def _plan_batch(self, layers: np.ndarray, plans: list, seqs: list, lengths: np.ndarray, pages: np.ndarray,
                    tables: np.ndarray) -> CompactionBatch:
        """Step-end plans as a `CompactionBatch`, job j seqs[j]'s in layer `layers[j]` (one storage class): plans
        over one tensor (a `StackedPlan`'s stack, or one shared plan) gathered once; counts, lengths (the step's
        token stored), pages and starts as numpy."""
        device = self.stores[0].device
        sources = [(plan.stack, plan.row) if isinstance(plan, StackedPlan) else (plan.indices, None) for plan in plans]
        lengths, pages = np.ascontiguousarray(lengths), np.ascontiguousarray(pages)
        starts = None
        layers = layers.tolist()
        if any(seq.kv_starts[layer] is not None for seq, layer in zip(seqs, layers)):
            starts = np.array([seq.kv_starts[layer] or [0] * self.num_kv_heads for seq, layer in zip(seqs, layers)],
                              dtype=np.int64)
        keep, pos, widths = stack_keeps(sources, device)
        if keep.shape[1] != self.num_kv_heads:
            raise RuntimeError(f"method {self.method.name!r}: keep plans of layer {layers[0]} have {keep.shape[1]} "
                               f"KV heads, the model {self.num_kv_heads}")
        counts = np.repeat(widths[:, None], keep.shape[1], axis=1)
        for j, plan in enumerate(plans):
            if plan.lengths is not None:  # per-head variable counts (compiled methods keep them on the CPU)
                counts[j] = plan.lengths.detach().cpu().numpy()
        return CompactionBatch(keep, pos, widths, counts, lengths, tables, pages, starts, _shared_order(plans))


def _shared_order(plans: list) -> torch.Tensor | None:
    """[N, Hkv, n]: the plans' slots in time order, where they are rows of one stacked selection that sorted
    them (`StackedPlan.order`), job j's its plan's row; else None (the executor sorts)."""
    order = getattr(plans[0], "order", None) if plans else None
    if order is None or not all(isinstance(p, StackedPlan) and p.order is order for p in plans):
        return None
    rows = [p.order_row for p in plans]
    if rows == list(range(order.shape[0])):
        return order
    return order[to_device(rows, order.device)]

