"""Attention over a layer whose K and V are one DeltaKV code (runtime/kv/delta_pages.py), in torch.

Per sequence of the step: its stored positions decoded (`DeltaPages.read`: raw where raw, else
reference + code), its own new tokens as computed, causal attention; then the new tokens enter the
store (`DeltaPages.store`, which compresses the block that is due). A decode row with a token
`ReadPlan` reads the positions its KV heads list (each head its own), its `last` newest, and
always the raw tail the store keeps (`Delta.compressed`: the uncompressed buffer, as the
reference's cache reads it). A Python loop over the step's sequences, the reference path; on the
Triton backend the `delta` variant's kernels attend instead (compiler/templates/paged_delta.py.jinja:
the decode rows in one launch, each prefill chunk through `plain`'s prefill over its decoded tokens).
Decode rows are stored together.
"""

from __future__ import annotations

import torch

from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.kv.delta_pages import DeltaPages
from kvc.runtime.kv.plans import ReadPlan


QUERY_BLOCK = 256  # a prefill chunk's queries attend this many at a time (their logits: Hq x 256 x L floats)


def _sequences(md: AttentionMetadata, layer: int) -> list[tuple[int, int, int, int, int]]:
    """(index, its row, first row of its tokens, its new tokens, stored before the step) per sequence
    with new tokens (from the step's host copies where it has them: no device read)."""
    cu = md.host_cu_seqlens if md.host_cu_seqlens is not None else md.cu_seqlens_q.tolist()
    lens = md.host_context_lens[layer] if md.host_context_lens is not None else md.context_lens[layer].tolist()
    rows = md.host_rows if md.host_rows is not None else md.rows.tolist()
    return [(b, rows[b], cu[b], cu[b + 1] - cu[b], lens[b] - (cu[b + 1] - cu[b]))
            for b in range(len(cu) - 1) if cu[b + 1] > cu[b]]


def store(source: DeltaPages, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata, layer: int,
          sequences: list[tuple[int, int, int, int, int]] | None = None) -> None:
    """The step's k, v [T, Hkv, D] (keys after RoPE) into each sequence's layer: the decode rows' tokens on
    the device (`DeltaPages.store_decodes`; the runner compressed the blocks they bring due before the
    step, `ModelRunner`), the other sequences' one by one (`DeltaPages.store`, compressing as it goes;
    `sequences`: `_sequences` of the step, where the caller listed them)."""
    d, batch = md.num_decodes, md.cu_seqlens_q.shape[0] - 1
    x = torch.cat([k, v], dim=-1)
    if d:
        source.store_decodes(md.rows[:d], md.context_lens[layer, :d] - 1, x[:d])
    if d < batch:
        tables = md.block_tables[layer]
        for b, row, at, n, before in sequences if sequences is not None else _sequences(md, layer):
            if b >= d:
                source.store(tables[b], row, before, x[at:at + n])


def forward(source: DeltaPages, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
            layer: int, scale: float, read: ReadPlan | None = None, kernels=None) -> torch.Tensor:
    """Attention output [T, Hq, D] of the step's queries q [T, Hq, D] over each sequence's stored
    tokens (a decode row's as `read` lists them) and its own new ones (k, v [T, Hkv, D]); then the
    new tokens are stored. `kernels` (the `delta` variant's module, on the Triton backend): its
    `delta_decode` computes the decode rows' outputs and its `delta_prefill` each prefill chunk's
    instead of this module's loop; a decode-only step then reads nothing on the host (CUDA graphs)."""
    out = torch.zeros_like(q)
    d, batch = md.num_decodes, md.cu_seqlens_q.shape[0] - 1
    tables, sequences = md.block_tables[layer], None
    if kernels is not None and d:
        kernels.delta_decode(source, q[:d], k[:d], v[:d], tables[:d], md.context_lens[layer, :d], md.rows[:d], scale,
                             read, out=out[:d])
    if kernels is None or d < batch:
        sequences = _sequences(md, layer)
        for b, row, at, n, before in sequences:
            if kernels is not None and b < d:
                continue
            rows = slice(at, at + n)
            if kernels is not None:
                out[rows] = kernels.delta_prefill(source, q[rows], k[rows], v[rows], tables[b], row, before, scale)
                continue
            positions, listed = torch.arange(before, device=q.device), None
            if read is not None and b < md.num_decodes:
                positions, listed = _listed(source, read, b, before)
            old_k, old_v = source.read(tables[b], row, positions, before)
            keys = torch.cat([old_k, k[rows].transpose(0, 1).float()], dim=1)  # [Hkv, m + n, D]
            values = torch.cat([old_v, v[rows].transpose(0, 1).float()], dim=1)
            out[rows] = causal(q[rows], keys, values, positions.shape[0], scale, listed).to(q.dtype)
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
    length = keys.shape[1]
    k = keys.repeat_interleave(group, 0)  # [Hq, L, D]
    w = values.repeat_interleave(group, 0)
    hidden = None
    if listed is not None:
        hidden = torch.cat([~listed, listed.new_zeros(listed.shape[0], n)], dim=1).repeat_interleave(group, 0)
    out = q.new_empty(n, heads, q.shape[-1], dtype=torch.float32)
    for first in range(0, n, QUERY_BLOCK):  # the logits of a block of queries at a time: [Hq, block, L]
        rows = slice(first, min(n, first + QUERY_BLOCK))
        at = torch.arange(rows.start, rows.stop, device=q.device)
        mask = (torch.arange(length, device=q.device)[None, :] > (stored + at)[:, None])[None]
        if hidden is not None:
            mask = mask | hidden[:, None, :]
        logits = torch.einsum("nhd,hld->hnl", q[rows].float(), k) * scale
        out[rows] = torch.einsum("hnl,hld->nhd", logits.masked_fill(mask, float("-inf")).softmax(-1), w)
    return out
