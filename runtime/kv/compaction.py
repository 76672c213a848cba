"""Compaction: applying a method's keep plan to one sequence's pages of one layer.

The kept K/V of each KV head are gathered (each head its own token indices: pages are head-major,
[page, Hkv, slot, D], so heads can keep different tokens in the same slots) and written into the
first ceil(kept / page_size) pages of the layer's table. The scheduler then frees the rest. All
reads happen before any write, so compacting in place is safe. Plain torch (CPU and GPU); a
Triton kernel can replace it later.
"""

from __future__ import annotations

import torch


def compact_layer(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: list[int],
    length: int,
    keep: torch.Tensor,
    checked: bool = True,
) -> int:
    """Keeps tokens `keep [Hkv, kept]` (physical indices < length) of the sequence whose tokens
    sit in `page_ids`; returns `kept`. Pages must be owned by this sequence alone. `checked=False`
    skips the range check of the indices (it reads them back: a device sync per call)."""
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    if keep.dim() != 2 or keep.shape[0] != num_kv_heads:
        raise ValueError(f"keep plan must be [{num_kv_heads}, kept], got {tuple(keep.shape)}")
    kept = keep.shape[1]
    if kept > length or (checked and kept and (int(keep.max()) >= length or int(keep.min()) < 0)):
        raise ValueError(f"keep plan indexes outside the {length} stored tokens")
    if kept == 0:
        return 0
    device = k_cache.device
    pages = torch.tensor(page_ids, dtype=torch.long, device=device)
    keep = keep.to(device=device, dtype=torch.long)
    heads = torch.arange(num_kv_heads, device=device)[:, None].expand_as(keep)
    src_page, src_slot = pages[keep // page_size], keep % page_size  # [Hkv, kept]
    dst = torch.arange(kept, device=device)
    dst_page, dst_slot = pages[dst // page_size][None].expand_as(keep), (dst % page_size)[None].expand_as(keep)
    for cache in (k_cache, v_cache):
        gathered = cache[src_page, heads, src_slot]  # [Hkv, kept, D], a copy
        cache[dst_page, heads, dst_slot] = gathered
    return kept
