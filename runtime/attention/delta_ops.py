"""Attention over a layer whose K and V are one DeltaKV code (runtime/kv/delta_pages.py), in torch.

Per sequence of the step: its stored positions decoded (`DeltaPages.read`: raw where raw, else
reference + code), its own new tokens as computed, causal attention; then the new tokens enter the
store (`DeltaPages.store`, which compresses the block that is due). A decode row with a token
`ReadPlan` reads the positions its KV heads list (each head its own), its `last` newest, and
always the raw tail the store keeps (`Delta.compressed`: the uncompressed buffer, as the
reference's cache reads it). A Python loop over the step's
sequences, as a reference path: the Triton tile that reads codes is not written yet (docs/design.md,
"DeltaKV").
"""

from __future__ import annotations

import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.kv.delta_pages import DeltaPages
from kvc.runtime.kv.plans import ReadPlan


def _sequences(md: AttentionMetadata, layer: int) -> list[tuple[int, int, int, int, int]]:
    """(index, its row, first row of its tokens, its new tokens, stored before the step) per sequence
    with new tokens."""
    cu = md.cu_seqlens_q.tolist()
    lens = md.context_lens[layer].tolist()
    rows = md.rows.tolist()
    return [(b, rows[b], cu[b], cu[b + 1] - cu[b], lens[b] - (cu[b + 1] - cu[b]))
            for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]


def store(source: DeltaPages, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: int,
          sequences: list[tuple[int, int, int, int, int]] | None = None) -> None:
    """The step's k, v [T, Hkv, D] (keys after RoPE) into each sequence's layer."""
    tables = md.block_tables[layer]
    x = torch.cat([k, v], dim=-1)
    for b, row, at, n, before in sequences if sequences is not None else _sequences(md, layer):
        source.store(tables[b], row, before, x[at:at + n])


def forward(source: DeltaPages, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
            layer: int, scale: float, read: ReadPlan | None = None) -> torch.Tensor:
    """Attention output [T, Hq, D] of the step's queries q [T, Hq, D] over each sequence's stored
    tokens (a decode row's as `read` lists them) and its own new ones (k, v [T, Hkv, D]); then the
    new tokens are stored."""
    out = torch.zeros_like(q)
    tables, sequences = md.block_tables[layer], _sequences(md, layer)
    for b, row, at, n, before in sequences:
        positions, listed = torch.arange(before, device=q.device), None
        if read is not None and b < md.num_decodes:
            positions, listed = _listed(source, read, b, before)
        old_k, old_v = source.read(tables[b], row, positions, before)
        keys = torch.cat([old_k, k[at:at + n].transpose(0, 1).float()], dim=1)  # [Hkv, m + n, D]
        values = torch.cat([old_v, v[at:at + n].transpose(0, 1).float()], dim=1)
        out[at:at + n] = causal(q[at:at + n], keys, values, positions.shape[0], scale, listed).to(q.dtype)
    store(source, k, v, md, layer, sequences)
    return out


def _listed(source: DeltaPages, read: ReadPlan, b: int, before: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode row b's stored positions to read (ascending) and which of them each KV head lists
    ([Hkv, m] bool): its plan's tokens, its `last` newest and the raw tail."""
    enc = source.enc
    tokens = read.tokens[b].long()  # [Hkv, T]
    device = tokens.device
    newest = 0 if read.last is None else int(read.last[b])
    start = min(before + 1 - newest, enc.sink + enc.compressed(before))  # the step's token is position `before`
    always = torch.arange(max(0, start), before, device=device)
    heads = [t[(t >= 0) & (t < before)] for t in tokens]
    positions = torch.unique(torch.cat([always, *heads]))
    listed = torch.stack([torch.isin(positions, h) | (positions >= start) for h in heads])
    return positions, listed


def causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, stored: int, scale: float,
           listed: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D], the step's n tokens, over keys, values [Hkv, stored + n, D]: `stored` read
    tokens (each KV head only those `listed` [Hkv, stored] marks, None: all), then the step's own,
    causal among them: [n, Hq, D] float32."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // keys.shape[0]
    k = keys.repeat_interleave(group, 0)  # [Hq, L, D]
    w = values.repeat_interleave(group, 0)
    logits = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    length = keys.shape[1]
    mask = torch.arange(length, device=q.device)[None, :] > (stored + torch.arange(n, device=q.device))[:, None]
    mask = mask[None].expand(heads, -1, -1)
    if listed is not None:
        hidden = torch.cat([~listed, listed.new_zeros(listed.shape[0], n)], dim=1)  # [Hkv, L]
        mask = mask | hidden.repeat_interleave(group, 0)[:, None, :]
    logits = logits.masked_fill(mask, float("-inf"))
    return torch.einsum("hnl,hld->nhd", logits.softmax(-1), w)
