"""On a CUDA GPU: several methods in one engine (runtime/lanes.py) with the Triton kernels and decode
graphs. full and SnapKV share one attention group, so their mixed decode steps replay its graphs;
decode steps that also hold Quest or KIVI rows replay each group's graphs over its rows
(docs/design.md, "Many methods in one batch").
Every request gives the tokens of its method's one-method GPU engine (float32 tiny model: a
difference would be a bug, not rounding). Skipped on CPU."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PARAMS = {"snapkv": {"budget": 32, "window": 8}, "quest": {"budget": 32},
          "kivi": {"residual_length": 16, "group_size": 16, "bits": 4}}
COMMON = dict(device="cuda", dtype="float32", page_size=16, max_num_batched_tokens=4096, kv_cache_memory=2**27)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("methods", [["full", "snapkv"], ["full", "snapkv", "quest", "kivi"]])
def test_mixed_gpu_batch_equals_single_method_engines(tmp_path, methods):
    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist()
               for n in torch.randint(60, 160, (16,), generator=g)]
    which = [methods[i % len(methods)] for i in range(16)]
    mixed = LLM(str(model_dir), method=methods[0], methods=methods[1:], methods_params=PARAMS, **COMMON)
    out = mixed.generate(prompts, GREEDY, method=which)
    groups = mixed.engine.runner.groups
    # full + SnapKV: one group, its decode graphs replayed the mixed steps; with Quest and KIVI every group's
    assert all(group.graphs is not None and group.graphs.graphs for group in groups)
    for method in methods:
        rows = [i for i, w in enumerate(which) if w == method]
        ref = LLM(str(model_dir), method=method, method_params=PARAMS.get(method), **COMMON).generate(
            [prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
