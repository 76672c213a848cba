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
    version is. Each (token, head) is one row of the cache seen as [pages * Hkv * page_size, D]
    (pages are head-major), written by `index_copy_`: a row copy, where indexing pages and offsets
    around the head slice took the slow generic path (2.5x the time at a 2K-token chunk).
    """
    _, num_kv_heads, page_size, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    if bool(keep.all()):  # the usual step: no padding, so no masked copies of k and v
        slots = slot_mapping.long()
    else:
        slots, k, v = slot_mapping[keep].long(), k[keep], v[keep]
    heads = torch.arange(num_kv_heads, device=slots.device)
    rows = ((slots // page_size * num_kv_heads)[:, None] + heads[None, :]) * page_size + (slots % page_size)[:, None]
    rows = rows.flatten()  # [n * Hkv], token-major like k
    k_cache.view(-1, head_dim).index_copy_(0, rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim).index_copy_(0, rows, v.reshape(-1, head_dim).to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor, page_ids: torch.Tensor, length: int | None = None
) -> torch.Tensor:
    """Pages `page_ids` [..., n] of one layer's cache as dense [..., Hkv, n * page_size, D].

    `index_select` copies whole pages (a few KB each) where advanced indexing copied element by
    element: 3x faster on the CPU for a 2K-token chunk, 1.6x for a decode batch's tables."""
    ids = page_ids.long()
    pages = cache.index_select(0, ids.flatten()).view(*ids.shape, *cache.shape[1:])  # [..., n, Hkv, S, D]
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

    Rows with context_lens == 0 (CUDA-graph padding) come out as zeros. `kv_starts [B, Hkv]`
    (None: all 0): KV head h of sequence b reads only slots [kv_starts[b, h], context_lens[b])
    (per-head variable counts, stored right-aligned; see `metadata.py`). `max_context_len` bounds
    every row's length (default: everything the block table can address).

    On a GPU all sequences run in one batched SDPA over `max_context_len` keys with a key-padding
    mask, so there is no host sync (CUDA graphs capture it). On the CPU, where reading the lengths
    costs nothing, each row gathers and attends over its own keys only: the batched form copied
    every row's pages up to the longest row and then masked them (half a decode step at batch 8 of
    500-2,000 tokens).
    """
    if q.device.type == "cpu":
        o = _decode_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, out)
    else:
        o = _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts)
    if stats is not None:
        decode_stats_torch(q, k_cache, block_tables, context_lens, scale, stats.out, stats.reduce, stats.fn,
                           kv_starts=kv_starts)
    if out is None or o is out:
        return o
    out.copy_(o)
    return out


def _decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len, kv_starts):
    """paged_decode as one batched SDPA with a key-padding mask (no host value read)."""
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
    return torch.where((context_lens > 0)[:, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))


def _decode_by_row(q, k_cache, v_cache, block_tables, context_lens, scale, kv_starts, out):
    """paged_decode one row at a time over exactly its context_lens[b] keys (host lengths); a mask
    only for a row with per-head starts. Writes into `out` when given."""
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    o = torch.zeros_like(q) if out is None else out
    head_starts = None if kv_starts is None else kv_starts.tolist()
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            o[b] = 0
            continue
        pages = block_tables[b, : -(-length // page_size)]
        keys = gather_kv(k_cache, pages, length)[None].to(q.dtype)  # [1, Hkv, n, D]
        values = gather_kv(v_cache, pages, length)[None].to(q.dtype)
        mask = None
        if head_starts is not None and any(head_starts[b]):  # [1, Hkv, 1, n]
            mask = (torch.arange(length, device=q.device)[None, :] >= kv_starts[b][:, None])[None, :, None, :]
        grouped_q = q[b].reshape(1, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # as in _decode_padded
        row = F.scaled_dot_product_attention(grouped_q, keys, values, attn_mask=mask, scale=scale)
        o[b] = row.reshape(num_q_heads, head_dim)
    return o


def causal_offset_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: the i-th new query sits at position kv_len - q_len + i."""
    positions = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= positions[:, None]


# The CPU flash-attention kernel also returns each query's log-sum-exp, which lets a chunk over a
# cached prefix run as two mask-free calls (`_attend_over_prefix`). Private aten op; without it
# (another build) or off the CPU, the chunk takes one call with its causal mask.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _attend_over_prefix(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of a chunk's queries q [1, Hq, n, D] over keys/values [1, Hkv, m, D] whose last
    n are the chunk's own (query i sees keys 0..m - n + i).

    A boolean mask keeps SDPA from skipping the future half of the chunk and costs a select per
    score, so where the flash kernel is at hand the prefix (every query sees every key) and the
    chunk (plainly causal) are two mask-free calls, merged by their log-sum-exps.
    """
    n, m = q.shape[2], keys.shape[2]
    gqa = q.shape[1] != keys.shape[1]
    if _CPU_FLASH is None or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_offset_mask(n, m, q.device),
                                              scale=scale, enable_gqa=gqa)
    prefix = m - n
    o_prefix, lse_prefix = _CPU_FLASH(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False, scale=scale)
    o_chunk, lse_chunk = _CPU_FLASH(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, True, scale=scale)
    # softmax over both parts = each part's softmax weighted by its share of the total mass
    w_prefix = torch.sigmoid(lse_prefix.float() - lse_chunk.float()).unsqueeze(-1)  # [1, Hq, n, 1]
    return torch.lerp(o_chunk.float(), o_prefix.float(), w_prefix).to(q.dtype)


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

    SDPA gets 4-D inputs ([1, heads, tokens, D]): only those reach the CPU flash kernel (3-D ones
    fall back to the math path, several times slower, that materialises every score). A fresh
    chunk (no cached prefix, every start 0) runs `is_causal`, the call Hugging Face makes; a chunk
    over a cached prefix goes through `_attend_over_prefix`; per-head starts use a mask. A row of
    starts that is all 0 takes the path of no starts, so zero starts stay bit-identical to none.
    """
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[1]
    page_size = k_cache.shape[2]
    gqa = num_q_heads != num_kv_heads
    if out is None:
        out = torch.zeros_like(q)
    starts = cu_seqlens_q.tolist()
    lengths = context_lens.tolist()
    head_starts = None if kv_starts is None else kv_starts.tolist()
    for b, kv_len in enumerate(lengths):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_pages = -(-kv_len // page_size)
        keys = gather_kv(k_cache, block_tables[b, :num_pages], kv_len).to(q.dtype)[None]  # [1, Hkv, L, D]
        values = gather_kv(v_cache, block_tables[b, :num_pages], kv_len).to(q.dtype)[None]
        queries = q[start:end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
        if head_starts is not None and any(head_starts[b]):
            # [Hq, q_len, kv_len]: each query head from its kv head's start
            first = kv_starts[b].repeat_interleave(num_q_heads // num_kv_heads)
            visible = torch.arange(kv_len, device=q.device)[None, None, :] >= first[:, None, None]
            mask = causal_offset_mask(q_len, kv_len, q.device)[None] & visible
            o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[None], scale=scale,
                                               enable_gqa=gqa)
        elif q_len == kv_len:
            o = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            o = _attend_over_prefix(queries, keys, values, scale)
        out[start:end] = o[0].transpose(0, 1)
    return out
