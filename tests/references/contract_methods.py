"""Hand-written oracles of the two contract test methods (tests/runtime/contract_methods.py).

A Hugging Face model runs with our own attention (transformers' `AttentionInterface`) over a cache
we hold per layer: exact keys and values [Hkv, n, D], float32. What each query reads follows the
papers' rules, written here from scratch (no kvc code):

- page top-k: prefill attends densely; a decode query of KV head h attends only to the tokens of
  the `pages` pages (runs of `page_size` slots) with the largest bound
  sum_d max(q_d * max_page k_d, q_d * min_page k_d), maximised over h's query heads, the newest
  page always among them (`dense_layers`, default 0: the first layers read every page);
- int8 keys: every key is seen as int8-quantized (per token, symmetric: scale = max |k| / 127,
  code = round half up, clamped to +-127) except the newest `r` of a layer, seen exactly; r grows by
  the tokens stored (at most `window`) and drops to 0 when a prefill ends or a decode step ends with
  r == window (the window re-encoded); a step sees its own tokens and the window's newest (at most
  window - 1 of them) exactly.

`Session` keeps the cache between calls, so a chain's next turn, a fork or a prefix-cache hit is
the same session continued (or a copy of it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel

NAME = "kvc_contract_reference"


@dataclass
class Session:
    method: str  # "pagetopk" | "int8keys"
    params: dict[str, Any]
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [Hkv, n, D]
    values: list[torch.Tensor] = field(default_factory=list)
    resid: list[int] = field(default_factory=list)  # int8keys: per layer, the newest slots seen exactly
    decoding: bool = False

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[1]

    def copy(self) -> Session:
        return copy.deepcopy(self)

    def truncate(self, n: int, resid: int | None = None) -> Session:
        """The first n tokens of the cache (a prefix-cache hit: its pages, read as stored)."""
        out = self.copy()
        out.keys = [k[:, :n] for k in out.keys]
        out.values = [v[:, :n] for v in out.values]
        out.resid = [0 if resid is None else resid for _ in out.resid]
        return out


_active: Session | None = None


def _int8(k: torch.Tensor) -> torch.Tensor:
    scale = k.abs().amax(-1, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.floor(k / scale + 0.5).clamp(-127, 127) * scale


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, dropout: float = 0.0, scaling: float | None = None, **kwargs: Any):
    s = _active
    layer = module.layer_idx
    q, k, v = query[0].float(), key[0].float(), value[0].float()  # [Hq, c, D], [Hkv, c, D]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    while len(s.keys) <= layer:
        s.keys.append(k[:, :0])
        s.values.append(v[:, :0])
        s.resid.append(0)
    s.keys[layer] = torch.cat([s.keys[layer], k], dim=1)
    s.values[layer] = torch.cat([s.values[layer], v], dim=1)
    keys, values = s.keys[layer], s.values[layer]
    kv_heads, n, new = keys.shape[0], keys.shape[1], k.shape[1]
    group = q.shape[0] // kv_heads
    if s.method == "int8keys":
        before = s.resid[layer]
        s.resid[layer] = min(before + new, s.params["window"])
        exact = min(before, s.params["window"] - 1) + new  # the step's tokens and the window's newest
        keys = torch.cat([_int8(keys[:, : n - exact]), keys[:, n - exact:]], dim=1)
    visible = torch.ones(kv_heads, new, n, dtype=torch.bool)
    visible &= torch.arange(n)[None, None, :] <= torch.arange(n - new, n)[None, :, None]  # causal
    if s.method == "pagetopk" and s.decoding and layer >= s.params.get("dense_layers", 0):
        size, count = s.params["page_size"], s.params["pages"]
        pages = -(-n // size)
        kmax = torch.stack([keys[:, i * size:(i + 1) * size].amax(1) for i in range(pages)], dim=1)  # [Hkv, P, D]
        kmin = torch.stack([keys[:, i * size:(i + 1) * size].amin(1) for i in range(pages)], dim=1)
        qg = q[:, -1].view(kv_heads, group, 1, -1)  # [Hkv, G, 1, D]
        bound = torch.maximum(qg * kmax[:, None], qg * kmin[:, None]).sum(-1).amax(1)  # [Hkv, P]
        bound[:, -1] = float("inf")
        chosen = bound.topk(min(count, pages), dim=-1).indices  # [Hkv, n chosen]
        slot_page = torch.arange(n) // size
        visible[:, -1] &= (slot_page[None, :, None] == chosen[:, None, :]).any(-1)
    outs = []
    for h in range(kv_heads):
        logits = q[h * group:(h + 1) * group] @ keys[h].T * scale  # [G, c, n]
        probs = logits.masked_fill(~visible[h][None], float("-inf")).softmax(-1)
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


def _turn_end(session: Session) -> None:
    """A prefill or a decode step ended: a full int8 window is re-encoded."""
    if session.method == "int8keys":
        session.resid = [0 if r >= session.params["window"] else r for r in session.resid]


def generate(model: PreTrainedModel, session: Session, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy: prefill `prompt` onto the session (one chunk), then `steps - 1` decode steps; the
    tokens and their logits [steps, vocab]."""
    session.decoding = False
    logits = [_forward(model, session, prompt)[-1]]
    _turn_end(session)
    tokens = [int(logits[-1].argmax())]
    session.decoding = True
    for _ in range(steps - 1):
        logits.append(_forward(model, session, [tokens[-1]])[-1])
        _turn_end(session)
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)
