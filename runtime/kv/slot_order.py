"""Eviction in place: a layer whose slots are not in time order, and the positions that order them.

A decode-time keep that drops a few tokens of a window would, compacting in order, move every kept
token behind them (the whole window, at every step). In place, the kept tokens past the layer's new
length fill the evicted slots below it instead, so an eviction moves at most as many tokens as it
drops, and the page table changes only where pages are freed. Slot order then stops being time
order; a spec whose keep evicts in place (`KVSpec.positions`, chosen by the compiler) stores each
slot's logical position (int32, per KV head, written with the token: `record`), and moves it with
the slot like any per-token tensor. Attention reads a set of keys and does not care; whatever reads
a layer as a sequence (a hook's `last N`, pooling along keys, ties broken by index) reads it in
`order`: the physical slots sorted by position. Plans stay in logical indices, mapped to slots
(`to_slots`) before `fill` carries them out. `settle` puts a layer back in time order (a chain's
turn ends: its pages become the record's, which prefill hooks and pruning read in order). On CUDA
`fill` is one Triton launch (slot_order_triton.py); the torch version here is the CPU path and its
oracle.

docs/design.md, "Eviction in place".
"""

from __future__ import annotations

import numpy as np
import torch

from kvc.runtime.kv import encodings
from kvc.runtime.kv.compaction import _use_triton
from kvc.runtime.transfer import to_device

PAD = torch.iinfo(torch.int32).max  # position of a padding slot: sorts last


def record(plane: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, backend: str = "torch") -> None:
    """The step's tokens' logical `positions [T]` at their `slots [T]` (-1: none, sent to the scratch
    page) of a positions tensor `plane [pages + 1, Hkv, S]`. Graph-safe: no host value. `backend` "triton":
    one launch (runtime/kv/records_triton.py), else in torch."""
    if backend == "triton":
        from kvc.runtime.kv.records_triton import record_positions

        record_positions(plane, slots, positions)
        return
    page_size, scratch = plane.shape[2], plane.shape[0] - 1
    slots = slots.long()
    pages = torch.where(slots >= 0, slots // page_size, scratch)
    plane[pages, :, slots.clamp(min=0) % page_size] = positions.to(plane.dtype)[:, None]


def read_rows(plane: torch.Tensor, tables: np.ndarray, lengths: np.ndarray, pad=PAD) -> torch.Tensor:
    """A per-token plane's values (positions, or a method's state) at slots [0, lengths[n]) of N layers
    `tables [N, W]` (store indices): [N, Hkv, max length], `pad` past each one's length. The tables go
    to the device in one pinned copy. A token tensor `[pages + 1, Hkv, S, *rest]` (dense keys) reads
    the same way, as [N, Hkv, max length, *rest]."""
    page_size, device, rest = plane.shape[2], plane.device, plane.shape[3:]
    lengths = np.asarray(lengths, dtype=np.int64)
    width = int(lengths.max(initial=0))
    if width == 0:
        return torch.full((len(tables), plane.shape[1], 0, *rest), pad, dtype=plane.dtype, device=device)
    pages = -(-width // page_size)
    ids = to_device(np.ascontiguousarray(tables[:, :pages], dtype=np.int64), device)
    slots = torch.arange(width, device=device)
    out = plane[ids[:, slots // page_size], :, slots % page_size].movedim(2, 1)  # [N, Hkv, width, *rest]
    if (lengths == width).all():
        return out
    inside = (slots[None, :] < to_device(lengths, device)[:, None])[:, None, :]
    inside = inside.view(*inside.shape, *([1] * len(rest)))
    return torch.where(inside, out, torch.full_like(out, pad))


def read_rows_in_order(plane: torch.Tensor, tables: np.ndarray, slot_order: torch.Tensor) -> torch.Tensor:
    """`in_order(read_rows(plane, tables, lengths), slot_order)` for N layers of one length n (`slot_order [N,
    Hkv, n]`, each layer's slots in logical order) in one gather: [N, Hkv, n, *rest], entry i of head h the
    slot `slot_order[., h, i]`'s (a stacked decode batch's keys, read once rather than read and reordered)."""
    page_size, device = plane.shape[2], plane.device
    n = slot_order.shape[-1]
    ids = to_device(np.ascontiguousarray(tables[:, : -(-n // page_size)], dtype=np.int64), device)
    slots = slot_order.to(device)
    pages = ids.gather(1, (slots // page_size).flatten(1)).view_as(slots)  # [N, Hkv, n]
    heads = torch.arange(plane.shape[1], device=device)[None, :, None]
    return plane[pages, heads, slots % page_size]


def order(positions: torch.Tensor) -> torch.Tensor:
    """Physical slots in logical order, [..., n] int64, from their positions [..., n] (PAD last)."""
    return torch.sort(positions, dim=-1, stable=True).indices


def orders(plane: torch.Tensor, tables: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """[N, Hkv, max length]: each layer's slots in logical order (padding slots last)."""
    return order(read_rows(plane, tables, lengths))


def in_order(x: torch.Tensor, slot_order: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, n, *rest] (per slot) in logical order: entry i is slot `slot_order[..., h, i]`'s."""
    index = slot_order
    while index.dim() < x.dim():
        index = index.unsqueeze(-1)
    return x.gather(slot_order.dim() - 1, index.expand(*slot_order.shape, *x.shape[slot_order.dim():]))


def to_slots(keep: torch.Tensor, slot_order: torch.Tensor) -> torch.Tensor:
    """A plan's logical indices `keep [N, Hkv, K]` as physical slots (`slot_order [N, Hkv, >= n]`)."""
    return slot_order.gather(2, keep.clamp(min=0, max=max(slot_order.shape[2] - 1, 0)))


def fill(tensors: list[torch.Tensor], keep: torch.Tensor, counts: np.ndarray, lengths: np.ndarray,
         tables: np.ndarray, backend: str = "auto") -> None:
    """Job n keeps the physical slots `keep[n, h, :counts[n]]` (any order) of the `lengths[n]` its table
    `tables[n]` stores, in place: its new length is counts[n], and each kept slot at or past it moves
    into a dropped slot below it (the i-th such in slot order into the i-th hole), in every TOKEN
    tensor [pages + 1, Hkv, S, ...]. Moves max(lengths - counts) slots per head at most, whatever
    the window. `backend` as compaction's: "auto" runs the one-launch Triton kernel on CUDA
    (slot_order_triton.py), "triton" asks for it (CUDA, or TRITON_INTERPRET=1), "torch" runs the
    torch version below (the CPU path and the kernel's oracle)."""
    if _use_triton(backend, keep.device):
        from kvc.runtime.kv.slot_order_triton import fill_triton

        fill_triton(tensors, keep, counts, lengths, tables)
        return
    num, heads, width = keep.shape
    if num == 0:
        return
    device = keep.device
    longest = int(lengths.max())
    dropped = int((lengths - counts).max())
    if dropped <= 0:
        return
    count = to_device(np.asarray(counts, dtype=np.int64), device)
    valid = torch.arange(width, device=device)[None, :] < count[:, None]  # [N, K]
    kept = torch.zeros(num, heads, longest + 1, dtype=torch.bool, device=device)
    kept.scatter_(2, torch.where(valid[:, None, :], keep.clamp(min=0, max=longest), longest), True)
    kept = kept[..., :longest]
    slots = torch.arange(longest, device=device)
    below = (slots[None, :] < count[:, None])[:, None, :]  # [N, 1, L]
    hole, mover = below & ~kept, ~below & kept
    dst, src = (_ranked(mask, slots, dropped) for mask in (hole, mover))  # [N, Hkv, E], -1: none
    _move(tensors, to_device(np.ascontiguousarray(tables, dtype=np.int64), device), src, dst, dst >= 0)


def _ranked(mask: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
    """The slots where `mask [N, Hkv, L]` holds, ascending, in the first columns of [N, Hkv, width] (-1 after)."""
    rank = torch.where(mask, mask.long().cumsum(-1) - 1, width)
    out = torch.full((*mask.shape[:2], width + 1), -1, dtype=torch.long, device=mask.device)
    out.scatter_(2, rank.clamp(max=width), slots.expand_as(rank).where(mask, -1))
    return out[..., :width]


def _move(tensors: list[torch.Tensor], table: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
          moved: torch.Tensor) -> None:
    """Slot src[n, h, i] of job n's layer (table row n) into its slot dst[n, h, i], KV head h, in every
    TOKEN tensor, where `moved`; the sources are read before any is written."""
    heads = torch.arange(src.shape[1], device=src.device)[None, :, None].expand_as(src)
    addresses: dict[tuple[int, int], tuple] = {}  # (page size, scratch page) -> the moves' (page, offset) pairs
    for tensor in tensors:
        raw = encodings.raw(tensor)
        key = (raw.shape[2], raw.shape[0] - 1)
        if key not in addresses:  # every TOKEN tensor of a store shares them: computed once, not per tensor
            addresses[key] = (*_address(table, src, moved, *key), *_address(table, dst, moved, *key))
        sp, so, dp, do = addresses[key]
        raw[dp, heads, do] = raw[sp, heads, so]


def _address(table: torch.Tensor, slots: torch.Tensor, moved: torch.Tensor, page_size: int,
             scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of each job's slots [N, Hkv, E]; the scratch page where nothing moves."""
    slots = slots.clamp(min=0)
    num = slots.shape[0]
    pages = table.gather(1, (slots // page_size).reshape(num, -1)).reshape(slots.shape)
    return torch.where(moved, pages, scratch), slots % page_size


def settle(tensors: list[torch.Tensor], plane: torch.Tensor, tables: np.ndarray, lengths: np.ndarray) -> None:
    """Puts N layers back in time order: slot i of each holds its i-th token by position (every TOKEN
    tensor, the positions among them). Moves whole windows: for the rare reader that needs order in
    the slots themselves."""
    if len(tables) == 0:
        return
    slot_order = orders(plane, tables, lengths)  # [N, Hkv, L]
    longest = slot_order.shape[2]
    if longest == 0:
        return
    positions = torch.arange(longest, device=slot_order.device)
    inside = positions[None, :] < to_device(np.asarray(lengths, dtype=np.int64), plane.device)[:, None]
    if bool((slot_order == positions).all()):
        return  # already in order
    table = to_device(np.ascontiguousarray(tables, dtype=np.int64), plane.device)
    _move(tensors, table, slot_order, positions.expand_as(slot_order), inside[:, None, :].expand_as(slot_order))
