"""Low-rank projections of K and V (a `LowRank` store, runtime/kv/spec.py) from the model's weights.

For a group G of KV heads, the keys the cache sees are `k_G = M_G x` (x the layer's normed hidden
state), with `M_G` the K projection's rows of those heads, each head's rows scaled by its k-norm
weight where the model has one (a per-head RMSNorm before RoPE), and the bias, where there is
one, as one more column. The best rank-r subspace of everything `M_G` can produce is spanned by its
first r left singular vectors `U_r` [g D, r] (Eckart-Young), so the projection stores
`latent = k_G @ U_r` and reads `k_G ~ latent @ U_r^T`: down = up = U_r, split into each head's D
rows. Values likewise, with V's rows (no norm). Palu's group-head decomposition (G-LRD) at a uniform
rank; its Fisher-information rank allocation is not done. A k-norm divides each head by its own RMS,
so with several heads per group the subspace is exact for each head's direction only up to that
per-head scale (exact for groups of one head). docs/design.md, "Low-rank K/V".
"""

from __future__ import annotations

import torch


def group_basis(rows: torch.Tensor, num_kv_heads: int, group: int, rank: int) -> torch.Tensor:
    """rows [Hkv * D, n] (what a projection produces, one head's D rows at a time) -> [Hkv, D, rank]
    float32: the first `rank` left singular vectors of each group's [g D, n] block, in its heads' rows."""
    dim = rows.shape[0] // num_kv_heads
    out = []
    for start in range(0, num_kv_heads, group):
        block = rows[start * dim:(start + group) * dim].double()  # on the weights' device
        u = torch.linalg.svd(block, full_matrices=False)[0]  # [g D, min(g D, n)]
        if u.shape[1] < rank:
            raise ValueError(f"rank {rank} exceeds the {u.shape[1]} directions of a group of {group} heads")
        out.append(u[:, :rank].reshape(group, dim, rank))
    return torch.cat(out).float().cpu()


def projections(model, group: int, rank: int) -> dict[str, torch.Tensor]:
    """{"k": ..., "v": ...}, each [layers, Hkv, D, rank]: the orthonormal basis per group that is both
    the operand's down and up projection, from a kvc model's attention weights (runtime/models/layers.py,
    `Attention`)."""
    keys, values = [], []
    for layer in model.layers:
        attn = layer.self_attn
        weight = attn.qkv_proj.weight.detach().float()
        bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach().float()
        q, kv = attn.q_size, attn.kv_size
        k_rows, v_rows = weight[q:q + kv], weight[q + kv:]
        if bias is not None:  # an affine projection: its bias is one more direction
            k_rows = torch.cat([k_rows, bias[q:q + kv, None]], 1)
            v_rows = torch.cat([v_rows, bias[q + kv:, None]], 1)
        if attn.k_norm is not None:  # what the cache sees: each head's rows scaled by the norm's weight
            k_rows = k_rows * attn.k_norm.weight.detach().float().repeat(attn.num_kv_heads)[:, None]
        keys.append(group_basis(k_rows, attn.num_kv_heads, group, rank))
        values.append(group_basis(v_rows, attn.num_kv_heads, group, rank))
    return {"k": torch.stack(keys), "v": torch.stack(values)}
