"""Formatter: canonical output, idempotence, comments, parentheses and AST round trips."""

from __future__ import annotations

import pytest

from kvc.dsl import KvmError, format_source, parse_source

MESSY = """# header comment

# about the method
method  m:eviction   # trailing
param budget :tokens=2048 in[1,65536]     # kept tokens
param window:tokens = 32  # window



let  reserve=(budget)-((window))
on  prefill_end   where layer>=2 :
    # compute scores
    obs = attention( q[ last window ], k )
    score = mean(pool(sum(obs,over query),avg,5,
                      along key),   # pooled
                 over group)

    keep top(score,reserve,per kv_head)+last window
    # end of the hook
# end of file
"""

CANONICAL = """# header comment

# about the method
method m : eviction                        # trailing
param budget: tokens = 2048 in [1, 65536]  # kept tokens
param window: tokens = 32                  # window

let reserve = budget - window
on prefill_end where layer >= 2:
  # compute scores
  obs = attention(q[last window], k)
  score = mean(pool(sum(obs, over query), avg, 5, along key), over group)  # pooled

  keep top(score, reserve, per kv_head) + last window
  # end of the hook
# end of file
"""


def test_canonical_form() -> None:
    assert format_source(MESSY) == CANONICAL


def test_idempotent_and_round_trip() -> None:
    once = format_source(MESSY)
    assert format_source(once) == once
    assert parse_source(once).method == parse_source(MESSY).method


@pytest.mark.parametrize("text,expected", [
    ("(a - b) - c", "a - b - c"),
    ("a - (b - c)", "a - (b - c)"),
    ("a * (b + c)", "a * (b + c)"),
    ("-(a + b)", "-(a + b)"),
    ("not (a and b)", "not (a and b)"),
    ("(a or b) or c", "(a or b) or c"),
    ("(a if b else c) if d else e", "(a if b else c) if d else e"),
    ("a if b else (c if d else e)", "a if b else c if d else e"),
    ("last (n * 2)", "last (n * 2)"),
    ("(last n) * 2", "last n * 2"),
    ("x[(last n)]", "x[last n]"),
    ("(-a)[b]", "(-a)[b]"),
    ("- -a", "--a"),
    ("0.50", "0.5"),
    ("1e-5", "1e-05"),
])
def test_minimal_parentheses(text: str, expected: str) -> None:
    out = format_source(f"method m : full\nlet x = {text}\n")
    assert out == f"method m : full\nlet x = {expected}\n"
    assert parse_source(out).method == parse_source(f"method m : full\nlet x = {text}\n").method


def test_strings_are_escaped() -> None:
    src = 'method m : eviction\nreplay "a\\n\\"b\\"\\\\" in chunks of 64\n'
    assert format_source(src) == src


def test_formatting_a_broken_file_reports_errors() -> None:
    with pytest.raises(KvmError) as info:
        format_source("method m : eviction\non step_end:\n  keep (\n")
    assert info.value.first.pos.line == 3


def test_replay_declaration_round_trips():
    src = ('method m : eviction\nparam sink: tokens = 4 in [0, 64]\n'
           'replay "a" in chunks of 64 then "b" + last 8 over first sink\n')
    assert format_source(src) == src
