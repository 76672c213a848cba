"""On two CUDA GPUs: tensor parallelism over NCCL (runtime/distributed/), the decode steps in CUDA graphs
with their all-reduces captured, gives one GPU's greedy tokens for full, SnapKV and Ada-KV (float32 tiny
Qwen3 and Qwen3-MoE: a difference would be a bug, not rounding). Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

PARAMS = {"snapkv": {"budget": 32, "window": 8}, "adakv": {"budget": 32, "window": 8}}
COMMON = dict(device="cuda", dtype="float32", page_size=16, kv_cache_memory=2**27, max_num_batched_tokens=512)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("make", [make_tiny_qwen3, make_tiny_qwen3_moe], ids=["qwen3", "qwen3_moe"])
def test_two_gpus_give_one_gpus_tokens(tmp_path, make):
    model = str(make(tmp_path))
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 160, (12,), generator=g)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist() for n in lengths]
    which = [("full", "snapkv", "adakv")[i % 3] for i in range(12)]
    with LLM(model, method="full", methods=["snapkv", "adakv"], methods_params=PARAMS, tensor_parallel_size=2,
             **COMMON) as tp:
        out = tp.generate(prompts, GREEDY, method=which)
        assert any(group.graphs is not None and group.graphs.graphs for group in tp.engine.runner.groups)
    for method in ("full", "snapkv", "adakv"):
        rows = [i for i, w in enumerate(which) if w == method]
        ref = LLM(model, method=method, method_params=PARAMS.get(method), **COMMON).generate(
            [prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
