"""The eviction interval (`EngineConfig.evict_interval`, kvpress DecodingPress's
compression_interval): decode-time eviction only once a row stores N tokens past its kept count,
then back down to the count at once.

Oracles: `tests/references/model_forward.greedy_compressed_decode(..., interval=N)` (hand-written
from the papers' rules, evicting at the same lengths): greedy tokens and every layer's physical
length after every step; N = 1 is the every-step oracle the engine followed before. StreamingLLM's
kept tokens right after each eviction are identified by their layer-0 keys (a function of token
and position only) and compared with the per-step engine's at the same length. Memory: the
budget, the admission bound and the throughput plan count the N - 1 extra tokens, and a run at
the planned batch never preempts (at the batch planned without them it does).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.bench.plan import model_spec, plan_batch
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import LayerCacheView
from kvc.runtime.methods import resolve_method
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama
from tests.references.model_forward import greedy_compressed_decode

PAGE = 5
CASES = {
    "streamingllm": {"sink": 4, "recent": 20},
    "tova": {"budget": 26},
    "h2o": {"heavy": 0.3, "recent": 0.1},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def make_engine(model_dir: Path, method: str, params: dict, interval: int, **options) -> Engine:
    # the step end's lengths: a ring (runtime/kv/ring.py, its own tests) holds one more slot
    options = {"page_size": PAGE, "max_num_batched_tokens": 64, "max_prefill_chunk": 32, "decode_rings": False,
               **options}
    return LLM(str(model_dir), method=method, method_params=params, device="cpu", dtype="float32",
               attention_backend="torch", evict_interval=interval, **options).engine


def decode_lengths(engine: Engine, seqs, retained: list | None = None) -> dict[int, dict[int, list[int]]]:
    """Steps the engine to the end; per sequence, decode step -> kv_lens after it (the pages held
    checked to be those the lengths need, or up to the budget's bound where a keep left pages the row
    takes again before its next keep: `Scheduler._shrink`)."""
    lengths: dict[int, dict[int, list[int]]] = {s.seq_id: {} for s in seqs}
    budget = engine.scheduler.rules.budget
    while engine.has_unfinished():
        engine.step()
        for s in seqs:
            if s.is_finished or s.is_prefill or s.num_computed_tokens <= s.num_prompt_tokens:
                continue
            lengths[s.seq_id][s.num_computed_tokens - s.num_prompt_tokens] = list(s.kv_lens)
            bound = [budget.steady_tokens(s.prefill_end, s.num_computed_tokens + 1, layer)
                     for layer in range(len(s.kv_lens))]
            assert all(-(-n // PAGE) <= len(t) <= -(-max(n, b) // PAGE)
                       for n, b, t in zip(s.kv_lens, bound, s.page_tables))
            if retained is not None:  # pages a keep left for the tokens to come
                retained.append(sum(len(t) - -(-n // PAGE) for n, t in zip(s.kv_lens, s.page_tables)))
    assert engine.pool.num_free == engine.pool.num_pages
    return lengths


@pytest.mark.parametrize("method, interval, steps", [
    ("streamingllm", 1, 20),  # N = 1: the every-step behaviour, unchanged
    ("streamingllm", 16, 40),
    ("h2o", 8, 30),
    ("tova", 8, 30),
])
def test_tokens_and_lengths_follow_the_interval_oracle(model_dir, hf, method, interval, steps):
    """Two prompts of equal length (one group of `step_end_batch`) and a longer one, batched with
    chunked prefill: tokens and lengths equal the reference evicting at count + N; between
    evictions a row stores [count, count + N - 1] tokens; the method's state is idle after."""
    engine = make_engine(model_dir, method, CASES[method], interval)
    prompts = prompts_of([33, 33, 71], seed=21)
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    retained = []
    lengths = decode_lengths(engine, seqs, retained)
    if interval > 1:  # a keep leaves the pages the row fills again before its next keep, not freed and retaken
        assert max(retained) >= interval // PAGE
    m = engine.method
    assert not m._pending and not m._decode_state and not m._in_pages
    for seq, prompt in zip(seqs, prompts):
        want, _, want_lengths = greedy_compressed_decode(hf, torch.tensor(prompt), steps, method, interval=interval,
                                                         **CASES[method])
        assert seq.generated_ids == want.tolist(), f"{method}, prompt of {len(prompt)} tokens"
        got = lengths[seq.seq_id]
        assert sorted(got) == list(range(1, steps - 1))
        assert [got[step] for step in range(1, steps - 1)] == want_lengths[:-1]
        count = m.decode_kept(10**4, len(prompt), 10**4, 0, engine.spec.num_kv_heads)
        layer0 = [got[step][0] for step in range(1, steps - 1)]
        assert all(count <= n <= count + interval - 1 for n in layer0)
        if interval == 1:
            continue  # every step back to the count (the range above)
        # it evicted (back to the count after growing), once every N steps from the prefill's count
        evictions = [step for step in range(2, steps - 1) if got[step][0] < got[step - 1][0]]
        assert evictions and all(got[step][0] == count for step in evictions)
        assert all(b - a == interval for a, b in zip(evictions, evictions[1:]))


@pytest.mark.parametrize("method", ["streamingllm", "h2o"])
def test_step_end_runs_only_for_rows_due(model_dir, method):
    """`step_end_due` leaves out the rows (and the layers) that do not evict at this step: every
    view handed to `step_end_batch` gives a plan, and with N = 16 most steps hand over none."""
    engine = make_engine(model_dir, method, CASES[method], 16)
    calls: list[int] = []
    real = engine.method.step_end_batch

    def spy(layer, views):
        plans = real(layer, views)
        assert all(plan is not None for plan in plans), "a row that is not due reached step_end"
        calls.append(len(views))
        return plans

    engine.method.step_end_batch = spy
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for prompt in prompts_of([33, 33, 71], seed=5):
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    layers = engine.spec.num_layers
    assert calls and len(calls) <= layers * (2 * 40 // 16 + 2)  # a few eviction steps, not every step
    assert min(calls) >= 1


def _layer0_keys(engine: Engine, seq) -> torch.Tensor:
    """Layer 0's stored keys of `seq` in time order (a keep in place moves slots), one row per token:
    [n, Hkv * D]."""
    keys = LayerCacheView(engine.attention.store_of(0), seq.page_tables[0], seq.kv_lens[0]).keys()  # [Hkv, n, D]
    return keys.transpose(0, 1).flatten(1)


def _key_table(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """Layer 0's keys of every position of `tokens` (the `full` method stores them all): [T, Hkv * D]."""
    engine = LLM(str(model_dir), device="cpu", dtype="float32", attention_backend="torch", page_size=PAGE).engine
    seq = engine.add_request(tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while seq.num_generated < 1:
        engine.step()
    return _layer0_keys(engine, seq)


def _kept_positions(model_dir: Path, interval: int, prompt: list[int], steps: int) -> dict[int, list[int]]:
    """StreamingLLM at `interval`: logical length after each decode step -> the positions layer 0
    stores (identified by their keys, which depend on token and position only)."""
    engine = make_engine(model_dir, "streamingllm", {"sink": 4, "recent": 12}, interval)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    stored: dict[int, torch.Tensor] = {}
    while engine.has_unfinished():
        engine.step()
        if not seq.is_finished and seq.num_computed_tokens > len(prompt):
            stored[seq.num_computed_tokens] = _layer0_keys(engine, seq).clone()
    table = _key_table(model_dir, seq.token_ids)
    positions = {}
    for length, keys in stored.items():
        distance = torch.cdist(keys, table[:length])
        best = distance.min(dim=1)
        assert float(best.values.max()) < 1e-3  # every stored key is one of the sequence's
        positions[length] = best.indices.tolist()
    return positions


def test_streamingllm_keeps_what_per_step_eviction_keeps(model_dir):
    """Right after each eviction at N = 16, layer 0 stores exactly the positions the per-step
    engine stores at that length (the sink and the newest `recent`); between evictions only the
    new tokens are added."""
    prompt = prompts_of([30], seed=5)[0]
    every_step = _kept_positions(model_dir, 1, prompt, 60)
    batched = _kept_positions(model_dir, 16, prompt, 60)
    for length, kept in every_step.items():
        assert kept == list(range(4)) + list(range(length - 12, length))
    evicted = [length for length, kept in batched.items() if len(kept) == 16]
    assert evicted == [30 + 16, 30 + 32, 30 + 48]  # 16 kept at prefill end; evicts at 16 + 16 stored
    for length in evicted:
        assert batched[length] == every_step[length]
    for length, kept in batched.items():
        last = max([e for e in evicted if e <= length], default=None)
        if last is None:  # before the first eviction: the prefill's keep plus every new token
            assert kept == list(range(4)) + list(range(18, 30)) + list(range(30, length))
        else:
            assert kept == batched[last] + list(range(last, length))


def test_budget_counts_the_interval():
    """The decode bound (admission, the scheduler's pages_needed, the plan) is the kept count plus
    N: the step's token and the N - 1 a row holds between evictions."""
    for interval in (1, 16):
        tova, stream, h2o, snap = (resolve_method(n, p) for n, p in
                                   [("tova", {"budget": 26}), ("streamingllm", {"sink": 4, "recent": 20}),
                                    ("h2o", {"heavy": 0.3, "recent": 0.1}), ("snapkv", {"budget": 32, "window": 8})])
        for m in (tova, stream, h2o, snap):
            m.bind(2, 2)
            m.evict_interval = interval
        assert tova.budget.steady_tokens(100, 5000, 1) == 26 + interval
        assert stream.budget.steady_tokens(100, 5000, 0) == 24 + interval
        assert h2o.budget.steady_tokens(100, 5000, 0) == 30 + 10 + interval
        assert tova.budget.steady_tokens(20, 24, 0) == 24  # still growing towards the budget
        assert stream.budget.steady_tokens(100, 110, 0) == min(34, 24 + interval)  # never above the stored
        assert snap.budget.steady_tokens(100, 5000, 0) == 32 + 4900  # no decode-time keep: no change


def test_engine_gives_the_method_its_interval(model_dir):
    engine = make_engine(model_dir, "streamingllm", CASES["streamingllm"], 16)
    assert engine.method.evict_interval == 16
    # the admission bound counts the interval's peak (above the prompt's 20 resident at prefill)
    assert engine.scheduler.pages_needed(20, 400) == engine.spec.num_layers * -(-(24 + 16) // PAGE)


@pytest.mark.parametrize("value", [0, -1, "x", 1.5, True])
def test_bad_intervals_are_config_errors(value):
    with pytest.raises(ConfigError, match="evict_interval must be a positive integer") as e:
        EngineConfig(evict_interval=value)
    assert e.value.param == "evict_interval"


# ---- the throughput plan counts the interval, and a run at the planned batch fits ----------------
MEMORY_PAGES = 80  # layer-pages of 4 tokens: 2 KV heads x (dim 16 x float32, K and V, + an int32 position)
PLAN_PAGE = 4
STREAM = {"sink": 4, "recent": 12}  # keeps 16


def _plan(model_dir: Path, interval: int, input_len: int = 24, output_len: int = 40):
    spec = model_spec(str(model_dir), torch.device("cpu"), "float32")
    memory = MEMORY_PAGES * 2 * (2 * 16 * 4 + 4) * PLAN_PAGE
    return memory, plan_batch(resolve_method("streamingllm", STREAM), spec, memory, PLAN_PAGE, input_len,
                              output_len, 1000, interval)


def test_plan_counts_the_interval(model_dir):
    _, every = _plan(model_dir, 1)
    _, batched = _plan(model_dir, 16)
    assert every.num_pages == batched.num_pages == MEMORY_PAGES
    assert (every.steady_tokens, batched.steady_tokens) == (16 + 1, 16 + 16)
    assert (every.pages_per_seq, batched.pages_per_seq) == (2 * 5, 2 * 8)
    assert (every.batch, batched.batch) == (8, 5)
    assert batched.to_json()["evict_interval"] == 16


def _run_batch(model_dir: Path, memory: int, batch: int, interval: int) -> tuple[Engine, int]:
    """`batch` requests of the plan's shape run to the end; the engine and its peak pages in use."""
    engine = LLM(str(model_dir), method="streamingllm", method_params=STREAM, device="cpu", dtype="float32",
                 attention_backend="torch", page_size=PLAN_PAGE, kv_cache_memory=memory, max_num_seqs=batch,
                 max_num_batched_tokens=256, evict_interval=interval).engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts_of([24] * batch, seed=2)]
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.pool.num_used)
    assert all(s.num_generated == 40 for s in seqs)
    return engine, peak


def test_a_run_at_the_planned_batch_never_preempts(model_dir):
    """N = 16 at the batch its plan allows: every row in lockstep reaches count + 16 tokens in the
    same step, the pool is exactly full then, and nothing is preempted. At the batch planned
    without the interval's N - 1 tokens, the same run runs out of pages and preempts."""
    memory, plan = _plan(model_dir, 16)
    engine, peak = _run_batch(model_dir, memory, plan.batch, 16)
    assert engine.num_pages == plan.num_pages
    assert engine.scheduler.num_preemptions == 0
    assert peak == plan.batch * plan.pages_per_seq == plan.num_pages
    _, naive = _plan(model_dir, 1)
    engine, _ = _run_batch(model_dir, memory, naive.batch, 16)
    assert engine.scheduler.num_preemptions > 0
