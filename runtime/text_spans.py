"""Spans of a text partition: where a sequence's tokens end a span (`dim P = split(key, at = [...])`).

A method that reads the spans of its stored tokens (SkipKV's sentences, `methods/skipkv.kvm`) names the
strings that end a span; the compiler's hook fact `spans` carries them (compiler/hook_facts.py). A token
ends a span when the sequence's text through it ends with one of those strings and the string's last
character is the token's own (so ".\\n" ends a span whether the model wrote it as one token or as "."
and "\\n"). Span i holds the tokens after the i-th end, up to and including the (i+1)-th; the last span
is open. `TextSpans.index(seq)` gives each logical position its span; the engine maps stored slots to
them through the slots' recorded positions (KVSpec.positions), so the spans of the tokens a head still
stores after evictions are the spans they had when written. docs/design.md, "Text partitions".

Work: each token's text comes from the tokenizer once per vocabulary id; a sequence's ends are found
incrementally (the tokens past what an earlier call saw), so a step costs the tokens it added.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

MEMO_SEQUENCES = 4096  # sequences whose scanned prefix is remembered (least recently used dropped)


class TextSpans:
    """The span ends of one text partition over sequences' token ids (module docstring)."""

    def __init__(self, tokenizer, markers: list[str] | tuple[str, ...]) -> None:
        if not markers or any(not m for m in markers):
            raise ValueError("a text partition needs non-empty strings that end a span")
        self.tokenizer, self.markers = tokenizer, tuple(markers)
        self.longest = max(len(m) for m in self.markers)
        self._pieces: dict[int, str] = {}
        # seq_id -> (tokens scanned, their end flags, the text tail after them)
        self._memo: OrderedDict[int, tuple[list[int], list[bool], str]] = OrderedDict()
        self._last_index: tuple[int, int, int, np.ndarray] | None = None  # (seq_id, tokens, length, index)

    def piece(self, token: int) -> str:
        """A token's own text (decoded alone: special tokens as their text, no cleanup)."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=False,
                                                                clean_up_tokenization_spaces=False)
        return text

    def ends(self, tokens: list[int], seq_id: int | None = None) -> np.ndarray:
        """[len(tokens)] bool: does token t end a span (module docstring)."""
        scanned: list[int] = []
        flags: list[bool] = []
        tail = ""
        if seq_id is not None and seq_id in self._memo:
            scanned, flags, tail = self._memo[seq_id]
            self._memo.move_to_end(seq_id)
            if len(scanned) > len(tokens) or tokens[: len(scanned)] != scanned:  # another history: start over
                scanned, flags, tail = [], [], ""
        flags = list(flags)
        for token in tokens[len(scanned):]:
            piece = self.piece(token)
            text = tail + piece
            # the text ends with the piece: a marker it ends with ends inside the piece when the piece is not empty
            flags.append(bool(piece) and any(text.endswith(m) for m in self.markers))
            tail = text[-self.longest:]
        if seq_id is not None:
            self._memo[seq_id] = (list(tokens), flags, tail)
            while len(self._memo) > MEMO_SEQUENCES:
                self._memo.popitem(last=False)
        return np.asarray(flags, dtype=bool)

    def index(self, tokens: list[int], length: int, seq_id: int | None = None) -> np.ndarray:
        """[length] int64: the span of each logical position 0..length-1 (ends before it), from the tokens
        before it (a position past the known tokens takes the span after the last known one). Every layer of a
        step asks for the same sequence's index: the last one is kept (keyed by the tokens known and `length`)."""
        last = self._last_index
        if seq_id is not None and last is not None and last[:3] == (seq_id, len(tokens), length):
            return last[3]
        ends = self.ends(tokens[: max(0, length - 1)], seq_id)
        out = np.zeros(length, dtype=np.int64)
        known = len(ends)
        if length > 1 and known:
            out[1: known + 1] = np.cumsum(ends)
            out[known + 1:] = out[known]
        if seq_id is not None:
            self._last_index = (seq_id, len(tokens), length, out)
        return out
