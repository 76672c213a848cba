"""The typed method IR: what a checked .kvm method computes, as data the passes can read.

Pipeline position: first stage of `kvc.compiler`. `build(checked)` turns a `CheckedMethod` (the
typed AST of `kvc.dsl`) into a `MethodIR`; the passes (`budgets`, `legality`, `fusion`) read it
and `codegen` renders it. Tensor values keep the checker's named axes (`dims`) in the checker's
order, which is also the order of the torch tensors the lowering builds. Scalar counts (budgets,
windows, ranges) are sympy expressions with every `let` expanded and parameters left symbolic,
so one generated module serves every parameter override.

Constructs the lowering does not handle yet raise `NotLowerable` with the source position; the
compiler then writes a manifest marked `"lowered": false` with that reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import sympy as sp

from kvc.dsl import ast
from kvc.dsl.symbolic import NotSymbolic, to_sympy
from kvc.dsl.types import Scalar as ScalarType
from kvc.dsl.types import Selection, Tensor

LOWERED_FAMILIES = ("eviction", "full", "sparse", "quantization", "compression")


class NotLowerable(Exception):
    """The method is valid .kvm but this compiler version cannot lower it (yet)."""

    def __init__(self, reason: str, pos: object = None) -> None:
        super().__init__(reason)
        self.reason, self.pos = reason, pos


# ---- tensor values ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Value:
    dims: tuple[str, ...]


@dataclass(frozen=True)
class Input(Value):
    """A tensor the engine hands the hook (`q`, `k`, `v`, `attn`), a method state, a page summary
    (`summary kmax = max(k, within pages)`: [kv_head, pages, channel], kept current by the store), or
    a method input loaded from a file (`input gate: [layer, kv_head] from "..."`, read by roles)."""

    name: str
    kind: str  # 'hook' | 'state' | 'summary' | 'input'


@dataclass(frozen=True)
class Window(Value):
    """`x[first n along axis]` / `x[last n]`: a contiguous range of a sequence axis."""

    src: Value
    side: str  # 'first' | 'last'
    count: object  # sympy
    axis: str


@dataclass(frozen=True)
class Attention(Value):
    """Causal softmax(q k^T / sqrt(d)) (or the logits); queries are the last positions."""

    q: Value
    k: Value
    softmax: bool = True


@dataclass(frozen=True)
class Reduce(Value):
    """sum/mean/max/min over axes; the pseudo-axis `group` folds `head` into `kv_head`."""

    src: Value
    fn: str
    axes: tuple[str, ...]


@dataclass(frozen=True)
class Pool(Value):
    """Stride-1 centred pooling along an axis, zero padding (avg counts it, max ignores it)."""

    src: Value
    mode: str  # 'avg' | 'max' | 'param:<name>'
    kernel: object  # sympy
    axis: str


@dataclass(frozen=True)
class Elementwise(Value):
    fn: str  # 'neg' | 'abs' | 'exp' | 'log' | 'sqrt' | 'add' | 'sub' | 'mul' | 'div' | 'max' | 'min' | a comparison
    args: tuple[Value, ...]


@dataclass(frozen=True)
class Quantile(Value):
    """`quantile(x, p, over axes)`: the value below which exactly round(p * n) of the n items lie
    (the round(p * n)-th smallest; -inf for none), so `x <= quantile(x, p, ...)` holds for exactly
    round(p * n) items when they are distinct (runtime/primitives/torch_primitives.quantile)."""

    src: Value
    p: object  # sympy
    axes: tuple[str, ...]


@dataclass(frozen=True)
class Norm(Value):
    """L2 norm over axes."""

    src: Value
    axes: tuple[str, ...]


@dataclass(frozen=True)
class Softmax(Value):
    """softmax along one axis (float32)."""

    src: Value
    axis: str


@dataclass(frozen=True)
class Redundancy(Value):
    """R-KV's redundancy of each item along `axis` (runtime/primitives/torch_primitives.redundancy): the mean
    cosine similarity of the others to it, each item's newest near-copy (cos > threshold) not counted,
    softmaxed along the axis; `channel` is dropped."""

    src: Value
    threshold: object  # sympy
    axis: str


@dataclass(frozen=True)
class SpanReduce(Value):
    """`fn(x, within P)` over the spans of a text partition (`dim P = split(key, at = [...])`): the key
    axis becomes P, one entry per span of the tokens each KV head stores (NaN where it stores none)."""

    src: Value
    fn: str
    partition: str


@dataclass(frozen=True)
class Duplicated(Value):
    """`duplicated(x, threshold, along P)`: 1 where a later item along P has a vector (over `channel`)
    of cosine similarity above `threshold` with this item's, else 0; `channel` is dropped."""

    src: Value
    threshold: object  # sympy
    axis: str


@dataclass(frozen=True)
class Scalar(Value):
    """A scalar operand inside a tensor expression (sympy)."""

    expr: object


TensorValue = Union[Input, Window, Attention, Reduce, Pool, Elementwise, Norm, Quantile, Softmax, Redundancy,
                    SpanReduce, Duplicated, Scalar]

# ---- statements ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TopK:
    score: Value
    count: object  # sympy: tokens (per index of `per`, or in total across `across`)
    granularity: str  # 'kv_head' | 'layer' (one set for every head) | 'head_adaptive' | 'global' | 'spans'
    at_least: object = None  # sympy or None (head-adaptive safeguard per head)
    within: str | None = None  # 'spans': the text partition whose whole spans it keeps (count in tokens)


@dataclass(frozen=True)
class Select:
    """`top(...) + first a + last b`: ranges are forced, top ranks the other tokens; `shared` names a
    shared selection that another layer chose (`read chosen + last n`)."""

    top: TopK | None
    first: object = None  # sympy or None
    last: object = None
    shared: str | None = None


@dataclass(frozen=True)
class Assign:
    name: str
    value: Value


@dataclass(frozen=True)
class Accumulate:
    state: str
    value: Value
    dims: tuple[str, ...] = ()  # the state's axes (the value is laid out over them before adding)


@dataclass(frozen=True)
class Keep:
    select: Select
    role: str | None = None


@dataclass(frozen=True)
class Read:
    """`read top(score, count) + last n` over the pages of a `split(key, size = page)` partition
    (sparse attention in decode_before_attention): counts stay in tokens, `page` is the partition's
    size in tokens (sympy); the lowering turns them into pages (docs/design.md, "Plans"). Over
    single tokens (`item` key, `page` 1): `read chosen + last n`, a shared selection plus a range."""

    select: Select
    item: str  # the partition axis the selection is over (e.g. `pages`, or `key`)
    page: object  # sympy: tokens per item


@dataclass(frozen=True)
class Estimate:
    """`estimate top(score, count) using KEY, VSUM` over the clusters of a `kmeans` partition (after a
    `read top(score, ...)` of the same score): the next `count` tokens' worth of clusters by score,
    each standing in the attention for its tokens as one pseudo-key, the key summary KEY, weighted
    by its size, with value VSUM / size (docs/design.md, "Cluster indices")."""

    select: Select
    item: str
    key: str  # the summary the pseudo-key is
    value_sum: str  # the summary of the values' sum


@dataclass(frozen=True)
class Partition:
    """`dim P = kmeans(k, size = n, segment = s, iterations = i)`: clusters of about n keys per KV
    head, formed over segments of s tokens (None: one segment), with i Lloyd iterations; its
    summaries `fn(k | v, within P)` (name -> (fn, source)) are what the cluster index keeps."""

    name: str
    size: object  # sympy
    segment: object  # sympy or None
    iterations: object  # sympy
    summaries: dict[str, tuple[str, str]]


KMEANS_ITERATIONS = 10  # Lloyd iterations of a `kmeans(...)` that names none (docs/language.md)


@dataclass(frozen=True)
class Choose:
    """`chosen = top(...)` into a shared selection (decode_before_attention): the tokens this layer
    chooses in this decode step, read by the layers after it (OmniKV's filter layers)."""

    shared: str
    select: Select


Stmt = Union[Assign, Accumulate, Keep, Read, Estimate, Choose]


@dataclass(frozen=True)
class HookIR:
    name: str
    where: object  # sympy condition or None
    stmts: tuple[Stmt, ...]
    line: int = 0

    @property
    def keeps(self) -> list[Keep]:
        return [s for s in self.stmts if isinstance(s, Keep)]

    @property
    def period(self) -> tuple[object, list] | None:
        """(n, guards) of a `where` that is `step % n == 0`, alone or with conditions that do not read
        `step` (`guards`: a parameter switching the hook on, `every > 0`); None for any other `where`."""
        if self.where is None:
            return None
        step = sp.Symbol("step")
        parts = list(self.where.args) if isinstance(self.where, sp.And) else [self.where]
        periods = [p for p in parts if isinstance(p, sp.Eq) and p.rhs == 0 and isinstance(p.lhs, sp.Mod)
                   and p.lhs.args[0] == step and step not in p.lhs.args[1].free_symbols]
        guards = [p for p in parts if p not in periods]
        if len(periods) != 1 or any(step in g.free_symbols for g in guards):
            return None
        return periods[0].lhs.args[1], guards

    @property
    def reads(self) -> list[Read]:
        return [s for s in self.stmts if isinstance(s, Read)]

    @property
    def estimates(self) -> list[Estimate]:
        return [s for s in self.stmts if isinstance(s, Estimate)]

    @property
    def chooses(self) -> list[Choose]:
        return [s for s in self.stmts if isinstance(s, Choose)]

    @property
    def batched(self) -> bool:
        """Runs once over a whole decode batch (a read, or a choice that a later layer reads)."""
        return bool(self.reads or self.chooses)


@dataclass(frozen=True)
class StateIR:
    name: str
    dims: tuple[str, ...]
    init: object  # sympy


@dataclass(frozen=True)
class ParamIR:
    name: str
    type: str
    default: object
    domain: object = None


@dataclass(frozen=True)
class InputIR:
    """`input NAME: [dims] from "FILE"`: a float32 tensor the engine loads from the model directory
    (else the shipped defaults for the embedded model; runtime/models/method_inputs.py)."""

    name: str
    dims: tuple[str, ...]
    file: str
    fallback: str | None = None  # `or zeros`: zeros where no file is found

    @classmethod
    def of(cls, decl: ast.Input) -> InputIR:
        return cls(decl.name.name, tuple(d.name for d in decl.shape.dims), decl.source.value,
                   None if decl.fallback is None else decl.fallback.name)


@dataclass(frozen=True)
class ReplayIR:
    """`replay PROMPT in chunks of CHUNK [then THEN + last OVERLAP] [over first SINK]`: the pass that
    re-reads the context after prefill (docs/language.md, "Replay"); counts as sympy over parameters."""

    prompt: str
    chunk: object
    then: str | None = None
    overlap: object = 0
    sink: object = 0


@dataclass
class MethodIR:
    name: str
    family: str
    path: str
    source_sha256: str
    params: list[ParamIR]
    values: dict[str, object]
    lets: dict[str, str]  # name -> formula text (documentation and the manifest)
    states: list[StateIR] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)  # storage formats, carried as text for later
    shared: list[str] = field(default_factory=list)  # shared selections (chosen in a step, read by later layers)
    hooks: list[HookIR] = field(default_factory=list)
    inputs: list[InputIR] = field(default_factory=list)
    roles: dict[str, Value] = field(default_factory=dict)  # role -> a bool mask over (some of) layer, kv_head
    partitions: dict[str, Partition] = field(default_factory=dict)  # the `kmeans` partitions a read ranks
    spans: dict[str, tuple[str, ...]] = field(default_factory=dict)  # text partitions: name -> strings ending a span
    replay: ReplayIR | None = None
    checked: object = field(default=None, repr=False, compare=False)  # the CheckedMethod (compiler/kv_spec.py reads it)

    def hook(self, name: str) -> HookIR | None:
        return next((h for h in self.hooks if h.name == name), None)


# ---- building ------------------------------------------------------------------------------

_REDUCERS = {"sum", "mean", "max", "min"}
_UNARY = {"abs", "exp", "log", "sqrt"}
_BINOPS = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
_COMPARISONS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}


class _Builder:
    def __init__(self, checked) -> None:
        self.checked = checked
        self.lets = checked.lets
        self.env: dict[str, Value] = {}
        self.partitions: dict[str, Partition] = {}
        self.spans: dict[str, tuple[str, ...]] = {}

    def sym(self, expr: ast.Expr):
        return to_sympy(expr, self.lets)

    def dims(self, expr: ast.Expr) -> tuple[str, ...]:
        if not isinstance(expr.ty, Tensor):
            raise NotLowerable(f"expected a tensor, got {expr.ty}", expr.pos)
        return tuple(expr.ty.dims)

    def value(self, e: ast.Expr) -> Value:
        if isinstance(e, ast.Name) and e.id in self.env:
            return self.env[e.id]
        if isinstance(e.ty, ScalarType) and not any(isinstance(n, ast.Name) and n.id in self.env for n in ast.walk(e)):
            try:  # a number inside a tensor expression: sympy, like counts
                return Scalar((), self.sym(e))
            except NotSymbolic as err:
                raise NotLowerable(f"cannot lower the number: {err}", e.pos) from None
        if isinstance(e, ast.Name):
            if e.id in ("q", "k", "v", "attn"):
                return Input(self.dims(e), e.id, "hook")
            binding = self.checked.bindings.get(e.id)
            if binding is not None and binding.kind in ("state", "summary", "input"):
                return Input(self.dims(e), e.id, binding.kind)
            if isinstance(e.ty, Tensor):
                raise NotLowerable(f"cannot lower the tensor '{e.id}' ({binding.kind if binding else '?'})", e.pos)
            return Scalar((), self.sym(e))
        if isinstance(e, ast.Number):
            return Scalar((), self.sym(e))
        if isinstance(e, ast.Subscript) and isinstance(e.index, ast.Range):
            src = self.value(e.value)
            axis = e.along.name if e.along else next(d for d in src.dims if d in ("query", "key"))
            return Window(src.dims, src, e.index.kind, self.sym(e.index.count), axis)
        if isinstance(e, ast.UnaryOp) and e.op == "-":
            return Elementwise(self.dims(e), "neg", (self.value(e.operand),))
        if isinstance(e, ast.BinOp) and e.op in _BINOPS and isinstance(e.ty, Tensor):
            return Elementwise(self.dims(e), _BINOPS[e.op], (self.value(e.left), self.value(e.right)))
        if isinstance(e, ast.Compare) and e.op in _COMPARISONS and isinstance(e.ty, Tensor):
            return Elementwise(self.dims(e), _COMPARISONS[e.op], (self.value(e.left), self.value(e.right)))
        if isinstance(e, ast.Call):
            return self.call(e)
        raise NotLowerable(f"cannot lower {type(e).__name__} expressions yet", e.pos)

    def call(self, e: ast.Call) -> Value:
        name = e.func.name
        if name in ("attention", "logits"):
            return Attention(self.dims(e), self.value(e.args[0]), self.value(e.args[1]), name == "attention")
        if name in _REDUCERS and len(e.args) == 1 and e.clause("over"):
            axes = tuple(d.name for d in e.clause("over").dims)
            return Reduce(self.dims(e), self.value(e.args[0]), name, axes)
        if name in _REDUCERS and len(e.args) == 1 and e.clause("within"):
            partition = e.clause("within").dims[0].name
            if partition not in self.spans:
                raise NotLowerable(f"`{name}(x, within {partition})` is lowered over the spans of a "
                                   "`split(key, at = [...])` partition (pages and clusters are summarised)", e.pos)
            return SpanReduce(self.dims(e), self.value(e.args[0]), name, partition)
        if name == "duplicated":
            return Duplicated(self.dims(e), self.value(e.args[0]), self.sym(e.args[1]), e.clause("along").dims[0].name)
        if name in ("max", "min") and len(e.args) == 2 and isinstance(e.ty, Tensor):
            return Elementwise(self.dims(e), name, (self.value(e.args[0]), self.value(e.args[1])))
        if name == "pool":
            mode_expr = e.args[1]
            mode = mode_expr.id if mode_expr.id in ("avg", "max") else f"param:{mode_expr.id}"
            axis = e.clause("along").dims[0].name
            return Pool(self.dims(e), self.value(e.args[0]), mode, self.sym(e.args[2]), axis)
        if name == "quantile":
            return Quantile(self.dims(e), self.value(e.args[0]), self.sym(e.args[1]),
                            tuple(d.name for d in e.clause("over").dims))
        if name == "norm":
            return Norm(self.dims(e), self.value(e.args[0]), tuple(d.name for d in e.clause("over").dims))
        if name == "softmax":
            return Softmax(self.dims(e), self.value(e.args[0]), e.clause("over").dims[0].name)
        if name == "redundancy":
            return Redundancy(self.dims(e), self.value(e.args[0]), self.sym(e.args[1]), e.clause("along").dims[0].name)
        if name in _UNARY:
            return Elementwise(self.dims(e), name, (self.value(e.args[0]),))
        raise NotLowerable(f"cannot lower `{name}(...)` yet", e.pos)

    def selection(self, e: ast.Expr, items: tuple[str, ...] = ("key",)) -> Select:
        parts: list[ast.Expr] = []

        def flatten(x: ast.Expr) -> None:
            if isinstance(x, ast.BinOp) and x.op == "+" and isinstance(x.ty, Selection):
                flatten(x.left)
                flatten(x.right)
            else:
                parts.append(x)

        flatten(e)
        top, first, last, shared = None, None, None, None
        for p in parts:
            if isinstance(p, ast.Range):
                count = self.sym(p.count)
                if p.kind == "first":
                    first = count if first is None else first + count
                else:
                    last = count if last is None else last + count  # `last a + last b` would be max; rare
            elif isinstance(p, ast.Call) and p.func.name == "top" and top is None:
                top = self.top(p, items)
            elif isinstance(p, ast.Name) and self._is_shared(p.id) and shared is None:
                shared = p.id
            else:
                raise NotLowerable("only `top(...)`, `first n` and `last n` selections are lowered yet", p.pos)
        return Select(top, first, last, shared)

    def _is_shared(self, name: str) -> bool:
        binding = self.checked.bindings.get(name)
        return binding is not None and binding.kind == "shared"

    def top(self, e: ast.Call, items: tuple[str, ...] = ("key",)) -> TopK:
        ty: Selection = e.ty
        if ty.item not in items:
            raise NotLowerable("selections over partitions (pages, spans, clusters) are not lowered yet", e.pos)
        if ty.item in self.spans:  # whole spans of a text partition, up to `count` tokens per KV head
            if ty.per != ("kv_head",) or ty.across or e.kwarg("at_least") is not None:
                raise NotLowerable("a top over spans is lowered `per kv_head` only", e.pos)
            return TopK(self.value(e.args[0]), self.sym(e.args[1]), "spans", within=ty.item)
        if ty.across == ("kv_head",):
            granularity = "head_adaptive"
        elif ty.across:
            granularity = "global"
        elif ty.per == ("kv_head",):
            granularity = "kv_head"
        elif not ty.per:
            granularity = "layer"
        else:
            raise NotLowerable(f"top per {', '.join(ty.per)} is not lowered yet", e.pos)
        at_least = e.kwarg("at_least")
        return TopK(self.value(e.args[0]), self.sym(e.args[1]), granularity,
                    None if at_least is None else self.sym(at_least))

    def read(self, s: ast.Read) -> Read:
        """A read over the pages the method summarises: the engine's pages (the KV spec checks that
        they hold `size` tokens), so a plan can name them by their index in the page table."""
        ty = s.selection.ty
        item = getattr(ty, "item", "key")
        if item == "key":
            select = self.selection(s.selection)
            if select.top is not None or select.shared is None:
                raise NotLowerable("`read` of single tokens is lowered for a shared selection plus ranges only "
                                   "(`read chosen + last n`; a ranked read goes over pages of a `split` partition)",
                                   s.pos)
            return Read(select, item, 1)
        if item in self.partitions:
            return Read(self.selection(s.selection, (item,)), item, self.partitions[item].size)
        if item not in self._summarised():
            raise NotLowerable(f"`read` over {item}, which no `summary ... within {item}` of a `split(key, size = n)` "
                               "partition describes, is not lowered yet", s.pos)
        size = self.checked.axes[item].decl.value.kwarg("size")
        return Read(self.selection(s.selection, (item,)), item, self.sym(size))

    def estimate(self, s: ast.Estimate) -> Estimate:
        """An estimate over the clusters of a `kmeans` partition, using two of its summaries."""
        item = getattr(s.selection.ty, "item", "key")
        if item not in self.partitions:
            raise NotLowerable("`estimate` is lowered over the clusters of a `kmeans` partition only", s.pos)
        names = []
        for arg in (s.keys, s.values):
            if not (isinstance(arg, ast.Name) and arg.id in self.partitions[item].summaries):
                raise NotLowerable(f"an estimate uses two summaries of {item} by name (`using centroid, value_sum`)",
                                   arg.pos)
            names.append(arg.id)
        key, value_sum = names
        if self.partitions[item].summaries[value_sum] != ("sum", "v"):
            raise NotLowerable(f"an estimate's values are the clusters' value sums: `summary {value_sum} = "
                               f"sum(v, within {item})`", s.values.pos)
        if self.partitions[item].summaries[key][1] != "k":
            raise NotLowerable(f"an estimate's pseudo-keys summarise the keys: `summary {key} = mean(k, within "
                               f"{item})`", s.keys.pos)
        select = self.selection(s.selection, (item,))
        if select.top is None or select.first is not None or select.last is not None:
            raise NotLowerable("an estimate is one `top(score, count)`", s.pos)
        return Estimate(select, item, key, value_sum)

    def span_partitions(self) -> dict[str, tuple[str, ...]]:
        """Every `dim P = split(key, at = [...])`: the strings that end a span (docs/language.md)."""
        out = {}
        for decl in self.checked.method.items:
            call = getattr(decl, "value", None)
            if isinstance(decl, ast.DimDecl) and isinstance(call, ast.Call) and call.func.name == "split":
                at = call.kwarg("at")
                if at is not None:
                    out[decl.name.name] = tuple(item.value for item in at.items)
        return out

    def kmeans_partitions(self) -> dict[str, Partition]:
        """Every `dim P = kmeans(k, ...)` whose summaries are plain reductions of k or v within P."""
        out: dict[str, Partition] = {}
        for decl in self.checked.method.items:
            call = getattr(decl, "value", None)
            if isinstance(decl, ast.DimDecl) and isinstance(call, ast.Call) and call.func.name == "kmeans":
                segment, iterations = call.kwarg("segment"), call.kwarg("iterations")
                out[decl.name.name] = Partition(
                    decl.name.name, self.sym(call.kwarg("size")), None if segment is None else self.sym(segment),
                    KMEANS_ITERATIONS if iterations is None else self.sym(iterations), {})
        for decl in self.checked.method.items:
            e = decl.value if isinstance(decl, ast.Summary) else None
            within = e.clause("within") if isinstance(e, ast.Call) else None
            if within is None or len(within.dims) != 1 or within.dims[0].name not in out:
                continue
            if not (len(e.args) == 1 and isinstance(e.args[0], ast.Name) and e.args[0].id in ("k", "v")
                    and e.func.name in _REDUCERS):
                raise NotLowerable(f"a summary of {within.dims[0].name} is sum/mean/max/min of k or v", decl.pos)
            out[within.dims[0].name].summaries[decl.name.name] = (e.func.name, e.args[0].id)
        return out

    def _summarised(self) -> set[str]:
        """The `split` partitions the method's summaries are over (the engine's pages)."""
        out = set()
        for decl in self.checked.method.items:
            within = decl.value.clause("within") if isinstance(decl, ast.Summary) and isinstance(
                decl.value, ast.Call) else None
            axis = self.checked.axes.get(within.dims[0].name) if within is not None and within.dims else None
            split = getattr(getattr(axis, "decl", None), "value", None)
            if isinstance(split, ast.Call) and split.func.name == "split" and split.kwarg("size") is not None:
                out.add(axis.name)
        return out

    def hook(self, h: ast.Hook) -> HookIR:
        self.env = {}
        stmts: list[Stmt] = []
        for s in h.body:
            if isinstance(s, ast.Assign):
                if s.target.index is not None:
                    raise NotLowerable("writes to shared state are not lowered yet", s.pos)
                name = s.target.name.name
                if self._is_shared(name):
                    if not isinstance(s.value.ty, Selection):
                        raise NotLowerable("a shared value other than a selection is not lowered yet", s.pos)
                    stmts.append(Choose(name, self.selection(s.value)))
                    continue
                value = self.value(s.value)
                if self.checked.bindings.get(name) is not None and self.checked.bindings[name].kind == "state":
                    raise NotLowerable("state assignment is not lowered yet (only `+=`)", s.pos)
                self.env[name] = value
                stmts.append(Assign(name, value))
            elif isinstance(s, ast.Accumulate):
                state = self.checked.bindings[s.target.name.name].type
                stmts.append(Accumulate(s.target.name.name, self.value(s.value), tuple(state.dims)))
            elif isinstance(s, ast.Keep):
                stmts.append(Keep(self.selection(s.selection, ("key", *self.spans)), s.role.name if s.role else None))
            elif isinstance(s, ast.Read):
                stmts.append(self.read(s))
            elif isinstance(s, ast.Estimate):
                stmts.append(self.estimate(s))
            else:
                raise NotLowerable(f"`{type(s).__name__.lower()}` statements are not lowered yet", s.pos)
        where = None if h.where is None else self.sym(h.where)
        return HookIR(h.name.name, where, tuple(stmts), h.pos.line)


def _param_type(info) -> str:
    return str(info.type)


def build(checked, source: bytes | None = None) -> MethodIR:
    """The IR of a checked method. Raises `NotLowerable` for what this compiler cannot lower yet."""
    path = Path(checked.path)
    data = source if source is not None else path.read_bytes()
    method = MethodIR(
        name=checked.name,
        family=checked.family,
        path=_display_path(path),
        source_sha256=hashlib.sha256(data).hexdigest(),
        params=[ParamIR(n, _param_type(p), checked.values[n], p.domain) for n, p in checked.params.items()],
        values=dict(checked.values),
        lets={n: _formula(e, checked.lets) for n, e in checked.lets.items()},
        checked=checked,
    )
    for decl in checked.method.items:
        if isinstance(decl, ast.Store):
            method.stores.append(f"store {', '.join(t.name for t in decl.targets)}")
        if isinstance(decl, ast.State):
            if decl.shared:
                if not isinstance(checked.bindings[decl.name.name].type, Selection):
                    raise NotLowerable("shared state other than a selection is not lowered yet", decl.pos)
                method.shared.append(decl.name.name)
                continue
            init = to_sympy(decl.init, checked.lets) if decl.init is not None else 0
            method.states.append(StateIR(decl.name.name, tuple(d.name for d in decl.shape.dims), init))
        if isinstance(decl, ast.Input):
            method.inputs.append(InputIR.of(decl))
        if isinstance(decl, ast.Replay):
            method.replay = ReplayIR(
                decl.prompt.value, to_sympy(decl.chunk, checked.lets), None if decl.then is None else decl.then.value,
                0 if decl.overlap is None else to_sympy(decl.overlap, checked.lets),
                0 if decl.sink is None else to_sympy(decl.sink, checked.lets))
    if method.family not in LOWERED_FAMILIES:
        raise NotLowerable(f"the {method.family} family is not lowered yet (eviction, sparse reads and "
                           "quantization lower so far)")
    if method.family in ("quantization", "compression"):
        _lowerable_stores(checked)
    builder = _Builder(checked)
    method.partitions = builder.partitions = builder.kmeans_partitions()
    method.spans = builder.spans = builder.span_partitions()
    method.roles = {decl.name.name: builder.value(decl.value) for decl in checked.method.items
                    if isinstance(decl, ast.Role)}
    method.hooks = [builder.hook(h) for h in checked.hooks]
    return method


_QUANTIZERS = ("fp8", "quant", "lloyd_max")


def leads_with_offset(stages: list[str]) -> bool:
    """Is a store's first stage a key offset, `residual(x[layer])` before a quantizer (not DeltaKV's residual
    before `project`)? kv_spec.py maps it to `Quantized.offset`."""
    return stages[:1] == ["residual"] and len(stages) > 1 and stages[1] != "project"


def _lowerable_stores(checked) -> None:
    """A quantization or compression method lowers when every `store` is one quantizer (`fp8`,
    `quant` or `lloyd_max`), optionally after a key offset (`residual(x[layer])`) and a `rotate`, or
    one low-rank `project` of the whole stream, or DeltaKV's joint code of k and v, for every layer
    or for some (`where layer [not] in P`: the others store it dense): its store rotates (the kernels
    rotate queries and outputs, not the cache), quantizes (token by token, or a block at a time for
    groups over tokens) or projects, and attention decodes, from the KV spec alone. Its hooks lower
    as any family's do."""
    for decl in (d for d in checked.method.items if isinstance(d, ast.Store)):
        stages = [c.func.name for c in decl.codecs if isinstance(c, ast.Call)]
        if decl.also and stages == ["residual", "project"]:
            continue  # DeltaKV's joint code (its kv_spec says whether it maps)
        body = stages[1:] if leads_with_offset(stages) else stages  # its kv_spec says whether it maps
        body = body[1:] if body[:1] == ["rotate"] else body
        if body == ["project"] and decl.exempt is None:
            continue
        if len(body) != 1 or body[0] not in _QUANTIZERS:
            raise NotLowerable(f"store {decl.target.name} as {' then '.join(stages)}: one quantizer (fp8, quant or "
                               "lloyd_max), after at most a key offset and a rotate, or one project of every token is "
                               "lowered so far (QJL sketches, residuals against references and learned compressors "
                               "are not)", decl.pos)


def _formula(expr: ast.Expr, lets) -> str:
    from kvc.dsl.symbolic import NotSymbolic, formula

    try:
        return formula(expr, lets)
    except NotSymbolic as e:
        return f"<not symbolic: {e}>"


def _display_path(path: Path) -> str:
    """The .kvm path as written in generated files: relative to the repository for shipped ones."""
    from kvc.dsl import METHODS_DIR

    resolved = path.resolve()
    root = METHODS_DIR.parent
    try:
        return resolved.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()
