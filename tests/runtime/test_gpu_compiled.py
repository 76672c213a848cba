"""On a CUDA GPU: compiled methods served with their fused Triton scoring kernels (the default on
CUDA) keep the same tokens and give the same greedy output as the CPU float32 torch lowering, and
the generated kernels equal the torch lowering at sizes the interpreter cannot reach. Skipped on CPU."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.compiled.method import CompiledMethod
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {
    "snapkv": {"budget": 48, "window": 8, "kernel": 5},
    "pyramidkv": {"budget": 48, "window": 8, "kernel": 5},
    "tova": {"budget": 40},
    "h2o": {"heavy": 0.25, "recent": 0.1},
    "adakv": {"budget": 48, "window": 8, "kernel": 5},
    "streamingllm": {"sink": 4, "recent": 40},
}


@pytest.mark.parametrize("method", sorted(CASES))
def test_fused_scoring_on_gpu_matches_cpu(tmp_path, method, monkeypatch):
    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (60, 150, 299)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    common = dict(dtype="float32", page_size=16, max_num_batched_tokens=64, max_prefill_chunk=32,
                  method=method, method_params=CASES[method], kv_cache_memory=2**26)
    plans = {"cpu": [], "cuda": []}
    original = CompiledMethod.prefill_end

    def spy(self, layer, view):
        plan = original(self, layer, view)
        plans[view.cache.device.type].append(None if plan is None else plan.indices.cpu())
        return plan

    monkeypatch.setattr(CompiledMethod, "prefill_end", spy)
    ref = LLM(str(model_dir), device="cpu", **common).generate(prompts, params)
    gpu_llm = LLM(str(model_dir), device="cuda", **common)
    got = gpu_llm.generate(prompts, params)
    if gpu_llm.engine.method._fused_names:
        assert gpu_llm.engine.method._fused, "the fused kernels must run on CUDA"
    for r, o in zip(ref, got):
        assert o.token_ids == r.token_ids
    del gpu_llm
    torch.cuda.empty_cache()
    assert len(plans["cpu"]) == len(plans["cuda"])
    for a, b in zip(plans["cpu"], plans["cuda"]):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


@pytest.mark.parametrize("length", [1000, 4099])
def test_window_score_kernel_large(length):
    from kvc.kernels_generated.snapkv import torch_lowering, triton_kernels

    g = torch.Generator(device="cuda").manual_seed(length)
    q = torch.randn(16, 64, 128, device="cuda", generator=g)
    k = torch.randn(4, length, 128, device="cuda", generator=g)
    params = {"window": 64, "kernel": 7, "pooling": "avg"}
    torch.testing.assert_close(triton_kernels.window_score(q, k, params), torch_lowering.score(q, k, params=params),
                               rtol=1e-4, atol=1e-6)
