"""Eviction in place (runtime/kv/slot_order.py): a decode-time keep fills the dropped slots with the
kept ones past the new length, moving O(evicted) slots, and each slot's stored position gives the
hooks the layer in time order. Oracles: the ordered compaction (runtime/kv/compaction.py) read in
time order, and the same engine serving the same requests with slots kept in order."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.compiled.method import CompiledMethod
from kvc.runtime.kv import slot_order
from kvc.runtime.kv.compaction import CompactionBatch, compact_tensors
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.spec import Extent, KVSpec, TensorSpec, dense_spec, state_plane
from kvc.runtime.kv.store import KVStore
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import LayerCacheView
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3

PAGE, HEADS, DIM = 4, 2, 3


def _store(num_pages: int = 40) -> KVStore:
    spec = dense_spec(DIM, torch.float32, extra=(state_plane("seen"),
                                                  TensorSpec("slot.position", Extent.TOKEN, torch.int32)))
    spec = dataclasses.replace(spec, positions="slot.position", in_place=True)
    store = KVStore(spec, num_pages, HEADS, PAGE, 1, "cpu")
    g = torch.Generator().manual_seed(0)
    for name in ("k", "v", "seen"):
        store[name].copy_(torch.randn(store[name].shape, generator=g))
    return store


def _layers(store: KVStore, lengths: list[int], seed: int) -> np.ndarray:
    """Disjoint shuffled tables of `lengths` slots, positions 1000 n + s in slot s (time order)."""
    g = torch.Generator().manual_seed(seed)
    pages = torch.randperm(store.num_pages, generator=g).tolist()
    width = max(-(-n // PAGE) for n in lengths)
    tables = np.zeros((len(lengths), width), dtype=np.int64)
    for n, length in enumerate(lengths):
        count = -(-length // PAGE)
        tables[n, :count] = pages[:count]
        pages = pages[count:]
        for s in range(length):
            store["slot.position"][tables[n, s // PAGE], :, s % PAGE] = 1000 * n + s
    return tables


def _in_time_order(store: KVStore, table: np.ndarray, length: int) -> dict[str, torch.Tensor]:
    """Every TOKEN tensor of one layer, [Hkv, length, ...] in time order."""
    view = LayerCacheView(store, table.tolist(), length)
    ids = torch.as_tensor(table).repeat_interleave(PAGE)[:length]
    offsets = torch.arange(length) % PAGE
    return {name: view.in_order(store[name][ids, :, offsets].transpose(0, 1)) for name in ("k", "v", "seen",
                                                                                            "slot.position")}


def _plans(lengths: list[int], counts: list[int], seed: int) -> torch.Tensor:
    """[N, Hkv, max count] random ascending time-order indices, a different choice per head."""
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(len(lengths), HEADS, max(counts), dtype=torch.long)
    for n, (length, count) in enumerate(zip(lengths, counts)):
        for h in range(HEADS):
            keep[n, h, :count] = torch.randperm(length, generator=g)[:count].sort().values
    return keep


def _batch(keep: torch.Tensor, counts: list[int], lengths: list[int], tables: np.ndarray) -> CompactionBatch:
    widths = np.asarray(counts, dtype=np.int64)
    return CompactionBatch(keep, np.arange(len(counts)), widths, np.repeat(widths[:, None], HEADS, axis=1),
                           np.asarray(lengths, dtype=np.int64), tables,
                           np.asarray([-(-n // PAGE) for n in lengths], dtype=np.int64))


@pytest.mark.parametrize("seed", range(4))
def test_a_keep_in_place_equals_the_ordered_compaction_in_time_order(seed):
    lengths, counts = [17, 13, 9], [10, 12, 9]
    store = _store()
    tables = _layers(store, lengths, seed)
    keep = _plans(lengths, counts, seed)
    before = [_in_time_order(store, tables[n], lengths[n]) for n in range(len(lengths))]
    # twice: the second keep runs over a layer already out of order
    for round_, (next_counts) in enumerate([counts, [7, 5, 9]]):
        if round_:
            lengths, counts = counts, next_counts
            keep = _plans(lengths, counts, seed + 10)
            before = [_in_time_order(store, tables[n], lengths[n]) for n in range(len(lengths))]
        executor = KVExecutor(store)
        physical = executor.compact(_batch(keep, counts, lengths, tables), in_place=True)
        assert physical.tolist() == counts
        for n, count in enumerate(counts):
            after = _in_time_order(store, tables[n], count)
            for name, x in before[n].items():
                want = x.gather(1, keep[n, :, :count].reshape(HEADS, count, *([1] * (x.dim() - 2))).expand(
                    HEADS, count, *x.shape[2:]))
                assert torch.equal(after[name], want), (round_, n, name)


def test_the_ordered_compaction_is_the_oracle():
    """The same plans through compact_tensors (slots kept in order) give the same tokens in time order."""
    lengths, counts = [17, 13], [10, 12]
    stores = [_store(), _store()]
    tables = [_layers(s, lengths, 3) for s in stores]
    keep = _plans(lengths, counts, 3)
    KVExecutor(stores[0]).compact(_batch(keep, counts, lengths, tables[0]), in_place=True)
    compact_tensors(stores[1].token_tensors(), _batch(keep, counts, lengths, tables[1]), backend="torch")
    for n, count in enumerate(counts):
        ordered = {name: x for name, x in _in_time_order(stores[1], tables[1][n], count).items()}
        assert torch.equal(ordered["slot.position"], ordered["slot.position"].sort(dim=1).values)
        for name, x in _in_time_order(stores[0], tables[0][n], count).items():
            assert torch.equal(x, ordered[name]), name


def test_a_keep_in_place_moves_only_the_dropped_slots():
    """A window of 40 dropping 3 tokens moves at most 3 slots per head; every other kept slot stays
    where it was, bit for bit."""
    store = _store()
    tables = _layers(store, [40], 0)
    keep = torch.stack([torch.tensor([i for i in range(40) if i not in drop]) for drop in ({5, 21, 39}, {0, 1, 2})])
    old = {name: store[name].clone() for name in ("k", "v", "seen", "slot.position")}
    KVExecutor(store).compact(_batch(keep[None], [37], [40], tables), in_place=True)
    ids = torch.as_tensor(tables[0]).repeat_interleave(PAGE)[:37]
    offsets = torch.arange(37) % PAGE
    for name, before in old.items():
        changed = (store[name][ids, :, offsets] != before[ids, :, offsets]).reshape(37, HEADS, -1).any(-1)
        # head 0 dropped 5, 21 and 39: slots 37 and 38 move into 5 and 21; head 1 dropped 0-2: 37-39 move there
        assert changed[:, 0].nonzero().flatten().tolist() == [5, 21], name
        assert changed[:, 1].nonzero().flatten().tolist() == [0, 1, 2], name


def test_settle_puts_layers_back_in_time_order():
    lengths, counts = [17, 13], [10, 12]
    store = _store()
    tables = _layers(store, lengths, 5)
    keep = _plans(lengths, counts, 5)
    KVExecutor(store).compact(_batch(keep, counts, lengths, tables), in_place=True)
    logical = [_in_time_order(store, tables[n], counts[n]) for n in range(2)]
    KVExecutor(store).settle(tables, np.asarray(counts))
    for n, count in enumerate(counts):
        ids = torch.as_tensor(tables[n]).repeat_interleave(PAGE)[:count]
        offsets = torch.arange(count) % PAGE
        for name, want in logical[n].items():
            assert torch.equal(store[name][ids, :, offsets].transpose(0, 1), want), name


def test_positions_are_recorded_with_the_tokens():
    store = _store()
    plane = store["slot.position"]
    plane.fill_(-7)
    slot_order.record(plane, torch.tensor([9, -1, 2]), torch.tensor([40, 41, 42]))
    assert plane[2, :, 1].tolist() == [40, 40] and plane[0, :, 2].tolist() == [42, 42]
    assert plane[store.scratch_page, :, 0].tolist() == [41, 41]  # padding writes into scratch
    assert int((plane[: store.num_pages] != -7).sum()) == 4


def test_rows_read_in_order_in_one_gather():
    """`read_rows_in_order` (a stacked decode batch's keys) equals reading the rows, then reordering them."""
    g = torch.Generator().manual_seed(3)
    plane = torch.randn(21, HEADS, PAGE, DIM, generator=g)
    tables = np.stack([np.random.RandomState(i).permutation(20)[:4] for i in range(3)])
    length = 14  # a partial last page
    order = torch.stack([torch.stack([torch.randperm(length, generator=g) for _ in range(HEADS)]) for _ in range(3)])
    expected = slot_order.in_order(slot_order.read_rows(plane, tables, np.full(3, length)), order)
    assert torch.equal(slot_order.read_rows_in_order(plane, tables, order), expected)


def test_a_keep_in_place_needs_positions_and_equal_counts():
    store = KVStore(dense_spec(DIM, torch.float32), 8, HEADS, PAGE, 1, "cpu")
    batch = _batch(torch.zeros(1, HEADS, 2, dtype=torch.long), [2], [3], np.zeros((1, 1), dtype=np.int64))
    with pytest.raises(ValueError, match="evicts in place"):
        KVExecutor(store).compact(batch, in_place=True)
    store = _store()
    batch.counts[0, 1] = 1
    with pytest.raises(ValueError, match="same count in every KV head"):
        KVExecutor(store).compact(batch, in_place=True)
    with pytest.raises(ValueError, match="int32"):
        KVSpec((TensorSpec("k", Extent.TOKEN, torch.float32, (DIM,)), TensorSpec("v", Extent.TOKEN, torch.float32,
                                                                                 (DIM,)),
                TensorSpec("p", Extent.TOKEN, torch.float32)), positions="p", in_place=True)


# ---- served: the same requests with slots kept in order ------------------------------------------
SERVED = {"streamingllm": {"sink": 3, "recent": 14}, "h2o": {"budget": 18}, "tova": {"budget": 15},
          "rkv": {"budget": 16, "window": 4, "every": 3}}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def _in_order_spec(monkeypatch) -> None:
    """Methods' specs without positions: every keep compacts in order (the oracle)."""
    served = CompiledMethod.kv_spec

    def ordered(self, *args, **kwargs):
        spec = served(self, *args, **kwargs)
        if spec.positions is None:
            return spec
        return dataclasses.replace(spec, tensors=tuple(t for t in spec.tensors if t.name != spec.positions),
                                   positions=None, in_place=False)

    monkeypatch.setattr(CompiledMethod, "kv_spec", ordered)


def _serve(model_dir: Path, method: str, interval: int = 1) -> tuple[list[list[int]], list]:
    llm = LLM(str(model_dir), method=method, method_params=SERVED[method], device="cpu", dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="torch",
              evict_interval=interval, decode_rings=False)  # the step end's layouts (rings: test_decode_rings.py)
    engine = llm.engine
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (23, 40, 31)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            for p, n in zip(prompts, (30, 24, 27))]
    kept = []  # layer 0's stored positions of the first request in time order, every step
    while engine.has_unfinished():
        engine.step()
        seq = seqs[0]
        if not seq.is_finished and not seq.is_prefill and seq.kv_lens[0]:
            view = LayerCacheView(engine.attention.store_of(0), seq.page_tables[0], seq.kv_lens[0])
            kept.append(view.keys()[:, :, 0].clone())
    assert engine.pool.num_free == engine.pool.num_pages
    return [s.generated_ids for s in seqs], kept


@pytest.mark.parametrize("method", sorted(SERVED))
def test_served_tokens_equal_the_ordered_layout(model_dir, method, monkeypatch):
    tokens, kept = _serve(model_dir, method)
    _in_order_spec(monkeypatch)
    want, want_kept = _serve(model_dir, method)
    assert tokens == want
    assert len(kept) == len(want_kept) and all(torch.allclose(a, b) for a, b in zip(kept, want_kept))


def test_streamingllm_turns_its_window_into_a_ring(model_dir):
    """Per step, StreamingLLM drops its oldest recent token: in place, the newest token takes that
    slot, so the slots' positions rotate (out of time order) and nothing else moves."""
    llm = LLM(str(model_dir), method="streamingllm", method_params=SERVED["streamingllm"], device="cpu",
              dtype="float32", page_size=PAGE, attention_backend="torch", decode_rings=False)  # the step end's fill
    engine = llm.engine
    seq = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=9, temperature=0, ignore_eos=True))
    while seq.num_generated < 8:
        engine.step()
    store = engine.attention.store_of(0)
    ids = torch.as_tensor(seq.page_tables[0]).repeat_interleave(PAGE)[: seq.kv_lens[0]]
    positions = store["slot.position"][ids, 0, torch.arange(seq.kv_lens[0]) % PAGE].tolist()
    context = seq.num_computed_tokens
    want = [0, 1, 2] + list(range(context - 14, context))  # first 3 + last 14, by position
    assert sorted(positions) == want and positions != want  # kept exactly those, out of time order
    assert positions[:3] == [0, 1, 2]  # the sinks never move


def _chained(model_dir: Path, method: str) -> tuple[list[list[int]], list[list[int]]]:
    """Two chained turns; (each turn's tokens, the record's layer-0 positions slot by slot after turn 1)."""
    from kvc.runtime.chains import ChainSpec

    llm = LLM(str(model_dir), method=method, method_params=SERVED[method], device="cpu", dtype="float32",
              page_size=PAGE, attention_backend="torch")
    g = torch.Generator().manual_seed(3)
    first, second = (torch.randint(3, 300, (n,), generator=g).tolist() for n in (37, 12))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    out = llm.generate(first, params, chain=ChainSpec(open=True))[0]
    record = llm.engine.chains.get(out.chain_id, None)
    store = llm.engine.attention.store_of(0)
    ids = torch.as_tensor(record.page_tables[0]).repeat_interleave(PAGE)[: record.kv_lens[0]]
    stored = store["slot.position"][ids, :, torch.arange(len(ids)) % PAGE].T.tolist() if store.spec.positions else []
    again = llm.generate(first + out.token_ids + second, params, chain=ChainSpec(continue_id=out.chain_id))[0]
    return [out.token_ids, again.token_ids], stored


@pytest.mark.parametrize("method", ["streamingllm", "h2o"])
def test_a_chains_turn_ends_with_its_layers_in_time_order(model_dir, method, monkeypatch):
    """At a turn's end the record's layers are put back in time order (its readers read slots in
    order); the next turn gives the tokens it gives with slots kept in order."""
    tokens, stored = _chained(model_dir, method)
    assert stored and all(row == sorted(row) for row in stored)
    _in_order_spec(monkeypatch)
    assert tokens == _chained(model_dir, method)[0]


# ---- the same keeps in place through async scheduling and the decode graphs' step ---------------
RUNS = {**SERVED, "snapkv": {"budget": 16, "window": 4, "kernel": 3, "every": 3}}


def _tokens(model_dir: Path, method: str, monkeypatch=None, graphs: bool = False, **options) -> list[list[int]]:
    """Greedy tokens of three prompts. The runs batch rows differently (the graph step pads to its
    bucket), so scores differ by float noise (~1e-7); a keep whose two candidates score within that
    of each other (TOVA on the tiny Qwen3: 0.0176194459 vs 0.0176194478) would flip, and the tokens
    after it. The keep's selection therefore ranks scores rounded to 1e-5, equal in every run."""
    llm = LLM(str(model_dir), method=method, method_params=RUNS[method], device="cpu", dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="torch",
              max_model_len=160, max_num_seqs=4, decode_rings=False, **options)  # the keeps in place, not rings
    engine = llm.engine
    select = engine.method._select_fn  # ranks scores on a 1e-5 grid: see `_tokens`' docstring
    engine.method._select_fn = lambda scores, sym, params: select(
        scores if scores.device.type == "meta" else torch.round(scores, decimals=5), sym, params)
    if graphs:  # decode-only steps through the CUDA-graph runner's own step, uncaptured on the CPU
        from kvc.runtime.decode_graphs import DecodeGraphs

        runner = engine.runner
        runner.graphs = DecodeGraphs(runner, 4)
        monkeypatch.setattr(runner.graphs, "run", lambda batch, feed=None: runner.graphs.run_uncaptured(batch, feed))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (29, 44, 35)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=22, temperature=0, ignore_eos=True)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages
    return [s.generated_ids for s in seqs]


@pytest.mark.parametrize("method", sorted(RUNS))
def test_keeps_in_place_run_ahead_and_in_the_graph_step(model_dir, method, monkeypatch):
    """Async scheduling (steps launched ahead, the keep's moves queued behind them) and the decode graphs'
    step (positions recorded from its static buffers) give the eager engine's tokens."""
    want = _tokens(model_dir, method, async_scheduling=False)
    assert _tokens(model_dir, method, async_scheduling=True) == want
    assert _tokens(model_dir, method, monkeypatch, graphs=True, async_scheduling=False) == want


@pytest.mark.parametrize("recent", [13, 12])  # sink + recent: 3 + 13 = 16, four whole pages; 15, not whole
def test_a_keep_in_steady_state_leaves_the_tables_alone(model_dir, recent):
    """One token in, one out at every step: once the window is full a row's page tables stop changing (no
    page freed and taken again, even when the window is a whole number of pages), so the runner's table
    arrays and the decode graphs' mirror are not touched."""
    llm = LLM(str(model_dir), method="streamingllm", method_params={"sink": 3, "recent": recent}, device="cpu",
              dtype="float32", page_size=PAGE, attention_backend="torch")
    engine = llm.engine
    seq = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    versions, pages = [], []
    while not seq.is_finished:
        engine.step()
        if seq.num_generated > 2 and not seq.is_finished:
            versions.append(seq.tables_version)
            pages.append([len(t) for t in seq.page_tables])
    assert len(set(versions)) == 1 and len(versions) > 8
    assert all(p == [-(-(3 + recent + 1) // PAGE)] * len(p) for p in pages)
