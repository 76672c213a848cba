"""The decode-time reference rules (`decode_eviction.py`) on hand-made caches, and
`greedy_compressed_decode` against `greedy_compressed` where no decode step evicts."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.references.decode_eviction import H2O, TOVA, StreamingLLM
from tests.references.model_forward import HeadCache, greedy_compressed, greedy_compressed_decode

D = 4


def cache_of(n: int, heads: int = 2) -> HeadCache:
    keys = [torch.arange(n, dtype=torch.float32)[:, None].repeat(1, D) * (h + 1) for h in range(heads)]
    return HeadCache(keys, [k.clone() for k in keys])


def ids(cache: HeadCache, head: int = 0) -> list[int]:
    """Which original tokens survive (keys encode their index)."""
    return [int(x) for x in (cache.keys[head][:, 0] / (head + 1)).tolist()]


def test_streamingllm_keeps_sinks_and_the_newest():
    cache = cache_of(10)
    StreamingLLM(n_sink=2, recent=5).step(0, torch.zeros(2, D), cache)
    assert ids(cache) == [0, 1, 5, 6, 7, 8, 9] and ids(cache, 1) == ids(cache)
    StreamingLLM(n_sink=2, recent=8).step(0, torch.zeros(2, D), cache)  # within budget: untouched
    assert ids(cache) == [0, 1, 5, 6, 7, 8, 9]


def test_tova_drops_the_least_attended_even_the_newest():
    cache = cache_of(4, heads=1)
    cache.keys[0] = torch.tensor([[3.0] * D, [1.0] * D, [2.0] * D, [-5.0] * D])  # newest attends least
    TOVA(budget=3).step(0, torch.ones(2, D), cache)
    assert cache.keys[0][:, 0].tolist() == [3.0, 1.0, 2.0]


def test_h2o_accumulates_and_keeps_heavy_hitters_plus_recent():
    cache = cache_of(5, heads=1)
    q = torch.zeros(2, D)  # uniform attention: every token gets 1/5 this step
    seen = [torch.tensor([[0.5, 0.1, 0.9, 0.2]])]  # the newest token (index 4) has none yet
    h2o = H2O(heavy=2, recent=1, seen=seen)
    h2o.step(0, q, cache)
    # heavy hitters among tokens 0..3 by 0.7, 0.3, 1.1, 0.4: tokens 2 and 0; the newest stays
    assert ids(cache) == [0, 2, 4]
    torch.testing.assert_close(h2o.seen[0], torch.tensor([[0.7, 1.1, 0.2]]))
    assert math.isclose(float(h2o.seen[0].sum()), 2.0, rel_tol=1e-6)


def test_greedy_decode_without_eviction_is_greedy_compressed(tiny_dirs: dict[str, Path]):
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    prompt = torch.randint(3, 300, (20,), generator=torch.Generator().manual_seed(5))
    tokens, logits, lengths = greedy_compressed_decode(model, prompt, 6, "streamingllm", sink=4, recent=100)
    want, want_logits = greedy_compressed(model, prompt, 6, "streamingllm", budget=104, n_sink=4)
    assert tokens.tolist() == want.tolist()
    torch.testing.assert_close(logits, want_logits)
    assert lengths == [[20 + step] * model.config.num_hidden_layers for step in range(1, 6)]
    tokens, _, lengths = greedy_compressed_decode(model, prompt, 6, "streamingllm", sink=4, recent=12)
    assert lengths == [[16] * model.config.num_hidden_layers] * 5
