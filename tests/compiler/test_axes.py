"""Axes combine by name: random well-typed score expressions give the same values in the generated
torch lowering, in the named-axis reference evaluator (tests/compiler/named_axes.py, no kvc
code) and, for the scores the fusion plan turns into a kernel, in the generated Triton wrapper
(TRITON_INTERPRET=1 on the CPU).

The expressions are built here, with their own axis bookkeeping: hook inputs q [head, query,
channel], k/v [kv_head, key, channel], attn [head, query, key], a state [kv_head, key] and
attention(q, k); elementwise operations with numbers and with each other (reduced tensors against
full ones, `kv_head` against `head`), reductions over named axes and `group`, norms, pooling,
ranges of the key and query axes. Sizes are drawn small and often equal to each other, so a
lowering that pairs axes by position either fails or, worse, computes something else.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvc.compiler import codegen, fusion, ir
from kvc.dsl import check_source
from tests.compiler import named_axes as ref

Env = dict
HEADER = """method prop : eviction
param budget: tokens = 3 in [1, 1048576]
param alpha: float = 0.75
state seen: [kv_head, key] = 0
"""


# ---- expressions with their own axis bookkeeping ----------------------------------------------


@dataclass(frozen=True)
class Expr:
    src: str
    axes: frozenset[str]
    ev: Callable[[Env], ref.Named]
    ranges: tuple = ()  # sorted ((axis, (range text, ...)), ...): which entries of an axis it holds

    def range_of(self, axis: str) -> tuple:
        return dict(self.ranges).get(axis, ())


def _merged(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
    axes = a | b
    return axes - {"kv_head"} if "head" in axes else axes


def _combinable(a: Expr, b: Expr) -> bool:
    """The language's rule: shared axes must hold the same entries (ranges only on query and key here)."""
    return all(a.range_of(axis) == b.range_of(axis) for axis in a.axes & b.axes)


def _ranges(*exprs: Expr, drop=()) -> tuple:
    table = {}
    for e in exprs:
        table.update(dict(e.ranges))
    return tuple(sorted((a, r) for a, r in table.items() if a not in drop))


def leaf(name: str) -> Expr:
    axes = {"q": ("head", "query", "channel"), "k": ("kv_head", "key", "channel"),
            "v": ("kv_head", "key", "channel"), "attn": ("head", "query", "key"), "seen": ("kv_head", "key")}
    if name == "attention":
        return Expr("attention(q, k)", frozenset({"head", "query", "key"}),
                    lambda env: ref.attention(env["q"], env["k"], env["group"]))
    return Expr(name, frozenset(axes[name]), lambda env: env[name])


LEAVES = ["q", "k", "v", "attn", "seen", "attention"]
SCALARS = {"alpha": lambda env: 0.75, "2": lambda env: 2.0, "0.5": lambda env: 0.5}
BINARY = {"+": np.add, "-": np.subtract, "*": np.multiply}


@st.composite
def tensor_expr(draw, depth: int = 3) -> Expr:
    if depth == 0 or draw(st.integers(0, 4)) == 0:
        return leaf(draw(st.sampled_from(LEAVES)))
    kind = draw(st.sampled_from(["binary", "binary", "binary", "scalar", "unary", "reduce", "reduce", "norm",
                                 "range", "pool", "extreme", "divide"]))
    x = draw(tensor_expr(depth - 1))
    group = "group"
    if kind in ("binary", "extreme", "divide"):
        y = draw(tensor_expr(depth - 1))
        if not _combinable(x, y):
            return x
        axes, ranges = _merged(x.axes, y.axes), _ranges(x, y)
        if kind == "binary":
            op = draw(st.sampled_from(sorted(BINARY)))
            fn = BINARY[op]
            return Expr(f"({x.src} {op} {y.src})", axes, lambda env: ref.elementwise(fn, x.ev(env), y.ev(env),
                                                                                     env["group"]), ranges)
        if kind == "divide":  # a denominator kept away from zero
            return Expr(f"({x.src} / (abs({y.src}) + 1))", axes, lambda env: ref.elementwise(
                np.divide, x.ev(env), ref.unary(lambda a: np.abs(a) + 1, y.ev(env)), env["group"]), ranges)
        fn_name = draw(st.sampled_from(["max", "min"]))
        fn = np.maximum if fn_name == "max" else np.minimum
        return Expr(f"{fn_name}({x.src}, {y.src})", axes,
                    lambda env: ref.elementwise(fn, x.ev(env), y.ev(env), env["group"]), ranges)
    if kind == "scalar":
        number = draw(st.sampled_from(sorted(SCALARS)))
        value = SCALARS[number]
        form = draw(st.sampled_from(["{x} * {n}", "{n} - {x}", "{x} / {n}", "{x} + {n}", "max({x}, {n})",
                                     "min({n}, {x})"]))
        fns = {"{x} * {n}": lambda a, n: a * n, "{n} - {x}": lambda a, n: n - a, "{x} / {n}": lambda a, n: a / n,
               "{x} + {n}": lambda a, n: a + n, "max({x}, {n})": np.maximum, "min({n}, {x})": np.minimum}
        fn = fns[form]
        src = form.format(x=x.src, n=number)
        return Expr(f"({src})" if not form.startswith(("max", "min")) else src, x.axes,
                    lambda env: ref.unary(lambda a: fn(a, value(env)), x.ev(env)), x.ranges)
    if kind == "unary":
        form = draw(st.sampled_from(["neg", "abs", "exp"]))
        src = {"neg": f"-{x.src}", "abs": f"abs({x.src})", "exp": f"exp(-abs({x.src}))"}[form]
        fn = {"neg": np.negative, "abs": np.abs, "exp": lambda a: np.exp(-np.abs(a))}[form]
        return Expr(src if form != "neg" else f"({src})", x.axes, lambda env: ref.unary(fn, x.ev(env)), x.ranges)
    axes = sorted(x.axes, key=ref.ORDER.index)
    if kind in ("reduce", "norm"):
        over = draw(st.lists(st.sampled_from(axes), min_size=1, max_size=len(axes), unique=True)) if axes else []
        if kind == "reduce" and "head" in x.axes and "head" not in over and draw(st.booleans()):
            over = [group] + over
        if not over:
            return x
        left = (x.axes - set(over)) | ({"kv_head"} if group in over else set())
        left -= {"head"} if group in over else set()
        ranges = _ranges(x, drop=set(over))
        if kind == "norm":
            return Expr(f"norm({x.src}, over {', '.join(over)})", frozenset(left),
                        lambda env: ref.norm(x.ev(env), tuple(over)), ranges)
        fn = draw(st.sampled_from(sorted(ref.REDUCERS)))
        return Expr(f"{fn}({x.src}, over {', '.join(over)})", frozenset(left),
                    lambda env: ref.reduce(x.ev(env), fn, tuple(over), env["group"]), ranges)
    if kind == "range":
        along = [a for a in ("key", "query") if a in x.axes]
        if not along:
            return x
        axis = draw(st.sampled_from(along))
        side = draw(st.sampled_from(["first", "last"]))
        counts = ["1", "2", "3"] + ([] if x.src == "q" else ["(context - 1)"])  # q's window is fixed up front
        count = draw(st.sampled_from(counts))
        text = f"{side} {count}"
        ranges = dict(x.ranges)
        ranges[axis] = ranges.get(axis, ()) + (text,)
        return Expr(f"{x.src}[{text} along {axis}]", x.axes,
                    lambda env: ref.take(x.ev(env), axis, side, eval(count, {}, {"context": env["context"]})),
                    tuple(sorted(ranges.items())))
    if kind == "pool":
        axis = draw(st.sampled_from(axes)) if axes else None
        if axis is None:
            return x
        mode, kernel = draw(st.sampled_from(["avg", "max"])), draw(st.sampled_from([1, 3, 5]))
        return Expr(f"pool({x.src}, {mode}, {kernel}, along {axis})", x.axes,
                    lambda env: ref.pool(x.ev(env), mode, kernel, axis), x.ranges)
    return x


def as_score(x: Expr) -> Expr:
    """x turned into a ranking score over [kv_head, key] or [key]: given a key axis if it has none,
    reduced over everything else, query heads folded into their KV head."""
    if "key" not in x.axes:
        x = _times_key_means(x)
    extra = tuple(sorted(x.axes - {"kv_head", "head", "key"}, key=ref.ORDER.index))
    if extra:
        x = _summed(x, extra)
    return _folded(x) if "head" in x.axes else x


def _times_key_means(x: Expr) -> Expr:
    keys = leaf("k")
    return Expr(f"({x.src} * mean(k, over channel))", _merged(x.axes, frozenset({"kv_head", "key"})),
                lambda env: ref.elementwise(np.multiply, x.ev(env), ref.reduce(keys.ev(env), "mean", ("channel",), 1),
                                            env["group"]), x.ranges)


def _summed(x: Expr, over: tuple[str, ...]) -> Expr:
    return Expr(f"sum({x.src}, over {', '.join(over)})", x.axes - set(over),
                lambda env: ref.reduce(x.ev(env), "sum", over, 1), _ranges(x, drop=set(over)))


def _folded(x: Expr) -> Expr:
    return Expr(f"mean({x.src}, over group)", (x.axes - {"head"}) | {"kv_head"},
                lambda env: ref.reduce(x.ev(env), "mean", ("group",), env["group"]), x.ranges)


@dataclass
class Case:
    score: Expr
    acc: Expr | None
    acc_first: bool  # `seen += ...` before the score is defined (else after: the score reads the old seen)
    sizes: dict = field(default_factory=dict)

    def source(self) -> str:
        lines = [f"  score = {self.score.src}"]
        if self.acc is not None:
            acc = f"  seen += {self.acc.src}"
            lines = [acc] + lines if self.acc_first else lines + [acc]
        per = ", per kv_head" if "kv_head" in self.score.axes else ""
        return HEADER + "on prefill_chunk:\n" + "\n".join(lines) + f"\n  keep top(score, budget{per})\n"


@st.composite
def cases(draw) -> Case:
    score = as_score(draw(tensor_expr()))
    acc = as_score(draw(tensor_expr(2))) if draw(st.booleans()) else None
    if acc is not None and (acc.axes != {"kv_head", "key"} or acc.ranges):
        acc = None  # a state holds every key of every KV head
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    queries = draw(st.integers(1, 4))
    sizes = {"kv_heads": kv_heads, "heads": kv_heads * group, "queries": queries,
             "keys": draw(st.integers(queries, queries + 4)), "channels": draw(st.integers(1, 5))}
    return Case(score, acc, draw(st.booleans()), sizes)


# ---- running the generated code -----------------------------------------------------------------


def compile_source(source: str, path: str = "prop.kvm") -> dict[str, str]:
    checked = check_source(source, path)
    return codegen.generate_ir(ir.build(checked, source=source.encode()))


def load(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(text, f"<generated {name}>", "exec"), module.__dict__)  # noqa: S102 -- our own generated code
    return module


def inputs_of(sizes: dict, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    h, kv, n, t, d = (sizes[s] for s in ("heads", "kv_heads", "queries", "keys", "channels"))
    return {"q": g.standard_normal((h, n, d)), "k": g.standard_normal((kv, t, d)),
            "v": g.standard_normal((kv, t, d)), "attn": g.random((h, n, t)), "seen": g.random((kv, t))}


def reference_scores(case: Case, arrays: dict[str, np.ndarray]) -> np.ndarray:
    sizes = case.sizes
    axes = {"q": ("head", "query", "channel"), "k": ("kv_head", "key", "channel"),
            "v": ("kv_head", "key", "channel"), "attn": ("head", "query", "key"), "seen": ("kv_head", "key")}
    env = {name: ref.named(a, axes[name]) for name, a in arrays.items()}
    env.update(group=sizes["heads"] // sizes["kv_heads"], context=sizes["keys"])
    after = dict(env)
    if case.acc is not None:
        after["seen"] = ref.elementwise(np.add, env["seen"], case.acc.ev(env), env["group"])
    score = case.score.ev(after if case.acc_first else env)
    return ref.ranking_scores(score, sizes["kv_heads"], sizes["keys"])


def lowered_scores(case: Case, arrays: dict[str, np.ndarray]) -> np.ndarray:
    lowering = load(compile_source(case.source())["torch_lowering.py"], "prop_lowering")
    tensors = {name: torch.tensor(a, dtype=torch.float32) for name, a in arrays.items()}
    sizes = case.sizes
    sym = {"context": sizes["keys"], "prompt": sizes["keys"], "step": 0, "layer": 0, "layers": 1,
           "heads": sizes["heads"], "kv_heads": sizes["kv_heads"], "head_dim": sizes["channels"]}
    state = {"seen": tensors.pop("seen")}
    scores = lowering.prefill_chunk_scores(tensors, state, sym, dict(lowering.DEFAULTS))
    return scores.double().numpy()


def assert_same_scores(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{what}: scored keys differ\n{got}\n{want}"
    finite = np.isfinite(want)
    scale = 1.0 + np.abs(want[finite]).max(initial=0.0)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-4, atol=1e-4 * scale, err_msg=what)


def check_case(case: Case, seed: int = 0) -> None:
    arrays = inputs_of(case.sizes, seed)
    try:
        want = reference_scores(case, arrays)
    except ref.EmptyRange:
        assume(False)  # a range with no entries (e.g. `last (context - 1)` of one key): nothing to compare
    assert_same_scores(lowered_scores(case, arrays), want, f"{case.sizes}\n{case.source()}")


PROPERTY = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@PROPERTY
@given(cases())
def test_lowering_matches_the_named_axis_reference(case: Case) -> None:
    check_case(case)


@pytest.fixture
def asked_for(request) -> None:
    """Long property runs only when selected by marker (`pytest -m slow tests/compiler/test_axes.py`)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a long property run: select it with -m slow")


LONG = settings(PROPERTY, max_examples=3000, derandomize=False,
                suppress_health_check=[*PROPERTY.suppress_health_check, HealthCheck.function_scoped_fixture])


@pytest.mark.slow
@LONG
@given(case=cases())
def test_lowering_matches_the_named_axis_reference_long(asked_for, case: Case) -> None:
    check_case(case)


# ---- the fusable family: the Triton wrapper against the torch lowering and the reference ----------


@dataclass(frozen=True)
class Family:
    """An observation-window score the fusion plan may turn into one `attention_columns` kernel."""

    window: int
    sliced: bool  # [first (context - window) along key]
    query_reduce: str  # sum | mean
    pooling: str  # none | avg | max
    kernel: int
    heads: str  # group (mean over group) | all (mean over head and query)
    order: tuple[str, ...]  # how `over head, query` is written
    post: str  # "" or an elementwise tail the kernel does not compute
    near: str = ""  # a near miss the kernel does not compute: "slice" (one key fewer), "q" or "k" (scaled)

    @property
    def fusable(self) -> bool:
        return not self.post and not self.near

    def source(self) -> str:
        q = "(q * 2)[last window]" if self.near == "q" else "q[last window]"
        k = "k * 2" if self.near == "k" else "k"
        kept = "context - window - 1" if self.near == "slice" else "context - window"
        obs = f"attention({q}, {k})" + (f"[first ({kept}) along key]" if self.sliced else "")
        if self.heads == "all":
            score = f"mean({obs}, over {', '.join(self.order)})"
        else:
            votes = f"{self.query_reduce}(obs, over query)"
            if self.pooling != "none":
                votes = f"pool({votes}, {self.pooling}, {self.kernel}, along key)"
            score = f"mean({votes}, over group)"
        if self.post:
            score = self.post.format(score=score, keys="k" + (f"[first ({kept}) along key]" if self.sliced else ""))
        per = ", per kv_head" if self.heads == "group" else ""
        return (f"method fam : eviction\nparam budget: tokens = 4 in [1, 1048576]\n"
                f"param window: tokens = {self.window} in [1, 64]\non prefill_end:\n  obs = {obs}\n"
                f"  score = {score}\n  keep top(score, budget{per}) + last window\n")

    def reference(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        group = q.shape[0] // k.shape[0]
        length = k.shape[1]
        window = ref.clamp(self.window, q.shape[1])
        kept = length - self.window - (self.near == "slice")
        queries = ref.named(q * (2 if self.near == "q" else 1), ("head", "query", "channel"))
        keys = ref.named(k * (2 if self.near == "k" else 1), ("kv_head", "key", "channel"))
        obs = ref.attention(ref.take(queries, "query", "last", window), keys, group)
        if self.sliced:
            obs = ref.take(obs, "key", "first", kept)
        if self.heads == "all":
            score = ref.reduce(obs, "mean", self.order, group)
        else:
            votes = ref.reduce(obs, self.query_reduce, ("query",), group)
            if self.pooling != "none":
                votes = ref.pool(votes, self.pooling, self.kernel, "key")
            score = ref.reduce(votes, "mean", ("group",), group)
        if self.post:
            keys = ref.named(k, ("kv_head", "key", "channel"))
            if self.sliced:
                keys = ref.take(keys, "key", "first", kept)
            score = POSTS[self.post](score, keys, group)
        return ref.ranking_scores(score, k.shape[0], length)


POSTS = {
    "-{score}": lambda s, keys, g: ref.unary(np.negative, s),
    "{score} * 2 + 1": lambda s, keys, g: ref.unary(lambda a: a * 2 + 1, s),
    "{score} - norm({keys}, over channel)": lambda s, keys, g: ref.elementwise(
        np.subtract, s, ref.norm(keys, ("channel",)), g),
    "{score} * mean({keys}, over kv_head, channel)": lambda s, keys, g: ref.elementwise(
        np.multiply, s, ref.reduce(keys, "mean", ("kv_head", "channel"), g), g),
}


@st.composite
def families(draw) -> Family:
    heads = draw(st.sampled_from(["group", "group", "all"]))
    pooling = draw(st.sampled_from(["none", "avg", "max"])) if heads == "group" else "none"
    sliced = draw(st.booleans())
    variant = draw(st.sampled_from(["fused", "fused", "post", "near"]))  # the last two must not fuse
    post = draw(st.sampled_from(sorted(p for p in POSTS if heads == "group" or "norm(" not in p))) \
        if variant == "post" else ""
    near = draw(st.sampled_from(["q", "k"] + (["slice"] if sliced else []))) if variant == "near" else ""
    return Family(window=draw(st.integers(1, 6)), sliced=sliced, near=near,
                  query_reduce=draw(st.sampled_from(["sum", "mean"])) if heads == "group" else "mean",
                  pooling=pooling, kernel=draw(st.sampled_from([1, 3, 5])) if pooling != "none" else 1,
                  heads=heads, order=tuple(draw(st.permutations(["head", "query"]))), post=post)


def check_family(family: Family, length: int, seed: int, triton: bool) -> None:
    source = family.source()
    checked = check_source(source, "fam.kvm")
    method = ir.build(checked, source=source.encode())
    kernels = fusion.plan(method).kernels
    assert bool(kernels) == family.fusable, f"fused {kernels} for\n{source}"
    files = codegen.generate_ir(method)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(4, length, 16, generator=g), torch.randn(2, length, 16, generator=g)
    want = family.reference(q.double().numpy(), k.double().numpy())
    lowering = load(files["torch_lowering.py"], "fam_lowering")
    got = lowering.score(q, k)
    assert_same_scores(got.double().numpy(), want, f"torch lowering of\n{source}")
    if triton and kernels:
        pytest.importorskip("triton")
        wrappers = load(files["triton_kernels.py"], "fam_triton")
        fused = getattr(wrappers, kernels[0].name)(q, k, None)
        assert_same_scores(fused.double().numpy(), want, f"triton kernel of\n{source}")


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(families(), st.integers(7, 20), st.integers(0, 1000))
def test_fused_scores_match_the_lowering_and_the_reference(family: Family, length: int, seed: int) -> None:
    check_family(family, length, seed, triton=True)


@pytest.mark.slow
@settings(LONG, max_examples=400)
@given(family=families(), length=st.integers(7, 40), seed=st.integers(0, 1000))
def test_fused_scores_match_the_lowering_and_the_reference_long(asked_for, family: Family, length: int,
                                                               seed: int) -> None:
    check_family(family, length, seed, triton=True)


def test_keydiff_on_one_kv_head_with_as_many_keys_as_channels() -> None:
    """Sizes that let a position-aligned lowering run: [kv_head, key, channel] / [kv_head, key] with
    one KV head and keys == channels broadcasts key against channel instead of failing."""
    src = ("method keydiff : eviction\nparam budget: tokens = 4 in [1, 1048576]\non prefill_end:\n"
           "  kn = k / norm(k, over channel)\n  anchor = mean(kn, over key)\n"
           "  keep top(-sum(kn * anchor, over channel), budget, per kv_head)\n")
    lowering = load(compile_source(src, "keydiff.kvm")["torch_lowering.py"], "keydiff_lowering")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 16, 16, generator=g)
    kn = k / k.norm(dim=-1, keepdim=True)
    want = -(kn * kn.mean(dim=1, keepdim=True)).sum(-1)
    torch.testing.assert_close(lowering.score(torch.randn(4, 16, 16, generator=g), k), want)
