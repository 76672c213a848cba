"""Types of .kvm values, and the unit and axis rules of arithmetic on them.

Pipeline position: used by `kvc.dsl.checker` to annotate every expression (`expr.ty`) and by
`kvc.compiler` to read those annotations. A type never refers back to the AST.

- `Scalar`: int / float / bool, with a unit (`tokens` or none). Number literals have no unit and
  adapt to the other operand (`budget - 32`), named values keep theirs (`budget - kernel` is an
  error when `kernel` is an int): budgets stay in tokens.
- `Tensor`: a float (or bool) value over named axes, e.g. `[kv_head, key]`.
- `Selection`: a set of tokens (or pages, clusters, spans) to keep or read, chosen `per` some axes
  or pooled `across` them; `ranges` marks a pure `first n` / `last n` selection.
"""

from __future__ import annotations

from dataclasses import dataclass


class Type:
    def show(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Unknown(Type):
    """The type of an expression that already failed to check: silences follow-up errors."""

    def __str__(self) -> str:
        return "?"


UNKNOWN = Unknown()


@dataclass(frozen=True)
class Scalar(Type):
    kind: str  # 'int' | 'float' | 'bool'
    unit: str | None = None  # 'tokens' or None
    literal: bool = False  # a constant written without a unit: adapts to the other operand

    def __str__(self) -> str:
        if self.kind == "bool":
            return "bool"
        if self.unit == "tokens":
            return "tokens"
        return self.kind

    @property
    def numeric(self) -> bool:
        return self.kind in ("int", "float")


INT = Scalar("int")
FLOAT = Scalar("float")
BOOL = Scalar("bool")
TOKENS = Scalar("int", "tokens")


@dataclass(frozen=True)
class Enum(Type):
    members: tuple[str, ...]

    def __str__(self) -> str:
        return "{" + ", ".join(self.members) + "}"


@dataclass(frozen=True)
class EnumValue(Type):
    """A bare name that may stand for an enum member (`avg`); resolved where an enum is expected."""

    name: str

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class ListOf(Type):
    elem: Type

    def __str__(self) -> str:
        return f"{self.elem}[]"


@dataclass(frozen=True)
class StringT(Type):
    def __str__(self) -> str:
        return "string"


STRING = StringT()


@dataclass(frozen=True)
class Tensor(Type):
    """A value over named axes. `ranges` lists the axes that hold only a range of their entries,
    each with the ranges taken, outermost first, as written (`x[first (context - w) along key]`
    gives ("key", ("first (context - w)",))), in the order of `dims`. Operands combine by axis
    name, and only where they hold the same entries of every axis they share."""

    dims: tuple[str, ...]
    dtype: str = "float"  # 'float' | 'bool'
    ranges: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def __str__(self) -> str:
        prefix = "mask" if self.dtype == "bool" else ""
        ranges = dict(self.ranges)
        shown = [d + "".join(f"[{r}]" for r in ranges.get(d, ())) for d in self.dims]
        return f"{prefix}[{', '.join(shown)}]"

    def range_of(self, axis: str) -> tuple[str, ...]:
        """The ranges taken of `axis`, outermost first (empty: every entry)."""
        return dict(self.ranges).get(axis, ())

    def reshaped(self, dims, dtype: str | None = None, ranges: dict[str, tuple[str, ...]] | None = None) -> Tensor:
        """A value over `dims` that keeps the ranges of the axes it keeps (or has `ranges`)."""
        dims = tuple(dims)
        table = dict(self.ranges) if ranges is None else ranges
        return Tensor(dims, dtype or self.dtype, tuple((d, table[d]) for d in dims if table.get(d)))


@dataclass(frozen=True)
class Selection(Type):
    item: str  # key, or a partition axis (page, cluster, span)
    per: tuple[str, ...] = ()
    across: tuple[str, ...] = ()
    ranges: bool = False  # only `first n` / `last n` ranges

    def __str__(self) -> str:
        inner = ", ".join(self.per + self.across + (self.item,))
        return f"selection[{inner}]"

    @property
    def dims(self) -> tuple[str, ...]:
        return self.per + self.across


@dataclass(frozen=True)
class Codec(Type):
    name: str

    def __str__(self) -> str:
        return f"format {self.name}"


def unit_name(t: Scalar) -> str:
    return "tokens" if t.unit == "tokens" else ("a number" if t.literal else t.kind)


def join_units(a: Scalar, b: Scalar) -> tuple[str | None, str | None]:
    """Unit of `a + b` (or a comparison, min, max), or (None, error message)."""
    if a.unit == b.unit:
        return a.unit, None
    if a.literal and a.unit is None:
        return b.unit, None
    if b.literal and b.unit is None:
        return a.unit, None
    return None, f"cannot combine {unit_name(a)} and {unit_name(b)}"


def arith(op: str, a: Scalar, b: Scalar) -> tuple[Scalar | None, str | None]:
    """Result of scalar `a op b`, or (None, why not)."""
    if not (a.numeric and b.numeric):
        return None, f"'{op}' needs numbers, not {a} and {b}"
    literal = a.literal and b.literal
    kind = "float" if "float" in (a.kind, b.kind) or op == "/" else "int"
    if op in ("+", "-", "%"):
        unit, err = join_units(a, b)
        if err:
            return None, err
        return Scalar(kind, unit, literal), None
    if op == "*":
        if a.unit == "tokens" and b.unit == "tokens":
            return None, "cannot multiply tokens by tokens"
        return Scalar(kind, a.unit or b.unit, literal), None
    # '/' and '//'
    if b.unit == "tokens" and a.unit != "tokens":
        return None, f"cannot divide {unit_name(a)} by tokens"
    unit = None if (a.unit == "tokens" and b.unit == "tokens") else a.unit
    return Scalar(kind, unit, literal), None


@dataclass(frozen=True)
class PartitionOf(Type):
    """The value of `split(...)` / `kmeans(...)`: a way to cut the key axis into items."""

    kind: str  # 'pages' | 'spans' | 'clusters'
    per: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"partition of key into {self.kind}"
