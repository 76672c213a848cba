"""Hand-written oracle of DuoAttention (Xiao et al. 2025) as kvc's .kvm states it, no kvc code.

A Hugging Face model runs with our own attention (transformers' `AttentionInterface`) over a cache
held per layer and per KV head: exact post-RoPE keys and values [n_h, D], float32. Retrieval heads
keep every token. A streaming head keeps its first `sink` tokens and its newest `recent` ones,
cut after every prefill chunk (its queries saw the stored tokens plus the chunk, causally) and after
every decode step (its query saw sink + recent + itself). The roles: the round(sparsity * L * Hkv)
lowest gates stream (`streaming_mask`, written from the definition, not from the quantile).

`Session` keeps the cache between calls (a chain's next turn, a fork: a copy of it).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

NAME = "kvc_duoattention_reference"


def streaming_mask(gate: torch.Tensor, sparsity: float) -> torch.Tensor:
    """bool [layers, kv_heads]: the round-half-up(sparsity * n) lowest gates (distinct gates)."""
    n = gate.numel()
    count = math.floor(sparsity * n + 0.5)
    order = gate.flatten().argsort()
    mask = torch.zeros(n, dtype=torch.bool)
    mask[order[:count]] = True
    return mask.view_as(gate)


@dataclass
class Session:
    streaming: torch.Tensor  # bool [layers, kv_heads]
    sink: int
    recent: int
    keys: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][head] -> [n_h, D]
    values: list[list[torch.Tensor]] = field(default_factory=list)
    length: int = 0  # logical tokens (RoPE positions)

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def cut(self) -> None:
        """Streaming heads keep their first `sink` and last `recent` tokens."""
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            for h in range(len(keys)):
                n = keys[h].shape[0]
                if not bool(self.streaming[layer, h]) or n <= self.sink + self.recent:
                    continue
                keep = torch.cat([torch.arange(min(self.sink, n)), torch.arange(n - self.recent, n)])
                keys[h], values[h] = keys[h][keep], values[h][keep]


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s = _active
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [Hq, c, D], [Hkv, c, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    kv_heads, new = k.shape[0], k.shape[1]
    while len(s.keys) <= layer:
        s.keys.append([k[h, :0] for h in range(kv_heads)])
        s.values.append([v[h, :0] for h in range(kv_heads)])
    group = q.shape[0] // kv_heads
    outs = []
    for h in range(kv_heads):
        keys = s.keys[layer][h] = torch.cat([s.keys[layer][h], k[h]])
        values = s.values[layer][h] = torch.cat([s.values[layer][h], v[h]])
        n = keys.shape[0]
        causal = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]  # [c, n]
        logits = q[h * group:(h + 1) * group] @ keys.T * scale  # [G, c, n]
        outs.append(logits.masked_fill(~causal[None], float("-inf")).softmax(-1) @ values)
    return torch.cat(outs).transpose(0, 1)[None].to(query.dtype), None


AttentionInterface.register(NAME, _attention)


def _forward(model: PreTrainedModel, session: Session, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of `ids` at positions session.length.., appended to the session."""
    global _active
    start = session.length
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _active = session
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                        use_cache=False).logits[0].float()
    finally:
        _active = None
        model.set_attn_implementation(previous)
    session.length += len(ids)
    return out


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int,
             chunk: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy: prefill `prompt` onto the session in chunks of `chunk` tokens (None: one chunk), each
    cut after it, then `steps - 1` decode steps, each cut after it; the tokens and their logits."""
    chunk = chunk or len(prompt)
    for first in range(0, len(prompt), chunk):
        last_logits = _forward(model, session, prompt[first:first + chunk])[-1]
        session.cut()
    logits = [last_logits]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        session.cut()
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
