"""On a CUDA GPU: penalties, logit bias, min_tokens, min_p and logprobs under CUDA-graph decode and
async scheduling (penalty counts updated on the device between steps launched ahead) give the
same tokens and logprobs as eager steps without async scheduling; prompt logprobs equal a Hugging
Face forward's. Skipped on CPU (tests/runtime/test_logprobs.py runs the same checks eagerly)."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LENGTHS = (9, 60, 150, 97, 33)


def params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.6, logprobs=3),
        SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True, presence_penalty=0.8,
                       frequency_penalty=0.5, min_p=0.01, logprobs=0),
        SamplingParams(max_tokens=20, temperature=0, min_tokens=12, logit_bias={7: 3.0}, logprobs=2),
        SamplingParams(max_tokens=28, temperature=0, ignore_eos=True),  # asks for nothing
        SamplingParams(max_tokens=16, temperature=1.0, top_k=20, seed=9, ignore_eos=True),
    ]


def run(model_dir, graphs: bool, async_scheduling: bool):
    llm = LLM(str(model_dir), device="cuda", dtype="float32", page_size=16, max_num_batched_tokens=512,
              kv_cache_memory=2**26, cuda_graphs=graphs, async_scheduling=async_scheduling)
    built = []
    inner = llm.engine.scheduler.schedule_ahead
    llm.engine.scheduler.schedule_ahead = lambda batch: built.append(inner(batch)) or built[-1]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]
    outs = llm.generate(prompts, params())
    prompt_lp = llm.generate(prompts[2], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    graphs_used = bool(llm.engine.runner.graphs is not None and llm.engine.runner.graphs.graphs)
    return outs, prompt_lp, prompts, sum(b is not None for b in built), graphs_used


def test_graphs_and_async_give_the_eager_tokens_and_logprobs(tmp_path):
    model_dir = make_tiny_qwen3(tmp_path)
    eager, _, _, ahead, used = run(model_dir, graphs=False, async_scheduling=False)
    assert ahead == 0 and not used
    fast, prompt_lp, prompts, ahead, used = run(model_dir, graphs=True, async_scheduling=True)
    assert used and ahead >= 10, (used, ahead)
    for a, b in zip(eager, fast):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompts[2]])).logits[0].float(), -1)
    got = torch.tensor([e.logprob for e in prompt_lp.prompt_logprobs[1:]])
    want = ref[:-1].gather(1, torch.tensor(prompts[2][1:])[:, None])[:, 0]
    assert torch.allclose(got, want, atol=1e-3)
