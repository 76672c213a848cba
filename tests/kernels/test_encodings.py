"""Quantized K/V encodings (runtime/kv/encodings.py): round trips within half a step, codes in range,
packing round trips, degenerate groups, and the dtype checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.runtime.kv import encodings
from kvc.runtime.kv.spec import Quantized

# (bits, packing, codes dtype of a symmetric and of an asymmetric encoding)
LAYOUTS = [(8, "", torch.int8, torch.uint8), (4, "", torch.int8, torch.uint8), (4, "int4x2", torch.uint8, torch.uint8),
           (2, "int2x4", torch.uint8, torch.uint8), (2, "", torch.int8, torch.int16)]


def encoding(bits: int, group: int, symmetric: bool) -> Quantized:
    return Quantized("codes", "scale", bits, group, zero=None if symmetric else "zero")


@settings(max_examples=60, deadline=None)
@given(layout=st.sampled_from(LAYOUTS), symmetric=st.booleans(), groups=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([4, 8, 16]), tokens=st.integers(1, 5), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 50.0]), offset=st.sampled_from([0.0, 3.0]))
def test_round_trip_within_half_a_step(layout, symmetric, groups, group, tokens, seed, spread, offset):
    bits, packing, sym_dtype, asym_dtype = layout
    enc = encoding(bits, group, symmetric)
    head_dim = groups * group
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 3, head_dim, generator=gen) * spread + offset
    codes, scale, zero = encodings.quantize(x, enc, sym_dtype if symmetric else asym_dtype, packing=packing)
    assert codes.shape == (tokens, 3, encodings.stored_width(head_dim, packing))
    assert scale.shape == (tokens, 3, groups) and (zero is None) == symmetric
    back = encodings.dequantize(codes, scale, zero, enc, head_dim, torch.float32)
    step = scale.repeat_interleave(group, dim=-1)
    # half a step, plus float32 rounding of x / scale (+ zero) relative to the codes' magnitude
    slack = step * (2 ** bits) * 2e-7 + 1e-7 * x.abs()
    assert ((x - back).abs() <= step / 2 + slack).all()
    lo, hi = encodings.code_range(enc)
    raw = encodings.unpack(codes, bits, packing, symmetric) if packing else codes.long()
    assert lo <= int(raw.min()) and int(raw.max()) <= hi


@settings(max_examples=40, deadline=None)
@given(bits_packing=st.sampled_from([(4, "int4x2"), (2, "int2x4"), (3, "int3x8")]), signed=st.booleans(),
       width=st.sampled_from([8, 16, 24]), seed=st.integers(0, 2**16))
def test_packing_round_trips(bits_packing, signed, width, seed):
    bits, packing = bits_packing
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    codes = torch.randint(lo, hi + 1, (3, width), generator=torch.Generator().manual_seed(seed))
    packed = encodings.pack(codes, bits, packing)
    assert packed.dtype == torch.uint8 and packed.shape == (3, encodings.stored_width(width, packing))
    assert torch.equal(encodings.unpack(packed, bits, packing, signed), codes.int())
    # low bits first: the first code of a byte sits in its lowest bits
    assert torch.equal(packed[:, 0].int() & (2**bits - 1), codes[:, 0].int() & (2**bits - 1))


def test_constant_and_zero_groups_decode_exactly():
    x = torch.tensor([[0.0] * 8 + [2.5] * 8])
    for symmetric in (True, False):
        enc = encoding(4, 8, symmetric)
        codes, scale, zero = encodings.quantize(x, enc, torch.uint8, packing="int4x2")
        back = encodings.dequantize(codes, scale, zero, enc, 16, torch.float32)
        assert torch.equal(back[:, :8], x[:, :8])
        if not symmetric:  # a constant group is its zero point
            assert torch.equal(back, x)
        assert (scale > 0).all()


def test_stored_scales_round_before_the_codes_are_chosen():
    """Codes are chosen against the scale as stored (fp16 here), so the round trip through the
    stored values stays within half a stored step (plus the clamp of a rounded-down scale)."""
    enc = encoding(8, 16, False)
    x = torch.randn(7, 2, 32, generator=torch.Generator().manual_seed(3)) * 3 + 1
    codes, scale, zero = encodings.quantize(x, enc, torch.uint8, scale_dtype=torch.float16, zero_dtype=torch.float16)
    assert scale.dtype == torch.float16 and zero.dtype == torch.float16
    back = encodings.dequantize(codes, scale, zero, enc, 32, torch.float32)
    step = scale.float().repeat_interleave(16, dim=-1)
    assert ((x - back).abs() <= step * (0.5 + 255 * 2**-11) + 1e-6).all()


def test_dequantize_rounds_once_to_the_model_dtype():
    enc = encoding(8, 8, True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
    codes, scale, zero = encodings.quantize(x, enc, torch.int8)
    want = (codes.float() * scale.repeat_interleave(8, -1)).to(torch.bfloat16)
    assert torch.equal(encodings.dequantize(codes, scale, zero, enc, 16, torch.bfloat16), want)


@pytest.mark.parametrize("bits,packing,dtype,symmetric,message", [
    (8, "", torch.int8, False, "do not fit"),
    (8, "", torch.float16, True, "integer dtype"),
    (4, "int4x2", torch.int8, True, "uint8"),
    (2, "int4x2", torch.uint8, True, "uint8"),
    (4, "int2x4", torch.uint8, False, "uint8"),
])
def test_bad_code_dtypes_are_refused(bits, packing, dtype, symmetric, message):
    with pytest.raises(ValueError, match=message):
        encodings.quantize(torch.zeros(2, 16), encoding(bits, 8, symmetric), dtype, packing=packing)


def test_group_must_divide_head_dim():
    with pytest.raises(ValueError, match="does not divide"):
        encodings.quantize(torch.zeros(2, 12), encoding(8, 8, True), torch.int8)
    with pytest.raises(ValueError, match="do not hold"):
        encodings.dequantize(torch.zeros(2, 5, dtype=torch.uint8), torch.ones(2, 2), None, encoding(4, 8, True), 16,
                             torch.float32)
