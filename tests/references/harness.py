"""What the hand-written references of storage methods share (tests/references/fp8.py, kivi.py, palu.py,
deltakv.py): causal attention of a step's queries over the keys and values the method lets them read,
one forward of a Hugging Face model with such an attention function registered under `name`, and the
model's RoPE applied (or undone) by hand, for keys cached before it."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """x [H, n, D] float32 rotated (rotate-half pairs (i, i + D/2)) by sign x the positions' angles."""
    angle = positions.double()[:, None] * inv_freq.double()[None, :] * sign
    cos, sin = angle.cos().float(), angle.sin().float()
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    """query [1, Hq, c, D] (as transformers passes it), keys / values [Hkv, n, D] float32 whose last c
    are the step's own -> the output [1, c, Hq, D] in the query's dtype: plain causal softmax, each
    KV head for its group of query heads."""
    q = query[0].float()
    kv_heads, n, new = keys.shape[0], keys.shape[1], q.shape[1]
    group = q.shape[0] // kv_heads
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    causal = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]
    outs = []
    for h in range(kv_heads):
        logits = q[h * group:(h + 1) * group] @ keys[h].T * scale
        outs.append(logits.masked_fill(~causal, float("-inf")).softmax(-1) @ values[h])
    return torch.cat(outs).transpose(0, 1)[None].to(query.dtype)


def forward(model: PreTrainedModel, name: str, ids: list[int], start: int) -> torch.Tensor:
    """Logits [len(ids), vocab] float32 of `ids` at positions start.. with attention `name` (registered
    with transformers' AttentionInterface; the caller sets what it reads), no cache."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids]), position_ids=torch.arange(start, start + len(ids))[None],
                         use_cache=False).logits[0].float()
    finally:
        model.set_attn_implementation(previous)
