"""Paged attention in plain PyTorch: the CPU backend and the oracle for the Triton kernels.

Sits between the model's attention layers and the paged KV cache (see `metadata.py` for the
layout). Each sequence's keys and values are gathered from its pages into a dense tensor and
attention runs through `torch.nn.functional.scaled_dot_product_attention` in the input dtype, so
that in float32 the engine matches Hugging Face token for token. The generated Triton kernels
(kernels_generated/_attention/, loaded by `triton_ops.py`) implement the same three functions with
the same signatures. `paged_decode(..., stats=)` also computes the decode statistics a method
reads (`decode_stats.decode_stats_torch`, the oracle of the kernels that emit them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvc.runtime.attention.decode_stats import decode_stats_torch
from kvc.runtime.attention.metadata import DecodeStats


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values k, v [T, Hkv, D] into their slots; slot -1 writes nothing.

    Uses a boolean mask (one host sync), so this path is not CUDA-graph capturable; the Triton
    version is.
    """
    page_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    pages, offsets = slots // page_size, slots % page_size
    # Advanced indices around a slice: the indexed view is [n, Hkv, D], matching k[keep].
    k_cache[pages, :, offsets] = k[keep].to(k_cache.dtype)
    v_cache[pages, :, offsets] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, page_ids: torch.Tensor, length: int | None = None
) -> torch.Tensor:
    """Pages `page_ids` [..., n] of one layer's cache as dense [..., Hkv, n * page_size, D]."""
    pages = cache[page_ids.long()]  # [..., n, Hkv, S, D]
    pages = pages.movedim(-3, -4)  # [..., Hkv, n, S, D]
    dense = pages.flatten(-3, -2)  # [..., Hkv, n * S, D]
    return dense if length is None else dense[..., :length, :]


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
    stats: DecodeStats | None = None,
) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D], over its first context_lens[b] cached tokens;
    `stats` (metadata.py) also asks for the step's attention statistics (into `stats.out`).

    All sequences run in one batched SDPA over `max_context_len` keys (an upper bound; default:
    everything the block table can address) with a key-padding mask, so there is no host sync.
    Rows with context_lens == 0 (CUDA-graph padding) come out as zeros. `kv_starts [B, Hkv]`
    (None: all 0): KV head h of sequence b reads only slots [kv_starts[b, h], context_lens[b])
    (per-head variable counts, stored right-aligned; see `metadata.py`).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * page_size
    max_context_len = max(int(max_context_len), 1)
    num_pages = min(-(-max_context_len // page_size), block_tables.shape[1])
    length = min(max_context_len, num_pages * page_size)

    page_ids = block_tables[:, :num_pages]
    keys = gather_kv(k_cache, page_ids, length)  # [B, Hkv, L, D]
    values = gather_kv(v_cache, page_ids, length)
    slots = torch.arange(length, device=q.device)
    valid = slots[None, :] < context_lens[:, None]  # [B, L]
    if kv_starts is None:
        mask = valid[:, None, None, :]
    else:  # [B, Hkv, 1, L]: each kv head from its own start
        mask = (valid[:, None, :] & (slots[None, None, :] >= kv_starts[:, :, None]))[:, :, None, :]

    # The query heads of one GQA group become the "query length" axis of their kv head: the same
    # q.k dot products as repeating K/V per query head, without the copy.
    grouped_q = q.reshape(batch, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(
        grouped_q, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
    )
    o = o.reshape(batch, num_q_heads, head_dim)
    o = torch.where((context_lens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    if stats is not None:
        decode_stats_torch(q, k_cache, block_tables, context_lens, scale, stats.out, stats.reduce, stats.fn,
                           kv_starts=kv_starts)
    if out is None:
        return o
    out.copy_(o)
    return out


def causal_offset_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: the i-th new query sits at position kv_len - q_len + i."""
    positions = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= positions[:, None]


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    kv_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention for prefill chunks, q [Tq, Hq, D] in varlen layout (see cu_seqlens_q).

    Sequence b's chunk holds the last q_len of its context_lens[b] tokens, whose K/V are already
    in the cache; query at position p sees keys 0..p (from kv_starts[b, h] on for KV head h when
    `kv_starts [B, Hkv]` is given). One SDPA per sequence (the lengths go to the host once).
    """
    num_q_heads = q.shape[1]
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    for b, kv_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        keys = gather_kv(k_cache, block_tables[b, :num_pages], kv_len).to(q.dtype)
        values = gather_kv(v_cache, block_tables[b, :num_pages], kv_len).to(q.dtype)
        mask = causal_offset_mask(q_len, kv_len, q.device)
        if kv_starts is not None:  # [Hq, q_len, kv_len]: each query head from its kv head's start
            head_starts = kv_starts[b].repeat_interleave(num_q_heads // num_kv_heads)
            mask = mask[None] & (torch.arange(kv_len, device=q.device)[None, None, :] >= head_starts[:, None, None])
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1),  # [Hq, q_len, D]
            keys,
            values,
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )
        out[start:end] = o.transpose(0, 1)
    return out
