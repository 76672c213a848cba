"""The scheduler, step by step: budgets, chunking, admission order, preemption, aborts, hits."""

from __future__ import annotations

import pytest

from kvc.runtime.errors import ConfigError, KvcError, OutOfKVMemory, PromptTooLongError
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kvc.runtime.sequence import SequenceStatus
from tests.runtime.test_sched_fake_model import (
    FakeModel,
    check_batch,
    check_books,
    drive,
    make_seq,
    reference,
)

VOCAB = 1000


def setup(num_pages=64, page_size=4, **config) -> tuple[Scheduler, PagePool, FakeModel]:
    pool = PagePool(num_pages, page_size)
    return Scheduler(SchedulerConfig(**config), pool), pool, FakeModel(pool, VOCAB)


def step(sched: Scheduler, model: FakeModel) -> ScheduledBatch:
    """One scheduled step fed through the fake model; returns the batch as it was scheduled."""
    batch = sched.schedule()
    assert batch is not None
    check_batch(batch, sched)
    shape = [(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)]
    sched.postprocess(batch, model.run(batch))
    check_books(sched)
    batch.shape = shape  # the (seq, tokens) pairs, for asserting
    return batch


# ---- sequences -------------------------------------------------------------------------------


def test_sequence_ids_are_monotonic_and_tokens_are_copied():
    prompt = [1, 2, 3]
    a, b = make_seq(prompt), make_seq(prompt)
    assert b.seq_id > a.seq_id and b.arrival > a.arrival
    prompt.append(4)
    assert a.token_ids == [1, 2, 3] and a.num_prompt_tokens == 3
    with pytest.raises(KvcError, match="empty"):
        make_seq([])


def test_check_stop_reasons():
    seq = make_seq([5, 6], max_tokens=3, eos=(2,), stop=(9,))
    assert seq.check_stop() is None  # nothing generated yet
    seq.append_token(2)
    assert seq.check_stop() == "stop" and seq.generated_ids == [2] and seq.num_generated == 1
    seq = make_seq([5, 6], max_tokens=3, eos=(2,), stop=(9,), ignore_eos=True)
    seq.append_token(2)
    assert seq.check_stop() is None  # eos ignored
    seq.append_token(9)
    assert seq.check_stop() == "stop"  # stop tokens are never ignored
    seq = make_seq([5, 6], max_tokens=2)
    seq.append_token(1)
    assert seq.check_stop() is None
    seq.append_token(1)
    assert seq.check_stop() == "length"
    seq = make_seq([5, 6, 7], max_tokens=100, max_model_len=4)
    seq.append_token(1)
    assert seq.check_stop() == "length"


def test_config_is_validated():
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ConfigError, match="max_prefill_chunk"):
        SchedulerConfig(max_prefill_chunk=-1)
    SchedulerConfig(max_prefill_chunk=None)


# ---- admission checks ------------------------------------------------------------------------


def test_a_prompt_that_can_never_fit_is_refused_at_add():
    sched, pool, model = setup(num_pages=3, page_size=4)
    sched.add(make_seq(range(11)))  # 11 + 1 tokens = 3 pages: fits alone
    with pytest.raises(OutOfKVMemory, match="needs 4 KV pages.*has 3"):
        sched.add(make_seq(range(12)))
    with pytest.raises(PromptTooLongError, match="context is 5"):
        sched.add(make_seq(range(5), max_model_len=5))
    assert sched.num_waiting == 1


def test_waiting_queue_keeps_arrival_order_even_when_added_out_of_order():
    sched, pool, model = setup()
    a, b, c = make_seq([1]), make_seq([2]), make_seq([3])
    for s in (a, c, b):
        sched.add(s)
    assert list(sched.waiting) == [a, b, c]
    with pytest.raises(ValueError, match="not a fresh"):
        sched.add(b)


# ---- budgets and chunks ----------------------------------------------------------------------


def test_chunked_prefill_respects_budget_and_chunk_cap():
    sched, pool, model = setup(max_num_batched_tokens=16, max_prefill_chunk=6)
    a, b, c = make_seq(range(20)), make_seq(range(100, 113)), make_seq(range(200, 204))
    for s in (a, b, c):
        sched.add(s)
    b1 = step(sched, model)
    assert b1.shape == [(a.seq_id, 6), (b.seq_id, 6), (c.seq_id, 4)]
    assert b1.needs_sample() == [False, False, True]  # c's whole prompt ran: it samples
    b2 = step(sched, model)  # c decodes first, then a and b continue their prefill
    assert b2.num_decodes == 1
    assert b2.shape == [(c.seq_id, 1), (a.seq_id, 6), (b.seq_id, 6)]
    b3 = step(sched, model)
    assert b3.shape == [(c.seq_id, 1), (a.seq_id, 6), (b.seq_id, 1)]
    assert b3.needs_sample() == [True, False, True]
    b4 = step(sched, model)
    assert b4.shape == [(b.seq_id, 1), (c.seq_id, 1), (a.seq_id, 2)]  # decodes by arrival
    assert b4.num_decodes == 2


def test_decodes_come_first_and_take_budget_from_prefills():
    sched, pool, model = setup(max_num_batched_tokens=9)
    short = [make_seq(range(i, i + 3)) for i in range(3)]
    for s in short:
        sched.add(s)
    step(sched, model)  # three 3-token prefills
    long = make_seq(range(50, 80))
    sched.add(long)
    batch = step(sched, model)  # 3 decodes, then 6 tokens of the long prompt: a mixed step
    assert batch.shape == [(s.seq_id, 1) for s in short] + [(long.seq_id, 6)]
    assert batch.num_decodes == 3 and batch.num_prefills == 1
    assert long.is_prefill and long.num_computed_tokens == 6


def test_budget_smaller_than_decodes_leaves_the_newest_for_later():
    sched, pool, model = setup(max_num_batched_tokens=2)
    seqs = [make_seq([i]) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert step(sched, model).shape == [(seqs[0].seq_id, 1), (seqs[1].seq_id, 1)]
    assert step(sched, model).shape == [(seqs[0].seq_id, 1), (seqs[1].seq_id, 1)]  # decodes first
    assert sched.num_waiting == 1


# ---- admission order -------------------------------------------------------------------------


def test_admission_is_fcfs_and_bounded_by_seats():
    sched, pool, model = setup(max_num_seqs=2)
    seqs = [make_seq(range(i, i + 4), max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [sid for sid, _ in step(sched, model).shape] == [seqs[0].seq_id, seqs[1].seq_id]
    assert sched.num_running == 2 and sched.num_waiting == 1
    step(sched, model)  # both finish (max_tokens=2): the seats free up
    assert [sid for sid, _ in step(sched, model).shape] == [seqs[2].seq_id]


def test_admission_blocked_by_pages_does_not_skip_ahead():
    sched, pool, model = setup(num_pages=4, page_size=4)
    first = make_seq(range(12), max_tokens=3)  # 3 pages + growth
    big = make_seq(range(100, 112), max_tokens=1)  # 3 pages: does not fit next to `first`
    small = make_seq([7], max_tokens=1)  # 1 page: would fit, but must wait behind `big`
    for s in (first, big, small):
        sched.add(s)
    assert [sid for sid, _ in step(sched, model).shape] == [first.seq_id]
    assert pool.num_free == 1 and sched.num_waiting == 2
    step(sched, model)
    assert sched.waiting[0] is big and small.status is SequenceStatus.WAITING
    drive(sched, model)
    for s in (first, big, small):
        assert (s.token_ids, s.finish_reason) == reference(s, VOCAB, capacity=16)


# ---- preemption ------------------------------------------------------------------------------


def test_preemption_recomputes_the_newest_and_it_completes_unchanged():
    sched, pool, model = setup(num_pages=4, page_size=2, max_num_seqs=2, enable_prefix_caching=False)
    old, new = make_seq([1, 2, 3], max_tokens=4), make_seq([4, 5, 6], max_tokens=4)
    late = make_seq([9], max_tokens=2)  # waits for a seat
    for s in (old, new, late):
        sched.add(s)
    step(sched, model)  # both prefill: 2 pages each, the pool is full
    assert pool.num_free == 0
    batch = step(sched, model)  # both decode position 3: fits in their second pages
    assert batch.num_decodes == 2
    batch = step(sched, model)  # position 4 needs a third page each: `new` yields to `old`
    assert batch.shape == [(old.seq_id, 1)]
    assert new.status is SequenceStatus.WAITING and new.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert new.page_table == [] and new.num_computed_tokens == 0
    assert list(sched.waiting) == [new, late]  # it keeps its place ahead of later arrivals
    drive(sched, model)
    for s in (old, new, late):
        assert (s.token_ids, s.finish_reason) == reference(s, VOCAB, capacity=8)
    assert pool.num_free == pool.num_pages


def test_a_preempted_sequence_comes_back_as_one_prefill_of_all_its_tokens():
    sched, pool, model = setup(num_pages=4, page_size=2, enable_prefix_caching=False)
    old, new = make_seq([1, 2, 3], max_tokens=3), make_seq([4, 5, 6], max_tokens=8)
    sched.add(old)
    sched.add(new)
    for _ in range(3):
        step(sched, model)  # `new` was preempted in the third step with 5 tokens known
    assert new.status is SequenceStatus.WAITING and len(new.token_ids) == 5
    while new.status is SequenceStatus.WAITING:
        batch = step(sched, model)
    i = batch.seqs.index(new)
    assert i >= batch.num_decodes and batch.num_new_tokens[i] == 5  # prompt + generated
    assert batch.needs_sample()[i] and not new.is_prefill


def test_a_sequence_that_outgrows_the_whole_pool_ends_with_length():
    sched, pool, model = setup(num_pages=2, page_size=2)
    seq = make_seq([1, 2, 3], max_tokens=100)
    sched.add(seq)
    drive(sched, model)
    assert seq.finish_reason == "length" and len(seq.token_ids) == 5  # 4 slots + 1 never stored
    assert pool.num_free == 2


# ---- abort -----------------------------------------------------------------------------------


def test_abort_frees_everything_and_is_idempotent():
    sched, pool, model = setup(num_pages=8, page_size=2, max_num_seqs=1)
    running, waiting = make_seq(range(7)), make_seq(range(5))
    sched.add(running)
    sched.add(waiting)
    step(sched, model)
    assert pool.num_used == 4
    assert sched.abort(running.seq_id) is running
    assert running.finish_reason == "abort" and running.page_table == []
    assert pool.num_used == 0 and sched.num_running == 0
    assert sched.abort(waiting.seq_id) is waiting and waiting.is_finished
    assert sched.abort(waiting.seq_id) is None and sched.abort(12345) is None
    assert not sched.has_unfinished() and sched.schedule() is None
    check_books(sched)


def test_abort_while_a_step_runs_is_skipped_by_postprocess():
    sched, pool, model = setup()
    seq = make_seq(range(6))
    sched.add(seq)
    batch = sched.schedule()
    sampled = model.run(batch)
    sched.abort(seq.seq_id)
    assert sched.postprocess(batch, sampled) == []
    assert seq.token_ids == list(range(6)) and pool.num_used == 0
    check_books(sched)


def test_postprocess_refuses_a_missing_sample():
    sched, pool, model = setup()
    sched.add(make_seq([1, 2]))
    batch = sched.schedule()
    with pytest.raises(ValueError, match="no sample"):
        sched.postprocess(batch, {})


# ---- prefix caching --------------------------------------------------------------------------


def test_second_sequence_hits_the_shared_prefix():
    sched, pool, model = setup(num_pages=16, page_size=4)
    system = list(range(100, 110))  # 2 full pages + 2 tokens
    a = make_seq(system + [1, 2, 3], max_tokens=3)
    sched.add(a)
    step(sched, model)  # a's prompt computed: pages 0-2 registered
    b = make_seq(system + [7, 8], max_tokens=2)
    sched.add(b)
    batch = step(sched, model)
    assert b.num_cached_tokens == 8 and batch.shape[-1] == (b.seq_id, 4)  # 12 - 8 computed
    assert b.page_table[:2] == a.page_table[:2]
    shared = a.page_table[:2]
    assert [pool.ref_count(p) for p in shared] == [2, 2]
    drive(sched, model)
    for s in (a, b):
        assert (s.token_ids, s.finish_reason) == reference(s, VOCAB, capacity=64)
    assert pool.stats()["hit_tokens"] == 8 and pool.stats()["query_tokens"] == 13 + 12
    # after both finish their pages stay cached; a prompt of exactly 3 cached full pages still
    # computes its last page, so that its last token yields a logit
    c = make_seq(system + [1, 2], max_tokens=2)
    sched.add(c)
    batch = step(sched, model)
    assert c.num_cached_tokens == 8 and batch.shape == [(c.seq_id, 4)]
    assert c.page_table[:2] == shared


def test_preempted_sequence_finds_its_own_pages_in_the_cache():
    sched, pool, model = setup(num_pages=6, page_size=2)
    old, new = make_seq([1, 2, 3, 4, 5], max_tokens=4), make_seq([6, 7, 8, 9, 10], max_tokens=6)
    sched.add(old)
    sched.add(new)
    while new.num_preemptions == 0:
        step(sched, model)
    assert pool.num_cached == 2  # of new's 3 full pages, old's growth evicted the tail one
    while new.status is SequenceStatus.WAITING:
        step(sched, model)
    assert new.num_cached_tokens == 4 and new.num_preemptions == 1
    drive(sched, model)
    for s in (old, new):
        assert (s.token_ids, s.finish_reason) == reference(s, VOCAB, capacity=12)
