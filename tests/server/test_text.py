"""Incremental detokenization and stop strings (runtime/server/text.py), without a server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.runtime.server.text import ChoiceText, IncrementalDetokenizer, StopStrings


@pytest.fixture(scope="module")
def tokenizer():
    from kvc.runtime.models.random_tiny import ensure_tiny_model
    from kvc.runtime.tokenizer import load_tokenizer

    return load_tokenizer(ensure_tiny_model())  # byte-level: ids 0..255 are the bytes


def _stream(tokenizer, ids, stop=(), chunk=1, include=False):
    text = ChoiceText(tokenizer, stop, include)
    deltas = [text.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(text.finish())
    return deltas, text


def test_multibyte_character_waits_for_its_last_byte(tokenizer):
    ids = list("é€".encode())  # byte-level: ids 0..255 are the bytes
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in ids] == ["", "é", "", "", "€"]
    assert detok.flush() == ""


def test_incomplete_character_at_the_end_is_flushed_as_replacement(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([i]) for i in list(b"a") + list("€".encode())[:2]] == ["a", "", ""]
    assert detok.flush() == "\ufffd"


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 300), max_size=40), chunk=st.integers(1, 4))
def test_deltas_concatenate_to_the_full_decode(tokenizer, ids, chunk):
    deltas, text = _stream(tokenizer, ids, chunk=chunk)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full == text.text


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet="abcXY", max_size=30), stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4),
                                                                   min_size=1, max_size=3))
def test_stop_strings_never_leak_and_cut_at_the_first_match(text, stop):
    s = StopStrings(stop)
    shown = ""
    for ch in text:
        shown += s.add(ch)
        # nothing shown ever contains a stop string, nor ends in the start of one that later matched
        assert not any(x in shown for x in stop)
    shown += s.flush()
    # Generation ends as soon as the text contains a stop string, cut where the match starts.
    expected, stopped = text, False
    for k in range(1, len(text) + 1):
        starts = [i for i in (text[:k].find(x) for x in stop) if i != -1]
        if starts:
            expected, stopped = text[: min(starts)], True
            break
    assert shown == expected
    assert s.stopped == stopped


def test_stop_string_split_over_tokens_is_held_back_then_cut(tokenizer):
    ids = list(b"hello world")
    deltas, text = _stream(tokenizer, ids, stop=["o w"])
    assert "".join(deltas) == "hell"
    assert deltas[4] == ""  # the 'o' might start "o w": held back
    assert text.stopped and len(text.token_ids) == 7  # 'o', ' ', 'w' completed it at token 7


def test_held_back_prefix_is_released_when_it_does_not_match(tokenizer):
    deltas, text = _stream(tokenizer, list(b"ab ac"), stop=["abc"])
    assert deltas[:3] == ["", "", "ab "] and "".join(deltas) == "ab ac" and not text.stopped


def test_include_stop_str_in_output(tokenizer):
    deltas, _ = _stream(tokenizer, list(b"say STOP now"), stop=["STOP"], include=True)
    assert "".join(deltas) == "say STOP"


def test_no_stop_string_is_matched_before_min_tokens(tokenizer):
    ids = list(b"ab|cd|ef")
    early = ChoiceText(tokenizer, ["|"])
    assert "".join(early.add([i]) for i in ids) == "ab" and early.stops.matched == "|"
    held = ChoiceText(tokenizer, ["|"], min_tokens=4)  # the first "|" is token 3: not a stop yet
    assert "".join(held.add([i]) for i in ids) == "ab|cd" and held.stopped
    late = ChoiceText(tokenizer, ["d|e"], min_tokens=5)  # a match may not start in unchecked text
    assert "".join(late.add([i]) for i in ids) + late.finish() == "ab|cd|ef" and not late.stopped


def test_token_strings_give_each_tokens_exact_bytes(tokenizer):
    from kvc.runtime.server.text import TokenStrings

    strings = TokenStrings(tokenizer)
    ids = list("é€ a".encode())  # byte-level: ids are the bytes, a character split over tokens
    assert b"".join(bytes(strings(i)[1]) for i in ids).decode() == "é€ a"
    assert strings(ord("a")) == ("a", [97])
    assert TokenStrings(None)(7) == ("token_id:7", list(b"token_id:7"))
