"""Decode rings (runtime/kv/ring.py): a window keep at every step writes each decode token over the oldest
recent one instead of evicting at step end. Oracles: the papers' per-step rule
(tests/references/model_forward.greedy_compressed_decode) and the same engine with `decode_rings=False`
(the step end's in-place eviction), through batching, chunked prefill, async run-ahead, clones and
preemption; the ring's slots hold exactly the tokens the rule keeps, and no step end runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.kv import slot_order
from kvc.runtime.kv.ring import Ring, RingRules, decode_offsets, ring_offsets
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama
from tests.references.model_forward import greedy_compressed_decode

PAGE = 8
SINK, RECENT = 3, 13  # capacity 17: the ring's window crosses a page boundary
STEPS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def make_engine(model_dir: Path, rings: bool = True, method: str = "streamingllm", params: dict | None = None,
                **options):
    opts = dict(device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32,
                attention_backend="torch", decode_rings=rings, **options)
    return LLM(str(model_dir), method=method, method_params=params or {"sink": SINK, "recent": RECENT},
               **opts).engine


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def serve(engine, prompts: list[list[int]], steps: int = STEPS) -> list:
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages
    return seqs


def test_the_window_keep_rings_and_others_do_not(model_dir):
    """StreamingLLM's `first sink + last recent` at every step rings at capacity sink + recent + 1; a keep that
    reads scores, an eviction interval or `decode_rings=False` does not."""
    engine = make_engine(model_dir)
    rings = engine.scheduler.rules.rings
    assert rings is not None and rings.capacities == [SINK + RECENT + 1] and not rings.ranked
    rules = rings.of(40)
    assert rules is rings.of(1000) or rules.capacity.tolist() == rings.of(1000).capacity.tolist()
    assert rules.first.tolist() == [SINK] * engine.spec.num_layers
    assert rules.capacity.tolist() == [SINK + RECENT + 1] * engine.spec.num_layers
    assert engine.method.decode_ring(0, 40) == (SINK, SINK + RECENT + 1, False)
    assert make_engine(model_dir, rings=False).scheduler.rules.rings is None
    assert make_engine(model_dir, evict_interval=4).scheduler.rules.rings is None
    snapkv = make_engine(model_dir, method="snapkv", params={"budget": 16, "window": 4, "every": 1})
    assert snapkv.scheduler.rules.rings is None  # a decode budget ranks step_end's own scores


@pytest.mark.parametrize(("method", "params", "ring"), [
    ("h2o", {"budget": 12}, (6, 13, True)),  # `top(seen, 6) + last 6`: the prompt's fractions unused
    ("tova", {"budget": 11}, (11, 12, True)),  # `top(attention, 11)`: a ring of one slot
    ("h2o", {"heavy": 0.3, "recent": 0.2}, (30, 51, True)),  # fractions of a 100-token prompt
])
def test_a_ranked_keep_rings(model_dir, method, params, ring):
    engine = make_engine(model_dir, method=method, params=params)
    assert engine.method.decode_ring(0, 100) == ring
    rings = engine.scheduler.rules.rings
    assert rings.ranked and rings.of(100).ranked.all()
    assert rings.capacities == ([] if "heavy" in params else [ring[1]])  # a rung only where every prompt has it


def test_tokens_follow_the_per_step_rule(model_dir, hf):
    """Prompts shorter and longer than the window, batched with chunked prefill: the rule's greedy tokens;
    every layer ends at the ring's capacity and holds the pages it needs, no more."""
    prompts = prompts_of([9, 40, 40, 71], seed=3)
    engine = make_engine(model_dir)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    held = {}
    while engine.has_unfinished():
        engine.step()
        for s in seqs:
            if not s.is_finished and s.ring is not None and s.ring.full:
                held[s.seq_id] = (list(s.kv_lens), [len(t) for t in s.page_tables])
    for seq, prompt in zip(seqs, prompts):
        want = greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, "streamingllm", sink=SINK, recent=RECENT)[0]
        assert seq.generated_ids == want.tolist(), f"prompt of {len(prompt)} tokens"
        cap = SINK + RECENT + 1
        assert held[seq.seq_id] == ([cap] * engine.spec.num_layers, [-(-cap // PAGE)] * engine.spec.num_layers)
    assert engine.pool.num_free == engine.pool.num_pages


def test_a_ring_holds_the_tokens_the_rule_keeps_and_no_step_end_runs(model_dir, monkeypatch):
    """Mid-decode, every layer's slots read in position order are the sinks and the newest RECENT + 1 tokens
    (the step's own included); the step end never selects for a ringed row."""
    engine = make_engine(model_dir)
    calls = []
    real = engine.method.step_end_batch
    monkeypatch.setattr(engine.method, "step_end_batch", lambda layer, views: calls.append(len(views)) or
                        real(layer, views))
    seq = engine.add_request(prompts_of([30], seed=4)[0], SamplingParams(max_tokens=STEPS, temperature=0,
                                                                          ignore_eos=True))
    while seq.num_generated < 12:
        engine.step()
    assert seq.ring is not None and seq.ring.full and not calls
    stored = seq.num_computed_tokens
    want = list(range(SINK)) + list(range(stored - RECENT - 1, stored))
    store = engine.attention.store_of(0)
    for layer in range(engine.spec.num_layers):
        table = np.asarray([seq.page_tables[layer]], dtype=np.int64)
        positions = slot_order.read_rows(store[store.spec.positions], table, np.array([seq.kv_lens[layer]]))
        for head in positions[0]:
            assert sorted(head.tolist()) == want
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("options", [
    dict(async_scheduling=True),  # run-ahead steps advance the rings before the step is committed
    dict(kv_cache_memory=2 * 2 * 16 * 4 * PAGE * 20),  # 19 pages: a newer request is preempted, recomputed
], ids=["async", "preempted"])
def test_tokens_equal_the_step_end_eviction(model_dir, options):
    prompts = prompts_of([30, 45, 20, 60], seed=5)
    want = serve(make_engine(model_dir, rings=False, **options), prompts)
    engine = make_engine(model_dir, **options)
    got = serve(engine, prompts)
    assert [s.generated_ids for s in got] == [s.generated_ids for s in want]
    if "kv_cache_memory" in options:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("method", ["streamingllm", "tova"])  # a window ring, and a ranked one (moves in the step)
def test_clones_of_a_ringed_row_decode_its_tokens(model_dir, method):
    """Clones of a row whose ring is full share its pages copy-on-write, each with its own ring state: every clone
    decodes the source's tokens, and every page returns to the pool."""
    engine = make_engine(model_dir, method=method, params=RANKED.get(method))
    source = engine.add_request(prompts_of([33], seed=6)[0], SamplingParams(max_tokens=STEPS, temperature=0,
                                                                             ignore_eos=True))
    while source.num_generated < 10:
        engine.step()
    assert source.ring is not None and source.ring.full
    clones = engine.clone_sequence(source, 2)
    assert all(c.ring is not None and c.ring is not source.ring for c in clones)
    while engine.has_unfinished():
        engine.step()
    assert all(c.generated_ids == source.generated_ids for c in clones)
    assert engine.pool.num_free == engine.pool.num_pages


RANKED = {"h2o": {"budget": 12}, "tova": {"budget": 11}}


def _inverted(engine):
    """The engine with its decode keep ranking the negated scores: on the tiny random model a token leaving
    H2O's window never out-scores the older ranked ones (attention is flat, and they summed more queries), so
    ranking the least attended first makes it win (the mechanics under test are the same)."""
    decoder = engine.method.decoder
    after = decoder.facts.after_fn
    decoder.facts = dataclasses.replace(decoder.facts, after_fn=lambda inputs, state, sym, params: -after(
        inputs, state, sym, params))
    return engine


def _kept_positions(engine, seq) -> list[list[list[int]]]:
    """Per layer and KV head, the positions of the stored slots, sorted (a multiset: a ring's leaving slot may
    still hold a token the ranking copied)."""
    store = engine.attention.store_of(0)
    out = []
    for layer in range(engine.spec.num_layers):
        table = np.asarray([seq.page_tables[layer]], dtype=np.int64)
        pos = slot_order.read_rows(store[store.spec.positions], table, np.array([seq.kv_lens[layer]]))
        out.append([sorted(h.tolist()) for h in pos[0]])
    return out


@pytest.mark.parametrize("method", sorted(RANKED))
def test_a_ranked_ring_holds_the_step_ends_tokens_at_every_step(model_dir, method):
    _holds_the_step_ends_tokens(model_dir, method, RANKED[method])


def test_rings_of_counts_that_read_the_prompt(model_dir):
    """H2O's default fractions of the prompt: each row rings at its own prompt's counts, rows of several rules
    in one batch (and one a step whose counts, at 9 tokens, keep 2)."""
    _holds_the_step_ends_tokens(model_dir, "h2o", {"heavy": 0.15, "recent": 0.15}, min_sets=10)


def _holds_the_step_ends_tokens(model_dir, method: str, method_params: dict, min_sets: int = 20) -> None:
    """H2O's `top(seen, h) + last r` and TOVA's `top(attention, n)` at every step, ringed: after each step a
    ring's slots, less its leaving slot's token (the next token's slot), are exactly the tokens the step end's
    eviction keeps, per layer and KV head, in a batch of a short, a window-long and two long prompts; the
    ranked slots change (tokens leaving the window win slots; H2O's ranking inverted, `_inverted`); the greedy
    tokens are equal."""
    prompts = prompts_of([9, 13, 30, 45], seed=9)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ringed, plain = (make_engine(model_dir, rings=r, method=method, params=method_params) for r in (True, False))
    if method == "h2o":
        ringed, plain = _inverted(ringed), _inverted(plain)
    pairs = [(ringed.add_request(p, params), plain.add_request(p, params)) for p in prompts]
    compared, ranked_sets = 0, set()
    while ringed.has_unfinished():
        ringed.step()
        plain.step()
        for a, b in pairs:
            if a.is_finished or a.num_generated == 0:
                continue
            got = _kept_positions(ringed, a)
            if a.ring is not None and a.ring.on.all():
                first = int(a.ring.rules.first[0])
                leaving = a.num_computed_tokens - (int(a.ring.rules.capacity[0]) - first - 1) - 1
                for heads in got:
                    for head in heads:
                        head.remove(leaving)
                ranked_sets.add((a.seq_id, str([[h[:first] for h in heads] for heads in got])))
            assert got == _kept_positions(plain, b), (a.seq_id, a.num_generated)
            compared += 1
    assert compared > 60 and len(ranked_sets) > min_sets
    assert [a.generated_ids for a, _ in pairs] == [b.generated_ids for _, b in pairs]
    assert ringed.pool.num_free == ringed.pool.num_pages


@pytest.mark.parametrize("options", [
    dict(async_scheduling=True),
    dict(kv_cache_memory=2 * 2 * 16 * 4 * PAGE * 21),  # 19 pages with the planes: a request is preempted
], ids=["async", "preempted"])
@pytest.mark.parametrize("method", sorted(RANKED))
def test_ranked_ring_tokens_equal_the_step_end_eviction(model_dir, method, options):
    prompts = prompts_of([30, 45, 20, 60], seed=5)
    want = serve(make_engine(model_dir, rings=False, method=method, params=RANKED[method], **options), prompts)
    engine = make_engine(model_dir, method=method, params=RANKED[method], **options)
    got = serve(engine, prompts)
    assert [s.generated_ids for s in got] == [s.generated_ids for s in want]
    if "kv_cache_memory" in options:
        assert engine.scheduler.num_preemptions > 0


def test_promote_moves_every_token_tensor_and_breaks_ties_to_the_older_token():
    """`promote` on a hand-made store: two rows of 2 KV heads, 3 ranked slots and a leaving slot on another
    page. Row 0: head 0's leaving token beats the lowest ranked slot (tied lowest: the newer one goes), head 1's
    equals the lowest (the older token stays). Row 1: no leaving slot. K, V, the state and positions move."""
    from kvc.runtime.kv.ring import promote
    from kvc.runtime.kv.spec import Extent, KVSpec, TensorSpec, state_plane
    from kvc.runtime.kv.store import KVStore

    spec = KVSpec((TensorSpec("k", Extent.TOKEN, torch.float32, (2,)), TensorSpec("v", Extent.TOKEN, torch.float32,
                                                                                 (2,)),
                   state_plane("seen"), TensorSpec("slot.position", Extent.TOKEN, torch.int32, ())),
                  positions="slot.position", in_place=True)
    store = KVStore(spec, num_pages=4, num_kv_heads=2, page_size=4, num_layers=1, device="cpu")
    for name in ("k", "v", "seen"):
        store[name].copy_(torch.randn(store[name].shape))
    tables = torch.tensor([[0, 1], [2, 3]])
    pos = store["slot.position"]
    pos[0, :, :3] = torch.tensor([[7, 2, 5], [7, 2, 5]], dtype=torch.int32)  # row 0's ranked slots 0..2
    pos[1, :, 1] = 20  # slot 5: the leaving token
    scores = torch.tensor([[[0.1, 0.5, 0.1, 0.0, 0.0, 0.3],    # head 0: lowest 0.1 at positions 7 and 5
                            [0.2, 0.6, 0.4, 0.0, 0.0, 0.2]],   # head 1: leaving ties the lowest
                           [[0.0] * 6, [0.0] * 6]])
    before = {name: t.clone() for name, t in store.tensors.items()}
    promote(store, tables, scores, torch.tensor([5, -1]), torch.tensor([3, 3]))
    for name in ("k", "v", "seen", "slot.position"):
        want = before[name].clone()
        want[0, 0, 0] = before[name][1, 0, 1]  # head 0: slot 0 (position 7, the newer of the lowest) replaced
        torch.testing.assert_close(store[name][:4], want[:4], rtol=0, atol=0)


def test_decode_offsets_equal_each_rows_ring():
    """The graphs' vectorised offsets equal each row's own: appending rows, partly and fully ringed rows."""
    rules = RingRules.of([(2, 7), (2, 7), None])
    kv = np.array([[3, 7, 7], [3, 6, 7], [3, 9, 12]], dtype=np.int64)  # [L, n]
    full = rules.enter([7, 7, 12], 40, None)
    partial = rules.enter([7, 6, 9], 30, None)
    assert full.full and not partial.full and partial.on.tolist() == [True, False, False]
    phys, ctx = decode_offsets(kv, [None, partial, full], [10, 33, 45])
    assert phys[:, 0].tolist() == [3, 3, 3] and ctx[:, 0].tolist() == [4, 4, 4]
    assert phys[:, 1].tolist() == [2 + (33 - 30) % 5, 6, 9] and ctx[:, 1].tolist() == [7, 7, 10]
    assert phys[:, 2].tolist() == [2 + (45 - 40) % 5, 2 + (45 - 40) % 5, 12] and ctx[:, 2].tolist() == [7, 7, 13]



def test_leave_slots_name_the_next_tokens_slot_at_capacity():
    """A ranked ring hands the slot the next token will take: the one after this step's in the ring's cycle,
    where the layer holds its capacity after the step (ringing, or just filled); -1 below it."""
    rules = RingRules.of([Ring(2, 7, True), Ring(2, 7, True), Ring(2, 7, True)])
    kv = np.array([[7], [6], [4]], dtype=np.int64)  # ringing, filling now, still short
    ring = rules.enter([7, 6, 4], 40, None)
    leave, first = ring_offsets(kv, [ring], [44])[2]
    assert leave[:, 0].tolist() == [2 + (44 - 40 + 1) % 5, 2, -1] and first[:, 0].tolist() == [2, 2, 0]
    assert ring_offsets(kv, [RingRules.of([(2, 7)] * 3).enter([7, 6, 4], 40, None)], [44])[2] is None  # a window ring
    # rows of two prompts' rules in one step (the graphs' vectorised path groups rows by rules), and a row without
    other = RingRules.of([Ring(3, 9, True)] * 3)
    rows = [ring, other.enter([9, 9, 8], 50, None), None]
    kv3 = np.array([[7, 9, 5], [6, 9, 5], [4, 8, 5]], dtype=np.int64)
    leave, first = ring_offsets(kv3, rows, [44, 52, 7])[2]
    assert leave.T.tolist() == [[2 + (44 - 40 + 1) % 5, 2, -1], [3 + (52 - 50 + 1) % 6, 3 + (52 - 50 + 1) % 6, 3],
                                [-1, -1, -1]]
    assert first.T.tolist() == [[2, 2, 0], [3, 3, 3], [0, 0, 0]]


def test_duoattention_streaming_heads_ring_beside_retrieval_heads(tmp_path):
    """DuoAttention's role keep on per-head cache layers: its streaming heads ring, its retrieval heads keep
    appending (a sequence with some layers ringed and some not); the tokens equal the step end's."""
    from kvc.runtime.models.method_inputs import save_input

    model_dir = make_tiny_llama(tmp_path, seed=7, num_hidden_layers=3)
    save_input(model_dir / "duo_attention_heads.safetensors", "gate",
               torch.rand(3, 2, generator=torch.Generator().manual_seed(0)))
    params = {"sink": 2, "recent": 5, "sparsity": 0.5}
    prompts = prompts_of([9, 23, 37], seed=8)
    want = serve(make_engine(model_dir, rings=False, method="duoattention", params=params), prompts)
    engine = make_engine(model_dir, method="duoattention", params=params)
    rules = engine.scheduler.rules.rings.of(23)
    assert rules is not None and 0 < int((rules.capacity >= 0).sum()) < len(rules.capacity)
    got = serve(engine, prompts)
    assert [s.generated_ids for s in got] == [s.generated_ids for s in want]



def test_a_ringed_layer_never_needs_or_returns_pages():
    """`Room` with fixed layers (the scheduler's view of a ringed sequence): growth counts only the layers that
    append, whatever the fixed ones hold; a sequence whose every layer rings never grows."""
    from kvc.runtime.kv.room import UNBOUNDED, Room

    room = Room(0, [0, 40, 3], 8, fixed=frozenset({1}))  # layer 1 rings (40 free slots ignored), 0 and 2 append
    assert room.least == 0 and room.growth(1) == 1 and room.short(3) == [(0, 1)] and room.short(4) == [(0, 1), (2, 1)]
    assert room.growth_by(3, (0, 0, 1), 2) == [1, 0]  # layer 2's 3 free slots take 3 tokens
    every = Room(0, [0, 0], 8, fixed=frozenset({0, 1}))
    assert every.least == UNBOUNDED and every.growth(1) == 0 and every.growth_by(1, (0, 0), 1) == [0]


def test_a_rings_capacity_is_a_context_rung_of_the_decode_graphs(model_dir):
    """Ringed rows stay at the capacity: the decode graphs get a context rung there, so a decode hook's reads
    (as wide as the graph's context) cover the ring and no more."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    engine = make_engine(model_dir, method="tova", params=RANKED["tova"])
    capacity = engine.method.decode_ring(0, 40).capacity
    graphs = DecodeGraphs(engine.runner, 4)
    assert capacity in graphs.contexts and graphs.contexts == sorted(graphs.contexts)
    assert capacity not in DecodeGraphs(make_engine(model_dir, rings=False, method="tova",
                                                    params=RANKED["tova"]).runner, 4).contexts


@pytest.mark.parametrize("method", sorted(RANKED))
def test_a_ranked_ring_through_the_decode_graphs_step(model_dir, method, monkeypatch):
    """The decode graphs' own step (`DecodeGraphs`, static buffers and the leaving-slot buffer, run uncaptured on
    the CPU) rings as the eager step does: one request (a batch bucket of one, so no padding row changes a float),
    the same kept tokens after every step and the same greedy tokens."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    prompt = prompts_of([30], seed=12)[0]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engines = []
    for graphs in (False, True):
        engine = make_engine(model_dir, method=method, params=RANKED[method], max_num_seqs=4)
        if method == "h2o":
            _inverted(engine)
        if graphs:
            runner = engine.runner
            runner.graphs = DecodeGraphs(runner, 4)
            assert runner.graphs.leave is not None
            monkeypatch.setattr(runner.graphs, "run", lambda batch, feed=None, g=runner.graphs: g.run_uncaptured(
                batch, feed))
        engines.append((engine, engine.add_request(prompt, params)))
    (eager, a), (graph, b) = engines
    steps = 0
    while eager.has_unfinished():
        eager.step()
        graph.step()
        if not a.is_finished and a.num_generated:
            assert _kept_positions(eager, a) == _kept_positions(graph, b), a.num_generated
            steps += a.ring is not None and bool(a.ring.on.all())
    assert steps > 5 and a.generated_ids == b.generated_ids

