"""State planes: a method's per-token state stored in pages beside K/V, addressed like them.

A method whose decode hook keeps per-token state (H2O's `seen [kv_head, key]`) lists one float32
per-token tensor per state in its KV spec (runtime/kv/spec.py `state_plane`); the KV store then
holds one `[num_pages + 1, Hkv, page_size]` tensor per name. Slot s of a sequence's layer sits in
page `table[s // page_size]` at offset `s % page_size`, exactly where its K/V sit, so the state
scales with the stored tokens (not with max_model_len x max_num_seqs), is freed with the pages,
shared and copied with them (copy-on-write, chain records), and moved with them by the executor's
compaction. The extra last page is scratch: batched writes send the padding of a batch there, so
a captured graph writes with static shapes and never touches a page it does not own.

Two kinds of access:
- host-side, one sequence's layer (eager code: prefill end, step end, chain resume): `read` /
  `write` the dense `[Hkv, n]` state of slots [0, n);
- batched, graph-safe (`BatchSlots`): where slot w of each decode row lives, for w < W (the
  decode statistics' width), from the step's device tables and lengths alone: no host value, no
  sync, static shapes. `gather` gives `[B, Hkv, W]`, `scatter` writes it back (padding to scratch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.transfer import to_device

DTYPE = torch.float32


def _slots(plane: torch.Tensor, page_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    page_size = plane.shape[2]
    if len(page_ids) * page_size < n:
        raise ValueError(f"{len(page_ids)} pages of {page_size} slots cannot hold {n} tokens")
    slots = torch.arange(n, device=plane.device)
    pages = to_device(page_ids, plane.device, torch.long)
    return pages[slots // page_size], slots % page_size


def read(plane: torch.Tensor, page_ids: list[int], n: int) -> torch.Tensor:
    """The state of slots [0, n) of one sequence's layer: [Hkv, n] float32 (a copy)."""
    pages, offsets = _slots(plane, page_ids, n)
    return plane[pages, :, offsets].transpose(0, 1)


def write(plane: torch.Tensor, page_ids: list[int], values: torch.Tensor) -> None:
    """Stores `values [Hkv, n]` into slots [0, n) of one sequence's layer."""
    pages, offsets = _slots(plane, page_ids, values.shape[1])
    plane[pages, :, offsets] = values.to(device=plane.device, dtype=DTYPE).transpose(0, 1)


@dataclass(frozen=True)
class BatchSlots:
    """Where slot w of decode row b lives, for every (b, w < W): `pages [B, W]` (the scratch page
    where w >= the row's length) and `offsets [B, W]`. Built on the device from the step's tables
    and lengths: CUDA-graph safe."""

    pages: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, block_tables: torch.Tensor, lengths: torch.Tensor, width: int, page_size: int,
           scratch_page: int) -> BatchSlots:
        device = block_tables.device
        slots = torch.arange(width, device=device)
        column = (slots // page_size).clamp(max=block_tables.shape[1] - 1)
        pages = block_tables.long().index_select(1, column)  # [B, W]
        inside = slots[None, :] < lengths.to(device).long()[:, None]
        pages = torch.where(inside, pages, torch.full_like(pages, scratch_page))
        return cls(pages, (slots % page_size).expand_as(pages))

    def flat(self, page_size: int) -> torch.Tensor:
        """[B, W] int64: each slot's place in the store, `page * page_size + offset` (a slot mapping's)."""
        return self.pages * page_size + self.offsets

    def gather(self, plane: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, W]: the plane's values at the rows' slots (scratch values past a row's length)."""
        return plane[self.pages, :, self.offsets].permute(0, 2, 1)

    def scatter(self, plane: torch.Tensor, values: torch.Tensor) -> None:
        """Writes `values [B, Hkv, W]` at the rows' slots (past a row's length: into scratch)."""
        plane[self.pages, :, self.offsets] = values.permute(0, 2, 1).to(DTYPE)
