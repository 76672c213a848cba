"""Token ids -> the text a client sees, one step at a time: incremental detokenization and stop
strings.

The engine hands the server new token ids per step; `ChoiceText` turns them into text deltas:

1. `IncrementalDetokenizer` decodes a sliding window of ids and emits text only once it decodes
   cleanly. A byte-level tokenizer splits one multi-byte UTF-8 character over several tokens; until
   the last byte arrives the window ends in U+FFFD, and nothing is emitted. The concatenated deltas
   equal `tokenizer.decode(all ids)`.
2. `StopStrings` finds the first stop string in the text and cuts there. While streaming it holds
   back the longest tail that could still grow into a stop string, so a client never sees half of
   one that then matches. Until `min_tokens` tokens are out, no stop string is looked for (vLLM's
   rule): text of those tokens can never start a match.
3. `TokenStrings` names single tokens for logprobs: each token's text and its exact bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), as char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenStrings:
    """A token's text and bytes as the logprobs of a response show them (cached per id). Byte-level
    tokenizers give each token's exact bytes (a token may hold part of a UTF-8 character); others
    the UTF-8 of its decoded text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token; without a tokenizer the text is `token_id:N`."""
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._strings(token_id)
        return got

    def _strings(self, token_id: int) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
            return text, list(text.encode())
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if self._alphabet is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)  # special tokens are not byte pieces
            if piece and token_id not in self._special and all(c in self._alphabet for c in piece):
                return text, [self._alphabet[c] for c in piece]
        return text, list(text.encode())


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
        self.matched: str | None = None  # the stop string that ended the text
        self._unchecked = 0  # text before this was added with `check` off: no match starts there

    def add(self, delta: str, check: bool = True) -> str:
        """Appends decoded text; returns what may be shown now. Sets `stopped` on a match.
        `check` False: the text is shown as it is, and no later match may start in it."""
        if self.stopped:
            return ""
        if not check:
            self.text += delta
            self._unchecked = len(self.text)
            return self._emit_to(len(self.text))
        # a new match must touch the delta
        start = max(0, self._unchecked, len(self.text) - self._longest + 1)
        self.text += delta
        if not self.stop:
            return self._emit_to(len(self.text))
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) != -1]
        if hits:
            i, s = min(hits)
            self.stopped, self.matched = True, s
            end = i + len(s) if self.include_in_output else i
            self.text = self.text[:end]
            return self._emit_to(end)
        return self._emit_to(len(self.text) - self._partial_match())

    def flush(self) -> str:
        """The held-back tail, once the sequence has ended without completing a stop string."""
        return "" if self.stopped else self._emit_to(len(self.text))

    def _partial_match(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        for n in range(min(self._longest - 1, len(self.text) - max(self.emitted, self._unchecked)), 0, -1):
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
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stops = StopStrings(stop, include_stop_str_in_output)
        self.min_tokens = min_tokens  # stop strings count only after this many tokens
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
            out.append(self.stops.add(self.detok.add([t]), check=len(self.token_ids) > self.min_tokens))
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
