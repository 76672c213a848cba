"""Prefill records: one prompt's prefill, captured by one engine and taken by others without running
the model again (docs/design.md, "Prefill records").

What a KV method does at prefill does not change the forward: its prefill hooks run after each
layer's attention and compress only what is stored, once prefill ends (the exceptions, whose engines
neither record nor replay: `Engine.shares_prefills`). So the model's per-layer
attention inputs for a prompt (post-RoPE q, k, v of every token) and the logits of its last token
are the same under every method. An engine records them for a request
(`Engine.add_request(..., record=PrefillRecord())`); another engine, with any method, takes them
(`add_request(..., replay=record)`): its runner stores the recorded K/V into its own pages, runs
its method's prefill hooks on the recorded q/k/v and samples the first token from the recorded
logits, skipping the model's layers and the attention output nobody reads. Everything after the
prefill (compaction, decode, chains) runs as usual. A step replays only when every sequence in it
replays a chunk its record covers; any other step runs the model (results are the same, only
slower), and `EngineConfig.prefill_first` keeps decodes out of prefill steps so that replays are
not mixed with them. The values are bit-identical to the recording engine's forward; against a
direct prefill in the replaying engine they are identical when both engines batch the prompts
alike (the same scheduling), since a matrix product's rounding can depend on how many rows it
multiplies at once. `kvc eval` prefills each case once and replays it into every method and budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillRecord:
    """Per layer the chunks of q [n, Hq, D], k and v [n, Hkv, D] in prompt order, and the logits
    [vocab] (float32) of the prompt's last token; `tokens` the prompt it was recorded for."""

    tokens: tuple[int, ...] = ()
    logits: torch.Tensor | None = None
    invalid: bool = False  # a chunk skipped tokens (a prefix-cache hit): this record can never complete
    # state a method's prefill hooks compute from the recorded q/k/v alone (shared by every engine
    # that replays the record; keys say which method, parameters, layer and chunk)
    memo: dict = field(default_factory=dict, repr=False)
    _chunks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = field(default_factory=list, repr=False)
    _layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = field(default=None, repr=False)

    # ---- recording (the runner of the engine that prefills) ---------------------------------
    def start(self, tokens: list[int], num_layers: int) -> None:
        self.tokens, self.logits, self._layers, self.invalid = tuple(tokens), None, None, False
        self.memo = {}
        self._chunks = [[] for _ in range(num_layers)]

    def add(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._chunks[layer].append((q.clone(), k.clone(), v.clone()))

    @property
    def recorded(self) -> int:
        """Prompt tokens recorded so far (layer 0's; every layer gets the same chunks)."""
        if self._layers is not None:
            return self._layers[0][0].shape[0]
        return sum(q.shape[0] for q, _, _ in self._chunks[0]) if self._chunks else 0

    @property
    def complete(self) -> bool:
        return (bool(self.tokens) and not self.invalid and self.logits is not None
                and self.recorded == len(self.tokens))

    # ---- replaying (the runner of an engine that takes the prefill) -------------------------
    def covers(self, start: int, n: int) -> bool:
        return self.complete and 0 <= start and start + n <= len(self.tokens)

    def rows(self, layer: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens [start, start + n) of layer `layer`: (q, k, v)."""
        if self._layers is None:
            self._layers = [tuple(torch.cat(part) for part in zip(*chunks)) for chunks in self._chunks]
            self._chunks = []
        q, k, v = self._layers[layer]
        return q[start:start + n], k[start:start + n], v[start:start + n]
