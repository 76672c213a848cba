"""OmniKV (Hao et al. 2025, "OmniKV: Dynamic Context Selection for Efficient Long-Context LLMs"),
written by hand from the paper's algorithm (no kvc code): the oracle of methods/omnikv.kvm.

Nothing is evicted. In a decode step:
- layers before the first filter layer, and the filter layers, attend to every token;
- a filter layer also chooses the prompt tokens the next layers read: its step query's logits
  q.k / sqrt(d) over the prompt's keys, the largest over all query heads per token, the top
  floor(selected * prompt) of them (`choose`);
- every other layer past the first filter layer attends to the tokens the last filter layer chose
  plus every token after the prompt (the generated ones, the step's own included).
Prefill is dense.

`generate` runs a Hugging Face model with that attention (transformers' `AttentionInterface`) over
a cache we hold per layer (float32 keys and values [Hkv, n, D]); `Session` keeps the cache between
calls, so a chain's next turn, a fork or a prefix-cache hit is the same session continued (or a
copy). The prompt of a call is everything stored once its prefill ends (a chain turn's history
included), as the engine counts it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

NAME = "kvc_omnikv_reference"


def choose(q: torch.Tensor, keys: torch.Tensor, prompt: int, selected: float) -> torch.Tensor:
    """The prompt tokens a filter layer chooses, ascending: q [Hq, D] the step's query, keys
    [Hkv, n, D] every stored key (query head h reads KV head h // (Hq / Hkv))."""
    heads, kv_heads = q.shape[0], keys.shape[0]
    group = heads // kv_heads
    logits = torch.stack([keys[h // group, :prompt].float() @ q[h].float() for h in range(heads)])
    logits = logits / math.sqrt(q.shape[-1])  # [Hq, prompt]
    count = math.floor(selected * prompt)
    return logits.amax(0).topk(count).indices.sort().values


def reads(layer: int, filters: list[int]) -> str:
    """What a decode step's layer attends to: "all" or "chosen" (+ the generated tokens)."""
    return "all" if layer <= min(filters) or layer in filters else "chosen"


def visible(chosen: torch.Tensor, prompt: int, length: int) -> torch.Tensor:
    """[length] bool: the chosen prompt tokens and every token past the prompt."""
    mask = torch.zeros(length, dtype=torch.bool)
    mask[chosen] = True
    mask[prompt:] = True
    return mask


@dataclass
class Session:
    params: dict[str, Any]  # filters, selected
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, n, D]
    values: list[torch.Tensor] = field(default_factory=list)
    prompt: int = 0
    decoding: bool = False
    chosen: torch.Tensor | None = None  # the last filter layer's choice in this step
    choices: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (layer, chosen) of every step

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int) -> Session:
        """The first n tokens of the cache (a prefix-cache hit)."""
        out = self.copy()
        out.keys = [k[:, :n] for k in out.keys]
        out.values = [v[:, :n] for v in out.values]
        return out


_active: Session | None = None


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s = _active
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [Hq, c, D], [Hkv, c, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    while len(s.keys) <= layer:
        s.keys.append(k[:, :0])
        s.values.append(v[:, :0])
    s.keys[layer] = torch.cat([s.keys[layer], k], dim=1)
    s.values[layer] = torch.cat([s.values[layer], v], dim=1)
    keys, values = s.keys[layer], s.values[layer]
    kv_heads, n, new = keys.shape[0], keys.shape[1], k.shape[1]
    group = q.shape[0] // kv_heads
    seen = torch.arange(n)[None, :] <= torch.arange(n - new, n)[:, None]  # causal [c, n]
    filters = s.params["filters"]
    if s.decoding:
        if layer in filters:
            s.chosen = choose(q[:, -1], keys, s.prompt, s.params["selected"])
            s.choices.append((layer, s.chosen))
        elif reads(layer, filters) == "chosen":
            seen = seen & visible(s.chosen, s.prompt, n)[None, :]
    outs = []
    for h in range(kv_heads):
        logits = q[h * group:(h + 1) * group] @ keys[h].T * scale  # [G, c, n]
        probs = logits.masked_fill(~seen[None], float("-inf")).softmax(-1)
        outs.append(probs @ values[h])
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
    return out


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy: prefill `prompt` onto the session (one chunk, dense), then `steps - 1` decode steps;
    the tokens and their logits [steps, vocab]."""
    session.decoding = False
    logits = [_forward(model, session, prompt)[-1]]
    session.prompt = session.length
    tokens = [int(logits[-1].argmax())]
    session.decoding = True
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
