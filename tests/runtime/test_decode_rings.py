"""Decode rings (runtime/kv/ring.py): a window keep at every step writes each decode token over the oldest
recent one instead of evicting at step end. Oracles: the papers' per-step rule
(tests/references/model_forward.greedy_compressed_decode) and the same engine with `decode_rings=False`
(the step end's in-place eviction), through batching, chunked prefill, async run-ahead, clones and
preemption; the ring's slots hold exactly the tokens the rule keeps, and no step end runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.runtime.kv import slot_order
from kvc.runtime.kv.ring import RingRules, decode_offsets
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


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


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
    rules = engine.scheduler.rules.rings
    assert rules is not None
    assert rules.first.tolist() == [SINK] * engine.spec.num_layers
    assert rules.capacity.tolist() == [SINK + RECENT + 1] * engine.spec.num_layers
    assert engine.method.decode_ring(0) == (SINK, SINK + RECENT + 1)
    assert make_engine(model_dir, rings=False).scheduler.rules.rings is None
    assert make_engine(model_dir, evict_interval=4).scheduler.rules.rings is None
    h2o = make_engine(model_dir, method="h2o", params={"heavy": 0.3, "recent": 0.2})
    assert h2o.method.decode_ring(0) is None and h2o.scheduler.rules.rings is None


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


def test_clones_of_a_ringed_row_decode_its_tokens(model_dir):
    engine = make_engine(model_dir)
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
    rules = engine.scheduler.rules.rings
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
