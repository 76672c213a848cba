"""Chain cache memory: forks share pages copy-on-write, idle chains are evicted LRU under pressure
(410 afterwards), active ones never, and 503 when a chain cannot fit beside the active ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import ChainCapacity, ChainEvicted
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, PAGE_BYTES, check_books, greedy, make_llm, tokens, turn

PROMPT = tokens(40, seed=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("chains-memory"), seed=4, num_hidden_layers=2)


def pages_of(engine, *chain_ids: str) -> int:
    return len({p for r in engine.chains.records() if r.chain_id in chain_ids for p in r.pages()})


@pytest.mark.parametrize("method", ["full", "snapkv", "h2o"])
def test_two_forks_are_two_separate_chains_on_fewer_pages(model_dir: Path, method: str) -> None:
    branches = [PROMPT + [11, 12, 13], PROMPT + [21, 22]]  # the base's history, then two branches

    forked = make_llm(model_dir, method, METHODS[method])
    base = turn(forked, PROMPT, 1, ChainSpec(open=True))  # history: the prompt
    forks = []
    for branch in branches:
        # a fork's first request computes just its branch's tokens...
        out = turn(forked, branch, 1, ChainSpec(fork_id=base.chain_id))
        assert out.chain_id != base.chain_id and out.num_cached_tokens == len(PROMPT)
        forks.append(out)
    fork_pages = pages_of(forked.engine, *(f.chain_id for f in forks))
    # ...and then both continue independently
    fork_tokens = [turn(forked, b + f.token_ids + [5, 6, 7], 5, ChainSpec(continue_id=f.chain_id)).token_ids
                   for b, f in zip(branches, forks)]

    separate = make_llm(model_dir, method, METHODS[method])
    own_pages, own_tokens = 0, []
    for branch in branches:
        first = turn(separate, PROMPT, 1, ChainSpec(open=True))
        out = turn(separate, branch, 1, ChainSpec(continue_id=first.chain_id))
        own_pages += pages_of(separate.engine, first.chain_id)
        own_tokens.append(turn(separate, branch + out.token_ids + [5, 6, 7], 5,
                               ChainSpec(continue_id=first.chain_id)).token_ids)
    assert fork_tokens == own_tokens
    if method == "full":  # the forks share the prompt's pages (and the base's)
        assert fork_pages < own_pages
    else:  # a compacting turn copies what it rewrites: never more than separate chains
        assert fork_pages <= own_pages
    for engine in (forked.engine, separate.engine):
        for record in engine.chains.records():
            engine.drop_chain(record.chain_id, None)
        assert engine.pool.num_free == engine.pool.num_pages


def small_llm(model_dir: Path, pages: int, method: str = "full"):
    return make_llm(model_dir, method, METHODS[method], kv_cache_memory=pages * PAGE_BYTES,
                    enable_prefix_caching=False)


def test_idle_chains_are_evicted_least_recently_used_first(model_dir: Path) -> None:
    llm = small_llm(model_dir, pages=48)  # a 20-token chain holds 2 layers x 5 pages of 4 tokens
    chains = [turn(llm, tokens(20, seed=s), 1, ChainSpec(open=True)).chain_id for s in range(4)]
    # use chain 0 again: chain 1 is now the least recently used
    again = turn(llm, tokens(20, seed=0) + [9], 1, ChainSpec(continue_id=chains[0]))
    assert again.num_cached_tokens == 20
    assert llm.engine.chains.stats()["idle"] == 4 and llm.engine.pool.num_free == 6  # 12 + 3 x 10 pages held
    out = llm.generate(tokens(20, seed=9), greedy(4))[0]  # needs 12 pages: one chain must go
    assert out.finish_reason == "length"
    stats = llm.engine.chains.stats()
    assert stats["evicted_total"] == 1 and stats["idle"] == 3
    with pytest.raises(ChainEvicted) as e:
        llm.generate(tokens(20, seed=1) + [9], greedy(1), chain=ChainSpec(continue_id=chains[1]))
    assert e.value.http_status == 410
    for chain_id in (chains[0], chains[2], chains[3]):
        assert chain_id in llm.engine.chains
    check_books(llm.engine)


def test_active_chains_are_never_evicted(model_dir: Path) -> None:
    llm = small_llm(model_dir, pages=48)
    engine = llm.engine
    idle = turn(llm, tokens(20, seed=1), 1, ChainSpec(open=True)).chain_id
    busy = turn(llm, tokens(20, seed=2), 1, ChainSpec(open=True)).chain_id
    # chain `busy` becomes active (queued), then plain requests press on the pool: only `idle` goes
    seq = engine.add_request(tokens(20, seed=2) + [7, 8], greedy(3), chain=ChainSpec(continue_id=busy))
    plain = [engine.add_request(tokens(12, seed=10 + i), greedy(12)) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
        check_books(engine)
    assert seq.num_cached_tokens == 20 and len(seq.generated_ids) == 3
    assert all(p.finish_reason == "length" for p in plain)
    assert busy in engine.chains and idle not in engine.chains
    assert engine.chains.stats()["evicted_total"] == 1


def test_capacity_when_active_chains_hold_the_pool(model_dir: Path) -> None:
    llm = small_llm(model_dir, pages=40, method="snapkv")
    engine = llm.engine
    a = turn(llm, tokens(20, seed=1), 1, ChainSpec(open=True)).chain_id
    b = turn(llm, tokens(20, seed=2), 1, ChainSpec(open=True)).chain_id
    engine.add_request(tokens(20, seed=1) + tokens(30, seed=3), greedy(4), chain=ChainSpec(continue_id=a))
    with pytest.raises(ChainCapacity) as e:  # chain a's turn is pinned: b's cannot fit beside it
        engine.add_request(tokens(20, seed=2) + tokens(30, seed=4), greedy(4), chain=ChainSpec(continue_id=b))
    assert e.value.http_status == 503 and e.value.code == "chain_capacity"
    stats = engine.chains.stats()
    assert stats["idle"] == 1 and stats["active"] == 1  # b is left as it was, idle
    while engine.has_unfinished():  # a's turn runs; b, idle, may be evicted for it
        engine.step()
        check_books(engine)
    assert engine.chains.stats()["active"] == 0 and a in engine.chains


def test_a_preempted_chained_turn_restarts_from_its_record(model_dir: Path) -> None:
    """Two chained turns outgrow the pool together: one is preempted (no plain sequence is left to
    take first), its record stays intact (copy-on-write), and it restarts its turn from it; with
    `full` the tokens are those of the same conversation without chains."""
    llm = small_llm(model_dir, pages=30)
    engine = llm.engine
    histories = [tokens(16, seed=s) for s in (1, 2)]
    chains = [turn(llm, h, 1, ChainSpec(open=True)).chain_id for h in histories]
    prompts = [h + [9, 10] for h in histories]
    seqs = [engine.add_request(p, greedy(20), chain=ChainSpec(continue_id=c)) for p, c in zip(prompts, chains)]
    while engine.has_unfinished():
        engine.step()
        check_books(engine)
    assert engine.scheduler.num_preemptions > 0 and any(s.num_preemptions for s in seqs)
    roomy = make_llm(model_dir, "full")
    for seq, prompt in zip(seqs, prompts):
        assert seq.num_cached_tokens == 16
        assert seq.generated_ids == roomy.generate(prompt, greedy(20))[0].token_ids
    stats = engine.chains.stats()  # the first to finish went idle, and may then be evicted for the other
    assert stats["idle"] + stats["evicted_total"] == 2 and stats["active"] == 0
