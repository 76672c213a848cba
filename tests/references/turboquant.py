"""A hand-written TurboQuant reference (Zandieh et al. 2025, "TurboQuant: Online Vector Quantization
with Near-optimal Distortion Rate", arXiv 2504.19874; its MSE quantizer), written from the paper and
the definitions in docs/design.md ("KV spec"), with no kvc code: the numpy quantizer kvc's encodings
must match, and the oracle of a model served with TurboQuant (a Hugging Face model whose keys and
values are replaced by their round trip through the cache).

- Rotation: an orthogonal D x D matrix R; "random" is Q of the QR decomposition of a standard
  normal matrix drawn by a torch.Generator seeded with 0 (float64), with the signs of R's diagonal
  folded into Q's columns; "hadamard" is Sylvester's H_D times diag(s) / sqrt(D), s = 2 * randint(0,
  2, (D,)) - 1 from that generator. A vector x is stored as the codes of x R^T.
- Levels: the Lloyd-Max quantizer with 2^b levels of y = sqrt(D) u_1, a coordinate of a uniformly
  random unit vector (density proportional to (1 - y^2 / D) ^ ((D - 3) / 2) on |y| < sqrt(D)),
  computed here its own way (closed-form first moments, Simpson masses), not kvc's.
- Quantizer, per token and KV head, float32: `scale` = the RMS of the rotated vector (its norm over
  sqrt(D)), stored in the model dtype (1 where it is 0); code = the number of midpoints `(l_i +
  l_{i+1}) * 0.5` that `x / scale` exceeds; x' = levels[code] * scale, rotated back with R.
- Key offsets (`offsets` [layers, Hkv, D], bench/variants/turboquant_offsets.kvm's `k_mean`; kvc's
  addition, not the paper's):
  every key of a layer, stored or attended as computed, is `k - offsets[layer]` (attention is
  unchanged in exact arithmetic: q·offset is the same for all of a query's keys).
- Every token is stored quantized as it arrives (no residual window). A prefill chunk attends to its
  own tokens as computed and to earlier ones as stored (the papers' full-precision prefill); a
  decode step reads every token as stored, its own included.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references import harness

NAME = "kvc_turboquant_reference"


def rotation(dim: int, kind: str = "random") -> np.ndarray:
    """R [dim, dim] float64 (the module's docstring)."""
    gen = torch.Generator().manual_seed(0)
    if kind == "hadamard":
        signs = (torch.randint(0, 2, (dim,), generator=gen) * 2 - 1).numpy().astype(np.float64)
        h = np.array([[1.0]])
        while h.shape[0] < dim:
            h = np.block([[h, h], [h, -h]])
        return h * signs[None, :] / np.sqrt(dim)
    q, r = np.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64).numpy())
    return q * np.sign(np.diag(r))[None, :]


@functools.lru_cache(maxsize=None)
def levels(bits: int, dim: int) -> np.ndarray:
    """The 2^bits Lloyd-Max levels (float64, ascending): each level the mean of its cell, cells split
    at the midpoints. A cell's first moment in closed form (the density's antiderivative times y is
    -(D / (2 (a + 1))) (1 - y^2 / D) ^ (a + 1), a = (D - 3) / 2), its mass by Simpson's rule on 4,000
    intervals; iterated from evenly spread levels until they move by less than 1e-14."""
    a, edge, count = (dim - 3) / 2, np.sqrt(dim), 2**bits

    def mass(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        t = np.linspace(0, 1, 4001)
        y = lo[:, None] + (hi - lo)[:, None] * t[None, :]
        f = np.power(np.clip(1 - y * y / dim, 0, None), a)
        simpson = np.ones(4001)
        simpson[1:-1:2], simpson[2:-1:2] = 4, 2
        return (f * simpson).sum(1) * (hi - lo) / (3 * 4000)

    def first(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        g = lambda y: np.power(np.clip(1 - y * y / dim, 0, None), a + 1)  # noqa: E731
        return dim / (2 * (a + 1)) * (g(lo) - g(hi))

    level = np.linspace(-2.0, 2.0, count)
    for _ in range(20000):
        mids = (level[:-1] + level[1:]) / 2
        lo, hi = np.concatenate([[-edge], mids]), np.concatenate([mids, [edge]])
        new = first(lo, hi) / mass(lo, hi)
        moved = np.abs(new - level).max()
        level = new
        if moved < 1e-14:
            break
    return level


def quantize(x: np.ndarray, book: np.ndarray, scale_dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """x [..., D] float32 (already rotated), float32 levels -> (codes [..., D] uint8, scale [...] as stored)."""
    x = x.astype(np.float32)
    rms = np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1)).astype(np.float32)
    scale = rms.astype(scale_dtype).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0))
    return codes_given_scale(x, scale, book), scale


def codes_given_scale(x: np.ndarray, scale: np.ndarray, book: np.ndarray) -> np.ndarray:
    """The codes of x [..., D] float32 against a stored scale [...] (the decision, exact in float32)."""
    book = book.astype(np.float32)
    mids = ((book[:-1] + book[1:]) * np.float32(0.5)).astype(np.float32)
    y = (x.astype(np.float32) / scale[..., None].astype(np.float32)).astype(np.float32)
    return (y[..., None] > mids).sum(-1).astype(np.uint8)


def pack3(codes: np.ndarray) -> np.ndarray:
    """3-bit codes [..., D] (D a multiple of 8) -> uint8 [..., 3 D / 8]: each 8 codes' 24-bit
    little-endian word, code j at bits 3j..3j+2."""
    words = codes.astype(np.int64).reshape(*codes.shape[:-1], -1, 8)
    word = sum(words[..., j] << (3 * j) for j in range(8))
    parts = np.stack([(word >> (8 * b)) & 255 for b in range(3)], axis=-1)
    return parts.reshape(*codes.shape[:-1], -1).astype(np.uint8)


def round_trip(x: torch.Tensor, bits: int, kind: str = "random") -> torch.Tensor:
    """x [Hkv, c, D] as the cache gives it back, float32 (rotated, quantized, decoded, rotated back)."""
    dim = x.shape[-1]
    r = rotation(dim, kind)
    book = levels(bits, dim).astype(np.float32)
    rotated = (x.double().numpy() @ r.T).astype(np.float32)
    codes, scale = quantize(rotated, book)
    back = book[codes] * scale[..., None]
    return torch.from_numpy((back.astype(np.float64) @ r).astype(np.float32))


@dataclass
class Session:
    """A layer-by-layer cache of K/V as TurboQuant's cache holds them (decoded)."""

    key_bits: int | None = 3  # None: exact (TurboQuant off)
    value_bits: int | None = 3
    exact_prefill: bool = True  # a prefill chunk reads itself as computed (False: as stored)
    stored: Any = None  # x [Hkv, c, D] -> as the cache gives it back (None: `round_trip` at the bits)
    offsets: torch.Tensor | None = None  # [layers, Hkv, D] subtracted from keys (the module's docstring)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int) -> Session:
        out = self.copy()
        out.keys = [k[:, :n] for k in out.keys]
        out.values = [v[:, :n] for v in out.values]
        return out

    def step(self, layer: int, k: torch.Tensor, v: torch.Tensor, prefill: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a step of new k, v [Hkv, c, D] attends over; then the cache takes them."""
        if self.offsets is not None:
            k = k.float() - self.offsets[layer][:, None, :].float()
        if self.stored is not None:
            stored_k, stored_v = self.stored(k.float()), self.stored(v.float())
        else:
            stored_k = k.float() if self.key_bits is None else round_trip(k.float(), self.key_bits)
            stored_v = v.float() if self.value_bits is None else round_trip(v.float(), self.value_bits)
        if len(self.keys) <= layer:
            self.keys.append(stored_k[:, :0])
            self.values.append(stored_v[:, :0])
        own_k, own_v = (k.float(), v.float()) if prefill and self.exact_prefill else (stored_k, stored_v)
        keys = torch.cat([self.keys[layer], own_k], dim=1)
        values = torch.cat([self.values[layer], own_v], dim=1)
        self.keys[layer] = torch.cat([self.keys[layer], stored_k], dim=1)
        self.values[layer] = torch.cat([self.values[layer], stored_v], dim=1)
        return keys, values


_active: tuple[Session, bool] | None = None  # the session, and whether the forward is a prefill chunk


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    session, prefill = _active
    keys, values = session.step(module.layer_idx, key[0], value[0], prefill)
    return harness.causal_attention(query, keys, values, scaling), None


AttentionInterface.register(NAME, _attention)


def _forward(model: PreTrainedModel, session: Session, ids: list[int], prefill: bool) -> torch.Tensor:
    global _active
    _active = session, prefill
    try:
        return harness.forward(model, NAME, ids, session.length)
    finally:
        _active = None


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int,
             chunk: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy: `prompt` in chunks of `chunk` tokens (None: one), then `steps - 1` decode steps; the
    tokens and their logits [steps, vocab]."""
    size = chunk or len(prompt)
    for i in range(0, len(prompt), size):
        out = _forward(model, session, prompt[i:i + size], True)
    logits = [out[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]], False)[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
