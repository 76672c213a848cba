"""The replay pass's hooks of a compiled method: `replay_chunk` and `replay_end`.

docs/design.md, "Replay", is the design; the engine side (the replayed chunks through the model)
is runtime/context_replay.py. A replayed chunk's hook runs over the keys its chunk reconstructs: its `attn`
is the replayed queries' attention on those keys ([head, query, key], normalised over the sink keys,
the chunk and the replayed tokens, as the `replay ... over first s` declaration says), and its state
is the chunk's slice of the per-(sequence, layer) state, written back after the hook. `replay_end`
ranks every layer's state at once (a top across layers) and gives one keep plan per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from kvc.runtime.compiled.folder import GeneratedCode
from kvc.runtime.kv.plans import keep_plan
from kvc.runtime.method_api import KeepPlan


class ReplayHooks:
    """A compiled method's replay hooks and the state they build per (sequence, layer) (`spec`: the
    generated `replay(params)`, or None when the method declares no replay pass)."""

    def __init__(self, code: GeneratedCode, params: dict[str, Any]) -> None:
        replay = getattr(code.hooks, "replay", None)
        self.spec: dict[str, Any] | None = replay(params) if replay is not None else None
        self.params, self.states = params, code.states
        self.state: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        if self.spec is not None:
            self.chunk_fn = code.required("replay_chunk")
            self.end_scores = code.required("replay_end_scores")
            self.end_select = code.required("replay_end_select")

    def chunk(self, seq_id: int, layer: int, num_layers: int, q: torch.Tensor, attn: torch.Tensor, start: int,
              context_len: int, num_kv_heads: int) -> None:
        """`replay_chunk` of one layer: q [Hq, n, D] the replayed queries, attn [Hq, n, c] their attention on
        the context keys [start, start + c)."""
        key = (seq_id, layer)
        full = self.state.get(key)
        if full is None:
            full = self.state[key] = {name: torch.zeros(num_kv_heads, context_len, device=q.device)
                                      for name in self.states}
        width = attn.shape[-1]
        part = {name: value[:, start:start + width].clone() for name, value in full.items()}
        sym = {"context": width, "prompt": context_len, "step": 0, "layer": layer, "layers": num_layers,
               "heads": q.shape[0], "kv_heads": num_kv_heads, "head_dim": q.shape[-1]}
        out = self.chunk_fn({"q": q, "attn": attn}, part, sym, self.params)
        for name, value in out.items():
            full[name][:, start:start + width] = value[:, :width]

    def end(self, seq_id: int, num_layers: int, context_len: int, num_kv_heads: int) -> list[KeepPlan]:
        """`replay_end`: every layer's keep plan from one ranking over all of them (per-head counts on
        the CPU: host facts)."""
        layers = [self.state.pop((seq_id, layer)) for layer in range(num_layers)]
        state = {name: torch.stack([layer[name] for layer in layers]) for name in self.states}
        sym = {"context": context_len, "prompt": context_len, "step": 0, "layer": None, "layers": num_layers,
               "heads": None, "kv_heads": num_kv_heads, "head_dim": None}
        scores = self.end_scores({}, state, sym, self.params)
        return [keep_plan(kept, scores.device) for kept in self.end_select(scores, sym, self.params)]

    def release(self, seq_id: int) -> None:
        for key in [key for key in self.state if key[0] == seq_id]:
            del self.state[key]
