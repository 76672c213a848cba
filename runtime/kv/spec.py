"""The KV storage spec: every tensor a method stores, and how attention reads K and V from them.

A method's `kv_spec(...)` (the contract, runtime/method_api.py; compiled methods derive it from the
.kvm file) names its tensors, each stored at one extent:

- `TOKEN`: one value per stored slot and KV head, at the token's slot like K and V
  (`[pages + 1, Hkv, page_size, *shape]`): K/V themselves, quantized codes, scales, zero points,
  per-token method state (H2O's `seen`);
- `PAGE`: one value per page and KV head (`[pages + 1, Hkv, *shape]`): Quest's key min/max;
- `SEQ`: one value per sequence, layer and KV head (`[rows + 1, layers, Hkv, *shape]`): a
  quantization method's full-precision residual window;
- `LAYER`: one value per layer and KV head (`[layers, Hkv, *shape]`), fixed once and shared by
  every page: FP8's per-tensor or per-head scales.

One page id addresses every TOKEN and PAGE tensor; one row id every SEQ tensor. The last page and
the last row are scratch (batch padding writes there). `keys` / `values` say how attention reads K
and V (`Dense` or `Quantized`), `summaries` which PAGE tensors the store keeps current. Bytes per
token, per page and per sequence come from here and size the pool, admission and the largest batch.
docs/design.md, "KV spec", has the rules; runtime/kv/store.py holds the tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace

import torch

K, V = "k", "v"  # the names of dense keys and values
REDUCERS = ("max", "min", "sum", "mean")
# packing -> (codes, uint8 elements they share), along the last axis, low bits first: `int3x8` puts 8
# 3-bit codes in 3 bytes (code j of 8 at bits [3j, 3j + 3) of their little-endian 24-bit word)
PACKINGS = {"": (1, 1), "int4x2": (2, 1), "int2x4": (4, 1), "int3x8": (8, 3)}
CODEBOOKS = ("sphere",)  # codes that index levels (runtime/kv/encodings.py, `levels`)
ROTATIONS = ("hadamard", "random")  # orthogonal matrices of a stored rotation (runtime/kv/rotation.py)
# FP8 code formats: the torch dtype and the largest finite magnitude (codes saturate there)
FLOAT_CODES = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
SCALINGS = ("unit", "dynamic")  # where FP8 scales come from (docs/design.md, "KV spec")


class Extent(enum.Enum):
    TOKEN = "token"
    PAGE = "page"
    SEQ = "seq"
    LAYER = "layer"


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor: `shape` is per slot (TOKEN), page (PAGE), sequence-layer (SEQ) or layer
    (LAYER), per KV head. `packing` says how integer codes share an element (`int4x2`: two 4-bit codes per uint8,
    low bits first, along the last axis; `shape` counts stored elements)."""

    name: str
    extent: Extent
    dtype: torch.dtype
    shape: tuple[int, ...] = ()
    packing: str = ""

    def __post_init__(self) -> None:
        if self.packing not in PACKINGS:
            raise ValueError(f"tensor {self.name!r}: unknown packing {self.packing!r} (one of {sorted(PACKINGS)})")
        if any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise ValueError(f"tensor {self.name!r}: shape {self.shape} must be positive integers")

    @property
    def bytes(self) -> int:
        """Bytes per slot, page, sequence-layer or layer, per KV head."""
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Dense:
    """Attention reads the tensor as it is: `[.., D]` in the model's dtype; with `channels`, its first
    `channels` only, a view (MLA's values: the latent part of the keys' tensor, `KVSpec.with_latent_values`)."""

    tensor: str
    channels: int | None = None

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """What attention reads of the stored `tensor [..., D]`."""
        return tensor if self.channels is None else tensor[..., : self.channels]


@dataclass(frozen=True)
class Quantized:
    """Integer codes with a scale (and a zero point) per group: `x = code * scale + zero`
    (asymmetric: unsigned codes, the zero point the group minimum) or `x = code * scale` (symmetric: signed codes,
    `zero` None). `codes` is a TOKEN tensor. `axis` says what a group spans:

    - "channel" (per token): `group` channels of one token share a scale; `scale`/`zero` are TOKEN
      tensors of shape [D // group] (KIVI's values, FP8-style per-token scales);
    - "token" (per channel): `group` consecutive slots share a scale per channel; `scale`/`zero` are
      PAGE tensors of shape [1, D]: the page size divides `group`, and a group longer than a page
      has its scale stored in each of its pages (KIVI's keys). Readers see them at every slot of
      the page (`reader`: one scale per channel).

    `residual`: a SEQ tensor `[W, D]` in the model dtype holding the newest stored tokens in full
    precision, slot s at row `s % W`; attention reads the last `resid_len` slots of a layer (a
    per-sequence, per-layer count the store keeps) from it instead of the codes.

    `flush_block` B > 0: codes are written a block at a time, not token by token. Blocks are the
    slots [jB, (j+1)B); the store quantizes block j when the first slot past it is stored, from the
    window (whose W >= B + 1 slots still hold it) and the step's new tokens, so a block is read in
    full precision through the step that completes it. Attention reads at most the newest
    `(length - 1) % B + 1` slots (the newest, unfinished block) from the window, the rest from the
    codes. Token-axis groups need it (a group's scale needs the whole group): KIVI's keys, B its
    residual length. B = 0: every token's codes are written when it is stored.

    `codebook` "sphere": codes index 2^bits levels instead of counting steps (TurboQuant's
    scalar quantizer): `x = levels[code] * scale`, one scale per group, the group's RMS, and the
    levels the Lloyd-Max quantizer of one coordinate of a random unit vector in `group` dimensions,
    scaled by sqrt(group) (encodings.levels). Unsigned codes, no zero point, groups along channels.

    `rotation` "hadamard" / "random": the operand is stored rotated, `x @ R.T` with R that orthogonal
    matrix (runtime/kv/rotation.py), and read back as `x^ @ R`: outside the store everything is in the
    model's basis. The attention kernels rotate the query by the keys' R and their output back by the
    values' instead of rotating cached rows. No residual window: its full-precision rows would mix the
    two bases in one tile.

    `prefill_exact`: a prefill chunk attends to its own tokens as computed, to earlier ones as stored
    (the research methods' full-precision prefill: KIVI, TurboQuant); otherwise it reads itself as
    stored too (vLLM's FP8 prefill). A residual window implies it (the chunk is the newest tokens).
    A decode step reads its own token as stored, or from the window when there is one.

    `format` "e4m3" / "e5m2": float codes (FP8, `FLOAT_CODES`), `x = float(code) * scale`, stored
    `code = fp8(clamp(x / scale, -max, max))` (round to nearest even). Their scale is a LAYER
    tensor of shape [1] in the model dtype (group = D, axis "channel", symmetric, 8 bits, no residual), fixed once:
    `scaling` "unit" (1.0) or "dynamic" (set from the first stored chunk of each layer:
    encodings.dynamic_scale); `shared_heads`: one scale for every KV head of a layer (vLLM's
    per-tensor k_scale / v_scale) rather than one per KV head.

    `offset` (keys only): a LAYER tensor [D], one vector per KV head (a method input: the mean key of the
    model's layer and head, bench/variants/turboquant_offsets.kvm's `k_mean`). Keys are stored and read as `k - offset`:
    the attention backend subtracts it from the step's keys before it stores them or a prefill chunk
    attends to them, so every key of a softmax carries it and `q . offset`, the same for all of a
    query's keys, cancels (docs/design.md, "Key offsets"). Hooks see the keys so. No residual window,
    no float codes."""

    codes: str
    scale: str
    bits: int
    group: int
    zero: str | None = None
    residual: str | None = None
    axis: str = "channel"
    format: str | None = None
    scaling: str = "unit"
    shared_heads: bool = True
    flush_block: int = 0
    codebook: str | None = None
    rotation: str | None = None
    prefill_exact: bool = False
    # keys stored relative to a LAYER tensor [D] (per KV head): `x - offset`, read back as stored (the
    # class docstring)
    offset: str | None = None
    # float codes only: read the codes tensor's first `channels` (MLA's values inside the keys' codes,
    # `KVSpec.with_latent_values`); None: all of them
    channels: int | None = None

    def view(self, codes: torch.Tensor) -> torch.Tensor:
        """What a reader reads of the stored codes [..., Dc]."""
        return codes if self.channels is None else codes[..., : self.channels]

    def __post_init__(self) -> None:
        if self.channels is not None and (self.format is None or self.channels != self.group):
            raise ValueError(f"quantized {self.codes!r}: reading the first channels of the codes takes float codes, "
                             f"one scale over those channels (group = channels); got format {self.format!r}, "
                             f"group {self.group}, channels {self.channels}")
        if self.rotation is not None and self.rotation not in ROTATIONS:
            raise ValueError(f"quantized {self.codes!r}: rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.rotation is not None and self.residual is not None:
            raise ValueError(f"quantized {self.codes!r}: a rotated operand has no residual window (its rows would be "
                             "in the model's basis, the codes in the rotated one)")
        if self.codebook is not None and (self.codebook not in CODEBOOKS or self.zero is not None
                                          or self.axis != "channel" or self.format is not None
                                          or self.bits not in (2, 3, 4) or self.group < 3):
            raise ValueError(f"quantized {self.codes!r}: codebook codes are {CODEBOOKS}, 2 to 4 bits, one scale per "
                             f"group of >= 3 channels and no zero point; got {self.codebook!r}, {self.bits} bits, "
                             f"group {self.group}, axis {self.axis}")
        whole_groups = self.axis != "token" or self.flush_block % self.group == 0
        if self.flush_block < 0 or (self.flush_block and (self.residual is None or not whole_groups)):
            raise ValueError(f"quantized {self.codes!r}: a flush block needs a residual window and, with groups over "
                             f"tokens, a multiple of the group ({self.group}); got {self.flush_block}")
        if self.axis == "token" and self.bits == 3:
            raise ValueError(f"quantized {self.codes!r}: groups over tokens take 2, 4 or 8-bit codes, got 3")
        if self.axis == "token" and not self.flush_block:
            raise ValueError(f"quantized {self.codes!r}: groups over tokens are written a block at a time: give a "
                             "residual window and a flush block (a multiple of the group)")
        if self.format is not None:
            if self.format not in FLOAT_CODES or self.scaling not in SCALINGS:
                raise ValueError(f"quantized {self.codes!r}: float codes are {sorted(FLOAT_CODES)} with scaling one of "
                                 f"{SCALINGS}, got {self.format!r}, {self.scaling!r}")
            if self.bits != 8 or self.zero is not None or self.residual is not None or self.axis != "channel":
                raise ValueError(f"quantized {self.codes!r}: float codes are 8 bits, symmetric, without a residual "
                                 "window, one scale per token's channels")
        if self.offset is not None and (self.residual is not None or self.format is not None):
            raise ValueError(f"quantized {self.codes!r}: an offset is for integer or codebook codes without a "
                             "residual window")
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"quantized {self.codes!r}: bits must be 2, 3, 4 or 8, got {self.bits}")
        if self.group < 1:
            raise ValueError(f"quantized {self.codes!r}: group must be >= 1, got {self.group}")
        if self.axis not in ("channel", "token"):
            raise ValueError(f"quantized {self.codes!r}: axis must be channel or token, got {self.axis!r}")

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    @property
    def exact_chunk(self) -> bool:
        """A prefill chunk reads its own tokens as computed (`prefill_exact`, or a residual window)."""
        return self.prefill_exact or self.residual is not None

    @property
    def signed(self) -> bool:
        """Codes are two's-complement integers (symmetric steps); codebook indices and asymmetric
        codes are unsigned."""
        return self.zero is None and self.codebook is None and self.format is None

    @property
    def reader(self) -> Quantized:
        """The encoding as a reader of one slot sees it: groups over tokens become one scale per
        channel at every slot (`KVStore.scale_slots` shows the page's scales at each of its slots)."""
        return self if self.axis == "channel" else replace(self, axis="channel", group=1)


@dataclass(frozen=True)
class LowRank:
    """A low-rank latent per group of `group` consecutive KV heads (Palu's group-head decomposition):
    the group's K (or V) rows, concatenated, `x_G [group * D]`, are stored as `x_G @ down_G [rank]`
    and read back as `latent @ up_G^T`, with `down_G` and `up_G` [group * D, rank] (orthonormal
    columns for an SVD projection, where up = down).

    - `latent`: a TOKEN tensor [rank // group] in the model dtype: each KV head of a group stores
      its share of the group's latent (head j of the group: channels [j r/g, (j+1) r/g)), so pages,
      tables, copies and chains treat it as any per-head tensor; reading one head reads its group's;
    - `down`, `up`: LAYER tensors [D, rank]: KV head h's rows of its group's projections (h's
      channels to the whole latent and back), filled from the method's input files when the engine
      binds the model (docs/design.md, "Method inputs");
    - `prerope`: keys are stored before RoPE and rotated when read, at the slot's position (a
      sequence's slot s holds its token s: no keep plan may move them).

    A prefill chunk reads its own tokens as computed, earlier ones as stored; a decode step reads
    its own token as stored."""

    latent: str
    down: str
    up: str
    group: int
    prerope: bool = False

    def __post_init__(self) -> None:
        if self.group < 1:
            raise ValueError(f"low-rank {self.latent!r}: group must be >= 1 KV heads, got {self.group}")

    @property
    def exact_chunk(self) -> bool:
        """A prefill chunk reads its own tokens as computed (`Quantized.exact_chunk`)."""
        return True


@dataclass(frozen=True)
class Delta:
    """DeltaKV's one code for a token's keys (before RoPE) and values (docs/design.md, "DeltaKV"; the
    arithmetic in runtime/kv/delta.py): a spec's `keys` and `values` are both this encoding. Per KV
    head a token's vector is `[k_pre | v]` (2 D); the first `sink` tokens and every `every`-th token
    of a compressed block (the centers) stay raw; any other compressed token stores its share of
    `code = (x - ref) @ down`, ref the mean of its `count` nearest centers, read back as `ref + code
    @ up^T + bias`, its key rotated to its slot's position. The tensors:

    - `latent` TOKEN [C / Hkv] (model dtype): each KV head's share of the token's code;
    - `neighbours` TOKEN int32 [ceil(count / Hkv)]: the positions of the token's centers (-1: fewer),
      shared out as the code is: KV head h holds neighbours [h k, (h + 1) k) (`share`);
    - `centers` PAGE [page_size / every, 2 D]: the raw vectors of the page's center slots;
    - `sinks` SEQ [sink, 2 D] (None when `sink` is 0) and `window` SEQ [2 recent, 2 D]: the first
      tokens and the raw tail, slot s at `s % (2 recent)`;
    - `down`, `up` LAYER [2 D, C] (KV head h's rows of the projections), `bias` LAYER [2 D] (or None).

    Tokens are compressed a block at a time (`delta.block_of`): the raw tail holds `recent` to 2
    `recent` - 1 tokens once 2 `recent` are past the sinks, so how many are compressed is a function
    of the stored length alone (`compressed`)."""

    latent: str
    neighbours: str
    centers: str
    sinks: str | None
    window: str
    down: str
    up: str
    bias: str | None
    every: int
    count: int
    sink: int
    recent: int

    def __post_init__(self) -> None:
        if self.every < 1 or self.count < 1 or self.sink < 0 or self.recent < 1:
            raise ValueError(f"delta {self.latent!r}: every, count and recent must be >= 1 and sink >= 0, got "
                             f"{self.every}, {self.count}, {self.recent}, {self.sink}")

    @property
    def exact_chunk(self) -> bool:
        """A prefill chunk reads its own tokens as computed (`Quantized.exact_chunk`)."""
        return True

    def share(self, num_kv_heads: int) -> int:
        """Neighbours each KV head stores of a token (all heads' shares side by side: its `count`, -1 past)."""
        return -(-self.count // num_kv_heads)

    def compressed(self, length: int) -> int:
        """Tokens past the sinks stored as codes (or centers) once `length` are stored."""
        return max(0, (length - self.sink - self.recent) // self.recent) * self.recent


Encoding = Dense | Quantized | LowRank | Delta


@dataclass(frozen=True)
class Summary:
    """A PAGE tensor the store keeps equal to `fn` over the page's stored slots of the decoded
    keys (`source` "k") or values ("v"), per KV head and channel: recomputed for every page a step
    writes (appends, the partial last page included) and every page a compaction rewrites. Of a
    source written a block at a time (`Quantized.flush_block`), whose codes come a block after its
    slots, it is `fn` over the slots' rows as computed instead, folded in as they are stored
    (`KVStore.fold_summaries`; max, min or sum)."""

    tensor: str
    source: str
    fn: str

    def __post_init__(self) -> None:
        if self.source not in (K, V) or self.fn not in REDUCERS:
            raise ValueError(f"summary {self.tensor!r}: source must be k or v and fn one of {REDUCERS}")


@dataclass(frozen=True)
class KVSpec:
    tensors: tuple[TensorSpec, ...]
    keys: Encoding = Dense(K)
    values: Encoding = Dense(V)
    summaries: tuple[Summary, ...] = ()
    # the method's keeps may give KV heads different counts (stored right-aligned, per-head start
    # slots the kernels read: docs/design.md, "KV memory")
    head_starts: bool = False
    # the TOKEN tensor of each slot's logical position (int32), written as tokens are stored and moved with
    # them; None: not recorded. `in_place`: the method's decode-time keep evicts in place, so slot order is
    # not time order (runtime/kv/slot_order.py); otherwise slots are in time order (positions read by hooks:
    # a text partition's spans)
    positions: str | None = None
    in_place: bool = False
    _by_name: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {}
        for t in self.tensors:
            if t.name in by_name:
                raise ValueError(f"KV spec: tensor {t.name!r} named twice")
            by_name[t.name] = t
        object.__setattr__(self, "_by_name", by_name)
        for enc in (self.keys, self.values):
            self._check_encoding(enc)
        if getattr(self.values, "offset", None) is not None:
            raise ValueError("KV spec: an offset is for keys (attention ignores it on keys only)")
        for s in self.summaries:
            self._need(s.tensor, Extent.PAGE, "summary")
        positions = self._need(self.positions, Extent.TOKEN, "positions")
        if self.in_place and positions is None:
            raise ValueError("KV spec: a keep in place needs the slots' positions")
        if positions is not None and (positions.dtype != torch.int32 or positions.shape != ()):
            raise ValueError(f"KV spec: positions {positions.name!r} are one int32 per slot, got "
                             f"{positions.dtype}{list(positions.shape)}")

    def _need(self, name: str | None, extent: Extent, what: str) -> TensorSpec | None:
        if name is None:
            return None
        t = self._by_name.get(name)
        if t is None:
            raise ValueError(f"KV spec: {what} names tensor {name!r}, which the spec does not list")
        if t.extent is not extent:
            raise ValueError(f"KV spec: {what} tensor {name!r} is stored per {t.extent.value}, not per "
                             f"{extent.value}")
        return t

    def _check_encoding(self, enc: Encoding) -> None:
        if isinstance(enc, Dense):
            t = self._need(enc.tensor, Extent.TOKEN, "dense")
            if enc.channels is not None and not 0 < enc.channels <= t.shape[-1]:
                raise ValueError(f"KV spec: dense {enc.tensor!r} read as its first {enc.channels} channels of "
                                 f"{t.shape[-1]}")
            return
        if isinstance(enc, Delta):
            for name, extent in ((enc.latent, Extent.TOKEN), (enc.neighbours, Extent.TOKEN), (enc.centers, Extent.PAGE),
                                 (enc.sinks, Extent.SEQ), (enc.window, Extent.SEQ), (enc.down, Extent.LAYER),
                                 (enc.up, Extent.LAYER), (enc.bias, Extent.LAYER)):
                self._need(name, extent, "delta")
            if self.keys is not self.values and self.keys != self.values:
                raise ValueError("KV spec: a delta code covers keys and values: both operands are the one encoding")
            shares = self.tensor(enc.neighbours).shape
            window = self.tensor(enc.window).shape[0]
            if window != 2 * enc.recent or len(shares) != 1 or not 1 <= shares[0] <= enc.count:
                raise ValueError(f"KV spec: delta window [2 recent, 2 D] and neighbours [ceil(count / Hkv)], got "
                                 f"{list(self.tensor(enc.window).shape)}, {list(self.tensor(enc.neighbours).shape)}")
            return
        if isinstance(enc, LowRank):
            latent = self._need(enc.latent, Extent.TOKEN, "latent")
            down, up = self._need(enc.down, Extent.LAYER, "down projection"), self._need(enc.up, Extent.LAYER, "up "
                                                                                              "projection")
            rank = enc.group * latent.shape[-1]
            if len(latent.shape) != 1 or not latent.dtype.is_floating_point or any(
                    len(t.shape) != 2 or t.shape[1] != rank or not t.dtype.is_floating_point for t in (down, up)):
                raise ValueError(f"KV spec: low-rank {enc.latent!r} stores [rank / group] floats per KV head, its "
                                 f"projections [head_dim, rank] (rank {rank} = group {enc.group} x "
                                 f"{list(latent.shape)}); got {list(down.shape)}, {list(up.shape)}")
            return
        codes = self._need(enc.codes, Extent.TOKEN, "codes")
        groups = Extent.LAYER if enc.format else Extent.TOKEN if enc.axis == "channel" else Extent.PAGE
        scale = self._need(enc.scale, groups, "scale")
        self._need(enc.zero, groups, "zero point")
        resid = self._need(enc.residual, Extent.SEQ, "residual")
        offset = self._need(enc.offset, Extent.LAYER, "offset")
        if offset is not None and (len(offset.shape) != 1 or not offset.dtype.is_floating_point):
            raise ValueError(f"KV spec: offset {offset.name!r} is one float vector [head_dim] per KV head, got "
                             f"{offset.dtype}{list(offset.shape)}")
        if enc.flush_block and resid.shape[0] < enc.flush_block + 1:
            raise ValueError(f"KV spec: residual {resid.name!r} holds {resid.shape[0]} slots; a flush block of "
                             f"{enc.flush_block} needs {enc.flush_block + 1} (the block and the token past it)")
        if enc.axis == "token" and self.tensor(enc.scale).shape[0] != 1:
            raise ValueError(f"KV spec: scale {enc.scale!r} of groups over tokens is [1, D] per page, got "
                             f"{list(self.tensor(enc.scale).shape)}")
        if enc.format is not None:
            if codes.dtype != FLOAT_CODES[enc.format][0] or scale.shape != (1,) or not scale.dtype.is_floating_point:
                raise ValueError(f"KV spec: {enc.format} codes {codes.name!r} are {FLOAT_CODES[enc.format][0]} with a "
                                 f"scale of shape [1] (in the model dtype), got {codes.dtype} and "
                                 f"{scale.dtype}{list(scale.shape)}")
        elif codes.dtype.is_floating_point:
            raise ValueError(f"KV spec: codes tensor {codes.name!r} must be an integer dtype")

    # ---- lookups -------------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def of(self, extent: Extent) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.tensors if t.extent is extent)

    @property
    def dense(self) -> bool:
        """K and V stored as plain tensors (the engine's dense kernels read them)."""
        return isinstance(self.keys, Dense) and isinstance(self.values, Dense)

    @property
    def kv_tensors(self) -> frozenset[str]:
        """The tensors attention reads K and V from."""
        return frozenset(_encoding_tensors(self.keys) | _encoding_tensors(self.values))

    @property
    def method_tensors(self) -> tuple[TensorSpec, ...]:
        """Per-token tensors that are the method's own (state planes), not K/V, summaries or positions."""
        summaries = {s.tensor for s in self.summaries}
        return tuple(t for t in self.tensors if t.extent is Extent.TOKEN and t.name not in self.kv_tensors
                     and t.name not in summaries and t.name != self.positions)

    # ---- bytes ---------------------------------------------------------------------------------
    def bytes_per_token(self, num_kv_heads: int) -> int:
        """TOKEN tensors: bytes one stored token costs in one layer."""
        return num_kv_heads * sum(t.bytes for t in self.of(Extent.TOKEN))

    def bytes_per_page(self, num_kv_heads: int, page_size: int) -> int:
        """Bytes one page of the pool costs (one layer's `page_size` slots): what the pool is divided by."""
        per_page = num_kv_heads * sum(t.bytes for t in self.of(Extent.PAGE))
        return self.bytes_per_token(num_kv_heads) * page_size + per_page

    def bytes_per_row(self, num_kv_heads: int, num_layers: int) -> int:
        """SEQ tensors: bytes one sequence's row costs, every layer."""
        return num_layers * num_kv_heads * sum(t.bytes for t in self.of(Extent.SEQ))

    def bytes_per_layers(self, num_kv_heads: int, num_layers: int) -> int:
        """LAYER tensors: bytes stored once for the whole pool (every layer)."""
        return num_layers * num_kv_heads * sum(t.bytes for t in self.of(Extent.LAYER))

    @property
    def exact_chunks(self) -> bool:
        """Does a prefill chunk read K or V of its own tokens as computed (`Quantized.exact_chunk`)?"""
        return any(isinstance(e, (Quantized, LowRank, Delta)) and e.exact_chunk for e in (self.keys, self.values))

    @property
    def delta(self) -> Delta | None:
        """The delta code K and V share, if the spec stores one."""
        return self.keys if isinstance(self.keys, Delta) else None

    @property
    def low_rank(self) -> bool:
        """Is K or V stored as low-rank latents (`LowRank`)?"""
        return isinstance(self.keys, LowRank) or isinstance(self.values, LowRank)

    @property
    def prerope(self) -> bool:
        """Are keys stored before RoPE (`LowRank.prerope`, `Delta`): read at their slots' positions?"""
        return (isinstance(self.keys, LowRank) and self.keys.prerope) or isinstance(self.keys, Delta)

    @property
    def uses_rows(self) -> bool:
        return bool(self.of(Extent.SEQ))

    def with_dense(self, which: tuple[str, ...], head_dim: int, dtype: torch.dtype) -> KVSpec:
        """The spec with the operands in `which` ("k", "v") stored dense in `dtype` instead: their
        encodings' own tensors dropped, a plain `[head_dim]` TOKEN tensor each in their place (a layer
        where the .kvm's `store ... where LAYERS` does not apply; `StorageClasses`)."""
        if not which:
            return self
        if isinstance(self.keys, Delta) and set(which) != {K, V}:
            raise ValueError(f"a delta code covers keys and values: a layer stores both dense or neither, got {which}")
        keys, values, dropped, added = self.keys, self.values, set(), []
        for name in which:
            enc = self.keys if name == K else self.values
            if isinstance(enc, Dense):
                continue
            dropped |= _encoding_tensors(enc)
            added.append(TensorSpec(name, Extent.TOKEN, dtype, (head_dim,)))
            keys, values = (Dense(K), values) if name == K else (keys, Dense(V))
        tensors = tuple(added) + tuple(t for t in self.tensors if t.name not in dropped)
        return replace(self, tensors=tensors, keys=keys, values=values)

    @property
    def latent(self) -> bool:
        """Values are a view of the keys' tensor (`with_latent_values`): written with the keys."""
        keys, values = self.keys, self.values
        if isinstance(keys, Dense) and isinstance(values, Dense):
            return values.tensor == keys.tensor and values.channels is not None
        return (isinstance(keys, Quantized) and isinstance(values, Quantized) and values.codes == keys.codes
                and values.channels is not None)

    def with_latent_values(self, channels: int) -> KVSpec:
        """The spec over MLA's absorbed attention (runtime/models/glm4_moe_lite.py), whose values are the
        keys' first `channels` (the latent): the values' own tensors dropped, values read as that view of
        the keys' (dense K, or FP8 codes with their one scale), so a token costs its keys' bytes only
        (docs/design.md, "MLA"). Other encodings, and page summaries of values, are errors."""
        keys, values = self.keys, self.values
        if any(s.source == V for s in self.summaries):
            raise ValueError("a latent cache stores no values of their own: no page summary may be of values")
        if keys == Dense(K) and values == Dense(V):
            return replace(self, tensors=tuple(t for t in self.tensors if t.name != V), values=Dense(K, channels))
        fp8 = [isinstance(e, Quantized) and e.format is not None and e.rotation is None for e in (keys, values)]
        if all(fp8) and (keys.format, keys.scaling, keys.shared_heads) == (values.format, values.scaling,
                                                                           values.shared_heads):
            dropped = _encoding_tensors(values)
            return replace(self, tensors=tuple(t for t in self.tensors if t.name not in dropped),
                           values=replace(keys, group=channels, channels=channels))
        raise ValueError(f"a latent cache reads values from the keys' tensor: keys and values must be stored dense or "
                         f"as FP8 codes of one format and scaling, got {type(keys).__name__} keys and "
                         f"{type(values).__name__} values")

    def describe(self) -> str:
        """One line per tensor (logs, `kvc` messages)."""
        return "; ".join(f"{t.name}: {t.extent.value} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                         f"{' ' + t.packing if t.packing else ''}" for t in self.tensors)


def flushed(length: int, block: int) -> int:
    """Slots [0, flushed) of a layer of `length` slots have their codes, under a flush block (0 for
    an empty layer, and for a padding row's, whose step "starts" before slot 0)."""
    return 0 if length <= 0 else block * ((length - 1) // block)


def flush_from(first: int, held: int, block: int) -> int:
    """The first slot of the blocks that a step storing slots from `first` on quantizes, its sequence's
    window holding the `held` slots before `first`: `flushed(first)`, or the first block boundary the
    window reaches back to where it holds less. (A sequence that starts at a prefix-cache hit, a whole
    number of blocks, holds nothing: the blocks before it have their codes in the shared pages.)"""
    start = first - held
    return max(flushed(first, block), 0 if start <= 0 else -(-start // block) * block)


def _encoding_tensors(enc: Encoding) -> set[str]:
    """The tensors one operand's encoding reads."""
    if isinstance(enc, Dense):
        return {enc.tensor}
    if isinstance(enc, LowRank):
        return {enc.latent, enc.down, enc.up}
    if isinstance(enc, Delta):
        return {n for n in (enc.latent, enc.neighbours, enc.centers, enc.sinks, enc.window, enc.down, enc.up,
                            enc.bias) if n}
    return {n for n in (enc.codes, enc.scale, enc.zero, enc.residual, enc.offset) if n}


@dataclass(frozen=True)
class StorageClasses:
    """The KV specs of a method's layers: `specs[layer_class[l]]` is layer l's. Layers of one class
    share a page pool and a store (runtime/kv/page_pool.py `PagePools`, runtime/attention/backend.py);
    most methods have one class, a `store ... where LAYERS` in its .kvm two (docs/design.md, "Storage
    classes")."""

    specs: tuple[KVSpec, ...]
    layer_class: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.specs or any(not 0 <= c < len(self.specs) for c in self.layer_class):
            raise ValueError(f"storage classes: {len(self.specs)} specs, layer classes {self.layer_class}")
        if set(self.layer_class) != set(range(len(self.specs))):
            raise ValueError(f"storage classes: a spec no layer uses (layer classes {self.layer_class})")

    @classmethod
    def of_layers(cls, specs: list[KVSpec]) -> StorageClasses:
        """The classes of per-layer specs: equal specs share a class, numbered by first layer."""
        distinct: list[KVSpec] = []
        for spec in specs:
            if spec not in distinct:
                distinct.append(spec)
        return cls(tuple(distinct), tuple(distinct.index(spec) for spec in specs))

    @classmethod
    def single(cls, spec: KVSpec, num_layers: int) -> StorageClasses:
        return cls((spec,), (0,) * num_layers)

    @property
    def num_classes(self) -> int:
        return len(self.specs)

    def layers(self, cls: int) -> list[int]:
        """The layers of class `cls`, ascending."""
        return [layer for layer, c in enumerate(self.layer_class) if c == cls]

    def spec_of(self, layer: int) -> KVSpec:
        return self.specs[self.layer_class[layer]]

    def with_latent_values(self, channels: int) -> StorageClasses:
        """Every class's spec over MLA's latent cache (`KVSpec.with_latent_values`)."""
        return replace(self, specs=tuple(s.with_latent_values(channels) for s in self.specs))


def dense_spec(head_dim: int, dtype: torch.dtype, extra: tuple[TensorSpec, ...] = (),
               summaries: tuple[Summary, ...] = (), head_starts: bool = False) -> KVSpec:
    """K and V in the model's dtype, per token (`full` and every eviction method), plus `extra`
    tensors (per-token method state, page summaries)."""
    kv = (TensorSpec(K, Extent.TOKEN, dtype, (head_dim,)), TensorSpec(V, Extent.TOKEN, dtype, (head_dim,)))
    return KVSpec(kv + tuple(extra), summaries=summaries, head_starts=head_starts)


def state_plane(name: str) -> TensorSpec:
    """A method's per-token float32 state (one value per slot and KV head), paged with K/V."""
    return TensorSpec(name, Extent.TOKEN, torch.float32)
