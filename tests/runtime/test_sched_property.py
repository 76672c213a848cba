"""Property test: random workloads through the scheduler lose nothing and leak nothing.

Requests arrive at random steps with random prompts (often sharing a prefix), limits and stop
tokens, into pools from "barely fits the longest prompt" to roomy, under random budgets, seats and
chunk caps; some are aborted, a few while their step runs. After every step the books must balance
(`check_books`); at the end every page is free, and every request that was not aborted holds
exactly what the fake model generates for it alone, so preemption and recompute lose nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.scheduler import Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence
from tests.runtime.test_sched_fake_model import (
    FakeModel,
    check_batch,
    check_books,
    make_seq,
    reference,
)

EOS = 0


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    max_model_len: int
    stop: list[int]
    ignore_eos: bool
    add_at: int  # step at which it arrives
    abort_at: int | None  # step at which it is aborted (it may have finished by then)
    abort_mid_step: bool  # abort between the model run and postprocess


@dataclass
class Scenario:
    page_size: int
    num_pages: int
    vocab: int
    config: SchedulerConfig
    requests: list[Request]


@dataclass
class Outcome:
    seqs: list[Sequence]
    pool: PagePool
    steps: int


def run(sc: Scenario, max_steps: int = 5000) -> Outcome:
    """Plays the scenario, checking the books after every step and the results at the end."""
    pool = PagePool(sc.num_pages, sc.page_size, salt=b"test")
    sched = Scheduler(sc.config, pool)
    model = FakeModel(pool, sc.vocab)
    pending = sorted(sc.requests, key=lambda r: r.add_at)
    seqs: dict[int, Sequence] = {}
    aborts: dict[int, list[tuple[int, bool]]] = {}
    step = 0
    while pending or sched.has_unfinished():
        while pending and pending[0].add_at <= step:
            r = pending.pop(0)
            seq = make_seq(r.prompt, r.max_tokens, max_model_len=r.max_model_len, eos=(EOS,),
                           stop=r.stop, ignore_eos=r.ignore_eos)
            sched.add(seq)
            seqs[seq.seq_id] = seq
            if r.abort_at is not None:
                aborts.setdefault(r.abort_at, []).append((seq.seq_id, r.abort_mid_step))
        due = aborts.pop(step, [])
        for seq_id, mid in due:
            if not mid:
                sched.abort(seq_id)
        if sched.has_unfinished():
            batch = sched.schedule()
            assert batch is not None, "work is left but nothing was scheduled"
            check_batch(batch, sched)
            sampled = model.run(batch)
            for seq_id, mid in due:
                if mid:
                    sched.abort(seq_id)
            sched.postprocess(batch, sampled)
            check_books(sched)
        step += 1
        assert step < max_steps, "livelock: not finished"

    assert pool.num_free == pool.num_pages and pool.num_used == 0
    pool.check_invariants()
    capacity = sc.num_pages * sc.page_size
    for seq in seqs.values():
        assert seq.is_finished and seq.page_table == []
        tokens, reason = reference(seq, sc.vocab, capacity)
        if seq.finish_reason == "abort":
            assert tokens[: len(seq.token_ids)] == seq.token_ids
        else:
            assert (seq.token_ids, seq.finish_reason) == (tokens, reason), seq
    return Outcome(list(seqs.values()), pool, step)


@st.composite
def scenarios(draw) -> Scenario:
    page_size = draw(st.integers(1, 5))
    vocab = draw(st.integers(3, 40))
    token = st.integers(0, vocab - 1)
    bases = draw(st.lists(st.lists(token, max_size=16), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        base = draw(st.sampled_from(bases))
        keep = draw(st.just(len(base)) | st.integers(0, len(base)))  # whole shared prefix: often
        prompt = base[:keep] + draw(st.lists(token, min_size=0 if keep else 1, max_size=10))
        add_at = draw(st.integers(0, 12))
        abort_in = draw(st.none() | st.none() | st.integers(0, 15))
        requests.append(
            Request(
                prompt=prompt,
                max_tokens=draw(st.integers(1, 16)),
                max_model_len=len(prompt) + draw(st.integers(1, 20)),
                stop=draw(st.lists(token, max_size=2)),
                ignore_eos=draw(st.booleans()),
                add_at=add_at,
                abort_at=None if abort_in is None else add_at + abort_in,
                abort_mid_step=draw(st.booleans()),
            )
        )
    least = max(-(-(len(r.prompt) + 1) // page_size) for r in requests)
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        max_prefill_chunk=draw(st.none() | st.integers(1, 16)),
        enable_prefix_caching=draw(st.booleans()),
    )
    num_pages = draw(st.integers(least, least + 10))
    return Scenario(page_size, num_pages, vocab, config, requests)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_lose_nothing_and_leak_nothing(sc: Scenario):
    run(sc)


def test_a_crowded_workload_exercises_preemption_and_prefix_hits():
    """A fixed, tight workload: the paths the property test relies on are really taken."""
    rng = random.Random(0)
    system = [rng.randrange(1, 50) for _ in range(12)]
    requests = [
        Request(
            prompt=system[: rng.randrange(0, 13)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))],
            max_tokens=rng.randrange(4, 16), max_model_len=64, stop=[], ignore_eos=True,
            add_at=rng.randrange(0, 10), abort_at=None, abort_mid_step=False,
        )
        for _ in range(12)
    ]
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_prefill_chunk=8)
    out = run(Scenario(page_size=2, num_pages=24, vocab=50, config=config, requests=requests))
    assert sum(s.num_preemptions for s in out.seqs) > 0
    assert out.pool.stats()["hit_tokens"] > 0
    assert all(s.finish_reason == "length" for s in out.seqs)
