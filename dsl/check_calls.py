"""Typing of calls to the built-in functions: arguments, axis clauses and result axes.

Pipeline position: `ExprChecker._Call` dispatches here. One handler per built-in (the table of
built-ins and their docs is `kvc.dsl.builtins.BUILTINS`). Checks that need parameter values (an
odd pooling kernel, a bit width in 1..8) are queued in `numeric_checks` and run by the checker
once defaults are known.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvc.dsl import ast
from kvc.dsl.builtins import BUILTINS, ENUMS
from kvc.dsl.check_exprs import Ctx, ExprChecker
from kvc.dsl.types import (BOOL, FLOAT, STRING, UNKNOWN, Codec, Enum, ListOf, PartitionOf, Scalar, Selection,
                           Tensor, Type, join_units)

STORED = ("kv_head", "key", "channel")  # axes of the K or V tensor a storage format encodes


@dataclass
class Bound:
    args: list[ast.Expr]
    kw: dict[str, ast.Expr]
    clauses: dict[str, ast.Clause]


def check_call(xc: ExprChecker, e: ast.Call, ctx: Ctx) -> Type:
    name = e.func.name
    spec = BUILTINS.get(name)
    if spec is None:
        if name in xc.bindings or name in ctx.locals:
            return xc.error(e.func, f"'{name}' is not a function")
        return xc.error(e.func, f"unknown function '{name}'", xc.suggest(name, BUILTINS))
    if spec.kind not in ctx.calls:
        where = {"partition": f"{name}(...) declares an axis: write `dim NAME = {name}(...)`",
                 "codec": f"{name}(...) is a storage format: write `store k as {name}(...)`",
                 "select": f"{name}(...) chooses tokens: use it in a hook (keep/read/estimate)",
                 "reference": f"{name}(...) is a residual's reference: residual({name}(...)) then ..."}[spec.kind] \
            if spec.kind != "value" and spec.kind != "scalar" else None
        return xc.error(e.func, f"{name}(...) cannot be used {ctx.where}", where)
    return _HANDLERS[name](xc, e, ctx)


# ---- argument helpers ----------------------------------------------------------------------


def bind(xc: ExprChecker, e: ast.Call, npos: tuple[int, int], kwargs=(), clauses=()) -> Bound | None:
    name, usage = e.func.name, f"usage: {BUILTINS[e.func.name].signature}"
    ok = True
    lo, hi = npos
    if len(e.args) > hi:
        xc.error(e.args[hi], f"too many arguments to {name}", usage)
        ok = False
    elif len(e.args) < lo:
        xc.error(e, f"{name} needs {lo} argument{'s' if lo > 1 else ''}", usage)
        ok = False
    kw: dict[str, ast.Expr] = {}
    for k in e.kwargs:
        if k.name.name not in kwargs:
            xc.error(k.name, f"{name} has no argument '{k.name.name}'", xc.suggest(k.name.name, kwargs) or usage)
            ok = False
        elif k.name.name in kw:
            xc.error(k.name, f"argument '{k.name.name}' given twice")
            ok = False
        else:
            kw[k.name.name] = k.value
    cl: dict[str, ast.Clause] = {}
    for c in e.clauses:
        if c.kind not in clauses:
            xc.error(c, f"{name} does not take `{c.kind}`", usage)
            ok = False
        elif c.kind in cl:
            xc.error(c, f"`{c.kind}` given twice; list the axes after one `{c.kind}`")
            ok = False
        else:
            cl[c.kind] = c
    return Bound(list(e.args), kw, cl) if ok else None


def tensor(xc: ExprChecker, arg: ast.Expr, ctx: Ctx, what: str) -> Tensor | None:
    t = xc.check(arg, ctx)
    if t is UNKNOWN:
        return None
    if not isinstance(t, Tensor) or t.dtype != "float":
        xc.error(arg, f"{what} must be a tensor, not {t}")
        return None
    return t


def number(xc: ExprChecker, arg: ast.Expr, ctx: Ctx, what: str, whole: bool = False) -> Scalar | None:
    t = xc.check(arg, ctx)
    if t is UNKNOWN:
        return None
    if not (isinstance(t, Scalar) and t.numeric) or (whole and t.kind != "int"):
        xc.error(arg, f"{what} must be a {'whole number' if whole else 'number'}, not {t}")
        return None
    return t


def enum(xc: ExprChecker, arg: ast.Expr, ctx: Ctx, key: str, what: str) -> bool:
    members = ENUMS[key]
    if isinstance(arg, ast.Name) and arg.id not in ctx.locals and arg.id not in xc.bindings:
        if arg.id in members:
            arg.ty = Enum(members)
            return True
        arg.ty = UNKNOWN
        xc.error(arg, f"'{arg.id}' is not a {what}; expected {' or '.join(members)}")
        return False
    t = xc.check(arg, ctx)
    if t is UNKNOWN:
        return False
    if isinstance(t, Enum):
        extra = [m for m in t.members if m not in members]
        if extra:
            xc.error(arg, f"{what} must be {' or '.join(members)}; the parameter also allows {', '.join(extra)}")
            return False
        return True
    shown = f"'{arg.id}'" if isinstance(arg, ast.Name) else str(t)
    xc.error(arg, f"{shown} is not a {what}; expected {' or '.join(members)}")
    return False


def axes_of(xc: ExprChecker, clause: ast.Clause, t: Tensor | None, allow_group: bool = False) -> list[str] | None:
    out = []
    for ident in clause.dims:
        info = xc.axis(ident, allow_group)
        if info is None:
            return None
        if t is not None and ident.name != "group" and ident.name not in t.dims:
            xc.error(ident, f"{t} has no {ident.name} axis")
            return None
        out.append(ident.name)
    return out


def reduce(xc: ExprChecker, node: ast.Node, t: Tensor, dims: list[str]) -> Type:
    cur = list(t.dims)
    for d in dims:
        if d == "group":
            if "head" not in cur:
                return xc.error(node, f"nothing to reduce over group: {t.reshaped(cur)} has no head axis",
                                "values over kv_head are already one per KV head" if "kv_head" in cur else None)
            if t.range_of("head"):
                return xc.error(node, f"cannot fold {t} over group: it holds a range of the query heads, and "
                                      "each KV head needs all of its group")
            cur = ["kv_head" if x == "head" else x for x in cur]
        elif d in cur:
            cur.remove(d)
        else:
            return xc.error(node, f"{t.reshaped(cur)} has no {d} axis to reduce")
    return t.reshaped(xc.sort_dims(cur))


# ---- value functions -----------------------------------------------------------------------


def _attention(xc, e, ctx):
    b = bind(xc, e, (2, 2))
    if b is None:
        return UNKNOWN
    qt = tensor(xc, b.args[0], ctx, f"the queries of {e.func.name}")
    kt = tensor(xc, b.args[1], ctx, f"the keys of {e.func.name}")
    if qt is None or kt is None:
        return UNKNOWN
    if "channel" not in qt.dims or not {"head", "kv_head"} & set(qt.dims) or "key" in qt.dims:
        return xc.error(b.args[0], f"the first argument of {e.func.name} must be queries "
                                   f"[head, (query,) channel], got {qt}")
    items = [d for d in kt.dims if d == "key" or _is_partition(xc, d)]
    if "channel" not in kt.dims or len(items) != 1:
        return xc.error(b.args[1], f"the second argument of {e.func.name} must be keys "
                                   f"[kv_head, key, channel], got {kt}")
    heads = ("head", "kv_head")
    extra = [d for d in qt.dims if d not in heads + ("query", "channel")]
    extra += [d for d in kt.dims if d not in heads + ("channel",) + tuple(items)]
    if extra:
        return xc.error(e, f"{e.func.name} scores queries [head, query, channel] against keys [kv_head, key, channel]; "
                           f"reduce the {extra[0]} axis first")
    if qt.range_of("channel") != kt.range_of("channel"):
        return xc.error(e, f"the queries {qt} and keys {kt} of {e.func.name} hold different channels",
                        "take the same range of both, or none")
    if kt.range_of(items[0]):
        return xc.error(b.args[1], f"{e.func.name} needs every key, got {kt}: the causal mask places queries by "
                                   "the keys' positions",
                        f"take the range of the result: {e.func.name}(q, k)[... along key]")
    if any(not r.startswith("last ") for r in qt.range_of("query")):
        return xc.error(b.args[0], f"{e.func.name} reads the newest queries, got {qt}: the causal mask places them at "
                                   "the end of the keys", "write q[last n]")
    t = xc.combine(e, qt.reshaped(d for d in qt.dims if d != "channel"),
                   kt.reshaped(d for d in kt.dims if d != "channel"))
    return UNKNOWN if t is None else t


def _is_partition(xc: ExprChecker, d: str) -> bool:
    info = xc.axes.get(d)
    return bool(info and info.kind == "partition")


def _softmax(xc, e, ctx):
    b = bind(xc, e, (1, 1), clauses=("over",))
    if b is None:
        return UNKNOWN
    if "over" not in b.clauses:
        return xc.error(e, "softmax needs one axis: softmax(x, over key)")
    t = tensor(xc, b.args[0], ctx, "the argument of softmax")
    if t is None:
        return UNKNOWN
    dims = axes_of(xc, b.clauses["over"], t)
    if dims is None:
        return UNKNOWN
    if len(dims) != 1:
        return xc.error(b.clauses["over"], "softmax normalises along exactly one axis")
    return t


def _reduction(xc, e, ctx):
    name = e.func.name
    b = bind(xc, e, (1, 2), clauses=("over", "within"))
    if b is None:
        return UNKNOWN
    if "over" in b.clauses and "within" in b.clauses:
        return xc.error(e, f"{name} takes `over` or `within`, not both")
    if not b.clauses:
        if name in ("max", "min"):
            return _elementwise_extreme(xc, e, b, ctx)
        if len(b.args) == 1 and isinstance(xc.check(b.args[0], ctx), ListOf):
            return Scalar("int")
        return xc.error(e, f"{name} needs the axes to reduce: {name}(x, over AXES) or {name}(x, within PARTITION)")
    if len(b.args) != 1:
        return xc.error(b.args[1], f"{name} over axes takes one value")
    t = tensor(xc, b.args[0], ctx, f"the argument of {name}")
    if t is None:
        return UNKNOWN
    if "over" in b.clauses:
        dims = axes_of(xc, b.clauses["over"], t, allow_group=True)
        return UNKNOWN if dims is None else reduce(xc, e, t, dims)
    return within(xc, b.clauses["within"], t)


def within(xc: ExprChecker, clause: ast.Clause, t: Tensor) -> Type:
    if len(clause.dims) != 1:
        return xc.error(clause, "`within` names one partition")
    info = xc.axis(clause.dims[0])
    if info is None:
        return UNKNOWN
    if info.kind != "partition":
        return xc.error(clause.dims[0], f"'{info.name}' is not a partition of the key axis",
                        "declare one with `dim pages = split(key, size = 16)` or `dim clusters = kmeans(k, size = 16)`")
    if "key" not in t.dims:
        return xc.error(clause, f"{t} has no key axis to group into {info.name}")
    if t.range_of("key"):
        return xc.error(clause, f"{t} holds a range of the keys; {info.name} cover them all")
    if info.per and not ({"kv_head", "head"} & set(t.dims)):
        return xc.error(clause, f"{info.name} differ per KV head, but {t} has no head axis")
    return t.reshaped(xc.sort_dims([info.name if d == "key" else d for d in t.dims]))


def _elementwise_extreme(xc, e, b: Bound, ctx):
    name = e.func.name
    if len(b.args) == 1:
        t = xc.check(b.args[0], ctx)
        if t is UNKNOWN:
            return t
        if isinstance(t, ListOf) and t.elem == Scalar("int"):
            return Scalar("int")
        if isinstance(t, Tensor):
            return xc.error(e, f"{name} of a tensor needs the axes to reduce: {name}(x, over AXES)")
        return xc.error(b.args[0], f"{name} of one value needs a list, not {t}")
    a, c = xc.check(b.args[0], ctx), xc.check(b.args[1], ctx)
    if UNKNOWN in (a, c):
        return UNKNOWN
    if isinstance(a, Scalar) and isinstance(c, Scalar) and a.numeric and c.numeric:
        unit, err = join_units(a, c)
        if err:
            return xc.error(e, f"{name}: {err}")
        return Scalar("float" if "float" in (a.kind, c.kind) else "int", unit, a.literal and c.literal)
    for t, arg in ((a, b.args[0]), (c, b.args[1])):
        if not (isinstance(t, Tensor) and t.dtype == "float") and not (isinstance(t, Scalar) and t.numeric):
            return xc.error(arg, f"{name} needs numbers or tensors, not {t}")
    t = xc.combine(e, a, c)
    return UNKNOWN if t is None else t


def _quantile(xc, e, ctx):
    b = bind(xc, e, (2, 2), clauses=("over",))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the argument of quantile")
    if number(xc, b.args[1], ctx, "the quantile") is not None:
        xc.numeric_checks.append(("unit", b.args[1], ctx, "the quantile"))
    if t is None:
        return UNKNOWN
    if "over" not in b.clauses:
        return xc.error(e, "quantile needs the axes: quantile(x, p, over AXES)")
    dims = axes_of(xc, b.clauses["over"], t)
    return UNKNOWN if dims is None else reduce(xc, e, t, dims)


def _norm(xc, e, ctx):
    b = bind(xc, e, (1, 1), clauses=("over",))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the argument of norm")
    if t is None:
        return UNKNOWN
    if "over" not in b.clauses:
        return xc.error(e, "norm needs the axis: norm(x, over channel)")
    dims = axes_of(xc, b.clauses["over"], t)
    return UNKNOWN if dims is None else reduce(xc, e, t, dims)


def _along_one(xc, e, b: Bound, t: Tensor | None) -> str | None:
    if "along" not in b.clauses:
        xc.error(e, f"{e.func.name} needs the axis: {BUILTINS[e.func.name].signature}")
        return None
    dims = axes_of(xc, b.clauses["along"], t)
    if dims is None:
        return None
    if len(dims) != 1:
        xc.error(b.clauses["along"], f"{e.func.name} works along exactly one axis")
        return None
    return dims[0]


def _pool(xc, e, ctx):
    b = bind(xc, e, (3, 3), clauses=("along",))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the argument of pool")
    enum(xc, b.args[1], ctx, "pool.mode", "pooling mode")
    if number(xc, b.args[2], ctx, "the pooling kernel", whole=True) is not None:
        xc.numeric_checks.append(("odd", b.args[2], ctx, "the pooling kernel"))
    if t is None:
        return UNKNOWN
    return t if _along_one(xc, e, b, t) else UNKNOWN


def _cumsum(xc, e, ctx):
    b = bind(xc, e, (1, 1), clauses=("along",))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the argument of cumsum")
    if t is None:
        return UNKNOWN
    return t if _along_one(xc, e, b, t) else UNKNOWN


def _similarity(xc, e, ctx):
    b = bind(xc, e, (2, 2), clauses=("along",))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, f"the argument of {e.func.name}")
    if number(xc, b.args[1], ctx, "the similarity threshold") is not None:
        xc.numeric_checks.append(("cosine", b.args[1], ctx, "the similarity threshold"))
    if t is None:
        return UNKNOWN
    if "channel" not in t.dims:
        return xc.error(b.args[0], f"{e.func.name} compares vectors: its argument needs a channel axis, got {t}")
    if not _along_one(xc, e, b, t):
        return UNKNOWN
    return t.reshaped(d for d in t.dims if d != "channel")


def _elementwise(xc, e, ctx):
    b = bind(xc, e, (1, 1))
    if b is None:
        return UNKNOWN
    t = xc.check(b.args[0], ctx)
    if t is UNKNOWN:
        return t
    if isinstance(t, Tensor) and t.dtype == "float":
        return t
    if isinstance(t, Scalar) and t.numeric:
        return t if e.func.name == "abs" else FLOAT
    return xc.error(b.args[0], f"{e.func.name} needs a number or a tensor, not {t}")


def _rounding(xc, e, ctx):
    b = bind(xc, e, (1, 1))
    if b is None:
        return UNKNOWN
    t = number(xc, b.args[0], ctx, f"the argument of {e.func.name}")
    return UNKNOWN if t is None else Scalar("int", t.unit, t.literal)


# ---- selection -----------------------------------------------------------------------------


def _top(xc, e, ctx):
    b = bind(xc, e, (2, 2), kwargs=("at_least",), clauses=("per", "across"))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the score of top")
    xc.count(b.args[1], ctx, "the number of tokens to select")
    if "at_least" in b.kw:
        xc.count(b.kw["at_least"], ctx, "at_least")
        if "across" not in b.clauses:
            xc.error(b.kw["at_least"], "at_least only makes sense with `across` (a pooled budget)")
    if t is None:
        return UNKNOWN
    items = [d for d in t.dims if d == "key" or _is_partition(xc, d)]
    if len(items) != 1:
        return xc.error(b.args[0], f"top needs a score over tokens (key) or over one partition, got {t}")
    item = items[0]
    per = axes_of(xc, b.clauses["per"], t) if "per" in b.clauses else []
    across = axes_of(xc, b.clauses["across"], t) if "across" in b.clauses else []
    if per is None or across is None:
        return UNKNOWN
    for d in per + across:
        if d == item:
            return xc.error(e, f"{item} is what top selects; it cannot be `per` or `across`")
    if set(per) & set(across):
        return xc.error(e, "an axis cannot be both `per` and `across`")
    ranged = [d for d in per + across if t.range_of(d)]
    if ranged:
        return xc.error(b.args[0], f"the score {t} holds a range of the {ranged[0]} axis; top selects for all of them")
    missing = [d for d in t.dims if d != item and d not in per and d not in across]
    if missing:
        m = missing[0]
        return xc.error(b.args[0], f"the score also varies along {', '.join(missing)}: say `per {m}` (one selection "
                                   f"each) or `across {m}` (one pooled budget)",
                        "or reduce it first, e.g. mean(score, over group)" if m == "head" else None)
    return Selection(item, xc.sort_dims(per), xc.sort_dims(across))


# ---- partitions ----------------------------------------------------------------------------


def _split(xc, e, ctx):
    b = bind(xc, e, (1, 1), kwargs=("size", "at"))
    if b is None:
        return UNKNOWN
    if not (isinstance(b.args[0], ast.Name) and b.args[0].id == "key"):
        return xc.error(b.args[0], "split cuts the key axis: split(key, size = n) or split(key, at = [...])")
    if ("size" in b.kw) == ("at" in b.kw):
        return xc.error(e, "split takes `size = n` (pages) or `at = [\"...\"]` (spans), exactly one")
    if "size" in b.kw:
        xc.count(b.kw["size"], ctx, "the page size")
        xc.numeric_checks.append(("positive", b.kw["size"], ctx, "the page size"))
        return PartitionOf("pages")
    t = xc.check(b.kw["at"], ctx)
    if t is not UNKNOWN and (t != ListOf(STRING) or not getattr(b.kw["at"], "items", [1])):
        return xc.error(b.kw["at"], "`at` lists the strings that end a span, e.g. at = [\".\\n\", \"\\n\\n\"]")
    return PartitionOf("spans")


def _kmeans(xc, e, ctx):
    b = bind(xc, e, (1, 1), kwargs=("size", "segment", "iterations"))
    if b is None:
        return UNKNOWN
    t = tensor(xc, b.args[0], ctx, "the vectors to cluster")
    if "size" not in b.kw:
        xc.error(e, "kmeans needs the average cluster size: kmeans(k, size = 16)")
    else:
        xc.count(b.kw["size"], ctx, "the cluster size")
        xc.numeric_checks.append(("positive", b.kw["size"], ctx, "the cluster size"))
    if "segment" in b.kw:
        xc.count(b.kw["segment"], ctx, "the segment length")
        xc.numeric_checks.append(("positive", b.kw["segment"], ctx, "the segment length"))
        if "size" in b.kw:  # whole clusters per segment: `n` tokens of clusters are ceil(n / size) of them
            xc.numeric_checks.append(("multiple", (b.kw["segment"], b.kw["size"]), ctx, "the segment length"))
    if "iterations" in b.kw and number(xc, b.kw["iterations"], ctx, "iterations", whole=True):
        xc.numeric_checks.append(("positive", b.kw["iterations"], ctx, "iterations"))
    if t is not None and set(t.dims) != {"kv_head", "key", "channel"}:
        return xc.error(b.args[0], f"kmeans clusters keys [kv_head, key, channel], got {t}")
    return PartitionOf("clusters", ("kv_head",))


# ---- storage formats -----------------------------------------------------------------------


def _stored_axes(xc, e, b: Bound, required: bool = True, only: tuple[str, ...] = STORED) -> list[str] | None:
    if "along" not in b.clauses:
        if required:
            xc.error(e, f"say which elements share a scale: {BUILTINS[e.func.name].signature}")
        return None if required else []
    dims = axes_of(xc, b.clauses["along"], None)
    if dims is None:
        return None
    for d, ident in zip(dims, b.clauses["along"].dims):
        if d not in only:
            xc.error(ident, f"{e.func.name} works along {', '.join(only)}, not {d}")
            return None
    return dims


def _bits(xc, arg, ctx, what="the bit width"):
    if number(xc, arg, ctx, what, whole=True) is not None:
        xc.numeric_checks.append(("bits", arg, ctx, what))


def _quant(xc, e, ctx):
    b = bind(xc, e, (1, 1), kwargs=("mode", "group"), clauses=("along",))
    if b is None:
        return UNKNOWN
    _bits(xc, b.args[0], ctx)
    if "mode" in b.kw:
        enum(xc, b.kw["mode"], ctx, "quant.mode", "quantization mode")
    dims = _stored_axes(xc, e, b)
    if "group" in b.kw:
        if number(xc, b.kw["group"], ctx, "the group size", whole=True) is not None:
            xc.numeric_checks.append(("positive", b.kw["group"], ctx, "the group size"))
        if dims is not None and len(dims) != 1:
            xc.error(b.clauses["along"], "a group size needs exactly one axis: group = g, along key")
    return Codec("quant")


def _fp8(xc, e, ctx):
    b = bind(xc, e, (1, 1), kwargs=("scale",), clauses=("along",))
    if b is None:
        return UNKNOWN
    enum(xc, b.args[0], ctx, "fp8.format", "FP8 format")
    if "scale" in b.kw:
        enum(xc, b.kw["scale"], ctx, "fp8.scale", "FP8 scale")
    _stored_axes(xc, e, b)
    return Codec("fp8")


def _rotate(xc, e, ctx):
    b = bind(xc, e, (1, 1), clauses=("along",))
    if b is None:
        return UNKNOWN
    enum(xc, b.args[0], ctx, "rotate.kind", "rotation")
    _stored_axes(xc, e, b, only=("channel",))
    return Codec("rotate")


def _codebook(xc, e, ctx):
    b = bind(xc, e, (1, 1), clauses=("along",))
    if b is None:
        return UNKNOWN
    _bits(xc, b.args[0], ctx)
    _stored_axes(xc, e, b, only=("channel",))
    return Codec(e.func.name)


def _project(xc, e, ctx):
    b = bind(xc, e, (2, 2), kwargs=("group", "prerope", "bias"))
    if b is None:
        return UNKNOWN
    down = tensor(xc, b.args[0], ctx, "the down projection")
    up = tensor(xc, b.args[1], ctx, "the up projection")
    if "group" in b.kw and number(xc, b.kw["group"], ctx, "the head group", whole=True) is not None:
        # a model whose KV heads the group does not divide groups gcd(group, kv_heads) of them (runtime/kv/spec.py)
        xc.numeric_checks.append(("positive", b.kw["group"], ctx, "the head group"))
    if "prerope" in b.kw:
        t = xc.check(b.kw["prerope"], ctx)
        if t is not UNKNOWN and t != BOOL:
            xc.error(b.kw["prerope"], f"prerope is true or false, not {t}")
    if down is None or up is None:
        return UNKNOWN
    for t, arg in ((down, b.args[0]), (up, b.args[1])):
        latent = [d for d in t.dims if d not in ("kv_head", "channel")]
        if "channel" not in t.dims or "kv_head" not in t.dims or len(latent) != 1:
            return xc.error(arg, f"a projection is [kv_head, channel, LATENT] for one declared latent axis, got {t}",
                            "declare it: `dim rank = head_dim // 2`, `input k_down: [layer, kv_head, channel, rank]`")
    if set(down.dims) != set(up.dims):
        return xc.error(b.args[1], f"the up projection {up} must have the axes of the down projection {down}")
    if "bias" in b.kw:
        bias = tensor(xc, b.kw["bias"], ctx, "the bias")
        if bias is not None and set(bias.dims) != {"kv_head", "channel"}:
            return xc.error(b.kw["bias"], f"a bias is [kv_head, channel] (added to what `up` reads back), got {bias}")
    return Codec("project")


def _nearest(xc, e, ctx) -> None:
    """`nearest(every = n, count = m)`: the mean of a token's m nearest centers (the reference of a residual)."""
    b = bind(xc, e, (0, 0), kwargs=("every", "count"))
    if b is None:
        return
    for kw, what in (("every", "the center stride"), ("count", "the neighbours")):
        if kw not in b.kw:
            xc.error(e, f"nearest needs `{kw}`: {BUILTINS['nearest'].signature}")
            continue
        if kw == "every":
            xc.count(b.kw[kw], ctx, what)
        else:
            number(xc, b.kw[kw], ctx, what, whole=True)
        xc.numeric_checks.append(("positive", b.kw[kw], ctx, what))


def _residual(xc, e, ctx):
    b = bind(xc, e, (1, 1))
    if b is None:
        return UNKNOWN
    if isinstance(b.args[0], ast.Call) and b.args[0].func.name == "nearest":
        _nearest(xc, b.args[0], ctx)
        return Codec("residual")
    t = tensor(xc, b.args[0], ctx, "the reference")
    if t is None:
        return UNKNOWN
    if tuple(t.dims) == ("kv_head", "channel"):  # one vector per KV head: an offset (e.g. k_mean[layer])
        return Codec("residual")
    if "channel" not in t.dims or not any(_is_partition(xc, d) for d in t.dims):
        return xc.error(b.args[0], "the reference is one vector per KV head (an input indexed by layer, "
                                   "[kv_head, channel]) or per partition item, e.g. [kv_head, clusters, channel]; "
                                   f"got {t}")
    return Codec("residual")


_HANDLERS = {
    "attention": _attention, "logits": _attention, "softmax": _softmax,
    "sum": _reduction, "mean": _reduction, "max": _reduction, "min": _reduction,
    "quantile": _quantile, "norm": _norm, "pool": _pool, "cumsum": _cumsum,
    "redundancy": _similarity, "duplicated": _similarity,
    "abs": _elementwise, "exp": _elementwise, "log": _elementwise, "sqrt": _elementwise,
    "floor": _rounding, "ceil": _rounding, "round": _rounding,
    "top": _top, "split": _split, "kmeans": _kmeans,
    "quant": _quant, "fp8": _fp8, "rotate": _rotate, "lloyd_max": _codebook, "qjl": _codebook,
    "project": _project, "residual": _residual,
    "nearest": lambda xc, e, ctx: UNKNOWN,  # checked by residual(...) (`_nearest`); elsewhere its kind is refused
}
assert set(_HANDLERS) == set(BUILTINS), "every built-in needs a typing rule"
