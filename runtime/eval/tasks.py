"""kvc eval's tasks: synthetic long-context cases generated from a seed, and their scoring rules.

`kvc eval` measures accuracy against KV budget (docs/accuracy.md describes the tasks and how the
runner uses them). A task turns (tokenizer, length, count, seed) into `Case`s: token-id prompts of
exactly `length` tokens, each with its expected answer, in the spirit of RULER (needles in a
haystack, key-value retrieval) and SCBench (one shared context, several turns). The haystack is
seeded prose from runtime/eval/filler.py; nothing is downloaded. runtime/eval/prompts.py lays the
prompts out at the token level, so the length is exact under the tokenizer given.

Case i of (task, length, seed) is drawn from its own generator, so it does not depend on `count`
and a run with more cases extends a smaller one. The wording (framing, needle statements, where the
question is named) is what SmolLM2-135M-Instruct, kvc's reference small model, answers with full
attention at 2K and 4K (bench/eval_tasks_check.py); a task the model cannot do measures nothing.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvc.runtime.errors import ConfigError
from kvc.runtime.eval import filler
from kvc.runtime.eval.prompts import Fill, Frame, Needle, build_prompt, prose


@dataclass(frozen=True)
class Turn:
    suffix: tuple[int, ...]  # token ids appended after the previous turn's prompt + generated tokens
    answer: str  # expected answer text


@dataclass(frozen=True)
class Case:
    task: str
    length: int  # target context length; len(prompt) == length for every task
    index: int  # case number within (task, length)
    prompt: tuple[int, ...]  # the first (or only) turn's prompt
    answer: str  # the first turn's expected answer
    max_tokens: int
    stop_token_ids: tuple[int, ...]
    turns: tuple[Turn, ...] = ()  # later turns (multiturn only)
    info: tuple[tuple[str, str], ...] = ()  # e.g. (("depth", "0.25"),) for reports


class Task(Protocol):
    name: str
    description: str  # one line for reports
    multi_turn: bool
    default: bool  # run when `kvc eval --tasks` is not given

    def cases(self, tokenizer, length: int, count: int, seed: int) -> list[Case]: ...

    def correct(self, expected: str, generated_text: str) -> bool: ...


_NUMBER = re.compile(r"\d+")


def first_number(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    m = _NUMBER.search(text)
    return m.group() if m else None


def number_correct(expected: str, generated_text: str) -> bool:
    """The scoring rule of every task here: the first run of digits in the generated text is the
    expected number, digit for digit. A later correct number does not count (no lenient substring
    match), nor does a run that merely contains it ("148213" for "48213")."""
    return first_number(generated_text) == expected


def case_rng(task: str, length: int, index: int, seed: int) -> random.Random:
    """The generator of one case: a hash of its coordinates, the same on every machine and run."""
    digest = hashlib.sha256(f"kvc-eval/{task}/{length}/{index}/{seed}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def _check_request(task: str, length: int, count: int) -> None:
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ConfigError(f"task {task!r}: length must be a positive number of tokens, got {length!r}", param="length")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"task {task!r}: count must be a non-negative integer, got {count!r}", param="count")


def digits(r: random.Random, n: int) -> str:
    """A random n-digit number without a leading zero."""
    return str(r.randrange(10 ** (n - 1), 10**n))


# --- the tasks ------------------------------------------------------------------------------------------

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)  # cycled over cases: case i's (first) needle sits at DEPTHS[i % 5]

# Keys of the multi-key tasks: "<adjective>-<noun>", words that the filler never uses.
KEY_ADJECTIVES = (
    "amber", "azure", "brisk", "cobalt", "crimson", "dapper", "ebony", "fabled", "frosty", "gilded",
    "hollow", "ivory", "jade", "jolly", "lucid", "mellow", "misty", "nimble", "olive", "opal", "plucky",
    "rapid", "rosy", "ruby", "sable", "scarlet", "shiny", "snowy", "solar", "spry", "stormy", "sunny",
    "teal", "umber", "velvet", "vivid", "witty", "zesty", "lunar", "coral",
)
KEY_NOUNS = (
    "otter", "falcon", "badger", "heron", "lynx", "marmot", "osprey", "panda", "raven", "salmon",
    "tiger", "walrus", "zebra", "beetle", "condor", "dingo", "ferret", "gecko", "hyena", "ibis",
    "jaguar", "koala", "lemur", "moose", "newt", "ocelot", "parrot", "quail", "robin", "swan",
    "toucan", "viper", "wombat", "yak", "bison", "camel", "donkey", "eagle", "goose", "hare",
)


def draw_keys(r: random.Random, n: int) -> list[str]:
    """n distinct keys, no two sharing a word (so a key is told apart by either of its words)."""
    adjectives = r.sample(KEY_ADJECTIVES, n)
    nouns = r.sample(KEY_NOUNS, n)
    return [f"{a}-{b}" for a, b in zip(adjectives, nouns)]


def draw_values(r: random.Random, n: int, width: int) -> list[str]:
    """n distinct numbers of `width` digits."""
    values: list[str] = []
    while len(values) < n:
        v = digits(r, width)
        if v not in values:
            values.append(v)
    return values


@dataclass(frozen=True)
class NumberTask:
    """What the tasks share: the scoring rule (`number_correct`), the stop tokens, one generator per
    case, and the framing of the question (chat template or raw completion)."""

    name: str
    description: str
    answer_digits: int = 5
    chat: bool = True  # frame with the tokenizer's chat template where it has one
    system: str | None = None  # the system prompt; None: the chat template's default
    default: bool = True  # among `kvc eval`'s default tasks
    multi_turn = False

    def correct(self, expected: str, generated_text: str) -> bool:
        return number_correct(expected, generated_text)

    def cases(self, tokenizer, length: int, count: int, seed: int) -> list[Case]:
        _check_request(self.name, length, count)
        frame = Frame(tokenizer, chat=self.chat, system=self.system)
        stops = self.stop_token_ids(frame)
        return [self.case(frame, stops, length, i, case_rng(self.name, length, i, seed)) for i in range(count)]

    def stop_token_ids(self, frame: Frame) -> tuple[int, ...]:
        return frame.stop_token_ids()

    @property
    def max_tokens(self) -> int:
        # a space, the digits, a full stop and the end of the turn, with a little room
        return self.answer_digits + 6

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        """Case `index`, drawn from `r` alone."""
        raise NotImplementedError


@dataclass(frozen=True)
class Passkey(NumberTask):
    """RULER's passkey: one 5-digit pass key in the filler, at a depth cycled over cases, asked for
    in a raw completion that ends "The pass key is"."""

    name: str = "passkey"
    description: str = "a 5-digit pass key in varied prose, at depth 0-100%"
    chat: bool = False  # with the chat template SmolLM2-135M scores 15% at 4K, raw 60% (one statement)
    repeat: bool = False  # the classic filler: one passage repeated (eviction's known weak spot)
    instruction: str = (
        "There is a five-digit pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.\n\n"
    )
    # stated twice: with one statement SmolLM2-135M finds it in 60% of 4K contexts, with two in all
    needle: str = "The pass key is {key}. Remember it. The pass key is {key}."
    question: str = "\n\nWhat is the pass key?"
    answer_prefix: str = "The pass key is"

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        key = digits(r, self.answer_digits)
        depth = DEPTHS[index % len(DEPTHS)]
        fill = repeated(frame) if self.repeat else prose(frame.tokenizer, r.getrandbits(32))
        prompt, _ = build_prompt(self.name, frame, length, self.instruction,
                                 [Needle(self.needle.format(key=key), depth)], self.question, self.answer_prefix, fill)
        return Case(self.name, length, index, prompt, key, self.max_tokens, stops, info=(("depth", f"{depth:.2f}"),))


REPEATED = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def repeated(frame: Frame) -> Fill:
    """The classic passkey noise, sentence by sentence, repeated."""
    sentences = [s.strip() for s in re.findall(r"[^.]+\.", REPEATED)]

    def units() -> Iterator[tuple[int, ...]]:
        yield frame.encode(sentences[0])
        while True:
            for s in sentences[1:] + sentences[:1]:
                yield frame.encode(" " + s)

    return lambda budget: filler.fit(units(), budget)


@dataclass(frozen=True)
class MultiKey(NumberTask):
    """RULER's multi-key needle: several "magic number for <key>" needles, one asked for; the
    asked one sits at a depth cycled over cases, the distractors at random depths."""

    name: str = "multikey"
    description: str = "4 keyed 6-digit needles in varied prose, the key asked for named up front (depth 0-100%)"
    answer_digits: int = 6
    needles: int = 4
    # naming the asked key before the text and stating each needle twice lift SmolLM2-135M from
    # 60% to 90% at 4K (RULER's one-statement wording, question last: 60%)
    instruction: str = (
        "Some special magic numbers are hidden inside the following text. Make sure to memorize them. "
        "I will ask you for the special magic number for {key}.\n\n"
    )
    needle: str = (
        "The special magic number for {key} is {value}. Remember it. The special magic number for {key} is {value}."
    )
    question: str = "\n\nWhat is the special magic number for {key}?"
    answer_prefix: str = "The special magic number for {key} is"

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        keys = draw_keys(r, self.needles)
        values = draw_values(r, self.needles, self.answer_digits)
        depth = DEPTHS[index % len(DEPTHS)]
        depths = [depth] + [r.random() for _ in keys[1:]]
        needles = [Needle(self.needle.format(key=k, value=v), d) for k, v, d in zip(keys, values, depths)]
        order = list(range(self.needles))
        r.shuffle(order)  # needles at one boundary keep this order: the asked one is not always first
        fill = prose(frame.tokenizer, r.getrandbits(32))
        key = keys[0]
        prompt, _ = build_prompt(self.name, frame, length, self.instruction.format(key=key),
                                 [needles[i] for i in order], self.question.format(key=key),
                                 self.answer_prefix.format(key=key), fill)
        return Case(self.name, length, index, prompt, values[0], self.max_tokens, stops,
                    info=(("depth", f"{depth:.2f}"), ("key", keys[0])))


@dataclass(frozen=True)
class KVLookup(NumberTask):
    """Key-value retrieval (SCBench's Retr.KV, on a scale a small model can do): a table of keyed
    records somewhere in a long document, one key's value asked for (the key named up front). The
    table sits at a depth cycled over cases, the asked record at a random row of it. SmolLM2-135M
    cannot do a context that is all records (under 30% at 2K), nor "<key>: <value>" rows at 4K."""

    name: str = "kv_lookup"
    description: str = "a table of 8 key-value records (5-digit values) in varied prose, one key asked for"
    records: int = 8
    instruction: str = (
        "A table of records is hidden inside the following text. I will ask you for the number of {key}.\n\n"
    )
    table: str = "Here is the table of records, each a name and its number:\n{rows}\n"
    record: str = "The number for {key} is {value}."
    question: str = "\n\nWhat is the number for {key} in the table?"
    answer_prefix: str = "The number for {key} is"

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        depth = DEPTHS[index % len(DEPTHS)]
        keys = draw_keys(r, self.records)
        values = draw_values(r, self.records, self.answer_digits)
        row = r.randrange(self.records)
        key, value = keys[row], values[row]
        rows = "\n".join(self.record.format(key=k, value=v) for k, v in zip(keys, values))
        fill = prose(frame.tokenizer, r.getrandbits(32))
        question, prefix = self.question.format(key=key), self.answer_prefix.format(key=key)
        prompt, _ = build_prompt(self.name, frame, length, self.instruction.format(key=key),
                                 [Needle(self.table.format(rows=rows), depth)], question, prefix, fill, lead="\n\n")
        return Case(self.name, length, index, prompt, value, self.max_tokens, stops,
                    info=(("depth", f"{depth:.2f}"), ("row", str(row)), ("key", key)))


@dataclass(frozen=True)
class MultiTurn(NumberTask):
    """SCBench's multi-turn setting: one shared context holding several keyed needles (their keys
    named up front), then one question per turn, each about a different needle, asked turn by turn
    over the same cache. Turn k's suffix follows the model's own turn k-1, which ends with its
    end-of-turn token (the only stop tokens here), so the conversation is the chat template's."""

    name: str = "multiturn"
    description: str = "one shared context with 2 keyed 6-digit needles, one question per turn (2 turns)"
    answer_digits: int = 6
    # two needles, two turns: with three SmolLM2-135M answers 85% at 2K and 77% at 4K, with four 75%
    needles: int = 2
    instruction: str = (
        "Some special magic numbers are hidden inside the following text. "
        "Memorize the special magic numbers for {keys}. I will quiz you about them.\n\n"
    )
    needle: str = MultiKey.needle
    question: str = MultiKey.question
    answer_prefix: str = MultiKey.answer_prefix
    multi_turn = True

    def stop_token_ids(self, frame: Frame) -> tuple[int, ...]:
        # End of turn only: the generated tokens (the stop token included) become history, and the
        # next turn's suffix opens right after an end-of-turn (Frame.next_turn)
        return frame.end_of_turn_ids()

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        keys = draw_keys(r, self.needles)
        values = draw_values(r, self.needles, self.answer_digits)
        # needles spread over the context: one in each of `needles` equal stretches, anywhere in it
        depths = [(i + r.random()) / self.needles for i in range(self.needles)]
        asked = list(range(self.needles))
        r.shuffle(asked)
        needles = [Needle(self.needle.format(key=k, value=v), d) for k, v, d in zip(keys, values, depths)]
        fill = prose(frame.tokenizer, r.getrandbits(32))
        first = asked[0]
        instruction = self.instruction.format(keys=", ".join(keys))
        prompt, _ = build_prompt(self.name, frame, length, instruction, needles, self.question.format(key=keys[first]),
                                 self.answer_prefix.format(key=keys[first]), fill)
        turns = tuple(
            Turn(frame.next_turn(self.question.format(key=k).lstrip("\n"), self.answer_prefix.format(key=k)), v)
            for k, v in ((keys[i], values[i]) for i in asked[1:])
        )
        return Case(self.name, length, index, prompt, values[first], self.max_tokens, stops, turns=turns,
                    info=(("depths", ",".join(f"{depths[i]:.2f}" for i in asked)),))


@dataclass(frozen=True)
class Count(NumberTask):
    """A long generation whose every step reads the model's own output: after a long document, the
    model is asked for the numbers from A to B (B - A + 1 = `numbers`), comma-separated, and its
    answer opens with A. Each next number follows the last one written, hundreds of generated tokens
    long, so a method that compresses the output (R-KV) is tested on what it keeps of it. Correct:
    the generated numbers begin A+1, ..., B, in order (`count_correct`). What follows B is not
    scored: SmolLM2-135M counts on past B even with the full cache (it counts without fault)."""

    name: str = "count"
    description: str = "after varied prose, write the 100 numbers from A to B (3-digit A), comma-separated"
    numbers: int = 100
    answer_digits: int = 3
    default: bool = False  # hundreds of decode steps per case: run it with --tasks count
    instruction: str = "Read the following text. Afterwards I will give you a counting exercise.\n\n"
    question: str = "\n\nWrite the numbers from {first} to {last}, separated by commas."

    def correct(self, expected: str, generated_text: str) -> bool:
        return count_correct(expected, generated_text)

    def stop_token_ids(self, frame: Frame) -> tuple[int, ...]:
        return frame.end_of_turn_ids()  # the numbers may wrap onto new lines

    @property
    def max_tokens(self) -> int:
        # each number after A: a comma, a space and its digits (one token each under SmolLM2's
        # tokenizer); room for a few more
        return (self.answer_digits + 2) * self.numbers + 8

    def case(self, frame: Frame, stops: tuple[int, ...], length: int, index: int, r: random.Random) -> Case:
        # every number keeps the width of the first
        first = r.randrange(10 ** (self.answer_digits - 1), 10**self.answer_digits - self.numbers + 1)
        last = first + self.numbers - 1
        fill = prose(frame.tokenizer, r.getrandbits(32))
        # the answer opens with the first number: the model's own output is the rest, A+1..B
        prompt, _ = build_prompt(self.name, frame, length, self.instruction, [],
                                 self.question.format(first=first, last=last), f"{first},", fill)
        return Case(self.name, length, index, prompt, f"{first + 1}-{last}", self.max_tokens, stops,
                    info=(("first", str(first)), ("last", str(last))))


def count_correct(expected: str, generated_text: str) -> bool:
    """`expected` "A-B": the numbers in the generated text begin A, A+1, ..., B (digit for digit)."""
    first, last = (int(x) for x in expected.split("-"))
    want = [str(n) for n in range(first, last + 1)]
    return _NUMBER.findall(generated_text)[: len(want)] == want


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Passkey(),
        MultiKey(),
        KVLookup(),
        MultiTurn(),
        Count(),
        Passkey(name="passkey_repeat", repeat=True, default=False,
                description="a 5-digit pass key in one repeated passage (eviction's known weak spot), depth 0-100%"),
    )
}


def make_cases(task: str, tokenizer, length: int, count: int, seed: int) -> list[Case]:
    """The cases of one task by name; a ConfigError naming the known tasks for an unknown one."""
    if task not in TASKS:
        raise ConfigError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}", param="task")
    return TASKS[task].cases(tokenizer, length, count, seed)
