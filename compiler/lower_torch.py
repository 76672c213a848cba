"""Torch emitter: IR values and hook bodies as lines of plain PyTorch (the CPU backend).

Pipeline position: used by `codegen` to fill the named points of `templates/torch_lowering.py.jinja`.
Every IR value becomes one Python statement over a torch tensor whose dimensions are the value's
named axes in order; the template's prelude holds the helpers (`_attention`, `_window`,
`_reduce`, `_group`, `_pool`, `_select`) so the emitted code stays one line per operation.
Scalar counts are sympy, printed with `sympy.pycode` over local names (parameters and symbols).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp

from kvc.compiler.ir import (Accumulate, Assign, Attention, Elementwise, HookIR, Input, Keep, MethodIR, Norm,
                             NotLowerable, Pool, Reduce, Scalar, Value, Window)

SYMBOLS = ("context", "prompt", "step", "layer", "layers", "heads", "kv_heads", "head_dim")
_UNARY = {"neg": "-({})", "abs": "torch.abs({})", "exp": "torch.exp({})", "log": "torch.log({})",
          "sqrt": "torch.sqrt({})"}
_BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})",
           "max": "torch.maximum({}, {})", "min": "torch.minimum({}, {})"}


def pyexpr(expr) -> str:
    return sp.pycode(sp.sympify(expr), fully_qualified_modules=True).replace("math.floor", "_floor").replace(
        "math.ceil", "_ceil")


def names_in(expr) -> set[str]:
    return {str(s) for s in sp.sympify(expr).free_symbols}


@dataclass
class HookCode:
    """The emitted body of one hook: lines, and which names they read."""

    name: str
    lines: list[str] = field(default_factory=list)
    names: set[str] = field(default_factory=set)
    inputs: set[str] = field(default_factory=set)
    keep: dict | None = None  # score variable, counts, granularity
    where: str | None = None


class _Emitter:
    def __init__(self, code: HookCode) -> None:
        self.code = code
        self.counter = 0
        self.memo: dict[int, str] = {}

    def scalar(self, expr) -> str:
        self.code.names |= names_in(expr)
        return pyexpr(expr)

    def emit(self, rhs: str) -> str:
        self.counter += 1
        var = f"t{self.counter}"
        self.code.lines.append(f"{var} = {rhs}")
        return var

    def value(self, v: Value) -> str:
        key = id(v)
        if key not in self.memo:
            self.memo[key] = self._value(v)
        return self.memo[key]

    def _value(self, v: Value) -> str:
        if isinstance(v, Input):
            if v.kind == "state":
                return f'state["{v.name}"]'
            self.code.inputs.add(v.name)
            return v.name
        if isinstance(v, Scalar):
            return self.scalar(v.expr)
        if isinstance(v, Window):
            src = self.value(v.src)
            return self.emit(f'_window({src}, {v.src.dims.index(v.axis)}, "{v.side}", {self.scalar(v.count)})')
        if isinstance(v, Attention):
            if "query" not in v.q.dims:
                raise NotLowerable("attention of decode queries is not lowered yet")
            return self.emit(f"_attention({self.value(v.q)}, {self.value(v.k)}, softmax={v.softmax})")
        if isinstance(v, Reduce):
            x, dims = self.value(v.src), list(v.src.dims)
            if "group" in v.axes:
                x = self.emit(f'_group({x}, "{v.fn}", {dims.index("head")}, kv_heads)')
                self.code.names.add("kv_heads")
                dims[dims.index("head")] = "kv_head"
            rest = tuple(dims.index(a) for a in v.axes if a != "group")
            return self.emit(f'_reduce({x}, "{v.fn}", {rest})') if rest else x
        if isinstance(v, Pool):
            if v.mode.startswith("param:"):
                mode = v.mode.split(":", 1)[1]
                self.code.names.add(mode)
            else:
                mode = f'"{v.mode}"'
            return self.emit(f"_pool({self.value(v.src)}, {mode}, {self.scalar(v.kernel)}, {v.src.dims.index(v.axis)})")
        if isinstance(v, Norm):
            return self.emit(f"torch.linalg.vector_norm({self.value(v.src)}.float(), dim={v.src.dims.index(v.axis)})")
        if isinstance(v, Elementwise):
            args = [self.value(a) for a in v.args]
            table = _UNARY if len(args) == 1 else _BINARY
            return self.emit(table[v.fn].format(*args))
        raise NotLowerable(f"cannot lower {type(v).__name__} to torch yet")


def emit_hook(hook: HookIR) -> HookCode:
    code = HookCode(hook.name)
    em = _Emitter(code)
    if hook.where is not None:
        code.where = em.scalar(hook.where)
    keeps = hook.keeps
    if len(keeps) > 1:
        raise NotLowerable(f"{hook.name}: more than one `keep` in a hook is not lowered yet")
    for stmt in hook.stmts:
        if isinstance(stmt, Assign):
            continue  # values are substituted where they are used (the IR is a tree)
        if isinstance(stmt, Accumulate):
            value = em.value(stmt.value)
            code.lines.append(f'state["{stmt.state}"] = _grow(state["{stmt.state}"], {value}) + {value}')
        if isinstance(stmt, Keep):
            code.names |= {"kv_heads", "context"}  # `_select` always needs them
            sel, top = stmt.select, stmt.select.top
            keep = {"first": "None" if sel.first is None else em.scalar(sel.first),
                    "last": "None" if sel.last is None else em.scalar(sel.last),
                    "count": "None", "at_least": "None", "granularity": "none", "score": "None"}
            if top is not None:
                score = em.value(top.score)
                per_head = "kv_head" in top.score.dims
                code.lines.append(f"scores = _full_scores({score}, {str(per_head)}, kv_heads, context)")
                code.names |= {"kv_heads", "context"}
                keep.update(score="scores", count=em.scalar(top.count), granularity=top.granularity,
                            at_least="None" if top.at_least is None else em.scalar(top.at_least))
            code.keep = keep
    return code


def emit(method: MethodIR) -> list[HookCode]:
    return [emit_hook(h) for h in method.hooks]


def unpack_lines(code: HookCode, params: list[str]) -> list[str]:
    """Local names a hook body reads: symbols from `sym`, parameters from `params`."""
    lines = []
    for name in sorted(code.names):
        if name in SYMBOLS:
            lines.append(f'{name} = sym["{name}"]')
        elif name in params:
            lines.append(f'{name} = params["{name}"]')
        else:
            raise NotLowerable(f"unknown name '{name}' in a count")
    return lines
