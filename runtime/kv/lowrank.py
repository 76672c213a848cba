"""Low-rank K/V (runtime/kv/spec.py, `LowRank`): a latent per group of KV heads, and RoPE at read.

The arithmetic every reader and writer of a `LowRank` operand shares (the torch ops, the store's
dense reads, the reference in tests/references/palu.py checks it). With g KV heads per group,
head j of a group stores channels [j c, (j+1) c) of the group's latent (c = rank / g), so the
group's latent of a token is its heads' stored rows side by side:

    latent_G = sum_{h in G} x_h @ down_h        (down_h [D, rank]: head h's rows of down_G)
    x_h      = latent_G @ up_h^T                 (up_h [D, rank])

Keys stored before RoPE (`prerope`) are rotated back to position 0 before `down` (the model
rotated them at their position) and rotated to the slot's position after `up`: slot s of a
sequence holds its token s. RoPE is the rotate-half form of runtime/models/layers.py, with the
model's inverse frequencies, in float32.
"""

from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x [..., L, D] rotated by the angles of `positions` [L] (or [..., L]) in float32; `inverse`:
    by minus those angles (what undoes the model's rotation)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(x.device, torch.float32)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    x = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def encode(x: torch.Tensor, down: torch.Tensor, group: int, positions: torch.Tensor | None = None,
           inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The stored latent of new rows x [n, Hkv, D]: [n, Hkv, rank / group] (float32). `down` [Hkv,
    D, rank]; `positions` [n] and `inv_freq` for keys stored before RoPE."""
    n, heads, dim = x.shape
    if inv_freq is not None:
        x = rope(x.transpose(0, 1), positions, inv_freq, inverse=True).transpose(0, 1)  # [n, Hkv, D]
    groups, rank = heads // group, down.shape[-1]
    latent = torch.einsum("ngd,gdr->ngr", x.float().reshape(n, groups, group * dim),
                          down.float().reshape(groups, group * dim, rank))
    return latent.reshape(n, heads, rank // group)


def decode(latent: torch.Tensor, up: torch.Tensor, group: int, positions: torch.Tensor | None = None,
           inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [..., Hkv, L, D] (float32) from their stored latents [..., Hkv, L, rank / group]; `up`
    [Hkv, D, rank]; `positions` [L] (or [..., L]) and `inv_freq` for keys stored before RoPE."""
    *lead, heads, length, share = latent.shape
    groups, dim, rank = heads // group, up.shape[1], up.shape[2]
    grouped = latent.float().reshape(*lead, groups, group, length, share).transpose(-3, -2)
    grouped = grouped.reshape(*lead, groups, length, rank)  # the group's whole latent per slot
    x = torch.einsum("...glr,gjdr->...gjld", grouped, up.float().reshape(groups, group, dim, rank))
    x = x.reshape(*lead, heads, length, dim)
    if inv_freq is not None:
        pos = positions if positions.dim() == 1 else positions.unsqueeze(-2)  # [..., L] -> [..., 1, L]
        x = rope(x, pos, inv_freq)
    return x
