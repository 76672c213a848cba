"""On a CUDA GPU: the Triton backend and CUDA-graph decode give the same greedy tokens as the
torch path (float32 tiny model, so differences would be bugs, not rounding). Skipped on CPU."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_triton_and_graphs_match_torch_path(tmp_path):
    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 17, 64, 150, 299)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    common = dict(dtype="float32", page_size=16, max_num_batched_tokens=64, max_prefill_chunk=32, kv_cache_memory=2**26)
    ref = LLM(str(model_dir), device="cpu", **common).generate(prompts, params)
    eager = LLM(str(model_dir), device="cuda", cuda_graphs=False, **common).generate(prompts, params)
    graphs_llm = LLM(str(model_dir), device="cuda", cuda_graphs=True, **common)
    graphs = graphs_llm.generate(prompts, params)
    assert graphs_llm.engine.runner.graphs is not None and graphs_llm.engine.runner.graphs.graphs
    for r, e, c in zip(ref, eager, graphs):
        assert e.token_ids == r.token_ids
        assert c.token_ids == r.token_ids
