"""Automatic chains (`ChainSpec(auto=True)`, `ChainStore.find`) and chain limits (`ChainLimits`,
`ChainStore.expire`), on the tiny 2-layer Llama of the chain tests.

The matching rule: an owner's idle chain whose history up to the end of its last turn's prompt is
a prefix of the new prompt, rolled back over a reply the client resent differently where the
method still stores it verbatim, with at least `auto_min_tokens` in common; the longest wins.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.runtime.chains import ChainLimits, ChainSpec, ChainState
from kvc.runtime.errors import ChainEvicted, KvcError
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, check_books, greedy, make_llm, tokens, turn

PROMPT = tokens(48, seed=1)
USER = tokens(14, seed=2)


def auto(owner: str | None = None, min_tokens: int = 8) -> ChainSpec:
    return ChainSpec(auto=True, auto_min_tokens=min_tokens, owner=owner)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("chains_auto"), seed=3, num_hidden_layers=2)


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_a_conversation_continues_its_chain_turn_after_turn(model_dir: Path, method: str) -> None:
    llm = make_llm(model_dir, method, METHODS[method])
    first = turn(llm, PROMPT, 6, auto())
    assert first.chain_id and first.num_cached_tokens == 0
    conversation, chain = PROMPT + first.token_ids, first.chain_id
    for k in range(3):
        prompt = conversation + tokens(10 + k, seed=20 + k)
        out = turn(llm, prompt, 6, auto())
        assert out.chain_id == chain, f"turn {k + 2} opened a new chain"
        assert out.num_cached_tokens == len(conversation) - 1  # the last reply token was never computed
        conversation = prompt + out.token_ids
    assert llm.engine.chains.stats()["idle"] == 1


def test_a_resent_reply_that_differs_rolls_back(model_dir: Path) -> None:
    """The client resends the reply re-tokenized (here: its last 3 tokens changed): the chain
    continues from the common prefix, as long as the method stores those tokens verbatim
    (SnapKV compresses at prefill end only, so its decoded tokens are)."""
    llm = make_llm(model_dir, "snapkv", METHODS["snapkv"])
    first = turn(llm, PROMPT, 8, auto())
    resent = first.token_ids[:5] + [t % 200 + 7 for t in first.token_ids[5:]]
    assert resent[5:] != first.token_ids[5:]
    out = turn(llm, PROMPT + resent + USER, 4, auto())
    assert out.chain_id == first.chain_id and out.num_cached_tokens == len(PROMPT) + 5


def test_another_owner_never_matches(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full")
    alice = turn(llm, PROMPT, 6, auto(owner="alice"))
    conversation = PROMPT + alice.token_ids + USER
    for owner in ("bob", None):
        other = turn(llm, conversation, 2, auto(owner=owner))
        assert other.chain_id != alice.chain_id and other.num_cached_tokens < len(PROMPT)
    again = turn(llm, conversation, 2, auto(owner="alice"))
    assert again.chain_id == alice.chain_id


def test_another_branch_opens_a_new_chain_and_leaves_the_old_one(model_dir: Path) -> None:
    """A prompt sharing only the start of a chain's last prompt (an edited message, another
    conversation with the same system prompt) must not roll that chain back."""
    llm = make_llm(model_dir, "full")
    first = turn(llm, PROMPT, 6, auto())
    record = next(r for r in llm.engine.chains.records() if r.chain_id == first.chain_id)
    history = list(record.tokens)
    branch = PROMPT[:30] + USER  # 30 tokens in common, well over min_tokens
    other = turn(llm, branch, 2, auto())
    assert other.chain_id != first.chain_id
    assert record.tokens == history  # untouched
    back = turn(llm, PROMPT + first.token_ids + USER, 2, auto())
    assert back.chain_id == first.chain_id


def test_the_longest_match_wins_and_min_tokens_holds(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full")
    short = turn(llm, PROMPT, 4, ChainSpec(open=True))
    conversation = PROMPT + short.token_ids + USER
    long = turn(llm, conversation, 4, ChainSpec(fork_id=short.chain_id))  # short's history, and more
    # both match (each history's last prompt is a prefix); the one sharing more tokens wins
    out = turn(llm, conversation + long.token_ids + USER, 2, auto())
    assert out.chain_id == long.chain_id
    assert out.num_cached_tokens == len(conversation) + len(long.token_ids) - 1
    # fewer tokens in common than asked for: a new chain
    few = turn(llm, PROMPT + short.token_ids, 2, auto(min_tokens=200))
    assert few.chain_id not in (short.chain_id, long.chain_id)


def test_an_active_chain_never_matches(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full")
    first = turn(llm, PROMPT, 6, auto())
    store = llm.engine.chains
    prompt = PROMPT + first.token_ids + USER
    assert store.find(None, prompt, 8).chain_id == first.chain_id
    record = store.find(None, prompt, 8)
    record.state = ChainState.ACTIVE
    assert store.find(None, prompt, 8) is None
    record.state = ChainState.IDLE


def test_expired_chains_are_dropped_and_their_pages_freed(model_dir: Path) -> None:
    llm = make_llm(model_dir, "snapkv", METHODS["snapkv"])
    engine, store = llm.engine, llm.engine.chains
    free = engine.pool.num_free
    first = turn(llm, PROMPT, 6, ChainSpec(open=True))
    assert engine.pool.num_free < free
    store.limits = ChainLimits(ttl=60.0)
    record = next(r for r in store.records() if r.chain_id == first.chain_id)
    assert store.expire(now=record.last_used + 59) == []
    assert store.expire(now=record.last_used + 61) == [first.chain_id]
    assert engine.pool.num_free == free and store.stats()["expired_total"] == 1
    check_books(engine)
    with pytest.raises(ChainEvicted):  # 410, like an eviction
        store.get(first.chain_id, None)


def test_max_chains_drops_the_least_recently_used_idle_ones(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full", enable_prefix_caching=False)
    engine, store = llm.engine, llm.engine.chains
    free = engine.pool.num_free
    store.limits = ChainLimits(max_chains=2)
    a = turn(llm, PROMPT, 4, ChainSpec(open=True))
    b = turn(llm, tokens(40, seed=5), 4, ChainSpec(open=True))
    turn(llm, PROMPT + a.token_ids + USER, 2, ChainSpec(continue_id=a.chain_id))  # a is now the most recent
    c = turn(llm, tokens(40, seed=6), 4, ChainSpec(open=True))
    assert {r.chain_id for r in store.records()} == {a.chain_id, c.chain_id}  # b, least recently used, went
    with pytest.raises(ChainEvicted):
        store.get(b.chain_id, None)
    check_books(engine)
    for chain in (a.chain_id, c.chain_id):
        engine.drop_chain(chain, None)
    assert engine.pool.num_free == free


def test_bad_limits_and_specs_are_refused() -> None:
    for kwargs in ({"ttl": 0}, {"ttl": -1.0}, {"max_chains": 0}):
        with pytest.raises(KvcError):
            ChainLimits(**kwargs)
    with pytest.raises(KvcError):
        ChainSpec(auto=True, open=True)
    with pytest.raises(KvcError):
        ChainSpec(auto=True, auto_min_tokens=0)


def test_no_room_for_an_automatic_chain_runs_the_request_plain(model_dir: Path) -> None:
    """An automatic chain never fails a request that would run without one: where the chain cannot
    fit beside the active ones (ChainCapacity), the request runs unchained; an explicit one is refused."""
    from kvc.runtime.errors import ChainCapacity

    llm = make_llm(model_dir, "full")
    engine = llm.engine
    check_fits = engine._check_fits

    def no_room_for_chains(seq, params):
        if seq.chain is not None:
            raise ChainCapacity("no room for a chain")
        return check_fits(seq, params)

    engine._check_fits = no_room_for_chains
    out = turn(llm, PROMPT, 4, auto())
    assert out.chain_id is None and len(out.token_ids) == 4
    assert engine.chains.records() == []
    with pytest.raises(ChainCapacity):
        llm.generate(PROMPT, greedy(2), chain=ChainSpec(open=True))
    assert engine.chains.records() == []
