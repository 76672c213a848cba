"""KV spec pass: every tensor a method stores, derived from its .kvm declarations.

Pipeline position: after `hook_facts` (it reads `key_local` and `keeps`), before `codegen`, which
writes the result as `manifest.json["kv_spec"]` for every method, lowered or not, and, for lowered
methods, as the generated `kv_spec(num_kv_heads, head_dim, dtype, page_size, params)` of hooks.py
(`emit_python`), which builds a `kvc.runtime.kv.spec.KVSpec` (runtime/kv/spec.py). The compiler
itself never imports the runtime: this module describes the spec as data and prints the code.

What maps to what (docs/compiler.md, "The KV spec"; the runtime's rules: docs/design.md, "KV memory"):
- K or V without a `store`: a dense TOKEN tensor `k` / `v` [head_dim] in the model dtype;
- `store k as quant(bits, mode = m, group = g, along channel|key) except last n`: `Quantized`
  codes `k_codes` (TOKEN, uint8: `int4x2` / `int2x4` packing for 4 / 2 bits; symmetric 8-bit
  codes int8), scale `k_scale` and, asymmetric, zero point `k_zero` in the model dtype: TOKEN
  [head_dim / g] along channel (`axis="channel"`), PAGE [max(1, page_size // g), head_dim] along
  key (`axis="token"`); `except last n`: a SEQ residual `k_resid` [n, head_dim] in the model dtype;
- `store k as lloyd_max(bits, along channel)`: `Quantized` codebook codes (`codebook="sphere"`):
  `k_codes` (TOKEN, uint8 packed `int2x4` / `int3x8` / `int4x2`) and one scale `k_scale` per token
  (TOKEN [1], the RMS, model dtype); a leading `rotate(random|hadamard, along channel)` before it (or
  before `quant` / `fp8`) names the operand's `rotation`. Integer and codebook codes read a prefill
  chunk as computed (`prefill_exact`), FP8 as stored;
- `store k as fp8(format, scale = unit|dynamic, along kv_head, key, channel)`: `Quantized` with
  float codes: `k_codes` (TOKEN, float8 of the format [head_dim]) and one scale `k_scale` per
  layer (LAYER [1], model dtype; `along key, channel`: one per layer and KV head);
- `summary x = max|min|sum|mean(k|v, within P)`, P = `split(key, size = n)`: a PAGE tensor `x`
  [head_dim] (max and min in the model dtype, exact; sum and mean float32) and a `Summary` (the
  engine's pages must hold n tokens: `page_tokens`);
- the states of a key-local `decode_after_attention` (hook fact `key_local`): one float32 TOKEN
  plane per state, in declaration order, then `decode_after_attention.scores` when it keeps
  (what `DecodeHooks` keeps in paged planes, runtime/methods_compiled_decode.py);
- a head-adaptive keep (`top(..., across kv_head)`): `head_starts`;
- a decode-time keep that may evict in place (equal counts per KV head, an order-free decode state,
  codes that move slot by slot): `slot.position`, one int32 TOKEN tensor, each slot's logical
  position (`positions`; the engine's layout: docs/design.md, "Eviction in place").
The summaries of a `kmeans` partition that a lowered read ranks (hook fact `clusters`) are no spec
tensors: the engine's cluster index keeps them per sequence (runtime/compiled/cluster_index.py).
A shared selection that a lowered decode_before_attention chooses in every step stores nothing.
Anything else that stores data per token (QJL sketches, low-rank projections, clusters, other
shared state, state kept per sequence) is left out and named in `reasons` with its position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import sympy as sp

from kvc.compiler.ir import leads_with_offset
from kvc.dsl import ast
from kvc.dsl.formatter import expr as source_of
from kvc.dsl.symbolic import NotSymbolic, to_sympy
from kvc.dsl.types import Selection

HEAD_DIM = sp.Symbol("head_dim")
KV_HEADS = sp.Symbol("kv_heads")
PAGE_SIZE = sp.Symbol("page_size", positive=True, integer=True)  # the engine's; a parameter may share the name
MODEL = "model"  # dtype: the model's
FROM_BITS = "from bits"  # packing / dtype of codes whose bit width is a parameter: 8 none, 4 int4x2, 2 int2x4
FROM_FORMAT = "from format"  # dtype of FP8 codes: float8_e4m3fn or float8_e5m2, by the stage's format
FP8_AXES = {("channel", "key", "kv_head"): True, ("channel", "key"): False}  # sorted axes -> one scale for all heads
PACKINGS = {8: "", 4: "int4x2", 2: "int2x4"}
BOOK_PACKINGS = {4: "int4x2", 3: "int3x8", 2: "int2x4"}  # lloyd_max's codes: 8 3-bit codes in 3 bytes
SCORES_PLANE = "decode_after_attention.scores"
POSITIONS = "slot.position"  # each slot's logical position, where a decode-time keep evicts in place
REDUCERS = ("max", "min", "sum", "mean")
_UNFIT_STAGES = {
    "rotate": "a rotation leads the pipeline, before one quantizer",
    "lloyd_max": "codebook codes are the pipeline's one quantizer",
    "qjl": "a quantized Johnson-Lindenstrauss sketch of the previous stage's error",
    "project": "a low-rank projection (a latent per group of KV heads, read back through `up`)",
    "residual": "a residual against a per-item reference (cluster means)",
}


@dataclass(frozen=True)
class TensorDesc:
    name: str
    extent: str  # "token" | "page" | "seq" | "layer"
    dtype: str  # MODEL, "float32", "uint8", "int8", FROM_BITS or FROM_FORMAT
    shape: tuple = ()  # sympy over head_dim, page_size and parameters
    packing: str = ""  # "", "int4x2", "int2x4" or FROM_BITS
    state: bool = False  # a state plane (runtime/kv/spec.py `state_plane`)

    def to_json(self) -> dict:
        return {"name": self.name, "extent": self.extent, "dtype": self.dtype, "packing": self.packing,
                "shape": [_text(n) for n in self.shape]}


@dataclass(frozen=True)
class Dense:
    tensor: str

    @property
    def tensor_names(self) -> set[str]:
        return {self.tensor}

    def to_json(self) -> dict:
        return {"kind": "dense", "tensor": self.tensor}


@dataclass(frozen=True)
class Quantized:
    codes: str
    scale: str
    bits: object  # sympy
    group: object  # sympy
    axis: str  # "channel" | "token"
    zero: str | None = None
    residual: str | None = None
    residual_tokens: object = None  # sympy: the `except last n`; a residual of fewer than 1 token is left out
    # float codes (fp8): the format and the scaling, each a literal or a parameter's name (`Param`)
    format: object = None
    scaling: object = None
    shared_heads: bool = True
    codebook: str | None = None  # "sphere": lloyd_max's levels
    rotation: object = None  # "hadamard" | "random" | a Param: `rotate(...)` before the quantizer
    offset: str | None = None  # `residual(x[layer])` first: the LAYER tensor (input) subtracted from keys

    @property
    def tensor_names(self) -> set[str]:
        return {n for n in (self.codes, self.scale, self.zero, self.residual, self.offset) if n}

    def to_json(self) -> dict:
        data = {"kind": "quantized", "codes": self.codes, "scale": self.scale, "zero": self.zero,
                "bits": _text(self.bits), "group": _text(self.group), "axis": self.axis, "residual": self.residual}
        if self.codebook is not None:
            data["codebook"] = self.codebook
        if self.rotation is not None:
            data["rotation"] = str(self.rotation)
        if self.offset is not None:
            data["offset"] = self.offset
        data["prefill_exact"] = self.format is None  # a chunk reads itself as computed (runtime/kv/spec.py)
        if self.format is not None:
            data.update(format=str(self.format), scaling=str(self.scaling), shared_heads=self.shared_heads)
        if self.axis == "token":
            data["flush_block"] = _text(self.residual_tokens)
        return data


@dataclass(frozen=True)
class LowRank:
    """`project(down[layer], up[layer], group = g, prerope = p)`: a latent per group of KV heads."""

    latent: str
    down: str  # the LAYER tensors: the method's inputs of these names
    up: str
    group: object  # sympy: KV heads per group as written (the runtime takes its gcd with the model's)
    share: object  # sympy: latent channels each KV head stores (rank / group)
    prerope: bool = False

    @property
    def tensor_names(self) -> set[str]:
        return {self.latent, self.down, self.up}

    def to_json(self) -> dict:
        return {"kind": "low_rank", "latent": self.latent, "down": self.down, "up": self.up,
                "group": _text(self.group), "share": _text(self.share), "prerope": self.prerope}


DELTA_NEIGHBOURS, DELTA_CENTERS, DELTA_SINKS, DELTA_WINDOW = "kv_neighbours", "kv_centers", "kv_sinks", "kv_window"


@dataclass(frozen=True)
class Delta:
    """`store k, v as residual(nearest(every = n, count = m)) then project(down[layer], up[layer], group = g,
    bias = b[layer], prerope = p) except first s + last r where LAYERS` (DeltaKV): one code for a token's
    keys and values, relative to the mean of its m nearest centers (the first s tokens and every n-th
    token of each compressed block, kept raw); the newest tokens raw in a window (r, up to 2 r); only
    the layers LAYERS selects (`layers`: {"param": P, "member": bool} for `layer [not] in P`); the
    other layers store K and V dense (docs/design.md, "DeltaKV")."""

    latent: str
    down: str
    up: str
    bias: str | None
    group: object  # sympy: KV heads per code (written; the runtime takes its gcd with the model's)
    share: object  # sympy: code channels each KV head stores
    prerope: bool
    every: object  # sympy
    count: object  # sympy
    sink: object  # sympy
    recent: object  # sympy
    layers: dict

    @property
    def tensor_names(self) -> set[str]:
        """Every tensor the code stores (its fixed per-token, per-page and per-sequence ones too)."""
        return {self.latent, DELTA_NEIGHBOURS, DELTA_CENTERS, DELTA_SINKS, DELTA_WINDOW, self.down, self.up,
                self.bias} - {None}

    def to_json(self) -> dict:
        return {"kind": "delta", "latent": self.latent, "down": self.down, "up": self.up, "bias": self.bias,
                "group": _text(self.group), "share": _text(self.share), "prerope": self.prerope,
                "every": _text(self.every), "count": _text(self.count), "sink": _text(self.sink),
                "recent": _text(self.recent), "layers": self.layers}


@dataclass(frozen=True)
class Param:
    """A storage choice made by a parameter (its value is one of the enum's members)."""

    name: str

    def __str__(self) -> str:
        return f"param {self.name}"


@dataclass(frozen=True)
class Unmapped:
    """K or V stored in a format the spec cannot describe yet (the reason says why)."""

    store: str

    def to_json(self) -> dict:
        return {"kind": "unmapped", "store": self.store}


@dataclass(frozen=True)
class SummaryDesc:
    tensor: str
    source: str  # "k" | "v"
    fn: str

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "source": self.source, "fn": self.fn}


@dataclass
class SpecDesc:
    keys: Dense | Quantized | LowRank | Delta | Unmapped
    values: Dense | Quantized | LowRank | Delta | Unmapped
    tensors: list[TensorDesc] = field(default_factory=list)
    summaries: list[SummaryDesc] = field(default_factory=list)
    head_starts: bool = False
    positions: str | None = None  # the TOKEN tensor of each slot's logical position
    in_place: bool = False  # the decode-time keep evicts in place (slots out of time order)
    page_tokens: object = None  # sympy: tokens per page the summaries need, or None
    reasons: list[str] = field(default_factory=list)
    # operand ("k", "v") -> the layers its store applies to, `where layer [not] in P` ({"param", "member"});
    # an operand not named applies to every layer. Elsewhere it is stored dense (runtime StorageClasses).
    layers: dict[str, dict] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"tensors": [t.to_json() for t in self.tensors], "keys": self.keys.to_json(),
                "values": self.values.to_json(), "summaries": [s.to_json() for s in self.summaries],
                "head_starts": self.head_starts, "positions": self.positions,
                "in_place": self.in_place, "layers": self.layers,
                "page_tokens": None if self.page_tokens is None else _text(self.page_tokens),
                "reason": "; ".join(self.reasons) if self.reasons else None}


def _text(value) -> int | str:
    value = sp.sympify(value)
    return int(value) if value.is_Integer else sp.sstr(value)


# ---- derivation ----------------------------------------------------------------------------------


class _Deriver:
    def __init__(self, checked) -> None:
        self.checked = checked
        self.file = Path(checked.path).name
        self.params = set(checked.params)
        self.reasons: list[str] = []
        self.page_tokens = None  # pages of one group, where scales are per page (groups over tokens)
        self.inputs = {d.name.name: d for d in checked.method.items if isinstance(d, ast.Input)}
        self.where: dict[str, dict] = {}  # operand -> the layers its store applies to ({}: every one)

    def unfit(self, node: ast.Node, message: str) -> None:
        pos = node.pos
        self.reasons.append(f"{self.file}:{pos.line}:{pos.col}: {message}")

    def scalar(self, e: ast.Expr, node: ast.Node, what: str):
        """A size from the .kvm as sympy, or None (and a reason) where it is not one per method."""
        try:
            value = to_sympy(e, self.checked.lets)
        except NotSymbolic:
            self.unfit(node, f"{what} `{source_of(e)}` is not a formula of parameters")
            return None
        others = {str(s) for s in value.free_symbols} - self.params - {"head_dim", "kv_heads"}
        if others:
            self.unfit(node, f"{what} `{source_of(e)}` depends on {', '.join(sorted(others))}; a KV spec is one per "
                             "method and model (parameters, head_dim, kv_heads)")
            return None
        return value

    # -- K and V --------------------------------------------------------------------------------
    def operand(self, which: str, decl: ast.Store | None) -> tuple[Dense | Quantized | Unmapped, list[TensorDesc]]:
        if decl is None:
            return Dense(which), [TensorDesc(which, "token", MODEL, (HEAD_DIM,))]
        text = " then ".join(source_of(c) for c in decl.codecs)
        layers = self.layers(decl)
        if layers is None:
            return Unmapped(text), []
        self.where[which] = layers
        if decl.exempt is not None:
            text += f" except {source_of(decl.exempt)}"
        codecs = [c for c in decl.codecs if isinstance(c, ast.Call)]
        offset = None
        if leads_with_offset([c.func.name for c in codecs]):
            offset = self.offset(which, codecs[0])
            if offset is None:
                return Unmapped(text), []
            codecs = codecs[1:]
        rotation = None
        if len(codecs) == 2 and codecs[0].func.name == "rotate" and codecs[1].func.name in ("quant", "fp8",
                                                                                          "lloyd_max"):
            rotation = self.choice(codecs[0].args[0])  # the rotation's kind: the runtime's matrix of it
            codecs = codecs[1:]
            if decl.exempt is not None:
                self.unfit(decl, f"store {which} as {text}: a rotated operand keeps no residual window (its "
                                 "full-precision rows would be in the model's basis, its codes in the rotated one)")
                return Unmapped(text), []
        stages = [c.func.name for c in codecs]
        if stages == ["project"] and decl.exempt is None:
            mapped = self.project(which, codecs[0])
            return (Unmapped(text), []) if mapped is None else mapped
        if offset is not None and (stages not in (["quant"], ["lloyd_max"]) or decl.exempt is not None):
            self.unfit(decl, f"store {which} as {text}: an offset leads one integer or codebook quantizer (quant, "
                             "lloyd_max) and keeps no residual window")
            return Unmapped(text), []
        if stages in (["fp8"], ["lloyd_max"]):
            mapped = (self.fp8 if stages == ["fp8"] else self.lloyd_max)(which, decl, codecs[0])
            if mapped is None:
                return Unmapped(text), []
            return self.with_offset(dataclasses.replace(mapped[0], rotation=rotation), mapped[1], offset)
        if any(name != "quant" for name in stages):
            unfit = [c for c in codecs if c.func.name != "quant"]
            what = "; ".join(f"{c.func.name}: {_UNFIT_STAGES.get(c.func.name, 'not in the spec yet')}"
                             f"{_scale_sharing(c)}" for c in unfit)
            self.unfit(decl, f"store {which} as {text}: not in the KV spec yet ({what})")
            return Unmapped(text), []
        if len(stages) != 1:
            self.unfit(decl, f"store {which} as {text}: a pipeline of several stages is not in the KV spec yet")
            return Unmapped(text), []
        mapped = self.quant(which, decl, codecs[0])
        if mapped is None:
            return Unmapped(text), []
        return self.with_offset(dataclasses.replace(mapped[0], rotation=rotation), mapped[1], offset)

    def offset(self, which: str, call: ast.Call) -> str | None:
        """`residual(x[layer])` leading a key quantizer, x an input `[layer, kv_head, channel]`: the name
        of the LAYER tensor the keys are stored relative to (`Quantized.offset`), or None (a reason)."""
        arg = call.args[0] if call.args else None
        base = arg.value if isinstance(arg, ast.Subscript) else None
        decl = self.inputs.get(getattr(base, "id", None))
        if decl is None or [d.name for d in decl.shape.dims] != ["layer", "kv_head", "channel"]:
            self.unfit(call, f"store {which}: an offset `{source_of(call)}` is an input declared [layer, kv_head, "
                             "channel], indexed by layer")
            return None
        if which != "k":
            self.unfit(call, "store v: an offset is for keys (attention ignores a constant added to every key's "
                             "logit; values would need it added back to the output)")
            return None
        return base.id

    @staticmethod
    def with_offset(enc: Quantized, tensors: list[TensorDesc], offset: str | None):
        if offset is None:
            return enc, tensors
        return dataclasses.replace(enc, offset=offset), [*tensors, TensorDesc(offset, "layer", MODEL, (HEAD_DIM,))]

    def project(self, which: str, call: ast.Call):
        """`project(down[layer], up[layer], group = g, prerope = p)`: each KV head stores its share of
        its group's latent (TOKEN [rank / g]); down and up are LAYER tensors [head_dim, rank] named
        after the inputs they come from (runtime/kv/spec.py, `LowRank`)."""
        fails = len(self.reasons)
        names = []
        for arg in call.args[:2]:
            base = arg.value if isinstance(arg, ast.Subscript) else arg
            decl = self.inputs.get(getattr(base, "id", None))
            if decl is None or [d.name for d in decl.shape.dims][:2] != ["layer", "kv_head"]:
                self.unfit(call, f"store {which}: projection `{source_of(arg)}` is not an input declared "
                                 "[layer, kv_head, channel, LATENT] (indexed by layer)")
                continue
            names.append((base.id, decl))
        group_expr = call.kwarg("group")
        group = sp.Integer(1) if group_expr is None else self.scalar(group_expr, call, "the head group")
        prerope = call.kwarg("prerope")
        if len(self.reasons) > fails or group is None or len(names) != 2:
            return None
        latent_dim = [d.name for d in names[0][1].shape.dims][3]
        axis = self.checked.axes.get(latent_dim)
        rank = self.scalar(axis.decl.value, call, "the latent rank") if axis is not None and axis.decl else None
        if rank is None:
            self.unfit(call, f"store {which}: the latent axis `{latent_dim}` has no size (declare `dim {latent_dim} = "
                             "...`)")
            return None
        share = sp.simplify(rank / group)
        heads = sp.Symbol(f"{which}_group")  # the group the runtime takes (`_Emitter`): gcd(group, kv_heads)
        latent = f"{which}_latent"
        enc = LowRank(latent, names[0][0], names[1][0], group, share,
                      prerope=isinstance(prerope, ast.Bool) and prerope.value)
        tensors = [TensorDesc(latent, "token", MODEL, (share,)),
                   TensorDesc(names[0][0], "layer", MODEL, (HEAD_DIM, heads * share)),
                   TensorDesc(names[1][0], "layer", MODEL, (HEAD_DIM, heads * share))]
        return enc, tensors

    def delta(self, decl: ast.Store):
        """`store k, v as residual(nearest(...)) then project(...) except first s + last r where ...` (`Delta`):
        tensors `kv_latent` (TOKEN [code / group]), `kv_neighbours` (TOKEN int32 [ceil(count / kv_heads)]: the
        positions of a token's centers, shared out over its KV heads), `kv_centers` (PAGE [page_size / every, 2
        head_dim]: each center's keys before RoPE and values), `kv_sinks` and `kv_window` (SEQ [s, 2 head_dim], [2 r,
        2 head_dim]: raw tokens), and the projections (LAYER [2 head_dim, code], K's rows then V's) and bias (LAYER [2
        head_dim])."""
        fails = len(self.reasons)
        text = f"store k, v as {' then '.join(source_of(c) for c in decl.codecs)}"
        residual, project = decl.codecs
        near = residual.args[0] if isinstance(residual, ast.Call) and residual.args else None
        if not (isinstance(near, ast.Call) and near.func.name == "nearest"):
            self.unfit(decl, f"{text}: a joint code is relative to `nearest(every = n, count = m)` centers")
            return Unmapped(text), []
        every = self.scalar(near.kwarg("every"), near, "the center stride")
        count = self.scalar(near.kwarg("count"), near, "the neighbours")
        mapped = self.project("kv", project)
        sink = recent = sp.Integer(0)
        for part in _ranges(decl.exempt):
            value = self.scalar(part.count, part, "the raw tokens")
            if part.kind == "first":
                sink = value
            else:
                recent = value
        layers = self.layers(decl)
        if len(self.reasons) > fails or mapped is None or every is None or count is None or layers is None:
            return Unmapped(text), []
        low, tensors = mapped
        bias = project.kwarg("bias")
        bias_name = (bias.value if isinstance(bias, ast.Subscript) else bias).id if bias is not None else None
        enc = Delta(low.latent, low.down, low.up, bias_name, low.group, low.share, low.prerope, every, count, sink,
                    recent, layers)
        width = 2 * HEAD_DIM
        group = sp.Symbol("kv_group")
        tensors = [tensors[0], TensorDesc(DELTA_NEIGHBOURS, "token", "int32", (sp.ceiling(count / KV_HEADS),)),
                   TensorDesc(DELTA_CENTERS, "page", MODEL, (PAGE_SIZE / every, width)),
                   TensorDesc(DELTA_SINKS, "seq", MODEL, (sink, width)),
                   TensorDesc(DELTA_WINDOW, "seq", MODEL, (2 * recent, width)),
                   TensorDesc(low.down, "layer", MODEL, (width, group * low.share)),
                   TensorDesc(low.up, "layer", MODEL, (width, group * low.share))]
        if bias_name is not None:
            tensors.append(TensorDesc(bias_name, "layer", MODEL, (width,)))
        return enc, tensors

    def layers(self, decl: ast.Store) -> dict | None:
        """The layers a store applies to: every one, or `where layer [not] in P` (P a list parameter)."""
        where = decl.where
        if where is None:
            return {}
        if (isinstance(where, ast.Compare) and where.op in ("in", "not in") and isinstance(where.left, ast.Name)
                and where.left.id == "layer" and isinstance(where.right, ast.Name) and where.right.id in self.params):
            return {"param": where.right.id, "member": where.op == "in"}
        self.unfit(where, f"where {source_of(where)}: the spec's per-layer stores take `layer in P` or `layer not in "
                          "P`, P a list parameter")
        return None

    def lloyd_max(self, which: str, decl: ast.Store, call: ast.Call):
        """`lloyd_max(bits, along channel)`: codebook codes over a token's channels, one RMS scale."""
        fails = len(self.reasons)
        bits = self.scalar(call.args[0], call, "the bit width")
        if bits is not None:
            at = bits.subs({sp.Symbol(n): v for n, v in self.checked.values.items() if isinstance(v, (int, float))})
            if not (at.is_Integer and int(at) in BOOK_PACKINGS):
                self.unfit(call, f"store {which}: {source_of(call.args[0])} = {at} bits (codebook codes take 2, 3 "
                                 "or 4)")
        residual = self.residual(which, decl)
        if len(self.reasons) > fails or bits is None:
            return None
        packing = BOOK_PACKINGS[int(bits)] if bits.is_Integer else FROM_BITS
        names = {part: f"{which}_{part}" for part in ("codes", "scale", "resid")}
        tensors = [TensorDesc(names["codes"], "token", "uint8", (HEAD_DIM * bits / 8,), packing),
                   TensorDesc(names["scale"], "token", MODEL, (sp.Integer(1),))]
        if residual is not None:
            tensors.append(TensorDesc(names["resid"], "seq", MODEL, (residual + 1, HEAD_DIM)))
        enc = Quantized(names["codes"], names["scale"], bits, HEAD_DIM, "channel", None,
                        None if residual is None else names["resid"], residual, codebook="sphere")
        return enc, tensors

    def residual(self, which: str, decl: ast.Store):
        """The newest tokens a store keeps exact (`except last n`, summed), or None."""
        residual = None
        for part in _ranges(decl.exempt):
            if part.kind == "first":
                self.unfit(part, f"store {which}: the first tokens at full precision (`except first`); the spec's "
                                 "residual window holds the newest tokens only")
            else:
                count = self.scalar(part.count, part, "the residual window")
                residual = count if residual is None or count is None else residual + count
        return residual

    def quant(self, which: str, decl: ast.Store, call: ast.Call):
        fails = len(self.reasons)
        bits = self.scalar(call.args[0], call, "the bit width")
        if bits is not None and bits.is_Integer and int(bits) not in PACKINGS:
            self.unfit(call, f"store {which}: {bits}-bit codes (the spec packs 2, 4 or 8 bits)")
        elif bits is not None and not bits.is_Integer:
            at = bits.subs({sp.Symbol(n): v for n, v in self.checked.values.items() if isinstance(v, (int, float))})
            if not (at.is_Integer and int(at) in PACKINGS):
                self.unfit(call, f"store {which}: {source_of(call.args[0])} = {at} bits (the spec packs 2, 4 or 8)")
        mode = call.kwarg("mode")
        symmetric = isinstance(mode, ast.Name) and mode.id == "symmetric"
        if mode is not None and not (isinstance(mode, ast.Name) and mode.id in ("symmetric", "asymmetric")):
            self.unfit(call, f"store {which}: a quantization mode from a parameter ({source_of(mode)}) decides "
                             "whether a zero point is stored")
        along = call.clause("along")
        axes = [d.name for d in along.dims] if along is not None else []
        group_expr = call.kwarg("group")
        group = None if group_expr is None else self.scalar(group_expr, call, "the group size")
        if axes == ["channel"]:
            axis, group = "channel", HEAD_DIM if group_expr is None else group
        elif axes == ["key"] and group_expr is not None:
            axis = "token"
        elif axes == ["key"]:
            axis = None
            self.unfit(call, f"store {which}: one scale per channel over the whole key axis (no group) is fixed once; "
                             "the spec's token groups are page-local (give `group = g`)")
        else:
            axis = None
            self.unfit(call, f"store {which}: scales shared along {', '.join(axes)} (the spec groups along channel "
                             "or key only)")
        residual = self.residual(which, decl)
        if len(self.reasons) > fails or bits is None or group is None:
            return None
        per = sp.Integer(8) / bits
        packed = bits.is_Integer and int(bits) < 8
        codes_dtype = ("uint8" if not symmetric or packed else "int8") if bits.is_Integer else (
            "uint8" if not symmetric else FROM_BITS)
        packing = PACKINGS[int(bits)] if bits.is_Integer else FROM_BITS
        names = {part: f"{which}_{part}" for part in ("codes", "scale", "zero", "resid")}
        if axis == "channel":
            groups = ("token", (HEAD_DIM / group,))
        else:  # one row of scales a page: pages of one group (runtime/kv/spec.py, `Quantized` axis "token")
            groups = ("page", (sp.Integer(1), HEAD_DIM))
            if residual is None:
                self.unfit(call, f"store {which}: groups over tokens are quantized a block at a time from a window of "
                                 "the newest tokens: give `except last n` (n a multiple of the group)")
                return None
            self.page_tokens = group
        tensors = [TensorDesc(names["codes"], "token", codes_dtype, (HEAD_DIM / per,), packing),
                   TensorDesc(names["scale"], groups[0], MODEL, groups[1])]
        if not symmetric:
            tensors.append(TensorDesc(names["zero"], groups[0], MODEL, groups[1]))
        if residual is not None:  # the newest `residual` tokens and the step's one
            tensors.append(TensorDesc(names["resid"], "seq", MODEL, (residual + 1, HEAD_DIM)))
        enc = Quantized(names["codes"], names["scale"], bits, group, axis, None if symmetric else names["zero"],
                        None if residual is None else names["resid"], residual)
        return enc, tensors

    def fp8(self, which: str, decl: ast.Store, call: ast.Call):
        fails = len(self.reasons)
        along = call.clause("along")
        axes = tuple(sorted(d.name for d in along.dims)) if along is not None else ()
        if axes not in FP8_AXES:
            self.unfit(call, f"store {which}: fp8 scales shared along {', '.join(axes)} (the spec holds one per layer, "
                             "`along kv_head, key, channel`, or per layer and KV head, `along key, channel`)")
        if decl.exempt is not None:
            self.unfit(decl, f"store {which}: fp8 with tokens at full precision (`except`): float codes have no "
                             "residual window")
        if len(self.reasons) > fails:
            return None
        codes, scale = f"{which}_codes", f"{which}_scale"
        enc = Quantized(codes, scale, sp.Integer(8), HEAD_DIM, "channel", format=self.choice(call.args[0]),
                        scaling=self.choice(call.kwarg("scale"), "unit"), shared_heads=FP8_AXES[axes])
        return enc, [TensorDesc(codes, "token", FROM_FORMAT, (HEAD_DIM,)), TensorDesc(scale, "layer", MODEL, (1,))]

    def choice(self, e: ast.Expr | None, default: str | None = None):
        """An enum argument: its literal member, or the parameter naming it (`Param`)."""
        if e is None:
            return default
        return Param(e.id) if e.id in self.params else e.id

    # -- page summaries ---------------------------------------------------------------------------
    def summary(self, decl: ast.Summary, spec: SpecDesc) -> None:
        e = decl.value
        name = decl.name.name
        within = e.clause("within") if isinstance(e, ast.Call) else None
        if not (isinstance(e, ast.Call) and e.func.name in REDUCERS and within is not None and len(e.args) == 1
                and isinstance(e.args[0], ast.Name) and e.args[0].id in ("k", "v") and len(within.dims) == 1):
            self.unfit(decl, f"summary {name} = {source_of(e)}: the spec's summaries are max, min, sum or mean of "
                             "k or v within pages")
            return
        axis = self.checked.axes.get(within.dims[0].name)
        split = getattr(getattr(axis, "decl", None), "value", None)
        size = split.kwarg("size") if isinstance(split, ast.Call) and split.func.name == "split" else None
        if size is None:
            kind = split.func.name if isinstance(split, ast.Call) else "?"
            self.unfit(decl, f"summary {name} = {source_of(e)}: {within.dims[0].name} is a {kind} partition, not pages "
                             "of a fixed size (the spec's summaries are per page)")
            return
        tokens = self.scalar(size, split, "the page size")
        if tokens is None:
            return
        source = spec.keys if e.args[0].id == "k" else spec.values
        if (isinstance(source, Quantized) and source.axis == "token" and source.residual_tokens is not None
                and e.func.name == "mean"):
            # a block's codes are written when the block is full: the store folds each row into its page's
            # summary as computed (runtime/kv/store.py `fold_summaries`); a mean would need the page's count
            self.unfit(decl, f"summary {name}: {e.args[0].id} is written a block at a time (groups along key with "
                             "`except last`): its summaries are folded in as rows are stored, max, min or sum")
            return
        if spec.page_tokens is not None and sp.simplify(spec.page_tokens - tokens) != 0:
            self.unfit(decl, f"summary {name}: pages of {tokens} tokens, other summaries use {spec.page_tokens}")
            return
        spec.page_tokens = tokens
        # a max or min of stored values is one of them: exact in the model dtype, half the bytes a
        # sparse read scans; sums and means accumulate, so they keep float32
        dtype = MODEL if e.func.name in ("max", "min") else "float32"
        spec.tensors.append(TensorDesc(name, "page", dtype, (HEAD_DIM,)))
        spec.summaries.append(SummaryDesc(name, e.args[0].id, e.func.name))

    # -- method state -----------------------------------------------------------------------------
    def states(self, facts: dict | None, spec: SpecDesc) -> None:
        after_hook = next((h for h in self.checked.hooks if h.name.name == "decode_after_attention"), None)
        after = (facts or {}).get("decode_after_attention")
        paged = bool(after and after.get("key_local"))
        undecided = facts is None and after_hook is not None
        if undecided:
            self.unfit(after_hook, "decode_after_attention: whether its state and pending scores live in paged "
                                   "planes (key-local) is derived for lowered methods only")
        for d in (d for d in self.checked.method.items if isinstance(d, ast.State)):
            if d.shared and facts is not None and self.checked.bindings[d.name.name].kind == "shared" and \
                    _chosen_each_step(facts):
                continue  # chosen afresh in every decode step and handed down its layers: nothing stored
            if d.shared:
                self.unfit(d, f"shared {d.name.name}: one value per sequence seen by every layer is not in the spec "
                              "yet")
            elif self._replay_only(d.name.name):
                continue  # built and read by the replay pass alone: gone once its keep ran, nothing stored
            elif paged:
                spec.tensors.append(TensorDesc(d.name.name, "token", "float32", state=True))
            elif not undecided:
                self.unfit(d, f"state {d.name.name}: kept by the method per sequence and layer, outside the spec (only "
                              "the state of a key-local decode_after_attention is paged)")
        if paged and after.get("keeps"):
            spec.tensors.append(TensorDesc(SCORES_PLANE, "token", "float32", state=True))

    def _replay_only(self, name: str) -> bool:
        """Does only the replay pass (`replay_chunk`, `replay_end`) read or write state `name`?"""
        def names(s) -> set[str]:
            target = getattr(getattr(s, "target", None), "name", None)
            return {n.id for n in ast.walk(s) if isinstance(n, ast.Name)} | ({target.name} if target else set())

        users = {h.name.name for h in self.checked.hooks if any(name in names(s) for s in h.body)}
        return bool(users) and users <= {"replay_chunk", "replay_end"}

    def positions(self, facts: dict | None, spec: SpecDesc) -> None:
        """A hook that reads the spans of a text partition: the spec records each slot's logical position
        (the engine maps positions to spans); slots stay in time order.
        A decode-time keep evicts in place (each kept token past the new length fills an evicted
        slot below it, so an eviction moves O(evicted) tokens): the spec then stores each slot's
        logical position, which gives the hooks the layer in time order. Only where every slot moves
        alone: equal counts per KV head (no head-adaptive or per-role keep), a decode state that does
        not depend on slot order (a key-local decode_after_attention's planes), codes with no
        per-page scales or residual window, and no read plan (its newest slots and pages are the
        appended ones)."""
        if any(f.get("spans") for f in (facts or {}).values()):  # a hook reads the spans of stored tokens
            spec.tensors.append(TensorDesc(POSITIONS, "token", "int32"))
            spec.positions = POSITIONS  # recorded, slots kept in time order (per-head counts)
            return
        keeps = [(h, (facts or {}).get(h) or {}) for h in ("step_end", "decode_after_attention")]
        keeps = [(h, f) for h, f in keeps if f.get("keeps")]
        if not keeps or spec.head_starts or any(f.get("role") for _, f in keeps):
            return
        if any(f and f.get("reads") for f in (facts or {}).values()):
            return  # a read plan's newest slots and pages are where tokens were appended: slots stay in order
        if any(h == "decode_after_attention" and not f.get("key_local") for h, f in keeps):
            return
        for enc in (spec.keys, spec.values):
            if not isinstance(enc, (Dense, Quantized, LowRank)) or (
                    isinstance(enc, Quantized) and (enc.residual is not None or enc.axis == "token")):
                return
        spec.tensors.append(TensorDesc(POSITIONS, "token", "int32"))
        spec.positions, spec.in_place = POSITIONS, True


def _chosen_each_step(facts: dict) -> bool:
    """A lowered decode_before_attention of token plans chooses the method's shared selections anew in
    every step (runtime/compiled/read.py keeps them for the step's later layers only)."""
    return bool(facts.get("decode_before_attention", {}).get("tokens"))


def _scale_sharing(stage: ast.Call) -> str:
    """What a stage's scale sharing adds to its reason: a scale over the whole key axis has no extent."""
    along = stage.clause("along")
    axes = [d.name for d in along.dims] if along is not None else []
    if "key" in axes and stage.kwarg("group") is None:
        return f", one scale along {', '.join(axes)} fixed once (per layer: the spec has no such extent)"
    return ""


def _ranges(e: ast.Expr | None) -> list[ast.Range]:
    if e is None:
        return []
    if isinstance(e, ast.BinOp) and e.op == "+":
        return _ranges(e.left) + _ranges(e.right)
    return [e] if isinstance(e, ast.Range) else []


def _is_spans(checked, item: str) -> bool:
    """Is `item` a text partition (`dim P = split(key, at = [...])`)?"""
    decl = getattr(checked.axes.get(item), "decl", None)
    split = getattr(decl, "value", None)
    return isinstance(split, ast.Call) and split.func.name == "split" and split.kwarg("at") is not None


def _head_adaptive(checked) -> bool:
    """Does any keep select a head-adaptive `top(..., across kv_head)` or whole spans of a text partition
    (per-head counts, right-aligned)?"""
    for hook in checked.hooks:
        for stmt in hook.body:
            if isinstance(stmt, ast.Keep):
                for node in ast.walk(stmt.selection):
                    if (isinstance(node, ast.Call) and node.func.name == "top" and isinstance(node.ty, Selection)
                            and (node.ty.across == ("kv_head",) or _is_spans(checked, node.ty.item))):
                        return True
    return False


def derive(checked, facts: dict | None) -> SpecDesc:
    """The KV spec of a checked method; `facts` are its hook facts (None: not lowered)."""
    d = _Deriver(checked)
    stores = {t.name: decl for decl in checked.method.items if isinstance(decl, ast.Store) for t in decl.targets}
    if stores.get("k") is not None and stores.get("k") is stores.get("v"):  # `store k, v as ...`: one code
        keys, key_tensors = d.delta(stores["k"])
        values, value_tensors = keys, []
    else:
        keys, key_tensors = d.operand("k", stores.get("k"))
        values, value_tensors = d.operand("v", stores.get("v"))
    where = {w: m for w, m in d.where.items() if m}
    if isinstance(keys, Delta) and keys.layers:  # one code: both operands' layers
        where = {"k": keys.layers, "v": keys.layers}
    spec = SpecDesc(keys, values, key_tensors + value_tensors, head_starts=_head_adaptive(checked),
                    page_tokens=d.page_tokens, layers=where)
    indexed = {(facts or {}).get(h, {}).get("clusters", {}).get("partition") for h in (facts or {})} - {None}
    for decl in checked.method.items:
        if isinstance(decl, ast.Summary) and _within(decl) not in indexed:
            d.summary(decl, spec)
    d.states(facts, spec)
    d.positions(facts, spec)
    spec.reasons = d.reasons
    return spec


_ELEMENT_BYTES = {MODEL: sp.Symbol("dtype_bytes"), "float32": 4, "int32": 4, "uint8": 1, "int8": 1, FROM_BITS: 1,
                  FROM_FORMAT: 1}


# in_layers(layer, P): 1 where `layer` is in the list parameter P, else 0 (a store's `where layer [not] in P`)
IN_LAYERS = sp.Function("in_layers")


def _owned(enc) -> set[str]:
    """The names of the tensors an operand's encoding stores (none for an `Unmapped` one)."""
    return getattr(enc, "tensor_names", set())


def token_bytes(spec: SpecDesc):
    """Bytes one stored slot costs per KV head in layer `layer` (sympy over layer, head_dim, dtype_bytes
    and the parameters): the per-token tensors, and the per-page ones spread over a page's slots.
    Per-sequence and per-layer tensors are not per slot. An operand whose store applies to some layers
    (`where layer [not] in P`) costs its encoding's bytes there (`in_layers`) and the model dtype's
    head_dim elsewhere (the runtime's storage classes)."""
    layer = sp.Symbol("layer")

    def applies(which: str | None):
        where = spec.layers.get(which) if which else None
        if not where:
            return sp.Integer(1)
        member = IN_LAYERS(layer, sp.Symbol(where["param"]))
        return member if where["member"] else 1 - member

    owned = {which: _owned(enc) for which, enc in (("k", spec.keys), ("v", spec.values))}
    total = sp.Integer(0)
    for t in spec.tensors:
        if t.extent not in ("token", "page"):
            continue
        size = sp.Mul(*t.shape) * _ELEMENT_BYTES[t.dtype]
        size = size if t.extent == "token" else size / (spec.page_tokens or PAGE_SIZE)
        total += applies(next((w for w in ("k", "v") if t.name in owned[w]), None)) * size
    for which in spec.layers:  # stored dense where its store does not apply
        total += (1 - applies(which)) * HEAD_DIM * _ELEMENT_BYTES[MODEL]
    return sp.simplify(total)


def _within(decl: ast.Summary) -> str | None:
    """The partition a summary is `within` (None: none)."""
    within = decl.value.clause("within") if isinstance(decl.value, ast.Call) else None
    return within.dims[0].name if within is not None and len(within.dims) == 1 else None


# ---- the generated function ----------------------------------------------------------------------

_ARGS = ("num_kv_heads", "head_dim", "dtype", "page_size", "params")
_DTYPES = {MODEL: "dtype", "float32": "torch.float32", "uint8": "torch.uint8", "int8": "torch.int8",
           "int32": "torch.int32"}
_EXTENTS = {"token": "Extent.TOKEN", "page": "Extent.PAGE", "seq": "Extent.SEQ", "layer": "Extent.LAYER"}


class _Printer:
    """sympy -> Python over the function's arguments and locals of the parameters it reads."""

    def __init__(self, local_names: frozenset[str] = frozenset()) -> None:
        self.params: set[str] = set()
        self.local_names = local_names  # symbols the function computes itself (a low-rank group)

    @staticmethod
    def local(name: str) -> str:
        return f"param_{name}" if name in _ARGS else name

    def py(self, value) -> str:
        value = sp.sympify(value)
        subs = {}
        for s in value.free_symbols:
            if s == PAGE_SIZE or s == HEAD_DIM:
                continue
            if s == KV_HEADS:
                subs[s] = sp.Symbol("num_kv_heads")
                continue
            if str(s) in self.local_names:
                continue
            self.params.add(str(s))
            if self.local(str(s)) != str(s):
                subs[s] = sp.Symbol(self.local(str(s)))
        return sp.pycode(value.xreplace(subs), fully_qualified_modules=True)

    def size(self, value) -> str:
        value = sp.sympify(value)
        return self.py(value) if value.is_Symbol or value.is_integer else f'_size({self.py(value)}, "{sp.sstr(value)}")'


class _Emitter:
    def __init__(self, spec: SpecDesc) -> None:
        self.low_rank = {w: e for w, e in (("k", spec.keys), ("v", spec.values)) if isinstance(e, LowRank)}
        if isinstance(spec.keys, Delta):  # one code per token: its group of KV heads is `kv_group`
            self.low_rank = {"kv": spec.keys}
        self.spec, self.p = spec, _Printer(frozenset(f"{w}_group" for w in self.low_rank))
        encs = [e for e in (spec.keys, spec.values) if isinstance(e, Quantized)]
        self.bits = {e.codes: e.bits for e in encs}
        self.formats = {e.codes: e.format for e in encs if e.format is not None}
        self.resid = {e.residual: f"{e.residual}_tokens" for e in encs if e.residual is not None}

    def tensor(self, t: TensorDesc) -> str:
        if t.state:
            return f'state_plane("{t.name}")'
        if t.name in self.resid:  # the newest tokens kept and the step's one
            shape = f"({self.resid[t.name]} + 1, head_dim)"
        else:
            sizes = [self.p.size(n) for n in t.shape]
            shape = f"({sizes[0]},)" if len(sizes) == 1 else f"({', '.join(sizes)})"
        bits = self.p.py(self.bits[t.name]) if FROM_BITS in (t.dtype, t.packing) else None
        if t.dtype == FROM_FORMAT:
            fmt = _choice(self.formats[t.name])
            dtype = f'(torch.float8_e4m3fn if {fmt} == "e4m3" else torch.float8_e5m2)'
        else:
            dtype = f"_codes_dtype({bits})" if t.dtype == FROM_BITS else _DTYPES[t.dtype]
        packing = f", _packing({bits})" if t.packing == FROM_BITS else (f', "{t.packing}"' if t.packing else "")
        return f'TensorSpec("{t.name}", {_EXTENTS[t.extent]}, {dtype}, {shape}{packing})'

    def encoding(self, enc: Dense | Quantized | LowRank | Delta) -> str:
        if isinstance(enc, Dense):
            return f'Dense("{enc.tensor}")'
        if isinstance(enc, Delta):
            p = self.p
            bias = "None" if enc.bias is None else f'"{enc.bias}"'
            sink = p.size(enc.sink)
            return (f'Delta("{enc.latent}", "{DELTA_NEIGHBOURS}", "{DELTA_CENTERS}", "{DELTA_SINKS}" if {sink} >= 1 '
                    f'else None, "{DELTA_WINDOW}", "{enc.down}", "{enc.up}", {bias},\n        '
                    f'every={p.size(enc.every)}, '
                    f'count={p.size(enc.count)}, sink={sink}, recent={p.size(enc.recent)})')
        if isinstance(enc, LowRank):
            which = enc.latent.removesuffix("_latent")
            return (f'LowRank("{enc.latent}", "{enc.down}", "{enc.up}", {which}_group, '
                    f'prerope={enc.prerope})')
        zero = "None" if enc.zero is None else f'"{enc.zero}"'
        rotation = "" if enc.rotation is None else f", rotation={_choice(enc.rotation)}"
        rotation += "" if enc.offset is None else f', offset="{enc.offset}"'
        if enc.format is not None:
            return (f'Quantized(\n        "{enc.codes}", "{enc.scale}", 8, head_dim, format={_choice(enc.format)}, '
                    f'scaling={_choice(enc.scaling)},\n        shared_heads={enc.shared_heads}{rotation},\n    )')
        residual = "None" if enc.residual is None else f'"{enc.residual}" if {self.resid[enc.residual]} >= 1 else None'
        flush = f", flush_block={self.resid[enc.residual]}" if enc.axis == "token" else ""
        book = "" if enc.codebook is None else f', codebook="{enc.codebook}"'
        book += ", prefill_exact=True"  # integer and codebook codes: the papers' full-precision prefill
        return (f'Quantized(\n        "{enc.codes}", "{enc.scale}", {self.p.py(enc.bits)}, {self.p.py(enc.group)}, '
                f'zero={zero}, axis="{enc.axis}",\n        residual={residual}{flush}{book}{rotation},\n    )')

    def body(self, method_name: str) -> list[str]:
        spec, p = self.spec, self.p
        lines: list[str] = []
        if spec.page_tokens is not None:
            tokens = p.py(spec.page_tokens)
            lines += [f"    if page_size != {tokens}:",
                      f'        raise ValueError(f"{method_name} needs pages of {{{tokens}}} tokens (its page '
                      'summaries or page scales); the engine\'s pages hold {page_size}")']
        for enc in (spec.keys, spec.values):
            if isinstance(enc, Quantized) and enc.residual is not None:
                lines.append(f"    {self.resid[enc.residual]} = max(0, math.floor({p.py(enc.residual_tokens)}))")
        for which, enc in self.low_rank.items():  # a model whose KV heads the group does not divide: their gcd
            lines.append(f"    {which}_group = math.gcd(int({p.py(enc.group)}), num_kv_heads)")
        sinks = {DELTA_SINKS} if isinstance(spec.keys, Delta) else set()  # none without sink tokens
        lines.append("    tensors = [")
        lines += [f"        {self.tensor(t)}," for t in spec.tensors if t.name not in set(self.resid) | sinks]
        lines.append("    ]")
        for t in spec.tensors:
            if t.name in sinks:
                lines += [f"    if {p.size(spec.keys.sink)} >= 1:", f"        tensors.append({self.tensor(t)})"]
        for t in spec.tensors:
            if t.name in self.resid:
                lines += [f"    if {self.resid[t.name]} >= 1:", f"        tensors.append({self.tensor(t)})"]
        summaries = [f'Summary("{s.tensor}", "{s.source}", "{s.fn}")' for s in spec.summaries]
        summaries = f"({summaries[0]},)" if len(summaries) == 1 else f"({', '.join(summaries)})"
        lines += [f"    keys = {self.encoding(spec.keys)}",
                  f"    values = {self.encoding(spec.values)}",
                  f"    summaries = {summaries}",
                  f"    return KVSpec(tuple(tensors), keys=keys, values=values, summaries=summaries, "
                  f"head_starts={spec.head_starts}"
                  + (f', positions="{spec.positions}"' if spec.positions else "")
                  + (", in_place=True)" if spec.in_place else ")")]
        return lines


def _choice(value) -> str:
    """A storage choice as Python: a literal, or the parameter's value."""
    return f'params["{value.name}"]' if isinstance(value, Param) else f'"{value}"'


def emit_python(spec: SpecDesc, method_name: str, method_path: str) -> str:
    """Source of `kv_spec(num_kv_heads, head_dim, dtype, page_size, params) -> KVSpec` and the helpers it
    uses (the module imports math, torch and runtime/kv/spec.py's names). Every operand must be mapped."""
    if isinstance(spec.keys, Unmapped) or isinstance(spec.values, Unmapped):
        raise ValueError(f"method {method_name}: K or V stored as the KV spec cannot describe: {spec.reasons}")
    em = _Emitter(spec)
    body = em.body(method_name)
    unpack = [f'    {em.p.local(n)} = params["{n}"]' for n in sorted(em.p.params)]
    doc = (f'    """Every tensor {method_name} stores per token, page or sequence, from {method_path} '
           '(manifest.json "kv_spec")."""')
    text = "\n".join(body)
    helpers = ([_SIZE] if "_size(" in text else []) + ([_PACKING] if "_packing(" in text else [])
    fn = "\n".join(["def kv_spec(num_kv_heads, head_dim, dtype, page_size, params):", doc] + unpack + body)
    return "\n\n\n".join(helpers + [fn, _page_tokens(em, method_name, method_path),
                                    _dense_operands(spec, method_name, method_path)]) + "\n"


def _dense_operands(spec: SpecDesc, method_name: str, method_path: str) -> str:
    """Source of `dense_operands(params, layer)`: the operands ("k", "v") that layer `layer` stores
    dense, where the .kvm's `store ... where layer [not] in P` does not apply (runtime StorageClasses)."""
    doc = (f'    """The operands layer `layer` stores dense instead of as {method_name}\'s spec says, from\n'
           f'    {method_path} (`store ... where`)."""')
    lines = ["def dense_operands(params, layer):", doc, "    dense = []"]
    for which, where in sorted(spec.layers.items()):
        member = "not in" if where["member"] else "in"
        lines += [f'    if layer {member} params["{where["param"]}"]:', f'        dense.append("{which}")']
    return "\n".join(lines + ["    return tuple(dense)"])



def _page_tokens(em: _Emitter, method_name: str, method_path: str) -> str:
    """Source of `page_tokens(params)`: the engine page size the method's page summaries need (None:
    any), so that an engine started without a page size takes the method's."""
    doc = (f'    """The tokens of a page that {method_name} summarises, from {method_path}\n'
           '    (None: no page summaries, any engine page)."""')
    if em.spec.page_tokens is None:
        return "\n".join(["def page_tokens(params):", doc, "    return None"])
    printer = _Printer()  # its own, so that it unpacks only the parameters the page count reads
    tokens = printer.py(em.spec.page_tokens)
    unpack = [f'    {printer.local(n)} = params["{n}"]' for n in sorted(printer.params)]
    return "\n".join(["def page_tokens(params):", doc] + unpack + [f"    return int({tokens})"])

_SIZE = '''def _size(value, formula):
    """A tensor size computed from the .kvm (`formula`): a whole number (TensorSpec checks that it is positive)."""
    whole = round(value)
    if abs(value - whole) > 1e-9:
        raise ValueError(f"a KV spec size, {formula} = {value:g}, is not a whole number")
    return int(whole)'''

_PACKING = '''def _packing(bits):
    """How codes of `bits` bits share uint8s (runtime/kv/spec.py PACKINGS)."""
    if bits not in (2, 3, 4, 8):
        raise ValueError(f"{bits}-bit codes: the KV spec packs 2, 3, 4 or 8 bits")
    return {8: "", 4: "int4x2", 3: "int3x8", 2: "int2x4"}[bits]


def _codes_dtype(bits):
    """Symmetric codes: int8 when unpacked, uint8 when packed."""
    return torch.int8 if bits == 8 else torch.uint8'''
