"""The decode graphs' static inputs (`DecodeGraphs._load`, vectorised over layers and rows): the
graph step run uncaptured on the CPU decodes exactly what eager steps decode, for methods whose
layers store different lengths (PyramidKV), per-head start slots (Ada-KV), one length (SnapKV) and
no compression (full), with batch sizes that leave padding rows in their bucket and rows that
leave the batch (the incremental mirror's rows shift); and the slots, context lengths, page
tables and KV-head starts equal a row-by-row reference after every load.

Context buckets: the ladder (powers of two, capped by max_model_len and the pool) and the rung a
step picks; a run whose longest context grows past a rung and falls back as rows leave (full,
H2O and TOVA: their statistics and state-plane temporaries are as wide as the rung) still decodes
the eager tokens, every step at the smallest rung that holds it; the statistics buffer is
reserved once, at (largest batch bucket, largest rung), and never reallocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.decode_graphs import DecodeGraphs, GraphKey, context_bucket, context_ladder, longest_context
from kvc.runtime.tuning import buckets
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, PAGE_BYTES, greedy, make_llm, tokens

CASES = ["full", "snapkv", "pyramidkv", "adakv"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("graph-inputs"), seed=9, num_hidden_layers=3)


def _reference(graphs: DecodeGraphs, batch) -> tuple[torch.Tensor, torch.Tensor]:
    page, n = graphs.runner.page_size, len(batch.seqs)
    slots = torch.full((graphs.runner.num_layers, n), -1, dtype=torch.int64)
    ctx = torch.zeros((graphs.runner.num_layers, n), dtype=torch.int32)
    for i, seq in enumerate(batch.seqs):
        for layer, (table, kv) in enumerate(zip(seq.page_tables, seq.kv_lens)):
            slots[layer, i] = table[kv // page] * page + kv % page
            ctx[layer, i] = kv + 1
    return slots, ctx


@pytest.mark.parametrize("method", CASES)
def test_uncaptured_graph_steps_decode_like_eager_steps(model_dir: Path, method: str) -> None:
    prompts = [tokens(n, seed=40 + n) for n in (37, 61, 45, 52)]
    steps = [greedy(20), greedy(20), greedy(7), greedy(13)]  # rows leave: the batch shrinks and shifts
    eager = make_llm(model_dir, method, METHODS[method], max_num_seqs=6)
    want = [o.token_ids for o in eager.generate(prompts, steps)]
    llm = make_llm(model_dir, method, METHODS[method], max_num_seqs=6)
    runner = llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(runner, 6)
    loads = []

    def replay(batch, feed=None):
        logits = graphs.run_uncaptured(batch, feed)
        n = len(batch.seqs)
        slots, ctx = _reference(graphs, batch)
        assert torch.equal(graphs.slots[:, :n].cpu(), slots) and torch.equal(graphs.ctx[:, :n].cpu(), ctx)
        for i, seq in enumerate(batch.seqs):
            for layer, table in enumerate(seq.page_tables):
                assert graphs.tables[layer, i, : len(table)].tolist() == table
                if any(seq.has_kv_starts for seq in batch.seqs):
                    assert graphs.starts[layer, i].tolist() == (seq.kv_starts[layer] or [0, 0])
        loads.append((n, len({kv for s in batch.seqs for kv in s.kv_lens}) > 1))
        return logits

    graphs.run = replay
    got = [o.token_ids for o in llm.generate(prompts, steps)]
    assert got == want
    assert {4, 3, 2} <= {n for n, _ in loads}  # buckets 4 and 2 (3 rows: one padding row)
    if method == "pyramidkv":
        assert any(mixed for _, mixed in loads)  # layers of different lengths in one batch


def test_context_ladder_and_bucket_choice() -> None:
    assert context_ladder(34816) == [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 34816]
    assert context_ladder(32768)[-2:] == [16384, 32768]  # no duplicate rung at a power of two
    assert context_ladder(200) == [200] and context_ladder(257) == [256, 257]
    assert context_ladder(40, smallest=8) == [8, 16, 32, 40]
    ladder = context_ladder(34816)
    assert [context_bucket(ladder, n) for n in (1, 256, 257, 2049, 32769, 34816)] == [256, 256, 512, 4096, 34816,
                                                                                      34816]
    with pytest.raises(RuntimeError, match="34817 tokens"):
        context_bucket(ladder, 34817)
    # the pool bounds a row too: 100 pages of 16 hold 1600 tokens of one layer at most
    assert longest_context(40960, 100, 16) == 1600 and longest_context(512, 10**6, 16) == 512
    # a graph of a power-of-two rung launches the tuned config of exactly that context bucket
    assert all(buckets.context_bucket(rung) == rung for rung in ladder[:-1])
    assert buckets.context_bucket(ladder[-1]) == buckets.context_bucket(ladder[-2] + 1)


def test_the_ladder_is_capped_by_the_pool(model_dir: Path) -> None:
    llm = make_llm(model_dir, "h2o", METHODS["h2o"], max_num_seqs=6, kv_cache_memory=100 * PAGE_BYTES)
    runner = llm.engine.runner
    pool_tokens = runner.attention.num_pages * 4  # < 100 pages of 4 tokens: the state planes cost some
    assert runner.max_model_len == 512 and 256 < pool_tokens < 400
    graphs = DecodeGraphs(runner, 6)
    assert graphs.contexts == [256, pool_tokens]
    graphs.reserve_stats()
    rows = runner.method.attention.decode_stats.rows(runner.model.spec.num_heads, runner.num_kv_heads)
    assert runner.attention._stats.numel() == 6 * rows * pool_tokens


GROWING = {"full": {}, "h2o": {"heavy": 0.6, "recent": 0.6}, "tova": {"budget": 40}}


@pytest.mark.parametrize("method", sorted(GROWING))
def test_context_buckets_change_during_a_run(model_dir: Path, method: str) -> None:
    """Rungs 8, 16, 32, 64, ... (the mechanics of the real ladder at tiny lengths): the longest
    context grows from 31 past 32 (full grows; H2O keeps 1.2 x its prompt and TOVA 40 tokens, so
    they grow first, then evict), and H2O's falls back as its longest row leaves."""
    prompts = [tokens(n, seed=70 + n) for n in (25, 28, 20, 30)]
    steps = [greedy(20), greedy(12), greedy(7), greedy(16)]
    want = [o.token_ids for o in make_llm(model_dir, method, GROWING[method], max_num_seqs=6).generate(prompts, steps)]
    llm = make_llm(model_dir, method, GROWING[method], max_num_seqs=6)
    runner = llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(runner, 6)
    graphs.contexts = context_ladder(graphs.contexts[-1], smallest=8)
    graphs.reserve_stats()
    stats = runner.attention._stats
    reads_stats = stats is not None
    assert reads_stats is (method != "full")
    step_fn, stats_request = graphs._step_fn, runner.attention.stats_request
    keys: list[GraphKey] = []
    widths: list[int] = []

    def keyed(key: GraphKey):
        keys.append(key)
        return step_fn(key)

    def request(fold, num_decodes, num_heads, width):
        widths.append(width)
        return stats_request(fold, num_decodes, num_heads, width)

    graphs._step_fn, runner.attention.stats_request = keyed, request
    needed: list[int] = []

    def replay(batch, feed=None):
        needed.append(max(kv + 1 for seq in batch.seqs for kv in seq.kv_lens))
        count, asked = len(keys), len(widths)
        logits = graphs.run_uncaptured(batch, feed)
        assert len(keys) == count + 1
        if reads_stats:  # every layer's statistics as wide as the step's rung
            assert widths[asked:] == [keys[-1].context] * runner.num_layers
        return logits

    graphs.run = replay
    got = [o.token_ids for o in llm.generate(prompts, steps)]
    assert got == want
    contexts = [key.context for key in keys]
    assert contexts == [context_bucket(graphs.contexts, n) for n in needed]
    assert all(c == 8 or c < 2 * n for c, n in zip(contexts, needed))  # never wider than twice what is stored
    assert contexts[0] == 32 and 64 in contexts  # grew past a rung
    if method == "h2o":  # its rows settle at different lengths: the longest leaves, the rung falls back
        assert contexts[-1] == 32
    if reads_stats:  # reserved once at (largest batch bucket, largest rung), never reallocated
        rows = runner.method.attention.decode_stats.rows(runner.model.spec.num_heads, runner.num_kv_heads)
        assert runner.attention._stats is stats and stats.numel() == 6 * rows * graphs.contexts[-1]
        assert max(widths) <= graphs.contexts[-1]  # eager (mixed) steps ask for no more either


PARKED = {"h2o": METHODS["h2o"], "rkv": {"budget": 20, "window": 4, "kernel": 3, "every": 4},
          "kivi": {"bits": 4, "group_size": 4, "residual_length": 8}}


@pytest.mark.parametrize("method", sorted(PARKED))
def test_capture_warm_up_touches_no_sequence(model_dir: Path, method: str) -> None:
    """A graph captured lazily (a new batch bucket or context rung mid-run) executes its warm-up steps
    (`DecodeGraphs._capture`): run `parked`, over padding rows only, they change nothing a sequence owns
    (its K/V, decode statistics, query windows and their counts, residual windows: only the scratch
    page and row), and the loaded batch is back in the buffers after them, so the replay decodes the
    eager tokens. Unparked, the warm-ups wrote the step's queries into R-KV's windows three times."""
    prompts = [tokens(n, seed=90 + n) for n in (37, 45, 29)]
    steps = [greedy(14), greedy(9), greedy(12)]
    want = [o.token_ids for o in make_llm(model_dir, method, PARKED[method], max_num_seqs=6).generate(prompts, steps)]
    llm = make_llm(model_dir, method, PARKED[method], max_num_seqs=6)
    runner = llm.engine.runner
    graphs = runner.graphs = DecodeGraphs(runner, 6)
    stores = list(runner.attention.stores)
    checked = []

    def replay(batch, feed=None):
        key = graphs._load(batch, feed)
        buffers = [buf.clone() for buf in (graphs.slots, graphs.ctx, graphs.rows) if buf is not None]
        before = [{name: t.clone() for name, t in store.tensors.items()} for store in stores]
        with graphs.parked(key.batch):
            for _ in range(2):
                graphs._step_fn(key)()
        for store, saved in zip(stores, before):
            for name, t in store.tensors.items():
                owned = t[: store.scratch_row] if t.shape[0] == store.num_rows + 1 else t[: store.scratch_page]
                kept = saved[name][: owned.shape[0]]
                assert torch.equal(owned, kept), f"a warm-up step changed {name!r}"
        after = [buf for buf in (graphs.slots, graphs.ctx, graphs.rows) if buf is not None]
        assert all(torch.equal(a, b) for a, b in zip(after, buffers))
        checked.append(len(batch.seqs))
        return graphs._step_fn(key)()[: len(batch.seqs)]

    graphs.run = replay
    assert [o.token_ids for o in llm.generate(prompts, steps)] == want
    assert {3, 2} <= set(checked)
