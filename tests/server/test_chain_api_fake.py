"""A test double of the engine's chain side (/work/notes/chain_api.md), behind the real server.

`FakeChainEngine` wraps the real CPU `Engine` (real generation, tokenizer, pages) and adds a chain
table with the interface's semantics and error classes: `add_request(ids, params, chain)` checks
owner (404), eviction/drop (410), busy (409), divergence beyond a short rollback window (409),
capacity (503, after evicting idle chains oldest first); `seq.chain_id`; `num_cached_tokens` of a
continued chain is the reused history; a chained sequence that finishes or is aborted records its
tokens into the chain (turn end); `drop_chain`, `chain_info`, `chains.stats()`.

It only stands in for the engine side until that exists; the tests at the bottom pin the double
itself, so that the server tests exercise the interface rather than a fake's accident.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvc.runtime.chains import ChainLimits, ChainSpec
from kvc.runtime.errors import ChainBusy, ChainCapacity, ChainDiverged, ChainEvicted, ChainNotFound
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.sequence import SequenceStatus
from tests.server.conftest import LiveServer, make_engine

ROLLBACK = 8  # diverging tokens the fake can still roll back (the real engine: those held uncompressed)


@dataclass
class _Chain:
    id: str
    owner: str | None
    tokens: list[int]
    state: str = "active"
    last_used: float = 0.0


class FakeChainStore:
    def __init__(self, max_chains: int, page_size: int) -> None:
        self.max_chains = max_chains
        self.page_size = page_size
        self.live: dict[str, _Chain] = {}
        self.gone: dict[str, str | None] = {}  # evicted or dropped id -> owner
        self.evicted_total = 0
        self.reused_tokens_total = 0
        self.prefilled_tokens_total = 0
        self.limits = ChainLimits()  # set by the server; the double does not apply them

    def expire(self, now: float | None = None) -> int:
        return 0

    def find(self, chain_id: str, owner: str | None) -> _Chain:
        chain = self.live.get(chain_id)
        if chain is not None and chain.owner == owner:
            return chain
        if chain is None and chain_id in self.gone and self.gone[chain_id] == owner:
            raise ChainEvicted(f"the chain {chain_id!r} was evicted or deleted; open a new one", param="chain_id")
        raise ChainNotFound(f"no chain {chain_id!r}", param="chain_id")

    def evict(self, chain_id: str) -> None:
        chain = self.live.pop(chain_id)
        self.gone[chain_id] = chain.owner
        self.evicted_total += 1

    def make_room(self) -> None:
        if len(self.live) < self.max_chains:
            return
        idle = sorted((c for c in self.live.values() if c.state == "idle"), key=lambda c: c.last_used)
        if not idle:
            raise ChainCapacity("no KV memory for a new chain: every chain is active; retry later")
        self.evict(idle[0].id)

    def stats(self) -> dict[str, int]:
        return {
            "active": sum(c.state == "active" for c in self.live.values()),
            "idle": sum(c.state == "idle" for c in self.live.values()),
            "evicted_total": self.evicted_total,
            "pages": sum(math.ceil(len(c.tokens) / self.page_size) for c in self.live.values()),
            "reused_tokens_total": self.reused_tokens_total,
            "prefilled_tokens_total": self.prefilled_tokens_total,
        }


class FakeChainEngine:
    def __init__(self, engine, max_chains: int = 8) -> None:
        self._engine = engine
        self.chains = FakeChainStore(max_chains, engine.config.page_size)
        self._chained: dict[int, tuple[object, str, int]] = {}  # seq_id -> (seq, chain id, reused)
        self._pending: dict[int, int] = {}  # seq_id -> reused, until the sequence is admitted
        self.step_delay = 0.0  # seconds per step: lets a test hold a request running

    def __getattr__(self, name):  # everything that is not about chains is the real engine's
        return getattr(self._engine, name)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, chain: ChainSpec | None = None):
        if chain is None:
            return self._engine.add_request(prompt_token_ids, params)
        reused = 0
        source_id = chain.continue_id or chain.fork_id
        if source_id is not None:
            source = self.chains.find(source_id, chain.owner)
            if chain.continue_id is not None and source.state == "active":
                raise ChainBusy(f"a request is already running on the chain {source_id!r}", param="chain_id")
            reused = _common_prefix(source.tokens, prompt_token_ids)
            if reused < len(source.tokens) - ROLLBACK:
                raise ChainDiverged(
                    f"the prompt leaves the chain's history at token {reused} of {len(source.tokens)}, "
                    f"and only the last {ROLLBACK} tokens can be rolled back", param="chain_id")
            reused = min(reused, len(prompt_token_ids) - 1)  # at least one token is computed
        if chain.continue_id is None:
            self.chains.make_room()
        seq = self._engine.add_request(prompt_token_ids, params)  # the engine's own checks come next
        if chain.continue_id is not None:
            record = self.chains.live[chain.continue_id]
            record.state = "active"
        else:
            record = _Chain(id=f"chain-{secrets.token_urlsafe(16)}", owner=chain.owner, tokens=[],
                            last_used=time.time())
            self.chains.live[record.id] = record
        seq.chain_id = record.id
        self._chained[seq.seq_id] = (seq, record.id, reused)
        self._pending[seq.seq_id] = reused
        return seq

    def step(self):
        time.sleep(self.step_delay)
        finished = self._engine.step()
        for seq_id in list(self._pending):
            seq = self._chained[seq_id][0]
            if seq.status is not SequenceStatus.WAITING:
                seq.num_cached_tokens = self._pending.pop(seq_id)
        for seq in finished:
            self._turn_end(seq.seq_id)
        return finished

    def abort(self, seq_id: int) -> None:
        self._engine.abort(seq_id)
        self._turn_end(seq_id)

    def _turn_end(self, seq_id: int) -> None:
        if seq_id not in self._chained:
            return
        seq, chain_id, reused = self._chained.pop(seq_id)
        self._pending.pop(seq_id, None)
        record = self.chains.live.get(chain_id)
        if record is None:
            return
        record.tokens, record.state, record.last_used = list(seq.token_ids), "idle", time.time()
        self.chains.reused_tokens_total += reused
        self.chains.prefilled_tokens_total += seq.num_prompt_tokens - reused

    def drop_chain(self, chain_id: str, owner: str | None) -> None:
        record = self.chains.find(chain_id, owner)
        if record.state == "active":
            raise ChainBusy(f"a request is running on the chain {chain_id!r}; drop it after", param="chain_id")
        self.chains.live.pop(chain_id)
        self.chains.gone[chain_id] = owner

    def chain_info(self, chain_id: str, owner: str | None) -> dict:
        return self._describe(self.chains.find(chain_id, owner))

    def list_chains(self, owner: str | None) -> list[dict]:
        mine = sorted((c for c in self.chains.live.values() if c.owner == owner), key=lambda c: -c.last_used)
        return [{"id": c.id, **self._describe(c)} for c in mine]

    def _describe(self, record: _Chain) -> dict:
        return {"tokens": len(record.tokens), "state": record.state, "last_used": record.last_used,
                "pages": math.ceil(len(record.tokens) / self.chains.page_size)}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@contextmanager
def chain_server(max_chains: int = 8, **server_options) -> Iterator[LiveServer]:
    """The real app over a FakeChainEngine (the default model on CPU)."""
    from kvc.runtime.server.app import ServerConfig, build_app

    server_options.setdefault("served_model_name", "kvc-test")
    fake = FakeChainEngine(make_engine(), max_chains=max_chains)
    server = LiveServer(build_app(fake, ServerConfig(**server_options))).start()
    server.fake = fake
    try:
        yield server
    finally:
        server.stop()


# ---- the double itself -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fake():
    return FakeChainEngine(make_engine(), max_chains=2)


def _run(engine, seq):
    while engine.has_unfinished():
        engine.step()
    return seq


def test_fake_follows_the_interface(fake):
    greedy = SamplingParams(max_tokens=3, temperature=0)
    seq = _run(fake, fake.add_request(list(range(5, 21)), greedy, ChainSpec(open=True, owner="a")))
    cid = seq.chain_id
    assert fake.chain_info(cid, "a")["tokens"] == 19 and fake.chains.stats()["idle"] == 1
    with pytest.raises(ChainNotFound):
        fake.add_request(seq.token_ids + [9], greedy, ChainSpec(continue_id=cid, owner="b"))
    with pytest.raises(ChainDiverged):
        fake.add_request([1] * 20, greedy, ChainSpec(continue_id=cid, owner="a"))
    nxt = fake.add_request(seq.token_ids + [9], greedy, ChainSpec(continue_id=cid, owner="a"))
    assert nxt.chain_id == cid
    with pytest.raises(ChainBusy):
        fake.add_request(seq.token_ids + [9], greedy, ChainSpec(continue_id=cid, owner="a"))
    fork = fake.add_request(seq.token_ids + [4], greedy, ChainSpec(fork_id=cid, owner="a"))
    assert fork.chain_id != cid
    with pytest.raises(ChainCapacity):  # two chains, both active
        fake.add_request([3, 3], greedy, ChainSpec(open=True, owner="a"))
    _run(fake, nxt)
    assert nxt.num_cached_tokens == 19 and fake.chains.stats()["active"] == 0
    third = _run(fake, fake.add_request([3, 3], greedy, ChainSpec(open=True, owner="a")))  # evicts cid (LRU)
    with pytest.raises(ChainEvicted):
        fake.chain_info(cid, "a")
    with pytest.raises(ChainNotFound):  # another owner never learns the id existed
        fake.chain_info(cid, "b")
    fake.drop_chain(third.chain_id, "a")
    with pytest.raises(ChainEvicted):
        fake.drop_chain(third.chain_id, "a")
    assert fake.chains.stats()["evicted_total"] == 1 and fake.pool.num_used == 0
