"""Incremental per-layer page tables: what the scheduler's appends update in place equals a fresh
rebuild after any mix of changes.

A real `Scheduler` decodes synthetic sequences whose layers store different lengths (PyramidKV-like,
so some layer crosses a page boundary at nearly every step), and between steps random changes hit
them: copy-on-write of a page (the runner's `_own_page`), a compaction that truncates a layer
(`_shrink`) with per-head starts, clones, preemption and re-admission, aborts, and a tiny append
log (`resized_layers` cleared). After every step (property-style, fixed seeds):

- the runner's `TableCache` arrays, lengths and starts equal a fresh cache's;
- the scheduler's `Room` equals the free slots recomputed from the tables, and `_growth` the
  page count by layer;
- the decode graphs' host mirror and static device tables (`DecodeGraphs._load`, on the CPU)
  hold every row's tables, and its starts buffer the rows' starts.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvc.runtime import sequence as sequence_module
from kvc.runtime.decode_graphs import DecodeGraphs
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.room import Room
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence, SequenceStatus

LAYERS, HEADS, PAGE, SEATS = 6, 2, 4, 8


def _decoding(pool: PagePool, scheduler: Scheduler, rng: random.Random, lengths: list[int]) -> Sequence:
    """A running sequence in a method's post-prefill state, storing `lengths` tokens per layer."""
    logical = max(lengths)
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    seq = Sequence([rng.randrange(50) for _ in range(logical + 1)], params, max_model_len=1 << 12,
                   num_layers=LAYERS)
    seq.page_tables = [pool.allocate(pool.pages_for(n)) for n in lengths]
    seq.tables_version += 1
    seq.kv_lens, seq.num_computed_tokens, seq.compressed = list(lengths), logical, True
    seq.prefill_end = logical
    seq.status = SequenceStatus.RUNNING
    scheduler._live[seq.seq_id] = seq
    scheduler.running.append(seq)
    return seq


def _check_cache(cache: TableCache, seq: Sequence) -> None:
    fresh = TableCache(LAYERS, HEADS)
    want, got = fresh.array(seq), cache.array(seq)
    width = want.shape[1]
    assert got.shape[1] >= width and not got[:, width:].any()
    np.testing.assert_array_equal(got[:, :width], want)
    np.testing.assert_array_equal(cache.lengths(seq), [len(t) for t in seq.page_tables])
    assert cache.longest(seq) == fresh.longest(seq)
    np.testing.assert_array_equal(cache.starts_array(seq), fresh.starts_array(seq))


def _check_room(scheduler: Scheduler, seq: Sequence) -> None:
    room = scheduler._room(seq)
    free = [len(t) * PAGE - kv for t, kv in zip(seq.page_tables, seq.kv_lens)]
    assert room.free() == free
    assert room.least == min(free)
    for n in (1, 3, PAGE + 1):
        want = sum(scheduler.pool.pages_for(kv + n) - len(t) for kv, t in zip(seq.kv_lens, seq.page_tables))
        assert scheduler._growth(seq, n) == (0 if n <= min(free) else want)


def _check_mirror(graphs: DecodeGraphs, seqs: list[Sequence]) -> None:
    for i, seq in enumerate(seqs):
        for layer, table in enumerate(seq.page_tables):
            assert graphs._host_tables[layer, i, : len(table)].tolist() == table
            assert graphs.tables[layer, i, : len(table)].tolist() == table, (seq, layer)
            starts = seq.kv_starts[layer] or [0] * HEADS
            if seq.has_kv_starts:
                assert graphs.starts[layer, i].tolist() == starts


def _copy_on_write(pool: PagePool, rng: random.Random, seq: Sequence) -> None:
    """The runner's copy-on-write of one shared page (`KVExecutor.own_page`, as the step hooks call it)."""
    layer = rng.randrange(LAYERS)
    if not seq.page_tables[layer]:
        return
    index = rng.randrange(len(seq.page_tables[layer]))
    pool.acquire([seq.page_tables[layer][index]])  # another holder: the page is shared
    seq.spare_pages = pool.allocate(1)
    executor = KVExecutor(SimpleNamespace(copy_pages=lambda src, dst: None), pool)
    if executor.own_page(seq.page_tables[layer], index, seq.spare_pages):
        seq.tables_version += 1
    pool.free(seq.spare_pages)
    seq.spare_pages = []


def _compact(scheduler: Scheduler, rng: random.Random, seq: Sequence) -> None:
    """A keep plan: a layer truncated to fewer tokens, maybe with per-head starts; or every layer
    by the same few tokens (a decode-time keep's step, often freeing no page: the room follows)."""
    if rng.random() < 0.5:
        drop = rng.randrange(1, 3)
        if min(seq.kv_lens) > drop:
            scheduler._shrink(seq, {layer: kv - drop for layer, kv in enumerate(seq.kv_lens)})
        return
    layer = rng.randrange(LAYERS)
    kept = rng.randrange(1, seq.kv_lens[layer] + 1)
    scheduler._shrink(seq, {layer: kept})
    starts = [rng.randrange(kept) for _ in range(HEADS)] if rng.random() < 0.5 else None
    seq.set_kv_starts(layer, starts)


@pytest.mark.parametrize("seed,log_cap", [(0, None), (1, None), (2, 5)])
def test_incremental_tables_equal_a_fresh_rebuild(monkeypatch, seed: int, log_cap: int | None) -> None:
    if log_cap is not None:  # the append log fills up often: readers must rebuild, never go stale
        monkeypatch.setattr(sequence_module, "_RESIZED_LOG_CAP", log_cap)
    rng = random.Random(seed)
    pool = PagePool(4000, PAGE, False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=SEATS, max_num_batched_tokens=256,
                                          enable_prefix_caching=False), pool, num_layers=LAYERS)
    for _ in range(5):
        top = rng.randrange(8, 40)
        _decoding(pool, scheduler, rng, [max(1, top - 5 * layer + rng.randrange(3)) for layer in range(LAYERS)])
    runner = SimpleNamespace(device=torch.device("cpu"), lanes=[], num_layers=LAYERS, max_pages_per_seq=256,
                             num_kv_heads=HEADS, page_size=PAGE, tables=TableCache(LAYERS, HEADS),
                             max_model_len=256 * PAGE, attention=SimpleNamespace(num_pages=pool.num_pages, num_rows=0,
                                                                                 scratch_row=0, residual_window=0))
    graphs = DecodeGraphs(runner, SEATS)
    kinds = {"append": 0, "rebuild": 0}
    update_mirror = graphs._update_mirror

    def counted(seqs):
        rebuilt, appended = update_mirror(seqs)
        kinds["append"] += bool(appended)
        kinds["rebuild"] += bool(rebuilt)
        return rebuilt, appended

    graphs._update_mirror = counted
    for step in range(160):
        batch = scheduler.schedule()
        assert batch is not None
        decodes = batch.seqs[: batch.num_decodes]
        if decodes and rng.random() < 0.8:  # some steps skip the load: several changes pile up
            graphs._load(ScheduledBatch(decodes, [1] * len(decodes), len(decodes)))
            _check_mirror(graphs, decodes)
        finished = scheduler.postprocess(batch, {s.seq_id: rng.randrange(50) for s in batch.seqs})
        for seq in finished:
            runner.tables.drop(seq.seq_id)
        running = [s for s in scheduler.running if not s.is_prefill]
        change = rng.random()
        if running and change < 0.1:
            _copy_on_write(pool, rng, rng.choice(running))
        elif running and change < 0.2:
            _compact(scheduler, rng, rng.choice(running))
        elif running and change < 0.25 and len(scheduler.running) < SEATS:
            source = rng.choice(running)
            clone = Sequence(source.token_ids[: source.num_prompt_tokens], source.params, max_model_len=1 << 12,
                             num_layers=LAYERS)
            scheduler.clone(source, [clone])
        elif running and change < 0.28 and len(scheduler.running) > 1:
            scheduler._preempt(scheduler._victim())
        elif running and change < 0.3 and len(scheduler.running) > 2:
            victim = rng.choice(running)
            scheduler.abort(victim.seq_id)
            runner.tables.drop(victim.seq_id)
        for seq in scheduler.running:
            _check_cache(runner.tables, seq)
            _check_room(scheduler, seq)
        if rng.random() < 0.1 and len(scheduler.running) < 4:  # keep the batch going
            top = rng.randrange(8, 40)
            _decoding(pool, scheduler, rng, [max(1, top - 5 * layer) for layer in range(LAYERS)])
    assert kinds["append"] > 20 and kinds["rebuild"] > 5  # both paths ran
    pool.check_invariants()


def test_resized_since_reports_only_pure_appends() -> None:
    params = SamplingParams(max_tokens=8, temperature=0)
    seq = Sequence([1, 2, 3], params, max_model_len=64, num_layers=3)
    mark = (seq.tables_version, len(seq.resized_layers))
    seq.grow_table(2, [7])
    seq.grow_table(0, [8, 9])
    seq.grow_table(2, [10])
    assert seq.resized_since(*mark) == [2, 0, 2]
    assert seq.page_tables == [[8, 9], [], [7, 10]]
    mark = (seq.tables_version, len(seq.resized_layers))
    seq.grow_table(1, [11])
    seq.set_kv_starts(1, [1, 0])  # any other change: the reader rebuilds
    seq.grow_table(1, [12])
    assert seq.resized_since(*mark) is None
    mark = (seq.tables_version, len(seq.resized_layers))
    seq.reset_cache()
    assert seq.resized_since(*mark) is None


def test_room_matches_a_walk_over_the_layers() -> None:
    """`Room` against the per-layer formulas, including layers that hold whole spare pages (their
    negative count is part of the growth the scheduler always computed)."""
    rng = random.Random(7)
    for _ in range(200):
        free = [rng.randrange(0, 3 * PAGE) for _ in range(rng.randrange(1, 9))]
        room = Room(0, free, PAGE)
        for _ in range(6):
            used = rng.randrange(0, min(free) + 1)
            room.use(used)
            free = [f - used for f in free]
            assert room.free() == free and room.least == min(free)
            n = rng.randrange(1, 2 * PAGE)
            short = [(layer, -((f - n) // PAGE)) for layer, f in enumerate(free) if f < n]
            assert room.short(n) == short
            assert room.growth(n) == sum(-((f - n) // PAGE) for f in free)
            room.grew(room.short(n), room.version + 1)
            for layer, pages in short:
                free[layer] += pages * PAGE
    assert Room(3, [0, PAGE + 1], PAGE).growth(1) == 0  # one page short in layer 0, one spare in layer 1


def test_a_truncation_then_an_append_between_reads():
    """A layer cut to 2 pages and grown by one before the cache reads it again: the new third page replaces
    the old one, and nothing past it remains."""
    seq = Sequence([1] * 8, SamplingParams(max_tokens=4), max_model_len=256, num_layers=2)
    seq.grow_table(0, [10, 11, 12, 13])
    seq.grow_table(1, [20, 21])
    cache = TableCache(2, HEADS)
    assert cache.array(seq)[0].tolist() == [10, 11, 12, 13]
    assert seq.truncate_table(0, 2) == [12, 13]
    seq.grow_table(0, [14])
    assert seq.resized_since(*_snapshot(cache, seq)) is not None  # applied incrementally, not rebuilt
    assert cache.array(seq)[0].tolist() == [10, 11, 14, 0] and cache.lengths(seq) == [3, 2]
    assert cache.longest(seq) == 3


def _snapshot(cache: TableCache, seq: Sequence) -> tuple[int, int]:
    entry = cache._entries[seq.seq_id]
    return entry.version, entry.mark
