"""Decode state in paged state planes (runtime/kv/state_planes.py, runtime/compiled/decode.py):
the graph-capturable path of H2O's and TOVA's decode_after_attention, run here eagerly on the CPU
(the same code a CUDA graph captures: static shapes, device tensors, no host reads).

Oracle: the per-row dict path (`use_state_planes = False`, the previous implementation, one
generated call per row with host facts), itself pinned to the hand-written reference by
tests/runtime/test_decode_hooks.py. Both paths must give the same greedy tokens and the same
physical lengths after every step: batched requests with chunked prefill beside decodes,
preemption (recompute), and chains (state crossing turns through the record's pages, a fork).
A spy checks that the decode hook never reads the host and never needs the rows' host facts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.chain_prune import PruneRequest
from kvc.runtime.chains import ChainSpec
from kvc.runtime.kv import state_planes
from kvc.runtime.kv.compaction import CompactionJob, compact_many
from kvc.runtime.kv.state_planes import BatchSlots
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import LayerCacheView
from kvc.runtime.compiled.method import CompiledMethod
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import check_books

PAGE = 5
CASES = {"h2o": {"heavy": 0.3, "recent": 0.1}, "tova": {"budget": 26}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("planes"), seed=5, num_hidden_layers=2)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def make_llm(model_dir: Path, method: str, planes: bool, monkeypatch, **options) -> LLM:
    monkeypatch.setattr(CompiledMethod, "use_state_planes", planes)
    # the step end's eviction (TOVA's keep would otherwise ring: tests/runtime/test_decode_rings.py)
    defaults = dict(device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32,
                    attention_backend="torch", decode_rings=False)
    llm = LLM(str(model_dir), method=method, method_params=CASES[method], **{**defaults, **options})
    assert llm.engine.method.paged_state is planes and llm.engine.method.decode_graphs is planes
    assert bool(llm.engine.attention.planes) is planes
    return llm


def run(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Greedy tokens per request, and every request's kv_lens after every step it decoded."""
    engine = llm.engine
    seqs = [engine.add_request(p, greedy(steps)) for p in prompts]
    lengths: list[list[list[int]]] = [[] for _ in seqs]
    while engine.has_unfinished():
        engine.step()
        for i, s in enumerate(seqs):
            if not s.is_finished and not s.is_prefill and s.num_computed_tokens > s.num_prompt_tokens:
                lengths[i].append(list(s.kv_lens))
    assert engine.pool.num_free == engine.pool.num_pages
    return [s.generated_ids for s in seqs], lengths


def spy_plans(llm: LLM, monkeypatch) -> list[tuple[int, int, torch.Tensor]]:
    """Every step_end keep plan of the engine's method, in call order: (layer, context, indices)."""
    method = llm.engine.method
    original, plans = method.step_end_batch, []

    def spy(layer, views):
        out = original(layer, views)
        for view, plan in zip(views, out):
            if plan is not None:
                plans.append((layer, view.context_len, plan.indices.clone()))
        return out

    monkeypatch.setattr(method, "step_end_batch", spy)
    return plans


@pytest.mark.parametrize("method", sorted(CASES))
def test_planes_give_the_dict_path_tokens_and_lengths(model_dir, method, monkeypatch):
    """Three requests of different lengths arrive together: prefill chunks run beside decode rows
    (mixed steps), rows of one batch have different lengths, and eviction runs every step."""
    prompts = prompts_of([33, 71, 48], seed=21)
    dicts = make_llm(model_dir, method, False, monkeypatch)
    want_plans = spy_plans(dicts, monkeypatch)
    want = run(dicts, prompts, 24)
    llm = make_llm(model_dir, method, True, monkeypatch)
    got_plans = spy_plans(llm, monkeypatch)
    got = run(llm, prompts, 24)
    assert got == want
    # the same tokens evicted at every step: the state followed its keys through every compaction
    assert len(got_plans) == len(want_plans) > 2 * 3 * 20
    for a, b in zip(got_plans, want_plans):
        assert a[:2] == b[:2] and torch.equal(a[2], b[2])
    m = llm.engine.method
    assert not m._in_pages and not m._decode_state and not m._pending  # released with the requests


def test_plane_state_equals_the_dict_state_after_every_step(model_dir, monkeypatch):
    """H2O's `seen` in the planes, read through each sequence's page tables, equals the dict
    path's per-row state after every step (prefill end, then every decode step and its
    compaction): the state followed its keys."""
    dicts = make_llm(model_dir, "h2o", False, monkeypatch)
    planes = make_llm(model_dir, "h2o", True, monkeypatch)
    prompts = prompts_of([33, 71, 48], seed=21)
    pairs = [(dicts.engine.add_request(p, greedy(16)), planes.engine.add_request(p, greedy(16))) for p in prompts]
    plane = planes.engine.attention.planes["seen"]
    compared = 0
    while dicts.engine.has_unfinished():
        dicts.engine.step()
        planes.engine.step()
        for want_seq, got_seq in pairs:
            if got_seq.is_finished or got_seq.is_prefill:
                continue
            assert got_seq.kv_lens == want_seq.kv_lens
            for layer, length in enumerate(got_seq.kv_lens):
                want = dicts.engine.method._decode_state[want_seq.seq_id, layer]["seen"]
                # in time order: the planes path's keeps evict in place (runtime/kv/slot_order.py)
                view = LayerCacheView(planes.engine.attention.store_of(layer), got_seq.page_tables[layer], length)
                got = view.read_plane(plane)
                torch.testing.assert_close(got, want[:, :length])
                compared += 1
    assert not planes.engine.has_unfinished() and compared > 3 * 2 * 10


@pytest.mark.parametrize("method", sorted(CASES))
def test_the_graph_step_run_uncaptured(model_dir, method, monkeypatch):
    """Decode-only steps through the CUDA-graph runner's own step (`DecodeGraphs`: static buffers,
    batch-size buckets with padding rows, statistics `max_model_len` wide, no host rows), run
    without capture on the CPU: the dict path's tokens and lengths."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    prompts = prompts_of([33, 71, 48], seed=21)
    options = dict(max_model_len=160, max_num_seqs=6)
    want = run(make_llm(model_dir, method, False, monkeypatch, **options), prompts, 24)
    llm = make_llm(model_dir, method, True, monkeypatch, **options)
    runner = llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(runner, 6)
    replays = []

    def replay(batch, feed=None):
        replays.append(len(batch.seqs))
        return graphs.run_uncaptured(batch, feed)

    monkeypatch.setattr(graphs, "run", replay)
    assert run(llm, prompts, 24) == want
    assert {2, 3} <= set(replays)  # buckets 2 and 4 (one padding row)


@pytest.mark.parametrize("method", sorted(CASES))
def test_decode_hook_reads_no_host_value(model_dir, method, monkeypatch):
    """Every decode_after_attention call gets its view without the rows' host facts (as in a
    captured graph) and runs with the host-reading tensor methods disarmed; tokens unchanged."""
    prompts = prompts_of([40, 29], seed=3)
    want = run(make_llm(model_dir, method, False, monkeypatch), prompts, 12)[0]
    llm = make_llm(model_dir, method, True, monkeypatch)
    method_obj = llm.engine.method
    original = method_obj.decode_after_attention
    calls = []

    def forbidden(*args, **kwargs):
        raise AssertionError("the decode hook read a device value on the host")

    def graph_like(layer, view, out):
        view.rows = None
        with pytest.MonkeyPatch.context() as mp:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
                mp.setattr(torch.Tensor, name, forbidden)
            original(layer, view, out)
        calls.append(layer)

    monkeypatch.setattr(method_obj, "decode_after_attention", graph_like)
    assert run(llm, prompts, 12)[0] == want
    assert len(calls) >= 2 * 11  # both layers of every decode step


def test_planes_follow_preemption(model_dir, monkeypatch):
    """A pool too small for both prefill peaks: the newer request is preempted and recomputed;
    both paths, with the same number of pages, preempt alike and give the same tokens."""
    llm = make_llm(model_dir, "h2o", True, monkeypatch, kv_cache_memory=1)
    spec = llm.engine.spec
    kv_page = 2 * spec.num_kv_heads * PAGE * spec.head_dim * 4
    # the state planes, and each slot's position (H2O's keeps evict in place over planes)
    plane_page = 4 * spec.num_kv_heads * PAGE * (len(llm.engine.method.state_planes) + 1)
    pages = 30  # layer-pages: each 60-token prompt peaks at 2 x 12
    planes = make_llm(model_dir, "h2o", True, monkeypatch, kv_cache_memory=pages * (kv_page + plane_page))
    dicts = make_llm(model_dir, "h2o", False, monkeypatch, kv_cache_memory=pages * kv_page)
    assert planes.engine.num_pages == dicts.engine.num_pages == pages
    prompts = prompts_of([60, 60], seed=6)
    got, want = run(planes, prompts, 20), run(dicts, prompts, 20)
    assert planes.engine.scheduler.num_preemptions > 0
    assert planes.engine.scheduler.num_preemptions == dicts.engine.scheduler.num_preemptions
    assert got == want


def chain_turns(llm: LLM) -> list[list[int]]:
    """Open a chain, continue it twice (state crosses turns), fork it, prune it and continue it;
    every turn's tokens."""
    first_prompt = prompts_of([44], seed=8)[0]
    out = []
    first = llm.generate(first_prompt, greedy(7), chain=ChainSpec(open=True))[0]
    out.append(first.token_ids)
    history = first_prompt + first.token_ids
    second = llm.generate(history + prompts_of([9], seed=9)[0], greedy(6),
                          chain=ChainSpec(continue_id=first.chain_id))[0]
    out.append(second.token_ids)
    fork = llm.generate(history + prompts_of([9], seed=9)[0] + second.token_ids + [7, 8, 9], greedy(5),
                        chain=ChainSpec(fork_id=first.chain_id))[0]
    out.append(fork.token_ids)
    third = llm.generate(history + prompts_of([9], seed=9)[0] + second.token_ids + [11, 12], greedy(5),
                         chain=ChainSpec(continue_id=first.chain_id))[0]
    out.append(third.token_ids)
    llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 60),), keep=0.5))
    fourth = llm.generate(history + prompts_of([9], seed=9)[0] + second.token_ids + [11, 12] + third.token_ids
                          + [13, 14], greedy(5), chain=ChainSpec(continue_id=first.chain_id))[0]
    out.append(fourth.token_ids)
    check_books(llm.engine)
    return out


@pytest.mark.parametrize("method", sorted(CASES))
def test_planes_cross_chain_turns(model_dir, method, monkeypatch):
    """Same tokens per turn; and each continuation starts from the state the dict path resumes
    (H2O's `seen` of the record's stored tokens, read back from its pages)."""
    dicts = make_llm(model_dir, method, False, monkeypatch, max_num_batched_tokens=4096)
    want_states = []
    turn_resume = dicts.engine.method.turn_resume

    def spy_resume(seq_id, state, lengths):
        turn_resume(seq_id, state, lengths)
        for layer in range(len(lengths)):
            if (seq_id, layer) in dicts.engine.method._state:
                want_states.append(dicts.engine.method._state[seq_id, layer]["seen"].clone())

    monkeypatch.setattr(dicts.engine.method, "turn_resume", spy_resume)
    want = chain_turns(dicts)
    llm = make_llm(model_dir, method, True, monkeypatch, max_num_batched_tokens=4096)
    got_states = []
    original = llm.engine.method._resumed_state

    def spy(key, cache, stored):
        state = original(key, cache, stored)
        if state:
            got_states.append(state["seen"].clone())
        return state

    monkeypatch.setattr(llm.engine.method, "_resumed_state", spy)
    assert chain_turns(llm) == want
    assert len(got_states) == len(want_states) == (4 * 2 if llm.engine.method.states else 0)
    for got, want_state in zip(got_states, want_states):
        torch.testing.assert_close(got, want_state)


def test_batch_slots_read_and_write_where_the_tables_say():
    pages, heads, size = 6, 2, 4
    plane = torch.arange((pages + 1) * heads * size, dtype=torch.float32).reshape(pages + 1, heads, size)
    tables = torch.tensor([[3, 1, 0], [5, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([7, 2])
    slots = BatchSlots.of(tables, lengths, 9, size, pages)
    got = slots.gather(plane)  # [B, Hkv, W]
    torch.testing.assert_close(got[0, :, :7], state_planes.read(plane, [3, 1], 7))
    torch.testing.assert_close(got[1, :, :2], state_planes.read(plane, [5], 2))
    before = plane.clone()
    slots.scatter(plane, torch.full((2, heads, 9), -1.0))
    changed = (plane != before).nonzero()[:, 0].unique().tolist()
    assert changed == [1, 3, 5, 6]  # the rows' pages, and the scratch page for the padding
    assert (state_planes.read(plane, [3, 1], 7) == -1).all() and (plane[1, :, 3] == before[1, :, 3]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compaction_moves_planes_with_the_keys(backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(9, 2, 4, 8, generator=g), torch.randn(9, 2, 4, 8, generator=g)
    plane = torch.randn(10, 2, 4, generator=g)
    table = [3, 5, 1, 7]
    keys_before, state_before = k.clone(), state_planes.read(plane, table, 14)
    keep = torch.tensor([[0, 2, 5, 6, 9, 13], [1, 2, 3, 8, 12, 13]])
    compact_many(k, v, [CompactionJob(table, 14, keep)], backend=backend, planes=[plane])
    torch.testing.assert_close(state_planes.read(plane, table, 6), state_before.gather(1, keep))
    dense = keys_before[torch.tensor(table)].movedim(1, 0).flatten(1, 2)  # [Hkv, 16, D]
    moved = k[torch.tensor(table)].movedim(1, 0).flatten(1, 2)[:, :6]
    torch.testing.assert_close(moved, dense.gather(1, keep[..., None].expand(-1, -1, 8)))
