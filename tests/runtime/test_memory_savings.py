"""Real memory savings of a served eviction method (issue 4's acceptance, "real savings").

After a 4096-token prefill with SnapKV at budget 512, the request holds ceil(512 / page) pages
per layer (plus the pages its decoded tokens need), not ceil(4096 / page): compaction gives the
pages back to the pool, no mask keeps them allocated. And in the same fixed KV memory the
scheduler runs at least 6x more SnapKV requests at once than `full` ones.

How "at once" is counted: the requests past their prefill (decoding) in the same step. The
running set also holds prefills in progress, and an admitted prefill may still be preempted, so
only a request that decodes proves its memory fits. Both runs must be memory-bound at their peak
(requests still waiting), so the number is the memory's, not the workload's.

Why these sizes: the prompt stays resident until prefill_end, so one 4096-token prefill in flight
costs one full request's memory; with k full requests' memory SnapKV fits about
(k * 4136 - 4096) / (512 + decoded) decoding requests. k = 5 and 40 new tokens each give ~6.4x.
A step budget of 4160 tokens prefills one prompt per step, so decoders accumulate fast enough
(a request decodes 40 steps). The model is tiny (2 layers, one attention head) so
the 4096-token prefills stay cheap on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama

PROMPT = 4096
BUDGET = 512
PAGE = 16
LAYERS = 2
KV_HEADS, HEAD_DIM = 1, 16
NEW_TOKENS = 40
FULL_REQUESTS_IN_MEMORY = 5  # the fixed KV memory: this many full requests, prompt + new tokens
STEP_TOKENS = PROMPT + 64  # one whole prompt per step, beside the decodes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("long"), seed=3, num_hidden_layers=LAYERS, num_attention_heads=1,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=PROMPT + 512,
    )


def pages(tokens: int) -> int:
    return -(-tokens // PAGE)


def make_engine(model_dir: Path, method: str, **overrides) -> Engine:
    params = {"budget": BUDGET} if method == "snapkv" else None  # snapkv's default window (32)
    options = dict(model=str(model_dir), method=method, method_params=params, device="cpu",
                   dtype="float32", page_size=PAGE, max_num_batched_tokens=STEP_TOKENS,
                   enable_prefix_caching=False, attention_backend="torch")
    return Engine(EngineConfig(**{**options, **overrides}))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (PROMPT,), generator=g).tolist() for _ in range(n)]


def test_snapkv_holds_the_budget_pages_not_the_prompt_pages(model_dir):
    engine = make_engine(model_dir, "snapkv", max_num_batched_tokens=1024)  # chunked prefill
    assert (engine.spec.num_layers, engine.spec.num_kv_heads) == (LAYERS, KV_HEADS)
    seq = engine.add_request(prompts(1, seed=1)[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    held_in_forward: list[int] = []  # pages in use while the model runs each step
    run = engine.runner.run
    engine.runner.run = lambda batch, needs, *rest, **kw: (held_in_forward.append(engine.pool.num_used),
                                                          run(batch, needs, *rest, **kw))[1]
    while seq.is_prefill:
        engine.step()
    assert max(held_in_forward) == LAYERS * pages(PROMPT)  # the prompt was resident until prefill_end...
    assert seq.kv_lens == [BUDGET] * LAYERS  # ...then each layer kept the budget
    assert [len(t) for t in seq.page_tables] == [pages(BUDGET)] * LAYERS
    assert pages(BUDGET) != pages(PROMPT)
    assert engine.pool.num_used == LAYERS * pages(BUDGET)  # the other pages are back in the pool
    while not seq.is_finished:
        engine.step()
        if seq.is_finished:
            break
        decoded = seq.num_computed_tokens - PROMPT  # tokens stored after the kept prompt
        assert seq.kv_lens == [BUDGET + decoded] * LAYERS
        assert [len(t) for t in seq.page_tables] == [pages(BUDGET + decoded)] * LAYERS
        assert engine.pool.num_used == LAYERS * pages(BUDGET + decoded)
    assert engine.pool.num_free == engine.pool.num_pages


@dataclass
class Concurrency:
    decoding: int  # most requests decoding in one step
    waiting: int  # requests still waiting in that step (> 0: memory, not the workload, was the limit)
    preemptions: int


def peak_concurrency(engine: Engine, requests: list[list[int]]) -> Concurrency:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in requests]
    best = Concurrency(0, 0, 0)
    while engine.has_unfinished():
        engine.step()
        decoding = sum(not s.is_prefill for s in engine.scheduler.running)
        if decoding > best.decoding:
            best = Concurrency(decoding, engine.scheduler.num_waiting, 0)
    assert all(s.finish_reason == "length" and s.num_generated == NEW_TOKENS for s in seqs)
    assert engine.pool.num_free == engine.pool.num_pages
    best.preemptions = engine.scheduler.num_preemptions
    return best


def test_same_kv_memory_runs_six_times_more_snapkv_requests(model_dir):
    layer_page_bytes = 2 * KV_HEADS * PAGE * HEAD_DIM * 4  # K and V, float32
    memory = FULL_REQUESTS_IN_MEMORY * LAYERS * pages(PROMPT + NEW_TOKENS) * layer_page_bytes

    full = peak_concurrency(make_engine(model_dir, "full", kv_cache_memory=memory),
                            prompts(FULL_REQUESTS_IN_MEMORY + 2, seed=2))
    snap = peak_concurrency(make_engine(model_dir, "snapkv", kv_cache_memory=memory),
                            prompts(36, seed=2))
    print(f"most requests decoding at once: full {full}, snapkv {snap}")
    assert full.decoding == FULL_REQUESTS_IN_MEMORY and full.waiting > 0
    assert snap.waiting > 0
    assert snap.decoding >= 6 * full.decoding, (snap, full)
