"""RetroInfer (methods/retroinfer.kvm) compiled and served: its cluster index, plans and estimate
against the hand-written oracle (tests/references/retroinfer.py, the paper's wave index).

- k-means, the index's segments, the cluster scores, the exact reads and the estimated clusters of
  a decode batch (rows of several lengths, one grown by a decode-time segment) equal the
  reference's; decode attention over that plan equals the reference's softmax over exact tokens and
  pseudo-keys, and a hand-made estimate-augmented plan equals a softmax written out here.
- With `retrieved = computed = 1` (every cluster read exactly) RetroInfer's greedy tokens are
  `full`'s (tiny Llama and Qwen3, batched, chunked prefill, index grown while decoding).
- Served with small fractions it equals the reference, tokens and every sampled logit row: a batch
  with chunked prefills, a prefix-cache hit, a chain continued and forked, a preemption (with and
  without prefix caching).
- Bad parameters and constructs the compiler cannot lower are refused with their reasons.
"""

from __future__ import annotations

from functools import partial
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.compiled.method import CompiledMethod
from kvc.runtime.compiled.read import ReadHook
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.plans import Estimate, ReadPlan
from kvc.runtime.llm import LLM
from kvc.runtime.kv.store import KVStore
from kvc.runtime.method_api import DecodeView, LayerCacheView, PrefillView, StepView
from kvc.runtime.methods import resolve_method
from kvc.runtime.primitives import clusters
from kvc.runtime.primitives.clusters import kmeans
from tests.methods import served
from tests.methods.read_spy import Plans
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import retroinfer as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
PARAMS = {"cluster_size": 4, "segment": 8, "sink": 2, "local": 3, "retrieved": 0.25, "computed": 0.6}
EVERYTHING = {**PARAMS, "retrieved": 1.0, "computed": 1.0}


def test_kmeans_equals_the_reference() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 8, generator=g)
    for k, iterations in ((5, 10), (10, 3), (1, 2), (37, 4)):
        got = kmeans(x, k, iterations)
        for h in range(3):
            assert got[h].tolist() == ref.kmeans(x[h], k, iterations), (k, iterations, h)


# ---- one decode step of a batch, against the reference ----------------------------------------


def _batch(seed: int, rows: list[tuple[int, int]], method, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """A decode step over rows (prompt, length), row b the sequence b's row of the store: paged K/V
    (pages in shuffled order) in a store of the method's spec, each row's index written as the
    engine writes it (`_written`), the step's query, a DecodeView as a graph step builds it (no host
    rows), and each row's dense keys/values [Hkv, length, D]."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-length // PAGE) for _, length in rows]
    total = sum(pages_per_row)
    method.bind(1, kv_heads, max_context=LONGEST)
    store = KVStore(method.kv_spec(kv_heads, dim, torch.float32, PAGE), total, kv_heads, PAGE, 1, "cpu",
                    num_rows=len(rows))
    store["k"].copy_(torch.randn(total + 1, kv_heads, PAGE, dim, generator=g) * 2)
    store["v"].copy_(torch.randn(total + 1, kv_heads, PAGE, dim, generator=g))
    order = torch.randperm(total, generator=g)
    width = max(pages_per_row)
    tables = torch.full((len(rows), width), total, dtype=torch.int32)
    dense, at = [], 0
    for b, n in enumerate(pages_per_row):
        tables[b, :n] = order[at:at + n].to(torch.int32)
        at += n
        length = rows[b][1]
        ids = tables[b, :n].long()
        dense.append(tuple(c[ids].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :length]
                           for c in (store["k"], store["v"])))
    q = torch.randn(len(rows), heads, dim, generator=g)
    for b, (prompt_len, length) in enumerate(rows):
        _written(method, store, b, tables[b, :pages_per_row[b]].tolist(), prompt_len, length, heads)
    return _view(q, rows, store, tables, dense), dense


def _written(method, store: KVStore, b: int, pages: list[int], prompt_len: int, length: int, heads: int) -> int:
    """Sequence b's index in its row b as the engine writes it before its decode step of `length`:
    prefill_end over the prompt, then step_end after each decode step before it (where `step_end_due`
    says so). Returns how many step_end calls grew it."""
    def cache(n: int) -> LayerCacheView:
        return LayerCacheView(store, pages, n, layer=0, row=b)

    kv_heads, dim = store.num_kv_heads, store["k"].shape[-1]
    view = PrefillView(seq_id=b, layer=0, num_layers=1, q=torch.zeros(prompt_len, heads, dim),
                       k=torch.zeros(prompt_len, kv_heads, dim), v=torch.zeros(prompt_len, kv_heads, dim), start=0,
                       prompt_len=prompt_len, cache=cache(prompt_len))
    assert method.prefill_end(0, view) is None
    grown = 0
    for stored in range(prompt_len + 1, length):
        due = method.step_end_due(0, np.array([stored]), np.array([prompt_len]), np.array([stored]))
        if due is None or due[0]:
            grown += 1
            assert method.step_end_batch(0, [StepView(b, 0, 1, stored, prompt_len, cache(stored))]) == [None]
    return grown


def _view(q, rows, store, tables, dense) -> DecodeView:
    """The decode view of rows (prompt, length) over the store (`dense`: each row's keys and values)."""
    lengths = torch.tensor([length for _, length in rows], dtype=torch.int32)
    dim = q.shape[-1]
    return DecodeView(layer=0, q=q, k=torch.stack([d[0][:, -1] for d in dense]),
                      v=torch.stack([d[1][:, -1] for d in dense]), block_tables=tables, context_lens=lengths,
                      store=store, scale=dim ** -0.5,
                      prompt_lens=torch.tensor([p for p, _ in rows], dtype=torch.int32),
                      max_context_len=int(lengths.max()), seq_rows=torch.arange(len(rows), dtype=torch.int32))


ROWS = [(30, 34), (11, 12), (23, 39), (5, 6)]  # (prompt, length): row 2 grows its index by a segment while decoding
LONGEST = 64  # the rows' buffers are sized for it


def test_plans_and_attention_equal_the_reference() -> None:
    method = resolve_method("retroinfer", PARAMS)
    view, dense = _batch(1, ROWS, method)
    read = method.decode_before_attention(0, view)
    assert isinstance(read, ReadPlan) and read.tokens is not None and read.estimate is not None
    out = torch_ops.paged_decode(view.q, view.store.k_cache, view.store.v_cache, view.block_tables, view.context_lens,
                                 view.scale, max_context_len=view.max_context_len, read=read)
    estimated = 0
    for b, (prompt_len, length) in enumerate(ROWS):
        keys, values = dense[b]
        reads = ref.plan(view.q[b], keys, values, PARAMS, prompt_len)
        _, end, _ = ref.segments(PARAMS, prompt_len, length)
        assert int(read.last[b]) == length - end
        for h, (exact, guessed) in enumerate(reads):
            listed = set(read.tokens[b, h][read.tokens[b, h] >= 0].tolist()) | set(range(end, length))
            assert sorted(listed) == exact, (b, h)
            weights = read.estimate.log_weights[b, h]
            got = sorted((round(float(w.exp())), read.estimate.keys[b, h, e].tolist())
                         for e, w in enumerate(weights) if w > float("-inf"))
            want = sorted((len(c.slots), c.centroid.tolist()) for c in guessed)
            assert [n for n, _ in got] == [n for n, _ in want], (b, h)
            torch.testing.assert_close(torch.tensor([c for _, c in got]).reshape(-1), torch.tensor(
                [c for _, c in want]).reshape(-1), atol=1e-5, rtol=1e-5)
            estimated += len(guessed)
        torch.testing.assert_close(out[b], ref.attend(view.q[b], keys, values, reads, view.scale), atol=1e-5,
                                   rtol=1e-5)
    assert estimated > 0, "no cluster was estimated: the test is blind"
    assert method.indices.written[(2, 0)].end == 23 - 3 + 2 * 8  # row 2: two segments clustered while decoding
    bounds = view.store[method.indices.bounds][2, 0]  # what the hook reads: every KV head's (start, end)
    assert bounds.tolist() == [[2, 36]] * 2


def test_the_index_grows_a_segment_at_a_time_at_step_end() -> None:
    """step_end grows a row's index once a whole segment lies between it and the newest `last`
    (`step_end_due` picks exactly those steps), for the next step: the plan the reference builds
    from scratch; a released sequence's books are dropped."""
    method = resolve_method("retroinfer", PARAMS)
    view, dense = _batch(2, [(23, 31), (14, 21)], method)
    assert (method.indices.written[(0, 0)].start, method.indices.written[(0, 0)].end) == (2, 28)
    store = view.store
    pages = view.block_tables[0, :8].tolist()
    assert _written(method, store, 0, pages, 23, 31, 4) == 1  # one segment, at the step that stored 28 + 3
    read = method.decode_before_attention(0, view)
    for b, (prompt_len, _) in enumerate([(23, 31), (14, 21)]):
        reads = ref.plan(view.q[b], *dense[b], PARAMS, prompt_len)
        got = torch_ops.paged_decode(view.q, view.store.k_cache, view.store.v_cache, view.block_tables,
                                     view.context_lens, view.scale, max_context_len=view.max_context_len,
                                     read=read)[b]
        torch.testing.assert_close(got, ref.attend(view.q[b], *dense[b], reads, view.scale), atol=1e-5, rtol=1e-5)
    method.release(0)
    assert (0, 0) not in method.indices.written and (1, 0) in method.indices.written


def test_the_rows_buffers_bound_every_index_and_are_counted() -> None:
    """The rows' buffers hold the largest index of a context of LONGEST tokens (segments whole but
    one), and one row's bytes (what admission and the pool's sizing count) include them."""
    method = resolve_method("retroinfer", PARAMS)
    view, _ = _batch(3, [(LONGEST - 1, LONGEST), (1, LONGEST)], method)
    spec = view.store.spec
    clusters = method.indices.max_clusters(LONGEST, PARAMS)
    assert clusters == LONGEST // 4
    for b in range(2):
        assert method.indices.written[(b, 0)].clusters <= clusters
    assert spec.tensor(method.indices.sizes).shape == (clusters,)
    assert spec.tensor(method.indices.members).shape == (LONGEST,)
    per_head = 4 * clusters + 4 * LONGEST + 4 * 2 + 2 * 4 * clusters * 8  # sizes, members, bounds, two summaries
    assert spec.bytes_per_row(2, 3) == 3 * 2 * per_head
    assert method.indices.max_clusters(10, {**PARAMS, "segment": 8}) == 2 + 1  # 8 + 2 tokens: 2 + 1 clusters
    assert method.indices.max_clusters(10, {**PARAMS, "cluster_size": 3, "segment": 6}) == 2 + 2


@pytest.mark.parametrize("backend,packed", [("torch", False), ("torch", True), ("triton", False), ("triton", True)])
def test_attention_with_an_estimate_is_a_softmax_over_tokens_and_pseudo_keys(backend: str, packed: bool) -> None:
    """paged_decode with a token plan, `last` and an Estimate equals the softmax written out here: the
    torch path, and the spec variant's split kernel with the estimate as one more partial (its kernels under
    TRITON_INTERPRET=1 without a GPU), a plan as written or packed (`clusters.packed`: listed slots first,
    each head's count)."""
    device, ops = torch.device("cpu"), torch_ops
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        device, ops = triton_device_and_ops("spec")
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, pages = 4, 2, 8, 6
    k_cache = torch.randn(pages + 1, kv_heads, PAGE, dim, generator=g)
    v_cache = torch.randn(pages + 1, kv_heads, PAGE, dim, generator=g)
    tables = torch.tensor([[3, 0, 5, 1], [2, 4, 6, 6]], dtype=torch.int32)
    lengths = torch.tensor([15, 7], dtype=torch.int32)
    q = torch.randn(2, heads, dim, generator=g)
    tokens = torch.tensor([[[0, 4, 9, -1], [1, 2, -1, -1]], [[0, -1, -1, -1], [3, 1, -1, -1]]], dtype=torch.int32)
    last = torch.tensor([2, 1], dtype=torch.int32)
    e_keys, e_values = torch.randn(2, kv_heads, 3, dim, generator=g), torch.randn(2, kv_heads, 3, dim, generator=g)
    log_w = torch.tensor([[[math.log(5), math.log(2), float("-inf")], [float("-inf")] * 3],
                          [[0.0, math.log(7), math.log(3)], [math.log(4), float("-inf"), float("-inf")]]])
    plan, counts = clusters.packed(tokens) if packed else (tokens, None)
    if packed:
        assert counts.tolist() == [[3, 2], [1, 2]] and plan[0, 0].tolist() == [0, 4, 9, -1]
    put = partial(torch.Tensor.to, device=device)
    read = ReadPlan(tokens=put(plan), last=put(last), estimate=Estimate(put(e_keys), put(e_values), put(log_w)),
                    counts=None if counts is None else put(counts))
    scale = 0.3
    out = ops.paged_decode(put(q), put(k_cache), put(v_cache), put(tables), put(lengths), scale, read=read).cpu()
    for b in range(2):
        n = int(lengths[b])
        keys = k_cache[tables[b].long()].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        values = v_cache[tables[b].long()].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        for g_ in range(heads):
            h = g_ // (heads // kv_heads)
            slots = sorted({int(t) for t in tokens[b, h] if t >= 0} | set(range(n - int(last[b]), n)))
            entries = [(float(q[b, g_] @ keys[h, s]) * scale, values[h, s]) for s in slots]
            entries += [(float(q[b, g_] @ e_keys[b, h, e]) * scale + float(log_w[b, h, e]),
                         e_values[b, h, e] / math.exp(float(log_w[b, h, e])))  # a value sum over its weight
                        for e in range(3) if log_w[b, h, e] > float("-inf")]
            top = max(x for x, _ in entries)
            weights = [math.exp(x - top) for x, _ in entries]
            want = sum(w * v for w, (_, v) in zip(weights, entries)) / sum(weights)
            torch.testing.assert_close(out[b, g_], want, atol=1e-5 if backend == "triton" else 1e-6, rtol=1e-5)


@pytest.mark.parametrize("num_splits,by_rows", [(None, False), (1, False), (5, False), (None, True)])
def test_packed_plans_with_estimates_in_splits_equal_the_torch_path(num_splits, by_rows) -> None:
    """The spec variant's decode of packed token plans (`counts`) with `last` and an estimate, its splits
    sharing each head's own count (some splits empty, some heads listing nothing), equals the torch path;
    `by_rows`: the estimate's keys and sums are views over every sequence row (`Estimate.rows`)."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, ops = triton_device_and_ops("spec")
    g = torch.Generator().manual_seed(11)
    batch, kv_heads, group, dim, page, width, entries = 3, 2, 4, 16, 4, 48, 520  # 3 estimate partials
    lengths = torch.tensor([61, 17, 40], dtype=torch.int32)
    pages = 16
    tables = torch.randperm(3 * pages, generator=g).reshape(batch, pages).to(torch.int32) + 1
    k_cache = torch.randn(3 * pages + 1, kv_heads, page, dim, generator=g)
    v_cache = torch.randn(3 * pages + 1, kv_heads, page, dim, generator=g)
    q = torch.randn(batch, kv_heads * group, dim, generator=g)
    last = torch.tensor([5, 0, 9], dtype=torch.int32)
    tokens = torch.full((batch, kv_heads, width), -1, dtype=torch.long)
    for b in range(batch):
        for h in range(kv_heads):
            older = int(lengths[b] - last[b])
            n = 0 if (b, h) == (1, 1) else int(torch.randint(1, older, (1,), generator=g))
            chosen = torch.randperm(older, generator=g)[:n].sort().values
            tokens[b, h, torch.randperm(width, generator=g)[:n].sort().values] = chosen  # scattered, -1 between
    plan, counts = clusters.packed(tokens)
    log_w = torch.rand(batch, kv_heads, entries, generator=g).log() + 2.0
    log_w[0, 1, 3:] = float("-inf")
    log_w[2, 0] = float("-inf")  # a head with no estimate
    estimate = (torch.randn(batch, kv_heads, entries, dim, generator=g),
                torch.randn(batch, kv_heads, entries, dim, generator=g), log_w)
    want = torch_ops.paged_decode(q, k_cache, v_cache, tables, lengths, 0.25,
                                  read=ReadPlan(tokens=tokens.to(torch.int32), last=last, estimate=Estimate(*estimate)))
    put = partial(torch.Tensor.to, device=device)
    on_device = Estimate(*map(put, estimate))
    if by_rows:
        rows = torch.tensor([2, 5, 0])
        keys, sums = (torch.zeros(7, kv_heads, entries + 2, dim) for _ in range(2))
        keys[rows, :, :entries], sums[rows, :, :entries] = estimate[0], estimate[1]
        on_device = Estimate(put(keys)[:, :, :entries], put(sums)[:, :, :entries], put(log_w), rows=put(rows))
        assert torch.equal(on_device.gathered().keys.cpu(), estimate[0])
    read = ReadPlan(tokens=put(plan), last=put(last), counts=put(counts), estimate=on_device)
    got = ops.paged_decode(put(q), put(k_cache), put(v_cache), put(tables), put(lengths), 0.25, read=read,
                           num_splits=num_splits, block_n=None if num_splits is None else 16)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


# ---- served ---------------------------------------------------------------------------------------


def make_llm(model_dir: Path, method: str = "retroinfer", params: dict | None = None, **options) -> LLM:
    # the rows' cluster indices are sized by max_model_len, two rows per sequence
    engine_options = {"max_num_batched_tokens": 4096, "max_model_len": 128, "max_num_seqs": 8, "device": "cpu",
                      "attention_backend": "torch", "kv_cache_memory": 2**22, **options}
    config = EngineConfig(model=str(model_dir), dtype="float32", page_size=PAGE, method=method,
                          method_params=(PARAMS if params is None else params) if method == "retroinfer" else {},
                          **engine_options)
    return LLM.from_engine(Engine(config))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_reading_every_cluster_is_full(tmp_path: Path, monkeypatch, arch: str) -> None:
    make = make_tiny_llama if arch == "llama" else make_tiny_qwen3
    model_dir = make(tmp_path, seed=5, num_hidden_layers=5, initializer_range=0.25)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (41, 2), (9, 3), (30, 4))]
    params = [greedy(14) for _ in prompts]
    full = [o.token_ids for o in make_llm(model_dir, "full").generate(prompts, params)]
    plans = Plans(monkeypatch)
    whole = make_llm(model_dir, params=EVERYTHING, max_num_batched_tokens=24, max_prefill_chunk=8)
    assert whole.engine.method.compacts is False  # every token stays stored: prefix caching on
    assert [o.token_ids for o in whole.generate(prompts, params)] == full
    assert plans.count > 0, "no read plan was made: the test is blind"
    assert not whole.engine.method.indices.written  # released with their requests
    few = make_llm(model_dir, params={**PARAMS, "retrieved": 0.1, "computed": 0.1})
    assert [o.token_ids for o in few.generate(prompts, params)] != full
    graphed = make_llm(model_dir, params=EVERYTHING, max_num_batched_tokens=24, max_prefill_chunk=8)
    replays = served.graph_steps(graphed, monkeypatch)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == full
    assert replays, "no decode step ran through the graph path: the test is blind"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("retroinfer"), seed=7, num_hidden_layers=5, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def session() -> ref.Session:
    return ref.Session(dict(PARAMS))


def test_batch_with_chunked_prefills_equals_the_oracle(model_dir, hf, monkeypatch) -> None:
    """Requests of different lengths, prefilled in chunks of 8 beside the others' decode steps."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_num_batched_tokens=20, max_prefill_chunk=8)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        reference = session()
        want = ref.generate(hf, reference, p, 10)
        check(out.token_ids, spy.of(sp), want)
        if len(p) > 20:
            assert reference.estimated > 0, "no cluster was estimated: the test is blind"
            dense = ref.generate(hf, ref.Session(dict(EVERYTHING)), p, 10)[1]
            assert (dense[1:] - want[1][1:]).abs().max() > 10 * ATOL, "RetroInfer changes nothing: the test is blind"


def served_llm(model_dir: Path, monkeypatch, graphs: bool, **options) -> tuple[LLM, list[int]]:
    """The served method, its decode-only steps through the graph path (run uncaptured) or eager;
    the batch sizes of the graph steps."""
    llm = make_llm(model_dir, **options)
    return llm, served.graph_steps(llm, monkeypatch) if graphs else [0]


def test_graph_steps_equal_the_oracle(model_dir, hf, monkeypatch) -> None:
    """Decode-only steps through the CUDA-graph runner's step (static buffers, the rows among them;
    a batch bucket with a padding row; no host facts in the hook): the oracle's tokens and logits,
    with an index grown while decoding."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir)
    replays = served.graph_steps(llm, monkeypatch)
    indices, grown = llm.engine.method.indices, []
    grow = indices.grow

    def spy_grow(layer, views, sym, params):
        grow(layer, views, sym, params)
        grown.extend(v.seq_id for v in views if indices.written[(v.seq_id, layer)].end > v.prompt_len - 3)

    monkeypatch.setattr(indices, "grow", spy_grow)
    prompts = [prompt(n, seed) for n, seed in ((33, 21), (18, 22), (26, 23))]
    params = [greedy(12) for _ in prompts]
    outs = llm.generate(prompts, params)
    assert 3 in replays  # bucket 4: one padding row
    for p, out, sp in zip(prompts, outs, params):
        check(out.token_ids, spy.of(sp), ref.generate(hf, session(), p, 12))
    assert grown, "no index grew while decoding: the test is blind"


def test_the_triton_backend_in_graph_steps_equals_the_oracle(model_dir, hf, monkeypatch) -> None:
    """The GPU path, its kernels under TRITON_INTERPRET=1: Triton stores and prefill, the compiler's fused
    cluster scores over the index's rows (no gather), the decode of a plan with an estimate, in graph steps
    run uncaptured: the oracle's tokens and logits."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    monkeypatch.setattr(CompiledMethod, "fused_devices", ("cuda", "cpu"))  # the compiler's cluster_scores too
    scored = []
    original = ReadHook._cluster_plan
    monkeypatch.setattr(ReadHook, "_cluster_plan", lambda self, *a: scored.append(a[-1]) or original(self, *a))
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, device=device.type, attention_backend="triton", cuda_graphs=False)
    replays = served.graph_steps(llm, monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 4))]
    params = [greedy(8) for _ in prompts]
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp), ref.generate(hf, session(), p, 8))
    assert replays and scored and all(scored), "the fused cluster scores must have served every read"


@pytest.mark.parametrize("graphs", [False, True])
def test_prefix_cache_hit(model_dir, hf, monkeypatch, graphs: bool) -> None:
    llm, replays = served_llm(model_dir, monkeypatch, graphs)
    served.prefix_cache_hit(llm, Logits(monkeypatch), partial(ref.generate, hf), session)
    assert replays


@pytest.mark.parametrize("graphs", [False, True])
def test_chain_continued_and_forked(model_dir, hf, monkeypatch, graphs: bool) -> None:
    """A chain's next turn counts the stored history as its prompt: its index is built anew."""
    llm, replays = served_llm(model_dir, monkeypatch, graphs)
    served.chain_continued_and_forked(llm, Logits(monkeypatch), partial(ref.generate, hf), session)
    assert replays


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_as_a_prefill(model_dir, hf, monkeypatch, prefix_caching: bool, graphs: bool) -> None:
    """A preempted request recomputes its prompt and what it generated as one prefill, which is then
    the `prompt` its index covers (the same sequence id: the index is rebuilt, not reused)."""
    llm, replays = served_llm(model_dir, monkeypatch, graphs, enable_prefix_caching=prefix_caching)
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), session, PAGE, prefix_caching,
                                 25)
    assert replays


@pytest.mark.parametrize("graphs", [False, True])
def test_clones_decode_like_their_source(model_dir, hf, monkeypatch, graphs: bool) -> None:
    """`Engine.clone_sequence`: a clone's row is a copy of its source's, its index included, and
    grows as the source's does (a segment after the clone): every clone decodes the oracle's tokens."""
    llm, replays = served_llm(model_dir, monkeypatch, graphs)
    engine = llm.engine
    p = prompt(30, 31)
    source = engine.add_request(p, greedy(14))
    while source.num_generated < 3:
        engine.step()
    clones = engine.clone_sequence(source, 2)
    while engine.has_unfinished():
        engine.step()
    want = ref.generate(hf, session(), p, 14)[0]
    assert [s.generated_ids for s in (source, *clones)] == [want] * 3
    assert replays and not engine.method.indices.written


# ---- refused ---------------------------------------------------------------------------------------


def test_bad_parameters_are_refused_with_their_reason(model_dir) -> None:
    with pytest.raises(ConfigError) as e:
        make_llm(model_dir, params={**PARAMS, "computed": 0.1})  # fewer computed than retrieved
    text = str(e.value)
    assert "retroinfer.kvm:23:" in text and "negative" in text and "^" in text
    with pytest.raises(ConfigError) as e:
        make_llm(model_dir, params={**PARAMS, "cluster_size": 0})
    assert "cluster_size = 0 is outside its range [1, 1024]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_llm(model_dir, params={**PARAMS, "segment": 10})  # 2.5 clusters of 4 per segment
    assert "the segment length (10) must be a multiple of cluster_size (4)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_llm(model_dir, params={**PARAMS, "clusters": 4})
    assert "clusters" in str(e.value)


SOURCE = Path(__file__).resolve().parents[2] / "methods" / "retroinfer.kvm"


@pytest.mark.parametrize("change, reason", [
    (("using centroid, value_sum", "using value_sum, value_sum"), "summarise the keys"),
    (("+ first sink + last local", "+ first sink + last (context - prompt)"), "from parameters only"),
    (("estimate top(score,", "estimate top(-score,"), "by the same score"),
    (None, None),
])
def test_constructs_the_compiler_refuses(tmp_path: Path, change, reason) -> None:
    from kvc.compiler.codegen import generate

    text = SOURCE.read_text()
    if change is not None:
        assert change[0] in text
        text = text.replace(change[0], change[1])
    path = tmp_path / "retroinfer.kvm"
    path.write_text(text)
    manifest = json.loads(generate(path)["manifest.json"])
    if reason is None:
        assert manifest["lowered"] and manifest["hooks"]["decode_before_attention"]["clusters"]["estimate"]
    else:
        assert not manifest["lowered"] and reason in manifest["reason"], manifest.get("reason")


def test_rows_too_large_for_every_seat_bound_the_running_sequences(model_dir) -> None:
    """Rows sized by a long max_model_len for 2 x max_num_seqs would take the whole budget: the
    engine holds as many as half the budget buys (backend.ROW_SHARE), requests wait for a row, and
    the tokens are those of an engine with a row for everyone."""
    from kvc.runtime.attention.backend import ROW_SHARE

    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4), (17, 5))]
    roomy = make_llm(model_dir, max_model_len=256)
    want = [o.token_ids for o in roomy.generate(prompts, [greedy(8) for _ in prompts])]
    budget = 3 * 2**19
    tight = make_llm(model_dir, max_model_len=512, max_num_seqs=64, kv_cache_memory=budget)
    rows = tight.engine.rows.num_rows
    row = tight.engine.attention.store.spec.bytes_per_row(2, 5)
    assert rows < 2 * 64 and rows * row <= ROW_SHARE * budget and rows >= 2
    assert rows < len(prompts), "every request gets a row: the test is blind"
    running = []
    step = tight.engine.step

    def counted():
        out = step()
        running.append(len(tight.engine.scheduler.running))
        return out

    tight.engine.step = counted
    assert [o.token_ids for o in tight.generate(prompts, [greedy(8) for _ in prompts])] == want
    assert max(running) <= rows


@pytest.mark.parametrize("seed,by_rows", [(0, False), (1, False), (2, False), (0, True), (2, True)])
def test_the_triton_read_equals_the_torch_read(seed, by_rows) -> None:
    """`clusters_triton.read_clusters` (three launches; under TRITON_INTERPRET=1 without a GPU) gives the torch
    read's plan: the same packed tokens and counts, `last`, and estimate, with tied scores (ties: the lower
    cluster), clusters absent from a row, a head with nothing indexed, counts past the present clusters, and
    rows wider than one slice of the token passes; `by_rows`: the index as views over every sequence row
    (strided, as `ClusterIndices.inputs(gather=False)` cuts them) with the decode rows' `rows`."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    from kvc.runtime.primitives import clusters_triton

    g = torch.Generator().manual_seed(seed)
    batch, kv_heads, width, n_clusters, dim = 3, 2, 9000 if seed == 2 else 300, 40, 4
    starts = torch.tensor([4, 0, 2])
    ends = starts + torch.tensor([width - 10, width // 2, 0])
    members = torch.full((batch, kv_heads, width), -1, dtype=torch.int32)
    for b in range(batch):
        n = int(ends[b] - starts[b])
        members[b, :, :n] = torch.randint(0, n_clusters - 5 * b, (kv_heads, n), generator=g, dtype=torch.int32)
    sizes = torch.zeros(batch, kv_heads, n_clusters)
    for b in range(batch):
        for h in range(kv_heads):
            m = members[b, h][members[b, h] >= 0].long()
            sizes[b, h] = torch.bincount(m, minlength=n_clusters).float()
    scores = torch.randint(0, 6, (batch, kv_heads, n_clusters), generator=g).float()  # many ties
    inputs = {"sizes": sizes, "members": members, "starts": starts, "ends": ends,
              "lengths": ends + torch.tensor([7, 0, 3]),
              "centroid": torch.randn(batch, kv_heads, n_clusters, dim, generator=g),
              "value_sum": torch.randn(batch, kv_heads, n_clusters, dim, generator=g)}
    count = torch.tensor([60.0, 1e9, 0.0], dtype=torch.float64)  # ceil(n / size) clusters: some, all, none
    guess = torch.tensor([100.0, 30.0, 50.0], dtype=torch.float64)
    want = clusters.read_clusters(scores, inputs, count, 4, first=3, estimate=guess, using=("centroid", "value_sum"))
    put = {k: v.to(device) for k, v in inputs.items()}
    if by_rows:  # every sequence row of a two-layer store, the decode rows scattered among them
        rows = torch.tensor([4, 1, 2])
        for name in ("sizes", "members", "centroid", "value_sum"):
            x = inputs[name]
            store = torch.full((6, 2, *x.shape[1:-1], x.shape[-1] + 3), -7, dtype=x.dtype)
            store[rows, 1, ..., :x.shape[-1]] = x
            put[name] = store.to(device)[:, 1, ..., :x.shape[-1]]
        bounds = torch.full((6, 2), -7, dtype=torch.int32)  # each row's (start, end), int32 as the index keeps them
        bounds[rows, 0], bounds[rows, 1] = starts.to(torch.int32), ends.to(torch.int32)
        put["starts"], put["ends"] = bounds.to(device)[:, 0], bounds.to(device)[:, 1]
        put["lengths"] = put["lengths"].to(torch.int32)
        put["rows"] = rows.to(device, torch.int32)
        assert not put["members"].is_contiguous()
        torch_got = clusters.read_clusters(scores, {k: v.cpu() for k, v in put.items()}, count, 4, first=3,
                                           estimate=guess, using=("centroid", "value_sum"))
        for w, x in zip(want, torch_got):  # the torch read gathers the rows itself
            for a, b in zip(w if isinstance(w, tuple) else (w,), x if isinstance(x, tuple) else (x,)):
                torch.testing.assert_close(b, a)
    got = clusters_triton.read_clusters(scores.to(device), put, count.to(device), 4, first=3, estimate=guess.to(device),
                                        using=("centroid", "value_sum"))
    tokens, last, estimate, counts = (x.cpu() if isinstance(x, torch.Tensor) else x for x in got)
    assert torch.equal(tokens, want[0]) and torch.equal(last, want[1]) and torch.equal(counts, want[3])
    assert int(counts.sum()) > 0 and bool((counts < tokens.shape[-1]).all())
    assert len(estimate) == (4 if by_rows else 3)
    estimate = Estimate(*estimate).gathered()
    for w, x in zip(want[2], (estimate.keys, estimate.values, estimate.log_weights)):
        torch.testing.assert_close(x.cpu(), w)
    assert bool((want[2][2] > float("-inf")).any()), "nothing estimated: the test is blind"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_cluster_scores_read_the_rows_and_equal_the_lowering(dtype) -> None:
    """The compiler fuses RetroInfer's `max(sum(q * centroid, over channel), over group)` into `cluster_scores`
    (family page_scores, flags ROWS and PRODUCT): it reads each decode row's centroids from its sequence row of
    the layer's view (strided, no gather) and equals the torch lowering over the gathered rows."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops
    from kvc.compiler.cache import locate
    from kvc.runtime.compiled import folder
    from kvc.runtime.compiled.folder import GeneratedCode

    device, _ = triton_device_and_ops("spec")
    code = GeneratedCode("retroinfer", locate("retroinfer", generated=folder.GENERATED).folder,
                         locate("retroinfer", generated=folder.GENERATED).manifest)
    (kernel,) = [k for k in code.manifest["kernels"] if k["name"] == "cluster_scores"]
    assert kernel["flags"]["ROWS"] and kernel["flags"]["PRODUCT"] == "centroid"
    fused = code.fused("decode_before_attention")
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, n_clusters = 8, 2, 16, 37
    store = (torch.randn(6, 3, kv_heads, n_clusters + 5, dim, generator=g)).to(dtype)  # [R, layers, Hkv, C, D]
    view = store[:, 1, :, :n_clusters]
    rows = torch.tensor([5, 0, 3, 0])
    q = torch.randn(len(rows), heads, dim, generator=g).to(dtype)
    got = fused(q.to(device), {"centroid": view.to(device)}, rows.to(device)).cpu()
    sym = {"context": None, "kv_heads": kv_heads}
    want = code.lowering.decode_before_attention_scores({"q": q.float(), "centroid": view[rows].float()}, {}, sym,
                                                        dict(code.lowering.DEFAULTS))
    assert got.shape == (len(rows), kv_heads, n_clusters) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_the_cluster_read_kernels_compile_for_sm90() -> None:
    """The cluster read's kernels (clusters_triton.py) and the estimate's compile for an H100/H200: Triton's
    compiler and ptxas run here, outside the interpreter (tests/kernels/sm90_compile.py)."""
    from tests.kernels.sm90 import code_compiles_for_sm90

    code_compiles_for_sm90("from tests.kernels.sm90_compile import build\n"
            "from kvc.runtime.primitives import clusters_triton as ct\n"
            "for rows in (False, True):\n"
            "    build(ct._ranks_kernel, {'BLOCK_C': 4096, 'HAS_ROWS': rows}, {'scores_ptr': '*fp32',\n"
            "          'sizes_ptr': '*fp32', 'rows_ptr': '*i32', 'read_ptr': '*fp64', 'estimate_ptr': '*fp64',\n"
            "          'chosen_ptr': '*i8', 'log_w_ptr': '*fp32'}, num_warps=8)\n"
            "    build(ct._slice_counts_kernel, {'SLICE': 4096, 'BLOCK': 1024, 'HAS_ROWS': rows},\n"
            "          {'members_ptr': '*i32', 'rows_ptr': '*i32', 'chosen_ptr': '*i8', 'counts_ptr': '*i32'})\n"
            "    build(ct._slice_tokens_kernel, {'SLICE': 4096, 'BLOCK': 1024, 'BLOCK_S': 8, 'BLOCK_F': 4,\n"
            "          'HAS_ROWS': rows}, {'members_ptr': '*i32', 'rows_ptr': '*i32', 'chosen_ptr': '*i8',\n"
            "          'slice_counts_ptr': '*i32', 'out_ptr': '*i32', 'counts_ptr': '*i32', 'last_ptr': '*i32',\n"
            "          **{n: '*i32' if rows else '*i64' for n in ('starts_ptr', 'ends_ptr', 'lengths_ptr')}})\n"
            "from kvc.compiler.cache import load_module, locate\n"
            "from kvc.runtime.compiled import folder\n"
            "kernels = load_module(locate('retroinfer', generated=folder.GENERATED).folder, 'triton_kernels')\n"
            "build(kernels._cluster_scores_kernel, {'PAGE': 1, 'GROUP': 8, 'BLOCK_P': 64, 'BLOCK_D': 128,\n"
            "      'BLOCK_G': 16, 'IEEE': False}, {'q_ptr': '*bf16', 'centroid_ptr': '*bf16', 'tables_ptr': '*i32',\n"
            "      'lengths_ptr': '*i32'})\n")
