"""The decode graphs' static inputs (`DecodeGraphs._load`, vectorised over layers and rows): the
graph step run uncaptured on the CPU decodes exactly what eager steps decode, for methods whose
layers store different lengths (PyramidKV), per-head start slots (Ada-KV), one length (SnapKV) and
no compression (full), with batch sizes that leave padding rows in their bucket and rows that
leave the batch (the incremental mirror's rows shift); and the slots, context lengths, page
tables and KV-head starts equal a row-by-row reference after every load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.decode_graphs import DecodeGraphs
from tests.models.tiny import make_tiny_llama
from tests.runtime.chained import METHODS, greedy, make_llm, tokens

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

    def replay(batch):
        logits = graphs.run_uncaptured(batch)
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
