"""Semantic checker: a parsed method -> `CheckedMethod` (typed AST + tables), or every error in it.

Pipeline position: after `kvc.dsl.parser`, before `kvc.compiler`. It checks, in order:
1. the header (one, first, a known family, the file's name) and every declaration: duplicate and
   reserved names, parameter types, defaults and ranges, axis declarations and their sizes,
   state/input shapes, summaries, roles, storage formats, the replay pass;
2. every hook: that it exists, what it may read (`kvc.dsl.check_hooks`), the types and axes of its
   expressions (`kvc.dsl.check_exprs`, `kvc.dsl.check_calls`);
3. numbers that need parameter values: budgets must stay >= 0 at sample model shapes and context
   lengths, bit widths 1..8, pooling kernels odd, ...;
4. the parts a family needs (an eviction method keeps, a quantization method stores ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kvc.dsl import ast
from kvc.dsl.builtins import AXES, BUILTINS, FAMILIES, HOOK_VALUES, SYMBOLS, HookSpec
from kvc.dsl.check_exprs import AxisInfo, Binding, Ctx, ExprChecker
from kvc.dsl.check_hooks import check_hook
from kvc.dsl.check_params import ParamChecker, ParamInfo
from kvc.dsl.errors import DiagnosticSink, Pos
from kvc.dsl.evaluate import EvalError, evaluate, sample_points
from kvc.dsl.formatter import expr as source_of
from kvc.dsl.parser import KEYWORDS, ParsedFile
from kvc.dsl.types import BOOL, UNKNOWN, ListOf, PartitionOf, Scalar, Selection, Tensor, Type

STATIC = frozenset(s for s, spec in SYMBOLS.items() if spec.static)
ALL_SYMBOLS = frozenset(SYMBOLS)
# Pseudo-hooks for declarations that read this layer's keys/values (summaries, kmeans partitions).
_KV_DECL = HookSpec("a declaration", "layer", "", None, None, True, False, frozenset())
_QUANTIZERS = {"quant", "fp8", "lloyd_max", "qjl"}
_COMPRESSORS = {"project", "residual"}


@dataclass
class CheckedMethod:
    """A method that passed the checker: the annotated tree plus the tables the compiler needs."""

    path: str
    method: ast.Method
    params: dict[str, ParamInfo]
    values: dict[str, object]  # parameter values in force (defaults, then overrides)
    bindings: dict[str, Binding]
    axes: dict[str, AxisInfo]
    lets: dict[str, ast.Expr] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.method.name or ""

    @property
    def family(self) -> str:
        return self.method.family or ""

    @property
    def hooks(self) -> list[ast.Hook]:
        return self.method.hooks


class Checker:
    def __init__(self, parsed: ParsedFile, sink: DiagnosticSink, overrides: dict[str, object] | None = None) -> None:
        self.parsed, self.sink = parsed, sink
        self.overrides = dict(overrides or {})
        self.bindings: dict[str, Binding] = {}
        self.axes: dict[str, AxisInfo] = {n: AxisInfo(n, "builtin", order=o) for n, o in
                                          (("layer", 0), ("head", 1), ("kv_head", 2), ("query", 3), ("key", 4),
                                           ("channel", 6))}
        self.xc = ExprChecker(sink, self.bindings, self.axes, parsed.poisoned)
        self.pc = ParamChecker(self.xc, self.overrides)
        self.params: dict[str, ParamInfo] = self.pc.params
        self.values: dict[str, object] = self.pc.values
        self.lets: dict[str, ast.Expr] = {}
        self.counts: list = []

    # ---- driver ----------------------------------------------------------------------------

    def run(self) -> CheckedMethod:
        method = self.parsed.method
        for item in method.items:
            ident = getattr(item, "name", None)
            if isinstance(ident, ast.Ident) and not isinstance(item, (ast.Header, ast.Hook)):
                self.xc.declared.setdefault(ident.name, ident.pos)
        self.check_header(method)
        stores: dict[str, ast.Store] = {}
        replay: ast.Replay | None = None
        for item in method.items:
            if isinstance(item, ast.Header):
                continue
            if isinstance(item, ast.Hook):
                continue
            if isinstance(item, ast.Store):
                self.check_store(item, stores)
            elif isinstance(item, ast.Replay):
                if replay is not None:
                    self.xc.error(item, f"a method has one replay pass (the first is at line {replay.pos.line})")
                else:
                    replay = item
                    self.check_replay(item)
            else:
                self.check_named(item)
        self.pc.unknown_overrides(method.header or ast.Ident("", pos=Pos(1, 1)))
        seen: dict[tuple, ast.Hook] = {}
        for hook in method.hooks:
            key = (hook.name.name, repr(hook.where))
            if key in seen:
                self.xc.error(hook.name, f"duplicate hook `on {hook.name.name}` (first at line {seen[key].pos.line})",
                              "merge the two blocks, or give them different `where` conditions")
                continue
            seen[key] = hook
            check_hook(self.xc, hook, self.counts, replay is not None)
        self.check_numbers()
        if not self.parsed.broken:
            self.check_family(method, stores)
        return CheckedMethod(self.parsed.path, method, self.params, self.values, self.bindings, self.axes, self.lets)

    # ---- header ----------------------------------------------------------------------------

    def check_header(self, method: ast.Method) -> None:
        headers = method.of_type(ast.Header)
        if not headers:
            if not self._header_line_broken():
                self.sink.error(Pos(1, 1), "missing the method header", "start the file with `method NAME : FAMILY`")
            return
        first = headers[0]
        if method.items[0] is not first:
            self.xc.error(first, "the method header must come first")
        for extra in headers[1:]:
            self.xc.error(extra, f"a file describes one method (the header is at line {first.pos.line})")
        if first.family.name not in FAMILIES:
            self.xc.error(first.family, f"unknown family '{first.family.name}'",
                          self.xc.suggest(first.family.name, FAMILIES) or f"families are: {', '.join(FAMILIES)}")
        name = first.name.name
        if name in KEYWORDS:
            self.xc.error(first.name, f"'{name}' is a reserved word")
        stem = Path(self.parsed.path).name
        if stem.endswith(".kvm") and stem[:-4] != name:
            self.xc.error(first.name, f"method '{name}' is in a file named '{stem}'",
                          f"rename the file to {name}.kvm or the method to {stem[:-4]}")

    def _header_line_broken(self) -> bool:
        """A header line exists but failed to parse (its error is already reported)."""
        return self.parsed.broken and any(re.match(r"method\b", line) for line in self.parsed.text.split("\n"))

    # ---- named declarations ----------------------------------------------------------------

    def declare(self, ident: ast.Ident, kind: str, type_: Type, decl: ast.Decl, **extra) -> Binding | None:
        name = ident.name
        if name in KEYWORDS:
            self.xc.error(ident, f"'{name}' is a reserved word; pick another name")
            return None
        if name in AXES or name == "group" or name in SYMBOLS or name in HOOK_VALUES or name in BUILTINS:
            what = ("an axis" if name in AXES or name == "group" else "a symbol" if name in SYMBOLS
                    else "a hook value" if name in HOOK_VALUES else "a function")
            self.xc.error(ident, f"'{name}' is built in ({what}); pick another name")
            return None
        old = self.bindings.get(name)
        if old is not None:
            self.xc.error(ident, f"duplicate definition of '{name}' (first at {old.pos.line}:{old.pos.col})")
            return None
        b = Binding(kind, name, ident.pos, type_, decl, **extra)
        self.bindings[name] = b
        return b

    def check_named(self, d: ast.Decl) -> None:
        if isinstance(d, ast.Param):
            self.check_param(d)
        elif isinstance(d, ast.Let):
            self.check_let(d)
        elif isinstance(d, ast.DimDecl):
            self.check_dim(d)
        elif isinstance(d, ast.State):
            self.check_state(d)
        elif isinstance(d, ast.Input):
            self.check_input(d)
        elif isinstance(d, ast.Summary):
            self.check_summary(d)
        elif isinstance(d, ast.Role):
            self.check_role(d)

    def check_param(self, p: ast.Param) -> None:
        t, info, value = self.pc.check(p)
        if self.declare(p.name, "param", t, p) and info is not None:
            self.params[p.name.name] = info
            if value is not None:
                self.values[p.name.name] = value

    # other declarations

    def check_let(self, d: ast.Let) -> None:
        ctx = Ctx("in a definition", frozenset({"param", "let"}), ALL_SYMBOLS, calls=frozenset({"scalar", "value"}))
        t = self.xc.check(d.value, ctx)
        if t is not UNKNOWN and not isinstance(t, (Scalar, ListOf)):
            self.xc.error(d.value, f"a definition names a number, not {t}", "tensor values belong in hooks")
            t = UNKNOWN
        deps: set[str] = set()
        for node in ast.walk(d.value):
            if isinstance(node, ast.Name):
                if node.id in SYMBOLS:
                    deps.add(node.id)
                elif node.id in self.bindings and self.bindings[node.id].kind == "let":
                    deps |= self.bindings[node.id].deps
        if self.declare(d.name, "let", t, d, deps=frozenset(deps)):
            self.lets[d.name.name] = d.value

    def static_ctx(self, where: str, **kw) -> Ctx:
        return Ctx(where, frozenset({"param"}), STATIC, **kw)

    def check_dim(self, d: ast.DimDecl) -> None:
        name = d.name.name
        if isinstance(d.value, ast.Call) and d.value.func.name in ("split", "kmeans"):
            ctx = Ctx(f"in the axis {name}", frozenset({"param"}), STATIC, _KV_DECL, calls=frozenset({"partition"}))
            t = self.xc.check(d.value, ctx)
            if self.declare(d.name, "dim", t, d) and isinstance(t, PartitionOf):
                order = 5 + 0.01 * (1 + sum(a.kind == "partition" for a in self.axes.values()))
                self.axes[name] = AxisInfo(name, "partition", t.per, order, d)
            return
        ctx = self.static_ctx(f"in the size of axis {name}", calls=frozenset({"scalar"}))
        t = self.xc.check(d.value, ctx)
        if t is not UNKNOWN and not (isinstance(t, Scalar) and t.kind == "int"):
            self.xc.error(d.value, f"the size of axis {name} must be a whole number, not {t}",
                          "use // or round(...) to get a whole number")
            t = UNKNOWN
        if t is not UNKNOWN:
            self.counts.append((d.value, ctx, f"the size of axis {name}"))
        if self.declare(d.name, "dim", t, d):
            order = 7 + 0.01 * (1 + sum(a.kind == "sized" for a in self.axes.values()))
            self.axes[name] = AxisInfo(name, "sized", (), order, d)

    def shape_type(self, shape: ast.Shape, what: str, allow_layer: bool, allow_selection: bool) -> Type:
        dims = []
        for ident in shape.dims:
            info = self.xc.axis(ident)
            if info is None:
                return UNKNOWN
            if ident.name in dims:
                self.xc.error(ident, f"axis {ident.name} appears twice")
                return UNKNOWN
            if ident.name == "query":
                self.xc.error(ident, f"{what} cannot have the query axis: queries do not outlive their hook")
                return UNKNOWN
            if ident.name == "layer" and not allow_layer:
                self.xc.error(ident, f"{what} is already one per layer; drop the layer axis",
                              "use `shared` for one value that every layer sees")
                return UNKNOWN
            dims.append(ident.name)
        if shape.kind is None:
            return Tensor(self.xc.sort_dims(dims))
        if shape.kind.name != "selection" or not allow_selection:
            self.xc.error(shape.kind, f"unknown kind '{shape.kind.name}'" if shape.kind.name != "selection"
                          else f"{what} cannot be a selection", "write [axes] for a tensor or selection[axes]")
            return UNKNOWN
        items = [d for d in dims if d == "key" or self.axes[d].kind == "partition"]
        if len(items) != 1:
            self.xc.error(shape, "a selection is over key (or one partition), e.g. selection[kv_head, key]")
            return UNKNOWN
        return Selection(items[0], self.xc.sort_dims(d for d in dims if d != items[0]))

    def check_state(self, d: ast.State) -> None:
        what = "shared state" if d.shared else "a state"
        t = self.shape_type(d.shape, what, allow_layer=d.shared, allow_selection=True)
        if d.init is not None:
            it = self.xc.check(d.init, self.static_ctx("in a state's initial value"))
            if isinstance(t, Selection):
                self.xc.error(d.init, "a selection state starts empty (all tokens); drop the initial value")
            elif it is not UNKNOWN and not (isinstance(it, Scalar) and it.numeric):
                self.xc.error(d.init, f"a state starts from a number, not {it}")
        self.declare(d.name, "shared" if d.shared else "state", t, d)

    def check_input(self, d: ast.Input) -> None:
        t = self.shape_type(d.shape, "an input", allow_layer=True, allow_selection=False)
        if not d.source.value.strip():
            self.xc.error(d.source, "name the safetensors file the input is loaded from")
        if d.fallback is not None and d.fallback.name != "zeros":
            self.xc.error(d.fallback, f"an input's fallback is `or zeros` (its value where no file is found), "
                                      f"not `or {d.fallback.name}`")
        self.declare(d.name, "input", t, d)

    def check_summary(self, d: ast.Summary) -> None:
        ctx = Ctx("in a summary", frozenset({"param", "input"}), STATIC | {"layer"}, _KV_DECL)
        t = self.xc.check(d.value, ctx)
        if t is not UNKNOWN:
            if not isinstance(t, Tensor):
                self.xc.error(d.value, f"a summary is a tensor, not {t}")
                t = UNKNOWN
            elif "key" in t.dims or not any(self.axes[x].kind == "partition" for x in t.dims):
                self.xc.error(d.value, f"a summary reduces keys within a partition, e.g. max(k, within pages); got {t}")
                t = UNKNOWN
        self.declare(d.name, "summary", t, d)

    def check_role(self, d: ast.Role) -> None:
        ctx = Ctx("in a role", frozenset({"param", "input"}), STATIC)
        t = self.xc.check(d.value, ctx)
        if t is not UNKNOWN:
            if not (isinstance(t, Tensor) and t.dtype == "bool" and set(t.dims) <= {"layer", "kv_head"} and t.dims):
                self.xc.error(d.value, f"a role is a mask over layer and kv_head (a comparison), not {t}")
                t = UNKNOWN
        self.declare(d.name, "role", t, d)

    def check_store(self, d: ast.Store, stores: dict[str, ast.Store]) -> None:
        for ident in d.targets:
            if ident.name not in ("k", "v"):
                self.xc.error(ident, f"store names what it encodes: k or v, not '{ident.name}'")
            elif ident.name in stores:
                self.xc.error(ident, f"{ident.name} already has a storage format (line {stores[ident.name].pos.line})")
            else:
                stores[ident.name] = d
        target = ", ".join(t.name for t in d.targets)
        ctx = Ctx(f"in store {target}", frozenset({"param", "input", "summary"}), STATIC | {"layer"},
                  calls=frozenset({"codec"}), counts=self.counts)
        names = []
        for i, codec in enumerate(d.codecs):
            if not isinstance(codec, ast.Call):
                self.xc.error(codec, "a storage format is a call such as quant(2, group = 32, along key)")
                continue
            self.xc.check(codec, ctx)
            names.append(codec.func.name)
            if codec.func.name == "qjl" and i == 0:
                self.xc.error(codec, "qjl encodes the error of a previous stage; "
                                     "put it after one (... then qjl(1, along channel))")
            if codec.func.name in ("residual", "rotate") and i == len(d.codecs) - 1:
                self.xc.error(codec, f"{codec.func.name}(...) must be followed by the stage that encodes its output")
        if d.also and names != ["residual", "project"]:
            self.xc.error(d.also[0], "k and v are stored together only as one code: `store k, v as "
                                     "residual(nearest(...)) then project(down[layer], up[layer], ...)`")
        if d.exempt is not None:
            t = self.xc.check(d.exempt, ctx)
            if t is not UNKNOWN and not (isinstance(t, Selection) and t.ranges):
                self.xc.error(d.exempt, "`except` takes token ranges: first n, last n, or both joined with +")
        if d.where is not None:
            wctx = Ctx(f"in a `where` of store {target}", frozenset({"param", "let"}), STATIC | {"layer"},
                       calls=frozenset({"scalar", "value"}))
            t = self.xc.check(d.where, wctx)
            if t is not UNKNOWN and t != BOOL:
                self.xc.error(d.where, f"`where` needs a condition on the layer (a bool), not {t}")

    def check_replay(self, d: ast.Replay) -> None:
        if not d.prompt.value.strip():
            self.xc.error(d.prompt, "the replay prompt is empty",
                          'e.g. replay "Repeat the previous context:" in chunks of 2048')
        ctx = Ctx("in replay", frozenset({"param"}), STATIC, counts=self.counts)
        self.xc.count(d.chunk, ctx, "the replay chunk")
        self.xc.numeric_checks.append(("positive", d.chunk, ctx, "the replay chunk"))
        if d.then is not None and not d.then.value.strip():
            self.xc.error(d.then, "the later chunks' replay prompt is empty")
        for e, what in ((d.overlap, "the previous chunk's tokens after `then`"), (d.sink, "the sink keys")):
            if e is not None:
                self.xc.count(e, ctx, what)

    # ---- numbers that need parameter values ------------------------------------------------

    def symbols_of(self, expr: ast.Expr) -> set[str]:
        out: set[str] = set()
        for node in ast.walk(expr):
            if isinstance(node, ast.Name):
                if node.id in SYMBOLS:
                    out.add(node.id)
                elif node.id in self.bindings and self.bindings[node.id].kind == "let":
                    out |= set(self.bindings[node.id].deps)
        return out

    def check_numbers(self) -> None:
        for expr, ctx, what in self.counts:
            if expr.ty is UNKNOWN:
                continue
            used = self.symbols_of(expr)
            for point in sample_points(used):
                try:
                    v = evaluate(expr, {**self.values, **point}, self.lets)
                except EvalError:
                    break
                if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                    shown = used | ({"layers"} if "layer" in used else set())
                    at = ", ".join(f"{s}={point[s]}" for s in sorted(shown) if s in point)
                    self.xc.error(expr, f"{what} is negative: {_fmt(v)} tokens" + (f" at {at}" if at else "") +
                                  " with the default parameters",
                                  "a budget must stay 0 or more for every layer and context length")
                    break
        point = sample_points(set())[0]
        for kind, expr, ctx, what in self.xc.numeric_checks:
            expr, of = expr if isinstance(expr, tuple) else (expr, None)  # ("multiple", (x, of)): x a multiple of `of`
            if expr.ty is UNKNOWN or (of is not None and of.ty is UNKNOWN):
                continue
            try:
                v = evaluate(expr, {**self.values, **point}, self.lets)
                w = None if of is None else evaluate(of, {**self.values, **point}, self.lets)
            except EvalError:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            problem = {
                "multiple": isinstance(w, int) and w > 0 and v % w != 0 and
                f"{what} ({_fmt(v)}) must be a multiple of {_named(source_of(of), w)}: whole clusters per segment",
                "odd": v % 2 != 1 and f"{what} must be odd (the window is centred), not {_fmt(v)}",
                "bits": not 1 <= v <= 8 and f"{what} must be 1 to 8 bits, not {_fmt(v)}",
                "unit": not 0 <= v <= 1 and f"{what} must be between 0 and 1, not {_fmt(v)}",
                "cosine": not -1 <= v <= 1 and f"{what} is a cosine similarity, between -1 and 1, not {_fmt(v)}",
                "positive": v <= 0 and f"{what} must be positive, not {_fmt(v)}",
            }[kind]
            if problem:
                self.xc.error(expr, problem)

    # ---- the parts a family needs ----------------------------------------------------------

    def check_family(self, method: ast.Method, stores: dict[str, ast.Store]) -> None:
        header = method.header
        if header is None or header.family.name not in FAMILIES:
            return
        family = header.family.name
        verbs = [s for h in method.hooks for s in h.body if isinstance(s, (ast.Keep, ast.Read, ast.Estimate))]
        codecs = {c.func.name for s in stores.values() for c in s.codecs if isinstance(c, ast.Call)}
        if family == "full":
            for s in verbs:
                self.xc.error(s, f"a full method keeps and reads every token; `{type(s).__name__.lower()}` "
                                 "belongs to an eviction or sparse method")
            for s in stores.values():
                self.xc.error(s, "a full method stores K/V as they are; `store` belongs to a quantization or "
                                 "compression method")
            return
        need = {
            "eviction": (any(isinstance(s, ast.Keep) for s in verbs), "an eviction method needs a `keep` in a hook",
                         "e.g. on prefill_end:\n        keep top(score, budget, per kv_head) + last window"),
            "sparse": (any(isinstance(s, (ast.Read, ast.Keep)) for s in verbs),
                       "a sparse method needs a `read` (or a per-role `keep`) in a hook",
                       "e.g. on decode_before_attention:\n        read top(score, budget, per kv_head)"),
            "quantization": (bool(codecs & _QUANTIZERS), "a quantization method needs a `store` with quant, fp8, "
                             "lloyd_max or qjl", "e.g. store k as quant(2, group = 32, along key)"),
            "compression": (bool(codecs & _COMPRESSORS), "a compression method needs a `store` with project or "
                            "residual", "e.g. store k as project(k_down[layer], k_up[layer])"),
        }[family]
        if not need[0]:
            self.xc.error(header.family, need[1], need[2])


def _named(text: str, v: object) -> str:
    """`text (value)`, or the value alone when the text is that number."""
    return _fmt(v) if text == _fmt(v) else f"{text} ({_fmt(v)})"


def _fmt(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


__all__ = ["CheckedMethod", "Checker", "ParamInfo"]
