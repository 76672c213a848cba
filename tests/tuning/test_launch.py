"""A tuned entry really drives the launch, and kernels stay correct with non-default tuned configs.

Under TRITON_INTERPRET=1 on the CPU (tests/conftest.py) at tiny sizes: for each tuned kernel (the
generated attention wrappers, the fused MoE, the compaction kernel, the window scores) a table holding a
non-heuristic config for the call's bucket is installed; a spy on the Triton kernel records the
launch (grid, constexprs, warps) and the output is checked against the torch reference. A stale
source hash gives the heuristic launch back.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.tuning import buckets, lookup, table
from tests.kernels.paged_cases import make_case, reference_decode, reference_prefill, triton_device_and_ops

pytest.importorskip("triton")
DEVICE, OPS = triton_device_and_ops("plain")
HQ, HKV, D, PAGE = 4, 2, 16, 4


class Spy:
    """Stands in for a @triton.jit kernel: records each launch, then runs the real one."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((tuple(grid), kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


def install(kernel: str, family: str, bucket: tuple, config: dict, digest: str) -> None:
    entry = table.Entry(kernel, family, bucket, config, "test", digest)
    lookup.activate({entry.key: entry})


def spy_on(monkeypatch, module, name) -> Spy:
    spy = Spy(getattr(module, name))
    monkeypatch.setattr(module, name, spy)
    return spy


def decode_case(gen):
    case = make_case([5, 19, 11], HKV, D, PAGE, gen=gen, device=DEVICE)
    q = torch.randn(3, HQ, D, generator=gen).to(DEVICE)
    return case, q


@pytest.mark.parametrize("fresh_hash", [True, False])
def test_decode_uses_the_tuned_config_of_its_bucket(monkeypatch, fresh_hash):
    gen = torch.Generator().manual_seed(0)
    case, q = decode_case(gen)
    max_len = case.block_tables.shape[1] * PAGE
    bucket = buckets.decode(3, max_len, HQ, HKV, D, torch.float32)
    heuristic = OPS.decode_config(3, HKV, D, max_len, OPS.num_sms(DEVICE))
    tuned = {"num_splits": 3, "block_n": 16, "num_warps": 2, "num_stages": 1}
    assert heuristic.num_splits != 3 and heuristic.block_n != 16  # the entry differs from the heuristic
    install("attention.plain.decode", "decode", bucket, tuned, OPS.SOURCE_HASH if fresh_hash else "stale")
    split = spy_on(monkeypatch, OPS, "_decode_split_kernel")
    scale = 1 / math.sqrt(D)
    out = OPS.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale)
    (grid, kw), = split.calls
    if fresh_hash:
        assert grid[2] == 3 and kw["BLOCK_N"] == 16 and kw["num_warps"] == 2 and kw["num_stages"] == 1
    else:  # recompiled since tuning: the heuristic
        assert grid[2] == heuristic.num_splits and kw["BLOCK_N"] == heuristic.block_n
    torch.testing.assert_close(out.double(), reference_decode(case, q, scale), atol=1e-5, rtol=1e-4)


def test_explicit_knobs_override_the_tuned_entry(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    case, q = decode_case(gen)
    max_len = case.block_tables.shape[1] * PAGE
    install("attention.plain.decode", "decode", buckets.decode(3, max_len, HQ, HKV, D, torch.float32),
            {"num_splits": 3, "block_n": 16}, OPS.SOURCE_HASH)
    split = spy_on(monkeypatch, OPS, "_decode_split_kernel")
    OPS.paged_decode(q, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.25, num_splits=2)
    (grid, kw), = split.calls
    assert grid[2] == 2 and kw["BLOCK_N"] == 16  # the tuner's candidates go through these knobs


def test_prefill_uses_the_tuned_config(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    case = make_case([9, 14], HKV, D, PAGE, gen=gen, device=DEVICE)
    cu = [0, 5, 12]  # chunks of 5 and 7 queries ending each context
    q = torch.randn(12, HQ, D, generator=gen).to(DEVICE)
    bucket = buckets.prefill(7, HQ, HKV, D, torch.float32)
    install("attention.plain.prefill", "prefill", bucket, {"block_m": 32, "block_n": 16, "num_warps": 2},
            OPS.SOURCE_HASH)
    spy = spy_on(monkeypatch, OPS, "_prefill_kernel")
    scale = 1 / math.sqrt(D)
    out = OPS.paged_prefill(q, case.k_cache, case.v_cache, case.block_tables,
                            torch.tensor(cu, dtype=torch.int32, device=DEVICE), case.context_lens, scale, 7)
    (grid, kw), = spy.calls
    assert kw["BLOCK_N"] == 16 and kw["BLOCK_Q"] == 32 // 2 and kw["num_warps"] == 2
    torch.testing.assert_close(out.double(), reference_prefill(case, q, cu, scale), atol=1e-5, rtol=1e-4)


def test_store_kv_uses_the_tuned_warps(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, HKV, PAGE, D, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.randn(5, HKV, D, generator=gen).to(DEVICE), torch.randn(5, HKV, D, generator=gen).to(DEVICE)
    slots = torch.tensor([3, 0, -1, 9, 15], device=DEVICE)
    install("attention.plain.store_kv", "store_kv", buckets.store_kv(5, HKV, D, torch.float32), {"num_warps": 2},
            OPS.SOURCE_HASH)
    spy = spy_on(monkeypatch, OPS, "_store_kv_kernel")
    OPS.store_kv(k, v, k_cache, v_cache, slots)
    assert spy.calls[0][1]["num_warps"] == 2 != OPS.store_kv_num_warps(HKV, D)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    torch_ops.store_kv(k, v, want_k, want_v, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_fused_moe_uses_the_tuned_tiles(monkeypatch):
    from kvc.runtime.models import moe_triton
    from tests.kernels.test_moe_triton import make_experts, random_routing

    experts = make_experts(8, 64, 32)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids, weights = random_routing(5, 8, 2)
    heuristic = moe_triton.default_config(5, 2, 8, torch.float32)
    tuned = {"block_m": 32, "block_n": 16, "block_k": 16, "group_m": 2, "num_warps": 2, "num_stages": 1}
    assert heuristic.block_m != 32
    install(moe_triton.KERNEL, "moe", buckets.moe(5, 8, 2, 64, 32, torch.float32), tuned, moe_triton.SOURCE_HASH)
    spy = spy_on(monkeypatch, moe_triton, "_gate_up_kernel")
    experts.impl = "triton"
    got = experts(x, ids.to(torch.int32).contiguous(), weights.contiguous())
    kw = spy.calls[0][1]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["GROUP_M"], kw["num_warps"]) == (32, 16, 16, 2, 2)
    torch.testing.assert_close(got, experts.forward_torch(x, ids, weights), atol=1e-5, rtol=1e-4)


def test_compaction_uses_the_tuned_knobs(monkeypatch):
    from kvc.runtime.kv import compaction_triton
    from kvc.runtime.kv.compaction import compact_layer

    gen = torch.Generator().manual_seed(5)
    k0 = torch.randn(6, HKV, PAGE, D, generator=gen).to(DEVICE)
    v0 = torch.randn(6, HKV, PAGE, D, generator=gen).to(DEVICE)
    pages, length = [4, 1, 3, 0, 5], 19
    keep = torch.stack([torch.randperm(length, generator=gen)[:7].sort().values for _ in range(HKV)]).to(DEVICE)
    install(compaction_triton.KERNEL, "compaction", buckets.compaction(1, 7, HKV, D, torch.float32),
            {"block_t": 2, "block_d": 8, "num_warps": 1}, compaction_triton.SOURCE_HASH)
    spy = spy_on(monkeypatch, compaction_triton, "_compact_kernel")
    kt, vt = k0.clone(), v0.clone()
    compact_layer(kt, vt, pages, length, keep, checked=True, backend="triton")
    (grid, kw), = spy.calls
    assert kw["BLOCK_T"] == 2 and kw["BLOCK_D"] == 8 and kw["num_warps"] == 1 and grid[2] == D // 8
    want_k, want_v = k0.clone(), v0.clone()
    compact_layer(want_k, want_v, pages, length, keep, checked=True, backend="torch")
    assert torch.equal(kt, want_k) and torch.equal(vt, want_v)


@pytest.mark.parametrize("fresh_hash", [True, False])
def test_column_votes_uses_the_tuned_knobs(monkeypatch, fresh_hash):
    from kvc.runtime.primitives import triton_primitives as tp

    gen = torch.Generator().manual_seed(9)
    queries, keys = 6, 40
    q = torch.randn(HQ, queries, D, generator=gen).to(DEVICE)
    k = torch.randn(HKV, keys, D, generator=gen).to(DEVICE)
    want = tp.column_votes(q, k, keys - queries, block_q=16, block_k=16, num_warps=4)
    install(tp.KERNEL, "votes", buckets.votes(queries, keys, HQ, HKV, D, torch.float32),
            {"block_q": 32, "block_k": 32, "num_warps": 2}, tp.SOURCE_HASH if fresh_hash else "stale")
    rows, cols = spy_on(monkeypatch, tp, "_row_stats"), spy_on(monkeypatch, tp, "_columns")
    got = tp.column_votes(q, k, keys - queries)
    (_, row_kw), = rows.calls
    (col_grid, col_kw), = cols.calls
    expect = (32, 32, 2) if fresh_hash else (16, 16, 4)  # a stale entry: the CPU heuristic
    assert (row_kw["BLOCK_Q"], row_kw["BLOCK_K"], row_kw["num_warps"]) == expect
    assert (col_kw["BLOCK_R"], col_kw["BLOCK_K"], col_kw["num_warps"]) == expect  # the same rows a program (CPU)
    assert col_grid == (HKV * -(-(keys - queries) // expect[1]),)  # a program per KV head group and key block
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
