"""A fake model over a fake paged KV cache, to drive the scheduler without torch.

The "K/V" of a token is the token id itself, written at the slot its page table names. To sample,
the fake model reads the whole context back through the page table and hashes it, so a wrong page
table, a stale prefix-cache hit or a lost token after preemption changes the output. The other
scheduler tests import `FakeModel`, `reference`, `drive` and `check_books` from here.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from dataclasses import dataclass

import pytest

from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence, SequenceStatus


@dataclass
class Params:  # duck-types the engine's SamplingParams
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def next_token(context: list[int], vocab: int) -> int:
    digest = hashlib.blake2b(struct.pack(f"<{len(context)}q", *context), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab


def reference(seq: Sequence, vocab: int, capacity: int) -> tuple[list[int], str]:
    """What `seq` generates alone, one token at a time, with no cache at all."""
    tokens = seq.token_ids[: seq.num_prompt_tokens]
    alone = Sequence(tokens, seq.params, eos_token_ids=seq.eos_token_ids, max_model_len=seq.max_model_len)
    while True:
        alone.append_token(next_token(alone.token_ids, vocab))
        reason = alone.check_stop() or ("length" if len(alone.token_ids) > capacity else None)
        if reason:
            return alone.token_ids, reason


class FakeModel:
    def __init__(self, pool: PagePool, vocab: int) -> None:
        self.pool = pool
        self.vocab = vocab
        self.slots: list[int | None] = [None] * (pool.num_pages * pool.page_size)

    def _slot(self, seq: Sequence, pos: int) -> int:
        size = self.pool.page_size
        return seq.page_table[pos // size] * size + pos % size

    def run(self, batch: ScheduledBatch) -> dict[int, int]:
        sampled = {}
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.needs_sample()):
            start = seq.num_computed_tokens
            for pos in range(start, start + n):
                page = seq.page_table[pos // self.pool.page_size]
                assert self.pool.ref_count(page) == 1, f"{seq} writes into shared page {page}"
                assert not self.pool.is_registered(page), f"{seq} overwrites cached page {page}"
                self.slots[self._slot(seq, pos)] = seq.token_ids[pos]
            if samples:
                context = [self.slots[self._slot(seq, p)] for p in range(start + n)]
                assert context == seq.token_ids, f"{seq}: cache holds {context}"
                sampled[seq.seq_id] = next_token(context, self.vocab)
        return sampled


def check_batch(batch: ScheduledBatch, sched: Scheduler) -> None:
    cfg, pool = sched.config, sched.pool
    assert batch.num_tokens <= cfg.max_num_batched_tokens
    assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= n <= seq.num_uncomputed_tokens
        if i < batch.num_decodes:
            assert n == 1 and not seq.is_prefill
        else:
            assert seq.is_prefill and n <= (cfg.max_prefill_chunk or n)
        # pages are taken lazily: exactly what the tokens after this step need
        assert len(seq.page_table) == pool.pages_for(seq.num_computed_tokens + n)


def check_books(sched: Scheduler) -> None:
    """Pool invariants, and every reference count explained by a live sequence's page table."""
    pool = sched.pool
    pool.check_invariants()
    holders: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(set(seq.page_table)) == len(seq.page_table)
        assert len(seq.page_table) >= pool.pages_for(seq.num_computed_tokens)
        holders.update(seq.page_table)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING and not seq.page_table
        assert seq.num_computed_tokens == 0
    for page in range(pool.num_pages):
        assert pool.ref_count(page) == holders[page], f"page {page}"
        if holders[page] > 1:
            assert pool.is_registered(page), f"page {page} shared but not a cached prefix"
    arrivals = [s.arrival for s in sched.running]
    assert arrivals == sorted(arrivals)
    assert len(sched.running) <= sched.config.max_num_seqs


def drive(sched: Scheduler, model: FakeModel, max_steps: int = 10_000) -> int:
    """Runs until everything finishes, checking the books after every step; returns the steps."""
    for step in range(max_steps):
        if not sched.has_unfinished():
            return step
        batch = sched.schedule()
        assert batch is not None, "work is left but nothing was scheduled"
        check_batch(batch, sched)
        sched.postprocess(batch, model.run(batch))
        check_books(sched)
    raise AssertionError(f"not finished after {max_steps} steps")


def make_seq(prompt, max_tokens=16, *, max_model_len=10_000, eos=(), stop=(), ignore_eos=False):
    params = Params(max_tokens=max_tokens, stop_token_ids=tuple(stop), ignore_eos=ignore_eos)
    return Sequence(list(prompt), params, eos_token_ids=eos, max_model_len=max_model_len)


# ---- the fake itself must catch what it is there to catch ------------------------------------


def test_fake_model_matches_reference_when_alone():
    pool = PagePool(8, 4)
    sched = Scheduler(SchedulerConfig(), pool)
    seq = make_seq(range(1, 11), max_tokens=7)
    sched.add(seq)
    drive(sched, FakeModel(pool, vocab=1000))
    assert (seq.token_ids, seq.finish_reason) == reference(seq, 1000, capacity=32)
    assert pool.num_free == pool.num_pages


def test_fake_model_catches_a_wrong_page_table():
    pool = PagePool(8, 4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(), pool)
    seq = make_seq(range(1, 11), max_tokens=4)
    sched.add(seq)
    model = FakeModel(pool, vocab=1000)
    batch = sched.schedule()
    sched.postprocess(batch, model.run(batch))
    seq.page_table.reverse()  # what a scheduler bug could do
    with pytest.raises(AssertionError, match="cache holds"):
        model.run(sched.schedule())
