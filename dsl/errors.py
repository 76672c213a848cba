"""Diagnostics of the .kvm language: the error type every stage of `kvc.dsl` reports through.

Pipeline position: used by the scanner, parser, checker and formatter alike. A stage never raises
on the first problem; it collects `Diagnostic`s and the caller raises one `KvmError` holding all
of them, so `kvc check` shows every error of a file in one run.

Rendering (what a user sees):

    methods/snapkv.kvm:12:28: error: unknown name 'windw'
       12 |   keep top(score, budget - windw, per kv_head) + last window
          |                            ^^^^^
       hint: did you mean 'window'?
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvc.errors import KvcError


@dataclass(frozen=True)
class Pos:
    """A source span: 1-based line and column of the first character, and of one past the last."""

    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    @staticmethod
    def start() -> "Pos":
        return Pos(1, 1)


@dataclass
class Diagnostic:
    """One problem in one file, at one place."""

    path: str
    pos: Pos
    message: str
    hint: str | None = None
    source_line: str | None = field(default=None, repr=False)

    def render(self) -> str:
        head = f"{self.path}:{self.pos.line}:{self.pos.col}: error: {self.message}"
        lines = [head]
        if self.source_line is not None:
            shown = self.source_line.rstrip("\n").expandtabs(1)
            if len(shown) > 200:  # a giant line (minified or binary junk): show the part at the caret
                start = max(0, self.pos.col - 100)
                shown = shown[start:start + 200]
                caret_col = self.pos.col - start
            else:
                caret_col = self.pos.col
            number = f"{self.pos.line:>5}"
            width = 1
            if self.pos.end_line == self.pos.line and self.pos.end_col and self.pos.end_col > self.pos.col:
                width = self.pos.end_col - self.pos.col
            width = max(1, min(width, len(shown) - caret_col + 1))
            lines.append(f"{number} | {shown}")
            lines.append(f"{' ' * len(number)} | {' ' * (caret_col - 1)}{'^' * width}")
        if self.hint:
            lines.append(f"      hint: {self.hint}")
        return "\n".join(lines)


class KvmError(KvcError):
    """Errors in one or more .kvm files. `diagnostics` holds every problem found, in order."""

    def __init__(self, diagnostics: list[Diagnostic]) -> None:
        self.diagnostics = sorted(diagnostics, key=lambda d: (d.path, d.pos.line, d.pos.col))
        super().__init__("\n".join(d.render() for d in self.diagnostics))

    @property
    def first(self) -> Diagnostic:
        return self.diagnostics[0]


MAX_DIAGNOSTICS = 100  # per file: past this, a file is not a method with typos but something else


class DiagnosticSink:
    """Collects diagnostics for one file; fills in the source line for the caret display."""

    def __init__(self, path: str, text: str | None) -> None:
        self.path = path
        self._lines = text.split("\n") if text is not None else []
        self.items: list[Diagnostic] = []
        self._seen: set[tuple[int, int, str]] = set()

    def set_text(self, text: str) -> None:
        self._lines = text.split("\n")

    def error(self, pos: Pos, message: str, hint: str | None = None) -> None:
        key = (pos.line, pos.col, message)
        if key in self._seen:  # one construct reached twice (e.g. a let used in two hooks)
            return
        self._seen.add(key)
        if len(self.items) == MAX_DIAGNOSTICS:
            self.items.append(Diagnostic(self.path, pos,
                                         f"too many errors (more than {MAX_DIAGNOSTICS}); stopping here"))
        if len(self.items) > MAX_DIAGNOSTICS:
            return
        line = self._lines[pos.line - 1] if 0 < pos.line <= len(self._lines) else None
        self.items.append(Diagnostic(self.path, pos, message, hint, line))

    def __bool__(self) -> bool:
        return bool(self.items)

    def raise_if_any(self) -> None:
        if self.items:
            raise KvmError(self.items)
