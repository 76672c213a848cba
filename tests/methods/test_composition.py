"""A policy composed with a storage format in one .kvm file (bench/variants/snapkv_fp8.kvm: SnapKV's
selection over FP8 storage, two `store` lines added) compiles, lowers and is served by the engine
unchanged:
- its KV spec is fp8's (half the bytes per token of the model's dtype) and its hooks SnapKV's;
- with a budget that keeps every token it gives fp8's greedy tokens and logits exactly;
- with a smaller budget it keeps SnapKV's positions, chosen on the stored (FP8-decoded) keys, and
  holds SnapKV's tokens at fp8's bytes: the memory product, which the throughput plan's largest
  batch shows (about twice SnapKV's at the same memory).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.bench.plan import model_spec, plan_batch
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from kvc.runtime.methods import resolve_method
from kvc.runtime.method_api import KeepPlan
from tests.models.tiny import make_tiny_qwen3
from tests.runtime.test_contract_methods import Logits, greedy, prompt

PAGE = 4
COMPOSED = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "snapkv_fp8.kvm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("compose"), seed=7, num_hidden_layers=2, initializer_range=0.25)


def make_llm(model_dir: Path, method: str, params: dict | None = None) -> LLM:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method=method,
                          method_params=params or {}, max_num_batched_tokens=4096)
    return LLM.from_engine(Engine(config))


def test_the_composed_spec_is_fp8s_and_its_hooks_snapkvs(model_dir) -> None:
    composed = make_llm(model_dir, COMPOSED, {"budget": 16, "window": 4}).engine
    fp8, snapkv = make_llm(model_dir, "fp8").engine, make_llm(model_dir, "snapkv").engine
    assert composed.attention.store.spec == fp8.attention.store.spec
    assert composed.method.hooks == snapkv.method.hooks and composed.method.compacts
    spec = composed.attention.store.spec
    assert spec.bytes_per_token(2) * 2 == snapkv.attention.store.spec.bytes_per_token(2)


def test_a_budget_that_keeps_everything_is_fp8(model_dir, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    want = [greedy(8) for _ in prompts]
    fp8 = [o.token_ids for o in make_llm(model_dir, "fp8").generate(prompts, want)]
    got_params = [greedy(8) for _ in prompts]
    composed = make_llm(model_dir, COMPOSED, {"budget": 64, "window": 4}).generate(prompts, got_params)
    assert [o.token_ids for o in composed] == fp8
    for a, b in zip(want, got_params):
        torch.testing.assert_close(spy.of(b), spy.of(a), atol=0, rtol=0)


def test_snapkvs_positions_on_the_stored_keys_at_fp8s_bytes(model_dir, monkeypatch) -> None:
    """The composed prefill_end keeps what SnapKV's own generated selection picks from the same
    queries and the stored (FP8-decoded) keys; its sequences hold SnapKV's token counts."""
    composed = make_llm(model_dir, COMPOSED, {"budget": 16, "window": 4})
    method = composed.engine.method
    snapkv = resolve_method("snapkv", {"budget": 16, "window": 4})
    seen = []
    original = method.prefill_end

    def spy(layer, view):
        q, keys = view.q.transpose(0, 1).clone(), view.cache.keys().clone()  # one chunk: every query
        plan = original(layer, view)
        seen.append((layer, plan, q, keys))
        return plan

    monkeypatch.setattr(method, "prefill_end", spy)
    out = composed.generate(prompt(40, 3), greedy(6))[0]
    assert len(out.token_ids) == 6 and len(seen) == 2
    for layer, plan, q, keys in seen:
        assert keys.dtype == torch.bfloat16 and keys.shape[1] == 40  # decoded from the FP8 codes
        assert isinstance(plan, KeepPlan)
        scores = snapkv.code.score(q, keys, layer=layer, num_layers=2, params=snapkv.params)
        want = snapkv.lowering.select(scores, keys.shape[1], layer=layer, num_layers=2, params=snapkv.params)
        assert [sorted(t.tolist()) for t in want] == [sorted(row.tolist()) for row in plan.indices.cpu()], layer
        assert plan.indices.shape[1] == 16


def test_the_memory_product_in_the_throughput_plan(model_dir) -> None:
    spec = model_spec(str(model_dir), torch.device("cpu"), "bfloat16")
    memory = 2**24
    plans = {name: plan_batch(resolve_method(name, {"budget": 64, "window": 4} if "snapkv" in name else None), spec,
                              memory, PAGE, 1024, 64, 10**6)
             for name in ("snapkv", COMPOSED, "fp8", "full")}
    assert plans[COMPOSED].batch >= 1.9 * plans["snapkv"].batch
    assert plans["snapkv"].batch >= 5 * plans["full"].batch and plans["fp8"].batch >= 1.9 * plans["full"].batch
