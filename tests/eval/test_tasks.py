"""kvc eval's tasks (runtime/eval/tasks.py, prompts.py, filler.py): exact prompt lengths, the same
cases on every run, case i independent of the case count, needles where their depth says, the
multi-turn suffixes that continue the chat template, the scoring rule, and clear errors.

No model runs here: the byte-level tokenizer of the tiny random model serves every test, and
SmolLM2's tokenizer (the embedded default model, the one the wording is validated on,
bench/eval_tasks_check.py) the ones that take the `smol` fixture."""

from __future__ import annotations

import re
import pytest

from kvc.runtime.errors import ConfigError
from kvc.runtime.eval import filler
from kvc.runtime.eval.prompts import MIN_FILLER, Frame
from kvc.runtime.eval.tasks import DEPTHS, REPEATED, TASKS, Case, make_cases, number_correct
from kvc.runtime.models.random_tiny import ensure_tiny_model
from kvc.runtime.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ensure_tiny_model())


@pytest.fixture(scope="module")
def smol(real_model_dir):
    return load_tokenizer(real_model_dir)


def _find(haystack: tuple[int, ...], needle: tuple[int, ...]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i:i + len(needle)] == needle]


def _text(tokenizer, case: Case) -> str:
    return tokenizer.decode(list(case.prompt))


# --- lengths, determinism, independence of the count ------------------------------------------------


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("length", [800, 1001, 2048])
def test_every_prompt_has_exactly_length_tokens(tok, task: str, length: int) -> None:
    cases = make_cases(task, tok, length, 6, seed=3)
    assert [len(c.prompt) for c in cases] == [length] * 6
    assert [c.index for c in cases] == list(range(6))
    assert all(c.task == task and c.length == length for c in cases)


@pytest.mark.parametrize("task", list(TASKS))
def test_exact_lengths_under_the_real_tokenizer(smol, task: str) -> None:
    for length in (1024, 4096):
        assert {len(c.prompt) for c in make_cases(task, smol, length, 5, seed=0)} == {length}


@pytest.mark.parametrize("task", list(TASKS))
def test_same_inputs_give_the_same_cases_and_another_seed_others(tok, task: str) -> None:
    a = make_cases(task, tok, 900, 4, seed=11)
    assert a == make_cases(task, tok, 900, 4, seed=11)
    b = make_cases(task, tok, 900, 4, seed=12)
    assert all(x.prompt != y.prompt and x.answer != y.answer for x, y in zip(a, b))


@pytest.mark.parametrize("task", list(TASKS))
def test_case_i_does_not_depend_on_count(tok, task: str) -> None:
    few = make_cases(task, tok, 800, 2, seed=5)
    assert make_cases(task, tok, 800, 7, seed=5)[:2] == few
    assert make_cases(task, tok, 800, 0, seed=5) == []


# --- needles and answers ---------------------------------------------------------------------------


def _haystack_span(tokenizer, task: str, case: Case) -> tuple[int, int]:
    """Where the haystack lies in a passkey prompt: after the framed instruction, before the question."""
    t = TASKS[task]
    frame = Frame(tokenizer, chat=t.chat, system=t.system)
    head = frame.head(t.instruction)
    tail = frame.tail(t.question, t.answer_prefix)
    assert case.prompt[:len(head)] == head and case.prompt[-len(tail):] == tail
    return len(head), len(case.prompt) - len(tail)


@pytest.mark.parametrize("task", ["passkey", "passkey_repeat"])
def test_the_pass_key_sits_at_its_depth(tok, task: str) -> None:
    cases = make_cases(task, tok, 1500, 10, seed=0)
    assert [float(dict(c.info)["depth"]) for c in cases] == [DEPTHS[i % 5] for i in range(10)]
    for c in cases:
        start, end = _haystack_span(tok, task, c)
        needle = TASKS[task].needle.format(key=c.answer)
        at = _find(c.prompt, tuple(tok.encode(" " + needle, add_special_tokens=False)))
        if not at:  # the needle that opens the document goes without its leading space
            at = _find(c.prompt, tuple(tok.encode(needle, add_special_tokens=False)))
        assert len(at) == 1, "the needle appears once"
        depth = float(dict(c.info)["depth"])
        needle_len = len(tok.encode(" " + needle, add_special_tokens=False))
        where = (at[0] - start) / (end - start - needle_len)  # 0: first in the haystack, 1: last
        assert abs(where - depth) < 0.05, (where, depth)
        assert _text(tok, c).count(c.answer) == 2  # stated twice, asked for nowhere else


def test_depth_zero_and_one_are_the_ends_of_the_haystack(smol) -> None:
    first, *_, last = make_cases("passkey", smol, 2048, 5, seed=0)
    text_first, text_last = _text(smol, first), _text(smol, last)
    assert f"I will quiz you about the pass key.\n\nThe pass key is {first.answer}." in text_first
    assert text_last.endswith(f"The pass key is {last.answer}.\n\nWhat is the pass key? The pass key is")


def test_passkey_is_a_raw_completion_and_passkey_repeat_repeats_one_passage(tok) -> None:
    text = _text(tok, make_cases("passkey", tok, 700, 1, seed=0)[0])
    assert text.startswith("There is a five-digit pass key") and "<|im_start|>" not in text
    rep = make_cases("passkey_repeat", tok, 1200, 2, seed=0)[1]
    body = _text(tok, rep).split("\n\n")[1]
    needle = TASKS["passkey_repeat"].needle.format(key=rep.answer)
    noise = set(re.findall(r"[^.]+\.", body.replace(needle, ""))) - {" "}
    assert {s.strip() for s in noise} == {s.strip() for s in re.findall(r"[^.]+\.", REPEATED)}


def test_multikey_asks_one_of_several_keyed_needles(tok) -> None:
    task = TASKS["multikey"]
    for c in make_cases("multikey", tok, 1500, 5, seed=2):
        text = _text(tok, c)
        found = dict(re.findall(r"The special magic number for ([a-z]+-[a-z]+) is (\d+)\. Remember", text))
        assert len(found) == task.needles  # distinct keys, each stated (twice)
        assert len(set(found.values())) == task.needles
        key = dict(c.info)["key"]
        assert found[key] == c.answer and len(c.answer) == task.answer_digits
        assert f"I will ask you for the special magic number for {key}." in text
        assert text.endswith(f"The special magic number for {key} is")


def test_kv_lookup_asks_one_row_of_a_table(tok) -> None:
    for c in make_cases("kv_lookup", tok, 1500, 5, seed=2):
        text = _text(tok, c)
        table = text.split("Here is the table of records, each a name and its number:\n")[1]
        rows = re.findall(r"^The number for ([a-z]+-[a-z]+) is (\d+)\.$", table, flags=re.M)
        assert len(rows) == TASKS["kv_lookup"].records
        info = dict(c.info)
        assert rows[int(info["row"])] == (info["key"], c.answer)
        assert text.endswith(f"The number for {info['key']} is")


def test_multiturn_turns_ask_each_needle_once(tok) -> None:
    task = TASKS["multiturn"]
    assert task.multi_turn and not any(TASKS[n].multi_turn for n in TASKS if n != "multiturn")
    for c in make_cases("multiturn", tok, 1500, 4, seed=1):
        text = _text(tok, c)
        values = dict(re.findall(r"The special magic number for ([a-z]+-[a-z]+) is (\d+)\. Remember", text))
        assert len(c.turns) == task.needles - 1
        asked = [re.search(r"for ([a-z]+-[a-z]+) is$", s).group(1)
                 for s in [text] + [tok.decode(list(t.suffix)) for t in c.turns]]
        assert sorted(asked) == sorted(values)  # every needle asked, once
        assert [values[k] for k in asked] == [c.answer] + [t.answer for t in c.turns]


def test_a_later_turn_continues_the_chat_template(tok) -> None:
    """prompt + the model's answer (ending with its end-of-turn token, as kvc's outputs do) + the
    next turn's suffix is exactly the chat template's rendering of that conversation."""
    c = make_cases("multiturn", tok, 900, 1, seed=0)[0]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert eos in c.stop_token_ids
    assert not any(set(tok.decode([t])) <= {"\n"} for t in c.stop_token_ids), "a newline must not end a turn"
    answer = tok.encode(f" {c.answer}.", add_special_tokens=False)
    ids = list(c.prompt) + answer + [eos] + list(c.turns[0].suffix)
    text = tok.decode(ids)
    user1, prefix1 = text.split("<|im_start|>user\n")[1].split("<|im_end|>\n<|im_start|>assistant\n")[:2]
    user2, prefix2 = text.split("<|im_start|>user\n")[2].split("<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "user", "content": user1}, {"role": "assistant", "content": prefix1.split("<|im_end|>")[0]},
                {"role": "user", "content": user2}]
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix2
    assert text == want


def test_single_turn_answers_stop_at_a_line_break_or_the_end_of_turn(smol) -> None:
    newline = smol.encode("\n", add_special_tokens=False)[0]
    for task in ("passkey", "multikey", "kv_lookup"):
        c = make_cases(task, smol, 1024, 1, seed=0)[0]
        assert {newline, smol.eos_token_id} <= set(c.stop_token_ids)
        assert c.max_tokens >= len(smol.encode(" " + c.answer + ".", add_special_tokens=False)) + 1


# --- the filler ------------------------------------------------------------------------------------


def test_filler_is_varied_digit_free_and_seeded() -> None:
    stream = filler.sentences(7)
    first = [next(stream) for _ in range(3000)]
    assert len(set(first)) == 3000
    assert not any(re.search(r"\d", s) for s in first)
    again = filler.sentences(7)
    assert [next(again) for _ in range(50)] == first[:50]
    other = filler.sentences(8)
    assert [next(other) for _ in range(50)] != first[:50]


def test_fit_fills_a_budget_exactly_with_whole_sentences(tok) -> None:
    for budget in (0, 37, 250, 1999):
        units = filler.fit(filler.token_units(tok, 3), budget)
        assert sum(map(len, units)) == budget
        assert all(tok.decode(list(u)).endswith(".") for u in units)


def test_fit_cuts_the_last_unit_only_when_no_whole_units_can_close_the_gap() -> None:
    assert filler.fit(iter([(1, 2, 3)] * 10), 7, max_skips=5) == [(1, 2, 3), (1, 2, 3), (1,)]
    with pytest.raises(filler.Exhausted):
        filler.fit(iter([(1, 2, 3)] * 2), 9)


# --- scoring ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("generated, ok", [
    (" 48213.", True),
    ("48213", True),
    (" 48213 is the pass key. 99999", True),
    (" is 48213", True),
    (" 148213.", False),  # a longer number that merely contains it
    (" 4821.", False),
    (" 12345, not 48213", False),  # only the first number counts
    (" 48,213", False),  # digits, not formatting: "48" is the first number
    (" a small wooden box", False),
    ("", False),
])
def test_the_first_number_in_the_answer_must_be_the_expected_one(generated: str, ok: bool) -> None:
    assert number_correct("48213", generated) is ok
    # every task scored by its answer's first number (`count` scores a run of numbers: its own test below)
    assert all(TASKS[t].correct("48213", generated) is ok for t in TASKS if t != "count")


# --- errors ----------------------------------------------------------------------------------------


def test_an_unknown_task_names_the_known_ones(tok) -> None:
    with pytest.raises(ConfigError, match="unknown task 'needle'; known tasks: passkey, multikey, kv_lookup"):
        make_cases("needle", tok, 1024, 1, 0)


@pytest.mark.parametrize("task", list(TASKS))
def test_a_length_too_short_for_the_skeleton_says_the_minimum(tok, task: str) -> None:
    with pytest.raises(ConfigError, match=r"too short.* at least (\d+)") as err:
        make_cases(task, tok, 60, 1, 0)
    least = int(re.search(r"at least (\d+)", err.value.message).group(1))
    assert least > 60 + MIN_FILLER
    assert len(make_cases(task, tok, 2 * least, 2, 0)[1].prompt) == 2 * least


@pytest.mark.parametrize("task", ["passkey", "passkey_repeat"])
def test_the_minimum_is_exact_where_the_skeleton_is_fixed(tok, task: str) -> None:
    """A pass key's skeleton has the same length in every case (5 digits); keyed tasks' vary with
    their keys' spelling, so their minimum holds for the case that raised."""
    with pytest.raises(ConfigError) as err:
        make_cases(task, tok, 60, 1, 0)
    least = int(re.search(r"at least (\d+)", err.value.message).group(1))
    assert {len(c.prompt) for c in make_cases(task, tok, least, 3, 0)} == {least}
    with pytest.raises(ConfigError, match="too short"):
        make_cases(task, tok, least - 1, 1, 0)


@pytest.mark.parametrize("length, count", [(0, 1), (-5, 1), (True, 1), (2.5, 1), (1024, -1), (1024, "3")])
def test_bad_lengths_and_counts_are_config_errors(tok, length, count) -> None:
    with pytest.raises(ConfigError):
        make_cases("passkey", tok, length, count, 0)


def test_count_asks_for_a_run_of_numbers_and_scores_its_start(smol) -> None:
    """`count`: the question names A and B (B - A + 1 = 100, every number 3 digits), the answer opens with
    "A,", so the model's own output is A+1..B; it is right when its numbers begin exactly so, whatever
    follows (the model counts on past B), and wrong at the first slip."""
    from kvc.runtime.eval.tasks import count_correct

    task = TASKS["count"]
    for case in make_cases("count", smol, 1024, 4, seed=0):
        first, last = (int(x) for x in case.answer.split("-"))
        assert 100 <= first - 1 and last <= 999 and last - first + 2 == task.numbers
        text = smol.decode(list(case.prompt))
        assert f"from {first - 1} to {last}" in text and text.endswith(f"{first - 1},")
        assert case.max_tokens >= 5 * task.numbers
    assert count_correct("101-104", " 101, 102, 103, 104, 105, 106")
    assert count_correct("101-104", " 101,\n102, 103, 104")
    assert not count_correct("101-104", " 101, 102, 104, 105")
    assert not count_correct("101-104", " 101, 102, 103")
    assert count_correct("101-104", "Here they are: 101, 102, 103, 104")  # words are not numbers
    assert not count_correct("101-104", "The 3 numbers: 101, 102, 103, 104")
