"""Checking of `param` declarations: types, defaults, ranges, and the overrides a user passes.

Pipeline position: `kvc.dsl.checker` hands every `param` to `ParamChecker.check` in file order and
declares the name itself. A parameter's value in force is its override if one was given (checked
against the same type and range), else its default; later defaults see earlier values.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvc.dsl import ast
from kvc.dsl.check_exprs import Ctx, ExprChecker
from kvc.dsl.evaluate import EvalError, Member, evaluate
from kvc.dsl.types import BOOL, FLOAT, INT, TOKENS, UNKNOWN, Enum, ListOf, Scalar, Type

_SCALARS = {"int": INT, "float": FLOAT, "bool": BOOL, "tokens": TOKENS}


@dataclass
class ParamInfo:
    name: str
    type: Type
    default: object
    decl: ast.Param
    domain: tuple[str, list] | None = None  # ('range', [lo, hi]) or ('set', [values])


class ParamChecker:
    def __init__(self, xc: ExprChecker, overrides: dict[str, object]) -> None:
        self.xc, self.overrides = xc, overrides
        self.params: dict[str, ParamInfo] = {}
        self.values: dict[str, object] = {}  # values in force, for later defaults and budgets

    def check(self, p: ast.Param) -> tuple[Type, ParamInfo | None, object]:
        """Check one declaration: (type, info, value in force). The caller declares the name and,
        if it was accepted, records `info` in `params` and the value in `values`."""
        t = self.type_of(p.type)
        if t is UNKNOWN:
            return t, None, None
        default = self.default(p, t)
        domain = self.domain(p, t, default) if default is not None and p.domain is not None else None
        info = ParamInfo(p.name.name, t, default, p, domain)
        value = default
        if p.name.name in self.overrides:
            value = self.override(info, self.overrides[p.name.name])
        return t, info, value

    def unknown_overrides(self, header: ast.Node) -> None:
        for name in self.overrides:
            if name not in self.params:
                self.xc.sink.error(header.pos, f"this method has no parameter '{name}'",
                                   self.xc.suggest(name, self.params))

    # ---- pieces ----------------------------------------------------------------------------

    def type_of(self, tref: ast.TypeRef) -> Type:
        if tref.kind == "scalar":
            t = _SCALARS.get(tref.name or "")
            if t is None:
                self.xc.error(tref, f"unknown type '{tref.name}'",
                              "types are int, float, bool, tokens, int[] and {a, b, ...}")
                return UNKNOWN
            return t
        if tref.kind == "list":
            if tref.name != "int":
                self.xc.error(tref, f"lists hold whole numbers: int[], not {tref.name}[]")
                return UNKNOWN
            return ListOf(INT)
        names = [m.name for m in tref.members]
        for i, m in enumerate(tref.members):
            if m.name in names[:i]:
                self.xc.error(m, f"'{m.name}' is listed twice")
                return UNKNOWN
        return Enum(tuple(names))

    def default(self, p: ast.Param, t: Type) -> object:
        """Type-check and evaluate the default; None (after reporting) if unusable."""
        name, expr = p.name.name, p.default
        if isinstance(t, Enum):
            if isinstance(expr, ast.Name) and expr.id in t.members:
                expr.ty = t
                return Member(expr.id)
            shown = expr.id if isinstance(expr, ast.Name) else "this"
            self.xc.error(expr, f"default '{shown}' of {name} is not one of {', '.join(t.members)}")
            return None
        et = self.xc.check(expr, Ctx("in a parameter default", frozenset({"param"}), frozenset()))
        if et is UNKNOWN:
            return None
        if not fits(et, t):
            self.xc.error(expr, f"default of {name} must be {type_word(t)}, not {et}")
            return None
        try:
            value = evaluate(expr, self.values)
        except EvalError as e:
            self.xc.error(expr, f"default of {name} must be a constant ({e})")
            return None
        if t in (INT, TOKENS) and isinstance(value, float) and value.is_integer():
            value = int(value)  # e.g. budget / 2 of an even budget
        if t in (INT, TOKENS) and not isinstance(value, int):
            self.xc.error(expr, f"default of {name} must be a whole number, not {value!r}")
            return None
        if t == TOKENS and value < 0:
            self.xc.error(expr, f"default of {name} is negative ({value}); a number of tokens cannot be",
                          "budgets and windows are counts of tokens, 0 or more")
            return None
        return float(value) if t == FLOAT else value

    def domain(self, p: ast.Param, t: Type, value: object) -> tuple[str, list] | None:
        dom, name = p.domain, p.name.name
        assert dom is not None
        items = []
        for it in dom.items:
            if isinstance(t, Enum):
                if not (isinstance(it, ast.Name) and it.id in t.members):
                    self.xc.error(it, f"'{getattr(it, 'id', '?')}' is not one of {', '.join(t.members)}")
                    return None
                items.append(Member(it.id))
                continue
            et = self.xc.check(it, Ctx("in a parameter range", frozenset(), frozenset()))
            if et is UNKNOWN:
                return None
            if not fits(et, INT if isinstance(t, ListOf) else t):
                self.xc.error(it, f"the range of {name} must hold {type_word(t)}, not {et}")
                return None
            try:
                items.append(evaluate(it, {}))
            except EvalError as e:
                self.xc.error(it, f"a range must be constant ({e})")
                return None
        if dom.kind == "range":
            if not (isinstance(t, Scalar) and t.numeric):
                self.xc.error(dom, f"{name} is {t}; a [lo, hi] range needs a number",
                              "list the allowed values: in {a, b}")
                return None
            lo, hi = items
            if lo > hi:
                self.xc.error(dom, f"empty range [{lo}, {hi}]: the low end is above the high end")
                return None
        problem = outside((dom.kind, items), value)
        if problem:
            self.xc.error(p.default, f"default {_show(value)} of {name} {problem}")
        return dom.kind, items

    def override(self, info: ParamInfo, raw: object) -> object:
        """The checked override value, or the default (after reporting) if it does not fit."""
        name, t, at = info.name, info.type, info.decl.pos
        if not value_fits(raw, t):
            self.xc.sink.error(at, f"parameter {name} = {raw!r} is not {type_word(t)}")
            return info.default
        value = Member(raw) if isinstance(t, Enum) else (float(raw) if t == FLOAT else raw)
        if t == TOKENS and value < 0:
            self.xc.sink.error(at, f"parameter {name} = {raw!r} is negative; a number of tokens cannot be")
            return info.default
        problem = outside(info.domain, value)
        if problem:
            self.xc.sink.error(at, f"parameter {name} = {raw!r} {problem}")
            return info.default
        return value


def outside(domain: tuple[str, list] | None, value: object) -> str | None:
    """Why `value` is outside a parameter's range or set ("is outside its range [1, 63]"), or None."""
    if domain is None:
        return None
    kind, items = domain
    if kind == "range":
        lo, hi = items
        return None if lo <= value <= hi else f"is outside its range [{_show(lo)}, {_show(hi)}]"
    values = value if isinstance(value, list) else [value]
    bad = [v for v in values if v not in items]
    if not bad:
        return None
    shown = "{" + ", ".join(_show(i) for i in items) + "}"
    return f"is not one of the allowed values {shown}" if not isinstance(value, list) else \
        f"holds {_show(bad[0])}, not one of the allowed values {shown}"


def fits(t: Type, want: Type) -> bool:
    """Can an expression of type `t` give a value of parameter type `want`?"""
    if isinstance(want, Scalar) and isinstance(t, Scalar):
        if want == BOOL or t == BOOL:
            return want == t
        if want.kind == "int" and t.kind != "int":
            return False
        return t.literal or t.unit == want.unit
    if isinstance(want, ListOf):
        return isinstance(t, ListOf) and t.elem == want.elem
    return t == want


def value_fits(v: object, t: Type) -> bool:
    """Is the Python value `v` (an override) of parameter type `t`?"""
    if isinstance(t, Enum):
        return isinstance(v, str) and v in t.members
    if t == BOOL:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    if t in (INT, TOKENS):
        return isinstance(v, int)
    if t == FLOAT:
        return isinstance(v, (int, float))
    if isinstance(t, ListOf):
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
    return False


def type_word(t: Type) -> str:
    words = {INT: "a whole number", TOKENS: "a number of tokens", FLOAT: "a number", BOOL: "true or false"}
    if t in words:
        return words[t]
    return "a list of whole numbers" if isinstance(t, ListOf) else str(t)


def _show(v: object) -> str:
    return str(v) if not isinstance(v, float) or not v.is_integer() else str(int(v))
