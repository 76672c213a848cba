"""Axes combine by name, and only where both operands hold the same entries: the checker knows
which range of an axis a value holds (`x[first n along key]`) and reports, at `kvc check` with
file:line:col, every combination the lowering could only pair by position."""

from __future__ import annotations

import pytest

from kvc.dsl import KvmError, check_source
from kvc.dsl.types import Tensor

PRE = (
    "method m : eviction\n"                       # 1
    "param budget: tokens = 2048 in [1, 65536]\n"  # 2
    "param window: tokens = 32 in [1, 1024]\n"     # 3
    "state seen: [kv_head, key] = 0\n"             # 4
)
OBS = "attention(q[last window], k)[first (context - window) along key]"
VOTES = f"mean(sum({OBS}, over query), over group)"  # [kv_head, key[first (context - window)]]


def _hook(*lines: str, hook: str = "prefill_end") -> str:
    return PRE + f"on {hook}:\n" + "".join(f"  {line}\n" for line in lines)


ERRORS = [
    ("a window of keys against every key",
     _hook(f"keep top({VOTES} - norm(k, over channel), budget, per kv_head)"), 6, 12,
     "cannot combine [kv_head, key[first (context - window)]] with [kv_head, key]: they hold different entries "
     "of the key axis", "x[first (context - window) along key]"),
    ("two windows of queries",
     _hook("keep top(sum(attention(q[last window], k) * attention(q[last 4], k), over head, query), budget)"), 6, 16,
     "different entries of the query axis", None),
    ("first and last windows of the same size",
     _hook("x = norm(k, over channel)", "keep top(x[first 8] + x[last 8], budget, per kv_head)"), 7, 12,
     "[kv_head, key[first 8]] with [kv_head, key[last 8]]", None),
    ("a comparison", _hook("x = norm(k, over channel)", "y = x[first 8] < x", "keep last window"), 7, 7,
     "different entries of the key axis", None),
    ("max of two tensors", _hook("x = norm(k, over channel)", "keep top(max(x[last 3], x), budget, per kv_head)"),
     7, 12, "different entries of the key axis", None),
    ("a range of query heads against KV heads",
     _hook("a = sum(attention(q[last window], k), over query)[first 2 along head]",
           "keep top(sum(a * norm(k, over channel), over head), budget)"), 7, 16,
     "query head h reads KV head h // (heads / kv_heads)", None),
    ("folding a range of query heads",
     _hook("a = sum(attention(q[last window], k), over query)[first 2 along head]",
           "keep top(mean(a, over group), budget, per kv_head)"), 7, 12,
     "cannot fold [head[first 2], key] over group", None),
    ("attention over a range of keys",
     _hook("keep top(sum(attention(q[last window], k[first 10]), over head, query), budget)"), 6, 42,
     "attention needs every key, got [kv_head, key[first 10], channel]", "attention(q, k)[... along key]"),
    ("attention of queries that are not the newest",
     _hook("keep top(sum(attention(q[last window][first 2 along query], k), over head, query), budget)"), 6, 26,
     "attention reads the newest queries", "write q[last n]"),
    ("attention of queries with another axis",
     _hook("keep top(sum(attention(q[last window], k * sum(attention(q[last window], k), over head, key)), "
           "over head, query), budget)"), 6, 16, "reduce the query axis first", None),
    ("attention over different channels",
     _hook("keep top(sum(attention(q[last window][first 4 along channel], k), over head, query), budget)"), 6, 16,
     "hold different channels", None),
    ("a state accumulating a range of keys",
     _hook("seen += sum(mean(attn, over group), over query)[last 3]", "keep last window", hook="prefill_chunk"),
     6, 11,
     "cannot add [kv_head, key[last 3]] into 'seen'", None),
    ("a state assigned a range of keys",
     _hook("seen = norm(k, over channel)[first 5]", "keep top(seen, budget, per kv_head)", hook="step_end"), 6, 10,
     "'seen' is [kv_head, key], but this is [kv_head, key[first 5]]", None),
    ("top per a range of KV heads",
     _hook("keep top(norm(k, over channel)[first 1 along kv_head], budget, per kv_head)"), 6, 12,
     "holds a range of the kv_head axis", None),
]


@pytest.mark.parametrize("name,source,line,col,message,hint", ERRORS, ids=[c[0] for c in ERRORS])
def test_unalignable_axes_are_check_errors(name, source, line, col, message, hint):
    with pytest.raises(KvmError) as info:
        check_source(source, "m.kvm")
    found = [d for d in info.value.diagnostics if message in d.message]
    assert found, f"{name}: no diagnostic contains {message!r}:\n{info.value}"
    assert (found[0].pos.line, found[0].pos.col) == (line, col), f"{name}:\n{info.value}"
    if hint is not None:
        assert hint in (found[0].hint or ""), found[0].hint
    text = str(info.value)
    assert f"m.kvm:{line}:{col}: error: " in text and "^" in text


def _score_type(*lines: str) -> Tensor:
    checked = check_source(_hook(*lines), "m.kvm")
    return checked.hooks[0].body[-1].selection.left.args[0].ty if "+" in lines[-1] else \
        checked.hooks[0].body[-1].selection.args[0].ty


def test_the_same_range_on_both_sides_combines() -> None:
    ty = _score_type(f"keep top({VOTES} - norm(k, over channel)[first (context-window) along key], budget, "
                     "per kv_head) + last window")
    assert ty == Tensor(("kv_head", "key"), ranges=(("key", ("first (context - window)",)),))


def test_reductions_and_pooling_keep_or_drop_ranges() -> None:
    ty = _score_type(f"keep top(pool({VOTES}, max, 3, along key)[last 9] * {VOTES}[last 9], budget, per kv_head)")
    assert ty.range_of("key") == ("first (context - window)", "last 9")
    checked = check_source(_hook(f"x = sum({OBS}, over key)", "keep last window"), "m.kvm")
    assert checked.hooks[0].body[0].value.ty == Tensor(("head", "query"), ranges=(("query", ("last window",)),))


def test_query_heads_meet_their_kv_heads() -> None:
    ty = _score_type("keep top(mean(sum(attention(q[last window], k), over query) * norm(k, over channel), "
                     "over group), budget, per kv_head)")
    assert ty == Tensor(("kv_head", "key"))
