"""Parser: .kvm text -> `kvc.dsl.ast.Method`, with every syntax error of a file reported.

Pipeline position: after `kvc.dsl.scanner` (bytes, layout, comments), before `kvc.dsl.checker`.
The grammar lives in `grammar.lark` (LALR(1) with an indentation post-lexer). A clean file is
parsed in one pass with the `file` start symbol. When that fails, error recovery parses each
logical line on its own (start symbols `simple_decl`, `hook_head`, `simple_stmt`), reports the
first error of every broken line, and keeps the lines that parse so the checker can still report
the semantic errors of the rest. Names that broken lines would have defined are remembered
(`ParsedFile.poisoned`) so the checker does not report them as unknown.
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import LarkError, UnexpectedCharacters, UnexpectedEOF, UnexpectedToken, VisitError
from lark.indenter import DedentError, Indenter

from kvc.dsl import ast
from kvc.dsl.errors import DiagnosticSink, Pos
from kvc.dsl.scanner import Comment, LogicalLine, Scan, decode, scan

GRAMMAR_PATH = Path(__file__).with_name("grammar.lark")
KEYWORDS = frozenset(
    "method param let dim state shared input summary role store replay on where keep read estimate "
    "using for as then except in chunks of from if else and or not true false first last "
    "over along within per across".split()
)
_DECL_WORD = re.compile(r"\s*(param|let|dim|state|shared|input|summary|role)\s+([A-Za-z_]\w*)")
_STMT_TARGET = re.compile(r"\s*([A-Za-z_]\w*)\s*(\[[^\]]*\])?\s*\+?=")
_STORE_TARGET = re.compile(r"\s*store\s+([A-Za-z_]\w*)")
_ESCAPES = {"n": "\n", "t": "\t", '"': '"', "\\": "\\"}
MAX_DEPTH = 64  # expression nesting; real methods stay under 15, and every later stage recurses


class _KvmIndenter(Indenter):
    NL_type = "_NL"
    OPEN_PAREN_types = ["LPAR", "LSQB", "LBRACE"]
    CLOSE_PAREN_types = ["RPAR", "RSQB", "RBRACE"]
    INDENT_type = "_INDENT"
    DEDENT_type = "_DEDENT"
    tab_len = 8


@functools.lru_cache(maxsize=1)
def _lark() -> Lark:
    return Lark(GRAMMAR_PATH.read_text(encoding="utf-8"), parser="lalr", postlex=_KvmIndenter(),
                start=["file", "simple_decl", "hook_head", "simple_stmt"],
                propagate_positions=True, maybe_placeholders=True)


@functools.lru_cache(maxsize=1)
def _terminal_names() -> dict[str, str]:
    names = {"NAME": "a name", "NUMBER": "a number", "STRING": "a string", "_NL": "end of line",
             "_INDENT": "an indented block", "_DEDENT": "end of the block", "$END": "end of file",
             "COMP_OP": "a comparison", "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/', '//' or '%'"}
    for t in _lark().terminals:
        if t.name not in names and type(t.pattern).__name__ == "PatternStr":
            names[t.name] = repr(t.pattern.value)
    return names


class SyntaxIssue(Exception):
    """A syntax error found while building the tree (e.g. a bad string escape)."""

    def __init__(self, pos: Pos, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.pos, self.message, self.hint = pos, message, hint


@dataclass
class ParsedFile:
    """The result of parsing one file: the tree (possibly partial), comments, layout facts."""

    path: str
    text: str
    method: ast.Method
    comments: list[Comment]
    blank_lines: set[int]
    poisoned: set[str] = field(default_factory=set)  # names defined by lines that failed to parse
    broken: bool = False  # some line failed to parse: `method` is partial


# ---- lark tree -> AST ----------------------------------------------------------------------


@v_args(meta=True)
class _ToAst(Transformer):
    def __init__(self, line_offset: int = 0) -> None:
        super().__init__(visit_tokens=False)
        self.dl = line_offset

    # positions
    def _pos(self, meta) -> Pos:
        return Pos(meta.line + self.dl, meta.column, meta.end_line + self.dl, meta.end_column)

    def _tpos(self, tok: Token) -> Pos:
        return Pos(tok.line + self.dl, tok.column, tok.end_line + self.dl, tok.end_column)

    def _id(self, tok: Token) -> ast.Ident:
        return ast.Ident(str(tok), pos=self._tpos(tok))

    # file structure
    def file(self, meta, children):
        return ast.Method([c for c in children if c is not None], pos=Pos(1, 1))

    def header(self, meta, c):
        return ast.Header(self._id(c[0]), self._id(c[1]), pos=self._pos(meta))

    def param(self, meta, c):
        return ast.Param(self._id(c[0]), c[1], c[2], c[3], pos=self._pos(meta))

    def scalar_type(self, meta, c):
        return ast.TypeRef("scalar", str(c[0]), pos=self._pos(meta))

    def list_type(self, meta, c):
        return ast.TypeRef("list", str(c[0]), pos=self._pos(meta))

    def enum_type(self, meta, c):
        return ast.TypeRef("enum", None, [self._id(t) for t in c], pos=self._pos(meta))

    def range_domain(self, meta, c):
        return ast.Domain("range", list(c), pos=self._pos(meta))

    def set_domain(self, meta, c):
        return ast.Domain("set", list(c), pos=self._pos(meta))

    def let_decl(self, meta, c):
        return ast.Let(self._id(c[0]), c[1], pos=self._pos(meta))

    def dim_decl(self, meta, c):
        return ast.DimDecl(self._id(c[0]), c[1], pos=self._pos(meta))

    def state_decl(self, meta, c):
        return ast.State(self._id(c[0]), c[1], c[2], shared=False, pos=self._pos(meta))

    def shared_decl(self, meta, c):
        return ast.State(self._id(c[0]), c[1], c[2], shared=True, pos=self._pos(meta))

    def input_decl(self, meta, c):
        fallback = None if c[3] is None else self._id(c[3])
        return ast.Input(self._id(c[0]), c[1], self._string(c[2]), fallback, pos=self._pos(meta))

    def summary_decl(self, meta, c):
        return ast.Summary(self._id(c[0]), c[1], pos=self._pos(meta))

    def role_decl(self, meta, c):
        return ast.Role(self._id(c[0]), c[1], pos=self._pos(meta))

    def store_decl(self, meta, c):
        names = [self._id(t) for t in c if isinstance(t, Token)]
        codecs = [x for x in c[:-2] if not isinstance(x, Token)]
        return ast.Store(names[0], codecs, c[-2], also=names[1:], where=c[-1], pos=self._pos(meta))

    def replay_decl(self, meta, c):
        then = self._string(c[2]) if c[2] is not None else None
        return ast.Replay(self._string(c[0]), c[1], then=then, overlap=c[3], sink=c[4], pos=self._pos(meta))

    def shape(self, meta, c):
        kind = self._id(c[0]) if c[0] is not None else None
        return ast.Shape(kind, [self._id(t) for t in c[1:] if t is not None], pos=self._pos(meta))

    def hook_head(self, meta, c):
        return (self._id(c[0]), c[1], self._pos(meta))

    def hook(self, meta, c):
        name, where, pos = c[0]
        return ast.Hook(name, where, list(c[1:]), pos=Pos(pos.line, pos.col, *self._end(meta)))

    def _end(self, meta) -> tuple[int, int]:
        return meta.end_line + self.dl, meta.end_column

    def stmt(self, meta, c):
        return c[0]

    def assign(self, meta, c):
        return ast.Assign(c[0], c[1], pos=self._pos(meta))

    def accumulate(self, meta, c):
        return ast.Accumulate(c[0], c[1], pos=self._pos(meta))

    def target(self, meta, c):
        return ast.Target(self._id(c[0]), c[1], pos=self._pos(meta))

    def keep(self, meta, c):
        return ast.Keep(c[0], self._id(c[1]) if c[1] is not None else None, pos=self._pos(meta))

    def read(self, meta, c):
        return ast.Read(c[0], pos=self._pos(meta))

    def estimate(self, meta, c):
        return ast.Estimate(c[0], c[1], c[2], pos=self._pos(meta))

    # expressions
    def if_else(self, meta, c):
        return ast.IfElse(c[1], c[0], c[2], pos=self._pos(meta))

    def or_test(self, meta, c):
        return ast.BoolOp("or", list(c), pos=self._pos(meta))

    def and_test(self, meta, c):
        return ast.BoolOp("and", list(c), pos=self._pos(meta))

    def not_op(self, meta, c):
        return ast.UnaryOp("not", c[0], pos=self._pos(meta))

    def compare(self, meta, c):
        return ast.Compare(str(c[1]), c[0], c[2], pos=self._pos(meta))

    def member(self, meta, c):
        return ast.Compare("in", c[0], c[1], pos=self._pos(meta))

    def not_member(self, meta, c):
        return ast.Compare("not in", c[0], c[1], pos=self._pos(meta))

    def _fold(self, c) -> ast.Expr:
        left = c[0]
        for i in range(1, len(c), 2):
            right = c[i + 1]
            pos = Pos(left.pos.line, left.pos.col, right.pos.end_line, right.pos.end_col)
            left = ast.BinOp(str(c[i]), left, right, pos=pos)
        return left

    def arith(self, meta, c):
        return self._fold(c)

    def term(self, meta, c):
        return self._fold(c)

    def neg(self, meta, c):
        return ast.UnaryOp("-", c[0], pos=self._pos(meta))

    def first_range(self, meta, c):
        return ast.Range("first", c[0], pos=self._pos(meta))

    def last_range(self, meta, c):
        return ast.Range("last", c[0], pos=self._pos(meta))

    def subscript(self, meta, c):
        value, index, kw, dim = c
        along = None
        if kw is not None:
            if str(kw) != "along":
                raise SyntaxIssue(self._tpos(kw), f"'{kw}' cannot appear in a subscript", "write x[last n along DIM]")
            along = self._id(dim)
        return ast.Subscript(value, index, along, pos=self._pos(meta))

    def number(self, meta, c):
        text = str(c[0])
        value = int(text) if re.fullmatch(r"[0-9]+", text) else float(text)
        return ast.Number(value, pos=self._pos(meta))

    def string(self, meta, c):
        return self._string(c[0])

    def _string(self, tok: Token) -> ast.String:
        raw, out, i = str(tok)[1:-1], [], 0
        while i < len(raw):
            ch = raw[i]
            if ch == "\\":
                esc = raw[i + 1] if i + 1 < len(raw) else ""
                if esc not in _ESCAPES:
                    pos = self._tpos(tok)
                    raise SyntaxIssue(Pos(pos.line, pos.col + 1 + i), f"unknown escape '\\{esc}' in a string",
                                      'use \\n, \\t, \\" or \\\\')
                out.append(_ESCAPES[esc])
                i += 2
            else:
                out.append(ch)
                i += 1
        return ast.String("".join(out), pos=self._tpos(tok))

    def true(self, meta, c):
        return ast.Bool(True, pos=self._pos(meta))

    def false(self, meta, c):
        return ast.Bool(False, pos=self._pos(meta))

    def name(self, meta, c):
        return ast.Name(str(c[0]), pos=self._pos(meta))

    def list(self, meta, c):
        return ast.ListExpr([x for x in c if x is not None], pos=self._pos(meta))

    def kwarg(self, meta, c):
        return ast.Kwarg(self._id(c[0]), c[1], pos=self._pos(meta))

    def clause_kw(self, meta, c):
        return c[0]

    def clauses(self, meta, c):
        out: list[ast.Clause] = []
        for item in c:
            if item is None:
                continue
            if item.type == "NAME":
                out[-1].dims.append(self._id(item))
            else:
                out.append(ast.Clause(str(item), [], pos=self._tpos(item)))
        for cl in out:  # a clause spans its keyword and its axes
            last = cl.dims[-1].pos if cl.dims else cl.pos
            cl.pos = Pos(cl.pos.line, cl.pos.col, last.end_line, last.end_col)
        return out

    def args(self, meta, c):
        return [x for x in c if x is not None]

    def call(self, meta, c):
        func, parts = self._id(c[0]), c[1] or []
        args, kwargs, clauses = [], [], []
        for p in parts:
            if isinstance(p, list):
                clauses.extend(p)
            elif isinstance(p, ast.Kwarg):
                kwargs.append(p)
            else:
                if kwargs:
                    raise SyntaxIssue(p.pos, "positional argument after a keyword argument",
                                      "put `name = value` arguments after the positional ones")
                args.append(p)
        return ast.Call(func, args, kwargs, clauses, pos=self._pos(meta))


# ---- error translation ---------------------------------------------------------------------


def _describe(tok: Token) -> str:
    if tok.type == "$END":
        return "end of file"
    if tok.type == "_NL":
        return "end of line"
    if tok.type == "_INDENT":
        return "indentation"
    if tok.type == "_DEDENT":
        return "end of the block"
    if tok.type == "NAME":
        return f"name '{tok}'" if str(tok) not in KEYWORDS else f"'{tok}'"
    if tok.type == "NUMBER":
        return f"number {tok}"
    if tok.type == "STRING":
        return f"string {tok}"
    return f"'{tok}'"


def _expected(names: set[str], whole_file: bool = True) -> str:
    shown = dict(_terminal_names())
    if not whole_file:  # a single logical line ends where the file would
        shown["$END"] = "end of line"
    names = set(names)
    parts: list[str] = []
    if {"NAME", "NUMBER", "LPAR"} <= names:
        names -= {"NAME", "NUMBER", "STRING", "LPAR", "LSQB", "MINUS", "NOT", "FIRST", "LAST", "TRUE", "FALSE"}
        parts.append("an expression")
    parts += sorted({shown.get(n, n) for n in names})
    if not parts:
        return ""
    if len(parts) > 8:
        parts = parts[:7] + ["..."]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _keyword_hint(tok: Token, expected: set[str]) -> str | None:
    if tok.type != "NAME":
        return None
    names = _terminal_names()
    words = [names[e].strip("'") for e in expected if e in names and names[e].startswith("'")]
    close = difflib.get_close_matches(str(tok), [w for w in words if w.isidentifier()], n=1)
    return f"did you mean '{close[0]}'?" if close else None


def _open_brackets(piece: str, line: int, col: int) -> bool:
    """Is (line, col) of `piece` inside an open bracket? (Strings are skipped.)"""
    lines = piece.split("\n")
    text = "\n".join(lines[:line - 1] + [lines[line - 1][:col - 1]]) if line <= len(lines) else piece
    text = re.sub(r'"([^"\\\n]|\\.)*"', "", text)
    return sum(text.count(c) for c in "([{") > sum(text.count(c) for c in ")]}")


def _report(e: Exception, sink: DiagnosticSink, dl: int, piece: str, start: str = "file") -> None:
    """Translate a lark (or tree-building) error into one diagnostic."""
    whole_file = start == "file"
    if isinstance(e, VisitError):
        e = e.orig_exc
    if isinstance(e, RecursionError):
        sink.error(Pos(1 + dl, 1), f"expression nested too deeply (more than {MAX_DEPTH} levels)")
        return
    if isinstance(e, SyntaxIssue):
        sink.error(e.pos, e.message, e.hint)
        return
    if isinstance(e, UnexpectedToken):
        tok = e.token
        if tok.type == "$END" or tok.line is None:
            line, col = _end_of(piece)
        else:
            line, col = tok.line, tok.column
        pos = Pos(line + dl, col, line + dl, col + max(1, len(str(tok))))
        expected = set(e.expected)
        if expected == {"_INDENT"}:
            sink.error(pos, "expected an indented block of statements after ':'",
                       "indent the hook's statements under `on NAME:`")
            return
        if tok.type == "_INDENT":
            sink.error(pos, "unexpected indentation", "only the statements of a hook are indented")
            return
        if tok.type != "$END" and _open_brackets(piece, tok.line, tok.column):
            expected.discard("_NL")  # inside brackets a line break continues the line
        what = _expected(expected, whole_file)
        hint = _keyword_hint(tok, expected)
        if str(tok) == "=" and tok.type != "$END" and _open_brackets(piece, tok.line, tok.column):
            hint = "`name = value` arguments come before the axis clauses (over, along, within, per, across)"
        if start == "hook_head" and expected <= {"$END", "_NL"}:
            hint = "a hook's statements go on the lines below `on NAME:`, indented"
        described = "end of line" if tok.type == "$END" and not whole_file else _describe(tok)
        sink.error(pos, f"unexpected {described}" + (f"; expected {what}" if what else ""), hint)
        return
    if isinstance(e, UnexpectedCharacters):
        sink.error(Pos(e.line + dl, e.column), f"unexpected character {e.char!r}")
        return
    if isinstance(e, UnexpectedEOF):
        line, col = _end_of(piece)
        where = "end of file" if whole_file else "end of line"
        sink.error(Pos(line + dl, col), f"unexpected {where}" +
                   (f"; expected {_expected(set(e.expected), whole_file)}" if e.expected else ""))
        return
    if isinstance(e, DedentError):
        sink.error(Pos(1 + dl, 1), "inconsistent indentation", "indent every statement of a hook by the same amount")
        return
    sink.error(Pos(1 + dl, 1), f"internal parser error ({type(e).__name__}: {e}); please report it")


def _end_of(piece: str) -> tuple[int, int]:
    stripped = piece.rstrip()
    line = stripped.count("\n") + 1
    return line, len(stripped) - (stripped.rfind("\n") + 1) + 1


# ---- parsing -------------------------------------------------------------------------------


def _parse_piece(text: str, start: str, line_offset: int, sink: DiagnosticSink):
    try:
        tree = _lark().parse(text, start=start)
        node = _ToAst(line_offset).transform(tree)
        _check_depth(node)
        return node
    except (LarkError, SyntaxIssue, DedentError) as e:
        _report(e, sink, line_offset, text, start)
        return None


def _check_depth(root: object) -> None:
    """Reject expressions nested deeper than MAX_DEPTH (e.g. 5000 terms joined by '+'), iteratively."""
    stack = [(root, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, ast.Expr):
            depth += 1
            if depth > MAX_DEPTH:
                raise SyntaxIssue(node.pos, f"expression nested too deeply (more than {MAX_DEPTH} levels)",
                                  "split it with `let` definitions or hook values")
        if isinstance(node, ast.Node):
            stack.extend((getattr(node, f), depth) for f in node.__dataclass_fields__ if f not in ("pos", "ty"))
        elif isinstance(node, (list, tuple)):
            stack.extend((x, depth) for x in node)


def parse_text(text: str, path: str, sink: DiagnosticSink) -> ParsedFile:
    """Parse decoded text. Syntax errors go to `sink`; the returned method may then be partial."""
    layout = scan(text, sink)
    if not sink:
        full = text if text.endswith("\n") else text + "\n"
        probe = DiagnosticSink(path, text)
        method = _parse_piece(full, "file", 0, probe)
        if method is not None:
            return ParsedFile(path, text, method, layout.comments, layout.blank_lines)
        before = len(sink.items)
        parsed = _recover(layout, path, sink)
        if len(sink.items) == before:  # recovery found nothing line by line: report the whole-file error
            sink.items.extend(probe.items)
        return parsed
    return _recover(layout, path, sink)


def _recover(layout: Scan, path: str, sink: DiagnosticSink) -> ParsedFile:
    text = layout.text
    items: list[ast.Decl] = []
    poisoned: set[str] = set()
    groups: list[list[LogicalLine]] = []
    for ll in layout.lines:
        if ll.col == 1:
            groups.append([ll])
        elif groups:
            groups[-1].append(ll)
        elif not ll.broken:
            sink.error(Pos(ll.line, ll.col), "unexpected indentation", "top-level declarations start at column 1")

    def poison(piece: str) -> None:
        for rx in (_DECL_WORD, _STORE_TARGET):
            m = rx.match(piece)
            if m:
                poisoned.add(m.group(m.lastindex))

    for group in groups:
        head, body = group[0], group[1:]
        head_text = text[head.start:head.end]
        if head.broken:
            poison(head_text)
            continue
        if re.match(r"on\b", head_text):
            parsed_head = _parse_piece(head_text, "hook_head", head.line - 1, sink)
            stmts: list[ast.Stmt] = []
            if not body and parsed_head is not None:
                end = Pos(head.end_line, len(head_text.rstrip().split("\n")[-1]) + 1)
                sink.error(end, "expected an indented block of statements after ':'",
                           "indent the hook's statements under `on NAME:`")
            for ll in body:
                piece = text[ll.start:ll.end]
                if ll.broken or ll.col != body[0].col:
                    if not ll.broken:
                        sink.error(Pos(ll.line, ll.col), "inconsistent indentation",
                                   f"indent every statement of this hook by {body[0].col - 1} spaces")
                    m = _STMT_TARGET.match(piece)
                    if m:
                        poisoned.add(m.group(1))
                    continue
                stmt = _parse_piece(piece, "simple_stmt", ll.line - 1, sink)
                if stmt is None:
                    m = _STMT_TARGET.match(piece)
                    if m:
                        poisoned.add(m.group(1))
                else:
                    stmts.append(stmt)
            if parsed_head is not None:
                name, where, pos = parsed_head
                items.append(ast.Hook(name, where, stmts, pos=pos))
            continue
        decl = _parse_piece(head_text, "simple_decl", head.line - 1, sink)
        if decl is None:
            poison(head_text)
        else:
            items.append(decl)
        if body:
            sink.error(Pos(body[0].line, body[0].col), "unexpected indentation",
                       "only the statements of a hook (`on NAME:`) are indented")
    return ParsedFile(path, text, ast.Method(items, pos=Pos(1, 1)), layout.comments, layout.blank_lines,
                      poisoned, broken=True)


def load(source: str | bytes, path: str, sink: DiagnosticSink) -> ParsedFile | None:
    """Decode and parse; None when the bytes are not a method file at all (sink says why)."""
    data = source if isinstance(source, bytes) else source.encode("utf-8", errors="surrogatepass")
    text = decode(data, sink)
    if text is None:
        return None
    sink.set_text(text)
    try:
        return parse_text(text, path, sink)
    except RecursionError:
        sink.error(Pos(1, 1), "expression nested too deeply")
        return None


def parse(source: str | bytes, path: str = "<string>") -> ParsedFile:
    """Parse a whole method file; raise `KvmError` with every syntax error if there is any."""
    sink = DiagnosticSink(path, source if isinstance(source, str) else None)
    parsed = load(source, path, sink)
    sink.raise_if_any()
    assert parsed is not None
    return parsed


__all__ = ["KEYWORDS", "ParsedFile", "SyntaxIssue", "load", "parse", "parse_text"]
