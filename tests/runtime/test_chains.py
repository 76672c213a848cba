"""Chain cache, per served method: a continued turn prefills only its suffix, a stop-string-like
cut rolls back and continues, `full` through chains is `full` without them, and the errors.

Tiny 2-layer Llama (4 query heads over 2 KV heads), pages of 4 tokens, float32 on the CPU. Every
eviction method's parameters compress the 48-token first prompt (tests/runtime/chained.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import ChainBusy, ChainDiverged, ChainEvicted, ChainNotFound, KvcError
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, check_books, greedy, make_llm, stored_lengths, tokens, turn

PROMPT = tokens(48, seed=1)
USER = tokens(14, seed=2)
ALL = list(METHODS)
# methods whose only compaction is at prefill end: a rollback restores exactly the shorter turn
PREFILL_ONLY = ["full", "snapkv", "pyramidkv", "adakv"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("chains"), seed=3, num_hidden_layers=2)


def count_computed(llm) -> list[int]:
    """Spy: tokens the model computes per step (appended to the returned list)."""
    computed: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy():
        batch = schedule()
        if batch is not None:
            computed.append(batch.num_tokens)
        return batch

    llm.engine.scheduler.schedule = spy
    return computed


@pytest.mark.parametrize("method", ALL)
def test_continue_prefills_only_the_suffix(model_dir: Path, method: str) -> None:
    llm = make_llm(model_dir, method, METHODS[method])
    first = turn(llm, PROMPT, 6, ChainSpec(open=True))
    assert first.chain_id and first.num_cached_tokens == 0
    history = len(PROMPT) + 5  # the last sampled token's K/V is never computed
    prompt = PROMPT + first.token_ids + USER
    before = llm.engine.chains.stats()
    computed = count_computed(llm)
    second = turn(llm, prompt, 4, ChainSpec(continue_id=first.chain_id))
    after = llm.engine.chains.stats()
    assert second.chain_id == first.chain_id
    assert second.num_cached_tokens == history
    assert sum(computed) == len(prompt) - history + 3  # the suffix, then 3 decode steps
    assert after["reused_tokens_total"] - before["reused_tokens_total"] == history
    assert after["prefilled_tokens_total"] - before["prefilled_tokens_total"] == len(prompt) - history
    assert after["idle"] == 1 and after["active"] == 0
    lengths = stored_lengths(llm.engine, first.chain_id)
    if method == "full":
        assert lengths == [len(prompt) + 3] * 2
    else:  # the budget holds across turns: compressed again at the second prefill end
        assert max(lengths) < len(prompt)


@pytest.mark.parametrize("method", PREFILL_ONLY)
def test_stop_string_cut_rolls_back_to_the_shorter_turn(model_dir: Path, method: str) -> None:
    """The client drops the last 3 generated tokens (2 of them stored) and adds a user turn: the
    chain rolls back; the continuation equals a chain whose first turn stopped there."""
    llm = make_llm(model_dir, method, METHODS[method])
    first = turn(llm, PROMPT, 8, ChainSpec(open=True))
    prompt = PROMPT + first.token_ids[:5] + USER
    second = turn(llm, prompt, 5, ChainSpec(continue_id=first.chain_id))
    assert second.num_cached_tokens == len(PROMPT) + 5

    fresh = make_llm(model_dir, method, METHODS[method])
    short = turn(fresh, PROMPT, 6, ChainSpec(open=True))
    assert short.token_ids[:5] == first.token_ids[:5]
    expected = turn(fresh, prompt, 5, ChainSpec(continue_id=short.chain_id))
    assert second.token_ids == expected.token_ids


@pytest.mark.parametrize("method", ["streamingllm", "h2o"])
def test_stop_string_cut_survives_decode_time_eviction(model_dir: Path, method: str) -> None:
    """StreamingLLM and H2O evict at every decode step; their keep's `+ last N` keeps the newest
    tokens verbatim, so a cut inside that tail still rolls back."""
    llm = make_llm(model_dir, method, METHODS[method])
    first = turn(llm, PROMPT, 8, ChainSpec(open=True))
    stored = stored_lengths(llm.engine, first.chain_id)
    assert max(stored) < len(PROMPT)  # compressed, and evicting while decoding
    prompt = PROMPT + first.token_ids[:5] + USER
    seq = llm.engine.add_request(prompt, greedy(4), chain=ChainSpec(continue_id=first.chain_id))
    assert stored_lengths(llm.engine, first.chain_id) == [kv - 2 for kv in stored]  # rolled back 2 tokens
    while llm.engine.has_unfinished():
        llm.engine.step()
        check_books(llm.engine)
    assert seq.num_cached_tokens == len(PROMPT) + 5 and len(seq.generated_ids) == 4


def test_tova_cut_needs_an_uncompressed_tail(model_dir: Path) -> None:
    """TOVA's decode keep (`top(..., budget)`) has no `+ last N`: once it evicted while decoding,
    stored tokens cannot be cut (409); dropping only the last, never-stored token continues, and
    a chain that never compressed rolls back."""
    llm = make_llm(model_dir, "tova", METHODS["tova"])
    first = turn(llm, PROMPT, 8, ChainSpec(open=True))
    with pytest.raises(ChainDiverged) as e:
        llm.generate(PROMPT + first.token_ids[:5] + USER, greedy(3), chain=ChainSpec(continue_id=first.chain_id))
    assert e.value.http_status == 409 and e.value.code == "chain_diverged" and "roll back" in e.value.message
    ok = turn(llm, PROMPT + first.token_ids[:7] + USER, 3, ChainSpec(continue_id=first.chain_id))
    assert ok.num_cached_tokens == len(PROMPT) + 7

    short = PROMPT[:10]  # below the budget: nothing is compressed
    first = turn(llm, short, 4, ChainSpec(open=True))
    again = turn(llm, short + first.token_ids[:1] + USER, 3, ChainSpec(continue_id=first.chain_id))
    assert again.num_cached_tokens == len(short) + 1


def test_full_with_chains_is_full_without(model_dir: Path) -> None:
    """Several turns, one of them cut (rollback into a prefix-cached page), prefix caching on."""
    chained = make_llm(model_dir, "full")
    plain = make_llm(model_dir, "full", enable_prefix_caching=False)
    conversation, spec = PROMPT, ChainSpec(open=True)
    for k in range(4):
        out = turn(chained, conversation, 6, spec)
        expected = plain.generate(conversation, greedy(6))[0]
        assert out.token_ids == expected.token_ids, f"turn {k}"
        spec = ChainSpec(continue_id=out.chain_id)
        kept = out.token_ids if k != 1 else out.token_ids[:2]  # turn 2 ends with a stop-string cut
        conversation = conversation + kept + tokens(9 + k, seed=10 + k)
    assert chained.engine.pool.stats()["hit_tokens"] >= 0
    chained.engine.drop_chain(out.chain_id, None)
    assert chained.engine.pool.num_free == chained.engine.pool.num_pages


def test_diverged_beyond_the_verbatim_tail(model_dir: Path) -> None:
    llm = make_llm(model_dir, "snapkv", METHODS["snapkv"])
    first = turn(llm, PROMPT, 6, ChainSpec(open=True))
    edited = PROMPT[:30] + [7] + PROMPT[31:] + first.token_ids + USER  # an edit inside the compressed prompt
    with pytest.raises(ChainDiverged) as e:
        llm.generate(edited, greedy(2), chain=ChainSpec(continue_id=first.chain_id))
    assert e.value.http_status == 409 and "token 30" in e.value.message
    assert llm.engine.chains.stats() == {**llm.engine.chains.stats(), "idle": 1, "active": 0}
    ok = turn(llm, PROMPT + first.token_ids + USER, 2, ChainSpec(continue_id=first.chain_id))
    assert ok.num_cached_tokens == len(PROMPT) + 5


def test_owner_busy_drop_and_unknown(model_dir: Path) -> None:
    llm = make_llm(model_dir, "h2o", METHODS["h2o"])
    engine = llm.engine
    seq = engine.add_request(PROMPT, greedy(4), chain=ChainSpec(open=True, owner="alice"))
    chain_id = seq.chain_id
    assert chain_id.startswith("chain-") and len(chain_id) > 30
    follow = PROMPT + USER
    with pytest.raises(ChainBusy) as busy:  # one request at a time, also for forks
        engine.add_request(follow, greedy(2), chain=ChainSpec(continue_id=chain_id, owner="alice"))
    assert busy.value.http_status == 409 and busy.value.code == "chain_busy"
    with pytest.raises(ChainBusy):
        engine.add_request(follow, greedy(2), chain=ChainSpec(fork_id=chain_id, owner="alice"))
    while engine.has_unfinished():
        engine.step()
    history = PROMPT + seq.generated_ids
    for owner in ("bob", None):  # another key cannot see it, nor can a request without one
        with pytest.raises(ChainNotFound) as e:
            engine.add_request(history + USER, greedy(2), chain=ChainSpec(continue_id=chain_id, owner=owner))
        assert e.value.http_status == 404 and e.value.code == "chain_not_found"
        with pytest.raises(ChainNotFound):
            engine.drop_chain(chain_id, owner)
    with pytest.raises(ChainNotFound):
        engine.add_request(history, greedy(2), chain=ChainSpec(continue_id="chain-unknown", owner="alice"))
    check_books(engine)
    engine.drop_chain(chain_id, "alice")
    with pytest.raises(ChainEvicted) as gone:
        engine.add_request(history + USER, greedy(2), chain=ChainSpec(continue_id=chain_id, owner="alice"))
    assert gone.value.http_status == 410 and gone.value.code == "chain_evicted"
    with pytest.raises(ChainNotFound):  # an evicted id is still not another owner's to probe
        engine.add_request(history + USER, greedy(2), chain=ChainSpec(continue_id=chain_id, owner="bob"))
    assert engine.pool.num_free == engine.pool.num_pages
    with pytest.raises(KvcError):
        ChainSpec(open=True, continue_id=chain_id)


def test_abort_records_the_computed_tokens(model_dir: Path) -> None:
    """The server aborts on a stop string or a disconnect: the computed tokens become the chain."""
    llm = make_llm(model_dir, "snapkv", METHODS["snapkv"])
    engine = llm.engine
    seq = engine.add_request(PROMPT, greedy(20), chain=ChainSpec(open=True))
    for _ in range(4):  # the prefill, then 3 decode steps
        engine.step()
    engine.abort(seq.seq_id)
    check_books(engine)
    computed = seq.token_ids[: len(PROMPT) + 3]
    record = [r for r in engine.chains.records() if r.chain_id == seq.chain_id][0]
    assert record.tokens == computed and record.state.value == "idle"
    out = turn(llm, seq.token_ids[: len(PROMPT) + 3] + USER, 2, ChainSpec(continue_id=seq.chain_id))
    assert out.num_cached_tokens == len(computed)
