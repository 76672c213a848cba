"""Oracle 1: greedy `LLM.generate` with `full` equals Hugging Face `generate` token for token.

Tiny random Llama / Qwen3 / Qwen3-MoE checkpoints are saved to disk and loaded through kvc's real
loader; prompts of lengths 1..300 are submitted together, with a page size that divides none of
them and prefill chunks forced to 32 tokens so that chunks and decodes mix in one step.
"""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe

NEW_TOKENS = 64
PROMPT_LENGTHS = [1, 7, 33, 61, 100, 150, 217, 300]
PAGE_SIZE = 16

BUILDERS = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3, "qwen3_moe": make_tiny_qwen3_moe}


def random_prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model_dir, prompts, new_tokens=NEW_TOKENS):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module", params=list(BUILDERS))
def model_dir(request, tmp_path_factory):
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def make_llm(model_dir, **overrides):
    options = dict(
        device="cpu",
        dtype="float32",
        page_size=PAGE_SIZE,
        max_num_batched_tokens=64,
        max_prefill_chunk=32,
    )
    options.update(overrides)
    return LLM(str(model_dir), method="full", **options)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_batch_matches_hf(model_dir):
    llm = make_llm(model_dir)
    prompts = random_prompts(PROMPT_LENGTHS, llm.engine.spec.vocab_size, seed=1)
    outputs = llm.generate(prompts, GREEDY)
    expected = hf_greedy(model_dir, prompts)
    for n, out, ref in zip(PROMPT_LENGTHS, outputs, expected):
        assert len(out.token_ids) == NEW_TOKENS
        assert out.token_ids == ref, f"prompt length {n} diverged"
    assert llm.engine.pool.num_free == llm.engine.num_pages


def test_shared_prefix_hits_cache_and_matches_hf(model_dir):
    llm = make_llm(model_dir)
    vocab = llm.engine.spec.vocab_size
    prefix = random_prompts([250], vocab, seed=2)[0]
    first = [prefix + s for s in random_prompts([5, 19, 40], vocab, seed=3)]
    second = [prefix + s for s in random_prompts([3, 27, 51, 9], vocab, seed=4)]
    llm.generate(first, GREEDY)
    hits_before = llm.engine.pool.stats()["hit_tokens"]
    outputs = llm.generate(second, GREEDY)
    assert llm.engine.pool.stats()["hit_tokens"] > hits_before
    assert all(o.num_cached_tokens >= 240 for o in outputs)
    assert [o.token_ids for o in outputs] == hf_greedy(model_dir, second)


def test_preemption_under_small_page_budget_keeps_tokens(model_dir):
    roomy = make_llm(model_dir)
    prompts = random_prompts([90, 130, 70, 110, 120, 100], roomy.engine.spec.vocab_size, seed=5)
    expected = [o.token_ids for o in roomy.generate(prompts, GREEDY)]
    spec = roomy.engine.spec
    page_bytes = 2 * spec.num_layers * spec.num_kv_heads * PAGE_SIZE * spec.head_dim * 4
    # room for about two requests at their full length, so most must wait or be preempted
    tight = make_llm(model_dir, kv_cache_memory=24 * page_bytes, enable_prefix_caching=False)
    assert tight.engine.num_pages == 24 * spec.num_layers  # the pool counts one-layer pages
    outputs = tight.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert tight.engine.pool.num_free == tight.engine.num_pages
    assert tight.engine.scheduler.num_preemptions > 0
