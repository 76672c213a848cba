"""Typing of .kvm expressions: names, units, axes (symbolic shapes) and the built-in functions.

Pipeline position: called by `kvc.dsl.checker` (declarations) and `kvc.dsl.check_hooks` (hook
bodies) with a `Ctx` that says which names the place may read. Every expression gets its type in
`expr.ty`; errors go to the file's sink and the failing expression gets `UNKNOWN`, which silences
errors that would only repeat it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace

from kvc.dsl import ast, formatter
from kvc.dsl.builtins import AXES, GROUP, HOOK_VALUES, SYMBOLS, HookSpec
from kvc.dsl.errors import DiagnosticSink, Pos
from kvc.dsl.types import (BOOL, INT, STRING, TOKENS, UNKNOWN, Enum, ListOf, Scalar, Selection, Tensor, Type, arith,
                           join_units, unit_name)

KIND_WORDS = {"param": "parameter", "let": "definition", "state": "state", "shared": "shared state",
              "input": "input", "summary": "summary", "role": "role", "dim": "axis"}


@dataclass
class Binding:
    """A top-level name: what declared it and its type (as seen from a per-layer hook)."""

    kind: str
    name: str
    pos: Pos
    type: Type
    decl: ast.Decl | None = None
    deps: frozenset[str] = frozenset()  # lets: the context symbols they use


@dataclass
class AxisInfo:
    name: str
    kind: str  # 'builtin' | 'partition' | 'sized'
    per: tuple[str, ...] = ()  # partitions: axes the partition differs along (kmeans: kv_head)
    order: float = 0.0
    decl: ast.DimDecl | None = None


@dataclass
class Ctx:
    """Where an expression is: which kinds of names and which symbols it may use."""

    where: str  # for messages: "in prefill_end", "in a parameter default", ...
    kinds: frozenset[str]
    symbols: frozenset[str]
    hook: HookSpec | None = None
    locals: dict[str, tuple[Type, Pos]] = field(default_factory=dict)
    windowed: bool = False  # typing the value of `x[first/last n]`
    counts: list | None = None  # where budget expressions are collected
    calls: frozenset[str] = frozenset({"value", "scalar"})  # kinds of built-ins allowed here


def axis_order(axes: dict[str, AxisInfo], name: str) -> float:
    info = axes.get(name)
    return info.order if info else 99.0


class ExprChecker:
    def __init__(self, sink: DiagnosticSink, bindings: dict[str, Binding], axes: dict[str, AxisInfo],
                 poisoned: set[str]) -> None:
        self.sink, self.bindings, self.axes, self.poisoned = sink, bindings, axes, poisoned
        # (kind, expr, ctx, message) checked later against parameter values: 'odd', 'bits', 'unit', 'positive'
        self.numeric_checks: list[tuple[str, ast.Expr, Ctx, str]] = []
        self.declared: dict[str, Pos] = {}  # every top-level name of the file, for "declared later"

    # ---- helpers ---------------------------------------------------------------------------

    def error(self, node: ast.Node, message: str, hint: str | None = None) -> Type:
        self.sink.error(node.pos, message, hint)
        return UNKNOWN

    def sort_dims(self, dims) -> tuple[str, ...]:
        return tuple(sorted(set(dims), key=lambda d: axis_order(self.axes, d)))

    def suggest(self, name: str, candidates) -> str | None:
        close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.7)
        return f"did you mean '{close[0]}'?" if close else None

    def visible_names(self, ctx: Ctx) -> list[str]:
        names = list(ctx.locals) + [n for n, b in self.bindings.items() if b.kind in ctx.kinds]
        names += [s for s in ctx.symbols]
        if ctx.hook:
            names += list(HOOK_VALUES)
        return names

    def axis(self, ident: ast.Ident, allow_group: bool = False) -> AxisInfo | None:
        if ident.name == GROUP and allow_group:
            return AxisInfo(GROUP, "builtin")
        info = self.axes.get(ident.name)
        if info is None:
            if ident.name not in self.poisoned:
                names = list(self.axes) + ([GROUP] if allow_group else [])
                self.sink.error(ident.pos, f"unknown axis '{ident.name}'",
                                self.suggest(ident.name, names) or f"axes are: {', '.join(names)}")
            return None
        return info

    # ---- entry -----------------------------------------------------------------------------

    def check(self, e: ast.Expr, ctx: Ctx) -> Type:
        method = getattr(self, "_" + type(e).__name__, None)
        t = method(e, ctx) if method else self.error(e, f"{type(e).__name__} cannot appear here")
        e.ty = t
        return t

    def count(self, e: ast.Expr, ctx: Ctx, what: str) -> Type:
        """A number of tokens (a budget): must be in tokens; collected for the budget check."""
        t = self.check(e, ctx)
        if t is UNKNOWN:
            return t
        if not (isinstance(t, Scalar) and t.numeric):
            return self.error(e, f"{what} must be a number of tokens, not {t}")
        if t.unit != "tokens" and not t.literal:
            return self.error(e, f"{what} must be in tokens, not {unit_name(t)}",
                              "declare the parameters it uses as `tokens`, or scale a token count by a number")
        if ctx.counts is not None:
            ctx.counts.append((e, ctx, what))
        return TOKENS

    # ---- leaves ----------------------------------------------------------------------------

    def _Number(self, e: ast.Number, ctx: Ctx) -> Type:
        return Scalar("int" if isinstance(e.value, int) else "float", None, literal=True)

    def _String(self, e, ctx) -> Type:
        return STRING

    def _Bool(self, e, ctx) -> Type:
        return BOOL

    def _ListExpr(self, e: ast.ListExpr, ctx: Ctx) -> Type:
        types = [self.check(i, ctx) for i in e.items]
        if UNKNOWN in types:
            return UNKNOWN
        if all(t == STRING for t in types) and types:
            return ListOf(STRING)
        if all(isinstance(t, Scalar) and t.kind == "int" for t in types):
            return ListOf(INT)
        return self.error(e, "a list holds whole numbers or strings")

    def _Name(self, e: ast.Name, ctx: Ctx) -> Type:
        n = e.id
        if n in ctx.locals:
            return ctx.locals[n][0]
        if n in HOOK_VALUES:
            return self.hook_value(e, ctx)
        b = self.bindings.get(n)
        if b is not None:
            if b.kind == "dim":
                return self.error(e, f"'{n}' is an axis, not a value",
                                  "axes are named after over/along/within/per/across")
            if b.kind not in ctx.kinds:
                return self.error(e, f"the {KIND_WORDS[b.kind]} '{n}' cannot be used {ctx.where}")
            if b.kind == "let":
                missing = sorted(b.deps - ctx.symbols)
                if missing:
                    return self.error(e, f"'{n}' uses {', '.join(missing)}, "
                                         f"which {'is' if len(missing) == 1 else 'are'} not available {ctx.where}")
            return self.view(b, ctx)
        if n in SYMBOLS:
            if n not in ctx.symbols:
                return self.error(e, f"'{n}' is not available {ctx.where}", _symbol_hint(n))
            return TOKENS if SYMBOLS[n].unit == "tokens" else INT
        if n in AXES or n == GROUP:
            return self.error(e, f"'{n}' is an axis, not a value", "axes are named after over/along/within/per/across")
        if n in self.poisoned:
            return UNKNOWN
        later = self.declared.get(n)
        if later is not None and later.line >= e.pos.line:
            return self.error(e, f"'{n}' is declared later (line {later.line}); declare it before it is used")
        return self.error(e, f"unknown name '{n}'", self.suggest(n, self.visible_names(ctx)))

    def view(self, b: Binding, ctx: Ctx) -> Type:
        """A per-layer value seen from a per-request hook gains the `layer` axis."""
        t = b.type
        if ctx.hook is not None and ctx.hook.scope == "request" and b.kind in ("state", "summary"):
            if isinstance(t, Tensor):
                return Tensor(self.sort_dims(("layer",) + t.dims), t.dtype)
            if isinstance(t, Selection):
                return replace(t, per=self.sort_dims(("layer",) + t.per))
        return t

    def hook_value(self, e: ast.Name, ctx: Ctx) -> Type:
        n, h = e.id, ctx.hook
        if h is None:
            return self.error(e, f"'{n}' only exists inside hooks ({HOOK_VALUES[n].split(':')[0]})")
        if n == "q":
            if h.q is None:
                return self.error(e, f"q is not available in {h.name}",
                                  "queries exist in prefill, replay and decode hooks")
            if h.q == "window" and not ctx.windowed:
                return self.error(e, f"{h.name} keeps only a window of queries: write q[last N]",
                                  "N must be a parameter expression; the engine keeps that many recent queries")
            if h.q == "decode" and not ctx.windowed:
                return Tensor(("head", "channel"))
            return Tensor(("head", "query", "channel"))
        if n in ("k", "v"):
            if not h.kv:
                return self.error(e, f"{n} is not available in {h.name}")
            return Tensor(("kv_head", "key", "channel"))
        if h.attn is None:
            hint = {"decode_before_attention": "attention has not run yet: read attn in decode_after_attention",
                    "prefill_end": "compute it from a window of queries: attention(q[last N], k)",
                    "step_end": "compute it from a window of queries: attention(q[last N], k)"}.get(h.name)
            return self.error(e, f"attn is not available in {h.name}", hint)
        return Tensor(("head", "query", "key")) if h.attn == "chunk" else Tensor(("head", "key"))

    # ---- operators -------------------------------------------------------------------------

    def broadcast(self, node: ast.Node, a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...] | None:
        la, lb = list(a), list(b)
        if "head" in la and "kv_head" in lb:
            lb = ["head" if d == "kv_head" else d for d in lb]
        if "head" in lb and "kv_head" in la:
            la = ["head" if d == "kv_head" else d for d in la]
        dims = set(la) | set(lb)
        parts = [d for d in dims if self.axes.get(d) and self.axes[d].kind == "partition"]
        if "key" in dims and parts:
            self.error(node, f"cannot combine a per-token value with a per-{parts[0]} value",
                       f"reduce the per-token one first, e.g. mean(x, within {parts[0]})")
            return None
        if len(parts) > 1:
            self.error(node, f"cannot combine values over different partitions ({', '.join(sorted(parts))})")
            return None
        return self.sort_dims(dims)

    def combine(self, node: ast.Node, a: Type, b: Type, dtype: str = "float") -> Tensor | None:
        """The type of an elementwise `a op b` of numbers and tensors: axes match by name (`kv_head`
        reads as `head` against `head`: each query head uses its KV head), and both operands must
        hold the same entries of every axis they share, or the lowering could only pair them by
        position."""
        ta = a if isinstance(a, Tensor) else Tensor(())
        tb = b if isinstance(b, Tensor) else Tensor(())
        dims = self.broadcast(node, ta.dims, tb.dims)
        if dims is None:
            return None
        ranges: dict[str, tuple[str, ...]] = {}
        for axis in dims:
            names = (axis, "kv_head") if axis == "head" else (axis,)
            held = [(t, n, t.range_of(n)) for t in (ta, tb) for n in names if n in t.dims]
            if len(held) == 2 and held[0][1] != held[1][1] and (held[0][2] or held[1][2]):
                self.error(node, f"cannot combine {ta} with {tb}: query head h reads KV head h // (heads / "
                                 "kv_heads), so neither side can hold a range of its heads",
                           "combine them first, then take the range")
                return None
            if len(held) == 2 and held[0][2] != held[1][2]:
                chain = max(held[0][2], held[1][2], key=len)
                example = "x" + "".join(f"[{r} along {axis}]" for r in chain)
                self.error(node, f"cannot combine {ta} with {tb}: they hold different entries of the {axis} axis",
                           f"take the same range of both sides, e.g. {example}")
                return None
            if held and held[0][2]:
                ranges[axis] = held[0][2]
        return Tensor(dims, dtype, tuple((d, ranges[d]) for d in dims if d in ranges))

    def _BinOp(self, e: ast.BinOp, ctx: Ctx) -> Type:
        lt, rt = self.check(e.left, ctx), self.check(e.right, ctx)
        if UNKNOWN in (lt, rt):
            return UNKNOWN
        if isinstance(lt, Selection) or isinstance(rt, Selection):
            if e.op == "+" and isinstance(lt, Selection) and isinstance(rt, Selection):
                return self.union(e, lt, rt)
            if e.op in ("*", "/", "//") and isinstance(lt, Selection) and isinstance(e.left, ast.Range):
                return self.error(e, f"'{e.op}' applies to `{e.left.kind} ...` as a whole",
                                  f"write {e.left.kind} (...) around the count")
            return self.error(e, f"'{e.op}' cannot apply to a selection", "selections combine with '+' (union)")
        if isinstance(lt, Tensor) or isinstance(rt, Tensor):
            for t, side in ((lt, e.left), (rt, e.right)):
                if isinstance(t, Tensor) and t.dtype == "bool":
                    return self.error(side, f"arithmetic on a mask ({t})")
                if not isinstance(t, Tensor) and not (isinstance(t, Scalar) and t.numeric):
                    return self.error(side, f"'{e.op}' needs numbers or tensors, not {t}")
            t = self.combine(e, lt, rt)
            return UNKNOWN if t is None else t
        if isinstance(lt, Scalar) and isinstance(rt, Scalar):
            t, err = arith(e.op, lt, rt)
            if err:
                hint = None
                if "combine" in err:
                    hint = "budgets are in tokens: declare the parameter as `tokens`"
                return self.error(e, err, hint)
            return t
        return self.error(e, f"'{e.op}' cannot apply to {lt} and {rt}")

    def union(self, e: ast.Node, a: Selection, b: Selection) -> Type:
        if a.ranges and b.ranges:
            return Selection("key", ranges=True)
        if a.ranges:
            return b
        if b.ranges:
            return a
        if a.item != b.item:
            return self.error(e, f"cannot unite a selection of {a.item}s with one of {b.item}s")
        if a.across != b.across:
            return self.error(e, "cannot unite selections pooled across different axes")
        return Selection(a.item, self.sort_dims(a.per + b.per), a.across)

    def _UnaryOp(self, e: ast.UnaryOp, ctx: Ctx) -> Type:
        t = self.check(e.operand, ctx)
        if t is UNKNOWN:
            return t
        if e.op == "not":
            if t == BOOL or (isinstance(t, Tensor) and t.dtype == "bool"):
                return t if isinstance(t, Tensor) else BOOL
            return self.error(e, f"'not' needs a bool, not {t}")
        if isinstance(t, Tensor) and t.dtype == "float":
            return t
        if isinstance(t, Scalar) and t.numeric:
            return t
        return self.error(e, f"cannot negate {t}")

    def _Compare(self, e: ast.Compare, ctx: Ctx) -> Type:
        lt, rt = self.check(e.left, ctx), self.check(e.right, ctx)
        if UNKNOWN in (lt, rt):
            return UNKNOWN
        if e.op in ("in", "not in"):
            if isinstance(rt, ListOf) and isinstance(lt, Scalar) and lt.kind == "int":
                return BOOL
            return self.error(e, f"'{e.op}' needs a whole number and a list, not {lt} and {rt}")
        if isinstance(lt, Tensor) or isinstance(rt, Tensor):
            t = self.combine(e, lt, rt, "bool")
            return UNKNOWN if t is None else t
        if isinstance(lt, Scalar) and isinstance(rt, Scalar):
            if lt.numeric and rt.numeric:
                _, err = join_units(lt, rt)
                if err:
                    return self.error(e, err.replace("combine", "compare"))
                return BOOL
            if lt == rt == BOOL and e.op in ("==", "!="):
                return BOOL
        if isinstance(lt, Enum) and isinstance(e.right, ast.Name) and e.right.id in lt.members:
            return BOOL
        return self.error(e, f"cannot compare {lt} with {rt}")

    def _BoolOp(self, e: ast.BoolOp, ctx: Ctx) -> Type:
        types = [self.check(v, ctx) for v in e.values]
        if UNKNOWN in types:
            return UNKNOWN
        if all(t == BOOL for t in types):
            return BOOL
        for t, v in zip(types, e.values):
            if t != BOOL:
                return self.error(v, f"'{e.op}' needs bools, not {t}")
        return UNKNOWN

    def _IfElse(self, e: ast.IfElse, ctx: Ctx) -> Type:
        ct = self.check(e.cond, ctx)
        a, b = self.check(e.then, ctx), self.check(e.orelse, ctx)
        if ct is not UNKNOWN and ct != BOOL:
            self.error(e.cond, f"the condition must be a bool, not {ct}")
        if UNKNOWN in (a, b):
            return UNKNOWN
        if isinstance(a, Scalar) and isinstance(b, Scalar) and a.numeric and b.numeric:
            unit, err = join_units(a, b)
            if err:
                return self.error(e, f"the two branches differ: {err}")
            kind = "float" if "float" in (a.kind, b.kind) else "int"
            return Scalar(kind, unit, a.literal and b.literal)
        if a == b:
            return a
        return self.error(e, f"the two branches have different types: {a} and {b}")

    def _Range(self, e: ast.Range, ctx: Ctx) -> Type:
        self.count(e.count, ctx, f"`{e.kind}` count")
        return Selection("key", ranges=True)

    def _Subscript(self, e: ast.Subscript, ctx: Ctx) -> Type:
        if isinstance(e.index, ast.Range):
            vt = self.check(e.value, replace(ctx, windowed=True))
            self.count(e.index.count, ctx, f"`{e.index.kind}` count")
            e.index.ty = Selection("key", ranges=True)
            if vt is UNKNOWN:
                return vt
            if not isinstance(vt, Tensor):
                return self.error(e, f"only tensors can be sliced, not {vt}")
            if isinstance(e.value, ast.Name) and e.value.id == "q":
                bad = self._dynamic_names(e.index.count)
                if bad:
                    return self.error(e.index, f"q[{e.index.kind} N]: N cannot depend on {bad}",
                                      "the engine keeps a fixed window of recent queries per layer")
            if e.along is not None:
                if e.along.name not in vt.dims:
                    return self.error(e.along, f"{vt} has no {e.along.name} axis")
                axis = e.along.name
            else:
                seq = [d for d in vt.dims if d in ("query", "key")]
                if len(seq) != 1:
                    return self.error(e, f"{vt} has {'no' if not seq else 'two'} sequence axes to slice",
                                      "say which: x[last n along query]" if seq else None)
                axis = seq[0]
            ranges = dict(vt.ranges)
            ranges[axis] = ranges.get(axis, ()) + (formatter.expr(e.index),)
            return vt.reshaped(vt.dims, ranges=ranges)
        vt, it = self.check(e.value, ctx), self.check(e.index, ctx)
        if UNKNOWN in (vt, it):
            return UNKNOWN
        if not (isinstance(it, Scalar) and it.kind == "int"):
            return self.error(e.index, f"an index must be a whole number (a layer), not {it}")
        if isinstance(vt, Tensor) and "layer" in vt.dims:
            if vt.range_of("layer"):
                return self.error(e, f"{vt} holds a range of layers: it has no entry for every layer to index")
            return vt.reshaped(d for d in vt.dims if d != "layer")
        if isinstance(vt, Selection) and "layer" in vt.per:
            return replace(vt, per=tuple(d for d in vt.per if d != "layer"))
        return self.error(e, f"{vt} has no layer axis to index")

    def _dynamic_names(self, e: ast.Expr) -> str | None:
        for node in ast.walk(e):
            if isinstance(node, ast.Name):
                if node.id in ("context", "prompt", "step"):
                    return node.id
                b = self.bindings.get(node.id)
                if b is not None and b.kind == "let" and b.deps & {"context", "prompt", "step"}:
                    return node.id
        return None

    def _Call(self, e: ast.Call, ctx: Ctx) -> Type:
        from kvc.dsl.check_calls import check_call

        return check_call(self, e, ctx)


def _symbol_hint(name: str) -> str | None:
    return {"layer": "replay_end runs once for all layers; per-layer values there have a layer axis",
            "step": "step exists in decode_before_attention, decode_after_attention and step_end",
            "context": "axis sizes and shapes may use only parameters and layers, heads, kv_heads, head_dim",
            "prompt": "axis sizes and shapes may use only parameters and layers, heads, kv_heads, head_dim",
            }.get(name)


__all__ = ["AxisInfo", "Binding", "Ctx", "ExprChecker", "KIND_WORDS"]
