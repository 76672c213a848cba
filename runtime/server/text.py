"""Token ids -> the text a client sees, one step at a time: incremental detokenization and stop
strings.

The engine hands the server new token ids per step; `ChoiceText` turns them into text deltas:

1. `IncrementalDetokenizer` decodes a sliding window of ids and emits text only once it decodes
   cleanly. A byte-level tokenizer splits one multi-byte UTF-8 character over several tokens; until
   the last byte arrives the window ends in U+FFFD, and nothing is emitted. The concatenated deltas
   equal `tokenizer.decode(all ids)`.
2. `StopStrings` finds the first stop string in the text and cuts there. While streaming it holds
   back the longest tail that could still grow into a stop string, so a client never sees half of
   one that then matches.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # The window decoded each time starts at the last emitted chunk, kept as left context for
        # tokenizers whose decoding depends on the neighbour (sentencepiece's leading spaces).
        self._prefix = 0
        self._read = 0  # ids before this are emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends ids; returns the text they complete (may be empty)."""
        self.ids.extend(token_ids)
        if self.tokenizer is None or not token_ids:
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or a special token that decodes to nothing)
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """The text still held back (a final incomplete character decodes as U+FFFD)."""
        if self.tokenizer is None or self._read == len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return now[len(before) :]


class StopStrings:
    """Cuts the text at the first stop string; holds back what might be the start of one."""

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_in_output = include_in_output
        self._longest = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything decoded so far
        self.emitted = 0  # chars of `text` handed out
        self.stopped = False

    def add(self, delta: str) -> str:
        """Appends decoded text; returns what may be shown now. Sets `stopped` on a match."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self._longest + 1)  # a new match must touch the delta
        self.text += delta
        if not self.stop:
            return self._emit_to(len(self.text))
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)
            self.stopped = True
            end = i + len(s) if self.include_in_output else i
            self.text = self.text[:end]
            return self._emit_to(end)
        return self._emit_to(len(self.text) - self._partial_match())

    def flush(self) -> str:
        """The held-back tail, once the sequence has ended without completing a stop string."""
        return "" if self.stopped else self._emit_to(len(self.text))

    def _partial_match(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def _emit_to(self, end: int) -> str:
        out = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out


class ChoiceText:
    """One choice's text: detokenizer then stop strings, fed one token at a time so that a stop
    string is attributed to the token that completed it."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stop, include_stop_str_in_output)
        self.token_ids: list[int] = []  # tokens that count as output (up to a stop match)

    @property
    def text(self) -> str:
        return self.stops.text[: self.stops.emitted]

    @property
    def stopped(self) -> bool:
        return self.stops.stopped

    def add(self, token_ids: Sequence[int]) -> str:
        """Feeds new tokens; returns the text that may be shown now."""
        out = []
        for t in token_ids:
            if self.stops.stopped:
                break
            self.token_ids.append(t)
            out.append(self.stops.add(self.detok.add([t])))
        return "".join(out)

    def add_silent(self, token_ids: Sequence[int]) -> None:
        """Counts tokens that produce no text (a stop token id ends the output, unshown)."""
        if not self.stops.stopped:
            self.token_ids.extend(token_ids)

    def finish(self) -> str:
        """Call once when the sequence ends: releases everything held back."""
        if self.stops.stopped:
            return ""
        return self.stops.add(self.detok.flush()) + self.stops.flush()
