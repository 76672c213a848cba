"""Helpers for the chain-cache tests: a tiny engine per method, turns, and the page books.

`check_books(engine)` is the no-leak invariant: the pool's own books balance, and every page's
reference count is exactly the number of page-table entries that running sequences and chain
records hold (the prefix cache holds no references: its pages wait at count 0).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from kvc.runtime.chains import ChainSpec
from kvc.runtime.llm import LLM, RequestOutput
from kvc.runtime.sampling_params import SamplingParams

PAGE_BYTES = 2 * 2 * 16 * 4 * 4  # K and V, 2 KV heads, head_dim 16, float32, 4-token pages

# served method -> method_params that compress the test prompts (40-60 tokens) at prefill end
METHODS: dict[str, dict[str, Any]] = {
    "full": {},
    "streamingllm": {"sink": 2, "recent": 14},
    "snapkv": {"budget": 20, "window": 6, "kernel": 3},
    "pyramidkv": {"budget": 20, "window": 6, "kernel": 3, "beta": 2},
    "h2o": {"heavy": 0.2, "recent": 0.2},
    "tova": {"budget": 16},
    "adakv": {"budget": 20, "window": 6, "kernel": 3},
}


def make_llm(model_dir: Path, method: str, params: dict[str, Any] | None = None, **options: Any) -> LLM:
    defaults = {"device": "cpu", "dtype": "float32", "page_size": 4, "attention_backend": "torch",
                "max_num_batched_tokens": 4096, "kv_cache_memory": 1024 * PAGE_BYTES}
    return LLM(str(model_dir), method=method, method_params=params or None, **{**defaults, **options})


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def turn(llm: LLM, prompt: list[int], steps: int, spec: ChainSpec | None) -> RequestOutput:
    out = llm.generate(prompt, greedy(steps), chain=spec)[0]
    check_books(llm.engine)
    return out


def check_books(engine) -> None:
    pool = engine.pool
    pool.check_invariants()
    held = Counter(p for s in engine.scheduler.running for table in s.page_tables for p in table)
    held += Counter(p for s in engine.scheduler.running for p in s.spare_pages)
    held += engine.chains.references()
    for page in range(pool.num_pages):
        assert pool.ref_count(page) == held[page], f"page {page}: {pool.ref_count(page)} refs, held {held[page]}"


def stored_lengths(engine, chain_id: str) -> list[int]:
    return list([r for r in engine.chains.records() if r.chain_id == chain_id][0].kv_lens)
