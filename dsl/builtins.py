"""What the .kvm language knows before reading a file: families, axes, symbols, hooks, functions.

Pipeline position: tables read by `kvc.dsl.checker` (to type and check a method) and meant for
`kvc.compiler` (to lower it) and the docs. Adding a hook, a symbol or a built-in starts here.

Every table entry has a one-line doc; docs/language.md is written from the same facts.
"""

from __future__ import annotations

from dataclasses import dataclass

FAMILIES = {
    "full": "no compression: every token is kept and read (the baseline)",
    "eviction": "drops tokens from the cache for good (`keep`)",
    "sparse": "keeps the cache but reads part of it each step (`read`), or drops per-head (`keep ... for`)",
    "quantization": "stores K/V in fewer bits (`store ... as quant/fp8/lloyd_max`)",
    "compression": "stores a denser representation of K/V (`store ... as project/residual`)",
}


@dataclass(frozen=True)
class AxisSpec:
    name: str
    size: str  # a symbol or sympy-parsable expression
    doc: str


AXES = {
    "layer": AxisSpec("layer", "layers", "transformer layers (only in per-request values and `shared` state)"),
    "head": AxisSpec("head", "heads", "attention (query) heads"),
    "kv_head": AxisSpec("kv_head", "kv_heads", "key/value heads; `heads / kv_heads` query heads share one"),
    "query": AxisSpec("query", "queries",
                      "the hook's queries: a prefill chunk, a replayed chunk, or a window q[last n]"),
    "key": AxisSpec("key", "context", "the cached tokens of this layer, oldest first"),
    "channel": AxisSpec("channel", "head_dim", "components of one head's query/key/value vector"),
}
# `group` is not an axis of any value: reducing `over group` folds the query heads that share a KV
# head, turning `head` into `kv_head` (GQA).
GROUP = "group"
# Canonical order of axes inside a value's type (declared partitions sit after `key`, declared
# sized axes after `channel`).
AXIS_ORDER = ["layer", "head", "kv_head", "query", "key", "<partition>", "channel", "<sized>"]


@dataclass(frozen=True)
class SymbolSpec:
    name: str
    unit: str  # 'tokens' or 'int'
    doc: str
    static: bool  # known when the engine starts (model shape); usable in axis sizes


SYMBOLS = {
    "context": SymbolSpec("context", "tokens", "tokens in the sequence now (prompt + generated)", False),
    "prompt": SymbolSpec("prompt", "tokens", "tokens of the prompt of this turn", False),
    "step": SymbolSpec("step", "int", "decode steps taken in this turn (1 at the first generated token)", False),
    "layer": SymbolSpec("layer", "int", "index of the layer a hook runs for (0-based)", False),
    "layers": SymbolSpec("layers", "int", "number of transformer layers", True),
    "heads": SymbolSpec("heads", "int", "attention heads per layer", True),
    "kv_heads": SymbolSpec("kv_heads", "int", "key/value heads per layer", True),
    "head_dim": SymbolSpec("head_dim", "int", "channels per head", True),
}


@dataclass(frozen=True)
class HookSpec:
    name: str
    scope: str  # 'layer' (runs once per layer) or 'request' (once per request, sees every layer)
    when: str
    q: str | None  # 'chunk', 'decode', 'window' (only as q[last n]) or None
    attn: str | None  # 'chunk', 'decode' or None
    kv: bool
    step: bool
    verbs: frozenset[str]
    replay: bool = False


def _hook(name, scope, when, q, attn, kv, step, verbs, replay=False):
    return HookSpec(name, scope, when, q, attn, kv, step, frozenset(verbs), replay)


HOOKS = {
    h.name: h
    for h in [
        _hook("prefill_chunk", "layer", "after a prefill chunk's K/V are written", "chunk", "chunk",
              True, False, {"keep"}),
        _hook("prefill_end", "layer", "after the last prefill chunk", "window", None, True, False, {"keep"}),
        _hook("replay_chunk", "layer", "after a chunk of the `replay` pass (its K/V are then dropped)",
              "chunk", "chunk", True, False, set(), replay=True),
        _hook("replay_end", "request", "after the whole `replay` pass, once for all layers", None, None,
              False, False, {"keep"}, replay=True),
        _hook("decode_before_attention", "layer", "before a decode step's attention", "decode", None, True, True,
              {"read", "estimate"}),
        _hook("decode_after_attention", "layer", "after a decode step's attention", "decode", "decode", True, True,
              {"keep"}),
        _hook("step_end", "layer", "between decode steps", "window", None, True, True, {"keep"}),
        _hook("turn_end", "layer", "when a turn ends (before the chain cache snapshots the session)", None, None,
              True, False, {"keep"}),
        _hook("turn_resume", "layer", "when a session resumes (after the chain cache restores it)", None, None,
              True, False, set()),
    ]
}

HOOK_VALUES = {
    "q": "queries of this layer: [head, query, channel] in prefill/replay chunks, [head, channel] at decode; "
         "elsewhere only a window q[last n]",
    "k": "cached keys of this layer (RoPE applied): [kv_head, key, channel]",
    "v": "cached values of this layer: [kv_head, key, channel]",
    "attn": "attention probabilities of this step: [head, query, key] for a chunk, [head, key] at decode",
}


@dataclass(frozen=True)
class BuiltinSpec:
    name: str
    kind: str  # 'value', 'scalar', 'select', 'partition', 'codec'
    signature: str
    doc: str


def _b(name, kind, signature, doc):
    return BuiltinSpec(name, kind, signature, doc)


BUILTINS = {
    b.name: b
    for b in [
        _b("attention", "value", "attention(q, k)", "softmax(q·k/sqrt(head_dim)) over keys, causally masked"),
        _b("logits", "value", "logits(q, k)", "q·k/sqrt(head_dim), causally masked (-inf)"),
        _b("softmax", "value", "softmax(x, over D)", "softmax along one axis"),
        _b("sum", "value", "sum(x, over D...) | sum(x, within P)", "sum over axes, or within each item of a partition"),
        _b("mean", "value", "mean(x, over D...) | mean(x, within P)", "mean over axes, or within each partition item"),
        _b("max", "value", "max(x, over D...) | max(x, within P) | max(a, b) | max(list)", "maximum"),
        _b("min", "value", "min(x, over D...) | min(x, within P) | min(a, b) | min(list)", "minimum"),
        _b("quantile", "value", "quantile(x, p, over D...)", "the p-quantile over axes"),
        _b("norm", "value", "norm(x, over D)", "L2 norm over an axis"),
        _b("pool", "value", "pool(x, avg|max, kernel, along D)",
           "1-D pooling, stride 1, centred (odd kernel), zero padded"),
        _b("cumsum", "value", "cumsum(x, along D)", "running sum along an axis"),
        _b("redundancy", "value", "redundancy(x, threshold, along D)",
           "R-KV redundancy: mean cosine similarity of each item to the others along D (the newest near-copy, "
           "cos > threshold, not counted), softmaxed along D; drops `channel`"),
        _b("duplicated", "value", "duplicated(x, threshold, along D)",
           "1 where a later item along D has cosine similarity > threshold, else 0; drops `channel`"),
        _b("abs", "value", "abs(x)", "absolute value"),
        _b("exp", "value", "exp(x)", "e^x"),
        _b("log", "value", "log(x)", "natural logarithm"),
        _b("sqrt", "value", "sqrt(x)", "square root"),
        _b("floor", "scalar", "floor(n)", "round a number down"),
        _b("ceil", "scalar", "ceil(n)", "round a number up"),
        _b("round", "scalar", "round(n)", "round a number to the nearest integer (halves up)"),
        _b("top", "select", "top(score, n, at_least = m, per D... | across D...)",
           "the n best-scored tokens (or whole pages/clusters/spans, up to n tokens); `per D` selects for each "
           "index of D on its own, `across D` pools D (head-adaptive budgets), `at_least` guarantees m each"),
        _b("split", "partition", "split(key, size = n) | split(key, at = [\"...\", ...])",
           "cut the key axis into pages of n tokens, or into spans ending at delimiter tokens"),
        _b("kmeans", "partition", "kmeans(k, size = n, segment = s, iterations = i)",
           "cluster each KV head's keys, n tokens per cluster on average, segment by segment"),
        _b("quant", "codec", "quant(bits, mode = asymmetric|symmetric, group = g, along D...)",
           "integer quantization; elements along D (in groups of g) share a scale (and zero point)"),
        _b("fp8", "codec", "fp8(e4m3|e5m2, scale = unit|dynamic, along D...)",
           "FP8 with one scale per group of elements along D: 1.0, or set from the first stored chunk"),
        _b("rotate", "codec", "rotate(hadamard|random, along channel)", "an orthogonal rotation before quantizing"),
        _b("lloyd_max", "codec", "lloyd_max(bits, along channel)",
           "per-coordinate Lloyd-Max codebook for rotated unit vectors (norm kept separately)"),
        _b("qjl", "codec", "qjl(bits, along channel)",
           "a 1-bit quantized Johnson-Lindenstrauss sketch of the previous stage's error"),
        _b("project", "codec", "project(down, up, group = g, bias = b, prerope = true|false)",
           "store x·down (a low-rank latent), read back latent·up (+ b); `group` KV heads share one latent"),
        _b("residual", "codec", "residual(ref)",
           "subtract a per-item reference (a cluster centroid, or nearest(...)) before the next stage"),
        _b("nearest", "reference", "nearest(every = n, count = m)",
           "a token's reference: the mean of its m nearest centers (squared L2 over what the store encodes), "
           "centers being the first tokens kept raw and every n-th token of each compressed block"),
    ]
}

ENUMS = {
    "pool.mode": ("avg", "max"),
    "quant.mode": ("asymmetric", "symmetric"),
    "fp8.format": ("e4m3", "e5m2"),
    "fp8.scale": ("unit", "dynamic"),
    "rotate.kind": ("hadamard", "random"),
}

# Words a declaration may not use as its name (besides the keywords): they already mean something.
RESERVED = set(AXES) | {GROUP} | set(SYMBOLS) | set(HOOK_VALUES) | set(BUILTINS)
