"""FP8 codes (the `fp8` method's encoding): the store writes exactly the bytes of the hand-written
reference quantizer (tests/references/fp8.py), and decode and prefill over the FP8 cache equal dense
attention over the dequantized values, on the torch ops (the oracle of the kernels) and on the
`spec` Triton kernels under TRITON_INTERPRET=1 (tiny sizes).

The scale is a per-layer tensor seen at every page and slot with strides 0 (`KVStore.scale_slots`),
per tensor (one value for every KV head) or per KV head.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.sources import QuantizedPages
from kvc.runtime.kv import encodings
from kvc.runtime.kv.spec import FLOAT_CODES, Extent, KVSpec, Quantized, TensorSpec
from kvc.runtime.kv.store import KVStore
from tests.kernels.sm90 import compiles_for_sm90
from tests.references import fp8 as ref

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

HKV, HQ, D, PAGE, PAGES = 2, 4, 16, 4, 12
LENGTHS = [9, 1, 14]


def spec_for(fmt: str, scaling: str, shared: bool, dtype=torch.float32) -> KVSpec:
    codes = FLOAT_CODES[fmt][0]
    tensors = tuple(TensorSpec(n, e, t, s) for n, e, t, s in (
        ("k_codes", Extent.TOKEN, codes, (D,)), ("k_scale", Extent.LAYER, dtype, (1,)),
        ("v_codes", Extent.TOKEN, codes, (D,)), ("v_scale", Extent.LAYER, dtype, (1,))))
    return KVSpec(tensors, keys=Quantized("k_codes", "k_scale", 8, D, format=fmt, scaling=scaling, shared_heads=shared),
                  values=Quantized("v_codes", "v_scale", 8, D, format=fmt, scaling=scaling, shared_heads=shared))


def sources(store: KVStore, layer: int = 0):
    out = []
    for enc in (store.spec.keys, store.spec.values):
        out.append(QuantizedPages(enc, store[enc.codes], store.scale_slots(enc.scale, layer), None, D,
                                  store.model_dtype(enc.codes[0])))
    return out


def tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [B, 4] (a permutation of the pool's pages) and the slot of every token."""
    perm = torch.randperm(PAGES, generator=torch.Generator().manual_seed(3))[: 4 * len(LENGTHS)]
    block_tables = perm.view(len(LENGTHS), 4).to(torch.int32)
    slots = torch.cat([block_tables[b, torch.arange(n) // PAGE].long() * PAGE + torch.arange(n) % PAGE
                       for b, n in enumerate(LENGTHS)])
    return block_tables, slots


def test_float_codes_are_the_reference_bytes():
    """encodings.quantize_float (what both stores compute) against the hand-written quantizer,
    ties, saturation, subnormals and signed zero included."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 40
    x[:12] = torch.tensor([448.0, 464.0, 480.0, 1e9, -1e9, 0.0, -0.0, 2**-9, 2**-10, 3 * 2**-11, 57344.0, 61440.0])
    for fmt in FLOAT_CODES:
        for scale in (1.0, 0.37):
            codes = encodings.quantize_float(x, torch.tensor(scale), fmt)
            want = ref.encode((x / np.float32(scale)).numpy(), fmt)
            assert np.array_equal(codes.view(torch.uint8).numpy(), want), fmt
            back = encodings.dequantize(codes[None], torch.full((1, 1), scale), None,
                                        Quantized("c", "s", 8, x.numel(), format=fmt), x.numel(), torch.float32)[0]
            torch.testing.assert_close(back, torch.from_numpy(ref.decode(want, fmt)).float() * scale, rtol=0, atol=0)


def test_dynamic_scales_follow_the_first_stored_chunk():
    """amax / 200 (K) and / 100 (V) from the first chunk's stored rows, over every head or per head;
    padding rows (slot -1) do not count; later chunks leave the scales alone."""
    for shared in (True, False):
        store = KVStore(spec_for("e4m3", "dynamic", shared), PAGES, HKV, PAGE, 2, "cpu")
        assert float(store["k_scale"].abs().sum()) == 0  # unset until a chunk is stored
        k = torch.randn(5, HKV, D) * 3
        v = torch.randn(5, HKV, D)
        k[4] = 1000.0  # a padding row
        slots = torch.tensor([0, 1, 2, 3, -1])
        store.settle_scales(1, k, v, slots)
        amax = k[:4].abs().amax(dim=(0, 2))
        want = (amax.amax().expand(HKV) if shared else amax) / 200
        torch.testing.assert_close(store["k_scale"][1, :, 0], want)
        torch.testing.assert_close(store["v_scale"][1, :, 0], (v[:4].abs().amax(dim=(0, 2)).amax().expand(HKV)
                                                               if shared else v[:4].abs().amax(dim=(0, 2))) / 100)
        assert float(store["k_scale"][0].abs().sum()) == 0  # other layers wait for their own chunk
        store.settle_scales(1, k * 5, v * 5, slots)
        torch.testing.assert_close(store["k_scale"][1, :, 0], want)
        unit = KVStore(spec_for("e4m3", "unit", shared), PAGES, HKV, PAGE, 2, "cpu")
        unit.settle_scales(0, k, v, slots)
        assert bool((unit["k_scale"] == 1).all() and (unit["v_scale"] == 1).all())


def _filled(fmt: str, shared: bool, ops, dtype=torch.float32):
    """A store of one layer with every sequence's tokens stored by `ops.store_kv` (one chunk)."""
    store = KVStore(spec_for(fmt, "unit", shared, dtype), PAGES, HKV, PAGE, 1, "cpu")
    scale = torch.tensor([0.05, 0.11]) if not shared else torch.tensor([0.07, 0.07])
    store["k_scale"][0, :, 0] = scale
    store["v_scale"][0, :, 0] = scale * 2
    gen = torch.Generator().manual_seed(1)
    n = sum(LENGTHS)
    k = (torch.randn(n, HKV, D, generator=gen) * 4).to(dtype)
    v = torch.randn(n, HKV, D, generator=gen).to(dtype)
    block_tables, slots = tables()
    k_src, v_src = sources(store)
    ops.store_kv(k, v, k_src, v_src, slots)
    return store, k, v, block_tables, slots, scale


@pytest.mark.parametrize("fmt", sorted(FLOAT_CODES))
@pytest.mark.parametrize("shared", [True, False])
def test_torch_store_writes_the_reference_codes(fmt: str, shared: bool):
    store, k, v, _, slots, scale = _filled(fmt, shared, torch_ops)
    for which, x, s in (("k", k, scale), ("v", v, scale * 2)):
        codes = store[f"{which}_codes"][slots // PAGE, :, slots % PAGE]
        for h in range(HKV):
            want = ref.encode((x[:, h].float() / np.float32(s[h])).numpy(), fmt)
            assert np.array_equal(codes[:, h].view(torch.uint8).numpy(), want)


def _dense_oracle(store, block_tables, q, causal_chunk=None):
    """Attention (float64) over each sequence's dequantized keys/values, decoded by the reference."""
    out = []
    for b, n in enumerate(LENGTHS):
        table = block_tables[b].tolist()
        k = store.decoded("k", table, n, layer=0).double()  # [Hkv, n, D]
        v = store.decoded("v", table, n, layer=0).double()
        fmt = store.spec.keys.format
        raw_k = store["k_codes"][block_tables[b].long()].movedim(1, 0).flatten(1, 2)[:, :n]
        decoded = torch.from_numpy(ref.decode(raw_k.contiguous().view(torch.uint8).numpy(), fmt))
        want = (decoded.float() * store["k_scale"][0, :, :, None].float()).double()  # float32 product, as stored
        torch.testing.assert_close(k, want, rtol=0, atol=0)
        group = HQ // HKV
        kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        qb = q[b] if causal_chunk is None else q[causal_chunk[b]:causal_chunk[b + 1]]
        qb = qb.double().view(-1, HQ, D).transpose(0, 1)  # [Hq, c, D]
        logits = qb @ kk.transpose(1, 2) * D ** -0.5
        c = qb.shape[1]
        mask = torch.arange(n)[None, :] <= torch.arange(n - c, n)[:, None]
        out.append((logits.masked_fill(~mask, float("-inf")).softmax(-1) @ vv).transpose(0, 1))
    return torch.cat(out) if causal_chunk is not None else torch.cat(out).view(len(LENGTHS), HQ, D)


def _check_attention(ops, fmt: str, shared: bool):
    store, _, _, block_tables, _, _ = _filled(fmt, shared, ops)
    k_src, v_src = sources(store)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    q = torch.randn(len(LENGTHS), HQ, D, generator=torch.Generator().manual_seed(2))
    out = ops.paged_decode(q, k_src, v_src, block_tables, lens, D ** -0.5, max_context_len=max(LENGTHS))
    want = _dense_oracle(store, block_tables, q)
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-5)
    chunks = [3, 1, 6]  # each sequence's newest tokens as a prefill chunk over the rest
    cu = torch.tensor([0, *np.cumsum(chunks)], dtype=torch.int32)
    qp = torch.randn(int(cu[-1]), HQ, D, generator=torch.Generator().manual_seed(4))
    out = ops.paged_prefill(qp, k_src, v_src, block_tables, cu, lens, D ** -0.5, max(chunks))
    want = _dense_oracle(store, block_tables, qp, cu.tolist())
    torch.testing.assert_close(out.double(), want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FLOAT_CODES))
@pytest.mark.parametrize("shared", [True, False])
def test_torch_attention_is_dense_attention_over_the_dequantized_cache(fmt: str, shared: bool):
    _check_attention(torch_ops, fmt, shared)


def _triton_ops():
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    return triton_device_and_ops("spec")[1]


@pytest.mark.parametrize("fmt", sorted(FLOAT_CODES))
def test_triton_store_writes_the_torch_bytes(fmt: str):
    """The quantizing store kernel and the torch store write the same bytes (per-head scales)."""
    spec_ops = _triton_ops()
    a = _filled(fmt, False, torch_ops)[0]
    b = _filled(fmt, False, spec_ops)[0]
    for name in ("k_codes", "v_codes"):
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("fmt", sorted(FLOAT_CODES))
def test_triton_attention_is_dense_attention_over_the_dequantized_cache(fmt: str):
    _check_attention(_triton_ops(), fmt, False)


@pytest.mark.parametrize("fp8", ["fp8e4nv", "fp8e5"])
def test_the_kernels_compile_for_sm90(fp8: str):
    """The FP8 paths of the store, decode and prefill kernels compile for an H100/H200 (no GPU
    needed: Triton's compiler and ptxas run here), outside the interpreter."""
    compiles_for_sm90("tests.kernels.sm90_compile", fp8)
