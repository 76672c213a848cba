"""The torch ops reading K/V as a KV spec says (runtime/attention/torch_ops.py with
`QuantizedPages` sources, residual windows and read plans) against the hand-written oracle of
tests/kernels/spec_cases.py: decoded dense K/V, an explicit mask of the read slots, float64
softmax attention."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.metadata import DecodeStats
from kvc.runtime.attention.sources import QuantizedPages
from kvc.runtime.kv import encodings
from kvc.runtime.kv.plans import ReadPlan
from tests.kernels.paged_cases import reference_attention
from tests.kernels.spec_cases import (INT2_SYM_G16, INT4_ASYM_G8, INT8_PER_TOKEN, Enc, emptied, fold_oracle,
                                      make_spec_case, oracle_decode, oracle_prefill, random_plan)

HEAD_DIM = 32
TOL = dict(atol=1e-5, rtol=1e-4)
LENGTHS = [13, 0, 40, 1, 29]
ENCODINGS = {"dense": None, "int8-token": INT8_PER_TOKEN, "int4-asym-g8": INT4_ASYM_G8, "int2-sym-g16": INT2_SYM_G16}


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def case_for(k_name, v_name, gen, *, window=0, resid_lens=None, page_size=4, num_kv_heads=2, lengths=LENGTHS):
    return make_spec_case(lengths, num_kv_heads, HEAD_DIM, page_size, k_enc=ENCODINGS[k_name],
                          v_enc=ENCODINGS[v_name], gen=gen, window=window, resid_lens=resid_lens)


@pytest.mark.parametrize("k_name,v_name", [("int8-token", "int8-token"), ("int4-asym-g8", "int4-asym-g8"),
                                           ("dense", "int2-sym-g16"), ("int4-asym-g8", "dense")])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_reads_quantized_operands(k_name, v_name, window, group):
    gen = fresh(7 * group + window)
    case = case_for(k_name, v_name, gen, window=window)
    q = torch.randn(len(LENGTHS), 2 * group, HEAD_DIM, generator=gen)
    want, _ = oracle_decode(case, q, 0.3)
    args = (q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.3)
    extra = dict(rows=case.rows, resid_lens=case.resid_lens)
    torch.testing.assert_close(torch_ops.paged_decode(*args, **extra), want.float(), **TOL)
    # the batched path (the GPU's) reads the same
    padded = torch_ops._decode_padded(*args, 64, None, (case.rows, case.resid_lens))
    torch.testing.assert_close(padded, want.float(), **TOL)


def test_resid_lens_choose_between_codes_and_window():
    """resid_lens shorter than the window: the older window slots are read from the codes."""
    gen = fresh(3)
    lengths = [20, 9]
    case = case_for("int4-asym-g8", "int4-asym-g8", gen, window=8, resid_lens=[3, 1], lengths=lengths)
    q = torch.randn(2, 4, HEAD_DIM, generator=gen)
    want, _ = oracle_decode(case, q, 0.25)
    got = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.25,
                                 rows=case.rows, resid_lens=case.resid_lens)
    torch.testing.assert_close(got, want.float(), **TOL)
    # without resid_lens nothing is read from the window: all slots decode from the codes
    plain = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.25)
    assert not torch.allclose(plain, got)


@pytest.mark.parametrize("by,width", [("pages", 3), ("pages", 12), ("tokens", 7), ("tokens", 50)])
@pytest.mark.parametrize("k_name", ["dense", "int4-asym-g8"])
@pytest.mark.parametrize("with_starts", [False, True])
def test_decode_by_read_plan(by, width, k_name, with_starts):
    gen = fresh(width + 100 * with_starts)
    num_kv_heads, group = 2, 2
    window = 8 if k_name != "dense" else 0
    case = case_for(k_name, k_name, gen, window=window)
    plan = random_plan(case, num_kv_heads, by, width, gen)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, max(n, 1), (num_kv_heads,), generator=gen) for n in LENGTHS]).int()
    q = torch.randn(len(LENGTHS), num_kv_heads * group, HEAD_DIM, generator=gen)
    want, _ = oracle_decode(case, q, 0.3, plan, starts)
    got = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.3,
                                 kv_starts=starts, rows=case.rows, resid_lens=case.resid_lens, read=plan)
    torch.testing.assert_close(got, want.float(), **TOL)


def test_a_plan_of_every_page_is_the_full_decode():
    gen = fresh(11)
    case = case_for("int8-token", "int8-token", gen)
    pages = case.block_tables.shape[1]
    plan = ReadPlan(pages=torch.arange(pages, dtype=torch.int32).expand(len(LENGTHS), 2, pages).contiguous())
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    full = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.3)
    planned = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.3,
                                     read=plan)
    torch.testing.assert_close(planned, full, **TOL)


@pytest.mark.parametrize("reduce,fn", [("group", "mean"), ("head", "sum"), ("none", None)])
@pytest.mark.parametrize("by", [None, "pages", "tokens"])
def test_decode_stats_cover_the_slots_read(reduce, fn, by):
    gen = fresh(5)
    num_kv_heads, group = 2, 2
    case = case_for("int4-asym-g8", "int8-token", gen, window=4)
    plan = None if by is None else random_plan(case, num_kv_heads, by, 6, gen)
    q = torch.randn(len(LENGTHS), num_kv_heads * group, HEAD_DIM, generator=gen)
    width = max(LENGTHS) + 5
    rows = {"group": num_kv_heads, "head": 1, "none": num_kv_heads * group}[reduce]
    stats = DecodeStats(reduce, fn, torch.full((len(LENGTHS), rows, width), float("nan")))
    want, probs = oracle_decode(case, q, 0.3, plan)
    got = torch_ops.paged_decode(q, case.k_source, case.v_source, case.block_tables, case.context_lens, 0.3,
                                 stats=stats, rows=case.rows, resid_lens=case.resid_lens, read=plan)
    torch.testing.assert_close(got, want.float(), **TOL)
    torch.testing.assert_close(stats.out, fold_oracle(probs, num_kv_heads, width, reduce, fn).float(), **TOL)


@pytest.mark.parametrize("k_name,v_name", [("int8-token", "int4-asym-g8"), ("int2-sym-g16", "dense")])
@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("with_starts", [False, True])
def test_prefill_chunks_over_a_quantized_prefix(k_name, v_name, window, with_starts):
    gen = fresh(17 + window + with_starts)
    num_kv_heads, group = 2, 2
    shapes = [(21, 21), (30, 9), (17, 1), (12, 0), (25, 14)]  # (length after the step, new tokens)
    case = case_for(k_name, v_name, gen, window=window, lengths=[n for n, _ in shapes])
    cu = [0]
    for _, q_len in shapes:
        cu.append(cu[-1] + q_len)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, n - max(q, 1) + 1, (num_kv_heads,), generator=gen)
                              for n, q in shapes]).int()
    q = torch.randn(cu[-1], num_kv_heads * group, HEAD_DIM, generator=gen)
    want = oracle_prefill(case, q, cu, 0.2, starts)
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    args = (q, case.k_source, case.v_source, case.block_tables, cu_seqlens, case.context_lens, 0.2,
            max(q for _, q in shapes))
    if not window:  # no window: the chunk is read as stored
        got = torch_ops.paged_prefill(*args, kv_starts=starts, rows=case.rows, resid_lens=case.resid_lens)
        torch.testing.assert_close(got, want.float(), **TOL)
        return
    # a window: a chunk attends to its own tokens as computed (k_new, v_new), to earlier ones as stored
    chunk = (torch.randn(cu[-1], num_kv_heads, HEAD_DIM, generator=gen),
             torch.randn(cu[-1], num_kv_heads, HEAD_DIM, generator=gen))
    held = case.held(torch.tensor([q_len for _, q_len in shapes]))
    got = torch_ops.paged_prefill(*args, kv_starts=starts, rows=case.rows, resid_lens=held, k_new=chunk[0],
                                  v_new=chunk[1])
    torch.testing.assert_close(got, oracle_prefill(case, q, cu, 0.2, starts, chunk).float(), **TOL)
    with pytest.raises(ValueError, match="k_new"):
        torch_ops.paged_prefill(*args, rows=case.rows, resid_lens=held)


@pytest.mark.parametrize("k_name,v_name", [("int4-asym-g8", "int8-token"), ("dense", "int2-sym-g16")])
def test_store_then_read_gives_the_oracle(k_name, v_name):
    """store_kv of whole prompts (one padding token) into empty pools, then a decode: the same as
    the oracle of the case (whose codes came from encodings.quantize of the same tokens)."""
    gen = fresh(23)
    lengths = [13, 6, 21]
    window = 8
    case = case_for(k_name, v_name, gen, window=window, lengths=lengths)
    k_pool, v_pool = emptied(case.k_source), emptied(case.v_source)
    k = torch.cat([*case.full_keys, torch.randn(1, 2, HEAD_DIM, generator=gen)])
    v = torch.cat([*case.full_values, torch.randn(1, 2, HEAD_DIM, generator=gen)])
    slots = []
    for b, n in enumerate(lengths):
        table = case.block_tables[b].tolist()
        slots += [table[t // case.page_size] * case.page_size + t % case.page_size for t in range(n)]
    slot_mapping = torch.tensor(slots + [-1])
    cu = torch.tensor([0, 13, 19, 40], dtype=torch.int32)
    torch_ops.store_kv(k, v, k_pool, v_pool, slot_mapping, cu, case.context_lens, case.rows)
    q = torch.randn(3, 4, HEAD_DIM, generator=gen)
    want, _ = oracle_decode(case, q, 0.3)
    got = torch_ops.paged_decode(q, k_pool, v_pool, case.block_tables, case.context_lens, 0.3, rows=case.rows,
                                 resid_lens=case.resid_lens)
    torch.testing.assert_close(got, want.float(), **TOL)
    for stored, source in ((k_pool, case.k_source), (v_pool, case.v_source)):
        if isinstance(stored, QuantizedPages):  # the window holds each row's newest tokens
            for b, n in enumerate(lengths):
                for t in range(max(0, n - window), n):
                    assert torch.equal(stored.residual[case.rows[b], :, t % window],
                                       source.residual[case.rows[b], :, t % window])


def test_store_writes_the_reference_codes_and_nothing_else():
    gen = fresh(29)
    enc = Enc(4, 8, False, "int4x2")
    pages, heads, page_size = 5, 2, 4
    codes = torch.randint(0, 256, (pages, heads, page_size, HEAD_DIM // 2), generator=gen).to(torch.uint8)
    scale = torch.rand(pages, heads, page_size, HEAD_DIM // 8, generator=gen)
    zero = torch.rand(pages, heads, page_size, HEAD_DIM // 8, generator=gen)
    source = QuantizedPages(enc.quantized("k", 0), codes.clone(), scale.clone(), zero.clone(), HEAD_DIM,
                            torch.float32)
    dense = torch.randn(pages, heads, page_size, HEAD_DIM, generator=gen)
    k = torch.randn(4, heads, HEAD_DIM, generator=gen)
    v = torch.randn(4, heads, HEAD_DIM, generator=gen)
    slots = torch.tensor([9, -1, 0, 19])
    want_v = dense.clone()
    torch_ops.store_kv(k, v, source, dense, slots)
    want_codes, want_scale, want_zero = encodings.quantize(k, source.enc, torch.uint8, packing="int4x2")
    codes_view, scale_view, zero_view = codes.clone(), scale.clone(), zero.clone()
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            codes_view[slot // page_size, :, slot % page_size] = want_codes[i]
            scale_view[slot // page_size, :, slot % page_size] = want_scale[i]
            zero_view[slot // page_size, :, slot % page_size] = want_zero[i]
            want_v[slot // page_size, :, slot % page_size] = v[i]
    assert torch.equal(source.codes, codes_view)
    assert torch.equal(source.scale, scale_view) and torch.equal(source.zero, zero_view)
    assert torch.equal(dense, want_v)


def test_a_residual_store_needs_the_rows():
    gen = fresh(31)
    case = case_for("int8-token", "dense", gen, window=4, lengths=[5])
    with pytest.raises(ValueError, match="residual window"):
        torch_ops.store_kv(torch.zeros(1, 2, HEAD_DIM), torch.zeros(1, 2, HEAD_DIM), case.k_source, case.v_source,
                           torch.tensor([0]))


def test_quantized_pages_check_their_tensors():
    enc = Enc(4, 8, True, "int4x2").quantized("k", 0)
    codes = torch.zeros(3, 2, 4, HEAD_DIM // 2, dtype=torch.uint8)
    scale = torch.ones(3, 2, 4, HEAD_DIM // 8)
    QuantizedPages(enc, codes, scale, None, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        QuantizedPages(enc, codes, scale[..., :2], None, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="zero point"):
        QuantizedPages(enc, codes, scale, scale.clone(), HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedPages(enc, codes[..., :5], scale, None, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="residual"):
        QuantizedPages(enc, codes, scale, None, HEAD_DIM, torch.float32, torch.zeros(2, 2, 4, 16))


def test_dense_reference_helper_agrees():
    """The spec oracle on a dense case is the plain reference of paged_cases (same definition)."""
    gen = fresh(37)
    case = case_for("dense", "dense", gen)
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    want, _ = oracle_decode(case, q, 0.3)
    for b, n in enumerate(LENGTHS):
        ref = reference_attention(q[b: b + 1], case.keys[b], case.values[b], 0.3, [n - 1])
        torch.testing.assert_close(want[b: b + 1], ref)
