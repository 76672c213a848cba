"""kvc.dsl: the .kvm method language — grammar, parser, checker, formatter and their CLI.

Pipeline: bytes -> `scanner` (layout, comments) -> `parser` (lark, grammar.lark) -> `ast`
-> `checker` (names, types, axes, hooks, budgets) -> `CheckedMethod` for `kvc.compiler`.
`formatter` prints an AST back in canonical form; `symbolic` turns expressions into sympy.

Public API:
    check_source(text_or_bytes, path, params=None) -> CheckedMethod   (raises KvmError)
    check_file(path, params=None) -> CheckedMethod
    parse_source(text_or_bytes, path) -> ParsedFile                  (syntax only)
    format_source(text_or_bytes, path) -> str
    method_path(name) -> Path of a shipped method (methods/<name>.kvm)
    load_method(name_or_path, params=None) -> CheckedMethod          (a shipped name or a .kvm path)
"""

from __future__ import annotations

from pathlib import Path

from kvc.dsl.errors import Diagnostic, DiagnosticSink, KvmError, Pos

METHODS_DIR = Path(__file__).resolve().parent.parent / "methods"


def parse_source(source: str | bytes, path: str = "<string>"):
    from kvc.dsl.parser import parse

    return parse(source, path)


def check_source(source: str | bytes, path: str = "<string>", params: dict | None = None):
    """Parse and check one method; raise `KvmError` with every problem found."""
    from kvc.dsl.checker import Checker
    from kvc.dsl.parser import load

    sink = DiagnosticSink(path, source if isinstance(source, str) else None)
    parsed = load(source, path, sink)
    if parsed is None:
        sink.raise_if_any()
    try:
        checked = Checker(parsed, sink, params).run()
    except RecursionError:
        sink.error(Pos(1, 1), "expression nested too deeply")
        checked = None
    sink.raise_if_any()
    return checked


def check_file(path: str | Path, params: dict | None = None):
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise KvmError([Diagnostic(str(path), Pos(1, 1), f"cannot read the file: {e.strerror or e}")]) from None
    return check_source(data, str(path), params)


def format_source(source: str | bytes, path: str = "<string>") -> str:
    from kvc.dsl.formatter import format_parsed

    return format_parsed(parse_source(source, path))


def method_path(name: str) -> Path:
    """The .kvm file of a shipped method, e.g. method_path('snapkv')."""
    path = METHODS_DIR / f"{name}.kvm"
    if not path.is_file():
        known = sorted(p.stem for p in METHODS_DIR.glob("*.kvm"))
        raise KvmError([Diagnostic(str(path), Pos(1, 1),
                                   f"no shipped method named '{name}'; known: {', '.join(known)}")])
    return path


def load_method(name_or_path: str | Path, params: dict | None = None):
    """A checked method from a shipped name ('snapkv') or a path to a user's .kvm file."""
    text = str(name_or_path)
    path = Path(text) if text.endswith(".kvm") or "/" in text or Path(text).is_file() else method_path(text)
    return check_file(path, params)


__all__ = ["Diagnostic", "KvmError", "METHODS_DIR", "Pos", "check_file", "check_source", "format_source",
           "load_method", "method_path", "parse_source"]
