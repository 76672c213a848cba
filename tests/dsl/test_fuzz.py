"""Mutated method files (token and byte deletions, insertions, swaps) never crash the toolchain.

Only the language's own error type (`KvmError`) may escape `check_source` and `format_source`,
and each input is handled within a time bound.
"""

from __future__ import annotations

import re
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvc.dsl import KvmError, METHODS_DIR, check_source, format_source

SOURCES = {p.name: p.read_bytes() for p in sorted(METHODS_DIR.glob("*.kvm"))}
_TOKEN = re.compile(rb'"(?:[^"\\\n]|\\.)*"|[A-Za-z_][A-Za-z0-9_]*|[0-9.]+|\+=|//|==|!=|<=|>=|\n +|\s+|#[^\n]*|.', re.S)
VOCAB = [b"on", b"keep", b"read", b"top(", b")", b"(", b"[", b"]", b",", b":", b"=", b"+", b"-", b"*", b"//",
         b"over", b"along", b"per", b"across", b"within", b"last", b"first", b"param", b"method", b"\n", b"\n  ",
         b"    ", b"k", b"q", b"attn", b"layer", b"group", b"key", b"0", b"-1", b"99999999999999999999", b"1e999",
         b'"', b"#", b"\t", b"\xff", b"\x00", b"if", b"else", b"in", b"not", b"where", b"state", b"dim",
         b"store", b"as", b"then", b"except", b"selection[", b"{", b"}", b"tokens", b"int[]"]
PER_INPUT_SECONDS = 2.0


def _tokens(data: bytes) -> list[bytes]:
    return _TOKEN.findall(data)


@st.composite
def mutated(draw) -> bytes:
    name = draw(st.sampled_from(sorted(SOURCES)))
    data = SOURCES[name]
    for _ in range(draw(st.integers(1, 4))):
        level = draw(st.sampled_from(["token", "byte"]))
        units = _tokens(data) if level == "token" else [bytes([b]) for b in data]
        if not units:
            units = [b""]
        op = draw(st.sampled_from(["delete", "insert", "swap", "duplicate"]))
        i = draw(st.integers(0, len(units) - 1))
        if op == "delete":
            del units[i]
        elif op == "insert":
            piece = draw(st.sampled_from(VOCAB)) if level == "token" else bytes([draw(st.integers(0, 255))])
            units.insert(i, piece)
        elif op == "swap":
            j = draw(st.integers(0, len(units) - 1))
            units[i], units[j] = units[j], units[i]
        else:
            units.insert(i, units[i])
        data = b"".join(units)
    return data


def _run(data: bytes) -> None:
    for action in (check_source, format_source):
        start = time.perf_counter()
        try:
            action(data, "mutant.kvm")
        except KvmError as e:
            assert e.diagnostics, "a KvmError carries at least one diagnostic"
            for d in e.diagnostics:
                assert d.pos.line >= 1 and d.pos.col >= 1
                d.render()
        elapsed = time.perf_counter() - start
        assert elapsed < PER_INPUT_SECONDS, f"{action.__name__} took {elapsed:.2f}s"


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutated())
def test_mutants_only_raise_kvm_errors(data: bytes) -> None:
    _run(data)


def test_every_single_token_deletion_of_snapkv() -> None:
    """Exhaustive: deleting any one token of a real method never crashes."""
    units = _tokens(SOURCES["snapkv.kvm"])
    for i in range(len(units)):
        _run(b"".join(units[:i] + units[i + 1:]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(mutated())
def test_mutants_that_parse_format_idempotently(data: bytes) -> None:
    from kvc.dsl import parse_source

    try:
        before = parse_source(data, "mutant.kvm").method
    except KvmError:
        return
    once = format_source(data, "mutant.kvm")
    assert format_source(once, "mutant.kvm") == once
    assert parse_source(once, "mutant.kvm").method == before
