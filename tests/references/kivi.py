"""A hand-written KIVI reference (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", arXiv 2402.02750), written from the paper's algorithm and the reference
implementation's description, with no kvc code: the numpy quantizer kvc's encodings must match bit
for bit, and the oracle of a model served with KIVI (a Hugging Face model whose attention reads
keys and values as KIVI's cache holds them).

Quantizer (asymmetric, per group, float32): `mn = min`, `mx = max`, `scale = (mx - mn) / (2^b - 1)`
(1 for a group of equal values, where the reference would divide by 0), `code = round(clip((x - mn)
/ scale, 0, 2^b - 1))` with ties to even (torch's `round_`), `x' = code * scale + mn`. Keys are
quantized per channel over groups of `group` consecutive tokens, values per token over groups of
`group` consecutive channels.

Cache, per layer: quantized keys and values (kept decoded, `x'`) and the full-precision parts. A step
of c new tokens attends over [quantized, full, the step's own] in that order, the step's own exact
(KIVI's prefill attends in full precision; its decode appends the token to the full part first).
Then the new keys join the full part, and while it holds `residual` tokens or more its oldest
`residual` are quantized (whole groups: `residual` is a multiple of `group`); the new values join
theirs, and all but the newest `residual` are quantized. From an empty cache this is the
reference's prefill (the first `L - L % R` keys and `L - R` values quantized); one token at a time,
its decode. A continued session (a chain's next turn) follows the same rules. Layers in
`dense_layers` quantize nothing (every key and value exact).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel

from tests.references import harness

NAME = "kvc_kivi_reference"


def quantize_groups(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups along the last axis of x [..., g] (float32) -> (codes [..., g] uint8, scale [...], mn [...])."""
    x = x.astype(np.float32)
    mn, mx = x.min(-1), x.max(-1)
    qmax = np.float32(2**bits - 1)
    scale = ((mx - mn) / qmax).astype(np.float32)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    y = np.clip((x - mn[..., None]) / scale[..., None], 0, qmax)
    return np.rint(y).astype(np.uint8), scale, mn  # rint: ties to even


def dequantize_groups(codes: np.ndarray, scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float32) * scale[..., None] + mn[..., None]).astype(np.float32)


def keys_round_trip(k: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Keys [H, n, D] (n a multiple of group) as the cache decodes them: per channel, groups of tokens."""
    h, n, d = k.shape
    grouped = k.reshape(h, n // group, group, d).transpose(0, 1, 3, 2)  # [H, n/g, D, g]
    back = dequantize_groups(*quantize_groups(grouped, bits))
    return back.transpose(0, 1, 3, 2).reshape(h, n, d)


def values_round_trip(v: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Values [H, n, D] as the cache decodes them: per token, groups of channels."""
    h, n, d = v.shape
    grouped = v.reshape(h, n, d // group, group)
    return dequantize_groups(*quantize_groups(grouped, bits)).reshape(h, n, d)


@dataclass
class Session:
    bits: int = 2
    group: int = 32
    residual: int = 128
    keys_q: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, n, D], decoded
    keys_full: list[torch.Tensor] = field(default_factory=list)
    values_q: list[torch.Tensor] = field(default_factory=list)
    values_full: list[torch.Tensor] = field(default_factory=list)
    dense_layers: frozenset[int] = frozenset()  # layers that keep every key and value exact

    @property
    def length(self) -> int:
        return 0 if not self.keys_q else self.keys_q[0].shape[1] + self.keys_full[0].shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int) -> Session:
        """The first n tokens as a prefix-cache hit reads them: its pages as stored, every key and value
        from its codes (the hit's window starts empty). n must end a flushed key block."""
        out = self.copy()
        for layer in range(len(out.keys_q)):
            if layer in out.dense_layers:
                out.keys_full[layer] = out.keys_full[layer][:, :n]
                out.values_full[layer] = out.values_full[layer][:, :n]
                continue
            if out.keys_q[layer].shape[1] < n:
                raise ValueError(f"keys past {out.keys_q[layer].shape[1]} have no codes yet: no hit of {n}")
            full_v = out.values_full[layer]
            coded_v = full_v
            if full_v.shape[1]:
                coded_v = torch.from_numpy(values_round_trip(full_v.numpy(), self.bits, self.group))
            out.keys_q[layer] = out.keys_q[layer][:, :n]
            out.values_q[layer] = torch.cat([out.values_q[layer], coded_v], dim=1)[:, :n]
            out.keys_full[layer], out.values_full[layer] = out.keys_full[layer][:, :0], full_v[:, :0]
        return out

    def step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a step of new k, v [Hkv, c, D] attends over; then the cache takes them."""
        if len(self.keys_q) <= layer:
            for parts in (self.keys_q, self.keys_full, self.values_q, self.values_full):
                parts.append(k[:, :0].float())
        keys = torch.cat([self.keys_q[layer], self.keys_full[layer], k.float()], dim=1)
        values = torch.cat([self.values_q[layer], self.values_full[layer], v.float()], dim=1)
        full_k = torch.cat([self.keys_full[layer], k.float()], dim=1)
        if layer in self.dense_layers:
            self.keys_full[layer] = full_k
            self.values_full[layer] = torch.cat([self.values_full[layer], v.float()], dim=1)
            return keys, values
        flush = full_k.shape[1] // self.residual * self.residual
        if flush:
            done = keys_round_trip(full_k[:, :flush].numpy(), self.bits, self.group)
            self.keys_q[layer] = torch.cat([self.keys_q[layer], torch.from_numpy(done)], dim=1)
        self.keys_full[layer] = full_k[:, flush:]
        full_v = torch.cat([self.values_full[layer], v.float()], dim=1)
        old = max(0, full_v.shape[1] - self.residual)
        if old:
            done = values_round_trip(full_v[:, :old].numpy(), self.bits, self.group)
            self.values_q[layer] = torch.cat([self.values_q[layer], torch.from_numpy(done)], dim=1)
        self.values_full[layer] = full_v[:, old:]
        return keys, values


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    keys, values = _active.step(module.layer_idx, key[0], value[0])
    return harness.causal_attention(query, keys, values, scaling), None


AttentionInterface.register(NAME, _attention)


def _forward(model: PreTrainedModel, session: Session, ids: list[int]) -> torch.Tensor:
    global _active
    _active = session
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
        out = _forward(model, session, prompt[i:i + size])
    logits = [out[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
