"""Quantized K/V encodings in plain PyTorch: the reference of every kernel that reads or writes them.

A `Quantized` encoding (runtime/kv/spec.py) stores each token's `D` channels as integer codes with
one scale (and, asymmetric, one zero point) per group of `group` channels (or, groups over tokens,
per channel and group of `group` tokens):

- symmetric: signed codes in [-qmax, qmax], qmax = 2^(bits-1) - 1, `scale = absmax / qmax`,
  `code = floor(x / scale + 0.5)` clamped, `x = code * scale`;
- asymmetric (KIVI's arithmetic): unsigned codes in [0, 2^bits - 1], `scale = (max - min) /
  (2^bits - 1)`, the zero point is the group's minimum, `code = round(clamp((x - min) / scale, 0,
  2^bits - 1))` with ties to even (KIVI's `round_`), `x = code * scale + min`.

- codebook "sphere" (TurboQuant's scalar quantizer): unsigned codes in [0, 2^bits - 1] that index
  `levels(enc)`, `scale = sqrt(sum(x^2) / group)` (the group's RMS), `code` = the number of
  midpoints between consecutive levels that `x / scale` exceeds (the nearest level), `x =
  levels[code] * scale`.

Arithmetic in float32 against the scale and zero point *as stored* (rounded to their dtypes; the
Triton store computes the same codes), so what is stored decodes to within half a step of the input
(up to that rounding); in a float32 model this is KIVI's arithmetic exactly. A group whose range is
0 (or whose scale underflows its dtype) gets scale 1. Packing (`TensorSpec.packing`):
`int4x2` / `int2x4` put 2 / 4 codes in one uint8 along the last axis, low bits first, `int3x8` 8
codes in 3 uint8 (code j of 8 at bits [3j, 3j + 3) of the little-endian 24-bit word); a signed code
is stored as its two's-complement low bits.

Float codes (FP8, `Quantized.format`): `code = fp8(clamp(x / scale, -max, max))` in float32, cast
to the format with round to nearest even (torch's cast, and the Triton store's), and `x =
float(code) * scale`; the scale is fixed per layer (`dynamic_scale` sets it once from the first
stored chunk). docs/design.md, "KV spec", has the storage rules.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvc.runtime.kv import rotation
from kvc.runtime.kv.spec import FLOAT_CODES, PACKINGS, Quantized

# vLLM's `calculate_kv_scales` constants (K_SCALE_CONSTANT, V_SCALE_CONSTANT): a dynamic scale is
# amax / range, so the first chunk's largest |x| maps to this code (448 is e4m3's largest)
DYNAMIC_RANGE = {"k": 200.0, "v": 100.0}


def code_range(enc: Quantized) -> tuple[int, int]:
    """The smallest and largest code of `enc`."""
    if enc.signed:
        qmax = 2 ** (enc.bits - 1) - 1
        return -qmax, qmax
    return 0, 2**enc.bits - 1


def packing_of(head_dim: int, stored: int) -> str:
    """The packing of codes stored as `stored` elements per token for `head_dim` channels."""
    for name, (codes, elements) in PACKINGS.items():
        if stored * codes == head_dim * elements:
            return name
    raise ValueError(f"codes of width {stored} do not hold {head_dim} channels (one, two or four codes an element, "
                     "or eight in three)")


def stored_width(head_dim: int, packing: str) -> int:
    """Elements one token's `head_dim` codes take under `packing`."""
    codes, elements = PACKINGS[packing]
    return head_dim // codes * elements


def packing_for(bits: int) -> str:
    """The packing of `bits`-bit integer codes in uint8 (8: none)."""
    return {8: "", 4: "int4x2", 3: "int3x8", 2: "int2x4"}[bits]


def check(enc: Quantized, head_dim: int, code_dtype: torch.dtype, packing: str = "") -> None:
    """ValueError unless codes of `enc` fit `code_dtype` with `packing` for `head_dim` channels."""
    if packing not in PACKINGS:
        raise ValueError(f"unknown packing {packing!r} (one of {sorted(PACKINGS)})")
    if enc.format is not None:
        if code_dtype != FLOAT_CODES[enc.format][0] or packing or enc.group != head_dim:
            raise ValueError(f"quantized {enc.codes!r}: {enc.format} codes are unpacked {FLOAT_CODES[enc.format][0]} "
                             f"with one scale per token's {head_dim} channels, got {code_dtype}, group {enc.group}")
        return
    per, elements = PACKINGS[packing]
    if enc.axis == "channel" and head_dim % enc.group:
        raise ValueError(f"quantized {enc.codes!r}: group {enc.group} does not divide head_dim {head_dim}")
    if code_dtype.is_floating_point or code_dtype == torch.bool:
        raise ValueError(f"quantized {enc.codes!r}: codes need an integer dtype, got {code_dtype}")
    if per > 1:
        if code_dtype != torch.uint8 or enc.bits * per != 8 * elements:
            raise ValueError(f"quantized {enc.codes!r}: packing {packing!r} holds {8 * elements // per}-bit codes in "
                             f"uint8, got {enc.bits}-bit codes in {code_dtype}")
        if head_dim % per:
            raise ValueError(f"quantized {enc.codes!r}: head_dim {head_dim} is not a multiple of {per} ({packing})")
        return
    lo, hi = code_range(enc)
    info = torch.iinfo(code_dtype)
    if lo < info.min or hi > info.max:
        raise ValueError(f"quantized {enc.codes!r}: codes in [{lo}, {hi}] do not fit {code_dtype}")


def pack(codes: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    """Integer codes [..., D] -> uint8 [..., D * elements // per] under `packing` (`per` codes of
    `bits` bits in `elements` bytes, low bits first)."""
    per, elements = PACKINGS[packing]
    if per == 1:
        raise ValueError("pack needs several codes per byte")
    fields = (codes.to(torch.int32) & (2**bits - 1)).unflatten(-1, (-1, per))
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    word = (fields << shifts).sum(-1)  # [..., D // per], `per * bits` = 8 * elements bits each
    parts = torch.stack([(word >> (8 * j)) & 255 for j in range(elements)], dim=-1)
    return parts.flatten(-2).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, packing: str, signed: bool) -> torch.Tensor:
    """uint8 [..., Dc] -> int32 codes [..., Dc * per // elements] under `packing` (sign-extended
    from `bits` bits when `signed`)."""
    per, elements = PACKINGS[packing]
    parts = packed.to(torch.int32).unflatten(-1, (-1, elements))
    word = sum(parts[..., j] << (8 * j) for j in range(elements))  # [..., D // per]
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    fields = (word[..., None] >> shifts) & (2**bits - 1)
    if signed:
        half = 2 ** (bits - 1)
        fields = (fields ^ half) - half
    return fields.flatten(-2)


def _stored(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`value` rounded to the storage dtype and read back as float32 (what a kernel will load)."""
    if not dtype.is_floating_point:
        raise ValueError(f"scales and zero points need a floating dtype, got {dtype}")
    return value.to(dtype).float()


def quantize(
    x: torch.Tensor,
    enc: Quantized,
    code_dtype: torch.dtype,
    *,
    packing: str = "",
    scale_dtype: torch.dtype = torch.float32,
    zero_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [..., D] -> (codes [..., D // per] code_dtype, scale [..., D // group] scale_dtype,
    zero [..., D // group] zero_dtype or None when symmetric). Groups over tokens (`enc.axis`
    "token", KIVI's keys): x [n, ..., D], n a multiple of `enc.group`, consecutive `group` tokens
    sharing one scale (and zero point) per channel: scale and zero [n // group, ..., D]. A rotated
    encoding quantizes `x @ R.T` (runtime/kv/rotation.py)."""
    head_dim = x.shape[-1]
    check(enc, head_dim, code_dtype, packing)
    x = rotation.to_stored(x, enc.rotation)
    if enc.axis == "token":
        n = x.shape[0]
        if n % enc.group:
            raise ValueError(f"quantized {enc.codes!r}: {n} tokens are not whole groups of {enc.group}")
        xf = x.float().unflatten(0, (n // enc.group, enc.group)).movedim(1, -1)  # [n/g, ..., D, group]
        codes, scale, zero = _grouped(xf, enc, scale_dtype, zero_dtype)
        codes = codes.movedim(-1, 1).flatten(0, 1)  # [n, ..., D]
    else:
        xf = x.float().unflatten(-1, (head_dim // enc.group, enc.group))  # [..., G, group]
        codes, scale, zero = _grouped(xf, enc, scale_dtype, zero_dtype)
        codes = codes.flatten(-2)
    codes = pack(codes, enc.bits, packing) if PACKINGS[packing][0] > 1 else codes.to(code_dtype)
    return codes, scale.to(scale_dtype), None if zero is None else zero.to(zero_dtype)


def _grouped(xf: torch.Tensor, enc: Quantized, scale_dtype: torch.dtype, zero_dtype: torch.dtype):
    """Float32 codes, scale and zero point of groups along the last axis of xf [..., group]."""
    lo, hi = code_range(enc)
    if enc.codebook is not None:
        scale = _stored(xf.square().mean(-1).sqrt(), scale_dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = xf / scale[..., None]
        return nearest_level(y, levels(enc, xf.device)), scale, None
    if enc.symmetric:
        scale = _stored(xf.abs().amax(-1) / hi, scale_dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        y = xf / scale[..., None]
        return torch.floor(y + 0.5).clamp(lo, hi), scale, None
    low = xf.amin(-1)
    scale = _stored((xf.amax(-1) - low) / hi, scale_dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = _stored(low, zero_dtype)
    y = ((xf - zero[..., None]) / scale[..., None]).clamp(lo, hi)
    return torch.round(y), scale, zero  # round half to even (KIVI's `round_`)


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    enc: Quantized,
    head_dim: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(codes [..., Dc], scale [..., G], zero [..., G] | None) -> x [..., D] in `dtype`; the packing
    follows from Dc (D / Dc codes per element). Arithmetic in float32: `code * scale` or
    `code * scale + zero`, then one rounding to `dtype` (the kernels compute exactly this). Groups over
    tokens are read per slot (`Quantized.reader`): scale [..., D], one per channel. A rotated encoding's
    rows are rotated back, `x @ R` in float32 before the rounding (runtime/kv/rotation.py)."""
    enc = enc.reader
    packing = packing_of(head_dim, codes.shape[-1])
    if (zero is None) != enc.symmetric:
        raise ValueError(f"quantized {enc.codes!r}: a zero point is needed exactly when asymmetric")
    code = unpack(codes, enc.bits, packing, enc.signed) if PACKINGS[packing][0] > 1 else codes
    code = levels(enc, codes.device)[code.long()] if enc.codebook is not None else code.float()
    s = scale.float().repeat_interleave(enc.group, dim=-1)
    x = code * s if zero is None else code * s + zero.float().repeat_interleave(enc.group, dim=-1)
    return rotation.to_model(x, enc.rotation).to(dtype)


# ---- codebooks (TurboQuant) ------------------------------------------------------------------------


def levels(enc: Quantized, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 2^bits float32 levels codebook codes of `enc` index, ascending (`sphere_levels`)."""
    return _levels_on(enc.bits, enc.group, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _levels_on(bits: int, dim: int, device: str) -> torch.Tensor:
    return torch.tensor(sphere_levels(bits, dim), dtype=torch.float32, device=device)


def nearest_level(y: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Codes of y (float32) against ascending levels `book`: how many midpoints between consecutive
    levels y exceeds (midpoints `(a + b) * 0.5` in float32, as the Triton store computes them)."""
    mids = (book[:-1] + book[1:]) * 0.5
    return (y[..., None] > mids).sum(-1)


@functools.lru_cache(maxsize=None)
def sphere_levels(bits: int, dim: int) -> tuple[float, ...]:
    """The Lloyd-Max quantizer with 2^bits levels of y = sqrt(dim) * u_1, one coordinate of a
    uniformly random unit vector u in `dim` dimensions (density proportional to (1 - y^2 / dim) ^
    ((dim - 3) / 2) on |y| < sqrt(dim); TurboQuant's codebook for a rotated vector over its norm,
    here over its RMS). Levels are the means of their cells and cell edges the midpoints between
    levels; Lloyd's iteration from evenly spread levels, each cell integrated by Gauss-Legendre
    quadrature, to a change below 1e-13. As dim grows the levels approach N(0, 1)'s (Max, 1960)."""
    if dim < 3 or not 1 <= bits <= 8:
        raise ValueError(f"sphere levels need dim >= 3 and 1..8 bits, got dim {dim}, {bits} bits")
    count, edge = 2**bits, float(np.sqrt(dim))
    nodes, weights = np.polynomial.legendre.leggauss(96)
    log_norm = (dim - 3) / 2

    def moments(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # mass and first moment of each cell [lo, hi], up to a common constant
        half = (hi - lo)[:, None] / 2
        y = (lo + hi)[:, None] / 2 + half * nodes[None, :]
        density = np.exp(log_norm * np.log1p(-np.minimum(y * y / dim, 1.0 - 1e-300)))
        mass = (half * weights * density).sum(1)
        return mass, (half * weights * density * y).sum(1)

    level = np.linspace(-2.0, 2.0, count) * min(1.0, 0.99 * edge / 2)  # inside the support
    for _ in range(20000):
        mids = (level[:-1] + level[1:]) / 2
        lo, hi = np.concatenate([[-edge], mids]), np.concatenate([mids, [edge]])
        mass, first = moments(lo, hi)
        new = first / mass
        done = np.abs(new - level).max() < 1e-13
        level = new
        if done:
            break
    level = (level - level[::-1]) / 2  # exactly symmetric
    return tuple(float(x) for x in level)


# ---- float codes (FP8) ------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    """`t` as bytes when it holds float codes (torch's CPU copies by index do not take FP8), else `t`."""
    return t.view(torch.uint8) if t.dtype in (dt for dt, _ in FLOAT_CODES.values()) else t


def quantize_float(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., D] -> FP8 codes [..., D] of format `fmt`: `clamp(x / scale, -max, max)` in float32,
    cast with round to nearest even; `scale` broadcasts against x (float32, > 0)."""
    dtype, largest = FLOAT_CODES[fmt]
    return (x.float() / scale.float()).clamp(-largest, largest).to(dtype)


def dynamic_scale(x: torch.Tensor, stored: torch.Tensor, shared_heads: bool, value_range: float) -> torch.Tensor:
    """The scale set from a first chunk x [T, Hkv, D] (`stored [T]`: the rows written; padding is
    not): `amax |x| / value_range`, over every KV head (`shared_heads`: [1]) or per head [Hkv, 1];
    0 where nothing was stored or every value is 0 (the scale stays unset until a chunk has some)."""
    amax = torch.where(stored[:, None, None], x.float().abs(), torch.zeros((), device=x.device)).amax(dim=(0, 2))
    if shared_heads:
        amax = amax.amax().expand(amax.shape)
    return (amax / value_range)[:, None]
