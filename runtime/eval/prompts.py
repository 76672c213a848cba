"""Token-level prompt building for kvc eval's tasks (runtime/eval/tasks.py; docs/accuracy.md).

`Frame` wraps text for one tokenizer: its chat template where it has one (found by rendering
markers, so any chat model works), or a plain completion. `build_prompt` lays out framing and
instruction, a haystack of filler units (runtime/eval/filler.py) with the needles at unit
boundaries nearest their depths, then the question and the start of the answer, in exactly the
number of tokens asked for: some methods' budgets are fractions of the prompt.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvc.runtime.errors import ConfigError
from kvc.runtime.eval import filler

log = logging.getLogger(__name__)

_MARK = "\x00KVC{}\x00"
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class Frame:
    """How prompt text is wrapped for one tokenizer: the user turn (instruction, document,
    question), the assistant turn that opens with an answer prefix, and what a later turn starts
    with. Derived from the tokenizer's chat template by rendering markers, so any chat model works;
    without a template (or with chat=False) it is a plain completion: "...question? Answer prefix"."""

    def __init__(self, tokenizer, chat: bool = True, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        self.end_ids = {int(vocab[t]) for t in _END_OF_TURN_TOKENS if t in vocab}
        if tokenizer.eos_token_id is not None:
            self.end_ids.add(int(tokenizer.eos_token_id))
        self.chat = bool(chat and getattr(tokenizer, "chat_template", None))
        self.user_start, self.user_end, self.turn_start = "", " ", "\n\n"  # a raw completion
        if self.chat:
            self._from_template(tokenizer, vocab, system)
        self.line_break_ids = line_break_ids(tokenizer)

    def _from_template(self, tokenizer, vocab: dict[str, int], system: str | None) -> None:
        m = [_MARK.format(i) for i in range(3)]
        messages = [{"role": "user", "content": m[0]}, {"role": "assistant", "content": m[1]},
                    {"role": "user", "content": m[2]}]
        if system is not None:  # None: the template's default system prompt, if it has one
            messages.insert(0, {"role": "system", "content": system})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        parts = re.split("|".join(map(re.escape, m)), text)
        if len(parts) != 4:
            log.warning("the chat template does not render each message once; framing prompts as raw completions")
            self.chat = False
            return
        # e.g. "<|im_start|>system\n...<|im_end|>\n<|im_start|>user\n", _, "<|im_end|>\n<|im_start|>user\n",
        # "<|im_end|>\n<|im_start|>assistant\n"
        self.user_start, _, turn_sep, self.user_end = parts
        # A later turn follows the model's own end-of-turn token (kept in the generated tokens,
        # the stop token included), so its suffix starts after that token's text.
        for t in _END_OF_TURN_TOKENS:
            if t in vocab and int(vocab[t]) in self.end_ids and turn_sep.startswith(t):
                turn_sep = turn_sep[len(t):]
                break
        self.turn_start = turn_sep

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def head(self, instruction: str) -> tuple[int, ...]:
        return self.encode(self.user_start + instruction)

    def tail(self, question: str, answer_prefix: str) -> tuple[int, ...]:
        return self.encode(question + self.user_end + answer_prefix)

    def next_turn(self, question: str, answer_prefix: str) -> tuple[int, ...]:
        """A later turn's suffix: a new user turn with `question`, the assistant's `answer_prefix`."""
        return self.encode(self.turn_start + question + self.user_end + answer_prefix)

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Tokens that end the model's turn: EOS and any chat end-of-turn token; in a raw completion,
        also line breaks (the turn is one line)."""
        ids = self.end_ids if self.chat else self.end_ids | self.line_break_ids
        return tuple(sorted(ids))

    def stop_token_ids(self) -> tuple[int, ...]:
        """End of turn and every token that is only line breaks: an answer is one line."""
        return tuple(sorted(self.end_ids | self.line_break_ids))


_LINE_BREAKS: dict[int, tuple[object, frozenset[int]]] = {}  # id(tokenizer) -> (tokenizer, ids)


def line_break_ids(tokenizer) -> frozenset[int]:
    """Every token that decodes to line breaks only (one newline, two, ...), once per tokenizer:
    decoding a 50K vocabulary takes most of a second."""
    cached = _LINE_BREAKS.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        ids = frozenset(i for i, piece in enumerate(pieces) if piece and set(piece) <= {"\n", "\r"})
        cached = _LINE_BREAKS[id(tokenizer)] = (tokenizer, ids)
    return cached[1]


MIN_FILLER = 32  # tokens of haystack a prompt must keep beside its needles, or depth means nothing


@dataclass(frozen=True)
class Needle:
    text: str  # one sentence (or one record), without the separator that precedes it
    depth: float  # 0.0: before all filler, 1.0: after all of it


Fill = Callable[[int], list[tuple[int, ...]]]  # a budget in tokens -> filler units of exactly that many


def prose(tokenizer, seed: int) -> Fill:
    """Filler of whole, varied sentences (runtime/eval/filler.py)."""
    return lambda budget: filler.fit(filler.token_units(tokenizer, seed), budget)


def haystack(
    frame: Frame, budget: int, needles: Sequence[Needle], fill: Fill, lead: str = " "
) -> tuple[tuple[int, ...], list[int]]:
    """Exactly `budget` tokens: whole filler units with each needle inserted at the unit boundary
    nearest its depth (measured in filler tokens). Returns the ids and each needle's token offset.
    `lead` separates a needle from the unit before it (a space in prose, a newline in a list); a
    needle that opens the document drops it where that keeps the needle's length."""
    encoded = [frame.encode(lead + n.text) for n in needles]
    fill_budget = budget - sum(map(len, encoded))
    units_taken = fill(fill_budget)
    bounds = [0]
    for u in units_taken:
        bounds.append(bounds[-1] + len(u))
    slots = [min(range(len(bounds)), key=lambda j: (abs(bounds[j] - n.depth * fill_budget), j)) for n in needles]
    order = sorted(range(len(needles)), key=lambda i: (slots[i], i))
    ids: list[int] = []
    offsets = [0] * len(needles)
    k = 0
    for j in range(len(units_taken) + 1):
        while k < len(order) and slots[order[k]] == j:
            i = order[k]
            offsets[i] = len(ids)
            needle = encoded[i]
            if not ids:
                bare = frame.encode(needles[i].text)
                needle = bare if len(bare) == len(needle) else needle
            ids.extend(needle)
            k += 1
        if j < len(units_taken):
            ids.extend(units_taken[j])
    return tuple(ids), offsets


def build_prompt(
    task: str,
    frame: Frame,
    length: int,
    instruction: str,
    needles: Sequence[Needle],
    question: str,
    answer_prefix: str,
    fill: Fill,
    lead: str = " ",
) -> tuple[tuple[int, ...], list[int]]:
    """head (framing + instruction) + haystack + tail (question + answer prefix), exactly `length`
    tokens. Returns the prompt and the needles' offsets in it. A ConfigError when the skeleton (all
    but the filler) leaves less than MIN_FILLER tokens."""
    head = frame.head(instruction)
    tail = frame.tail(question, answer_prefix)
    skeleton = len(head) + len(tail) + sum(len(frame.encode(lead + n.text)) for n in needles)
    if length - skeleton < MIN_FILLER:
        raise ConfigError(
            f"task {task!r}: length {length} is too short; its framing, question and needles take {skeleton} "
            f"tokens under this tokenizer, so the length must be at least {skeleton + MIN_FILLER} (a few more "
            f"where the keys drawn are longer)",
            param="length",
        )
    try:
        body, offsets = haystack(frame, length - len(head) - len(tail), needles, fill, lead)
    except filler.Exhausted as e:
        raise ConfigError(f"task {task!r}: length {length} is too long for this task: {e}", param="length") from None
    prompt = head + body + tail
    assert len(prompt) == length, (len(prompt), length)  # fit() guarantees it; a bug otherwise
    return prompt, [len(head) + o for o in offsets]
