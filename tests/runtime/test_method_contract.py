"""The lifecycle contract, proven by a test-only method written against `method_api` alone.

`Streaming` is StreamingLLM (n_sink first tokens + the most recent ones, chosen at prefill_end),
with an optional per-layer budget (PyramidKV-like shapes). It runs in the real engine (tiny random
Llama and Qwen3, float32, CPU, chunked prefill of 32, page sizes that do not divide the prompts,
batches of several requests) and must:
(a) give the greedy tokens of the hand-written oracle (`tests/references/model_forward.py`:
    decoding from a compressed cache, positions continuing from the logical length);
(b) hold ceil(kept / page_size) pages per layer after prefill, not the prompt's;
(c) run more requests at once than `full` in the same small KV memory;
(d) free everything at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.method_api import Hook, KeepPlan, MethodBase, PrefillView
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.eviction import gather_kv, rank_streamingllm
from tests.references.model_forward import HeadCache, decode, prefill

N_SINK = 4
STEPS = 6


class StreamingBudget:
    def __init__(self, budgets: list[int]) -> None:
        self.budgets = budgets

    def peak_tokens(self, prompt_len: int, layer: int) -> int:
        return prompt_len

    def steady_tokens(self, prompt_len: int, context_len: int, layer: int) -> int:
        return context_len  # no decode-time eviction: generated tokens stay


class Streaming(MethodBase):
    name = "test-streaming"
    hooks = frozenset({Hook.PREFILL_END})
    compacts = True

    def __init__(self, budgets: list[int]) -> None:
        self.budgets = budgets
        self.budget = StreamingBudget(budgets)

    def prefill_end(self, layer: int, view: PrefillView) -> KeepPlan | None:
        length, budget = view.cache.length, self.budgets[layer]
        if length <= budget:
            return None
        keep = torch.cat([torch.arange(N_SINK), torch.arange(length - (budget - N_SINK), length)])
        return KeepPlan(keep[None].expand(view.k.shape[1], -1).contiguous())


def oracle(model, prompt: list[int], budgets: list[int]) -> list[int]:
    """Greedy tokens: the first from full-attention prefill, then from per-layer compressed caches."""
    ids = torch.tensor(prompt)
    layers, logits = prefill(model, ids)
    caches = []
    for layer, t in enumerate(layers):
        kept = rank_streamingllm(t.q, t.k, budget=budgets[layer], n_sink=N_SINK).kept()
        caches.append(HeadCache(*gather_kv(t.k, t.v, list(kept))))
    tokens = [int(logits[-1].argmax())]
    for step in range(1, STEPS):
        out = decode(model, caches, torch.tensor([tokens[-1]]), start=len(prompt) + step - 1)
        tokens.append(int(out[-1].argmax()))
    return tokens


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def make_engine(model_dir: Path, method=None, page_size: int = 7, **overrides) -> Engine:
    options = dict(model=str(model_dir), device="cpu", dtype="float32", page_size=page_size,
                   max_num_batched_tokens=96, max_prefill_chunk=32, attention_backend="torch")
    options.update(overrides)
    return Engine(EngineConfig(**options), method=method)


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int = STEPS) -> tuple[list[list[int]], int]:
    """Greedy outputs, and the most sequences that ran at once."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.scheduler.num_running)
        engine.pool.check_invariants()
    assert engine.pool.num_free == engine.pool.num_pages  # (d) everything freed
    return [s.generated_ids for s in seqs], most


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("budgets", [[24, 24], [16, 40]], ids=["uniform", "per-layer"])
def test_tokens_match_the_compressed_oracle(model_dir, budgets):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of([20, 45, 70, 101], seed=3)  # 20: shorter than every budget (keeps all)
    outputs, _ = run_all(make_engine(model_dir, Streaming(budgets)), prompts)
    for prompt, got in zip(prompts, outputs):
        assert got == oracle(hf, prompt, budgets), f"prompt of {len(prompt)} tokens"


def test_full_is_unchanged_by_the_contract(model_dir):
    prompts = prompts_of([33, 70], seed=4)
    full, _ = run_all(make_engine(model_dir), prompts)
    keep_all, _ = run_all(make_engine(model_dir, Streaming([10**6, 10**6])), prompts)
    assert full == keep_all


def test_prefill_end_frees_pages(model_dir):
    budgets, page, prompt_len = [16, 40], 7, 101
    engine = make_engine(model_dir, Streaming(budgets), page_size=page)
    seq = engine.add_request(prompts_of([prompt_len], seed=5)[0],
                             SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    held_during_prefill = 0
    while seq.is_prefill:
        engine.step()
        held_during_prefill = max(held_during_prefill, engine.pool.num_used)
    layers = engine.spec.num_layers
    assert held_during_prefill == layers * -(-96 // page)  # chunks of 32: the third ends at 96 tokens
    assert seq.kv_lens == budgets and seq.num_computed_tokens == prompt_len
    assert [len(t) for t in seq.page_tables] == [-(-b // page) for b in budgets]
    assert engine.pool.num_used == sum(-(-b // page) for b in budgets)  # 3 + 6 = 9, not 2 * 15
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages


def test_same_memory_runs_more_requests(model_dir):
    prompts = prompts_of([120] * 8, seed=6)
    probe = make_engine(model_dir)
    layer_page = 2 * probe.spec.num_kv_heads * 8 * probe.spec.head_dim * 4
    memory = 2 * probe.spec.num_layers * 17 * layer_page  # two full requests' prompt + decode
    common = dict(page_size=8, kv_cache_memory=memory, enable_prefix_caching=False)
    _, full_most = run_all(make_engine(model_dir, **common), prompts, max_tokens=16)
    _, stream_most = run_all(make_engine(model_dir, Streaming([16, 16]), **common), prompts, max_tokens=16)
    print(f"max running: full {full_most}, streaming {stream_most}")
    assert stream_most >= 2 * full_most, (stream_most, full_most)


def test_preemption_recomputes_and_recompresses(model_dir):
    budgets = [16, 24]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of([60, 75, 90], seed=8)
    probe = make_engine(model_dir)
    layer_page = 2 * probe.spec.num_kv_heads * 7 * probe.spec.head_dim * 4
    engine = make_engine(model_dir, Streaming(budgets), kv_cache_memory=30 * layer_page,
                         max_num_batched_tokens=64)
    outputs, _ = run_all(engine, prompts)
    for prompt, got in zip(prompts, outputs):
        assert got == oracle(hf, prompt, budgets)


def test_triton_backend_matches_torch_under_the_interpreter(model_dir):
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops()
    prompts = prompts_of([9, 40], seed=7)
    want, _ = run_all(make_engine(model_dir), prompts, max_tokens=3)
    got, _ = run_all(make_engine(model_dir, attention_backend="triton", device=device.type,
                                 cuda_graphs=False), prompts, max_tokens=3)
    assert got == want
