"""On a CUDA GPU: OmniKV's shared choice and token read plans in CUDA-graph decode give the CPU
float32 torch path's greedy tokens, batched, with graphs replayed; selecting the whole prompt gives
full's tokens. Skipped on CPU (tests/methods/test_omnikv.py runs the oracles there)."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("selected", [0.1, 1.0])
def test_omnikv_in_graph_decode_matches_cpu(tmp_path, selected):
    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 150, 299)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    common = dict(dtype="float32", page_size=16, max_num_batched_tokens=64, max_prefill_chunk=32,
                  kv_cache_memory=2**26)
    omnikv = dict(method="omnikv", method_params={"filters": [0], "selected": selected})
    ref = [o.token_ids for o in LLM(str(model_dir), device="cpu", **common, **omnikv).generate(prompts, params)]
    llm = LLM(str(model_dir), device="cuda", cuda_graphs=True, **common, **omnikv)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == ref
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    if selected == 1.0:
        full = LLM(str(model_dir), device="cuda", **common).generate(prompts, params)
        assert got == [o.token_ids for o in full]
