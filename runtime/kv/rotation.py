"""Rotated K/V (runtime/kv/spec.py, `Quantized.rotation`): the orthogonal matrix of a seed, and the
change of basis of a rotated operand's store.

A rotated operand is stored as the codes of `x @ R.T` and every reader gets `x^ @ R` back (x^ the
decoded codes): the rotation belongs to the encoding, so everything outside the store (the model,
method hooks, prefill records, chains) sees the model's basis. The Triton kernels never rotate a
row of the cache: the store kernel rotates the new rows before it quantizes them, and since `q·k =
(q R^T)·(k R^T)` and `sum_j p_j v_j = (sum_j p_j v_j R^T) R`, attention rotates the query by the
keys' R and its output back by the values' (docs/design.md, "Codebook codes and rotations", says
where). The torch ops (the oracle) decode and rotate back (`to_model`).

The matrices, from a torch.Generator seeded with `SEED`: "random" (TurboQuant's random rotation)
is Q of the QR decomposition of a standard normal [D, D], with the signs of R's diagonal folded in
(Haar-distributed); "hadamard" is the randomized Hadamard transform `H_D diag(s) / sqrt(D)`
(Sylvester's H_D, D a power of two; signs s = 2 * randint(0, 2, (D,)) - 1).
"""

from __future__ import annotations

import functools

import torch


SEED = 0


@functools.lru_cache(maxsize=None)
def matrix(dim: int, kind: str) -> torch.Tensor:
    """The orthogonal [dim, dim] float64 matrix R of `kind` (the module's docstring)."""
    gen = torch.Generator().manual_seed(SEED)
    if kind == "hadamard":
        if dim & (dim - 1):
            raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {dim} (use `random`)")
        signs = (torch.randint(0, 2, (dim,), generator=gen) * 2 - 1).double()
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return h * signs[None, :] / dim**0.5
    if kind != "random":
        raise ValueError(f"unknown rotation {kind!r} (hadamard or random)")
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))[None, :]


@functools.lru_cache(maxsize=None)
def _on(dim: int, kind: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    return matrix(dim, kind).to(device=device, dtype=dtype).contiguous()


def on(dim: int, kind: str, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """R of `kind` on `device` in `dtype` (one tensor per place and dtype: what the kernels read)."""
    return _on(dim, kind, str(torch.device(device)), dtype)


def to_stored(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """Rows x [..., D] in the stored basis, `x @ R.T` in float32 (x itself when `kind` is None)."""
    if kind is None:
        return x
    return x.float() @ on(x.shape[-1], kind, x.device, torch.float32).T


def to_model(x: torch.Tensor, kind: str | None) -> torch.Tensor:
    """Decoded rows x [..., D] (the stored basis) back in the model's, `x @ R` in float32."""
    if kind is None:
        return x
    return x.float() @ on(x.shape[-1], kind, x.device, torch.float32)
