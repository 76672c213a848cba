"""Checker: types and axes annotated on the tree, per-hook views, overrides, tables for the compiler."""

from __future__ import annotations

import pytest

from kvc.dsl import KvmError, check_file, check_source, method_path
from kvc.dsl.evaluate import evaluate
from kvc.dsl.symbolic import formula
from kvc.dsl.types import BOOL, TOKENS, Selection, Tensor


def test_expressions_carry_their_types() -> None:
    checked = check_file(method_path("snapkv"))
    body = checked.hooks[0].body
    window, sliced = ("query", ("last window",)), ("key", ("first (context - window)",))
    assert body[0].value.ty == Tensor(("head", "query", "key"), ranges=(window, sliced))
    assert str(body[0].value.ty) == "[head, query[last window], key[first (context - window)]]"
    assert body[1].value.ty == Tensor(("head", "key"), ranges=(sliced,))
    assert body[2].value.ty == Tensor(("kv_head", "key"), ranges=(sliced,))
    keep = body[3]
    assert keep.selection.ty == Selection("key", per=("kv_head",))
    assert keep.selection.left.args[1].ty == TOKENS


def test_per_request_hooks_see_a_layer_axis() -> None:
    checked = check_file(method_path("kvzip"))
    replay_end = next(h for h in checked.hooks if h.name.name == "replay_end")
    score = replay_end.body[0].selection.left.args[0]
    assert score.ty == Tensor(("layer", "kv_head", "key"))
    assert replay_end.body[0].selection.ty == Selection("key", across=("layer", "kv_head"))


def test_tables_for_the_compiler() -> None:
    quest = check_file(method_path("quest"))
    assert quest.axes["pages"].kind == "partition"
    assert quest.bindings["kmax"].kind == "summary"
    assert quest.bindings["kmax"].type == Tensor(("kv_head", "pages", "channel"))
    assert quest.values == {"page_size": 16, "budget": 2048, "dense_layers": 2}
    retro = check_file(method_path("retroinfer"))
    assert retro.axes["clusters"].per == ("kv_head",)
    palu = check_file(method_path("palu"))
    assert palu.axes["rank"].kind == "sized"
    duo = check_file(method_path("duoattention"))
    assert duo.bindings["streaming"].type == Tensor(("layer", "kv_head"), "bool")


def test_where_conditions_evaluate_per_layer() -> None:
    checked = check_file(method_path("omnikv"), {"filters": [2, 8, 18]})
    reads = checked.hooks[1]
    active = [layer for layer in range(32) if evaluate(reads.where, {**checked.values, "layer": layer}, checked.lets)]
    assert 2 not in active and 8 not in active and 3 in active and 1 not in active and 31 in active


def test_list_parameters_stay_symbols_in_formulas() -> None:
    """`layer in filters` and `min(filters)` of an int[] parameter: sympy functions that survive a
    formula's round trip and print as Python over the list (what the generated `where` runs)."""
    import sympy as sp

    from kvc.compiler.lower_torch import pyexpr
    from kvc.dsl.symbolic import read_formula, to_sympy

    checked = check_file(method_path("omnikv"))
    where = to_sympy(checked.hooks[1].where, checked.lets)
    assert read_formula(sp.sstr(where)) == where
    code = pyexpr(where)
    for filters in ([2, 8, 18], [0], [5, 3]):
        for layer in range(20):
            want = layer > min(filters) and layer not in filters
            assert eval(code, {"layer": layer, "filters": filters}) == want, (code, filters, layer)


def test_budget_formulas() -> None:
    checked = check_file(method_path("snapkv"))
    top = checked.hooks[0].body[3].selection.left
    assert formula(top.args[1], checked.lets) == "budget - window"


def test_overrides_are_checked() -> None:
    path = method_path("snapkv")
    assert check_file(path, {"budget": 512, "pooling": "max"}).values["budget"] == 512
    for params, message in [({"budgte": 512}, "has no parameter 'budgte'"),
                            ({"budget": "x"}, "is not a number of tokens"),
                            ({"budget": -3}, "is negative"),
                            ({"kernel": 64}, "outside its range [1, 63]"),
                            ({"kernel": 4}, "must be odd"),
                            ({"window": 4096}, "outside its range"),
                            ({"pooling": "mean"}, "is not {avg, max}")]:
        with pytest.raises(KvmError) as info:
            check_file(path, params)
        assert message in info.value.message, (params, info.value.message)


def test_override_can_make_a_budget_negative() -> None:
    with pytest.raises(KvmError) as info:
        check_file(method_path("snapkv"), {"budget": 16})
    assert "negative: -16 tokens" in info.value.message


def test_turn_hooks_and_roles() -> None:
    src = """method m : sparse
param sink: tokens = 4
input gate: [layer, kv_head] from "g.safetensors"
role stream = gate < 0.5
state seen: [kv_head, key]
on turn_end:
  keep first sink + last 1024 for stream
on turn_resume:
  seen = 0
"""
    checked = check_source(src, "m.kvm")
    assert checked.bindings["stream"].type.dtype == "bool"


def test_conditions_are_bools() -> None:
    checked = check_file(method_path("rkv"))
    assert checked.hooks[0].where.ty == BOOL


def test_bad_families_and_hooks_are_reported_together() -> None:
    with pytest.raises(KvmError) as info:
        check_source("method m : eviction\non prefil_end:\n  keep last 4\non step_end:\n  read last 4\n", "m.kvm")
    messages = [d.message for d in info.value.diagnostics]
    assert any("unknown hook" in m for m in messages) and any("`read` cannot be used" in m for m in messages)


def test_later_defaults_see_overrides() -> None:
    src = ("method m : eviction\nparam budget: tokens = 2048\nparam window: tokens = budget // 64\n"
           "on step_end:\n  keep last window\n")
    assert check_source(src, "m.kvm").values["window"] == 32
    assert check_source(src, "m.kvm", {"budget": 512}).values["window"] == 8


def test_load_method_by_name_or_path(tmp_path) -> None:
    from kvc.dsl import load_method

    assert load_method("h2o").family == "eviction"
    path = tmp_path / "mine.kvm"
    path.write_text("method mine : eviction\nparam n: tokens = 64\non step_end:\n  keep last n\n")
    assert load_method(path, {"n": 8}).values["n"] == 8
    with pytest.raises(KvmError) as info:
        load_method("snapkvv")
    assert "no shipped method named 'snapkvv'" in info.value.message
