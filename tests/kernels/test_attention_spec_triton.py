"""Oracle 4 for the kernels rendered by spec (attention variant `spec`): quantizing store, decode and
prefill over quantized sources and residual windows, read-plan decode, statistics, against the torch
ops (tests/kernels/test_attention_spec_torch.py checks those against the hand-written oracle).

Under TRITON_INTERPRET=1 on a machine without a GPU, so the sizes stay tiny. Unowned pool entries
(scales, zero points, residual slots) hold NaN and outputs start as NaN, so a stray read or an
unwritten output fails. Dense operands through `spec` must equal `plain` bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.compiler import attention
from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.metadata import DecodeStats
from kvc.runtime.kv.plans import ReadPlan
from tests.kernels.paged_cases import triton_device_and_ops
from tests.kernels.spec_cases import (INT2_SYM_G16, INT4_HADAMARD, SPHERE3_G16, SPHERE3_ROTATED, Enc, INT4_ASYM_G8,
                                      INT8_PER_TOKEN, assert_stored_alike,
                                      emptied, fold_oracle, make_spec_case, moved, nan_free, oracle_decode,
                                      random_plan)

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
DEVICE, spec_ops = triton_device_and_ops("spec")
_, plain_ops = triton_device_and_ops("plain")

HEAD_DIM = 16
TOL = dict(atol=2e-5, rtol=1e-4)
LENGTHS = [13, 0, 37, 1]
ENCODINGS = {"dense": None, "int8-token": INT8_PER_TOKEN, "int4-asym-g8": INT4_ASYM_G8, "int2-sym-g16": INT2_SYM_G16,
             "int4-asym-g12": Enc(4, 12, False, "int4x2"), "sphere3-g16": SPHERE3_G16,
             "sphere4-g8": Enc(4, 8, True, "int4x2", "sphere"), "sphere3-g24": Enc(3, 24, True, "int3x8", "sphere"),
             "sphere4-g12": Enc(4, 12, True, "int4x2", "sphere"), "sphere3-rotated": SPHERE3_ROTATED,
             "int4-hadamard": INT4_HADAMARD}


def fresh(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def on_device(source):
    return moved(source, DEVICE)


def case_for(k_name, v_name, gen, *, window=0, lengths=LENGTHS, resid_lens=None, page_size=4, head_dim=HEAD_DIM):
    return make_spec_case(lengths, 2, head_dim, page_size, k_enc=ENCODINGS[k_name], v_enc=ENCODINGS[v_name],
                          gen=gen, window=window, resid_lens=resid_lens, stale=float("nan"))


def dev(t):
    return None if t is None else t.to(DEVICE)


def poisoned(shape) -> torch.Tensor:
    return torch.full(shape, float("nan"), device=DEVICE)


def test_the_spec_picks_the_variant():
    assert attention.variant_for_spec(True) == "plain"
    assert attention.variant_for_spec(True, decode_stats=True) == "decode_stats"
    assert attention.variant_for_spec(True, read_plan=True) == "spec"
    assert attention.variant_for_spec(False) == "spec"
    assert attention.variant_for_spec(False, decode_stats=True, read_plan=True) == "spec"


DECODE_CASES = [
    # k, v, window, group, num_splits, use_dot
    ("int8-token", "int8-token", 0, 1, 1, True),
    ("int4-asym-g8", "int4-asym-g8", 0, 2, 3, True),
    ("int4-asym-g8", "int4-asym-g8", 8, 3, 2, True),
    ("dense", "int2-sym-g16", 8, 2, 1, False),
    ("int8-token", "dense", 4, 4, 2, True),
    ("sphere3-g16", "sphere4-g8", 0, 2, 2, True),
    ("sphere4-g8", "sphere3-g16", 8, 4, 1, False),
    ("sphere3-rotated", "int4-hadamard", 0, 2, 2, True),  # the query rotated in, each split's partial back
    ("int4-hadamard", "sphere3-rotated", 0, 4, 1, False),
]


@pytest.mark.parametrize("k_name,v_name,window,group,num_splits,use_dot", DECODE_CASES)
def test_decode_over_quantized_sources(k_name, v_name, window, group, num_splits, use_dot):
    gen = fresh(group * 10 + num_splits + window)
    case = case_for(k_name, v_name, gen, window=window)
    q = torch.randn(len(LENGTHS), 2 * group, HEAD_DIM, generator=gen)
    extra = dict(rows=case.rows, resid_lens=case.resid_lens)
    want = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                  case.context_lens, 0.3, **extra)
    out = poisoned(q.shape)
    spec_ops.paged_decode(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                          dev(case.context_lens), 0.3, max_context_len=64, out=out, rows=dev(case.rows),
                          resid_lens=dev(case.resid_lens), num_splits=num_splits, block_n=16, use_dot=use_dot)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOL)


PLAN_CASES = [
    # by, width, k, window, with_starts, num_splits
    ("pages", 3, "dense", 0, False, 1),
    ("pages", 12, "int4-asym-g8", 8, True, 3),
    ("tokens", 9, "dense", 0, True, 2),
    ("tokens", 40, "int8-token", 4, False, 1),
]


@pytest.mark.parametrize("by,width,k_name,window,with_starts,num_splits", PLAN_CASES)
def test_decode_by_read_plan(by, width, k_name, window, with_starts, num_splits):
    gen = fresh(width + num_splits)
    case = case_for(k_name, k_name, gen, window=window)
    plan = random_plan(case, 2, by, width, gen)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, max(n, 1), (2,), generator=gen) for n in LENGTHS]).int()
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    want = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                  case.context_lens, 0.3, kv_starts=starts, rows=case.rows,
                                  resid_lens=case.resid_lens, read=plan)
    device_plan = ReadPlan(pages=dev(plan.pages), tokens=dev(plan.tokens))
    out = poisoned(q.shape)
    spec_ops.paged_decode(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                          dev(case.context_lens), 0.3, out=out, kv_starts=dev(starts), rows=dev(case.rows),
                          resid_lens=dev(case.resid_lens), read=device_plan, num_splits=num_splits, block_n=16)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOL)


@pytest.mark.parametrize("by,reduce,fn,num_splits", [(None, "group", "mean", 2), ("pages", "head", "sum", 1),
                                                     ("tokens", "none", None, 3), ("tokens", "group", "sum", 1)])
def test_decode_stats_over_quantized_keys_and_plans(by, reduce, fn, num_splits):
    gen = fresh(41 + num_splits)
    case = case_for("int4-asym-g8", "int8-token", gen, window=4)
    plan = None if by is None else random_plan(case, 2, by, 5, gen)
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    width = max(LENGTHS) + 3
    rows = {"group": 2, "head": 1, "none": 4}[reduce]
    want_stats = DecodeStats(reduce, fn, torch.zeros(len(LENGTHS), rows, width))
    want = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                  case.context_lens, 0.3, stats=want_stats, rows=case.rows,
                                  resid_lens=case.resid_lens, read=plan)
    stats = DecodeStats(reduce, fn, poisoned((len(LENGTHS), rows, width)))
    out = poisoned(q.shape)
    device_plan = None if plan is None else ReadPlan(pages=dev(plan.pages), tokens=dev(plan.tokens))
    spec_ops.paged_decode(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                          dev(case.context_lens), 0.3, out=out, stats=stats, rows=dev(case.rows),
                          resid_lens=dev(case.resid_lens), read=device_plan, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out.cpu(), want, **TOL)
    assert not stats.out.isnan().any()
    torch.testing.assert_close(stats.out.cpu(), want_stats.out, **TOL)


@pytest.mark.parametrize("k_name,v_name,window,with_starts,group", [
    ("int8-token", "int4-asym-g8", 0, False, 2),
    ("int4-asym-g8", "int2-sym-g16", 8, True, 1),
    ("dense", "int4-asym-g8", 8, False, 4),
    ("sphere3-g16", "sphere3-g16", 0, True, 2),
    ("sphere3-rotated", "sphere3-rotated", 0, True, 2),  # the chunk's own rows as computed, rotated
    ("int4-hadamard", "sphere3-rotated", 0, False, 4),
])
def test_prefill_over_a_quantized_prefix(k_name, v_name, window, with_starts, group):
    gen = fresh(53 + window + group)
    shapes = [(21, 21), (30, 9), (17, 1), (12, 0)]  # (length after the step, new tokens)
    case = case_for(k_name, v_name, gen, window=window, lengths=[n for n, _ in shapes])
    cu = torch.tensor([0, 21, 30, 31, 31], dtype=torch.int32)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, n - max(q_len, 1) + 1, (2,), generator=gen)
                              for n, q_len in shapes]).int()
    q = torch.randn(31, 2 * group, HEAD_DIM, generator=gen)
    k_new, v_new = (torch.randn(31, 2, HEAD_DIM, generator=gen) for _ in range(2))  # the chunks as computed
    want = torch_ops.paged_prefill(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables, cu,
                                   case.context_lens, 0.2, 21, kv_starts=starts, rows=case.rows,
                                   resid_lens=case.resid_lens, k_new=k_new, v_new=v_new)
    out = poisoned(q.shape)
    spec_ops.paged_prefill(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                           dev(cu), dev(case.context_lens), 0.2, 21, out=out, kv_starts=dev(starts),
                           rows=dev(case.rows), resid_lens=dev(case.resid_lens), k_new=k_new.to(DEVICE),
                           v_new=v_new.to(DEVICE), block_m=16, block_n=16)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOL)


@pytest.mark.parametrize("k_name,v_name,window,with_starts,block_n,page_size", [
    ("int4-asym-g8", "int2-sym-g16", 0, False, 16, 4),
    ("sphere3-g16", "sphere4-g8", 0, False, 16, 8),
    ("int8-token", "int4-asym-g8", 8, False, 16, 16),
    ("int4-asym-g8", "dense", 8, True, 16, 4),
    ("dense", "sphere3-g16", 0, True, 32, 4),
    ("sphere3-rotated", "int4-hadamard", 0, False, 16, 8),
])
def test_prefill_tile_ranges(k_name, v_name, window, with_starts, block_n, page_size):
    """Long prefixes: a block's tiles split into codes-only tiles (the decode tile's folds), general tiles
    (windows, the chunk's first rows) and tiles of the chunk's rows only; every range, and chunks that
    start off a tile boundary, agree with the torch prefill."""
    gen = fresh(71 + window + block_n)
    shapes = [(90, 20), (45, 45), (110, 7), (53, 1)]  # (length after the step, new tokens)
    case = make_spec_case([n for n, _ in shapes], 2, HEAD_DIM, page_size, k_enc=ENCODINGS[k_name],
                          v_enc=ENCODINGS[v_name], gen=gen, window=window, stale=float("nan"))
    cu = torch.tensor([0, 20, 65, 72, 73], dtype=torch.int32)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, n - q_len + 1, (2,), generator=gen) for n, q_len in shapes]).int()
    q = torch.randn(73, 4, HEAD_DIM, generator=gen)
    k_new, v_new = (torch.randn(73, 2, HEAD_DIM, generator=gen) for _ in range(2))
    want = torch_ops.paged_prefill(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables, cu,
                                   case.context_lens, 0.2, 45, kv_starts=starts, rows=case.rows,
                                   resid_lens=case.resid_lens, k_new=k_new, v_new=v_new)
    out = poisoned(q.shape)
    spec_ops.paged_prefill(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                           dev(cu), dev(case.context_lens), 0.2, 45, out=out, kv_starts=dev(starts),
                           rows=dev(case.rows), resid_lens=dev(case.resid_lens), k_new=k_new.to(DEVICE),
                           v_new=v_new.to(DEVICE), block_m=16, block_n=block_n)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), want, **TOL)


@pytest.mark.parametrize("k_name,v_name,window", [("int4-asym-g8", "int8-token", 4), ("int2-sym-g16", "dense", 8),
                                                  ("dense", "int4-asym-g8", 0), ("sphere3-g16", "sphere4-g8", 0),
                                                  ("sphere3-rotated", "int4-hadamard", 0)])
def test_store_quantizes_like_the_torch_store(k_name, v_name, window):
    gen = fresh(61 + window)
    lengths = [13, 6, 9]
    case = case_for(k_name, v_name, gen, window=window, lengths=lengths)
    new = [6, 1, 9]  # the step's new tokens of each sequence: a chunk, a decode, a whole prompt
    k = torch.randn(sum(new) + 1, 2, HEAD_DIM, generator=gen)
    v = torch.randn(sum(new) + 1, 2, HEAD_DIM, generator=gen)
    k[0] = 0.0  # groups of range 0: scale 1
    v[2, :, :8] = 1.5
    slots = []
    for b, (n, m) in enumerate(zip(lengths, new)):
        table = case.block_tables[b].tolist()
        slots += [table[t // 4] * 4 + t % 4 for t in range(n - m, n)]
    slot_mapping = torch.tensor(slots + [-1])  # a padding token
    cu = torch.tensor([0, 6, 7, 16], dtype=torch.int32)
    want_k, want_v = emptied(case.k_source), emptied(case.v_source)
    torch_ops.store_kv(k, v, want_k, want_v, slot_mapping, cu, case.context_lens, case.rows)
    got_k, got_v = on_device(emptied(case.k_source)), on_device(emptied(case.v_source))
    spec_ops.store_kv(k.to(DEVICE), v.to(DEVICE), got_k, got_v, dev(slot_mapping), dev(cu), dev(case.context_lens),
                      dev(case.rows))
    assert_stored_alike(got_k, want_k)
    assert_stored_alike(got_v, want_v)


@pytest.mark.parametrize("k_name,v_name", [("int8-token", "int4-asym-g8"), ("int4-asym-g12", "int8-token"),
                                           ("sphere3-g24", "sphere4-g12")])
def test_groups_that_do_not_tile_the_block(k_name, v_name):
    """head_dim 24 (block 32): per-token groups of 24 and groups of 12 take the gathered-scale path,
    groups of 8 leave a padded group; store, decode and prefill still agree with torch."""
    gen = fresh(83)
    head_dim, lengths = 24, [11, 6]
    case = case_for(k_name, v_name, gen, window=4, lengths=lengths, head_dim=head_dim)
    q = torch.randn(2, 4, head_dim, generator=gen)
    extra = dict(rows=case.rows, resid_lens=case.resid_lens)
    want = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                  case.context_lens, 0.3, **extra)
    got = spec_ops.paged_decode(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source),
                                dev(case.block_tables), dev(case.context_lens), 0.3, rows=dev(case.rows),
                                resid_lens=dev(case.resid_lens), num_splits=2, block_n=16)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    cu = torch.tensor([0, 11, 14], dtype=torch.int32)
    qp = torch.randn(14, 4, head_dim, generator=gen)
    k_new, v_new = (torch.randn(14, 2, head_dim, generator=gen) for _ in range(2))
    want = torch_ops.paged_prefill(qp, nan_free(case.k_source), nan_free(case.v_source), case.block_tables, cu,
                                   case.context_lens, 0.2, 11, **extra, k_new=k_new, v_new=v_new)
    got = spec_ops.paged_prefill(qp.to(DEVICE), on_device(case.k_source), on_device(case.v_source),
                                 dev(case.block_tables), dev(cu), dev(case.context_lens), 0.2, 11, rows=dev(case.rows),
                                 resid_lens=dev(case.resid_lens), k_new=k_new.to(DEVICE), v_new=v_new.to(DEVICE),
                                 block_m=16, block_n=16)
    torch.testing.assert_close(got.cpu(), want, **TOL)
    k = torch.randn(3, 2, head_dim, generator=gen)
    slots = torch.tensor([case.block_tables[0, 2] * 4 + 2, -1, case.block_tables[1, 1] * 4 + 1])
    want_k, want_v = emptied(case.k_source), emptied(case.v_source)
    cu_store = torch.tensor([0, 1, 3], dtype=torch.int32)
    torch_ops.store_kv(k, k, want_k, want_v, slots, cu_store, case.context_lens, case.rows)
    got_k, got_v = on_device(emptied(case.k_source)), on_device(emptied(case.v_source))
    spec_ops.store_kv(k.to(DEVICE), k.to(DEVICE), got_k, got_v, dev(slots), dev(cu_store), dev(case.context_lens),
                      dev(case.rows))
    assert_stored_alike(got_k, want_k)
    assert_stored_alike(got_v, want_v)


def test_dense_operands_through_spec_equal_plain_bit_for_bit():
    gen = fresh(71)
    case = case_for("dense", "dense", gen, page_size=5)
    k_cache, v_cache = on_device(case.k_source), on_device(case.v_source)
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen).to(DEVICE)
    args = (dev(case.block_tables), dev(case.context_lens), 0.3)
    for splits in (1, 3):
        a = spec_ops.paged_decode(q, k_cache, v_cache, *args, num_splits=splits, block_n=16)
        b = plain_ops.paged_decode(q, k_cache, v_cache, *args, num_splits=splits, block_n=16)
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    cu = torch.tensor([0, 13, 13, 20, 21], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(21, 4, HEAD_DIM, generator=gen).to(DEVICE)
    a = spec_ops.paged_prefill(qp, k_cache, v_cache, dev(case.block_tables), cu, dev(case.context_lens), 0.2, 13)
    b = plain_ops.paged_prefill(qp, k_cache, v_cache, dev(case.block_tables), cu, dev(case.context_lens), 0.2, 13)
    assert torch.equal(a, b)
    kv = torch.randn(2, 3, 2, HEAD_DIM, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 17], device=DEVICE)
    ka, va, kb, vb = (c.clone() for c in (k_cache, v_cache, k_cache, v_cache))
    spec_ops.store_kv(kv[0], kv[1], ka, va, slots)
    plain_ops.store_kv(kv[0], kv[1], kb, vb, slots)
    assert torch.equal(ka.nan_to_num(7.0), kb.nan_to_num(7.0)) and torch.equal(va.nan_to_num(7.0), vb.nan_to_num(7.0))


def test_plain_and_decode_stats_render_nothing_of_the_spec():
    """The dense variants are the kernels and wrappers they were before specs (byte for byte: their
    tuned launch configs stay valid); only `spec` takes sources, residual rows and read plans."""
    import inspect

    for ops in (plain_ops, triton_device_and_ops("decode_stats")[1]):
        text = inspect.getsource(ops)
        assert "_load_operand" not in text and "READ" not in text and "kernel_operand" not in text
        assert "read" not in inspect.signature(ops.paged_decode).parameters
        assert "rows" not in inspect.signature(ops.store_kv).parameters
    torch_params = list(inspect.signature(torch_ops.paged_decode).parameters)
    assert list(inspect.signature(spec_ops.paged_decode).parameters)[: len(torch_params)] == torch_params
    for name in ("paged_prefill", "store_kv"):
        want = list(inspect.signature(getattr(torch_ops, name)).parameters)
        assert list(inspect.signature(getattr(spec_ops, name)).parameters)[: len(want)] == want


@pytest.mark.parametrize("k_name,window,with_starts,num_splits,last", [
    ("dense", 0, False, 1, [3, 0, 37, 1]),    # a whole row from `last`, one empty, one all but listed
    ("dense", 0, True, 3, [5, 0, 2, 0]),
    ("int4-asym-g8", 8, False, 2, [13, 0, 9, 1]),  # the newest slots inside the residual window
])
def test_decode_by_token_plan_with_newest_slots(k_name, window, with_starts, num_splits, last):
    """A token plan plus each row's `last` newest slots (OmniKV's plan: the chosen prompt tokens and
    everything generated since): the splits walk the listed tokens, then the row's newest slots."""
    gen = fresh(77 + num_splits)
    case = case_for(k_name, k_name, gen, window=window)
    plan = random_plan(case, 2, "tokens", 6, gen, last=last)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, max(n, 1), (2,), generator=gen) for n in LENGTHS]).int()
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    want, probs = oracle_decode(case, q, 0.3, plan, starts)
    width = max(LENGTHS) + 3
    torch_stats = DecodeStats("group", "sum", torch.zeros(len(LENGTHS), 2, width))
    torch_out = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                       case.context_lens, 0.3, kv_starts=starts, rows=case.rows,
                                       resid_lens=case.resid_lens, read=plan, stats=torch_stats)
    torch.testing.assert_close(torch_out, want.float(), **TOL)
    torch.testing.assert_close(torch_stats.out, fold_oracle(probs, 2, width, "group", "sum").float(), **TOL)
    device_plan = ReadPlan(tokens=dev(plan.tokens), last=dev(plan.last))
    stats = DecodeStats("group", "sum", poisoned((len(LENGTHS), 2, width)))
    out = poisoned(q.shape)
    spec_ops.paged_decode(q.to(DEVICE), on_device(case.k_source), on_device(case.v_source), dev(case.block_tables),
                          dev(case.context_lens), 0.3, out=out, kv_starts=dev(starts), rows=dev(case.rows),
                          resid_lens=dev(case.resid_lens), read=device_plan, num_splits=num_splits, block_n=16,
                          stats=stats)
    torch.testing.assert_close(out.cpu(), want.float(), **TOL)
    torch.testing.assert_close(stats.out.cpu(), fold_oracle(probs, 2, width, "group", "sum").float(), **TOL)


@pytest.mark.parametrize("k_name,window,with_starts,last", [
    ("dense", 0, False, [3, 0, 37, 1]),
    ("dense", 0, True, [5, 0, 2, 0]),
    ("int4-asym-g8", 8, False, [13, 0, 9, 1]),
])
def test_a_bounded_newest_range_is_gathered_on_the_torch_path(k_name, window, with_starts, last):
    """With `last_bound` the torch path gathers the listed tokens and the newest `last_bound` slots
    (a plain token plan) instead of masking whole rows: the same attention and statistics, whether
    the bound is tight or loose, and listed tokens that fall in the newest range count once."""
    gen = fresh(91)
    case = case_for(k_name, k_name, gen, window=window)
    plan = random_plan(case, 2, "tokens", 6, gen, last=last)
    starts = None
    if with_starts:
        starts = torch.stack([torch.randint(0, max(n, 1), (2,), generator=gen) for n in LENGTHS]).int()
    q = torch.randn(len(LENGTHS), 4, HEAD_DIM, generator=gen)
    tokens = plan.tokens.clone()
    tokens[0, 0, 0] = max(case.lengths[0] - 1, 0)  # listed and inside the newest range: read once
    want, probs = oracle_decode(case, q, 0.3, ReadPlan(tokens=tokens, last=plan.last), starts)
    width = max(LENGTHS) + 3
    for bound in (max(last), max(last) + 5):
        bounded = ReadPlan(tokens=tokens, last=plan.last, last_bound=bound)
        assert torch_ops._gathers_last(bounded, 4096, case.block_tables, case.k_source)
        stats = DecodeStats("group", "sum", torch.zeros(len(LENGTHS), 2, width))
        out = torch_ops.paged_decode(q, nan_free(case.k_source), nan_free(case.v_source), case.block_tables,
                                     case.context_lens, 0.3, max_context_len=4096, kv_starts=starts, rows=case.rows,
                                     resid_lens=case.resid_lens, read=bounded, stats=stats)
        torch.testing.assert_close(out, want.float(), **TOL)
        torch.testing.assert_close(stats.out, fold_oracle(probs, 2, width, "group", "sum").float(), **TOL)


def test_a_token_plan_with_newest_slots_needs_int32_rows():
    gen = fresh(5)
    case = case_for("dense", "dense", gen)
    plan = random_plan(case, 2, "tokens", 4, gen, last=[1, 0, 2, 1])
    with pytest.raises(ValueError, match="`last` must be"):
        spec_ops.paged_decode(torch.randn(len(LENGTHS), 4, HEAD_DIM, device=DEVICE), on_device(case.k_source),
                              on_device(case.v_source), dev(case.block_tables), dev(case.context_lens), 0.3,
                              read=ReadPlan(tokens=dev(plan.tokens), last=dev(plan.last.long())))
