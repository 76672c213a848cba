"""On a CUDA GPU: structured outputs beside free rows under CUDA-graph decode and async scheduling:
the constrained rows match their grammars, the free rows' greedy tokens equal those of an eager run
without any constrained row, the graphs are replayed, and the bit masks unpack on the GPU as on the
CPU. Skipped on CPU (tests/runtime/test_structured_outputs.py runs the same checks eagerly)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvc import LLM, SamplingParams, StructuredOutputs
from kvc.runtime.grammar_book import unpack_bits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


def test_bit_masks_unpack_on_the_gpu_as_on_the_cpu():
    bits = torch.randint(-2**31, 2**31 - 1, (5, 1536), dtype=torch.int32)
    assert torch.equal(unpack_bits(bits.cuda(), 49152).cpu(), unpack_bits(bits, 49152))


def test_constrained_and_free_rows_in_graph_decode():
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    eager = LLM("random:tiny", device="cuda", dtype="float32", kv_cache_memory=2**24, cuda_graphs=False,
                async_scheduling=False)
    want = [o.token_ids for o in eager.generate(prompts[1::2], free)]
    llm = LLM("random:tiny", device="cuda", dtype="float32", kv_cache_memory=2**24, cuda_graphs=True,
              async_scheduling=True)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=1,
                             structured_outputs=StructuredOutputs(regex="[0-9]{3}-[a-z]{2}")), free,
              SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA)), free]
    outs = llm.generate(prompts, params)
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outs[0].text) and outs[0].finish_reason == "stop"
    assert json.loads(outs[2].text)["b"] in ("x", "y")
    assert [outs[1].token_ids, outs[3].token_ids] == want
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs
    assert not llm.engine.grammars.matchers
