"""A layer's DeltaKV cache in the store (runtime/kv/spec.py `Delta`): writing a step's tokens,
compressing a block, and reading positions back (the torch path; docs/design.md, "DeltaKV").

One sequence's layer holds, after `length` stored tokens (`Delta.compressed(length)` = c of them
past the sinks compressed): positions [0, sink) raw in its row's `sinks`; [sink, sink + c) as
codes (`latent`, `neighbours`), the centers among them raw in their pages' `centers` rows; [sink +
c, length) raw in its row's `window` (slot s at `s % (2 recent)`). Keys are stored before RoPE, so
slot s is position s (no keep plan moves them).

A step's tokens are read as computed by the step itself, and enter the store after its attention
(`DeltaPages.store`): raw into the sinks or the window, then the block that is now due is
compressed (`runtime/kv/delta.py`: centers, references over every center of the sequence at or
before a token, codes). `read` decodes any stored positions: raw where they are raw, else `ref +
code @ up^T + bias`, keys rotated to their positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.kv import delta, lowrank
from kvc.runtime.kv.spec import Delta


@dataclass
class DeltaPages:
    """One layer's view of a delta store's tensors: `latent [P, Hkv, S, c]`, `neighbours [P, Hkv, S, ceil(count /
    Hkv)]` int32 (each head its share), `centers [P, Hkv, S / every, 2 D]`, `sinks [R, Hkv, sink, 2 D]` (None: no
    sinks), `window [R, Hkv, 2 recent, 2 D]`, `down`, `up` [Hkv, 2 D, C], `bias` [Hkv, 2 D] (or None), and the model's
    RoPE frequencies."""

    enc: Delta
    latent: torch.Tensor
    neighbours: torch.Tensor
    centers: torch.Tensor
    sinks: torch.Tensor | None
    window: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    bias: torch.Tensor | None
    inv_freq: torch.Tensor

    def __post_init__(self) -> None:
        heads = self.latent.shape[1]
        if self.neighbours.shape[-1] != self.enc.share(heads):
            raise ValueError(f"delta neighbours: {heads} KV heads hold ceil({self.enc.count} / {heads}) = "
                             f"{self.enc.share(heads)} each, got {self.neighbours.shape[-1]}")

    @property
    def page_size(self) -> int:
        return self.latent.shape[2]

    def _neighbours(self, pages: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """[m, count] int64: the neighbours of the tokens at (pages, offsets), every head's share side by side."""
        return self.neighbours[pages, :, offsets].reshape(pages.shape[0], -1)[:, :self.enc.count].long()

    @property
    def head_dim(self) -> int:
        return self.window.shape[-1] // 2

    @property
    def dtype(self) -> torch.dtype:
        return self.window.dtype

    # ---- raw vectors by position ---------------------------------------------------------------
    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size = self.page_size
        return table.long()[positions // size], positions % size

    def raw(self, table: torch.Tensor, row: int, positions: torch.Tensor, length: int) -> torch.Tensor:
        """[n, Hkv, 2 D] the raw vectors of `positions`, each a sink, a center or in the raw tail of a
        sequence that stores `length` tokens (anything else: zeros)."""
        enc, heads = self.enc, self.window.shape[1]
        out = self.window.new_zeros(positions.shape[0], heads, 2 * self.head_dim)
        tail = enc.sink + enc.compressed(length)
        is_sink = positions < enc.sink
        in_tail = positions >= tail
        center = ~is_sink & ~in_tail & delta.is_center(positions, enc.sink, enc.every)
        if is_sink.any():
            out[is_sink] = self.sinks[row, :, positions[is_sink]].transpose(0, 1)
        if in_tail.any():
            out[in_tail] = self.window[row, :, positions[in_tail] % (2 * enc.recent)].transpose(0, 1)
        if center.any():
            pages, offsets = self._slots(table, positions[center])
            out[center] = self.centers[pages, :, offsets // enc.every]
        return out

    # ---- writes --------------------------------------------------------------------------------
    def _as_stored(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rows x [n, Hkv, 2 D] (keys after RoPE, at `positions` [n]) as stored: keys rotated back to position
        0, in the store's dtype."""
        half = self.head_dim
        k_pre = lowrank.rope(x[..., :half].transpose(0, 1), positions, self.inv_freq, inverse=True).transpose(0, 1)
        return torch.cat([k_pre, x[..., half:].float()], dim=-1).to(self.dtype)

    @torch.no_grad()
    def store(self, table: torch.Tensor, row: int, before: int, x: torch.Tensor) -> None:
        """A step's new tokens (positions [before, before + n)) into a sequence's layer: x [n, Hkv, 2 D]
        with keys after RoPE (the model's); then the block now due is compressed."""
        enc = self.enc
        n = x.shape[0]
        positions = torch.arange(before, before + n, device=x.device)
        x = self._as_stored(x, positions)  # [n, Hkv, 2 D]
        after = before + n
        sink = positions < enc.sink
        if sink.any():  # first: a block's references may be sinks
            self.sinks[row, :, positions[sink]] = x[sink].transpose(0, 1)
        old, new = enc.sink + enc.compressed(before), enc.sink + enc.compressed(after)
        if new > old:  # the block [old, new): its raw rows from the window and the step
            block = torch.arange(old, new, device=x.device)
            stored = block < before
            rows = torch.empty(block.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
            if stored.any():
                rows[stored] = self.window[row, :, block[stored] % (2 * enc.recent)].transpose(0, 1)
            rows[~stored] = x[block[~stored] - before]
            self._compress(table, row, block, rows)
        tail = positions >= max(new, after - 2 * enc.recent)  # the raw tail after the step (no slot twice)
        if tail.any():
            self.window[row, :, positions[tail] % (2 * enc.recent)] = x[tail].transpose(0, 1)

    def due(self, before: int) -> bool:
        """Does a sequence that stores `before` tokens compress a block when its next token is stored?"""
        return self.enc.compressed(before + 1) > self.enc.compressed(before)

    @torch.no_grad()
    def compress_due(self, table: torch.Tensor, row: int, before: int) -> None:
        """The block a decode row's token brings due (`due`), from the ring: what `store` compresses
        before it writes that token, run before the step (the step reads the block from the ring
        either way: it is past the compressed tokens until the step's token is stored)."""
        enc = self.enc
        old, new = enc.sink + enc.compressed(before), enc.sink + enc.compressed(before + 1)
        block = torch.arange(old, new, device=self.window.device)
        self._compress(table, row, block, self.window[row, :, block % (2 * enc.recent)].transpose(0, 1))

    @torch.no_grad()
    def store_decodes(self, rows: torch.Tensor, befores: torch.Tensor, x: torch.Tensor) -> None:
        """Decode rows' tokens x [n, Hkv, 2 D] (keys after RoPE) at positions `befores` [n] of the
        sequences in `rows` [n], on the device alone (CUDA-graph safe): each into its sinks or its ring
        slot; the blocks they bring due are compressed before the step (`compress_due`). A padding row
        (its row the scratch row, position -1) writes only the scratch row."""
        enc = self.enc
        befores, rows = befores.long(), rows.long()
        x = self._as_stored(x, befores)
        in_sink = (befores < enc.sink)[:, None, None]
        if self.sinks is not None:
            at = befores.clamp(0, enc.sink - 1)
            self.sinks[rows, :, at] = torch.where(in_sink, x, self.sinks[rows, :, at])
        at = befores % (2 * enc.recent)
        self.window[rows, :, at] = torch.where(in_sink, self.window[rows, :, at], x)

    def _compress(self, table: torch.Tensor, row: int, block: torch.Tensor, rows: torch.Tensor) -> None:
        """Block positions `block` (ascending, past the sinks) with raw vectors `rows` [m, Hkv, 2 D]:
        centers into their pages' rows, every token's neighbours and code."""
        enc = self.enc
        pages, offsets = self._slots(table, block)
        center = delta.is_center(block, enc.sink, enc.every)
        self.centers[pages[center], :, offsets[center] // enc.every] = rows[center]
        center_pos = delta.center_positions(int(block[-1]) + 1, enc.sink, enc.every).to(block.device)
        centers = self.raw(table, row, center_pos, int(block[-1]) + 1)  # the sinks, stored and new centers
        inside = center_pos >= int(block[0])
        centers[inside] = rows[center_pos[inside] - int(block[0])]
        ref, near = delta.references(rows.flatten(1), block, centers.flatten(1), center_pos, enc.count)
        code = delta.encode(rows, ref.view(rows.shape), self.down)
        self.latent[pages, :, offsets] = code.to(self.latent.dtype)
        heads, share = self.neighbours.shape[1], self.neighbours.shape[-1]
        shares = torch.full((near.shape[0], heads * share), -1, dtype=torch.int32, device=near.device)
        shares[:, :near.shape[1]] = near.to(torch.int32)
        self.neighbours[pages, :, offsets] = shares.view(-1, heads, share)

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, table: torch.Tensor, row: int, positions: torch.Tensor,
             length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (after RoPE, at their positions) and values [Hkv, n, D] (float32) of stored `positions`
        [n] of a sequence that stores `length` tokens."""
        enc = self.enc
        x = self.raw(table, row, positions, length).float()
        tail = enc.sink + enc.compressed(length)
        coded = (positions >= enc.sink) & (positions < tail) & ~delta.is_center(positions, enc.sink, enc.every)
        if coded.any():
            pages, offsets = self._slots(table, positions[coded])
            near = self._neighbours(pages, offsets)  # [m, count], -1: none
            valid = near >= 0
            flat = near.clamp(min=0).flatten()
            members = self.raw(table, row, flat, length).float().view(*near.shape, *x.shape[1:])
            weight = valid.float() / valid.sum(1, keepdim=True).clamp(min=1)
            ref = torch.einsum("mk,mkhf->mhf", weight, members)
            x[coded] = delta.decode(self.latent[pages, :, offsets], ref, self.up, self.bias)
        half = self.head_dim
        keys = lowrank.rope(x[..., :half].transpose(0, 1), positions, self.inv_freq)
        return keys, x[..., half:].transpose(0, 1)
