"""The grammar matchers of the sequences with structured outputs, and their token masks.

One llguidance `LLMatcher` per sequence (runtime/structured_outputs.py gives its grammar). Before
a step samples, `constrain` masks each constrained row's logits to the tokens its grammar allows
(the bit masks are computed on the CPU, applied on the logits' device; rows without a grammar are
untouched, and a step with none costs nothing). When the step's tokens reach the host, `advance`
feeds them to the matchers. A grammar that is complete allows only the end-of-sequence tokens.
Steps with a constrained row are never scheduled ahead (runtime/scheduler.py): the next mask needs
this step's token. docs/design.md, "Structured outputs".
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from kvc.runtime.errors import InvalidSamplingParams

log = logging.getLogger(__name__)


class GrammarBook:
    """Matchers by sequence id, over one tokenizer (built on first use: about a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll = None
        self.matchers: dict[int, object] = {}

    def _tokenizer(self):
        if self._ll is None:
            import llguidance.hf

            # one EOS (older llguidance takes no list): a complete grammar allows the model's first
            # end-of-sequence id, which ends the sequence like any other
            self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                    eos_token=self.eos_token_ids[0] if self.eos_token_ids else None)
        return self._ll

    def matcher(self, grammar: str):
        """A fresh matcher of `grammar`; InvalidSamplingParams if this tokenizer cannot match it."""
        import llguidance

        if self._hf is None or not getattr(self._hf, "is_fast", False):
            raise InvalidSamplingParams("structured_outputs: this model has no (fast) tokenizer to constrain",
                                        param="structured_outputs")
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidSamplingParams(f"structured_outputs: the grammar was rejected: {matcher.get_error()}",
                                        param="structured_outputs")
        return matcher

    def add(self, seq_id: int, matcher) -> None:
        self.matchers[seq_id] = matcher

    def copy(self, src: int, dst: int) -> None:
        """`dst` continues from `src`'s state (a clone)."""
        if src in self.matchers:
            self.matchers[dst] = self.matchers[src].deep_copy()

    def remove(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)

    def constrained(self, seq_ids: Sequence[int]) -> list[int]:
        """The positions in `seq_ids` of the sequences that have a matcher."""
        return [i for i, s in enumerate(seq_ids) if s in self.matchers] if self.matchers else []

    def constrain(self, logits: torch.Tensor, seq_ids: Sequence[int]) -> torch.Tensor:
        """`logits` [N, V] with each constrained row's disallowed tokens at -inf (a new tensor when
        any row is constrained; `logits` itself otherwise)."""
        rows = self.constrained(seq_ids)
        if not rows:
            return logits
        words = (self.vocab_size + 31) // 32
        bits = torch.empty((len(rows), words), dtype=torch.int32)
        for j, i in enumerate(rows):
            matcher = self.matchers[seq_ids[i]]
            row = bits[j]
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            if matcher.is_error():  # cannot happen for tokens this mask allowed; logged, row freed
                log.warning("structured outputs: sequence %s: %s", seq_ids[i], matcher.get_error())
                row.fill_(-1)
        dev = logits.device
        allowed = unpack_bits(bits if dev.type == "cpu" else bits.to(dev, non_blocking=True), logits.shape[1])
        if len(rows) == logits.shape[0]:
            return torch.where(allowed, logits.float(), float("-inf"))
        out = logits.float().clone()
        index = torch.tensor(rows, device=dev)
        out.index_copy_(0, index, torch.where(allowed, out.index_select(0, index), float("-inf")))
        return out

    def advance(self, tokens: dict[int, int]) -> None:
        """Feeds each constrained sequence its newly sampled token."""
        for seq_id, token in tokens.items():
            matcher = self.matchers.get(seq_id)
            if matcher is not None and not matcher.is_stopped() and not matcher.consume_token(token):
                log.warning("structured outputs: sequence %s: %s", seq_id, matcher.get_error())


_BYTE_BITS: dict[torch.device, torch.Tensor] = {}  # per device: [256, 8] bool, bit k of each byte value


def unpack_bits(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 bit masks (bit b of word w: token 32 w + b) -> [R, vocab_size] bool.

    Read as little-endian bytes, token t is bit t % 8 of byte t // 8: numpy's unpackbits on the
    CPU (20 us at a 49K vocabulary, where a shift per bit over [R, W, 32] took 20 ms), a lookup
    table per byte on a GPU."""
    octets = bits.contiguous().view(torch.uint8)  # [R, 4 W]
    if bits.device.type == "cpu":
        unpacked = np.unpackbits(octets.numpy(), axis=1, bitorder="little")[:, :vocab_size]
        return torch.from_numpy(unpacked.view(np.bool_))
    table = _BYTE_BITS.get(bits.device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32)[:, None]
        table = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(bits.device)
        _BYTE_BITS[bits.device] = table
    return table[octets.long()].reshape(bits.shape[0], -1)[:, :vocab_size]
