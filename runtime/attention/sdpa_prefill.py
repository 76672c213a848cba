"""Prefill chunks through the framework's fused attention: cuDNN's on Hopper (docs/design.md, "Prefill
attention").

For a layer that stores K/V dense in the model's dtype (the `plain` spec: `full`, and every eviction
method's store before its keep), a prefill chunk needs no paged kernel:
- a fresh chunk (no cached prefix) attends over its own k, v as computed, which are exactly what its
  pages hold: the pages are not read at all;
- a chunk over a cached prefix gathers its sequence's pages into one dense K and V (a copy: about 1%
  of the attention's time at 8K-token chunks) and runs the prefix with no mask and the chunk causally,
  merged by their log-sum-exps (`torch_ops.attend_chunk`).
SDPA's backends are tried cuDNN first (`sdpa_kernel(..., set_priority=True)`), then flash, then
memory-efficient. Per-head start slots and other storage (codes, low rank, residual windows) keep the
paged kernels. Which path a prefill takes is the engine's `prefill_attention` (`--prefill-attention`);
bench/prefill_attention_bench.py times both against cuDNN on contiguous K/V.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvc.runtime.attention.torch_ops import attend_chunk, gather_kv

ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# A chunk longer than this many tokens attends in query blocks of it (0: one call). cuDNN's causal kernel
# loses rate on long sequences (H100: 557 TFLOP/s over 128K tokens in one call, 584 in blocks of 32K, 585 of
# 16K), while a 32K chunk in blocks of 16K loses 2-3% (32/8 heads): docs/benchmarks.md, "Prefill attention in
# query blocks".
QUERY_BLOCK = 32768


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens: list[int], context_lens: list[int], scale: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the prefill chunks q [Tq, Hq, D] (varlen: host offsets `cu_seqlens`, host
    lengths `context_lens`, the chunk the last tokens of each); k, v [Tq, Hkv, D]: the chunks' own keys
    and values, already stored in the dense caches [P, Hkv, S, D] over `block_tables` [B, pages].
    Returns [Tq, Hq, D]: written into `out` where given; without it, one fresh chunk's is SDPA's own output
    (no copy: cuDNN writes it in q's token-major layout)."""
    page_size = k_cache.shape[2]
    rows = [(b, cu_seqlens[b], cu_seqlens[b + 1], n) for b, n in enumerate(context_lens)
            if cu_seqlens[b + 1] > cu_seqlens[b]]
    with sdpa_kernel(ORDER, set_priority=True):
        if out is None and len(rows) == 1:  # one row holds all of q: its attention is the result
            b, _, _, kv_len = rows[0]
            return _attend(q, k, v, k_cache, v_cache, block_tables[b], kv_len, page_size, scale)
        if out is None:
            out = q.new_empty(q.shape)
        for b, start, end, kv_len in rows:
            out[start:end] = _attend(q[start:end], k[start:end], v[start:end], k_cache, v_cache, block_tables[b],
                                     kv_len, page_size, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            table: torch.Tensor, kv_len: int, page_size: int, scale: float) -> torch.Tensor:
    """One sequence's chunk q [n, Hq, D] over its `kv_len` tokens, the last n its own k, v [n, Hkv, D]:
    [n, Hq, D]."""
    n = q.shape[0]
    if n == kv_len:  # a fresh chunk: its own k, v
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    else:
        pages = table[:-(-kv_len // page_size)]
        keys, values = (gather_kv(cache, pages, kv_len)[None] for cache in (k_cache, v_cache))
    return attend_chunk(q.transpose(0, 1)[None], keys, values, scale, block=QUERY_BLOCK)[0].transpose(0, 1)
