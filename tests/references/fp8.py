"""A hand-written FP8 reference: the quantizer kvc's fp8 method must match bit for bit, and the
oracle of attention over an FP8 cache (a Hugging Face model whose K/V are replaced by their FP8
round trip). Written from the formats' definitions, with no kvc or torch float8 code:

- e4m3 ("fn": no infinities; exponent bias 7; 0x7f/0xff are NaN, largest finite 448) and e5m2
  (IEEE-like; bias 15; largest finite 57344). Every bit pattern's value is computed from sign,
  exponent and mantissa (subnormals when the exponent field is 0); a float32 value is encoded as
  the nearest finite pattern, ties to the even pattern (mantissa's last bit 0), after clamping to
  the largest finite value (vLLM's saturating cast); the sign bit is the input's.
- kvc's semantics (vLLM's): code = encode(x / scale), x' = decode(code) * scale, one scale per
  layer for K and one for V (or one per KV head): 1.0 ("unit") or max|x| of the layer's (head's)
  first stored chunk divided by 200 (K) or 100 (V) ("dynamic"), fixed from then on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references import harness

FORMATS = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias
RANGES = {"k": 200.0, "v": 100.0}
NAME = "kvc_fp8_reference"


def table(fmt: str) -> np.ndarray:
    """The value of every bit pattern 0..255 (float64; NaN and infinities as such)."""
    e_bits, m_bits, bias = FORMATS[fmt]
    out = np.empty(256)
    for code in range(256):
        sign = -1.0 if code >> 7 else 1.0
        exp = (code >> m_bits) & ((1 << e_bits) - 1)
        man = code & ((1 << m_bits) - 1)
        if fmt == "e4m3" and exp == 15 and man == 7:
            out[code] = np.nan
        elif fmt == "e5m2" and exp == 31:
            out[code] = sign * np.inf if man == 0 else np.nan
        elif exp == 0:
            out[code] = sign * man / (1 << m_bits) * 2.0 ** (1 - bias)
        else:
            out[code] = sign * (1 + man / (1 << m_bits)) * 2.0 ** (exp - bias)
    return out


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 values -> uint8 bit patterns: the magnitude clamped to the largest finite, nearest,
    ties to the even pattern; the sign bit copied (negative zero stays negative)."""
    values = table(fmt)[:128]  # the non-negative patterns
    codes = np.arange(128)[np.isfinite(values)]
    grid = values[codes]
    flat = x.astype(np.float64).ravel()
    magnitude = np.minimum(np.abs(flat), grid.max())
    dist = np.abs(magnitude[:, None] - grid[None, :])
    tied = dist == dist.min(axis=1, keepdims=True)
    pick = codes[np.where(tied, codes[None, :] & 1, 2).argmin(axis=1)]
    return (pick | np.where(np.signbit(flat), 0x80, 0)).astype(np.uint8).reshape(x.shape)


def decode(codes: np.ndarray, fmt: str) -> np.ndarray:
    return table(fmt)[codes.astype(np.int64)]


def round_trip(x: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """x as stored and read back: decode(encode(x / scale)) * scale, in float32."""
    y = (x.float() / np.float32(scale)).numpy()
    return torch.from_numpy(decode(encode(y, fmt), fmt).astype(np.float32)) * np.float32(scale)


@dataclass
class Session:
    """A layer-by-layer cache of K/V as the FP8 cache holds them (already round-tripped)."""

    fmt: str | None = "e4m3"  # None: K/V kept exact (FP8 switched off)
    scaling: str = "unit"
    per_head: bool = False  # one scale per KV head (`along key, channel`), else one for all
    scales: dict = field(default_factory=dict)  # (layer, "k"|"v") -> the fixed scale of each KV head
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

    def stored(self, layer: int, which: str, x: torch.Tensor) -> torch.Tensor:
        """x [Hkv, c, D] as the cache holds it; the first call of a layer fixes its scales, one per KV
        head (equal unless `per_head`), stored in the model dtype as the cache stores them."""
        if self.fmt is None:
            return x.float()
        if (layer, which) not in self.scales:
            amax = x.float().abs().amax(dim=(1, 2)) if self.per_head else x.float().abs().max().expand(x.shape[0])
            scales = [1.0 if self.scaling == "unit" else float(np.float32(float(a) / RANGES[which])) for a in amax]
            self.scales[layer, which] = [float(torch.tensor(s).to(x.dtype)) for s in scales]
        return torch.cat([round_trip(x[h:h + 1], s, self.fmt) for h, s in enumerate(self.scales[layer, which])])


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s, layer = _active, module.layer_idx
    k, v = s.stored(layer, "k", key[0]), s.stored(layer, "v", value[0])  # [Hkv, c, D]
    if len(s.keys) <= layer:
        s.keys.append(k[:, :0])
        s.values.append(v[:, :0])
    s.keys[layer] = torch.cat([s.keys[layer], k.to(key.dtype).float()], dim=1)
    s.values[layer] = torch.cat([s.values[layer], v.to(value.dtype).float()], dim=1)
    return harness.causal_attention(query, s.keys[layer], s.values[layer], scaling), None


AttentionInterface.register(NAME, _attention)


def _forward(model: PreTrainedModel, session: Session, ids: list[int]) -> torch.Tensor:
    global _active
    _active = session
    try:
        return harness.forward(model, NAME, ids, session.length)
    finally:
        _active = None


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy: `prompt` as one chunk, then `steps - 1` decode steps; the tokens and their logits."""
    logits = [_forward(model, session, prompt)[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
