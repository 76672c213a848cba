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


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, cu_seqlens: list[int], context_lens: list[int], scale: float,
                 out: torch.Tensor) -> torch.Tensor:
    """Causal attention of the prefill chunks q [Tq, Hq, D] (varlen: host offsets `cu_seqlens`, host
    lengths `context_lens`, the chunk the last tokens of each) into `out` [Tq, Hq, D]; k, v [Tq, Hkv, D]:
    the chunks' own keys and values, already stored in the dense caches [P, Hkv, S, D] over
    `block_tables` [B, pages]."""
    page_size = k_cache.shape[2]
    with sdpa_kernel(ORDER, set_priority=True):
        for b, kv_len in enumerate(context_lens):
            start, end = cu_seqlens[b], cu_seqlens[b + 1]
            if end == start:
                continue
            if end - start == kv_len:  # a fresh chunk: its own k, v
                keys, values = k[start:end].transpose(0, 1)[None], v[start:end].transpose(0, 1)[None]
            else:
                pages = block_tables[b, :-(-kv_len // page_size)]
                keys, values = (gather_kv(cache, pages, kv_len)[None] for cache in (k_cache, v_cache))
            queries = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
            out[start:end] = attend_chunk(queries, keys, values, scale)[0].transpose(0, 1)
    return out
