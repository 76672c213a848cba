"""The runner's batched step end (`ModelRunner._step_end`: one `CompactionBatch` per layer, plans
that share a tensor moved once) against the per-row oracle: `step_end` per sequence and one
`compact_many` per plan, each alone. After the step the K/V pools and the state planes must be
tensor-equal, and the reported lengths, start slots and verbatim tails the same.

Runners come from bench/step_end_runner_host.py (no model: shuffled page tables over one pool,
random planes with ties). Cases: the compiled H2O / TOVA / StreamingLLM over rows of two lengths
(two groups), and a hand-made mix per layer (rows of one stacked selection out of order, one plan
object shared by two rows, per-head counts, rows whose layer already has start slots, a row that
keeps all). Both compaction backends: torch on the CPU, and the Triton kernel under
TRITON_INTERPRET=1 (or on a GPU).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from bench.step_end_runner_host import make_runner
from kvc.runtime.model_runner import StepOutput
from kvc.runtime.kv.compaction import CompactionJob, compact_batch, compact_many, stack_keeps
from kvc.runtime.method_api import KeepPlan, LayerCacheView, StackedPlan

HEADS = 4
PAGE = 4


def backends() -> list[str]:
    out = ["torch"]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        out.append("triton")
    return out


def device_of(backend: str) -> str:
    """The Triton backend runs on the GPU where there is one, else under the interpreter on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def snapshot(runner, batch, compacted: dict | None = None) -> dict:
    """The pools, or with `compacted` (the lengths the step left; a spec whose keeps evict in place)
    every row's layers in time order: the runner's keeps move slots in place, the oracle's in order."""
    seqs = batch.seqs
    store = runner.attention.store
    if compacted is None:
        pools = {"k": runner.attention.k_cache.clone(), "v": runner.attention.v_cache.clone(),
                 **{n: p.clone() for n, p in runner.planes.items()}}
    else:
        pools = {}
        for seq in seqs:
            for layer in range(runner.num_layers):
                n = compacted.get(seq.seq_id, {}).get(layer, seq.kv_lens[layer] + 1)
                view = LayerCacheView(store, seq.page_tables[layer], n)
                ids = torch.as_tensor(seq.page_tables[layer], device=store.device).repeat_interleave(PAGE)[:n]
                at = torch.arange(n, device=store.device) % PAGE
                for name in ("k", "v", *runner.planes):
                    pools.setdefault(name, []).append(view.in_order(store[name][ids, :, at].transpose(0, 1)))
    return {"pools": pools, "starts": [list(s.kv_starts) for s in seqs], "verbatim": [s.verbatim_from for s in seqs]}


def assert_same(a: dict, b: dict) -> None:
    for name, pool in a["pools"].items():
        other = b["pools"][name]
        same = torch.equal(pool, other) if isinstance(pool, torch.Tensor) else all(
            torch.equal(x, y) for x, y in zip(pool, other, strict=True))
        assert same, f"{name} differs"
    assert a["starts"] == b["starts"] and a["verbatim"] == b["verbatim"]


def oracle_step_end(runner, batch, plans_of) -> dict:
    """Per row: the plan, then `compact_many` of that one job; returns the reported lengths."""
    compacted: dict[int, dict[int, int]] = {}
    backend = "triton" if runner.attention.backend == "triton" else "auto"
    spec = runner.attention.store.spec
    planes = list(runner.planes.values()) + ([runner.attention.store[spec.positions]] if spec.positions else [])
    for layer in range(runner.num_layers):
        plans = plans_of(layer)
        for seq, plan in zip(batch.seqs, plans):
            if plan is None:
                continue
            indices = plan.indices.clone()
            if spec.positions:  # time-order indices -> their slots, ascending (the layer may be out of order)
                view = LayerCacheView(runner.attention.store, seq.page_tables[layer], seq.kv_lens[layer] + 1)
                indices = view.order.gather(1, indices).sort(dim=1).values
            job = CompactionJob(seq.page_tables[layer], seq.kv_lens[layer] + 1, indices, plan.lengths,
                                seq.kv_starts[layer])
            done = compact_many(runner.attention.k_cache, runner.attention.v_cache, [job], backend=backend,
                                planes=planes)[0]
            compacted.setdefault(seq.seq_id, {})[layer] = done.length
            seq.verbatim_from = max(seq.verbatim_from, seq.num_computed_tokens + 1 - plan.tail)
            if done.starts is not None or seq.kv_starts[layer] is not None:
                seq.set_kv_starts(layer, done.starts)
    return compacted


def step_end(runner, batch) -> dict[int, dict[int, int]]:
    """The runner's step end over `batch`: the lengths its keep plans left, per sequence and layer."""
    output = StepOutput({})
    runner.hooks.step_end(batch, output)
    return output.compacted


def views_of(runner, batch, layer: int):
    """The StepViews `_step_end` builds (through the same code: a spy on the method's batch call)."""
    seen = {}
    method = runner.method
    original = method.step_end_batch

    def spy(lay, views):
        seen[lay] = views
        return [None] * len(views)

    method.step_end_batch = spy
    try:
        step_end(runner, batch)
    finally:
        method.step_end_batch = original
    return seen[layer]


@pytest.mark.parametrize("ragged,shuffled", [(True, False), (False, False), (False, True)])  # one group reuses
@pytest.mark.parametrize("backend", backends())                                              # its order
@pytest.mark.parametrize("method", ["h2o", "tova", "streamingllm"])
def test_compiled_step_end_equals_the_per_row_oracle(method, backend, ragged, shuffled):
    """`shuffled`: the rows' layers already out of time order, each its own way (runtime/kv/slot_order.py)."""
    make = dict(batch=7, layers=2, kv=60, page=PAGE, kv_heads=HEADS, head_dim=4, backend=backend, ragged=ragged,
                seed=5, device=device_of(backend), own_layers=True, shuffled=shuffled)
    runner, batch = make_runner(method, **make)
    oracle, obatch = make_runner(method, **make)
    compacted = step_end(runner, batch)
    want = oracle_step_end(oracle, obatch, lambda layer: [
        oracle.method.step_end(layer, v) for v in views_of(oracle, obatch, layer)])
    assert list(compacted.values()) == list(want.values())  # seq ids differ between the two runners
    assert len(compacted) == 7 and all(len(v) == 2 for v in compacted.values())
    assert runner.attention.store.spec.positions is not None  # the runner's keeps move slots in place
    assert_same(snapshot(runner, batch, compacted), snapshot(oracle, obatch, want))


def ascending(length: int, count: int, start: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(length - start, generator=g)[:count].sort().values + start


def mixed_plans(layer: int, lengths: list[int], starts: list[list[int] | None], seed: int) -> list:
    """Per row (8 rows): a mix of stacked rows out of order, a shared plan, per-head counts, a
    row keeping all, and None."""
    g = torch.Generator().manual_seed(seed + layer)
    n = min(lengths[0], lengths[1], lengths[3]) - 3
    stack = torch.stack([torch.stack([ascending(lengths[0], n, 0, g) for _ in range(HEADS)]) for _ in range(3)])
    shared = KeepPlan(torch.stack([ascending(min(lengths[2], lengths[4]), n - 5, 0, g) for _ in range(HEADS)]), tail=2)
    counts = [9, 3, 0, 7]
    ragged = torch.zeros(HEADS, 9, dtype=torch.long)
    for h, c in enumerate(counts):
        ragged[h, :c] = ascending(lengths[5], c, starts[5][h] if starts[5] else 0, g)
    recut = torch.stack([ascending(lengths[6], 4, starts[6][h], g) for h in range(HEADS)])
    keep_all = torch.arange(lengths[7]).expand(HEADS, -1).clone()
    return [StackedPlan(stack, 2, tail=1), StackedPlan(stack, 0, tail=1), shared, StackedPlan(stack, 1, tail=1),
            shared, KeepPlan(ragged, torch.tensor(counts)), KeepPlan(recut), KeepPlan(keep_all)]


@pytest.mark.parametrize("backend", backends())
def test_mixed_plans_equal_the_per_row_oracle(backend):
    make = dict(batch=8, layers=2, kv=40, page=PAGE, kv_heads=HEADS, head_dim=4, backend=backend, ragged=True,
                seed=9, device=device_of(backend))
    runs = [make_runner("tova", **make, in_place=False) for _ in range(2)]  # per-head counts: in order
    for runner, batch in runs:
        for seq in batch.seqs[5:7]:  # layers compacted before with per-head counts: starts
            seq.kv_starts = [[3, 0, 5, 1] for _ in range(runner.num_layers)]
    (runner, batch), (oracle, obatch) = runs
    lengths = [s.kv_lens[0] + 1 for s in batch.seqs]
    starts = [s.kv_starts[0] for s in batch.seqs]
    plans = {layer: mixed_plans(layer, lengths, starts, seed=21) for layer in range(2)}
    runner.method.step_end_batch = lambda layer, views: plans[layer]
    compacted = step_end(runner, batch)
    want = oracle_step_end(oracle, obatch, lambda layer: plans[layer])
    assert list(compacted.values()) == list(want.values())
    assert_same(snapshot(runner, batch), snapshot(oracle, obatch))
    assert batch.seqs[5].kv_starts[0] == [0, 6, 9, 2]  # right-aligned below M = 9
    assert batch.seqs[6].kv_starts[0] is None  # equal counts reset the starts


def test_shared_plans_move_once():
    """One stacked selection in order is the keep tensor itself; one plan for all rows an
    expanded view (no copy); a mix is gathered, padded to the widest and concatenated."""
    stack = torch.arange(24).view(2, 3, 4)
    keep, pos, widths = stack_keeps([(stack, 0), (stack, 1)], torch.device("cpu"))
    assert keep.data_ptr() == stack.data_ptr() and pos.tolist() == [0, 1]
    plan = torch.arange(6).view(3, 2)
    keep, pos, widths = stack_keeps([(plan, None)] * 3, torch.device("cpu"))
    assert keep.shape == (3, 3, 2) and keep.stride(0) == 0 and widths.tolist() == [2, 2, 2]
    keep, pos, widths = stack_keeps([(plan, None), (stack, 1), (stack, 0), (plan, None)], torch.device("cpu"))
    assert keep.shape == (4, 3, 4) and widths.tolist() == [2, 4, 4, 2]
    for j, want in enumerate([plan, stack[1], stack[0], plan]):
        assert torch.equal(keep[pos[j], :, : widths[j]], want)


def test_batch_checks_name_the_job():
    runner, batch = make_runner("tova", batch=3, layers=1, kv=12, page=PAGE, kv_heads=HEADS, head_dim=4, seed=2)
    k, v = runner.attention.k_cache, runner.attention.v_cache
    good = torch.arange(5).expand(HEADS, -1)
    jobs = [CompactionJob(s.page_tables[0], 13, good.clone()) for s in batch.seqs]
    jobs[1].keep = good.flip(1).clone()
    with pytest.raises(ValueError, match="must ascend"):
        compact_many(k, v, jobs, checked=True)
    jobs[1].keep = good + 10
    with pytest.raises(ValueError, match="outside the stored tokens of KV head 0"):
        compact_many(k, v, jobs, checked=True)
    jobs[1] = CompactionJob(batch.seqs[1].page_tables[0][:2], 13, good.clone())
    with pytest.raises(ValueError, match="cannot hold"):
        compact_many(k, v, jobs)
    assert np.array_equal(compact_batch(k, v, _empty_like(k)), np.zeros(0))


def _empty_like(k: torch.Tensor):
    from kvc.runtime.kv.compaction import batch_of_jobs

    return batch_of_jobs(k, [])


@pytest.mark.parametrize("method,selections", [("streamingllm", 1), ("tova", 1), ("h2o", 6)])
def test_rows_of_other_prompts_share_a_selection_that_does_not_read_them(method, selections, monkeypatch):
    """Rows of one length whose prompts differ: StreamingLLM's and TOVA's selections read only the length,
    so the rows share one selection; H2O's fractions of the prompt need one per prompt, over score planes
    read (and sorted by position) once for all the rows. Either way the per-row oracle's result."""
    make = dict(batch=6, layers=1, kv=60, page=PAGE, kv_heads=HEADS, head_dim=4, seed=7, own_layers=True)
    runner, batch = make_runner(method, **make)
    oracle, obatch = make_runner(method, **make)
    for b in range(6):  # prompts of 480 + 3b or 60 + 3b tokens, every layer storing the same 60
        batch.seqs[b].prefill_end -= 3 * b
        obatch.seqs[b].prefill_end -= 3 * b
    calls, method_obj = [], runner.method
    select = method_obj._select_fn
    monkeypatch.setattr(method_obj, "_select_fn", lambda scores, sym, params: (
        calls.append(1) if scores.device.type != "meta" else None) or select(scores, sym, params))
    monkeypatch.setattr(method_obj, "step_end", lambda layer, view: pytest.fail("a row selected alone"))
    compacted = step_end(runner, batch)
    want = oracle_step_end(oracle, obatch, lambda layer: [
        oracle.method.step_end(layer, v) for v in views_of(oracle, obatch, layer)])
    assert len(calls) == selections
    assert len(compacted) == 6  # every row evicted
    assert list(compacted.values()) == list(want.values())
    assert_same(snapshot(runner, batch, compacted), snapshot(oracle, obatch, want))
