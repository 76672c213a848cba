"""The decode kernel's fast paths over quantized K/V (compiler/templates/paged_spec.py.jinja): the inline PTX that
unpacks 2- and 4-bit codes (`_unpack_asm`, checked here by executing its few instructions in Python for every
byte), and, on a GPU, the spec kernel in bf16 (scales folded out of the dot, codes unpacked by PTX, packed
fused multiply-adds) against the torch ops, which dequantize first (runtime/kv/encodings.py), for the methods whose
encodings take each path: KIVI (per-channel keys with page scales, per-token value groups, residual windows),
TurboQuant (codebook levels, one scale a slot) and FP8 (one scale a layer)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvc.compiler import attention
from kvc.runtime.attention import torch_ops

pytest.importorskip("triton")


def _spec_module():
    spec = importlib.util.spec_from_file_location("kvc_spec_fast", attention.locate("spec"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _half(bits: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(dtype)


def _run_ptx(asm: str, inputs: dict[int, int], outputs: int, dtype: torch.dtype) -> list[int]:
    """Executes the PTX subset the decode kernels' inline assembly uses (prmt, shr, shl, and, mad, lop3, mov, fma on
    16-bit pairs) on 32-bit input registers `{n: value}` ($n); returns registers $0 .. $outputs - 1."""
    regs = {f"${n}": v for n, v in inputs.items()}
    luts = {0x6A: lambda a, b, c: (a & b) ^ c, 0xD8: lambda a, b, c: (a & ~c) | (b & c),
            0xEA: lambda a, b, c: (a & b) | c}

    def val(x: str) -> int:
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    def byte(data: bytes, nibble: int) -> int:
        b = data[nibble & 7]
        return (0xFF if b & 0x80 else 0) if nibble & 8 else b  # the selector's top bit: replicate the sign

    for line in asm.replace("{", "").replace("}", "").split(";"):
        parts = line.replace(",", " ").split()
        if not parts or parts[0] == ".reg":
            continue
        if parts[0] == "mov.b32" and len(parts) == 4:  # mov.b32 {$a, $b}, t: t's halves to two 16-bit registers
            regs[parts[1]], regs[parts[2]] = val(parts[3]) & 0xFFFF, val(parts[3]) >> 16
            continue
        op, dst, args = parts[0], parts[1], [val(a) for a in parts[2:]]
        if op == "prmt.b32":
            data = args[0].to_bytes(4, "little") + args[1].to_bytes(4, "little")
            regs[dst] = int.from_bytes(bytes(byte(data, args[2] >> (4 * i)) for i in range(4)), "little")
        elif op == "shr.b32":
            regs[dst] = args[0] >> args[1]
        elif op == "shl.b32":
            regs[dst] = (args[0] << args[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = args[0] & args[1]
        elif op == "mad.lo.u32":
            regs[dst] = (args[0] * args[1] + args[2]) & 0xFFFFFFFF
        elif op == "lop3.b32":
            regs[dst] = luts[args[3]](*args[:3]) & 0xFFFFFFFF
        elif op == "mov.b32":
            regs[dst] = args[0]
        elif op.startswith("fma.rn."):
            lanes = []
            for shift in (0, 16):
                a, b, c = (_half(x >> shift, dtype).double() for x in args)
                exact = a * b + c
                assert exact.to(dtype).double() == exact  # every value involved is exact
                lanes.append(int(exact.to(dtype).view(torch.int16).item()) & 0xFFFF)
            regs[dst] = lanes[0] | lanes[1] << 16
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return [regs[f"${i}"] for i in range(outputs)]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("signed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_unpacking_ptx_decodes_every_byte(bits: int, signed: bool, dtype: torch.dtype) -> None:
    asm = _spec_module()._unpack_asm(bits, signed, "bf16" if dtype == torch.bfloat16 else "f16")
    fields = 8 // bits
    for first in range(0, 256, 4):
        data = [first, first + 1, first + 2, first + 3]
        out = _run_ptx(asm, {2 * fields: int.from_bytes(bytes(data), "little")}, 2 * fields, dtype)
        for k in range(fields):  # output k: field k of bytes 0, 1 (first register), 2, 3 (second)
            for i, byte in enumerate(data):
                lane = out[2 * k + i // 2] >> (16 * (i % 2))
                code = (byte >> (bits * k)) & ((1 << bits) - 1)
                if signed and code >= 1 << (bits - 1):
                    code -= 1 << bits
                assert _half(lane, dtype).item() == code, (bits, signed, byte, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_levels_ptx_looks_up_every_code(dtype: torch.dtype) -> None:
    book = torch.tensor([-2.15, -1.34, -0.76, -0.25, 0.25, 0.76, 1.34, 2.15]).to(dtype)
    bits = [int(b) & 0xFFFF for b in book.view(torch.int16).tolist()]
    pairs = {10 + 2 * i: bits[2 * i] | bits[2 * i + 1] << 16 for i in range(4)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(64):
        codes = torch.randint(0, 8, (2, 8), generator=gen)
        words = [sum(int(c) << (3 * k) for k, c in enumerate(row)) for row in codes]
        out = _run_ptx(_spec_module()._levels_asm(), {8: words[0], 9: words[1], **pairs}, 8, dtype)
        for k in range(8):  # output k: the levels of field k of word 0 (low half) and word 1 (high half)
            for w in range(2):
                assert _half(out[k] >> (16 * w), dtype) == book[codes[w, k]], (k, w)


def test_the_register_mma_unpacking_gives_the_offset_codes_of_every_byte() -> None:
    """`_mma_unpack_keys_asm`: output 8 u + i holds, of word u (channel 4 j + f at bit 8 j + 2 f), channels i (low
    half) and 8 + i (high half) as 128 + code * MMA_KEY_PLACE[i]; `_mma_unpack_values_asm`: output f holds field f
    of the byte its selector picks from each slot's word (slot 0 low, slot 1 high) as 128 + code *
    MMA_VALUE_PLACE[f]. Every byte value in every position."""
    mod = _spec_module()
    bf16 = torch.bfloat16
    for first in range(0, 256, 4):
        words = []
        for shift in (0, 77):
            data = [(first + shift + 37 * b) % 256 for b in range(4)]
            words.append((data, int.from_bytes(bytes(data), "little")))
        out = _run_ptx(mod._mma_unpack_keys_asm(), {16: words[0][1], 17: words[1][1]}, 16, bf16)
        for u, (data, _) in enumerate(words):
            for i in range(8):
                for h in range(2):
                    channel = i + 8 * h
                    code = (data[channel // 4] >> (2 * (channel % 4))) & 3
                    got = _half(out[8 * u + i] >> (16 * h), bf16).item()
                    assert got == 128 + code * mod.MMA_KEY_PLACE[i], (data, u, i, h)
        (even, w_even), (odd, w_odd) = words
        for k in range(4):
            out = _run_ptx(mod._mma_unpack_values_asm(), {4: w_even, 5: w_odd, 6: k | (4 + k) << 8}, 4, bf16)
            for f in range(4):
                for h, byte in enumerate((even[k], odd[k])):
                    want = 128 + ((byte >> (2 * f)) & 3) * mod.MMA_VALUE_PLACE[f]
                    assert _half(out[f] >> (16 * h), bf16).item() == want, (even, odd, k, f, h)


def test_the_register_mma_orders_permute_the_channels() -> None:
    """The key operand's K order and the value operand's rows are permutations; each lane t's K positions (2 t + e +
    8 hk + 16 kt) hold the channels of its words 2 t, 2 t + 1; a register's pair (K, K + 1) holds channels c, c + 8
    of one word at one place; a value group's rows g, g + 8, g + 16, g + 24 are the 4 fields of one byte."""
    mod = _spec_module()
    assert sorted(mod.mma_key_channel(k) for k in range(128)) == list(range(128))
    for k in range(0, 128, 2):
        t = (k >> 1) & 3
        assert mod.mma_key_channel(k) // 32 == t
        assert mod.mma_key_channel(k + 1) == mod.mma_key_channel(k) + 8
        assert mod.mma_key_place(k) == mod.mma_key_place(k + 1)
    assert sorted(mod.mma_value_channel(m) for m in range(32)) == list(range(32))
    for g in range(8):
        byte = {mod.mma_value_channel(g + 8 * f) // 4 for f in range(4)}
        assert byte == {4 * (g >> 2) + (g & 3)}, g
        assert [mod.mma_value_channel(g + 8 * f) % 4 for f in range(4)] == [0, 1, 2, 3]


HEADS, KV_HEADS, DIM = 16, 2, 128


def _method_sources(method: str, batch: int, context: int, gen: torch.Generator):
    from kvc.compiler.attention import variant_for_spec
    from kvc.runtime.attention.backend import PagedAttention
    from kvc.runtime.methods import resolve_method

    resolved = resolve_method(method, None)
    page = resolved.page_tokens() or 16
    pages_per_row = -(-context // page)
    spec = resolved.kv_spec(KV_HEADS, DIM, torch.bfloat16, page)
    att = PagedAttention.allocate(1, batch * pages_per_row + 1, KV_HEADS, page, DIM, torch.bfloat16, "cuda", "triton",
                                  spec, num_rows=batch)
    att.use_variant(variant_for_spec(att.store.spec.dense, False, False))
    for name, t in att.store.tensors.items():  # scales in (0.05, 0.15), zero points and window rows N(0, 1)
        if t.dtype.is_floating_point and t.element_size() >= 2:
            x = torch.randn(t.shape, generator=gen, device="cuda")
            t.copy_(x.abs() * 0.05 + 0.05 if "scale" in name else x)
        elif t.dtype.is_floating_point:  # FP8 codes: finite values
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(t.dtype))
        else:
            t.copy_(torch.randint(0, 256, t.shape, generator=gen, device="cuda").to(torch.uint8).view(t.dtype))
    tables = torch.randperm(batch * pages_per_row, generator=gen, device="cuda").int().view(batch, pages_per_row)
    k_src, v_src = att._sources[0]
    return att, k_src, v_src, tables


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the fast paths are PTX)")
@pytest.mark.parametrize("method", ["kivi", "turboquant", "fp8"])
@pytest.mark.parametrize("block_n", [None, 32, 64])
def test_the_fast_decode_equals_the_torch_ops_in_bf16(method: str, block_n: int | None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, context = 3, 1000
    att, k_src, v_src, tables = _method_sources(method, batch, context, gen)
    lens = torch.tensor([context, 517, 64], dtype=torch.int32, device="cuda")
    windows = getattr(k_src, "residual", None) is not None
    rows = torch.arange(batch, dtype=torch.int32, device="cuda") if windows else None
    resid = torch.tensor([100, 5, 0], dtype=torch.int32, device="cuda") if windows else None
    q = torch.randn(batch, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    scale = DIM ** -0.5
    got = att.ops.paged_decode(q, k_src, v_src, tables, lens, scale, rows=rows, resid_lens=resid, block_n=block_n)
    want = torch_ops.paged_decode(q, k_src, v_src, tables, lens, scale, rows=rows, resid_lens=resid)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (Gluon: mma.sync from registers)")
@pytest.mark.parametrize("heads", [HEADS, KV_HEADS * 3])  # 8 query heads a KV head, and 3
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_the_register_mma_decode_equals_the_torch_ops(heads: int, num_splits: int | None) -> None:
    """KIVI-2's coded pages through `_mma_decode_kernel`, each row's rest (residual windows, a page partly in
    one) through the split kernel, one reduce: rows of no, one and many coded pages, windows empty and full."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, context = 5, 1000
    att, k_src, v_src, tables = _method_sources("kivi", batch, context, gen)
    lens = torch.tensor([context, 517, 64, 20, 161], dtype=torch.int32, device="cuda")
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    resid = torch.tensor([100, 5, 0, 19, 128], dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    scale = DIM ** -0.5
    got = att.ops.paged_decode(q, k_src, v_src, tables, lens, scale, rows=rows, resid_lens=resid, mma=True,
                               num_splits=num_splits)
    want = torch_ops.paged_decode(q, k_src, v_src, tables, lens, scale, rows=rows, resid_lens=resid)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    split = att.ops.paged_decode(q, k_src, v_src, tables, lens, scale, rows=rows, resid_lens=resid, mma=False)
    assert (got.float() - want.float()).abs().max() <= 2 * (split.float() - want.float()).abs().max() + 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_register_mma_decode_is_refused_where_it_does_not_fit() -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    att, k_src, v_src, tables = _method_sources("fp8", 2, 256, gen)
    lens = torch.tensor([256, 100], dtype=torch.int32, device="cuda")
    q = torch.randn(2, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="register-mma"):
        att.ops.paged_decode(q, k_src, v_src, tables, lens, DIM ** -0.5, mma=True)


@pytest.mark.parametrize("method,params,heads,page,fits", [
    ("kivi", {}, 16, None, True),                       # KIVI-2 at its page (a key group of 32), 8 heads a KV head
    ("kivi", {}, 6, None, True),                        # 3 heads a KV head
    ("kivi", {}, 32, None, False),                      # 16 heads a KV head: more than the mma's 8 rows
    ("kivi", {"bits": 4}, 16, None, False),             # 4-bit codes
    ("kivi", {"group_size": 16}, 16, None, False),      # pages of 16 slots
    ("fp8", {}, 16, 32, False),
    ("turboquant", {}, 16, 32, False),
])
def test_the_register_mma_decode_takes_kivi_2s_storage_only(method: str, params: dict, heads: int,
                                                            page: int | None, fits: bool) -> None:
    """`mma_decode_stores_fit` (the operands' half of `mma_decode_fits`, on any device) over each method's real
    sources in bf16 at head_dim 128 (the engine's store, allocated here on the CPU)."""
    from kvc.runtime.attention.backend import PagedAttention
    from kvc.runtime.attention.sources import kernel_operand
    from kvc.runtime.kv.store import KVStore
    from kvc.runtime.methods import resolve_method

    resolved = resolve_method(method, params)
    page = page or resolved.page_tokens()
    spec = resolved.kv_spec(KV_HEADS, DIM, torch.bfloat16, page)
    store = KVStore(spec, 9, KV_HEADS, page, 1, "cpu", num_rows=2)
    k_src, v_src = PagedAttention(store, "torch", 1)._layer(0)
    q = torch.zeros(2, heads, DIM, dtype=torch.bfloat16)
    mod = _spec_module()
    assert mod.mma_decode_stores_fit(q, kernel_operand(k_src, True), kernel_operand(v_src, True), page,
                                     heads // KV_HEADS) is fits
    assert not mod.mma_decode_fits(q, kernel_operand(k_src, True), kernel_operand(v_src, True), page, 8)  # CPU
