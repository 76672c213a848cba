"""Keys read where the KV store keeps them: a decode batch's rows of one layer as a fused score reads them
(runtime/primitives/triton_primitives.py `column_votes`), through their page tables and, for a layer evicted in
place, its slot order (runtime/kv/slot_order.py), with no gathered copy. Triton-free, so the engine builds it
on any machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedKeys:
    """Keys of G rows of one layer where the store keeps them, as `column_votes` reads them: row g's KV head h
    is key row g * Hkv + h of `shape` [G * Hkv, length, D]; its logical key i is the slot `order[g, h, i]`
    (`order` None: slot i), slot s sits at page `tables[g, s // S]`, position s % S of `plane [pages + 1, Hkv,
    S, stored D]` (D <= stored D: the first channels, `Dense.channels`)."""

    plane: torch.Tensor
    tables: torch.Tensor  # [G, W] int64 on the plane's device
    order: torch.Tensor | None  # [G, Hkv, length] int64, or None
    length: int
    head_dim: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.tables.shape[0] * self.plane.shape[1], self.length, self.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.plane.dtype

    @property
    def device(self) -> torch.device:
        return self.plane.device

    def args(self) -> tuple:
        """The kernels' key arguments after the key pointer: tables, order, their strides and the plane's."""
        if self.plane.dim() != 4 or self.plane.stride(3) != 1:
            raise ValueError(f"paged keys need a plane [pages + 1, Hkv, S, D] with contiguous channels, got "
                             f"shape {tuple(self.plane.shape)} strides {self.plane.stride()}")
        order = self.tables if self.order is None else self.order.contiguous()  # (unread without ORDERED)
        stride_page, stride_head, stride_slot = self.plane.stride()[:3]
        return (self.tables, order, self.tables.stride(0), stride_page, stride_head, stride_slot)

    def constants(self) -> dict:
        return {"PAGED": True, "ORDERED": self.order is not None, "KV_HEADS": self.plane.shape[1],
                "PAGE": self.plane.shape[2]}
