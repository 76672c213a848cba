"""Compiled methods' decode-time hooks served end to end (`runtime/compiled/decode.py`, `step_end.py`):
H2O (decode_after_attention: accumulated attention, heavy hitters + recent window), TOVA
(decode_after_attention: the newest query's head-averaged attention) and StreamingLLM (step_end:
sink + recent window) evict after every decoding step.

Oracle: `tests/references/model_forward.greedy_compressed_decode` (hand-written from the papers,
dense recomputation per step). On tiny random Llama and Qwen3 (float32, CPU), with two prompts
batched together (chunked prefill next to decodes), page size 5 (dividing no budget), 27 decode
steps with eviction active from the first: the greedy tokens equal the oracle's, every layer's
physical length after every step equals the oracle cache's, the pages held are exactly those the
physical lengths need, and the pool and the method's state are idle after finish and abort.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.runtime.attention.metadata import StatsFold
from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import AttentionKernels, Hook, LayerCacheView
from kvc.runtime.methods import resolve_method
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.model_forward import greedy_compressed_decode

STEPS = 28  # tokens generated: the first from the prefill, then 27 decoding steps
PAGE = 5
LENGTHS = [33, 71]
CASES = {
    "streamingllm": {"sink": 4, "recent": 20},
    "tova": {"budget": 26},
    "h2o": {"heavy": 0.3, "recent": 0.1},
}
RKV = {"budget": 24, "window": 4, "kernel": 5, "mix": 0.07, "threshold": 0.5, "every": 4}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def make_engine(model_dir: Path, method: str, params: dict | None = None) -> Engine:
    llm = LLM(str(model_dir), method=method, method_params=params or CASES[method], device="cpu", dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="torch",
              decode_rings=False)  # the step end's lengths (StreamingLLM rings otherwise: runtime/kv/ring.py)
    return llm.engine


def method_is_idle(engine: Engine) -> bool:
    m = engine.method
    return (not m._q and not m._state and not m._pending and not m._decode_state and not m._in_pages
            and not m._resume_pages)


def _follow_the_oracle(model_dir, hf, method: str, params: dict) -> tuple[Engine, list[list[list[int]]]]:
    """Two prompts served together: the greedy tokens and every layer's physical length after every decoding
    step equal the oracle's, the pages held are those the lengths need (up to the budget's bound), and nothing is
    left behind.
    Returns the engine and the oracle's lengths per prompt."""
    engine = make_engine(model_dir, method, params)
    prompts = prompts_of(LENGTHS, seed=21)
    sampling = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, sampling) for p in prompts]
    lengths = {s.seq_id: {} for s in seqs}  # decode step -> kv_lens after it
    budget = engine.scheduler.rules.budget
    while engine.has_unfinished():
        engine.step()
        for s in seqs:
            if s.is_finished or s.is_prefill or s.num_computed_tokens <= s.num_prompt_tokens:
                continue
            lengths[s.seq_id][s.num_computed_tokens - s.num_prompt_tokens] = list(s.kv_lens)
            # the pages held are those the physical lengths need, or up to the budget's bound where a keep left
            # pages the row takes again before its next keep (Scheduler._shrink: no table change per step)
            bound = [budget.steady_tokens(s.prefill_end, s.num_computed_tokens + 1, layer)
                     for layer in range(len(s.kv_lens))]
            assert all(-(-n // PAGE) <= len(t) <= -(-max(n + 1, b) // PAGE)
                       for t, n, b in zip(s.page_tables, s.kv_lens, bound))
        running = [s for s in seqs if not s.is_finished]
        assert engine.pool.num_used == sum(len(t) for s in running for t in s.page_tables)
    assert engine.pool.num_free == engine.pool.num_pages
    assert method_is_idle(engine)

    oracle = []
    for seq, prompt in zip(seqs, prompts):
        want, _, want_lengths = greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, method, **params)
        assert seq.generated_ids == want.tolist(), f"{method}, prompt of {len(prompt)} tokens"
        got = lengths[seq.seq_id]
        # every decoding step but the last (it finishes the sequence, whose pages go back at once)
        assert sorted(got) == list(range(1, STEPS - 1))
        assert [got[step] for step in range(1, STEPS - 1)] == want_lengths[:-1]
        oracle.append(want_lengths)
    return engine, oracle


@pytest.mark.parametrize("method", sorted(CASES))
def test_tokens_and_lengths_follow_the_oracle(model_dir, hf, method):
    engine, oracle = _follow_the_oracle(model_dir, hf, method, CASES[method])
    # eviction was active from the first step: the cache stays at the method's budget while the
    # context grows (without decode-time eviction these lengths would grow by one per step)
    for prompt, want_lengths in zip(prompts_of(LENGTHS, seed=21), oracle):
        budget = engine.method.decode_kept(10**4, len(prompt), 10**4, 0, engine.spec.num_kv_heads)
        assert all(n == budget for step_lengths in want_lengths for n in step_lengths)


def test_rkv_tokens_and_lengths_follow_the_oracle(model_dir, hf):
    """R-KV: every prompt token stays; every `every` decoding steps a layer over the budget keeps R-KV's choice,
    scored with the row's newest queries (docs/design.md, "Decode query windows")."""
    engine, oracle = _follow_the_oracle(model_dir, hf, "rkv", RKV)
    for prompt, want_lengths in zip(prompts_of(LENGTHS, seed=21), oracle):
        # admission's bound: the prompt and the first `every` steps' tokens, held until the first keep runs
        assert engine.method.decode_bound(len(prompt), len(prompt) + STEPS, 0) == len(prompt) + RKV["every"]
        for step, step_lengths in enumerate(want_lengths, start=1):  # the prompt grows until step 4, then cycles
            full = len(prompt) + step
            want = full if step < RKV["every"] else RKV["budget"] + step % RKV["every"]
            assert step_lengths == [want] * len(step_lengths), (len(prompt), step)


DECODE_BUDGETS = {"snapkv": {"budget": 24, "window": 4, "kernel": 5, "pooling": "avg", "every": 4},
                  "pyramidkv": {"budget": 24, "window": 4, "kernel": 3, "pooling": "max", "beta": 2, "every": 3}}


@pytest.mark.parametrize("method", sorted(DECODE_BUDGETS))
def test_a_decode_budget_follows_the_oracle(model_dir, hf, method):
    """SnapKV and PyramidKV with `every` > 0: every `every` decoding steps each layer ranks its stored tokens
    again, generated ones included, and drops back to its prefill budget (a method parameter, not an engine
    mode: methods/snapkv.kvm)."""
    params = DECODE_BUDGETS[method]
    engine, oracle = _follow_the_oracle(model_dir, hf, method, params)
    every = params["every"]
    assert engine.method.decode_window == params["window"]
    assert engine.attention.store_of(0).spec.positions == "slot.position"  # its keeps evict in place
    for prompt, want_lengths in zip(prompts_of(LENGTHS, seed=21), oracle):
        kept = [engine.method.budget.kept(len(prompt), layer) for layer in range(engine.spec.num_layers)]
        # admission's bound: the prefill's kept tokens and `every` more, then back
        assert [engine.method.decode_bound(len(prompt), len(prompt) + STEPS, layer)
                for layer in range(engine.spec.num_layers)] == [n + every for n in kept]
        for step, step_lengths in enumerate(want_lengths, start=1):
            assert step_lengths == [n + step % every for n in kept], (len(prompt), step)


ADAKV_DECODE = {"budget": 24, "window": 4, "kernel": 5, "alpha": 0.3, "every": 4}


def test_adakv_decode_budget_follows_the_oracle(model_dir, hf):
    """Ada-KV with `every` > 0: every `every` decoding steps a layer allocates its budget across KV heads
    again over the tokens each head still holds (they differ per head: per-head starts), and each layer's
    slots are its longest head's (methods/adakv.kvm; the oracle: tests/references/decode_eviction.AdaKV)."""
    engine, oracle = _follow_the_oracle(model_dir, hf, "adakv", ADAKV_DECODE)
    assert engine.method.decoding.head_counts and engine.method.decode_window == ADAKV_DECODE["window"]
    every, budget = ADAKV_DECODE["every"], ADAKV_DECODE["budget"]
    for prompt, want_lengths in zip(prompts_of(LENGTHS, seed=21), oracle):
        if len(prompt) <= budget:
            continue
        # admission's bound holds every layer's slots at every step
        bounds = [engine.method.decode_bound(len(prompt), len(prompt) + STEPS, layer)
                  for layer in range(engine.spec.num_layers)]
        assert all(n <= bound for step_lengths in want_lengths for n, bound in zip(step_lengths, bounds))
        # re-allocated at every 4th step: back to the heads' budget, the longest head over the average
        kept = [want_lengths[step - 1] for step in range(every, STEPS - 1, every)]
        assert all(n < len(prompt) for layer_lengths in kept for n in layer_lengths)
        assert any(n > budget for layer_lengths in kept for n in layer_lengths)  # per-head counts differ


def test_a_decode_budget_is_off_by_default(model_dir):
    """`every` = 0 (the default): SnapKV decodes as the paper's prefill-only method, with no step_end,
    no query windows and no slot positions."""
    from kvc.runtime.method_api import Hook as H

    engine = make_engine(model_dir, "snapkv", {"budget": 24, "window": 4})
    assert H.STEP_END not in engine.method.hooks and engine.method.decode_window == 0
    assert engine.attention.store_of(0).spec.positions is None
    assert engine.method.decoding.keep_hook is None
    on = make_engine(model_dir, "snapkv", {"budget": 24, "window": 4, "every": 2})
    assert H.STEP_END in on.method.hooks and on.method.decoding.keep_hook == "step_end"


@pytest.mark.parametrize("method", ["h2o", "streamingllm"])
def test_abort_mid_decode_returns_everything(model_dir, method):
    engine = make_engine(model_dir, method)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts_of([33, 52], seed=4)]
    while min(s.num_computed_tokens - s.num_prompt_tokens for s in seqs) < 6:
        engine.step()
    assert all(s.compressed for s in seqs)
    engine.abort(seqs[0].seq_id)
    for _ in range(3):
        engine.step()
    engine.abort(seqs[1].seq_id)
    assert not engine.has_unfinished()
    assert engine.pool.num_free == engine.pool.num_pages
    assert method_is_idle(engine)


def test_hooks_and_graphs_come_from_the_manifest():
    h2o, tova, stream, snap = (resolve_method(n, CASES.get(n)) for n in ("h2o", "tova", "streamingllm", "snapkv"))
    assert {Hook.DECODE_AFTER_ATTENTION, Hook.STEP_END} <= h2o.hooks and {Hook.DECODE_AFTER_ATTENTION} <= tova.hooks
    assert Hook.STEP_END in stream.hooks and Hook.DECODE_AFTER_ATTENTION not in stream.hooks
    assert not snap.hooks & {Hook.DECODE_AFTER_ATTENTION, Hook.STEP_END}
    # key-local decode hooks keep their state in paged planes: graph-capturable; step_end alone
    # runs after a graph replay
    assert h2o.decode_graphs and tova.decode_graphs and stream.decode_graphs and snap.decode_graphs
    assert h2o.paged_state and tova.paged_state and not stream.paged_state
    assert h2o.state_planes == ("seen", "decode_after_attention.scores")
    assert tova.state_planes == ("decode_after_attention.scores",)
    spec = h2o.kv_spec(2, 16, torch.float32, 4)
    assert tuple(t.name for t in spec.method_tensors) == h2o.state_planes
    # K/V, two float32 planes and each slot's int32 position (the keep evicts in place) per head
    assert spec.bytes_per_token(2) == 2 * (2 * 16 * 4) + 2 * 2 * 4 + 2 * 4
    assert spec.positions == "slot.position" == stream.kv_spec(2, 16, torch.float32, 4).positions
    assert stream.kv_spec(2, 16, torch.float32, 4).method_tensors == ()
    # the attention variant and the statistics its decode kernels emit, from the manifest
    assert h2o.attention == AttentionKernels("decode_stats", StatsFold("group", "mean"))
    assert tova.attention == AttentionKernels("decode_stats", StatsFold("head", "mean"))
    assert stream.attention == snap.attention == AttentionKernels("plain", None)


def test_budget_is_bounded_by_decode_eviction():
    tova, stream, h2o, snap = (resolve_method(n, p) for n, p in
                               [("tova", {"budget": 26}), ("streamingllm", {"sink": 4, "recent": 20}),
                                ("h2o", {"heavy": 0.3, "recent": 0.1}), ("snapkv", {"budget": 32, "window": 8})])
    for m in (tova, stream, h2o, snap):
        m.bind(2, 2)
    # the peak of a decoding step: the kept tokens plus the step's own, whatever the context
    assert tova.budget.steady_tokens(100, 5000, 1) == 27
    assert stream.budget.steady_tokens(100, 5000, 0) == 25
    assert h2o.budget.steady_tokens(100, 5000, 0) == 30 + 10 + 1
    assert tova.budget.steady_tokens(20, 24, 0) == 24  # still growing towards the budget
    assert snap.budget.steady_tokens(100, 5000, 0) == 32 + 4900  # no decode-time keep


def test_long_generation_fits_a_small_pool(model_dir):
    """Admission by the decode bound: a request whose context outgrows the pool many times over is
    admitted and finishes, its pages bounded by the budget."""
    llm = LLM(str(model_dir), method="streamingllm", method_params={"sink": 4, "recent": 12}, device="cpu",
              dtype="float32", page_size=PAGE,
              kv_cache_memory=2 * PAGE * (2 * 16 * 4 + 4) * 12,  # 2 KV heads: K, V and each slot's position
              attention_backend="torch")
    engine = llm.engine
    assert engine.num_pages == 12  # 6 pages per layer: 30 tokens, against a context of 220
    seq = engine.add_request(prompts_of([20], seed=9)[0], SamplingParams(max_tokens=200, temperature=0,
                                                                         ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.pool.num_used)
    assert seq.finish_reason == "length" and seq.num_generated == 200
    assert peak <= 2 * -(-17 // PAGE)
    assert engine.pool.num_free == engine.pool.num_pages


def test_preemption_recomputes_and_releases(model_dir, hf):
    """A pool too small for two prompts' prefill peaks: the newer request is preempted, recomputed
    (its prefill then covers prompt + generated) and evicts again; the older one, never preempted,
    still follows the oracle; nothing is left behind."""
    method, method_params = "h2o", CASES["h2o"]
    llm = LLM(str(model_dir), method=method, method_params=method_params, device="cpu", dtype="float32",
              page_size=PAGE, kv_cache_memory=2 * 2 * PAGE * 16 * 4 * 30, max_num_batched_tokens=64,
              max_prefill_chunk=32, attention_backend="torch")
    engine = llm.engine
    prompts = prompts_of([60, 60], seed=6)
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions > 0 and seqs[1].num_preemptions > 0
    want = greedy_compressed_decode(hf, torch.tensor(prompts[0]), STEPS, method, **method_params)[0]
    assert seqs[0].generated_ids == want.tolist()
    assert all(s.num_generated == STEPS for s in seqs)
    assert engine.pool.num_free == engine.pool.num_pages
    assert method_is_idle(engine)


@pytest.mark.parametrize("method", ["h2o", "tova"])
def test_triton_statistics_in_the_engine(model_dir, hf, method):
    """The engine on the triton backend (the GPU path; here under TRITON_INTERPRET=1): the
    method runs the attention variant its manifest names, whose decode kernels emit the
    statistics its hook reads; same tokens as the oracle."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("decode_stats")
    llm = LLM(str(model_dir), method=method, method_params=CASES[method], device=device.type, dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="triton",
              cuda_graphs=False)
    engine = llm.engine
    assert engine.method.attention.decode_stats is not None
    assert engine.attention.variant == "decode_stats" and engine.attention.ops.EMITS_DECODE_STATS
    prompt, steps = prompts_of([37], seed=8)[0], 10
    seq = engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    want = greedy_compressed_decode(hf, torch.tensor(prompt), steps, method, **CASES[method])[0]
    assert seq.generated_ids == want.tolist()


def test_a_decode_budget_on_the_triton_backend(model_dir, hf):
    """SnapKV's decode budget on the triton backend (the GPU path, here under TRITON_INTERPRET=1): the decode
    rows' queries and positions written by one launch each (runtime/kv/records_triton.py), the window score
    fused, the layers' step ends stacked, the fill in one launch; the oracle's tokens."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("plain")
    params = DECODE_BUDGETS["snapkv"]
    llm = LLM(str(model_dir), method="snapkv", method_params=params, device=device.type, dtype="float32",
              page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32, attention_backend="triton",
              cuda_graphs=False)
    engine = llm.engine
    assert engine.attention.backend == "triton" and engine.method.step_end_layers
    prompt, steps = prompts_of([37], seed=8)[0], 10
    seq = engine.add_request(prompt, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    want = greedy_compressed_decode(hf, torch.tensor(prompt), steps, "snapkv", **params)[0]
    assert seq.generated_ids == want.tolist()


KNORM = """method knorm : eviction

param budget: tokens = 16 in [1, 1048576]
param window: tokens = 4 in [0, 1024]
param every: int = 3 in [1, 4096]

on prefill_end:
  keep top(-norm(k, over channel), budget, per kv_head) + last window

on step_end where step % every == 0:
  keep top(-norm(k, over channel), budget, per kv_head) + last window
"""


def test_a_step_end_keep_with_where_reading_keys(model_dir, tmp_path, monkeypatch):
    """A user's .kvm (compiled on start): step_end reads `k` and evicts every `every` steps only.
    Kept keys per head are the smallest-norm ones plus the window, checked against the stored K."""
    from kvc.compiler import cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    path = tmp_path / "knorm.kvm"
    path.write_text(KNORM)
    llm = LLM(str(model_dir), method=str(path), device="cpu", dtype="float32", page_size=PAGE,
              attention_backend="torch")
    engine = llm.engine
    assert Hook.STEP_END in engine.method.hooks and engine.method.decode_graphs
    # a keep `where step % 3 == 0`: 20 kept at prefill end, at most 3 more before each keep runs
    assert engine.method.budget.steady_tokens(30, 60, 0) == 20 + 3
    seq = engine.add_request(prompts_of([30], seed=3)[0], SamplingParams(max_tokens=12, temperature=0,
                                                                         ignore_eos=True))
    seen, before = {}, None
    while engine.has_unfinished():
        engine.step()
        if seq.is_finished or seq.is_prefill:
            continue
        step = seq.num_computed_tokens - 30
        seen[step] = list(seq.kv_lens)
        # layer 0 in time order ([Hkv, n, D]): the keep evicts in place, so slots are not
        keys = LayerCacheView(engine.attention.store_of(0), seq.page_tables[0], seq.kv_lens[0]).keys()
        if step > 0 and step % 3 == 0:  # evicted: 16 smallest-norm keys of the older ones + the window
            older = before[:, :19]  # the 23 stored before eviction: 22 from the last step + the new one
            want = older.norm(dim=-1).sort(dim=1, stable=True).indices[:, :16].sort(dim=1).values
            torch.testing.assert_close(keys[:, :16], older.gather(1, want[..., None].expand(-1, -1, keys.shape[-1])))
            torch.testing.assert_close(keys[:, 16:19], before[:, 19:22])
        before = keys
    # 20 kept at prefill end, +1 per step, back to 20 every third step
    assert [seen[s][0] for s in sorted(seen)] == [20, 21, 22] * 3 + [20, 21, 22][: len(seen) - 9]
    assert len(seen) == 11  # the 11th decoding step finishes the request
    assert engine.pool.num_free == engine.pool.num_pages


def test_budget_counts_the_first_step_after_a_larger_prefill_keep(tmp_path, monkeypatch):
    """Prefill keeps 40, decoding keeps 8: the first decoding step still holds 41."""
    from kvc.compiler import cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "kvc-cache"))
    path = tmp_path / "shrink.kvm"
    path.write_text("method shrink : eviction\n\non prefill_end:\n  keep last 40\n\non step_end:\n  keep last 8\n")
    m = resolve_method(str(path))
    m.bind(2, 2)
    assert m.budget.steady_tokens(100, 100, 0) == 40
    assert m.budget.steady_tokens(100, 101, 0) == 41
    assert m.budget.steady_tokens(100, 5000, 0) == 41
    assert m.budget.steady_tokens(6, 9, 0) == 9  # below every count: nothing evicted
