"""Formatter: a parsed method printed back in canonical form (what `kvc fmt` writes).

Pipeline position: reads `kvc.dsl.parser.ParsedFile` (tree + comments + blank lines); nothing
downstream depends on it. The output parses back to an equal tree, and formatting it again
changes nothing.

Canonical form: declarations in source order, one per line (bracketed continuations joined),
hook bodies indented by two spaces, one space around binary operators and after commas, minimal
parentheses, runs of blank lines collapsed to one (and none at the start of a block), comments
kept where they were (a comment inside a joined expression moves to the end of its line), and
the trailing comments of consecutive lines aligned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvc.dsl import ast
from kvc.dsl.parser import ParsedFile

INDENT = "  "

# Binding strength of each construct; a child weaker than its slot needs parentheses.
_IF, _OR, _AND, _NOT, _CMP, _ADD, _MUL, _UNARY, _POSTFIX, _ATOM = range(1, 11)
_BINOP_PREC = {"+": _ADD, "-": _ADD, "*": _MUL, "/": _MUL, "//": _MUL, "%": _MUL}


def expr(e: ast.Expr, slot: int = 0) -> str:
    """`e` as source text, parenthesised if it binds more loosely than `slot` allows."""
    text, prec = _render(e)
    return f"({text})" if prec < slot else text


def _render(e: ast.Expr) -> tuple[str, int]:
    if isinstance(e, ast.Number):
        return (str(e.value) if isinstance(e.value, int) else repr(e.value)), _ATOM
    if isinstance(e, ast.String):
        return _string(e.value), _ATOM
    if isinstance(e, ast.Bool):
        return ("true" if e.value else "false"), _ATOM
    if isinstance(e, ast.Name):
        return e.id, _ATOM
    if isinstance(e, ast.ListExpr):
        return "[" + ", ".join(expr(i) for i in e.items) + "]", _ATOM
    if isinstance(e, ast.Call):
        parts = [expr(a) for a in e.args] + [f"{k.name.name} = {expr(k.value)}" for k in e.kwargs]
        parts += [f"{c.kind} " + ", ".join(d.name for d in c.dims) for c in e.clauses]
        return f"{e.func.name}(" + ", ".join(parts) + ")", _ATOM
    if isinstance(e, ast.Subscript):
        along = f" along {e.along.name}" if e.along is not None else ""
        return f"{expr(e.value, _POSTFIX)}[{expr(e.index)}{along}]", _POSTFIX
    if isinstance(e, ast.Range):
        return f"{e.kind} {expr(e.count, _UNARY)}", _UNARY
    if isinstance(e, ast.UnaryOp):
        if e.op == "not":
            return f"not {expr(e.operand, _NOT)}", _NOT
        return f"-{expr(e.operand, _UNARY)}", _UNARY
    if isinstance(e, ast.BinOp):
        prec = _BINOP_PREC[e.op]
        return f"{expr(e.left, prec)} {e.op} {expr(e.right, prec + 1)}", prec
    if isinstance(e, ast.Compare):
        return f"{expr(e.left, _ADD)} {e.op} {expr(e.right, _ADD)}", _CMP
    if isinstance(e, ast.BoolOp):
        prec = _OR if e.op == "or" else _AND
        return f" {e.op} ".join(expr(v, prec + 1) for v in e.values), prec
    if isinstance(e, ast.IfElse):
        return f"{expr(e.then, _OR)} if {expr(e.cond, _OR)} else {expr(e.orelse, _IF)}", _IF
    raise TypeError(f"cannot format {type(e).__name__}")


def _string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


def _shape(s: ast.Shape) -> str:
    inner = "[" + ", ".join(d.name for d in s.dims) + "]"
    return (s.kind.name + inner) if s.kind is not None else inner


def _type(t: ast.TypeRef) -> str:
    if t.kind == "enum":
        return "{" + ", ".join(m.name for m in t.members) + "}"
    return f"{t.name}[]" if t.kind == "list" else str(t.name)


def decl(d: ast.Decl) -> str:
    """One declaration (a hook: its head line) as a line of source."""
    if isinstance(d, ast.Header):
        return f"method {d.name.name} : {d.family.name}"
    if isinstance(d, ast.Param):
        text = f"param {d.name.name}: {_type(d.type)} = {expr(d.default, _ADD)}"
        if d.domain is not None:
            items = ", ".join(expr(i) for i in d.domain.items)
            text += f" in [{items}]" if d.domain.kind == "range" else f" in {{{items}}}"
        return text
    if isinstance(d, ast.Let):
        return f"let {d.name.name} = {expr(d.value)}"
    if isinstance(d, ast.DimDecl):
        return f"dim {d.name.name} = {expr(d.value)}"
    if isinstance(d, ast.State):
        text = f"{'shared' if d.shared else 'state'} {d.name.name}: {_shape(d.shape)}"
        return text + (f" = {expr(d.init)}" if d.init is not None else "")
    if isinstance(d, ast.Input):
        fallback = "" if d.fallback is None else f" or {d.fallback.name}"
        return f"input {d.name.name}: {_shape(d.shape)} from {_string(d.source.value)}{fallback}"
    if isinstance(d, ast.Summary):
        return f"summary {d.name.name} = {expr(d.value)}"
    if isinstance(d, ast.Role):
        return f"role {d.name.name} = {expr(d.value)}"
    if isinstance(d, ast.Store):
        text = f"store {', '.join(t.name for t in d.targets)} as " + " then ".join(expr(c) for c in d.codecs)
        text += f" except {expr(d.exempt)}" if d.exempt is not None else ""
        return text + (f" where {expr(d.where)}" if d.where is not None else "")
    if isinstance(d, ast.Replay):
        text = f"replay {_string(d.prompt.value)} in chunks of {expr(d.chunk)}"
        if d.then is not None:
            text += f" then {_string(d.then.value)} + last {expr(d.overlap)}"
        return text + (f" over first {expr(d.sink)}" if d.sink is not None else "")
    if isinstance(d, ast.Hook):
        where = f" where {expr(d.where)}" if d.where is not None else ""
        return f"on {d.name.name}{where}:"
    raise TypeError(f"cannot format {type(d).__name__}")


def stmt(s: ast.Stmt) -> str:
    if isinstance(s, (ast.Assign, ast.Accumulate)):
        target = s.target.name.name + (f"[{expr(s.target.index)}]" if s.target.index is not None else "")
        return f"{target} {'=' if isinstance(s, ast.Assign) else '+='} {expr(s.value)}"
    if isinstance(s, ast.Keep):
        return f"keep {expr(s.selection)}" + (f" for {s.role.name}" if s.role is not None else "")
    if isinstance(s, ast.Read):
        return f"read {expr(s.selection)}"
    if isinstance(s, ast.Estimate):
        return f"estimate {expr(s.selection)} using {expr(s.keys)}, {expr(s.values)}"
    raise TypeError(f"cannot format {type(s).__name__}")


# ---- layout: comments and blank lines ------------------------------------------------------


@dataclass
class _Slot:
    start: int
    end: int
    level: int
    text: str
    leading: list = field(default_factory=list)  # own-line comments printed before it
    trailing: list[str] = field(default_factory=list)  # comments appended to its line
    after: list = field(default_factory=list)  # own-line comments closing a hook body


def _slots(method: ast.Method) -> list[_Slot]:
    out = []
    for item in method.items:
        if isinstance(item, ast.Hook):
            end = item.where.pos.end_line if item.where is not None else item.pos.line
            out.append(_Slot(item.pos.line, end, 0, decl(item)))
            out += [_Slot(s.pos.line, s.pos.end_line or s.pos.line, 1, stmt(s)) for s in item.body]
        else:
            out.append(_Slot(item.pos.line, item.pos.end_line or item.pos.line, 0, decl(item)))
    return out


def format_parsed(parsed: ParsedFile) -> str:
    slots = _slots(parsed.method)
    tail: list = []
    for c in parsed.comments:
        owner = next((s for s in slots if s.start <= c.line <= s.end), None)
        if owner is not None:
            (owner.leading if c.own_line else owner.trailing).append(c if c.own_line else c.text)
            continue
        nxt = next((s for s in slots if s.start > c.line), None)
        prev = next((s for s in reversed(slots) if s.end < c.line), None)
        if prev is not None and prev.level == 1 and c.col > 1 and (nxt is None or nxt.level == 0):
            prev.after.append(c)
        elif nxt is not None:
            nxt.leading.append(c)
        else:
            tail.append(c)

    rows: list[tuple[str, str | None]] = []  # (code with indent, trailing comment); ("", None) is blank
    blank = parsed.blank_lines
    after_head = False  # the next row opens a hook body: no blank line there

    def emit(line: int, text: str, comment: str | None, head: bool = False) -> None:
        nonlocal after_head
        if rows and (line - 1) in blank and not after_head:
            rows.append(("", None))
        rows.append((text, comment))
        after_head = head

    for s in slots:
        pad = INDENT * s.level
        for c in s.leading:
            emit(c.line, pad + c.text, None)
        emit(s.start, pad + s.text, "  ".join(s.trailing) if s.trailing else None, head=s.text.startswith("on "))
        for c in s.after:
            emit(c.line, pad + c.text, None)
    for c in tail:
        emit(c.line, c.text, None)
    return _align(rows)


def _align(rows: list[tuple[str, str | None]]) -> str:
    """Join rows; trailing comments of consecutive commented lines start in one column."""
    out: list[str] = []
    i = 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][1] is not None:
            j += 1
        if j > i:
            width = max(len(code) for code, _ in rows[i:j])
            out += [f"{code.ljust(width)}  {comment}" for code, comment in rows[i:j]]
            i = j
        else:
            out.append(rows[i][0])
            i += 1
    return "\n".join(line.rstrip() for line in out).strip("\n") + "\n"


__all__ = ["decl", "expr", "format_parsed", "stmt"]
