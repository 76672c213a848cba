"""Served methods vs the hand-written references (issue 4, acceptance 1): per layer and KV head the
same kept tokens, and the same next-token logits within 1e-4 relative, float32 on CPU.

The engine is the one users get (`LLM(model, method=..., method_params=...)`, kernels_generated
through the generic adapter); `tests/runtime/served.py` records the `KeepPlan` its method returns
at prefill end and the logits its sampler sees. The oracle is `tests/references/`: the prompt's
post-RoPE q/k/v from a Hugging Face forward, the paper's ranking (`eviction.rank`), and decoding
over the kept K/V (`model_forward.decode`) fed the engine's own first token. Compared:
- kept: `compare.assert_same_kept` (equal, or a different choice among near-ties only);
- logits: row 0 (the full-attention prefill) and row 1, the first decode step, which reads the
  compressed cache of every layer. Later rows are left out: the references compress at prefill end
  only, and decode-time evictions (streamingllm, tova, h2o) would start to act from there.

Grid: tiny Llama (8 query heads over 2 KV heads) and Qwen3 (4 over 2, q/k norms), 4 layers (so
PyramidKV's schedule slopes); prompts of 37, 101 and 211 tokens in one batch; pages of 4 and 16
tokens (none divides a prompt); each prompt in one step, or in chunks of at most 20 under a
64-token step budget (so chunks split SnapKV's 16-query window, the 101-token prompt ends with a
1-token chunk, and decodes share steps with prefill chunks). Every budget compresses every prompt.

PyramidKV: `methods/pyramidkv.kvm` follows KVCache-Factory's integer schedule, so its reference is
`pyramidkv_factory` (`eviction.kvcache_factory_budgets`), not kvpress's real-valued one.
H2O: kvc's `heavy` and `recent` are fractions of the prompt (floored), the reference's `budget`
and `recent` token counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from kvc.runtime.methods import resolve_method
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.compare import assert_logits_close, assert_same_kept
from tests.references.eviction import gather_kv, kvcache_factory_budgets, rank
from tests.references.model_forward import HeadCache, LayerPrompt, decode, prefill
from tests.runtime.served import make_llm, serve

LENGTHS = [37, 101, 211]
PAGE_SIZES = [4, 16]
CHUNKS = {"one-step-prefill": None, "chunks-of-20": 20}
STEPS = 2  # the prefill's token and the first decode step's

Reference = Callable[[int], tuple[str, dict[str, Any]]]  # prompt length -> (method, params)
# served method -> (its method_params, the reference configured to the same semantics)
METHODS: dict[str, tuple[dict[str, Any], Reference]] = {
    "streamingllm": ({"sink": 4, "recent": 20}, lambda n: ("streamingllm", {"budget": 24, "n_sink": 4})),
    "snapkv": ({"budget": 28, "window": 16, "kernel": 5},
               lambda n: ("snapkv", {"budget": 28, "window": 16, "kernel": 5, "pool": "avg"})),
    "pyramidkv": ({"budget": 24, "window": 8, "kernel": 5, "beta": 2},
                  lambda n: ("pyramidkv_factory", {"budget": 24, "window": 8, "kernel": 5, "pool": "avg", "beta": 2})),
    "tova": ({"budget": 20}, lambda n: ("tova", {"budget": 20})),
    "h2o": ({"heavy": 0.3, "recent": 0.1},
            lambda n: ("h2o", {"budget": math.floor(0.3 * n) + math.floor(0.1 * n), "recent": math.floor(0.1 * n)})),
}


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


PROMPTS = prompts_of(LENGTHS, seed=21)


class Oracle:
    """One tiny checkpoint, its Hugging Face model, and each prompt's reference prefill (cached)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._prefills: dict[tuple[int, ...], tuple[list[LayerPrompt], torch.Tensor]] = {}

    def prefill(self, prompt: list[int]) -> tuple[list[LayerPrompt], torch.Tensor]:
        key = tuple(prompt)
        if key not in self._prefills:
            self._prefills[key] = prefill(self.hf, torch.tensor(prompt))
        return self._prefills[key]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def oracle(request, tmp_path_factory) -> Oracle:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return Oracle(make_tiny_llama(root, seed=1, num_hidden_layers=4, num_attention_heads=8))
    return Oracle(make_tiny_qwen3(root, seed=2, num_hidden_layers=4))


@pytest.mark.parametrize("chunk", CHUNKS.values(), ids=CHUNKS.keys())
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_kept_tokens_and_logits_match_the_reference(oracle: Oracle, method: str, page_size: int, chunk) -> None:
    params, reference = METHODS[method]
    llm = make_llm(oracle.model_dir, method, params, page_size=page_size, chunk=chunk)
    for served in serve(llm, PROMPTS, STEPS):
        length = len(served.prompt)
        ref_method, ref_params = reference(length)
        layers, prompt_logits = oracle.prefill(served.prompt)
        caches = []
        for layer, t in enumerate(layers):
            ranking = rank(ref_method, t.q, t.k, layer=layer, num_layers=len(layers), **ref_params)
            where = f"{method}, {length}-token prompt, layer {layer}"
            assert ranking.count < length, f"{where}: the budget must compress"
            assert_same_kept(ranking, served.kept_heads(layer), where=where)
            caches.append(HeadCache(*gather_kv(t.k, t.v, list(ranking.kept()))))
        decoded = decode(oracle.hf, caches, torch.tensor(served.tokens[:-1]), start=length)
        want = torch.cat([prompt_logits[-1:], decoded])
        assert_logits_close(served.logits, want, where=f"{method}, {length}-token prompt")


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(2, 6000),
    num_layers=st.integers(2, 48),
    window=st.integers(1, 64),
    extra=st.integers(1, 3000),
    beta=st.integers(1, 40),
)
def test_compiled_pyramidkv_schedule_is_kvcache_factorys(
    length: int, num_layers: int, window: int, extra: int, beta: int
) -> None:
    """The generated per-layer budget (what the adapter's budget admits by; the kept counts of the
    served runs above show the plans follow it) is the hand-written schedule."""
    from kvc.kernels_generated.pyramidkv import hooks

    budget = window + extra
    params = {**hooks.DEFAULTS, "budget": budget, "window": window, "beta": beta}
    want = kvcache_factory_budgets(length, num_layers=num_layers, budget=budget, window=window, beta=beta)
    got = [min(length, hooks.kept_tokens(length, layer, num_layers, 2, params)) for layer in range(num_layers)]
    assert got == [min(length, b) for b in want]


def test_pyramidkv_budget_of_a_one_layer_model() -> None:
    """One layer: no step between layers (KVCache-Factory and kvpress alike), not a division by zero."""
    method = resolve_method("pyramidkv", {"budget": 24, "window": 8})
    method.bind(1, 2)
    assert method.budget.kept(100, 0) == min(100, kvcache_factory_budgets(100, num_layers=1, budget=24, window=8)[0])
