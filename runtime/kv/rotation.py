"""Rotated K/V (runtime/kv/spec.py, `Quantized.rotation`): the orthogonal matrix of a seed, and the
change of basis where q, k and v enter a layer's attention.

For an orthogonal R, `q·k = (q R^T)·(k R^T)` and `sum_j p_j v_j = (sum_j p_j v_j R^T) R`, so a
layer whose keys are stored rotated by R_k and values by R_v attends exactly as before when its
queries are rotated by R_k and its output rotated back by R_v. Rotating all three where they enter
the attention function (`Rotation.inputs`, then `Rotation.output`) keeps one basis for everything
inside it: the store, page summaries, method hooks (their scores are inner products or norms,
which the rotation keeps) and the kernels. The matrices, from a torch.Generator seeded with
`SEED`: "random" (TurboQuant's random rotation) is Q of the QR decomposition of a standard normal
[D, D], with the signs of R's diagonal folded in (Haar-distributed); "hadamard" is the randomized
Hadamard transform `H_D diag(s) / sqrt(D)` (Sylvester's H_D, D a power of two; signs s = 2 *
randint(0, 2, (D,)) - 1).
"""

from __future__ import annotations

import functools

import torch

from kvc.runtime.kv.spec import KVSpec, Quantized


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


class Rotation:
    """The change of basis of a spec whose K or V is stored rotated: `inputs` rotates a layer's q, k
    and v (row vectors, `x @ R.T`), `output` rotates its attention output back (`out @ R_v`)."""

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        self.keys, self.values = keys, values  # R^T of each operand, in the model dtype (None: not rotated)
        self.values_back = None if values is None else values.T.contiguous()

    @classmethod
    def of(cls, spec: KVSpec, head_dim: int, dtype: torch.dtype, device: torch.device | str) -> Rotation | None:
        """The spec's rotation (None when neither K nor V is rotated)."""
        def transposed(enc) -> torch.Tensor | None:
            if not isinstance(enc, Quantized) or enc.rotation is None:
                return None
            return matrix(head_dim, enc.rotation).T.to(device=device, dtype=dtype).contiguous()

        keys, values = transposed(spec.keys), transposed(spec.values)
        return None if keys is None and values is None else cls(keys, values)

    def inputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.keys is not None:
            q, k = q @ self.keys, k @ self.keys
        if self.values is not None:
            v = v @ self.values
        return q, k, v

    def output(self, out: torch.Tensor | None) -> torch.Tensor | None:
        return out if out is None or self.values is None else out @ self.values_back
