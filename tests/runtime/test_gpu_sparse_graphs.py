"""On a CUDA GPU: DuoAttention on per-head cache layers and RetroInfer's cluster indices in CUDA-graph
decode give the CPU float32 torch path's greedy tokens, batched, with graphs replayed. Skipped on
CPU (tests/methods/test_duoattention.py and test_retroinfer.py run the oracles there)."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.models.method_inputs import save_input
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COMMON = dict(dtype="float32", page_size=16, max_num_batched_tokens=64, max_prefill_chunk=32, kv_cache_memory=2**26,
              max_model_len=512, max_num_seqs=8)


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (70, 150, 299)]


@pytest.mark.parametrize("method, params", [
    ("duoattention", {"sink": 8, "recent": 32, "sparsity": 0.5}),
    ("retroinfer", {"cluster_size": 8, "segment": 16, "sink": 4, "local": 8, "retrieved": 0.2, "computed": 0.5}),
])
def test_graph_decode_matches_cpu(tmp_path, method, params):
    model_dir = make_tiny_qwen3(tmp_path)
    if method == "duoattention":
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        shape = (config.num_hidden_layers, config.num_key_value_heads)
        gate = torch.rand(*shape, generator=torch.Generator().manual_seed(0))
        save_input(model_dir / "duo_attention_heads.safetensors", "gate", gate)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = dict(COMMON, method=method, method_params=params)
    ref = [o.token_ids for o in LLM(str(model_dir), device="cpu", **options).generate(_prompts(), sampling)]
    llm = LLM(str(model_dir), device="cuda", cuda_graphs=True, **options)
    got = [o.token_ids for o in llm.generate(_prompts(), sampling)]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert got == ref
