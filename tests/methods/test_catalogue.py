"""The shipped method catalogue (methods/*.kvm): parses, checks, is formatted, and is documented.

These tests cover the language side only (parse and check); whether a method reproduces its
reference implementation is tested with the compiler and engine (tests/compiler, tests/runtime).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from kvc.dsl import METHODS_DIR, ast, check_file, format_source, parse_source
from kvc.dsl.symbolic import formula, read_formula, to_sympy

EXPECTED = {
    "full": "full",
    "streamingllm": "eviction", "snapkv": "eviction", "pyramidkv": "eviction", "h2o": "eviction", "tova": "eviction",
    "adakv": "eviction", "rkv": "eviction", "skipkv": "eviction", "kvzip": "eviction",
    "quest": "sparse", "omnikv": "sparse", "retroinfer": "sparse", "duoattention": "sparse",
    "kivi": "quantization", "fp8": "quantization", "turboquant": "quantization",
    "palu": "compression", "deltakv": "compression",
}
FILES = sorted(METHODS_DIR.glob("*.kvm"))
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_catalogue_is_complete() -> None:
    assert sorted(p.stem for p in FILES) == sorted(EXPECTED)


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_method_checks(path: Path) -> None:
    checked = check_file(path)
    assert checked.name == path.stem
    assert checked.family == EXPECTED[path.stem]


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_method_is_canonically_formatted_and_round_trips(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    formatted = format_source(source, str(path))
    assert formatted == source, f"run `kvc fmt {path}`"
    assert parse_source(formatted, str(path)).method == parse_source(source, str(path)).method


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_method_is_short_and_says_where_it_comes_from(path: Path) -> None:
    lines = path.read_text(encoding="utf-8").split("\n")
    code = [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert len(code) <= 60
    header = []
    for ln in lines:
        if not ln.startswith("#"):
            break
        header.append(ln)
    text = " ".join(header)
    assert len(header) >= 2, "a header comment names the paper or reference implementation"
    if path.stem != "full":
        assert re.search(r"arXiv|github|[A-Za-z-]+/[A-Za-z-]+|vLLM|kvpress", text), "name the reference"
        assert re.search(r"\d", text), "state the reference's default values"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_every_budget_is_a_sympy_formula(path: Path) -> None:
    checked = check_file(path)
    counts = []
    for node in ast.walk(checked.method):
        if isinstance(node, ast.Call) and node.func.name == "top":
            counts.append(node.args[1])
            if node.kwarg("at_least") is not None:
                counts.append(node.kwarg("at_least"))
        if isinstance(node, ast.Range):
            counts.append(node.count)
    for expr in counts:
        text = formula(expr, checked.lets)
        assert read_formula(text) == to_sympy(expr, checked.lets), text


def test_checking_the_whole_catalogue_takes_under_a_second() -> None:
    from kvc.dsl import parser

    parser._lark.cache_clear()  # include building the LALR parser
    # CPU time of this thread: the bar is the checker's cost, not how loaded the CI machine is
    start = time.thread_time()
    for path in FILES:
        check_file(path)
    assert time.thread_time() - start < 1.0


def test_methods_md_lists_every_method() -> None:
    text = (DOCS / "methods.md").read_text(encoding="utf-8")
    for name in EXPECTED:
        assert f"`{name}`" in text, name


def test_kivi_takes_two_or_four_bits() -> None:
    path = METHODS_DIR / "kivi.kvm"
    assert check_file(path, {"bits": 4}).values["bits"] == 4
    with pytest.raises(Exception) as info:
        check_file(path, {"bits": 3})
    assert "bits = 3 is not one of the allowed values {2, 4}" in str(info.value)
