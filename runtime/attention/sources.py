"""Where attention reads K and V from: a dense paged tensor, a `QuantizedPages` or a `LowRankPages` source.

Every attention op (torch_ops.py and the generated kernels, kernels_generated/_attention/) takes
its K and its V operand independently as either

- a dense tensor `[pages, Hkv, page_size, D]` in the model dtype (the `Dense` encoding of the KV
  spec, runtime/kv/spec.py: unchanged since the engine's first kernels), or
- a `QuantizedPages`: integer codes, scales and zero points at the same page ids and slots, plus,
  optionally, this layer's full-precision residual window (a SEQ tensor, one row per sequence);
- a `LowRankPages`: each KV head's share of its head group's latent, and the layer's projections
  (runtime/kv/lowrank.py); keys stored before RoPE are rotated at their slots' positions.

`kernel_operand` turns either into what the generated Triton wrappers pass to their kernels, so
the generated modules share one reading of a source. The encoding arithmetic is
runtime/kv/encodings.py; docs/compiler.md, "The engine's attention kernels", has the rules.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvc.runtime.kv import encodings, lowrank, rotation
from kvc.runtime.kv.spec import LowRank, Quantized


@dataclass(frozen=True)
class QuantizedPages:
    """One attention operand (K or V) stored quantized in the paged pool.

    `codes [P, Hkv, S, Dc]`, `scale [P, Hkv, S, G]` and `zero [P, Hkv, S, G]` (None when the
    encoding is symmetric) share page ids and slots with every other per-token tensor; `G = D //
    enc.group`, `Dc = D / codes per element` (the packing follows from Dc). Slots decode to `dtype`
    (the model dtype). `residual [R_rows, Hkv, R, D]` (optional, in `dtype`): this layer's slice of
    the SEQ residual tensor, slot t of the sequence in row r at `residual[r, h, t % R]`; the ops read
    a row's newest `resid_lens[b]` slots from it instead of the codes (and `store_kv` writes both).
    Build one per layer once: the checks run at construction."""

    enc: Quantized
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    head_dim: int
    dtype: torch.dtype
    residual: torch.Tensor | None = None

    def __post_init__(self) -> None:
        name = f"quantized {self.enc.codes!r}"
        if self.codes.dim() != 4:
            raise ValueError(f"{name}: codes must be [pages, kv_heads, page_size, stored], got "
                             f"{tuple(self.codes.shape)}")
        encodings.check(self.enc, self.head_dim, self.codes.dtype,
                        encodings.packing_of(self.head_dim, self.codes.shape[-1]))
        want = (*self.codes.shape[:3], self.head_dim // self.enc.reader.group)
        if tuple(self.scale.shape) != want or not self.scale.dtype.is_floating_point:
            raise ValueError(f"{name}: scale must be a floating [{', '.join(map(str, want))}], got "
                             f"{self.scale.dtype} {tuple(self.scale.shape)}")
        if (self.zero is None) != self.enc.symmetric:
            raise ValueError(f"{name}: a zero point tensor is needed exactly when the encoding is asymmetric")
        if self.zero is not None and (tuple(self.zero.shape) != want or self.zero.stride() != self.scale.stride()
                                      or not self.zero.dtype.is_floating_point):
            raise ValueError(f"{name}: zero must be a floating tensor shaped and strided like scale {want}")
        if self.residual is not None:
            r = self.residual
            heads = self.codes.shape[1]
            if r.dim() != 4 or r.shape[1] != heads or r.shape[3] != self.head_dim or r.dtype != self.dtype:
                raise ValueError(f"{name}: residual must be {self.dtype} [rows, {self.codes.shape[1]}, window, "
                                 f"{self.head_dim}], got {r.dtype} {tuple(r.shape)}")
        tensors = (self.codes, self.scale, self.zero, self.residual)
        if any(t is not None and t.stride(-1) != 1 for t in tensors):
            raise ValueError(f"{name}: codes, scale, zero and residual need a contiguous last axis")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[pages, Hkv, page_size, D], as a dense cache would be."""
        return (*self.codes.shape[:3], self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @functools.cached_property  # built once per layer; every kernel launch reads these
    def packing(self) -> str:
        return encodings.packing_of(self.head_dim, self.codes.shape[-1])

    @functools.cached_property
    def per_element(self) -> int:
        """Codes per packed unit (1, 2, 4, or 8 in 3 bytes: `int3x8`)."""
        return encodings.PACKINGS[self.packing][0]

    @functools.cached_property
    def rotation(self) -> torch.Tensor | None:
        """R [D, D] in the model dtype for a rotated encoding (runtime/kv/rotation.py), else None."""
        kind = self.enc.rotation
        return None if kind is None else rotation.on(self.head_dim, kind, self.codes.device, self.dtype)

    @functools.cached_property
    def levels(self) -> torch.Tensor | None:
        """The float32 levels codebook codes index (None: codes count steps)."""
        return None if self.enc.codebook is None else encodings.levels(self.enc.reader, self.codes.device)

    @property
    def window(self) -> int:
        """Slots of the residual window (0 without one)."""
        return 0 if self.residual is None else self.residual.shape[2]


@dataclass(frozen=True)
class LowRankPages:
    """One attention operand stored as a low-rank latent per group of KV heads (runtime/kv/spec.py,
    `LowRank`): `latent [P, Hkv, S, rank / group]` at the pool's page ids and slots, this layer's
    `down` and `up` [Hkv, D, rank]; `inv_freq` [D / 2] (the model's RoPE) for keys stored before
    RoPE, else None. Slot s of a sequence's pages decodes at position s."""

    enc: LowRank
    latent: torch.Tensor
    down: torch.Tensor
    up: torch.Tensor
    head_dim: int
    dtype: torch.dtype
    inv_freq: torch.Tensor | None = None
    residual = None  # no residual window (the ops' `reads_residual`)
    window = 0

    def __post_init__(self) -> None:
        name = f"low-rank {self.enc.latent!r}"
        heads = self.latent.shape[1]
        rank = self.enc.group * self.latent.shape[-1]
        if heads % self.enc.group:
            raise ValueError(f"{name}: groups of {self.enc.group} KV heads do not divide the model's {heads}")
        for what, t in (("down", self.down), ("up", self.up)):
            if tuple(t.shape) != (heads, self.head_dim, rank):
                raise ValueError(f"{name}: {what} must be [{heads}, {self.head_dim}, {rank}], got {tuple(t.shape)}")
        if self.enc.prerope and self.inv_freq is None:
            raise ValueError(f"{name}: keys stored before RoPE are read with the model's RoPE frequencies")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[pages, Hkv, page_size, D], as a dense cache would be."""
        return (*self.latent.shape[:3], self.head_dim)

    @property
    def device(self) -> torch.device:
        return self.latent.device

    @property
    def rope(self) -> torch.Tensor | None:
        return self.inv_freq if self.enc.prerope else None

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """New rows x [n, Hkv, D] at `positions` [n] as their stored latents [n, Hkv, rank / group]."""
        return lowrank.encode(x, self.down, self.enc.group, positions, self.rope).to(self.latent.dtype)

    def decode(self, latent: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Latents [..., Hkv, L, rank / group] at `positions` [L] (or [..., L]) as rows [..., Hkv, L, D]."""
        return lowrank.decode(latent, self.up, self.enc.group, positions, self.rope).to(self.dtype)


Source = torch.Tensor | QuantizedPages | LowRankPages


def within_keys(v_cache: Source, k_cache: Source) -> bool:
    """Are the values a view inside the keys' tensor or codes (a latent cache: `KVSpec.with_latent_values`)?
    Then they are written with the keys, never on their own."""
    def stored(source: Source) -> torch.Tensor | None:
        return source if is_dense(source) else getattr(source, "codes", None)

    k, v = stored(k_cache), stored(v_cache)
    return (k is not None and v is not None and v_cache is not k_cache
            and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr())


def is_dense(source: Source) -> bool:
    return isinstance(source, torch.Tensor)


# ---- what the generated Triton wrappers pass (no Triton import here) ----------------------------------


@dataclass(frozen=True)
class KernelOperand:
    """A source as kernel arguments: `data` (the dense cache or the codes) with its page, head and
    slot strides; scale, zero, codebook levels, residual and rotation pointers (a stand-in tensor when
    absent: never read) and their strides; the constexprs. `bits` 0 means dense; `window` 0 means no
    residual reads or writes; `book` 0 means codes count steps, else the codebook's level count;
    `rotated`: stored as `x @ R.T`, R [D, D] at `rotation` (the store rotates new rows, the attention
    kernels the query or their output)."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    levels: torch.Tensor
    residual: torch.Tensor
    strides: tuple[int, ...]  # data p, h, s; scale (= zero) p, h, s; residual row, h, slot
    bits: int
    per_element: int
    group: int
    asymmetric: bool
    window: int
    flush: int = 0
    book: int = 0
    fresh: bool = False  # a prefill chunk reads its own slots from its keys / values as computed
    rotation: torch.Tensor | None = None

    @property
    def rotated(self) -> bool:
        return self.rotation is not None

    @property
    def rotation_arg(self) -> torch.Tensor:
        """`{x}_rot_ptr`: R, or a stand-in never read."""
        return self.rotation if self.rotation is not None else self.scale

    def args(self) -> tuple:
        """The kernels' operand parameters in order: `{x}_cache_ptr, {x}_scale_ptr, {x}_zero_ptr,
        {x}_book_ptr, {x}_resid_ptr, {x}_rot_ptr`, then the nine strides
        (compiler/templates/paged_attention.py.jinja, `operand_params`)."""
        return (self.data, self.scale, self.zero, self.levels, self.residual, self.rotation_arg, *self.strides)

    def constants(self, prefix: str) -> dict:
        """The kernels' operand constexprs, `{X}_BITS` ... `{X}_ROT` (`operand_consts`)."""
        return {f"{prefix}_BITS": self.bits, f"{prefix}_PER_ELEMENT": self.per_element, f"{prefix}_GROUP": self.group,
                f"{prefix}_ASYM": self.asymmetric, f"{prefix}_WINDOW": self.window, f"{prefix}_FLUSH": self.flush,
                f"{prefix}_BOOK": self.book, f"{prefix}_FRESH": self.fresh, f"{prefix}_ROT": self.rotated}


def fp8_latent_sources(codes: torch.Tensor, scale: float, rank: int,
                       dtype: torch.dtype) -> tuple[QuantizedPages, QuantizedPages]:
    """(keys, values) over an FP8 latent cache's codes [pages + 1, 1, page, rank + rope] (the last page the
    scratch page) with the layer's one scale, as the backend builds a layer of `fp8` on MLA (values: the keys'
    first `rank` codes); for tests and benches of the latent kernels."""
    from kvc.runtime.kv.spec import Extent, KVSpec, TensorSpec
    from kvc.runtime.kv.store import KVStore

    width = codes.shape[-1]
    fmt = next(name for name, (code, _) in encodings.FLOAT_CODES.items() if code == codes.dtype)
    tensors = tuple(TensorSpec(n, e, t, shape) for n, e, t, shape in (
        ("k_codes", Extent.TOKEN, codes.dtype, (width,)), ("k_scale", Extent.LAYER, dtype, (1,)),
        ("v_codes", Extent.TOKEN, codes.dtype, (width,)), ("v_scale", Extent.LAYER, dtype, (1,))))
    enc = dict(format=fmt, scaling="unit", shared_heads=True)
    spec = KVSpec(tensors, keys=Quantized("k_codes", "k_scale", 8, width, **enc),
                  values=Quantized("v_codes", "v_scale", 8, width, **enc)).with_latent_values(rank)
    store = KVStore.from_tensors(spec, {"k_codes": codes, "k_scale": torch.full((1, 1, 1), scale, dtype=dtype,
                                                                                  device=codes.device)}, 1)
    return tuple(QuantizedPages(e, e.view(store[e.codes]), store.scale_slots(e.scale, 0), None, d, dtype)
                 for e, d in ((spec.keys, width), (spec.values, rank)))


def kernel_operand(source: Source, use_residual: bool) -> KernelOperand:
    """`source` as kernel arguments; `use_residual`: the op reads (or writes) residual windows (it
    was given the rows and, to read, resid_lens), so a source with a residual passes its window."""
    if is_dense(source):
        s = source.stride()
        return KernelOperand(source, source, source, source, source, (s[0], s[1], s[2], 0, 0, 0, 0, 0, 0), 0, 1, 1,
                             False, 0)
    resid = source.residual if use_residual else None
    cs, ss = source.codes.stride(), source.scale.stride()
    rs = resid.stride() if resid is not None else (0, 0, 0, 0)
    levels = source.levels
    return KernelOperand(
        source.codes, source.scale, source.zero if source.zero is not None else source.scale,
        levels if levels is not None else source.scale, resid if resid is not None else source.scale,
        (cs[0], cs[1], cs[2], ss[0], ss[1], ss[2], rs[0], rs[1], rs[2]),
        source.enc.bits, source.per_element, source.enc.reader.group, not source.enc.symmetric,
        0 if resid is None else resid.shape[2], source.enc.flush_block, 0 if levels is None else levels.numel(),
        resid is not None or source.enc.prefill_exact, source.rotation)
