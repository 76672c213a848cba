"""Low-rank projections of K and V (a `LowRank` store, runtime/kv/spec.py) for a model.

Two decompositions, Palu's (its `--decompose_method`): for each layer and group G of g KV heads,
the projection keeps the first r directions of

- `whiten` (the default): the keys the cache stores (before RoPE, or after it for a spec that stores
  them so) and the values, over calibration text: the top-r eigenvectors of `K_G^T K_G` [g D, g D]
  (the second moment of the group's rows, accumulated in float64). Since `K_G = X W_G^T`, this is
  the SVD of the projection weights whitened by the inputs' second moment (SVD-LLM's data-aware
  decomposition, which Palu uses): the best rank-r projection of the keys and values the model
  really produces;
- `svd`: the K (V) projection's weight rows of the group, each head's rows times its k-norm weight
  where the model has one, the bias as one more column: their first r left singular vectors `U_r`
  (Eckart-Young over every input direction alike). With a k-norm each head is divided by its own
  RMS, so for groups of several heads this subspace is exact only up to those per-head scales.
  Keys stored after RoPE are outside it (RoPE rotates them out of the weights' span): whiten only.

Both give an orthonormal basis U [g D, r], used as down and as up: latent = x_G @ U, x_G ~ latent
@ U^T. Ranks are uniform across layers: Palu's Fisher-information rank allocation is not done.
docs/design.md, "Calibrating low-rank projections".
"""

from __future__ import annotations

import torch

from kvc.runtime.calibrate.observe import observe
from kvc.runtime.models.fp8_weights import weight_of


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


def weight_projections(model, group: int, rank: int) -> dict[str, torch.Tensor]:
    """{"k": ..., "v": ...}, each [layers, Hkv, D, rank]: the orthonormal basis per group that is both
    the operand's down and up projection, from a kvc model's attention weights (runtime/models/layers.py,
    `Attention`)."""
    keys, values = [], []
    for layer in model.layers:
        attn = layer.self_attn
        weight = weight_of(attn.qkv_proj, torch.float32).detach()  # an FP8 layer's weights dequantized
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


def covariances(model, batches: list[torch.Tensor], prerope: bool = True) -> dict[str, list[torch.Tensor]]:
    """{"k": [...], "v": [...]}: per layer, the float64 second moment [Hkv D, Hkv D] of the keys the
    cache stores (`prerope`: rotated back to position 0; else as RoPE leaves them) and of the values,
    over `batches` of token ids (each one sequence from position 0), with plain causal attention in
    between."""
    from kvc.runtime.kv.lowrank import rope

    inv_freq = model.rotary.inv_freq
    moments: dict[str, list] = {"k": [], "v": []}

    def see(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        positions = torch.arange(k.shape[0], device=k.device)
        stored = rope(k.transpose(0, 1), positions, inv_freq, inverse=True).transpose(0, 1) if prerope else k
        for name, x in (("k", stored), ("v", v)):  # [T, Hkv, D]
            flat = x.reshape(x.shape[0], -1).double()
            if len(moments[name]) <= layer:
                moments[name].append(torch.zeros(flat.shape[1], flat.shape[1], dtype=torch.float64, device=x.device))
            moments[name][layer] += flat.T @ flat

    observe(model, batches, see)
    return moments


def whitened(moments: list[torch.Tensor], num_kv_heads: int, group: int, rank: int) -> torch.Tensor:
    """[layers, Hkv, D, rank] float32: per layer and group, the top-`rank` eigenvectors of the group's
    block of the second moment, in its heads' rows."""
    out = []
    for moment in moments:
        dim = moment.shape[0] // num_kv_heads
        heads = []
        for start in range(0, num_kv_heads, group):
            block = moment[start * dim:(start + group) * dim, start * dim:(start + group) * dim]
            values, vectors = torch.linalg.eigh(block)  # ascending
            heads.append(vectors[:, values.argsort(descending=True)[:rank]].reshape(group, dim, rank))
        out.append(torch.cat(heads))
    return torch.stack(out).float().cpu()
