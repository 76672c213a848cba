"""Numeric evaluation of scalar .kvm expressions (defaults, budgets, axis sizes, `where` clauses).

Pipeline position: the checker evaluates parameter defaults and ranges, and every budget at a
few sample model shapes and context lengths to catch negative budgets; the compiler can evaluate
`where` clauses per layer and budgets per request with the same function. Symbolic reasoning
(sympy) lives in `kvc.dsl.symbolic`; this module is the fast exact path.
"""

from __future__ import annotations

import math
from typing import Mapping

from kvc.dsl import ast


class EvalError(Exception):
    """The expression has no single numeric value here (a tensor, an unknown name, 1/0 ...)."""


class Member(str):
    """An enum member written as a bare name (`avg`)."""


_FUNCS = {
    "floor": lambda x: math.floor(x),
    "ceil": lambda x: math.ceil(x),
    "round": lambda x: math.floor(x + 0.5),
    "abs": abs,
    "sqrt": math.sqrt,
    "log": math.log,
    "exp": math.exp,
}


def evaluate(expr: ast.Expr, env: Mapping[str, object], lets: Mapping[str, ast.Expr] | None = None,
             _depth: int = 0) -> object:
    """Value of `expr`; names come from `env`, then from `lets` (expanded), else they are `Member`s."""
    if _depth > 64:
        raise EvalError("definitions refer to each other in a cycle")
    lets = lets or {}

    def ev(e: ast.Expr) -> object:
        return evaluate(e, env, lets, _depth + 1)

    if isinstance(expr, ast.Number):
        return expr.value
    if isinstance(expr, ast.Bool):
        return expr.value
    if isinstance(expr, ast.String):
        return expr.value
    if isinstance(expr, ast.Name):
        if expr.id in env:
            return env[expr.id]
        if expr.id in lets:
            return ev(lets[expr.id])
        return Member(expr.id)
    if isinstance(expr, ast.ListExpr):
        return [ev(i) for i in expr.items]
    if isinstance(expr, ast.UnaryOp):
        v = ev(expr.operand)
        if expr.op == "not":
            return not _bool(v)
        return -_num(v)
    if isinstance(expr, ast.BinOp):
        a, b = _num(ev(expr.left)), _num(ev(expr.right))
        try:
            if expr.op == "+":
                return a + b
            if expr.op == "-":
                return a - b
            if expr.op == "*":
                return a * b
            if expr.op == "/":
                return a / b
            if expr.op == "//":
                return a // b
            if expr.op == "%":
                return a % b
        except ZeroDivisionError:
            raise EvalError("division by zero") from None
        raise EvalError(f"unknown operator {expr.op}")
    if isinstance(expr, ast.Compare):
        a, b = ev(expr.left), ev(expr.right)
        if expr.op in ("in", "not in"):
            if not isinstance(b, list):
                raise EvalError("'in' needs a list")
            return (a in b) == (expr.op == "in")
        ops = {"==": lambda: a == b, "!=": lambda: a != b, "<": lambda: _num(a) < _num(b),
               "<=": lambda: _num(a) <= _num(b), ">": lambda: _num(a) > _num(b), ">=": lambda: _num(a) >= _num(b)}
        return ops[expr.op]()
    if isinstance(expr, ast.BoolOp):
        vals = (_bool(ev(v)) for v in expr.values)
        return all(vals) if expr.op == "and" else any(vals)
    if isinstance(expr, ast.IfElse):
        return ev(expr.then) if _bool(ev(expr.cond)) else ev(expr.orelse)
    if isinstance(expr, ast.Call) and not expr.clauses and not expr.kwargs:
        name = expr.func.name
        args = [ev(a) for a in expr.args]
        if name in ("min", "max"):
            if len(args) == 1 and isinstance(args[0], list) and args[0]:
                return (min if name == "min" else max)(_num(x) for x in args[0])
            if len(args) == 2:
                return (min if name == "min" else max)(_num(args[0]), _num(args[1]))
        if name in _FUNCS and len(args) == 1:
            try:
                return _FUNCS[name](_num(args[0]))
            except (ValueError, OverflowError) as e:
                raise EvalError(str(e)) from None
    raise EvalError("not a constant expression")


def _num(v: object) -> int | float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise EvalError("not a number")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise EvalError("not a bool")
    return v


def sample_points(symbols: set[str]) -> list[dict[str, int]]:
    """Model shapes and lengths at which budgets are evaluated (Llama-3-8B-, Qwen3-, GLM-like)."""
    points = []
    for layers in (28, 48, 80):
        for layer in sorted({0, layers // 2, layers - 1}):
            for context in (4096, 32768, 131072):
                for step in (1, 128):
                    points.append(dict(layers=layers, layer=layer, context=context, prompt=context, step=step,
                                       heads=32, kv_heads=8, head_dim=128))
    if not symbols & {"layer", "context", "prompt", "step", "layers"}:
        return points[:1]
    return points
