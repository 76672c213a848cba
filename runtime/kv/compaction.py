"""Compaction: applying a method's keep plan to one sequence's pages of one layer.

The kept K/V of each KV head are gathered (each head its own token indices: pages are head-major,
[page, Hkv, slot, D], so heads can keep different tokens in the same slots) and written into the
first ceil(M / page_size) pages of the layer's table, M being the layer's new physical length.
The scheduler then frees the rest. All reads happen before any write, so compacting in place is
safe. Plain torch (CPU and GPU); a Triton kernel can replace it later.

Equal counts: every head's kept tokens fill slots [0, kept). Per-head variable counts (`lengths`):
M = max_h len_h and head h's tokens are stored right-aligned in slots [M - len_h, M), so new
tokens keep appending at the common slot M for every head; the caller records the start slots
M - len_h (runtime/attention/metadata.py) and the kernels skip the slots before them.
"""

from __future__ import annotations

import torch


def compact_layer(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: list[int],
    length: int,
    keep: torch.Tensor,
    lengths: torch.Tensor | None = None,
    checked: bool = True,
) -> int:
    """Keeps tokens `keep [Hkv, kept]` (physical indices < length) of the sequence whose tokens
    sit in `page_ids`; with `lengths [Hkv]` head h keeps only `keep[h, :lengths[h]]`. Returns the
    layer's new physical length M (`kept`, or max(lengths)). Pages must be owned by this
    sequence alone. `checked=False` skips the range check of equal-count plans (it reads the
    indices back: a device sync per call); per-head plans are always checked."""
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    if keep.dim() != 2 or keep.shape[0] != num_kv_heads:
        raise ValueError(f"keep plan must be [{num_kv_heads}, kept], got {tuple(keep.shape)}")
    device = k_cache.device
    kept = keep.shape[1]
    keep = keep.to(device=device, dtype=torch.long)
    if lengths is None:
        return _compact_equal(k_cache, v_cache, page_ids, length, keep, checked)
    lengths = lengths.to(device=device, dtype=torch.long)
    if lengths.shape != (num_kv_heads,) or bool((lengths < 0).any()) or bool((lengths > kept).any()):
        raise ValueError(f"keep plan lengths must be [{num_kv_heads}] counts in [0, {kept}], got {lengths.tolist()}")
    valid = torch.arange(kept, device=device)[None, :] < lengths[:, None]  # [Hkv, kept]
    src = keep[valid]  # head-major: head 0's tokens, then head 1's, ...
    if src.numel() and (int(src.max()) >= length or int(src.min()) < 0):
        raise ValueError(f"keep plan indexes outside the {length} stored tokens")
    physical = int(lengths.max()) if num_kv_heads else 0
    if physical > length:
        raise ValueError(f"keep plan keeps {physical} tokens of a head, more than the {length} stored")
    if src.numel() == 0:
        return physical
    pages = torch.tensor(page_ids, dtype=torch.long, device=device)
    heads = torch.arange(num_kv_heads, device=device)[:, None].expand_as(keep)[valid]
    dst = ((physical - lengths)[:, None] + torch.arange(kept, device=device)[None, :])[valid]
    src_page, src_slot = pages[src // page_size], src % page_size
    dst_page, dst_slot = pages[dst // page_size], dst % page_size
    for cache in (k_cache, v_cache):
        gathered = cache[src_page, heads, src_slot]  # [n, D], a copy
        cache[dst_page, heads, dst_slot] = gathered
    return physical


def _compact_equal(k_cache, v_cache, page_ids: list[int], length: int, keep: torch.Tensor, checked: bool) -> int:
    """Every head keeps `kept` tokens into slots [0, kept): no host reads unless `checked`."""
    num_kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    kept = keep.shape[1]
    if kept > length or (checked and kept and (int(keep.max()) >= length or int(keep.min()) < 0)):
        raise ValueError(f"keep plan indexes outside the {length} stored tokens")
    if kept == 0:
        return 0
    device = k_cache.device
    pages = torch.tensor(page_ids, dtype=torch.long, device=device)
    heads = torch.arange(num_kv_heads, device=device)[:, None].expand_as(keep)
    src_page, src_slot = pages[keep // page_size], keep % page_size  # [Hkv, kept]
    dst = torch.arange(kept, device=device)
    dst_page, dst_slot = pages[dst // page_size][None].expand_as(keep), (dst % page_size)[None].expand_as(keep)
    for cache in (k_cache, v_cache):
        gathered = cache[src_page, heads, src_slot]  # [Hkv, kept, D], a copy
        cache[dst_page, heads, dst_slot] = gathered
    return kept
