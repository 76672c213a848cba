"""Attention over a layer whose K and V are one DeltaKV code (runtime/kv/delta_pages.py), in torch.

Per sequence of the step: its stored positions decoded (`DeltaPages.read`: raw where raw, else
reference + code), its own new tokens as computed, causal attention; then the new tokens enter the
store (`DeltaPages.store`, which compresses the block that is due). A Python loop over the step's
sequences, as a reference path: the Triton tile that reads codes is not written yet (docs/design.md,
"DeltaKV").
"""

from __future__ import annotations

import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.kv.delta_pages import DeltaPages


def _sequences(md: AttentionMetadata, layer: int):
    """(index, first row of its tokens, its new tokens, stored before the step) per sequence."""
    cu = md.cu_seqlens_q.tolist()
    lens = md.context_lens[layer].tolist()
    for b in range(len(cu) - 1):
        n = cu[b + 1] - cu[b]
        if n > 0:
            yield b, cu[b], n, lens[b] - n


def store(source: DeltaPages, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: int) -> None:
    """The step's k, v [T, Hkv, D] (keys after RoPE) into each sequence's layer."""
    tables, rows = md.block_tables[layer], md.rows
    x = torch.cat([k, v], dim=-1)
    for b, at, n, before in _sequences(md, layer):
        source.store(tables[b], int(rows[b]), before, x[at:at + n], source.inv_freq)


def forward(source: DeltaPages, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
            layer: int, scale: float) -> torch.Tensor:
    """Attention output [T, Hq, D] of the step's queries q [T, Hq, D] over each sequence's stored
    tokens and its own new ones (k, v [T, Hkv, D]); then the new tokens are stored."""
    out = torch.zeros_like(q)
    tables, rows = md.block_tables[layer], md.rows
    for b, at, n, before in _sequences(md, layer):
        positions = torch.arange(before, device=q.device)
        old_k, old_v = source.read(tables[b], int(rows[b]), positions, before, source.inv_freq)
        keys = torch.cat([old_k, k[at:at + n].transpose(0, 1).float()], dim=1)  # [Hkv, L, D]
        values = torch.cat([old_v, v[at:at + n].transpose(0, 1).float()], dim=1)
        out[at:at + n] = causal(q[at:at + n], keys, values, before, scale).to(q.dtype)
    store(source, k, v, md, layer)
    return out


def causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, before: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions [before, before + n) over keys, values [Hkv, before + n, D]:
    [n, Hq, D] float32 (query i sees positions <= before + i)."""
    n, heads = q.shape[0], q.shape[1]
    group = heads // keys.shape[0]
    k = keys.repeat_interleave(group, 0)  # [Hq, L, D]
    w = values.repeat_interleave(group, 0)
    logits = torch.einsum("nhd,hld->hnl", q.float(), k) * scale
    length = keys.shape[1]
    mask = torch.arange(length, device=q.device)[None, :] > (before + torch.arange(n, device=q.device))[:, None]
    logits = logits.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hnl,hld->nhd", logits.softmax(-1), w)
