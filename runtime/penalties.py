"""Presence, frequency and repetition penalties: the per-request token counts they read, kept on
the device, and the formulas the sampler applies (runtime/sampler.py).

Each request with a penalty holds one row of two device buffers: how often each vocabulary token
was generated, and which tokens its prompt holds. Rows are filled when the request is first
sampled and updated right after each of its sampled tokens, on the device (`TokenCounts.add`):
with async scheduling the next step is launched before the host knows the token, and the stream
orders the update before that step's sampler. A row is freed when the request ends; the buffers
exist only once some request asks for a penalty. docs/design.md, "Sampling".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvc.runtime.transfer import to_device


class TokenCounts:
    """Generated-token counts and prompt masks of the requests with penalties, one row each."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.slots: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = []
        self.counts: torch.Tensor | None = None  # [rows, V] float32
        self.prompt: torch.Tensor | None = None  # [rows, V] bool

    def rows(self, seqs: Sequence) -> torch.Tensor:
        """The rows of `seqs` (device int64), giving a row to each sequence that has none yet (its
        prompt marked, its committed output counted)."""
        fresh = [seq for seq in seqs if seq.seq_id not in self.slots]
        for seq in fresh:
            self.slots[seq.seq_id] = self._take()
        if fresh:
            slots = to_device([self.slots[s.seq_id] for s in fresh], self.device, torch.int64)
            self.counts.index_fill_(0, slots, 0)
            self.prompt.index_fill_(0, slots, False)
            for seq, slot in zip(fresh, [self.slots[s.seq_id] for s in fresh]):
                prompt = to_device(seq.token_ids[: seq.num_prompt_tokens], self.device, torch.int64)
                self.prompt[slot].index_fill_(0, prompt, True)
                if seq.num_generated:
                    out = to_device(seq.generated_ids, self.device, torch.int64)
                    self.counts[slot].index_add_(0, out, torch.ones(len(out), device=self.device))
        return to_device([self.slots[s.seq_id] for s in seqs], self.device, torch.int64)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts each row's newly sampled token (device tensors, no host sync)."""
        ones = torch.ones(len(rows), device=self.device, dtype=self.counts.dtype)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def _take(self) -> int:
        if not self._free:
            old = 0 if self.counts is None else self.counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
            prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            if self.counts is not None:
                counts[:old].copy_(self.counts)
                prompt[:old].copy_(self.prompt)
            self.counts, self.prompt = counts, prompt
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor, presence: torch.Tensor,
                    frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """logits [R, V] with each row's penalties ([R] each) over its counts and prompt mask [R, V].

    repetition (vLLM / HF): every token of the prompt or the output has its logit divided by r
    when positive, multiplied by r otherwise. frequency and presence (OpenAI): over the output
    only, logit - frequency x count - presence x (count > 0)."""
    seen = counts > 0
    r = repetition[:, None]
    logits = torch.where(seen | prompt, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * seen.to(logits.dtype)
