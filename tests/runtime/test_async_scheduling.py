"""Async scheduling (runtime/engine.py `step`): the engine builds and launches the next step (decodes,
prefill chunks, admissions) while the current one's sampled tokens are still pending on the device, and
commits them after.

The oracle is the same engine without it: every request's tokens and finish reason are equal, for
greedy and seeded sampling, with stop tokens and max_tokens that end requests at different steps
(a request that a pending token stops is in the step launched ahead: its row is computed and
dropped), requests arriving and aborted between steps, long prompts in small chunks, and the prefix
cache (the pages a request names while running ahead are the ones the plain engine names). The tests
also check that steps really ran ahead (`schedule_ahead` built most decode steps and the prefill
steps), and the scheduler's refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import Scheduler
from tests.models.tiny import make_tiny_qwen3

METHODS = {
    "full": None,
    "snapkv": {"budget": 24, "window": 8},
    "pyramidkv": {"budget": 24, "window": 8},
    "adakv": {"budget": 24, "window": 8},
    "h2o": {"heavy": 0.2, "recent": 0.15},
    "streamingllm": {"sink": 4, "recent": 16},
    "tova": {"budget": 24},
    "duoattention": {"sink": 4, "recent": 12, "sparsity": 0.5},  # per-head cache layers
}
LENGTHS = [9, 33, 61, 80, 47]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig

    from kvc.runtime.models.method_inputs import save_input

    path = make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))
    config = AutoConfig.from_pretrained(path)
    gate = torch.rand(config.num_hidden_layers, config.num_key_value_heads, generator=torch.Generator().manual_seed(0))
    save_input(path / "duo_attention_heads.safetensors", "gate", gate)  # DuoAttention's roles
    return path


def make_engine(model_dir: Path, method: str, async_scheduling: bool, **options):
    opts = {**dict(device="cpu", dtype="float32", page_size=8, max_num_batched_tokens=64, max_prefill_chunk=32,
                   attention_backend="torch"), **options}
    return LLM(str(model_dir), method=method, method_params=METHODS[method],
               async_scheduling=async_scheduling, **opts).engine


def prompts(seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]


def params(stop_ids: list[int]) -> list[SamplingParams]:
    """Greedy and seeded sampling, different max_tokens, stop tokens that end some requests early."""
    return [
        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.8, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=stop_ids),
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True, stop_token_ids=stop_ids),
    ]


class AheadCounter:
    """Counts the steps `schedule_ahead` built (wraps the engine's scheduler method)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.built = 0
        inner = scheduler.schedule_ahead

        def counted(batch):
            out = inner(batch)
            self.built += out is not None
            return out

        scheduler.schedule_ahead = counted


def run(engine, work: list[tuple[list[int], SamplingParams]], arrive_at: dict[int, int] | None = None,
        abort_at: dict[int, int] | None = None):
    """Steps the engine to the end; request i is added before step arrive_at[i] (0: at once) and
    aborted before step abort_at[i]. (tokens, finish reason) per request, and the step count."""
    arrive_at, abort_at = arrive_at or {}, abort_at or {}
    seqs: dict[int, object] = {}
    step = 0
    while True:
        for i, (prompt, sp) in enumerate(work):
            if i not in seqs and arrive_at.get(i, 0) <= step:
                seqs[i] = engine.add_request(prompt, sp)
        for i, at in abort_at.items():
            if at == step and i in seqs and not seqs[i].is_finished:
                engine.abort(seqs[i].seq_id)
        if len(seqs) == len(work) and not engine.has_unfinished():
            break
        engine.step()
        step += 1
        assert step < 500
    return [(seqs[i].generated_ids, seqs[i].finish_reason) for i in range(len(work))], step


def stop_ids_of(model_dir: Path, method: str) -> list[int]:
    """Tokens the plain engine generates mid-way for requests 3 and 4: used as their stop tokens,
    so they stop early (after a step that ran ahead of that token)."""
    engine = make_engine(model_dir, method, False)
    out, _ = run(engine, list(zip(prompts(), params([]))))
    return [out[3][0][6], out[4][0][4]]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("interval", [1, 4])
def test_async_equals_plain(model_dir, method, interval):
    """Every method runs ahead, decode-time eviction included (its step_end needs host facts only:
    the launched step's compactions queue behind it on the device), at any eviction interval."""
    stops = stop_ids_of(model_dir, method)
    work = list(zip(prompts(), params(stops)))
    plain, _ = run(make_engine(model_dir, method, False, evict_interval=interval), work)
    engine = make_engine(model_dir, method, True, evict_interval=interval)
    counter = AheadCounter(engine.scheduler)
    ahead, steps = run(engine, work)
    assert ahead == plain
    assert any(reason == "stop" for _, reason in plain), "a stop token ended no request: the test lost its point"
    assert engine._async
    assert counter.built >= steps // 2, f"only {counter.built} of {steps} steps were scheduled ahead"


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_arrivals_and_aborts_between_steps(model_dir, method):
    stops = stop_ids_of(model_dir, method)
    work = list(zip(prompts(), params(stops)))
    arrive = {2: 6, 4: 11}  # they arrive while others decode ahead
    abort = {0: 9}
    plain, _ = run(make_engine(model_dir, method, False), work, arrive, abort)
    ahead, _ = run(make_engine(model_dir, method, True), work, arrive, abort)
    for i in range(len(work)):
        if i == 0:  # aborted: its tokens so far depend on how far ahead it ran, the reason does not
            assert ahead[i][1] == plain[i][1] == "abort"
            assert plain[i][0][: len(ahead[i][0])] == ahead[i][0] or ahead[i][0][: len(plain[i][0])] == plain[i][0]
        else:
            assert ahead[i] == plain[i]


def test_prefix_cache_names_the_same_pages(model_dir):
    """A second request that repeats the first's prompt and reply hits the cache as far as it does
    without async scheduling (the pages filled while running ahead were named with their tokens)."""
    first = prompts()[2]
    sp = SamplingParams(max_tokens=29, temperature=0, ignore_eos=True)
    hits = []
    for async_ in (False, True):
        engine = make_engine(model_dir, "full", async_)
        (out, _), = run(engine, [(first, sp)])[0]
        seq = engine.add_request(first + out + [5, 6], SamplingParams(max_tokens=2, temperature=0))
        while engine.has_unfinished():
            engine.step()
        hits.append((out, seq.num_cached_tokens))
    assert hits[0] == hits[1]
    assert hits[1][1] >= 80  # 61 + 29 tokens: whole pages of prompt and reply were reused


def test_clone_while_a_step_runs_ahead(model_dir):
    """clone_sequence commits the step running ahead first; the clones continue as the source."""
    engine = make_engine(model_dir, "snapkv", True, enable_prefix_caching=False)
    seq = engine.add_request(prompts()[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while seq.num_generated < 3:
        engine.step()
    engine.step()
    assert engine._launched is not None  # a step runs ahead: seq's token is pending
    clones = engine.clone_sequence(seq, 2)
    assert seq.pending == 0 and engine._launched is None
    while engine.has_unfinished():
        engine.step()
    assert all(c.generated_ids == seq.generated_ids for c in clones)
    plain = make_engine(model_dir, "snapkv", False, enable_prefix_caching=False)
    (alone, _), = run(plain, [(prompts()[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])[0]
    assert seq.generated_ids == alone


def test_schedule_ahead_refusals_and_admissions(model_dir):
    engine = make_engine(model_dir, "full", True)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = engine.add_request(prompts()[0], sp)
    while engine._launched is None:
        engine.step()
    batch, _ = engine._launched
    sched = engine.scheduler
    free = sched.pool.num_free
    taken = sched.pool.allocate(free)  # no free page for a page boundary: never preempt ahead
    kv_lens, tables = list(a.kv_lens), [list(t) for t in a.page_tables]
    a.kv_lens = [(kv // 8 + 1) * 8 for kv in a.kv_lens]  # every layer at a page boundary
    a.room = None
    assert sched.schedule_ahead(batch) is None
    sched.pool.free(taken)
    a.kv_lens = [len(t) * 8 - 1 for t in a.page_tables]
    a.room = None
    max_tokens = a.params.max_tokens
    a.params = SamplingParams(max_tokens=a.num_generated + 1, temperature=0, ignore_eos=True)
    assert a.stops_by_length and sched.schedule_ahead(batch) is None  # its pending token ends it: nothing to run
    a.params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    a.kv_lens, a.room = kv_lens, None
    assert [list(t) for t in a.page_tables] == tables
    b = engine.add_request(prompts()[3], sp)  # 80 tokens: chunks of 32
    b.chain = object()  # a chained request waits: its admission attaches a record
    assert sched.schedule_ahead(batch) is None
    b.chain = None
    ahead = sched.schedule_ahead(batch)  # admitted ahead: a decodes its pending token, b prefills
    assert ahead is not None and ahead.seqs == [a, b] and ahead.num_new_tokens == [1, 32]


def test_prefill_chunks_run_ahead(model_dir):
    """A long prompt's chunks and the steps that admit waiting requests are scheduled ahead too (the
    host's work for the next chunk overlaps the device's current one); the tokens are the plain
    engine's."""
    stops = stop_ids_of(model_dir, "snapkv")
    work = list(zip(prompts(), params(stops)))
    arrive = {3: 4, 4: 9}
    plain, _ = run(make_engine(model_dir, "snapkv", False, max_prefill_chunk=8), work, arrive)
    engine = make_engine(model_dir, "snapkv", True, max_prefill_chunk=8)
    prefills = []
    inner = engine.scheduler.schedule_ahead

    def counted(batch):
        out = inner(batch)
        prefills.append(out is not None and out.num_prefills > 0)
        return out

    engine.scheduler.schedule_ahead = counted
    ahead, _ = run(engine, work, arrive)
    assert ahead == plain
    assert sum(prefills) >= 10, f"{sum(prefills)} steps with prefill chunks were scheduled ahead"


@pytest.mark.parametrize("method", ["full", "adakv"])
def test_graph_inputs_take_pending_tokens(model_dir, method):
    """The decode graphs' input path (`DecodeGraphs._load` with a feed, run uncaptured on the CPU):
    running ahead through it gives the plain engine's tokens."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    stops = stop_ids_of(model_dir, method)
    work = list(zip(prompts(), params(stops)))
    plain, _ = run(make_engine(model_dir, method, False), work)
    engine = make_engine(model_dir, method, True)
    graphs = engine.runner.graphs = DecodeGraphs(engine.runner, 8)
    fed = []

    def replay(batch, feed=None):
        fed.append(feed is not None)
        return graphs.run_uncaptured(batch, feed)

    graphs.run = replay
    ahead, _ = run(engine, work)
    assert ahead == plain
    assert sum(fed) >= len(fed) // 2  # most graph steps took their input tokens from the device


def test_cli_flag_runs_ahead_with_the_same_tokens(capsys):
    """`kvc generate --async-scheduling on|off` on the CPU: the same tokens either way."""
    import json

    from kvc.runtime.cli import main

    outputs = []
    for flag in ("on", "off"):
        assert main(["generate", "--prompt", "hello there", "--max-tokens", "12", "--json", "--max-model-len", "256",
                     "--ignore-eos", "--async-scheduling", flag]) == 0
        outputs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12
    with pytest.raises(SystemExit):  # argparse: usage and the choices on stderr
        main(["generate", "--prompt", "hi", "--async-scheduling", "sometimes"])
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
