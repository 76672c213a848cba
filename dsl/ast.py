"""The .kvm abstract syntax tree: plain dataclasses, one per construct, with source positions.

Pipeline position: built by `kvc.dsl.parser` from the lark tree, annotated by `kvc.dsl.checker`
(every expression's `ty` is filled in: dims of tensors, units of scalars), printed back by
`kvc.dsl.formatter`, and lowered by `kvc.compiler`.

Positions (`pos`) and checker annotations (`ty`) are excluded from equality, so
`parse(format(parse(src))) == parse(src)` compares structure only. Comments are not part of the
tree; the parser returns them beside it (`ParsedFile.comments`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Union

from kvc.dsl.errors import Pos

_NOPOS = Pos(0, 0)


@dataclass
class Node:
    pos: Pos = field(default=_NOPOS, kw_only=True, compare=False, repr=False)


@dataclass
class Ident(Node):
    """A name written at a declaration site or in a clause (kept with its own position)."""

    name: str


# ---- expressions ---------------------------------------------------------------------------


@dataclass
class Expr(Node):
    ty: object = field(default=None, kw_only=True, compare=False, repr=False)  # set by the checker


@dataclass
class Number(Expr):
    value: Union[int, float]


@dataclass
class String(Expr):
    value: str


@dataclass
class Bool(Expr):
    value: bool


@dataclass
class Name(Expr):
    id: str


@dataclass
class ListExpr(Expr):
    items: list[Expr]


@dataclass
class UnaryOp(Expr):
    op: str  # '-' or 'not'
    operand: Expr


@dataclass
class BinOp(Expr):
    op: str  # + - * / // %
    left: Expr
    right: Expr


@dataclass
class Compare(Expr):
    op: str  # == != < <= > >= in 'not in'
    left: Expr
    right: Expr


@dataclass
class BoolOp(Expr):
    op: str  # 'and' | 'or'
    values: list[Expr]


@dataclass
class IfElse(Expr):
    cond: Expr
    then: Expr
    orelse: Expr


@dataclass
class Range(Expr):
    """`first N` / `last N`: the first or last N tokens (a selection, or a slice inside [])."""

    kind: str  # 'first' | 'last'
    count: Expr


@dataclass
class Subscript(Expr):
    """`x[last n]` (a window along query/key, optionally `along D`) or `x[layer]` (a layer slice)."""

    value: Expr
    index: Expr
    along: Ident | None = None


@dataclass
class Kwarg(Node):
    name: Ident
    value: Expr


@dataclass
class Clause(Node):
    """`over a, b` / `along d` / `within p` / `per d` / `across d`: the named axes a call works on."""

    kind: str
    dims: list[Ident]


@dataclass
class Call(Expr):
    func: Ident
    args: list[Expr]
    kwargs: list[Kwarg] = field(default_factory=list)
    clauses: list[Clause] = field(default_factory=list)

    def kwarg(self, name: str) -> Expr | None:
        return next((k.value for k in self.kwargs if k.name.name == name), None)

    def clause(self, kind: str) -> Clause | None:
        return next((c for c in self.clauses if c.kind == kind), None)


# ---- declarations --------------------------------------------------------------------------


@dataclass
class TypeRef(Node):
    """`int`, `float`, `bool`, `tokens`, `int[]` (kind='list'), or `{a, b}` (kind='enum')."""

    kind: str  # 'scalar' | 'list' | 'enum'
    name: str | None = None  # scalar or list element type
    members: list[Ident] = field(default_factory=list)


@dataclass
class Domain(Node):
    """`in [lo, hi]` (kind='range', items=[lo, hi]) or `in {a, b, c}` (kind='set')."""

    kind: str
    items: list[Expr]


@dataclass
class Shape(Node):
    """`[kv_head, key]` (a float tensor) or `selection[kv_head, key]` (kind names the value kind)."""

    kind: Ident | None
    dims: list[Ident]


@dataclass
class Decl(Node):
    pass


@dataclass
class Header(Decl):
    name: Ident
    family: Ident


@dataclass
class Param(Decl):
    name: Ident
    type: TypeRef
    default: Expr
    domain: Domain | None = None


@dataclass
class Let(Decl):
    name: Ident
    value: Expr


@dataclass
class DimDecl(Decl):
    name: Ident
    value: Expr  # a size expression, or split(...) / kmeans(...) partitioning the key axis


@dataclass
class State(Decl):
    name: Ident
    shape: Shape
    init: Expr | None = None
    shared: bool = False  # `shared`: one value per request, seen by every layer


@dataclass
class Input(Decl):
    name: Ident
    shape: Shape
    source: String
    fallback: Ident | None = None  # `or zeros`: the value where no file is found


@dataclass
class Summary(Decl):
    name: Ident
    value: Expr


@dataclass
class Role(Decl):
    name: Ident
    value: Expr


@dataclass
class Store(Decl):
    target: Ident  # k | v
    codecs: list[Expr]  # applied in order ("then")
    exempt: Expr | None = None  # `except first n + last m`: tokens kept at full precision
    also: list[Ident] = field(default_factory=list)  # `store k, v as ...`: encoded together with target
    where: Expr | None = None  # `where layer ...`: the layers stored so (others keep K and V dense)

    @property
    def targets(self) -> list[Ident]:
        return [self.target, *self.also]


@dataclass
class Replay(Decl):
    """`replay PROMPT in chunks of CHUNK [then THEN + last OVERLAP] [over first SINK]` (docs/language.md)."""

    prompt: String
    chunk: Expr
    then: String | None = None  # the prompt of every chunk after the first
    overlap: Expr | None = None  # the previous chunk's last tokens that follow `then`
    sink: Expr | None = None  # the first keys a replayed chunk's attention spans besides the chunk


# ---- hooks ---------------------------------------------------------------------------------


@dataclass
class Target(Node):
    name: Ident
    index: Expr | None = None


@dataclass
class Stmt(Node):
    pass


@dataclass
class Assign(Stmt):
    target: Target
    value: Expr


@dataclass
class Accumulate(Stmt):
    target: Target
    value: Expr


@dataclass
class Keep(Stmt):
    selection: Expr
    role: Ident | None = None


@dataclass
class Read(Stmt):
    selection: Expr


@dataclass
class Estimate(Stmt):
    selection: Expr
    keys: Expr
    values: Expr


@dataclass
class Hook(Decl):
    name: Ident
    where: Expr | None
    body: list[Stmt]


@dataclass
class Method(Node):
    """A whole file: its declarations in source order."""

    items: list[Decl]

    @property
    def header(self) -> Header | None:
        return next((d for d in self.items if isinstance(d, Header)), None)

    @property
    def name(self) -> str | None:
        h = self.header
        return h.name.name if h else None

    @property
    def family(self) -> str | None:
        h = self.header
        return h.family.name if h else None

    def of_type(self, cls: type) -> list:
        return [d for d in self.items if isinstance(d, cls)]

    @property
    def params(self) -> list[Param]:
        return self.of_type(Param)

    @property
    def hooks(self) -> list[Hook]:
        return self.of_type(Hook)


def walk(node: object) -> Iterator[Node]:
    """Every node under `node` (itself included), parents before children, in field order."""
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, Node):
            yield cur
            children = [getattr(cur, f) for f in cur.__dataclass_fields__ if f not in ("pos", "ty")]
            stack.extend(reversed(children))
        elif isinstance(cur, list):
            stack.extend(reversed(cur))
