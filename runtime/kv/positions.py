"""Position maps: the logical position of every stored slot of one layer, per KV head.

A chain's pages stop equalling its logical tokens once a method compacts them, yet pruning a
message (runtime/chain_prune.py) must find the slots that hold its tokens, and a rollback must
know whether the tokens it cuts are still stored in order. A position map answers both.

Representation (cheap where nothing was compacted): `head` is an int32 tensor [Hkv, P] on the
cache's device, the logical positions of slots [0, P) (entries before a head's start slot are
padding: -1); the slots from P on hold consecutive logical tokens that end at the layer's logical
length. So with `length` stored slots and `logical` tokens, slot s >= P holds token
`logical - length + s`. `head` None means P = 0: the layer is stored verbatim (after its
history gap). Maps are never changed in place (a fork shares its source's tensors); every
operation returns a new map.

Only chained sequences carry maps (`Sequence.positions`): a plain request pays nothing.
"""

from __future__ import annotations

import torch

PAD = -1


def full_map(head: torch.Tensor | None, length: int, logical: int, num_kv_heads: int,
             device: torch.device) -> torch.Tensor:
    """[Hkv, length] int64: the logical position of each stored slot (padding: -1)."""
    explicit = 0 if head is None else head.shape[1]
    if explicit > length:
        raise ValueError(f"position map covers {explicit} slots, more than the {length} stored")
    tail = torch.arange(logical - length + explicit, logical, device=device, dtype=torch.int64)
    tail = tail.expand(num_kv_heads, -1)
    if head is None or explicit == 0:
        return tail.clone()
    return torch.cat([head.to(device=device, dtype=torch.int64), tail], dim=1)


def compact_map(head: torch.Tensor | None, length: int, logical: int, keep: torch.Tensor,
                counts: list[int], physical: int) -> torch.Tensor:
    """The map after a keep plan: head h keeps slots `keep[h, :counts[h]]`, right-aligned below
    `physical` (the compaction layout of runtime/kv/compaction.py)."""
    num_kv_heads = keep.shape[0]
    full = full_map(head, length, logical, num_kv_heads, keep.device)
    keep = keep.to(torch.int64)
    if all(c == physical for c in counts):
        return full.gather(1, keep[:, :physical]).to(torch.int32)
    out = torch.full((num_kv_heads, physical), PAD, dtype=torch.int64, device=keep.device)
    for h, count in enumerate(counts):
        if count:
            out[h, physical - count:] = full[h, keep[h, :count]]
    return out.to(torch.int32)


def truncate_map(head: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The map after the newest stored slots past `length` are dropped (a rollback cuts a
    verbatim tail, so the slots that remain keep their positions)."""
    if head is None or head.shape[1] <= length:
        return head
    return head[:, :length]


def tail_is_verbatim(full: torch.Tensor, starts: list[int] | None, length: int, cut_from: int,
                     logical: int) -> bool:
    """Whether the tokens [cut_from, logical) are exactly the last `logical - cut_from` stored slots
    of every head, in order, and no other slot holds a token at or past `cut_from` (so dropping
    those slots rolls the layer back to `cut_from` tokens)."""
    drop = logical - cut_from
    if drop == 0:
        return True
    starts = starts or [0] * full.shape[0]
    if any(length - drop < s for s in starts):
        return False
    want = torch.arange(cut_from, logical, device=full.device, dtype=full.dtype)
    if not bool((full[:, length - drop:] == want).all()):
        return False
    return bool((full[:, : length - drop] < cut_from).all())
