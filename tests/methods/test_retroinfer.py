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
from types import SimpleNamespace

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.plans import Estimate, ReadPlan
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import DecodeRow, DecodeView
from kvc.runtime.methods import resolve_method
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


def _batch(seed: int, rows: list[tuple[int, int]], heads: int = 4, kv_heads: int = 2, dim: int = 8):
    """A decode step over rows (prompt, length): paged K/V (pages in shuffled order), the step's
    query, a DecodeView as the engine builds it, and each row's dense keys/values [Hkv, length, D]."""
    g = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-length // PAGE) for _, length in rows]
    total = sum(pages_per_row)
    k_cache = torch.randn(total + 1, kv_heads, PAGE, dim, generator=g) * 2
    v_cache = torch.randn(total + 1, kv_heads, PAGE, dim, generator=g)
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
                           for c in (k_cache, v_cache)))
    q = torch.randn(len(rows), heads, dim, generator=g)
    return _view(q, rows, k_cache, v_cache, tables, dense), dense


def _view(q, rows, k_cache, v_cache, tables, dense) -> DecodeView:
    """The decode view of rows (prompt, length) over paged caches (`dense`: each row's keys and values)."""
    lengths = torch.tensor([length for _, length in rows], dtype=torch.int32)
    dim = q.shape[-1]
    return DecodeView(layer=0, q=q, k=torch.stack([d[0][:, -1] for d in dense]),
                      v=torch.stack([d[1][:, -1] for d in dense]), block_tables=tables, context_lens=lengths,
                      store=SimpleNamespace(k_cache=k_cache, v_cache=v_cache, page_size=PAGE), scale=dim ** -0.5,
                      rows=[DecodeRow(seq_id=b, length=length, context_len=length, prompt_len=p)
                            for b, (p, length) in enumerate(rows)],
                      prompt_lens=torch.tensor([p for p, _ in rows], dtype=torch.int32),
                      max_context_len=int(lengths.max()))


ROWS = [(30, 34), (11, 12), (23, 39), (5, 6)]  # (prompt, length): row 2 grows its index by a segment while decoding


def test_plans_and_attention_equal_the_reference() -> None:
    method = resolve_method("retroinfer", PARAMS)
    view, dense = _batch(1, ROWS)
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
    assert method.reader.indices.indices[(2, 0)].end == 23 - 3 + 2 * 8  # row 2: two segments clustered while decoding


def test_a_second_step_reuses_and_grows_the_index() -> None:
    """The index kept between steps (a segment added once enough tokens lie past it) gives the plan the
    reference builds from scratch."""
    method = resolve_method("retroinfer", PARAMS)
    later = [(23, 31), (14, 21)]
    view, dense = _batch(2, later)
    rows = [(23, 30), (14, 20)]  # the same rows one step earlier
    method.decode_before_attention(0, _view(view.q, rows, view.store.k_cache, view.store.v_cache, view.block_tables,
                                            dense))
    index = method.reader.indices.indices[(0, 0)]
    assert (index.start, index.end) == (2, 20)
    read = method.decode_before_attention(0, view)  # one token later: the index grows by one segment
    assert method.reader.indices.indices[(0, 0)].end == 28
    for b, (prompt_len, _) in enumerate(later):
        reads = ref.plan(view.q[b], *dense[b], PARAMS, prompt_len)
        got = torch_ops.paged_decode(view.q, view.store.k_cache, view.store.v_cache, view.block_tables,
                                     view.context_lens, view.scale, read=read)[b]
        torch.testing.assert_close(got, ref.attend(view.q[b], *dense[b], reads, view.scale), atol=1e-5, rtol=1e-5)
    method.release(0)
    assert (0, 0) not in method.reader.indices.indices and (1, 0) in method.reader.indices.indices


def test_attention_with_an_estimate_is_a_softmax_over_tokens_and_pseudo_keys() -> None:
    """paged_decode with a token plan, `last` and an Estimate equals the softmax written out here."""
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
    read = ReadPlan(tokens=tokens, last=last, estimate=Estimate(e_keys, e_values, log_w))
    scale = 0.3
    out = torch_ops.paged_decode(q, k_cache, v_cache, tables, lengths, scale, read=read)
    for b in range(2):
        n = int(lengths[b])
        keys = k_cache[tables[b].long()].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        values = v_cache[tables[b].long()].permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)[:, :n]
        for g_ in range(heads):
            h = g_ // (heads // kv_heads)
            slots = sorted({int(t) for t in tokens[b, h] if t >= 0} | set(range(n - int(last[b]), n)))
            entries = [(float(q[b, g_] @ keys[h, s]) * scale, values[h, s]) for s in slots]
            entries += [(float(q[b, g_] @ e_keys[b, h, e]) * scale + float(log_w[b, h, e]), e_values[b, h, e])
                        for e in range(3) if log_w[b, h, e] > float("-inf")]
            top = max(x for x, _ in entries)
            weights = [math.exp(x - top) for x, _ in entries]
            want = sum(w * v for w, (_, v) in zip(weights, entries)) / sum(weights)
            torch.testing.assert_close(out[b, g_], want, atol=1e-6, rtol=1e-5)


# ---- served ---------------------------------------------------------------------------------------


def make_llm(model_dir: Path, method: str = "retroinfer", params: dict | None = None, **options) -> LLM:
    engine_options = {"max_num_batched_tokens": 4096, **options}
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method=method,
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
    assert not whole.engine.method.reader.indices.indices  # released with their requests
    few = make_llm(model_dir, params={**PARAMS, "retrieved": 0.1, "computed": 0.1})
    assert [o.token_ids for o in few.generate(prompts, params)] != full


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


def test_prefix_cache_hit(model_dir, hf, monkeypatch) -> None:
    served.prefix_cache_hit(make_llm(model_dir), Logits(monkeypatch), partial(ref.generate, hf), session)


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    """A chain's next turn counts the stored history as its prompt: its index is built anew."""
    served.chain_continued_and_forked(make_llm(model_dir), Logits(monkeypatch), partial(ref.generate, hf),
                                      session)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recomputes_as_a_prefill(model_dir, hf, monkeypatch, prefix_caching: bool) -> None:
    """A preempted request recomputes its prompt and what it generated as one prefill, which is then
    the `prompt` its index covers (the same sequence id: the index is rebuilt, not reused)."""
    served.preemption_recomputes(make_llm(model_dir, enable_prefix_caching=prefix_caching), Logits(monkeypatch),
                                 partial(ref.generate, hf), session, PAGE, prefix_caching, 25)


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
