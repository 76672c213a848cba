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
               count: int, cells: int = 1 << 25, pool: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's reference: the mean of its `count` nearest centers at or before its position
    (squared L2 over the whole vector; ties: the earlier center).

    x [n, F] and positions [n]; centers [m, F], raw, at center_pos [m] (ascending). Returns (ref [n, F]
    float32, neighbours [n, count]: their positions, -1 where a row has fewer centers before it). Every
    row needs one (a block's first position is a center). Rows go in blocks of at most `cells` distances
    (a 32K-token block against 128K tokens' centers would need gigabytes at once). Against more than
    `pool` (default 8 `count`) centers, `_nearest` finds them through one matrix product; the answer is
    the exact one either way."""
    rows = max(1, cells // max(1, centers.shape[0]))
    if x.shape[0] > rows:
        parts = [references(x[i:i + rows], positions[i:i + rows], centers, center_pos, count, cells, pool)
                 for i in range(0, x.shape[0], rows)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    k = min(count, centers.shape[0])
    idx, valid = _nearest(x, positions, centers, center_pos, k, pool or 8 * count)
    weight = valid.float() / valid.sum(1, keepdim=True).clamp(min=1)
    ref = torch.einsum("nk,nkf->nf", weight, centers.float()[idx])
    out = torch.where(valid, center_pos[idx], torch.full_like(idx, -1))
    if k < count:
        out = torch.cat([out, out.new_full((out.shape[0], count - k), -1)], 1)
    return ref, out


def _exact_nearest(x: torch.Tensor, positions: torch.Tensor, centers: torch.Tensor, center_pos: torch.Tensor,
                   k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices [n, k] of each row's k nearest earlier centers, found [n, k]): every distance in float64
    without cancellation, a stable sort (equal distances keep the earlier center first)."""
    dist = torch.cdist(x.double(), centers.double(), compute_mode="donot_use_mm_for_euclid_dist").square()
    dist = dist.masked_fill(center_pos[None, :] > positions[:, None], float("inf"))
    order = torch.sort(dist, dim=1, stable=True)
    return order.indices[:, :k], torch.isfinite(order.values[:, :k])


def _nearest(x: torch.Tensor, positions: torch.Tensor, centers: torch.Tensor, center_pos: torch.Tensor, k: int,
             pool: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_exact_nearest`'s answer through candidates: float32 distances by one product (|x|^2 + |c|^2 - 2 x.c)
    pick each row's `pool` nearest, their exact float64 distances rank them as `_exact_nearest` does, and a
    row whose k-th exact distance is not below every other center's by more than the product's rounding bound
    is redone exactly (so the answer never differs; on real vectors no row is)."""
    if centers.shape[0] <= pool:
        return _exact_nearest(x, positions, centers, center_pos, k)
    xf, cf = x.float(), centers.float()
    x2, c2 = xf.square().sum(1), cf.square().sum(1)
    future = center_pos[None, :] > positions[:, None]
    approx = (x2[:, None] + c2[None, :] - 2 * (xf @ cf.T)).masked_fill(future, float("inf"))
    cut, cand = approx.topk(pool + 1, dim=1, largest=False)  # the last: the nearest center left out
    cand = cand[:, :pool].sort(dim=1).values  # ascending index: the stable sort keeps the earlier of equals
    xd, cd = x.double(), centers.double()
    exact = torch.stack([(xd - cd[cand[:, j]]).square().sum(-1) for j in range(pool)], 1)  # a candidate at a time
    exact = exact.masked_fill(center_pos[cand] > positions[:, None], float("inf"))
    order = torch.sort(exact, dim=1, stable=True)
    idx, dist = cand.gather(1, order.indices[:, :k]), order.values[:, :k]
    # |approx - exact| <= gamma (|x|^2 + |c|^2 + 2 |x||c|) <= 2 gamma (|x|^2 + |c|^2), gamma ~ (F + 3) u, u the
    # product's unit roundoff (TF32 or bf16 passes where torch's float32 matmul precision allows them)
    u = {"highest": 2.0**-24, "high": 2.0**-11}.get(torch.get_float32_matmul_precision(), 2.0**-8)
    slack = 4 * (x.shape[1] + 3) * u * (x2 + c2.max()).double()
    left_out = cut[:, pool].double()
    sure = torch.isinf(left_out) | (dist[:, -1] < left_out - slack)
    found = torch.isfinite(dist)
    if not bool(sure.all()):
        again = (~sure).nonzero().flatten()
        idx[again], found[again] = _exact_nearest(x[again], positions[again], centers, center_pos, k)
    return idx, found


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
