"""Prefix pruning of chains (runtime/chain_prune.py), in the engine: the hand-written reference,
re-pruning, forks (copy-on-write), every served method, method state, position maps, rollback
over a tail that is still stored, and the errors.

Tiny 2-layer Llama (4 query heads over 2 KV heads), pages of 4 tokens, float32 on the CPU
(tests/runtime/chained.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.chain_prune import InvalidPrune, PruneRequest, Segment, parse_auto_prune
from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import ChainBusy, ChainDiverged, ConfigError
from kvc.runtime.kv.positions import compact_map, full_map, tail_is_verbatim, truncate_map
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import load_hf, make_tiny_llama
from tests.references.chain_prune import pruned_session
from tests.runtime.chained import METHODS, check_books, greedy, make_llm, tokens, turn

PROMPT = tokens(48, seed=1)
USER = tokens(14, seed=2)
SEGMENTS = (Segment("system", 0, 4), Segment("user", 4, 10), Segment("tool", 10, 40), Segment("user", 40, 48))
SNAP = {"window": 6, "kernel": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("prune"), seed=3, num_hidden_layers=2)


def _record(llm, chain_id: str):
    return next(r for r in llm.engine.chains.records() if r.chain_id == chain_id)


def _check_positions(llm, chain_id: str) -> None:
    """Each head's stored slots hold distinct logical tokens of the history, oldest first."""
    record = _record(llm, chain_id)
    for layer, head in enumerate(record.positions):
        full = full_map(head, record.kv_lens[layer], len(record.tokens), 2, torch.device("cpu"))
        starts = record.kv_starts[layer] or [0, 0]
        for h, start in enumerate(starts):
            row = full[h, start:]
            assert bool((row[1:] > row[:-1]).all()) and int(row[0]) >= 0 and int(row[-1]) < len(record.tokens)


@pytest.mark.parametrize("ranges,keep", [([(10, 40)], 0.25), ([(2, 12), (20, 35)], 0.5)])
def test_full_chain_pruned_equals_the_reference(model_dir: Path, ranges, keep: float) -> None:
    llm = make_llm(model_dir, "full", prune_scorer="snapkv")
    first = turn(llm, PROMPT, 6, ChainSpec(open=True))
    report = llm.engine.prune_chain(first.chain_id, None, PruneRequest(
        token_ranges=tuple(ranges), keep=keep, scorer="snapkv", scorer_params=SNAP))
    check_books(llm.engine)
    dropped = sum((b - a) - -(-int(keep * 1000) * (b - a) // 1000) for a, b in ranges)
    assert report["stored_tokens"] == report["stored_tokens_before"] - 2 * dropped
    assert report["pages"] < report["pages_before"] and report["tokens"] == len(PROMPT) + 5
    _check_positions(llm, first.chain_id)
    convo = PROMPT + first.token_ids + USER
    second = turn(llm, convo, 5, ChainSpec(continue_id=first.chain_id))
    assert second.num_cached_tokens == len(PROMPT) + 5  # matching stays valid: only the suffix runs
    expected = pruned_session(load_hf(model_dir), PROMPT, 6, ranges, keep, convo, 5,
                              stored_queries=32, **SNAP)
    assert (first.token_ids, second.token_ids) == expected


def test_prune_again_and_keep_tokens(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full", prune_scorer="snapkv")
    first = turn(llm, PROMPT, 4, ChainSpec(open=True, segments=SEGMENTS))
    once = llm.engine.prune_chain(first.chain_id, None, PruneRequest(roles=("tool",), keep=0.5))
    assert once["ranges"] == [[10, 40]] and once["stored_tokens"] == 2 * (51 - 15)
    twice = llm.engine.prune_chain(first.chain_id, None, PruneRequest(messages=(2,), keep_tokens=4))
    assert twice["stored_tokens"] == 2 * (51 - 26)  # the 15 left of the message keep 4
    _check_positions(llm, first.chain_id)
    record = _record(llm, first.chain_id)
    held = set(full_map(record.positions[0], record.kv_lens[0], 51, 2, torch.device("cpu"))[0].tolist())
    missing = sorted(set(range(51)) - held)
    assert len(missing) == 26 and missing[0] >= 10 and missing[-1] < 40
    assert record.verbatim_from == missing[-1] + 1 and record.compressed  # the tail after the last drop
    check_books(llm.engine)
    second = turn(llm, PROMPT + first.token_ids + USER, 3, ChainSpec(continue_id=first.chain_id))
    assert second.num_cached_tokens == len(PROMPT) + 3


def test_prune_a_fork_leaves_the_other_intact(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full", prune_scorer="snapkv")
    base = turn(llm, PROMPT, 4, ChainSpec(open=True))
    history = PROMPT + base.token_ids
    fork = turn(llm, history + USER[:3], 3, ChainSpec(fork_id=base.chain_id))
    shared = set().union(*_record(llm, base.chain_id).page_tables) & set().union(
        *_record(llm, fork.chain_id).page_tables)
    assert shared  # copy-on-write: the fork shares the history's full pages
    llm.engine.prune_chain(fork.chain_id, None, PruneRequest(token_ranges=((0, 40),), keep=0.1))
    check_books(llm.engine)
    # the base chain continues exactly as an unpruned chain does
    continued = turn(llm, history + USER, 4, ChainSpec(continue_id=base.chain_id))
    fresh = make_llm(model_dir, "full", prune_scorer="snapkv")
    unpruned = turn(fresh, PROMPT, 4, ChainSpec(open=True))
    reference = turn(fresh, history + USER, 4, ChainSpec(continue_id=unpruned.chain_id))
    assert continued.token_ids == reference.token_ids
    check_books(llm.engine)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_prunes_and_continues(model_dir: Path, method: str) -> None:
    # a method without token scores (full) prunes with the engine's --prune-scorer
    llm = make_llm(model_dir, method, METHODS[method], prune_scorer=None if method != "full" else "snapkv")
    first = turn(llm, PROMPT + USER, 8, ChainSpec(open=True, segments=SEGMENTS))
    report = llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 50),), keep=0.0))
    check_books(llm.engine)
    _check_positions(llm, first.chain_id)
    record = _record(llm, first.chain_id)
    assert report["stored_tokens"] == sum(record.kv_lens) <= report["stored_tokens_before"]
    if isinstance(record.method_state, dict):  # per-token state follows the slots
        for layer, state in record.method_state.items():
            if isinstance(state, str):  # in the pages' state planes (IN_PAGES): moved with the K/V
                continue
            for value in state.values():
                if value.dim() == 2:
                    assert value.shape[1] >= record.kv_lens[layer]
    second = turn(llm, PROMPT + USER + first.token_ids + USER, 4, ChainSpec(continue_id=first.chain_id))
    assert second.num_cached_tokens == len(PROMPT + USER) + 7
    check_books(llm.engine)


def test_a_method_without_token_scores_needs_a_scorer(model_dir: Path) -> None:
    llm = make_llm(model_dir, "full")
    first = turn(llm, PROMPT, 3, ChainSpec(open=True))
    with pytest.raises(InvalidPrune, match="scores no tokens.*--prune-scorer"):
        llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 20),), keep=0.5))
    assert _record(llm, first.chain_id).window_queries == [None, None]  # no default scorer: no queries kept


def test_prune_refuses_while_busy_and_bad_requests(model_dir: Path) -> None:
    llm = make_llm(model_dir, "snapkv", METHODS["snapkv"])
    first = turn(llm, PROMPT, 3, ChainSpec(open=True))
    seq = llm.engine.add_request(PROMPT + first.token_ids + USER, SamplingParams(max_tokens=3, temperature=0),
                                 chain=ChainSpec(continue_id=first.chain_id))
    with pytest.raises(ChainBusy):
        llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 10),), keep=0.5))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.is_finished
    with pytest.raises(InvalidPrune, match="message boundaries"):  # a raw prompt: no messages
        llm.engine.prune_chain(first.chain_id, None, PruneRequest(roles=("tool",), keep=0.5))
    with pytest.raises(InvalidPrune, match="past the chain"):
        llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((500, 600),), keep=0.5))
    for kwargs in ({"keep": 0.5}, {"roles": ("tool",)}, {"roles": ("tool",), "keep": 1.0},
                   {"roles": ("tool",), "keep_tokens": -1}, {"token_ranges": ((5, 5),), "keep": 0.1}):
        with pytest.raises(InvalidPrune):
            PruneRequest(**kwargs)


def test_auto_prune_spec() -> None:
    spec = parse_auto_prune("role=tool|user,older_than=2,keep=0.2,scorer=h2o")
    assert spec.roles == ("tool", "user") and spec.older_than_rounds == 2 and spec.keep == 0.2
    assert spec.scorer == "h2o" and spec.skip_pruned
    for bad in ("role=tool", "keep=0.2,color=red", "keep", "keep=abc", "keep=2"):
        with pytest.raises(ConfigError):
            parse_auto_prune(bad)


def test_position_maps() -> None:
    # 6 slots, 10 logical tokens: slots 0-2 hold tokens 1, 4, 6 (compacted), then 7, 8, 9 verbatim
    head = torch.tensor([[1, 4, 6], [0, 5, 6]], dtype=torch.int32)
    full = full_map(head, 6, 10, 2, torch.device("cpu"))
    assert full.tolist() == [[1, 4, 6, 7, 8, 9], [0, 5, 6, 7, 8, 9]]
    keep = torch.tensor([[0, 2, 4, 5], [1, 3, 4, 5]])
    assert compact_map(head, 6, 10, keep, [4, 4], 4).tolist() == [[1, 6, 8, 9], [5, 7, 8, 9]]
    per_head = compact_map(head, 6, 10, torch.tensor([[0, 5, 0], [1, 2, 5]]), [2, 3], 3)
    assert per_head.tolist() == [[-1, 1, 9], [5, 6, 9]]  # right-aligned, padding -1
    assert truncate_map(head, 2).tolist() == [[1, 4], [0, 5]] and truncate_map(None, 2) is None
    assert tail_is_verbatim(full, None, 6, 7, 10) and not tail_is_verbatim(full, None, 6, 5, 10)
    gap = torch.tensor([[0, 1, 2, 9]])  # token 8 evicted: cutting at 8 keeps 9 only, not verbatim
    assert not tail_is_verbatim(gap, None, 4, 8, 10) and tail_is_verbatim(gap, None, 4, 9, 10)


def test_rollback_over_a_stored_tail_of_a_method_without_a_tail_promise(model_dir: Path) -> None:
    """TOVA promises no `+ last N` (each decode step's keep moves `verbatim_from` to the newest
    token), but the position maps show how many of the newest tokens every layer still holds in
    order: a cut inside them rolls back, a cut past them gets 409."""
    llm = make_llm(model_dir, "tova", {"budget": 40})
    first = turn(llm, PROMPT[:36], 10, ChainSpec(open=True))  # evicts while decoding past 40 stored
    record = _record(llm, first.chain_id)
    assert record.compressed and record.verbatim_from == len(record.tokens) == 45
    common = 0
    for layer, head in enumerate(record.positions):  # where every layer's in-order tail starts
        full = full_map(head, record.kv_lens[layer], 45, 2, torch.device("cpu"))
        cut = 45
        while cut > 0 and tail_is_verbatim(full, None, record.kv_lens[layer], cut - 1, 45):
            cut -= 1
        common = max(common, cut)
    assert 36 < common < 45  # this seed: the newest tokens are held, an older generated one is not
    with pytest.raises(ChainDiverged):
        llm.generate(PROMPT[:36] + first.token_ids[: common - 37] + USER, greedy(3),
                     chain=ChainSpec(continue_id=first.chain_id))
    again = turn(llm, PROMPT[:36] + first.token_ids[: common - 36] + USER, 3, ChainSpec(continue_id=first.chain_id))
    assert again.num_cached_tokens == common
    check_books(llm.engine)
