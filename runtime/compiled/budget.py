"""A compiled method's `KVBudget`: the physical tokens per layer the scheduler reserves for a request.

The formulas are the compiler's (hooks.py `held_tokens`); docs/design.md, "Compiled methods" (the
steady state) and "Decode-time eviction" (the decode bound), says why they hold.
"""

from __future__ import annotations

from typing import Any, Callable


class CompiledBudget:
    """Peak: the whole prompt per layer; steady: the generated bound on a layer's physical length
    (its most-keeping KV head, `held_tokens`) + generated tokens, bounded by the decode-time keep
    when the method has one (`decode_bound`, set by the adapter)."""

    def __init__(self, held_tokens: Callable, params: dict[str, Any], num_layers: int, num_kv_heads: int) -> None:
        self.held_tokens, self.params = held_tokens, params
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.decode_bound: Callable[[int, int, int], int] | None = None  # (prompt_len, physical, layer) -> most held
        # (prompt_len, layer) -> what a layer holds after prefill, where the generated `held_tokens`
        # cannot say (a per-head keep on a per-head cache layer, set by the adapter)
        self.prefill_kept: Callable[[int, int], int] | None = None
        self.replay_tokens = 0  # what a replay pass stores for a chunk besides the prompt (runtime/context_replay.py)

    def kept(self, prompt_len: int, layer: int) -> int:
        """Physical tokens (slots) layer `layer` holds at most after prefill end."""
        if self.prefill_kept is not None:
            return min(prompt_len, self.prefill_kept(prompt_len, layer))
        return min(prompt_len, int(self.held_tokens(prompt_len, layer, self.num_layers, self.num_kv_heads,
                                                    self.params)))

    def peak_tokens(self, prompt_len: int, layer: int) -> int:
        return prompt_len + self.replay_tokens

    def steady_tokens(self, prompt_len: int, context_len: int, layer: int) -> int:
        """Tokens held at `context_len` by a request whose prefill compressed `prompt_len` tokens."""
        grown = self.kept(prompt_len, layer) + max(0, context_len - prompt_len)
        return grown if self.decode_bound is None else self.decode_bound(prompt_len, grown, layer)
