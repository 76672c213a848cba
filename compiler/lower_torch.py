"""Torch emitter: IR values and hook bodies as lines of plain PyTorch (the CPU backend).

Pipeline position: used by `codegen` to fill the named points of `templates/torch_lowering.py.jinja`.
Every IR value becomes one Python statement over a torch tensor whose dimensions are the value's
named axes in order (`value.dims`, the checker's order); the template's prelude holds the helpers
(`_attention`, `_window`, `_reduce`, `_contract`, `_group`, `_pool`, `_align`, `_select`) so the emitted code
stays one line per operation. Axes combine by name, never by position: reductions, norms, pooling
and windows find their axis by name, and an operand of an elementwise operation (or of
`_attention`) whose axes differ from what it meets is first laid out by `_align` (permuted,
size-1 axes added, `kv_head` repeated into `head`). A score over a range of the key axis is placed
back at its keys' positions before ranking. Scalar counts are sympy, printed with `sympy.pycode`
over local names (parameters and symbols).

A hook with a `read` (decode_before_attention) is lowered over the whole decode batch at once: every
value gets a leading `row` axis (`batched`), which the by-name helpers carry through unchanged, and
the read becomes `<hook>_scores` (float32 `[row, kv_head, item]`) and `<hook>_read` (the plan's
page indices, `_read_pages`), static in shape so the engine may capture it in a CUDA graph.
A hook that chooses a shared selection (`chosen = top(...)`) or reads one (`read chosen + last n`,
a token plan) is batched the same way, with the per-row symbols `context`, `prompt` and `step` as
[row] tensors: a range of the key axis masks the keys outside it (`_row_range`), the decode query's
logits are `_decode_logits`, the choice is `_choose_tokens` (static in shape: its width is the count
at the batch's widest row) and the read `_read_tokens`.
A read over the clusters of a `kmeans` partition (with an `estimate` of the next ones) is batched
like a page read over the rows' cluster indices (runtime/compiled/cluster_index.py): its counts may
read the per-row symbols, its ranges (`first n`, `last m`: the slots the index leaves out) parameters
only; the plan is `_read_clusters` (runtime/primitives/clusters.py).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import sympy as sp

from kvc.compiler.ir import (Accumulate, Assign, Attention, Choose, Elementwise, Estimate, HookIR, Input, Keep,
                             MethodIR, Norm, NotLowerable, Partition, Pool, Quantile, Read, Reduce, Redundancy, Scalar,
                             Softmax, SpanReduce, Duplicated, Value, Window)

_NUMBER = re.compile(r"[0-9.]+(e-?[0-9]+)?")
SYMBOLS = ("context", "prompt", "step", "layer", "layers", "heads", "kv_heads", "head_dim")
ROW_SYMBOLS = ("context", "prompt", "step")  # per row of a decode batch: [row] tensors in a batched hook
ROW = "row"  # the decode batch's axis of a read hook (`batched`)
_UNARY = {"neg": "-({})", "abs": "torch.abs({})", "exp": "torch.exp({})", "log": "torch.log({})",
          "sqrt": "torch.sqrt({})"}
_BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "div": "({} / {})",
           "max": "torch.maximum({}, {})", "min": "torch.minimum({}, {})", "lt": "({} < {})", "le": "({} <= {})",
           "gt": "({} > {})", "ge": "({} >= {})", "eq": "({} == {})", "ne": "({} != {})"}
ROLE_DIMS = ("layer", "kv_head")  # a role's mask is laid out over these (a missing axis: size 1)


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
    read: dict | None = None  # score variable, counts in tokens, tokens per page, granularity (or a token read)
    choose: dict | None = None  # the shared selection a batched hook chooses: its name, score, counts
    where: str | None = None
    rows: bool = False  # batched over a decode batch's rows
    spans: set[str] = field(default_factory=set)  # the text partitions it reads (`sym[P]`: each slot's span)


class _Emitter:
    def __init__(self, code: HookCode, rows: bool = False) -> None:
        self.code = code
        self.rows = rows  # a batched hook: ranges of the key axis differ by row
        self.counter = 0
        self.memo: dict[int, str] = {}
        self.aligned: dict[tuple, str] = {}

    def scalar(self, expr) -> str:
        self.code.names |= names_in(expr)
        return pyexpr(expr)

    def emit(self, rhs: str) -> str:
        self.counter += 1
        var = f"t{self.counter}"
        self.code.lines.append(f"{var} = {rhs}")
        return var

    def value(self, v: Value) -> str:
        """A variable (or expression) holding `v` as a torch tensor laid out over `v.dims`, in order."""
        key = id(v)
        if key not in self.memo:
            self.memo[key] = self._value(v)
        return self.memo[key]

    def laid_out(self, var: str, dims: tuple[str, ...], to: tuple[str, ...]) -> str:
        """`var` (a tensor over `dims`) laid out over `to`: axes matched by name, permuted, a size-1
        axis where `to` has one `dims` lacks, `kv_head` repeated into `head`. Nothing when equal."""
        dims, to = tuple(dims), tuple(to)
        if dims == to:
            return var
        key = (var, dims, to)
        if key not in self.aligned or var.startswith("state["):  # a state may change between two reads
            heads = ""
            if "kv_head" in dims and "head" in to:
                self.code.names.add("heads")
                heads = ", heads"
            self.aligned[key] = self.emit(f"_align({var}, {_names(dims)}, {_names(to)}{heads})")
        return self.aligned[key]

    def operand(self, v: Value, to: tuple[str, ...]) -> str:
        """An operand of an elementwise operation whose result is over `to` (a number parenthesised:
        sympy prints 1/2 for a half)."""
        if isinstance(v, Scalar):
            text = self.value(v)
            return text if text.isidentifier() or _NUMBER.fullmatch(text) else f"({text})"
        return self.laid_out(self.value(v), v.dims, to)

    def _value(self, v: Value) -> str:
        if isinstance(v, Input):
            if v.kind == "state":
                return f'state["{v.name}"]'
            self.code.inputs.add(v.name)  # a hook input or a page summary, by name
            if self.rows and v.name == "q" and "query" in v.dims:  # the step's one query: [row, head, channel]
                return self.emit(f"_align(q, {_names((ROW, 'head', 'channel'))}, {_names(v.dims)})")
            return v.name
        if isinstance(v, Scalar):
            return self.scalar(v.expr)
        var, dims = self._op(v)
        return self.laid_out(var, dims, v.dims)

    def _op(self, v: Value) -> tuple[str, tuple[str, ...]]:
        """One torch operation for `v`: the variable and the axes of its result, in the order the
        operation leaves them (`_value` lays them out as `v.dims`)."""
        if isinstance(v, Window):
            src = self.value(v.src)
            if self.rows and v.axis == "key":  # each row's own range, the rest masked
                self.code.names.add("context")
                return self.emit(f'_row_range({src}, {v.src.dims.index(v.axis)}, "{v.side}", '
                                 f'{self.scalar(v.count)}, context)'), v.src.dims
            return self.emit(f'_window({src}, {v.src.dims.index(v.axis)}, "{v.side}", {self.scalar(v.count)})'), \
                v.src.dims
        if isinstance(v, Attention):
            return self._attention(v)
        if isinstance(v, Reduce):
            contracted = self._contraction(v)
            if contracted is not None:
                return contracted
            x, dims = self.value(v.src), list(v.src.dims)
            if "group" in v.axes:
                x = self.emit(f'_group({x}, "{v.fn}", {dims.index("head")}, kv_heads)')
                self.code.names.add("kv_heads")
                dims[dims.index("head")] = "kv_head"
            rest = tuple(dims.index(a) for a in v.axes if a != "group")
            kept = tuple(d for d in dims if d not in v.axes)
            # over the query heads: the ranks of a tensor-parallel engine each hold some (`_reduce_heads`)
            reduce = "_reduce_heads" if "head" in v.axes else "_reduce"
            return (self.emit(f'{reduce}({x}, "{v.fn}", {rest})') if rest else x), kept
        if isinstance(v, Pool):
            if v.mode.startswith("param:"):
                mode = v.mode.split(":", 1)[1]
                self.code.names.add(mode)
            else:
                mode = f'"{v.mode}"'
            src = self.value(v.src)
            return self.emit(f"_pool({src}, {mode}, {self.scalar(v.kernel)}, {v.src.dims.index(v.axis)})"), v.src.dims
        if isinstance(v, Quantile):
            src = self.value(v.src)
            axes = tuple(v.src.dims.index(a) for a in v.axes)
            return self.emit(f"_quantile({src}, {self.scalar(v.p)}, {axes})"), \
                tuple(d for d in v.src.dims if d not in v.axes)
        if isinstance(v, Norm):
            src = self.value(v.src)
            axes = tuple(v.src.dims.index(a) for a in v.axes)
            dim = axes[0] if len(axes) == 1 else axes
            return self.emit(f"torch.linalg.vector_norm({src}.float(), dim={dim})"), \
                tuple(d for d in v.src.dims if d not in v.axes)
        if isinstance(v, Softmax):
            src = self.value(v.src)
            return self.emit(f"_softmax({src}, {v.src.dims.index(v.axis)})"), v.src.dims
        if isinstance(v, SpanReduce):
            src = self.value(v.src)
            self.code.spans.add(v.partition)
            return self.emit(f'_span_reduce({src}, {v.partition}, "{v.fn}", {v.src.dims.index("key")})'), \
                tuple(v.partition if d == "key" else d for d in v.src.dims)
        if isinstance(v, Duplicated):
            src = self.value(v.src)
            return self.emit(f"_duplicated({src}, {self.scalar(v.threshold)}, {v.src.dims.index(v.axis)}, "
                             f"{v.src.dims.index('channel')})"), tuple(d for d in v.src.dims if d != "channel")
        if isinstance(v, Redundancy):
            src = self.value(v.src)
            return self.emit(f"_redundancy({src}, {self.scalar(v.threshold)}, {v.src.dims.index(v.axis)}, "
                             f"{v.src.dims.index('channel')})"), tuple(d for d in v.src.dims if d != "channel")
        if isinstance(v, Elementwise):
            if len(v.args) == 1:
                return self.emit(_UNARY[v.fn].format(self.operand(v.args[0], v.dims))), v.dims
            a, b = (self.operand(x, v.dims) for x in v.args)
            if v.fn in ("max", "min") and any(isinstance(x, Scalar) for x in v.args):
                tensor, number = (a, b) if isinstance(v.args[1], Scalar) else (b, a)
                bound = "min" if v.fn == "max" else "max"  # max(x, n) is x clamped from below at n
                return self.emit(f"torch.clamp({tensor}, {bound}={number})"), v.dims
            return self.emit(_BINARY[v.fn].format(a, b)), v.dims
        raise NotLowerable(f"cannot lower {type(v).__name__} to torch yet")

    def _contraction(self, v: Reduce) -> tuple[str, tuple[str, ...]] | None:
        """`sum(a * b, over axes)` of two tensors as one `_contract` (an einsum: the broadcast product
        is never in memory), where the sum is over neither the query group nor the query heads."""
        src = v.src
        if (v.fn != "sum" or not isinstance(src, Elementwise) or src.fn != "mul" or len(src.args) != 2
                or any(isinstance(a, Scalar) for a in src.args) or {"group", "head"} & set(v.axes)):
            return None
        a, b = src.args
        kept = tuple(d for d in src.dims if d not in v.axes)
        return self.emit(f"_contract({self.value(a)}, {_names(a.dims)}, {self.value(b)}, {_names(b.dims)}, "
                         f"{_names(kept)})"), kept

    def _attention(self, v: Attention) -> tuple[str, tuple[str, ...]]:
        """`_attention` takes q [head, query, channel] and k [kv_head, key, channel] (query head h
        reads KV head h // (heads // kv_heads)); other operands are laid out so first."""
        if self.rows:  # the decode step's query over each row's stored keys
            head = "head" if "head" in v.dims else "kv_head"
            query = ("query",) if "query" in v.q.dims else ()
            q = self.laid_out(self.value(v.q), v.q.dims, (ROW, head, *query, "channel"))
            k = self.laid_out(self.value(v.k), v.k.dims, (ROW, "kv_head", "key", "channel"))
            self.code.names.add("context")
            return self.emit(f"_decode_logits({q}, {k}, context, softmax={v.softmax})"), (ROW, head, *query, "key")
        if "query" not in v.q.dims:
            raise NotLowerable("attention of decode queries is lowered in a batched decode hook only")
        item = next(d for d in v.k.dims if d not in ("head", "kv_head", "channel"))
        head = "head" if "head" in v.dims else "kv_head"
        kv = next((d for d in ("kv_head", "head") if d in v.k.dims), "kv_head")
        q = self.laid_out(self.value(v.q), v.q.dims, (head, "query", "channel"))
        k = self.laid_out(self.value(v.k), v.k.dims, (kv, item, "channel"))
        # a layer compacted with per-head counts: each KV head's own keys (primitives' `attention`)
        starts = ', starts=sym.get("starts")' if item == "key" else ""
        return self.emit(f"_attention({q}, {k}, softmax={v.softmax}{starts})"), (head, "query", item)

    def key_start(self, v: Value) -> str | None:
        """Where the keys of a score over a range of the key axis start (Python over the symbols), or
        None when the range starts at the oldest key: `top` ranks every key by name, the others at -inf."""
        ranges = _key_ranges(v)
        if all(w.side == "first" for w in ranges):
            return None
        self.code.names.add("context")
        parts = ", ".join(f'("{w.side}", {self.scalar(w.count)})' for w in ranges)
        return f"_range_start(context, [{parts}])"


def _names(dims: tuple[str, ...]) -> str:
    return "(" + ", ".join(f'"{d}"' for d in dims) + ("," if len(dims) == 1 else "") + ")"


def _key_ranges(v: Value) -> list[Window]:
    """The ranges taken of the key axis on the way to `v`, outermost first (the checker makes every
    operand with a key axis hold the same ones, so following one of them is enough)."""
    if isinstance(v, Window):
        return _key_ranges(v.src) + ([v] if v.axis == "key" else [])
    if isinstance(v, Attention):
        return _key_ranges(v.k)
    children = [c for c in (getattr(v, "src", None), *getattr(v, "args", ())) if c is not None and "key" in c.dims]
    return _key_ranges(children[0]) if children else []


def batched(value: Value, done: dict[int, Value] | None = None) -> Value:
    """`value` over the rows of a decode batch: a leading `row` axis on every tensor value. `done`
    memoises by identity, so a value that two statements share (a name) stays one value."""
    done = {} if done is None else done
    if isinstance(value, Scalar):
        return value
    if id(value) not in done:
        changes = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if isinstance(item, Value):
                changes[f.name] = batched(item, done)
            elif isinstance(item, tuple) and item and all(isinstance(x, Value) for x in item):
                changes[f.name] = tuple(batched(x, done) for x in item)
        done[id(value)] = dataclasses.replace(value, dims=(ROW, *value.dims), **changes)
    return done[id(value)]


def _batched_hook(hook: HookIR) -> HookIR:
    """A read hook over the whole decode batch."""
    done: dict[int, Value] = {}

    def rows(v: Value) -> Value:
        return batched(v, done)

    stmts = []
    for stmt in hook.stmts:
        if isinstance(stmt, Assign):
            stmts.append(Assign(stmt.name, rows(stmt.value)))
        elif isinstance(stmt, (Read, Estimate, Choose)) and stmt.select.top is not None:
            top = dataclasses.replace(stmt.select.top, score=rows(stmt.select.top.score))
            stmts.append(dataclasses.replace(stmt, select=dataclasses.replace(stmt.select, top=top)))
        else:
            stmts.append(stmt)
    return dataclasses.replace(hook, stmts=tuple(stmts))


def _emit_token_read(em: _Emitter, code: HookCode, stmt: Read) -> None:
    """`read chosen + first m + last n`: the shared selection every KV head reads, plus the m first and
    each row's n newest stored tokens."""
    sel = stmt.select
    code.names.add("kv_heads")
    code.read = {"tokens": True, "shared": sel.shared, "last": "0" if sel.last is None else em.scalar(sel.last),
                 "first": "0" if sel.first is None else em.scalar(sel.first)}


def _emit_choose(em: _Emitter, code: HookCode, stmt: Choose) -> None:
    """`chosen = top(score, count)` (one set for every head of a row): the score [row, key] float32 and
    the count, with its static bound: the count where every row symbol is the batch's key width. That
    bounds every row only if the count does not shrink as a row grows: a count falling with a row
    symbol (`n - prompt`) is refused."""
    top = stmt.select.top
    if top is None or stmt.select.first is not None or stmt.select.last is not None or top.granularity != "layer":
        raise NotLowerable("a shared selection is lowered as one `top(score, count)` for every head yet")
    count = sp.sympify(top.count)
    for name in ROW_SYMBOLS:
        if sp.diff(count, sp.Symbol(name)).is_negative:
            raise NotLowerable(f"a shared selection's count may not fall as {name} grows (its static width is the "
                               "count at the batch's widest row)")
    score = em.laid_out(em.value(top.score), top.score.dims, (ROW, "key"))
    code.lines.append(f"scores = {score}.float()")
    width = sp.Symbol("width")
    bound = sp.sympify(top.count).subs({sp.Symbol(s): width for s in ROW_SYMBOLS})
    code.choose = {"shared": stmt.shared, "score": "scores", "count": em.scalar(top.count),
                   "bound": pyexpr(bound)}
    code.names |= names_in(bound) - {"width"}


def _emit_read(em: _Emitter, code: HookCode, stmt: Read) -> None:
    """`read top(score, count, per kv_head) + last n` over pages: the score laid out as [row, kv_head,
    item] float32, and the counts (tokens) the plan's `_read_pages` turns into pages."""
    sel, top = stmt.select, stmt.select.top
    read = {"count": "0", "last": "0" if sel.last is None else em.scalar(sel.last), "page": em.scalar(stmt.page),
            "score": "None", "granularity": "none"}
    if top is not None:
        per_head = "kv_head" in top.score.dims
        to = (ROW, "kv_head", stmt.item) if per_head else (ROW, stmt.item)
        score = em.laid_out(em.value(top.score), top.score.dims, to)
        if not per_head:
            score = em.emit(f"{score}.unsqueeze(1).expand(-1, kv_heads, -1)")
            code.names.add("kv_heads")
        code.lines.append(f"scores = {score}.float()")
        read.update(score="scores", count=em.scalar(top.count), granularity=top.granularity)
    code.read = read


def _emit_cluster_read(em: _Emitter, code: HookCode, stmt: Read, estimates: list[Estimate]) -> None:
    """`read top(score, count, per kv_head) + first a + last b` over the clusters of a `kmeans`
    partition, and the `estimate top(score, m) using KEY, VSUM` of the same score: the score laid out
    as [row, kv_head, clusters] float32, counts in tokens (per row), ranges over parameters only."""
    sel, top = stmt.select, stmt.select.top
    if top is None or top.granularity not in ("kv_head", "layer"):
        raise NotLowerable("a read over clusters is one `top(score, count)` (per kv_head or for the layer) plus "
                           "ranges")
    for side, count in (("first", sel.first), ("last", sel.last)):
        if count is not None and names_in(count) & set(ROW_SYMBOLS):
            raise NotLowerable(f"a read over clusters reads its `{side} n` from parameters only (the cluster index "
                               "covers the slots between them)")
    if len(estimates) > 1:
        raise NotLowerable("one `estimate` per read over clusters")
    per_head = "kv_head" in top.score.dims
    score = em.laid_out(em.value(top.score), top.score.dims,
                        (ROW, "kv_head", stmt.item) if per_head else (ROW, stmt.item))
    if not per_head:
        score = em.emit(f"{score}.unsqueeze(1).expand(-1, kv_heads, -1)")
        code.names.add("kv_heads")
    code.lines.append(f"scores = {score}.float()")
    read = {"clusters": stmt.item, "score": "scores", "count": em.scalar(top.count), "size": em.scalar(stmt.page),
            "first": "0" if sel.first is None else em.scalar(sel.first),
            "last": "0" if sel.last is None else em.scalar(sel.last), "estimate": "None", "using": "None"}
    if estimates:
        est = estimates[0]
        if est.item != stmt.item or est.select.top.score != top.score:
            raise NotLowerable("an estimate ranks the clusters its hook's read ranks, by the same score (it takes the "
                               "next ones)")
        read.update(estimate=em.scalar(est.select.top.count), using=f'("{est.key}", "{est.value_sum}")')
    code.read = read


def emit_partition(partition: Partition) -> tuple[dict[str, str], HookCode]:
    """The counts of a `kmeans` partition's clustering (`size`, `segment`, `iterations`) as Python
    over parameters, and the code whose `names` they read."""
    code = HookCode(partition.name)
    em = _Emitter(code)
    counts = {"size": em.scalar(partition.size), "iterations": em.scalar(partition.iterations),
              "segment": "None" if partition.segment is None else em.scalar(partition.segment)}
    if code.names & set(SYMBOLS):
        raise NotLowerable(f"the clustering of {partition.name} reads parameters only")
    return counts, code


def emit_hook(hook: HookIR, partitions: dict[str, Partition] | None = None) -> HookCode:
    partitions = partitions or {}
    if hook.estimates and not any(r.item in partitions for r in hook.reads):
        raise NotLowerable(f"{hook.name}: an `estimate` is lowered beside a `read` over the same clusters only")
    code = HookCode(hook.name, rows=hook.batched)
    if hook.batched:
        hook = _batched_hook(hook)
    em = _Emitter(code, rows=hook.batched and not any(r.item != "key" for r in hook.reads))
    if hook.where is not None:
        code.where = em.scalar(hook.where)
    keeps = hook.keeps
    if len(keeps) > 1:
        raise NotLowerable(f"{hook.name}: more than one `keep` in a hook is not lowered yet")
    for stmt in hook.stmts:
        if isinstance(stmt, Assign):  # computed in statement order: a later `+=` must not change it
            var = em.value(stmt.value)
            if var.startswith("state["):  # a state read as it is now, not as a later `+=` leaves it
                em.memo[id(stmt.value)] = em.emit(var)
            continue
        if isinstance(stmt, Accumulate):
            target = f'state["{stmt.state}"]'
            if isinstance(stmt.value, Scalar):
                code.lines.append(f"{target} = {target} + {em.value(stmt.value)}")
                continue
            value = em.laid_out(em.value(stmt.value), stmt.value.dims, stmt.dims)
            grow = "" if stmt.dims[-1:] == ("key",) or "key" not in stmt.dims else f", {stmt.dims.index('key')}"
            code.lines.append(f"{target} = _grow({target}, {value}{grow}) + {value}")
        if isinstance(stmt, Read) and stmt.item in partitions:
            _emit_cluster_read(em, code, stmt, [e for e in hook.estimates if e.item == stmt.item])
        elif isinstance(stmt, Read):
            (_emit_token_read if stmt.item == "key" else _emit_read)(em, code, stmt)
        if isinstance(stmt, Choose):
            _emit_choose(em, code, stmt)
        if isinstance(stmt, Keep):
            code.names |= {"kv_heads", "context"}  # `_select` always needs them
            sel, top = stmt.select, stmt.select.top
            keep = {"first": "None" if sel.first is None else em.scalar(sel.first),
                    "last": "None" if sel.last is None else em.scalar(sel.last),
                    "count": "None", "at_least": "None", "granularity": "none", "score": "None"}
            if top is not None and top.granularity == "global":  # every layer's scores at once (replay_end)
                if "layer" not in top.score.dims or "kv_head" not in top.score.dims:
                    raise NotLowerable(f"{hook.name}: a top across layers ranks a [layer, kv_head, key] score")
                score = em.laid_out(em.value(top.score), top.score.dims, ("layer", "kv_head", "key"))
                code.lines.append(f"scores = {score}.float()")
            elif top is not None and top.within is not None:  # whole spans: the spans' scores [kv_head, P]
                code.spans.add(top.within)
                score = em.laid_out(em.value(top.score), top.score.dims, ("kv_head", top.within))
                code.lines.append(f"scores = {score}.float()")
            elif top is not None:
                per_head = "kv_head" in top.score.dims
                score = em.laid_out(em.value(top.score), top.score.dims, ("kv_head", "key") if per_head else ("key",))
                start = em.key_start(top.score)
                start = "" if start is None else f", start={start}"
                code.lines.append(f"scores = _full_scores({score}, {str(per_head)}, kv_heads, context{start})")
            if top is not None:
                keep.update(score="scores", count=em.scalar(top.count), granularity=top.granularity,
                            at_least="None" if top.at_least is None else em.scalar(top.at_least))
                if top.within is not None:
                    keep["within"] = top.within
            if stmt.role is not None:
                if top is not None:
                    raise NotLowerable(f"{hook.name}: `keep top(...) for ROLE` is not lowered yet (only ranges: "
                                       "`keep first n + last m for ROLE`)")
                keep["role"] = stmt.role
            code.keep = keep
    if code.read is not None and not {"tokens", "clusters"} & set(code.read) and code.names & {"context", "prompt",
                                                                                               "step"}:
        raise NotLowerable(f"{hook.name}: a read may not depend on context, prompt or step yet (its plan is computed "
                           "once for the whole decode batch)")
    return code


def emit(method: MethodIR) -> list[HookCode]:
    return [emit_hook(h, method.partitions) for h in method.hooks]


def emit_roles(method: MethodIR) -> HookCode | None:
    """The body of the generated `roles(inputs, params)`: each role's bool mask laid out over
    (layer, kv_head) in a variable named after the role (None: the method has no roles). Roles
    read parameters and method inputs only (the checker's rule), so the engine computes them once."""
    if not method.roles:
        return None
    code = HookCode("roles")
    em = _Emitter(code)
    for name, value in method.roles.items():
        var = em.laid_out(em.value(value), value.dims, ROLE_DIMS)
        code.lines.append(f"{name} = {var}")
    return code


def unpack_lines(code: HookCode, params: list[str]) -> list[str]:
    """Local names a hook body reads: symbols from `sym`, parameters from `params`."""
    lines = []
    for name in sorted(code.names | code.spans):
        if name in code.spans:  # each stored slot's span (the engine's; absent in a `meta` run of the counts)
            lines.append(f'{name} = sym.get("{name}")')
        elif name in SYMBOLS:
            lines.append(f'{name} = sym["{name}"]')
        elif name in params:
            lines.append(f'{name} = params["{name}"]')
        else:
            raise NotLowerable(f"unknown name '{name}' in a count")
    return lines
