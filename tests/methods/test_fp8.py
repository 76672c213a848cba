"""The compiled `fp8` method (methods/fp8.kvm) served on tiny random Llama and Qwen3 models, against
the hand-written oracle of tests/references/fp8.py: the model run with every stored K/V replaced by
its FP8 round trip (the reference's own quantizer), dense attention over them. Greedy tokens and
every sampled logit row must match through batching with chunked prefills, a prefix-cache hit, a
chain continued and forked, and a preemption; unit and dynamic scales both. The pool holds twice
the tokens of a bf16 `full` cache (bytes per token from the spec), and the scales are what the
first stored chunk says (dynamic) or 1.0 (unit).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import fp8 as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
SCALINGS = ("unit", "dynamic")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    # sharp attention (as the contract tests): FP8 round trips then change the logits measurably
    return make(tmp_path_factory.mktemp(f"fp8-{request.param}"), seed=7, num_hidden_layers=2, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def make_llm(model_dir: Path, scaling: str, dtype: str = "float32", **options) -> LLM:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype=dtype, page_size=PAGE, attention_backend="torch",
                          kv_cache_memory=2**22, method="fp8", method_params={"scale": scaling},
                          **{"max_num_batched_tokens": 4096, **options})
    return LLM.from_engine(Engine(config))


def calibrated(llm: LLM, hf, scaling: str) -> ref.Session:
    """A reference session holding the scales the engine fixed: for dynamic scales, from a first
    request served alone in one chunk (the reference computes them from the same chunk and must
    agree), whose tokens must match too."""
    template = ref.Session(scaling=scaling)
    if scaling == "dynamic":
        first = prompt(7, 21)  # one chunk even where prefills are chunked by 8
        out = llm.generate(first, greedy(3))[0]
        assert out.token_ids == ref.generate(hf, template, first, 3)[0]
        store = llm.engine.attention.store
        for (layer, which), value in template.scales.items():
            torch.testing.assert_close(float(store[f"{which}_scale"][layer, 0, 0]), value, rtol=1e-6, atol=0)
    return ref.Session(scaling=scaling, scales=dict(template.scales))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_batch_with_chunked_prefills_equals_the_oracle(model_dir, hf, monkeypatch, scaling: str) -> None:
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, scaling, max_num_batched_tokens=20, max_prefill_chunk=8)
    template = calibrated(llm, hf, scaling) if scaling == "dynamic" else ref.Session()
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, template.copy(), p, 10)
        check(out.token_ids, spy.of(sp), want)
        exact = ref.Session(fmt=None)  # FP8 off: the exact K/V
        _, dense = ref.generate(hf, exact, p, 10)
        assert (dense - want[1]).abs().max() > 10 * ATOL, "FP8 changes nothing: the test is blind"


@pytest.mark.parametrize("scaling", SCALINGS)
def test_prefix_cache_hit(model_dir, hf, monkeypatch, scaling: str) -> None:
    llm = make_llm(model_dir, scaling)
    template = calibrated(llm, hf, scaling)
    served.prefix_cache_hit(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_chain_continued_and_forked(model_dir, hf, monkeypatch, scaling: str) -> None:
    llm = make_llm(model_dir, scaling)
    template = calibrated(llm, hf, scaling)
    served.chain_continued_and_forked(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes(model_dir, hf, monkeypatch, prefix_caching: bool) -> None:
    llm = make_llm(model_dir, "dynamic", enable_prefix_caching=prefix_caching)
    template = calibrated(llm, hf, "dynamic")
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy, PAGE,
                                 prefix_caching, 14)


def test_the_pool_holds_twice_the_tokens_of_bf16_full(model_dir) -> None:
    """Bytes per token come from the spec: FP8 codes are half of bf16 K/V, so the same KV budget
    buys twice the pages (the scales are per layer, outside the pages); a bf16 model serves."""
    config = dict(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE, attention_backend="torch",
                  kv_cache_memory=2**20)
    full = Engine(EngineConfig(**config, method="full"))
    fp8 = Engine(EngineConfig(**config, method="fp8"))
    heads = full.layout.kv_heads
    assert 2 * fp8.attention.store.spec.bytes_per_token(heads) == full.attention.store.spec.bytes_per_token(heads)
    assert fp8.num_pages >= 2 * full.num_pages - 1
    assert fp8.attention.store["k_codes"].dtype == torch.float8_e4m3fn
    out = LLM.from_engine(fp8).generate(prompt(12, 5), greedy(4))[0]
    assert len(out.token_ids) == 4
    assert torch.equal(fp8.attention.store["k_scale"].float(), torch.ones_like(fp8.attention.store["k_scale"].float()))


def test_e5m2_serves_and_differs_from_e4m3(model_dir, hf, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method="fp8",
                          method_params={"format": "e5m2", "scale": "dynamic"})
    llm = LLM.from_engine(Engine(config))
    p, params = prompt(21, 8), greedy(6)
    out = llm.generate(p, params)[0]
    want = ref.generate(hf, ref.Session(fmt="e5m2", scaling="dynamic"), p, 6)
    check(out.token_ids, spy.of(params), want)
    other = ref.generate(hf, ref.Session(fmt="e4m3", scaling="dynamic"), p, 6)[1]
    assert (other - want[1]).abs().max() > 10 * ATOL
