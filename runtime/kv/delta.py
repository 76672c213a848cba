"""DeltaKV's codes (a `delta` KV spec: compiler/kv_spec.py `Delta`; docs/design.md, "DeltaKV"): the
arithmetic its store, readers and trainer share, in the layout the spec stores.

A token's vector per KV head h is `x_h = [k_pre_h | v_h]` (2 D: its key before RoPE, then its value);
its whole vector x is every head's side by side. One code of C channels covers the token, and KV head
j stores channels [j C / Hkv, (j + 1) C / Hkv) of it, so the code is the heads' stored rows side by side:

    code = sum_h (x_h - ref_h) @ down_h          (down_h [2 D, C]: head h's rows of the projection)
    x^_h = ref_h + code @ up_h^T + bias_h        (up_h [2 D, C], bias_h [2 D])

`ref` is the mean raw vector of the token's nearest centers (`references`); centers are the sinks and
every `stride`-th token of a compressed block (`center_positions`), compressed a block at a time
(`block_of`). tests/references/deltakv.py is the oracle; runtime/calibrate/deltakv.py trains down, up
and bias with these functions, and runtime/kv/delta_pages.py stores and reads a served layer with them.
"""

from __future__ import annotations

import torch


def block_of(length: int, compressed: int, sink: int, recent: int) -> tuple[int, int]:
    """The block [start, end) to compress once a sequence stores `length` tokens of which
    `compressed` (after the sinks) already are: whole multiples of `recent`, leaving `recent` to
    2 `recent` - 1 raw; empty while fewer than 2 `recent` are raw."""
    start = sink + compressed
    raw = length - start
    if raw < 2 * recent:
        return start, start
    return start, start + (raw - recent) // recent * recent


def center_positions(end: int, sink: int, stride: int) -> torch.Tensor:
    """Every center before `end`: the sinks and every `stride`-th position from `sink` on."""
    return torch.cat([torch.arange(min(sink, end)), torch.arange(sink, max(sink, end), stride)])


def is_center(positions: torch.Tensor, sink: int, stride: int) -> torch.Tensor:
    return (positions < sink) | ((positions - sink) % stride == 0)


def references(x: torch.Tensor, positions: torch.Tensor, centers: torch.Tensor, center_pos: torch.Tensor,
               count: int, cells: int = 1 << 25) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's reference: the mean of its `count` nearest centers at or before its position
    (squared L2 over the whole vector; ties: the earlier center).

    x [n, F] and positions [n]; centers [m, F], raw, at center_pos [m] (ascending). Returns (ref [n, F]
    float32, neighbours [n, count]: their positions, -1 where a row has fewer centers before it). Every
    row needs one (a block's first position is a center). Rows go in blocks of at most `cells` distances
    (a 32K-token block against 128K tokens' centers would need gigabytes at once)."""
    rows = max(1, cells // max(1, centers.shape[0]))
    if x.shape[0] > rows:
        parts = [references(x[i:i + rows], positions[i:i + rows], centers, center_pos, count, cells)
                 for i in range(0, x.shape[0], rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    dist = torch.cdist(x.double(), centers.double(), compute_mode="donot_use_mm_for_euclid_dist").square()
    dist = dist.masked_fill(center_pos[None, :] > positions[:, None], float("inf"))
    k = min(count, centers.shape[0])
    # stable ascending sort: equal distances keep the earlier center first
    order = torch.sort(dist, dim=1, stable=True)
    d, idx = order.values[:, :k], order.indices[:, :k]
    valid = torch.isfinite(d)
    weight = valid.float() / valid.sum(1, keepdim=True).clamp(min=1)
    ref = torch.einsum("nk,nkf->nf", weight, centers.float()[idx])
    out = torch.where(valid, center_pos[idx], torch.full_like(idx, -1))
    if k < count:
        out = torch.cat([out, out.new_full((out.shape[0], count - k), -1)], 1)
    return ref, out


def encode(x: torch.Tensor, ref: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The stored code of rows x [n, Hkv, 2 D] against their references [n, Hkv, 2 D]: [n, Hkv, C / Hkv]
    float32 (`down` [Hkv, 2 D, C])."""
    n, heads, _ = x.shape
    code = torch.einsum("nhd,hdc->nc", (x.float() - ref.float()), down.float())
    return code.reshape(n, heads, -1)


def decode(code: torch.Tensor, ref: torch.Tensor, up: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Rows [n, Hkv, 2 D] (float32) from their stored codes [n, Hkv, C / Hkv] and references [n, Hkv, 2 D]
    (`up` [Hkv, 2 D, C], `bias` [Hkv, 2 D])."""
    whole = code.float().reshape(code.shape[0], -1)  # the heads' shares side by side: the token's code
    x = ref.float() + torch.einsum("nc,hdc->nhd", whole, up.float())
    return x if bias is None else x + bias.float()
