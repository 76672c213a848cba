"""Property test: random interleavings of chain operations leak no page.

Operations: open a chain, continue one (extending its history, or cutting its tail: a rollback, or
a 409 when the cut reaches compressed tokens), fork one, prune one (a token range, keeping a
fraction; refused while busy), abort a running request, drop a chain, and engine steps in between;
on a small pool with chunked prefill, so idle chains are evicted, sequences are preempted
mid-prefill and mid-decode, and forks share pages. After every operation the pool's books balance
and each page's reference count is exactly what running sequences and chain records hold
(`chained.check_books`); at the end, with every request aborted and every chain dropped, every page
is free. Every idle chain's position maps stay consistent: each KV head's stored slots hold
distinct tokens of its history, oldest first.

`full` (prefix caching on: chains and the prefix cache share pages), `h2o` (per-token method
state across turns, eviction at every decode step: copy-on-write of compacted pages) and `adakv`
(per-head counts: prunes of layers stored with per-head start slots).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvc.runtime.chain_prune import InvalidPrune, PruneRequest
from kvc.runtime.chains import ChainSpec, ChainState
from kvc.runtime.kv.positions import full_map
from kvc.runtime.errors import ChainError, OutOfKVMemory
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, PAGE_BYTES, check_books, greedy, make_llm

POOL_PAGES = 24
TOKEN = st.integers(5, 250)

OPS = st.tuples(
    st.one_of(
        st.tuples(st.just("open"), st.lists(TOKEN, min_size=1, max_size=24), st.integers(1, 6)),
        st.tuples(st.just("continue"), st.integers(0, 7), st.integers(0, 4), st.lists(TOKEN, max_size=10),
                  st.integers(1, 6)),
        st.tuples(st.just("fork"), st.integers(0, 7), st.lists(TOKEN, max_size=8), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 7)),
        st.tuples(st.just("drop"), st.integers(0, 7)),
        st.tuples(st.just("prune"), st.integers(0, 7), st.integers(0, 30), st.integers(1, 30),
                  st.sampled_from([0.0, 0.3, 0.7])),
    ),
    st.integers(0, 5),  # engine steps after the operation
)


@pytest.fixture(scope="module", params=["full", "h2o", "adakv"])
def llm(request, tmp_path_factory: pytest.TempPathFactory):
    model_dir: Path = make_tiny_llama(tmp_path_factory.mktemp("chains-property"), seed=6, num_hidden_layers=2)
    return make_llm(model_dir, request.param, METHODS[request.param], kv_cache_memory=POOL_PAGES * PAGE_BYTES,
                    max_num_batched_tokens=16, max_prefill_chunk=8, max_num_seqs=4)


def _check_position_maps(engine) -> None:
    for record in engine.chains.records():
        if record.state is not ChainState.IDLE:
            continue
        for layer, head in enumerate(record.positions):
            length = record.kv_lens[layer]
            full = full_map(head, length, len(record.tokens), engine.spec.num_kv_heads, engine.device)
            for h, start in enumerate(record.kv_starts[layer] or [0] * engine.spec.num_kv_heads):
                row = full[h, start:length]
                if row.numel():
                    assert bool((row[1:] > row[:-1]).all()) and 0 <= int(row[0]) and int(row[-1]) < len(record.tokens)


def _pick(items: list, index: int):
    return items[index % len(items)] if items else None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(OPS, min_size=1, max_size=20))
def test_random_chain_operations_leak_no_page(llm, ops) -> None:
    engine = llm.engine
    live = []  # requests added by this example
    for op, steps in ops:
        kind = op[0]
        records = engine.chains.records()
        try:
            if kind == "open":
                live.append(engine.add_request(op[1], greedy(op[2]), chain=ChainSpec(open=True)))
            elif kind == "continue":
                record = _pick(records, op[1])
                if record is not None:
                    history = record.tokens[: max(0, len(record.tokens) - op[2])]
                    prompt = history + op[3] or [7]
                    live.append(engine.add_request(prompt, greedy(op[4]), chain=ChainSpec(continue_id=record.chain_id)))
            elif kind == "fork":
                record = _pick(records, op[1])
                if record is not None:
                    prompt = record.tokens + op[2] or [7]
                    live.append(engine.add_request(prompt, greedy(op[3]), chain=ChainSpec(fork_id=record.chain_id)))
            elif kind == "abort":
                seq = _pick([s for s in live if not s.is_finished], op[1])
                if seq is not None:
                    engine.abort(seq.seq_id)
            elif kind == "drop":
                record = _pick(records, op[1])
                if record is not None:
                    engine.drop_chain(record.chain_id, None)
            elif kind == "prune":
                record = _pick(records, op[1])
                if record is not None:
                    start = min(op[2], max(0, len(record.tokens) - 1))
                    engine.prune_chain(record.chain_id, None,
                                       PruneRequest(token_ranges=((start, start + op[3]),), keep=op[4]))
        except (ChainError, OutOfKVMemory, InvalidPrune):
            pass  # busy, diverged, evicted, capacity: refused without side effects on the books
        check_books(engine)
        _check_position_maps(engine)
        for _ in range(steps):
            engine.step()
            check_books(engine)
    for _ in range(400):  # everything still queued runs to its end
        if not engine.has_unfinished():
            break
        engine.step()
        check_books(engine)
    assert not engine.has_unfinished(), "the engine stopped making progress"
    assert all(s.is_finished for s in live)
    for record in engine.chains.records():
        engine.drop_chain(record.chain_id, None)
    check_books(engine)
    pool = engine.pool
    assert pool.num_free == pool.num_pages
    assert all(pool.ref_count(p) == 0 for p in range(pool.num_pages))
