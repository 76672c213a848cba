"""The `delta` variant's decode kernel and prefill (compiler/templates/paged_delta.py.jinja) against the torch path
(runtime/attention/delta_ops.py: `DeltaPages.read` then causal attention), over DeltaKV stores filled by
the torch store: sinks, centers, coded tokens and raw tails; every stored position or a token read plan
with newest tokens; with and without sinks and bias; one split or several. Interpreted on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.attention import delta_ops
from kvc.runtime.kv.delta_pages import DeltaPages
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.kv.spec import Delta

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
from tests.kernels.paged_cases import triton_device_and_ops  # noqa: E402
from tests.kernels.sm90 import compiles_for_sm90  # noqa: E402

DEVICE, delta_kernels = triton_device_and_ops("delta")
HEAD_DIM, KV_HEADS, GROUP, PAGE = 64, 2, 4, 16
LENGTHS = [70, 33, 5, 100]  # stored tokens before the step (each row's own token is position L)


def filled(sink: int, bias: bool, seed: int) -> tuple[DeltaPages, torch.Tensor, torch.Tensor]:
    """A delta store of LENGTHS tokens per row (random keys and values stored as the torch store
    writes them, in chunks), its page tables and SEQ rows."""
    g = torch.Generator().manual_seed(seed)
    enc = Delta("latent", "near", "centers", "sinks" if sink else None, "window", "down", "up",
                "bias" if bias else None, every=4, count=3, sink=sink, recent=8)
    code = KV_HEADS * 16
    pages = sum(-(-(n + 1) // PAGE) for n in LENGTHS) + 1
    rows = len(LENGTHS) + 2
    width = 2 * HEAD_DIM
    source = DeltaPages(
        enc, torch.zeros(pages, KV_HEADS, PAGE, code // KV_HEADS), torch.full((pages, KV_HEADS, PAGE, 2), -1,
                                                                              dtype=torch.int32),  # 3 over 2 heads
        torch.zeros(pages, KV_HEADS, PAGE // 4, width), torch.zeros(rows, KV_HEADS, sink, width) if sink else None,
        torch.zeros(rows, KV_HEADS, 16, width), torch.randn(KV_HEADS, width, code, generator=g) * 0.2,
        torch.randn(KV_HEADS, width, code, generator=g) * 0.2,
        torch.randn(KV_HEADS, width, generator=g) * 0.1 if bias else None,
        1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)))
    order = torch.randperm(pages - 1, generator=g).tolist()
    width_pages = max(-(-(n + 1) // PAGE) for n in LENGTHS)
    tables = torch.zeros(len(LENGTHS), width_pages, dtype=torch.int32)
    seq_rows = torch.randperm(rows, generator=g)[: len(LENGTHS)].to(torch.int32)
    for b, n in enumerate(LENGTHS):
        owned = [order.pop() for _ in range(-(-(n + 1) // PAGE))]
        tables[b, : len(owned)] = torch.tensor(owned, dtype=torch.int32)
        x = torch.randn(n, KV_HEADS, width, generator=g)
        for at in range(0, n, 13):  # chunks: blocks compressed as they come due
            source.store(tables[b], int(seq_rows[b]), at, x[at:at + 13])
    return source, tables, seq_rows


def oracle(source: DeltaPages, q, k_new, v_new, tables, rows, scale, read: ReadPlan | None) -> torch.Tensor:
    out = torch.zeros_like(q)
    for b, before in enumerate(LENGTHS):
        positions, listed = torch.arange(before), None
        if read is not None:
            positions, listed = delta_ops._listed(source, read, b, before)
        keys, values = source.read(tables[b], int(rows[b]), positions, before)
        keys = torch.cat([keys, k_new[b:b + 1].transpose(0, 1).float()], dim=1)
        values = torch.cat([values, v_new[b:b + 1].transpose(0, 1).float()], dim=1)
        out[b:b + 1] = delta_ops.causal(q[b:b + 1], keys, values, positions.shape[0], scale, listed)
    return out


def on(source: DeltaPages) -> DeltaPages:
    fields = {name: getattr(source, name) for name in source.__dataclass_fields__}
    return DeltaPages(**{name: value.to(DEVICE) if torch.is_tensor(value) else value for name, value in fields.items()})


@pytest.mark.parametrize("sink,bias,plan,splits", [(4, True, False, 1), (4, True, True, 3), (0, False, True, 2),
                                                   (0, True, False, 4)])
def test_delta_decode_equals_the_torch_path(sink, bias, plan, splits):
    source, tables, rows = filled(sink, bias, seed=sink * 10 + splits)
    g = torch.Generator().manual_seed(7)
    batch = len(LENGTHS)
    q = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, generator=g)
    k_new, v_new = (torch.randn(batch, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
    read = None
    if plan:  # 12 distinct tokens a head (some past the row, some -1, some inside the raw range), 5 newest
        tokens = torch.stack([torch.stack([torch.randperm(max(n, 9) + 4, generator=g)[:12] - 1
                                           for _ in range(KV_HEADS)]) for n in LENGTHS]).int()
        read = ReadPlan(tokens=tokens, last=torch.tensor([5, 1, 0, 5], dtype=torch.int32))
    want = oracle(source, q, k_new, v_new, tables, rows, 0.3, read)
    lens = torch.tensor([n + 1 for n in LENGTHS], dtype=torch.int32)
    dev_read = None if read is None else ReadPlan(tokens=read.tokens.to(DEVICE), last=read.last.to(DEVICE))
    got = delta_kernels.delta_decode(on(source), q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), tables.to(DEVICE),
                                     lens.to(DEVICE), rows.to(DEVICE), 0.3, dev_read, num_splits=splits, block_n=16)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("sink", [4, 0])
def test_delta_prefill_equals_the_torch_path(sink):
    """A prefill chunk of 7 tokens over each row's stored ones (decoded) and itself as computed, causal."""
    source, tables, rows = filled(sink, True, seed=3 + sink)
    g = torch.Generator().manual_seed(9)
    for b, stored in enumerate(LENGTHS):
        q = torch.randn(7, KV_HEADS * GROUP, HEAD_DIM, generator=g)
        k_new, v_new = (torch.randn(7, KV_HEADS, HEAD_DIM, generator=g) for _ in range(2))
        keys, values = source.read(tables[b], int(rows[b]), torch.arange(stored), stored)
        want = delta_ops.causal(q, torch.cat([keys, k_new.transpose(0, 1)], 1),
                                torch.cat([values, v_new.transpose(0, 1)], 1), stored, 0.3)
        got = delta_kernels.delta_prefill(on(source), q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE),
                                          tables[b].to(DEVICE), int(rows[b]), stored, 0.3)
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-4)


def test_the_other_entry_points_say_where_a_delta_layer_goes():
    with pytest.raises(NotImplementedError, match="delta_ops"):
        delta_kernels.store_kv()
    with pytest.raises(NotImplementedError, match="page plans"):
        delta_kernels.delta_decode(None, torch.zeros(1, 8, HEAD_DIM), None, None, None, None, None, 1.0,
                                   ReadPlan(pages=torch.zeros(1, 2, 1, dtype=torch.int32)))


def test_the_kernel_compiles_for_sm90() -> None:
    """The decode kernel at DeltaKV's defaults on the Qwen3-30B-A3B shape compiles for an H100/H200 (ptxas here)."""
    compiles_for_sm90("tests.kernels.sm90_compile", "delta")
