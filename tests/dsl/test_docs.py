"""The examples in docs/language.md stay true: every complete method in a ```kvm block checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvc.dsl import check_source, format_source

DOC = Path(__file__).resolve().parents[2] / "docs" / "language.md"
BLOCKS = re.findall(r"```kvm\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)


def test_the_reference_has_examples() -> None:
    assert len(BLOCKS) >= 6


@pytest.mark.parametrize("source", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_documented_method_checks_and_is_formatted(source: str) -> None:
    name = re.search(r"^method (\w+)", source, re.M).group(1)
    check_source(source, f"{name}.kvm")
    assert format_source(source, f"{name}.kvm") == source


def test_every_builtin_and_hook_is_documented() -> None:
    from kvc.dsl.builtins import BUILTINS, HOOKS

    text = DOC.read_text(encoding="utf-8")
    for name in list(BUILTINS) + list(HOOKS):
        assert f"`{name}" in text or f" {name}" in text, name
