"""Source loading and layout scan: the first stage of `kvc.dsl`, before lark sees any text.

It does what a grammar cannot do well: reject oversized files, bytes that are not UTF-8, tabs and
control characters, unbalanced brackets and unterminated strings, each with an exact position;
collect comments (the formatter keeps them; the grammar folds them into line ends); and cut the
text into logical lines (a line plus its bracketed continuation lines). The parser's error
recovery parses those logical lines one by one, so one broken line does not hide the errors of
the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvc.dsl.errors import DiagnosticSink, Pos

MAX_BYTES = 64 * 1024  # a method is a few dozen lines; this bounds the work on hostile input
MAX_NESTING = 32
MAX_LINE = 2000  # characters in one logical line (a statement); real ones stay under 150
_OPEN = {"(": ")", "[": "]", "{": "}"}
_CLOSE = {")": "(", "]": "[", "}": "{"}
# A line starting at column 1 with one of these words begins a new declaration, even if an earlier
# bracket was left open: resynchronise there so the rest of the file is still checked.
_DECL_START = re.compile(r"(method|param|let|dim|state|shared|input|summary|role|store|replay|on)\b")


@dataclass(frozen=True)
class Comment:
    line: int
    col: int
    text: str  # including the leading '#'
    own_line: bool  # nothing but spaces before it on its line


@dataclass(frozen=True)
class LogicalLine:
    """One statement's worth of text: from the start of `line` to `end` (exclusive offset)."""

    line: int  # first physical line
    end_line: int
    col: int  # column of the first code character (1-based); 1 means a top-level line
    start: int  # offset of the start of `line` (so columns of a piece match the file)
    end: int
    broken: bool = False  # the scanner already reported an error inside it


@dataclass
class Scan:
    text: str
    comments: list[Comment] = field(default_factory=list)
    lines: list[LogicalLine] = field(default_factory=list)
    blank_lines: set[int] = field(default_factory=set)
    error_lines: set[int] = field(default_factory=set)


def decode(data: bytes, sink: DiagnosticSink) -> str | None:
    """Bytes -> text, or None after reporting why the bytes are not a method file."""
    if len(data) > MAX_BYTES:
        sink.error(Pos(1, 1), f"file is too large ({len(data)} bytes); a method file is at most {MAX_BYTES} bytes",
                   hint="a .kvm file describes one method in a few dozen lines")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        sink.set_text(data.decode("utf-8", errors="replace"))
        line = data.count(b"\n", 0, e.start) + 1
        line_start = data.rfind(b"\n", 0, e.start) + 1
        col = len(data[line_start:e.start].decode("utf-8", errors="replace")) + 1
        sink.error(Pos(line, col), f"invalid UTF-8 byte 0x{data[e.start]:02x}; a method file must be UTF-8 text",
                   hint="re-save the file as UTF-8")
        return None
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n")
    if not text.strip():
        sink.error(Pos(1, 1), "empty file: a method file starts with `method NAME : FAMILY`",
                   hint="e.g. `method mymethod : eviction`")
        return None
    return text


def scan(text: str, sink: DiagnosticSink) -> Scan:
    """Cut `text` into logical lines; report lexical problems the grammar would report badly."""
    out = Scan(text)
    stack: list[tuple[str, int, int]] = []  # open brackets: (char, line, col)
    nesting_reported = False
    cur: tuple[int, int, int] | None = None  # (line start offset, line, col) of the open logical line
    line, line_start, i, n = 1, 0, 0, len(text)
    code_on_line = comment_on_line = False
    last_code = 0  # offset just after the last code character (pieces end there, before comments)

    def error(at_line: int, at_col: int, message: str, hint: str | None = None, width: int = 1) -> None:
        out.error_lines.add(at_line)
        sink.error(Pos(at_line, at_col, at_line, at_col + width), message, hint)

    def close_logical(end: int, end_line: int) -> None:
        nonlocal cur
        if cur is not None:
            if end - cur[0] > MAX_LINE:
                error(cur[1], cur[2], f"statement too long ({end - cur[0]} characters; at most {MAX_LINE})",
                      "split it with `let` definitions or hook values")
            broken = any(ln in out.error_lines for ln in range(cur[1], end_line + 1))
            out.lines.append(LogicalLine(cur[1], end_line, cur[2], cur[0], end, broken))
            cur = None

    while i < n:
        c = text[i]
        if c == "\n":
            if not stack:
                close_logical(last_code, line)
            if not code_on_line and not comment_on_line:
                out.blank_lines.add(line)
            line, line_start, i = line + 1, i + 1, i + 1
            code_on_line = comment_on_line = False
            if stack and _DECL_START.match(text, i):
                for ch, ln, co in stack:
                    error(ln, co, f"'{ch}' is never closed", f"add '{_OPEN[ch]}' before the end of the statement")
                stack.clear()
                close_logical(last_code, line - 1)
            continue
        col = i - line_start + 1
        if c == " ":
            i += 1
            continue
        if c == "#":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.comments.append(Comment(line, col, text[i:j].rstrip(), own_line=not code_on_line))
            comment_on_line = True
            i = j
            continue
        if c == "\t":
            error(line, col, "tab character; indent and separate with spaces")
            i += 1
            continue
        if ord(c) < 32 or c == "\x7f" or c == "\ufeff":
            error(line, col, f"unexpected control character U+{ord(c):04X}")
            i += 1
            continue
        if cur is None:
            cur = (line_start, line, col)
        code_on_line = True
        if c == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            if j < n and text[j] == '"':
                i = j + 1
            else:
                error(line, col, "unterminated string", 'close it with " on the same line')
                i = min(j, n)
            last_code = i
            continue
        if c in _OPEN:
            stack.append((c, line, col))
            if len(stack) > MAX_NESTING and not nesting_reported:
                nesting_reported = True
                error(line, col, f"brackets nested more than {MAX_NESTING} deep")
        elif c in _CLOSE:
            if not stack:
                error(line, col, f"unmatched '{c}'")
            else:
                opener, ln, co = stack.pop()
                if opener != _CLOSE[c]:
                    error(line, col, f"'{c}' does not match '{opener}' opened at {ln}:{co}")
        i += 1
        last_code = i
    for ch, ln, co in stack:
        error(ln, co, f"'{ch}' is never closed", f"add '{_OPEN[ch]}' before the end of the statement")
    close_logical(last_code, line)
    return out
