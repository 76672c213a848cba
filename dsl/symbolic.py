"""Scalar .kvm expressions as sympy expressions (budgets, axis sizes, conditions).

Pipeline position: the compiler's shape and budget passes call `to_sympy` on the
checked AST, e.g. to get a request's KV footprint as a function of `context`. `let` names are
expanded; every other free name (parameters, `context`, `layer`, `layers`, ...) becomes a sympy
Symbol, so parameters can be substituted later or kept symbolic. `formula` prints an expression
as text and `read_formula` parses such text back (every identifier that is not one of the sympy
functions used here becomes a Symbol, so a parameter named `beta` or `gamma` stays a symbol).
sympy is imported only when these are called.

Mapping: `//` -> floor(a/b), `%` -> Mod, min/max -> Min/Max, `a if c else b` -> Piecewise,
comparisons -> relations, and/or/not -> And/Or/Not, round(x) -> floor(x + 1/2). A list parameter
stays a Symbol: `x in xs` -> member(x, xs), `min(xs)` / `max(xs)` -> list_min(xs) / list_max(xs),
functions sympy keeps unevaluated and Python code prints as `x in xs`, `min(xs)`, `max(xs)`.
"""

from __future__ import annotations

import re
from typing import Mapping

from kvc.dsl import ast


class NotSymbolic(ValueError):
    """The expression is not a scalar formula (a tensor, a selection, a string ...)."""


_LIST_FUNCTIONS: dict = {}


def list_functions() -> dict:
    """`member`, `list_min`, `list_max`: sympy functions over a list-valued symbol (made once, on first
    use, so importing this module does not import sympy)."""
    if not _LIST_FUNCTIONS:
        import sympy as sp
        from sympy.logic.boolalg import BooleanFunction

        class member(BooleanFunction):  # noqa: N801 -- the name sympy prints
            """`x in xs`, `xs` a list parameter."""

            @classmethod
            def eval(cls, x, xs):
                return None

            def _pythoncode(self, printer):
                return f"({printer._print(self.args[0])} in {printer._print(self.args[1])})"

        def reducer(name: str, python: str):
            def code(self, printer):
                return f"{python}({printer._print(self.args[0])})"

            return type(name, (sp.Function,), {"nargs": 1, "_pythoncode": code, "is_integer": True})

        _LIST_FUNCTIONS.update(member=member, list_min=reducer("list_min", "min"),
                               list_max=reducer("list_max", "max"))
    return _LIST_FUNCTIONS


def to_sympy(expr: ast.Expr, lets: Mapping[str, ast.Expr] | None = None, _depth: int = 0):
    import sympy as sp

    lets = lets or {}
    if _depth > 64:
        raise NotSymbolic("definitions refer to each other in a cycle")

    def go(e: ast.Expr):
        return to_sympy(e, lets, _depth + 1)

    if isinstance(expr, ast.Number):
        return sp.Integer(expr.value) if isinstance(expr.value, int) else sp.Rational(str(expr.value))
    if isinstance(expr, ast.Bool):
        return sp.true if expr.value else sp.false
    if isinstance(expr, ast.Name):
        if expr.id in lets:
            return go(lets[expr.id])
        return sp.Symbol(expr.id)
    if isinstance(expr, ast.UnaryOp):
        inner = go(expr.operand)
        return sp.Not(inner) if expr.op == "not" else -inner
    if isinstance(expr, ast.BinOp):
        a, b = go(expr.left), go(expr.right)
        return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
                "//": lambda: sp.floor(a / b), "%": lambda: sp.Mod(a, b)}[expr.op]()
    if isinstance(expr, ast.Compare):
        a = go(expr.left)
        if expr.op in ("in", "not in"):
            if isinstance(expr.right, ast.ListExpr):
                cond = sp.Or(*[sp.Eq(a, go(i)) for i in expr.right.items])
            elif isinstance(expr.right, ast.Name) and expr.right.id not in lets:  # a list parameter
                cond = list_functions()["member"](a, go(expr.right))
            else:
                raise NotSymbolic("'in' needs a literal list or a list parameter to be symbolic")
            return cond if expr.op == "in" else sp.Not(cond)
        b = go(expr.right)
        return {"==": sp.Eq, "!=": sp.Ne, "<": sp.Lt, "<=": sp.Le, ">": sp.Gt, ">=": sp.Ge}[expr.op](a, b)
    if isinstance(expr, ast.BoolOp):
        parts = [go(v) for v in expr.values]
        return sp.And(*parts) if expr.op == "and" else sp.Or(*parts)
    if isinstance(expr, ast.IfElse):
        return sp.Piecewise((go(expr.then), go(expr.cond)), (go(expr.orelse), True))
    if isinstance(expr, ast.Call) and not expr.kwargs and not expr.clauses:
        name, args = expr.func.name, [go(a) for a in expr.args]
        if name in ("min", "max") and len(args) == 2:
            return (sp.Min if name == "min" else sp.Max)(*args)
        if name in ("min", "max") and len(args) == 1 and isinstance(expr.args[0], ast.Name):  # of a list parameter
            return list_functions()[f"list_{name}"](args[0])
        if len(args) == 1:
            fn = {"floor": sp.floor, "ceil": sp.ceiling, "abs": sp.Abs, "sqrt": sp.sqrt, "log": sp.log,
                  "exp": sp.exp, "round": lambda x: sp.floor(x + sp.Rational(1, 2))}.get(name)
            if fn is not None:
                return fn(args[0])
    raise NotSymbolic(f"{type(expr).__name__} is not a scalar formula")


def formula(expr: ast.Expr, lets: Mapping[str, ast.Expr] | None = None) -> str:
    """sympy-readable text of a scalar expression, e.g. 'Min(context - window, ...)'."""
    import sympy as sp

    return sp.sstr(to_sympy(expr, lets))


_SYMPY_WORDS = {"Piecewise", "Min", "Max", "floor", "ceiling", "Mod", "Abs", "sqrt", "log", "exp", "And", "Or",
                "Not", "Eq", "Ne", "True", "False", "Rational", "oo", "member", "list_min", "list_max"}


def read_formula(text: str):
    """Parse `formula` output back into a sympy expression."""
    import sympy as sp

    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text)) - _SYMPY_WORDS
    return sp.sympify(text, locals={**{n: sp.Symbol(n) for n in names}, **list_functions()})
