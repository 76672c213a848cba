"""The engine's `TokenLogprobs` in OpenAI's two response shapes: chat's `logprobs.content[]` (token,
logprob, bytes, top_logprobs) and the legacy completions' `tokens` / `token_logprobs` /
`top_logprobs` / `text_offset`. Token texts and bytes come from `text.TokenStrings`.

JSON has no -inf: a token the sampler masked (top-k, top-p, min_p, min_tokens) is reported at
-9999.0, as vLLM does; so is a NaN that extreme parameters can give (a temperature or repetition
penalty near 0 overflows the logits).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvc.runtime.logprobs import TokenLogprobs
from kvc.runtime.server.text import TokenStrings

LOGPROB_FLOOR = -9999.0


def _floor(logprob: float) -> float:
    return min(logprob, 0.0) if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the test too


def chat_logprobs(entries: Sequence[TokenLogprobs], strings: TokenStrings) -> dict:
    """`{"content": [...]}`, one item per token: its text, logprob, bytes and top logprobs."""

    def item(token_id: int, logprob: float) -> dict:
        text, raw = strings(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": raw}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}


class CompletionLogprobs:
    """One choice's legacy logprobs, built over its stream of tokens (text offsets carry on from
    chunk to chunk)."""

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.offset = 0  # characters of the choice's text before the next token

    def add(self, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]) -> dict:
        """The logprobs object of these tokens (an entry None: a prompt's first token, which has none).
        Each token's top logprobs include its own, as vLLM's do; they are keyed by text, so tokens
        that decode alike share one entry (the better one's)."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self.strings(token_id)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if entry is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(_floor(entry.logprob))
            top: dict[str, float] = {}
            for t, lp in [*entry.top, (token_id, entry.logprob)]:  # best first: two tokens of one text keep the best
                top.setdefault(self.strings(t)[0], _floor(lp))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
