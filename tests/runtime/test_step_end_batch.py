"""`step_end_batch` of compiled decode-time evictions (runtime/compiled/step_end.py): the
plans of a whole decode batch at once, grouped by equal symbols, equal to `step_end` per row.

On a tiny random Llama (float32, CPU, page size 5), five requests whose prompt lengths repeat
(groups of rows with the same stored length, context and prompt length) next to lengths of their
own (groups of one), so the steps mix stacked selections, shared plans and per-row fallbacks;
eviction runs at every step. SnapKV's and R-KV's decode budgets stack the rows' keys and query
windows as the heads of one scoring. Checked at every layer of every step: the batched plans are
tensor-equal to the per-row oracle's (indices, lengths, tail), the batched path really ran (a
group of several rows took the stacked or shared selection), and end to end the greedy tokens
and kv_lens equal a run whose runner calls `step_end` per row.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.compiled import stacked, step_end
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import MethodBase
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama

PAGE = 5
STEPS = 20
LENGTHS = [40, 40, 40, 57, 57, 33]
CASES = {
    "streamingllm": ({"sink": 4, "recent": 20}, "symbolic"),
    "h2o": ({"heavy": 0.3, "recent": 0.1}, "planes"),
    "tova": ({"budget": 26}, "planes"),
    # a decode budget re-scored from the keys and the newest queries (`head_local`): rows stacked as heads
    "snapkv": ({"budget": 24, "window": 4, "kernel": 3, "every": 1}, "inputs"),
    "rkv": ({"budget": 24, "window": 4, "kernel": 3, "every": 1}, "inputs"),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("stepend"), seed=7, num_hidden_layers=2)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]


def make_llm(model_dir: Path, method: str) -> LLM:
    return LLM(str(model_dir), method=method, method_params=CASES[method][0], device="cpu", dtype="float32",
               page_size=PAGE, max_num_batched_tokens=128, max_prefill_chunk=64, attention_backend="torch",
               decode_rings=False)  # the step end's plans (StreamingLLM rings otherwise: runtime/kv/ring.py)


def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    engine = llm.engine
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts()]
    lengths = []
    while engine.has_unfinished():
        engine.step()
        lengths.append([list(s.kv_lens) for s in seqs])
    assert engine.pool.num_free == engine.pool.num_pages
    return [s.generated_ids for s in seqs], lengths


@pytest.mark.parametrize("method", sorted(CASES))
def test_batched_plans_equal_the_per_row_plans(model_dir, method, monkeypatch):
    llm = make_llm(model_dir, method)
    m = llm.engine.method
    assert m._group_mode == CASES[method][1]  # decided from the manifest facts, not the name
    original = m.step_end_batch
    groups, compared = [], [0]

    def checked(layer, views):
        want = [type(m).step_end(m, view.layer, view) for view in views]  # the oracle reads, never moves, state
        got = original(layer, views)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a.indices, b.indices) and a.indices.dtype == b.indices.dtype
                assert a.lengths is None and b.lengths is None and a.tail == b.tail
                compared[0] += 1
        return got

    group = m._step_end_group

    def spy_group(layer, views):
        groups.append(len(views))
        return group(layer, views)

    monkeypatch.setattr(m, "step_end_batch", checked)
    monkeypatch.setattr(m, "_step_end_group", spy_group)
    stacked_rows = []
    stacked_map = stacked.StackedRows.map
    monkeypatch.setattr(stacked.StackedRows, "map",
                        lambda rows, fn, *memo: stacked_rows.append(len(rows.rows)) or stacked_map(rows, fn, *memo))
    run(llm)
    # a stacked keep reads nothing of the layer: both layers' rows go as one step end (`step_end_layers`)
    layers = 2 if m.step_end_layers else 1
    assert m.step_end_layers is (CASES[method][1] == "inputs")
    assert (max(stacked_rows, default=0) == 3 * layers) is (CASES[method][1] == "inputs")  # rows scored as one
    assert compared[0] > 2 * len(LENGTHS) * (STEPS - 6)  # eviction at (almost) every step, every row
    # rows batched: H2O's selection reads the prompt, so its groups are the repeated prompts (3 and 2 rows);
    # SnapKV's and R-KV's read the step (`where step % every == 0`), so theirs are the rows that began decoding
    # together (the first three prompts fill the first prefill step); the others' read only the length, so
    # every row of a length is one group once they all hold their budget
    widest = 3 if m._group_symbols() else len(LENGTHS)
    assert groups and max(groups) == widest * layers and (2 * layers in groups or widest == len(LENGTHS))


@pytest.mark.parametrize("method", sorted(CASES))
def test_greedy_tokens_unchanged_end_to_end(model_dir, method, monkeypatch):
    batched = run(make_llm(model_dir, method))
    monkeypatch.setattr(step_end.StepEnd, "step_end_batch", MethodBase.step_end_batch)
    per_row = run(make_llm(model_dir, method))
    assert batched == per_row
    assert any(l != len(prompts()[0]) for step in batched[1] for row in step for l in row)  # it evicted


def test_stacked_rows_read_like_one_row_reads():
    """`read_rows` over several tables equals `state_planes.read` of each (pages out of order)."""
    from kvc.runtime.kv import state_planes

    plane = torch.randn(9, 2, 4)
    tables = [[3, 0, 7], [5, 2, 1], [8, 6, 4]]
    got = step_end.read_rows(plane, tables, 10)
    assert got.shape == (3, 2, 10)
    for g, table in enumerate(tables):
        assert torch.equal(got[g], state_planes.read(plane, table, 10))
    with pytest.raises(ValueError):
        step_end.read_rows(plane, [[1, 2], [3]], 10)


@pytest.mark.parametrize("method", sorted(name for name, (_, mode) in CASES.items() if mode != "inputs"))
def test_batched_plans_over_random_planes(method):
    """Planes of random scores with ties, page tables out of order, two groups (every third row a
    token longer): the batched plans equal the per-row ones, and rows of one group keep
    different tokens where the scores decide (so a plan handed to the wrong row would show)."""
    from bench.step_end_host import batched, per_row, same_plans, synthetic

    m, views = synthetic(method, batch=7, layers=2, kv=60, page=4, head_dim=4, seed=3, ragged=True)
    want, got = per_row(m, views), batched(m, views)
    assert same_plans(got, want)
    assert all(p is not None for layer in want for p in layer)
    rows = [p.indices for p in got[0][:2]]  # rows 0 and 1: one group
    assert torch.equal(rows[0], rows[1]) is (method == "streamingllm")


def test_rowwise_select_fact():
    """The compiler's `rowwise_select`: per-row granularities blind to `kv_heads` only."""
    import json

    from kvc.compiler.hook_facts import rowwise_select
    from kvc.compiler.lower_torch import HookCode

    root = Path(__file__).resolve().parents[2] / "kernels_generated"
    facts = {name: json.loads((root / name / "manifest.json").read_text())["hooks"]
             for name in ("streamingllm", "h2o", "tova", "adakv")}
    assert facts["streamingllm"]["step_end"]["rowwise_select"]
    assert facts["h2o"]["decode_after_attention"]["rowwise_select"]
    assert facts["tova"]["decode_after_attention"]["rowwise_select"]
    assert not facts["adakv"]["prefill_end"]["rowwise_select"]  # head_adaptive: heads share one budget
    keep = {"first": "None", "last": "8", "count": "budget", "at_least": "None", "granularity": "kv_head"}
    assert rowwise_select(HookCode("h", keep=keep))
    assert not rowwise_select(HookCode("h", keep={**keep, "count": "budget/kv_heads"}))
    assert not rowwise_select(HookCode("h", keep={**keep, "granularity": "head_adaptive"}))
    assert not rowwise_select(HookCode("h"))


def test_head_local_fact():
    """The compiler's `head_local`: a step_end score computed KV head by KV head from q/k (SnapKV's and R-KV's
    decode budgets), not Ada-KV's (heads share one budget) nor a score from state (H2O's); `score_symbols`
    are what the scores read (their windows: `context`)."""
    import json

    root = Path(__file__).resolve().parents[2] / "kernels_generated"
    hooks = {name: json.loads((root / name / "manifest.json").read_text())["hooks"]
             for name in ("snapkv", "rkv", "adakv", "h2o", "streamingllm")}
    assert hooks["snapkv"]["step_end"]["head_local"] and hooks["rkv"]["step_end"]["head_local"]
    assert hooks["snapkv"]["step_end"]["score_symbols"] == ["context"]
    assert not hooks["snapkv"]["prefill_end"]["head_local"]  # prefill end is not stacked
    assert not hooks["adakv"]["step_end"]["head_local"]
    assert not hooks["h2o"]["decode_after_attention"]["head_local"]
    assert not hooks["streamingllm"]["step_end"]["head_local"]  # no score at all


def test_stacked_rows_in_chunks(model_dir, monkeypatch):
    """Rows scored a chunk at a time (two rows here; on a GPU as many as half the free memory holds) give the
    per-row plans too: the chunks' kept indices join into one stack."""
    monkeypatch.setattr(stacked.StackedRows, "CPU_CHUNK", 2)
    test_batched_plans_equal_the_per_row_plans(model_dir, "snapkv", monkeypatch)


def test_stacked_chunks_measured_once_per_length(monkeypatch):
    """On a GPU the first chunk (FIRST_CHUNK rows) measures a row's device bytes; the method's memo keeps them,
    so the next layer's rows at that length go in one chunk where half the free memory holds them (each chunk
    is the selection's launches again), and a new length is measured again. The CUDA memory calls are faked:
    30 MB free, a chunk's peak 1 MB a row, so 15 rows a chunk after the first."""
    allocated = [0]
    peak = [0]
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: peak.__setitem__(0, allocated[0]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: peak[0])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: allocated[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 << 20, 80 << 30))

    def rows_of(count: int, length: int) -> stacked.StackedRows:
        rows = object.__new__(stacked.StackedRows)
        rows.rows, rows.length, rows.device = list(range(count)), length, torch.device("cuda", 0)
        return rows

    chunks = []

    def fn(lo, hi):
        chunks.append(hi - lo)
        peak[0] = max(peak[0], allocated[0] + (hi - lo) * (1 << 20))
        return torch.arange(lo, hi)

    memo = {}
    assert rows_of(40, 64).map(fn, memo).tolist() == list(range(40))
    assert chunks == [stacked.StackedRows.FIRST_CHUNK, 15, 40 - 15 - stacked.StackedRows.FIRST_CHUNK]
    assert list(memo.values()) == [1 << 20]
    chunks.clear()
    assert rows_of(40, 64).map(fn, memo).tolist() == list(range(40))  # the next layer: measured already
    assert chunks == [15, 15, 10]
    chunks.clear()
    rows_of(40, 80).map(fn, memo)  # another length: measured again
    assert chunks[0] == stacked.StackedRows.FIRST_CHUNK and len(memo) == 2
    chunks.clear()
    rows_of(40, 64).map(fn)  # no memo: measured every call, as before
    assert chunks[0] == stacked.StackedRows.FIRST_CHUNK


def test_layers_stack_by_store_class_and_due_rows(monkeypatch):
    """`StepHooks._layer_groups`: with `step_end_layers`, the layers of one storage class due in the same rows go
    as one call (a class whose store has page summaries stays layer by layer), at most STACKED_ROWS rows x layers
    a call; without it, one layer a call. Layers where no row is due are left out."""
    from types import SimpleNamespace

    import numpy as np

    from kvc.runtime import step_hooks

    plain = SimpleNamespace(flushes_blocks=False, spec=SimpleNamespace(summaries=()))
    summarised = SimpleNamespace(flushes_blocks=False, spec=SimpleNamespace(summaries=("bounds",)))
    hooks = step_hooks.StepHooks.__new__(step_hooks.StepHooks)
    hooks.stores, hooks.layer_class = [plain, summarised], (0, 0, 1, 1, 0, 0, 0)
    hooks.method = SimpleNamespace(step_end_layers=True)
    every, first, none = np.ones(3, bool), np.array([True, False, False]), np.zeros(3, bool)
    dues = [every, every, every, every, first, none, None]
    groups = [(layers, None if due is None else due.tolist()) for layers, due in hooks._layer_groups(dues, 3)]
    assert groups == [([0, 1], every.tolist()), ([2], every.tolist()), ([3], every.tolist()),
                      ([4], first.tolist()), ([6], None)]
    monkeypatch.setattr(step_hooks, "STACKED_ROWS", 4)  # two rows of three layers: two layers a call
    hooks.layer_class = (0,) * 7
    dues = [np.array([True, True, False])] * 3 + [none] * 4
    assert [layers for layers, _ in hooks._layer_groups(dues, 3)] == [[0, 1], [2]]
    hooks.method = SimpleNamespace(step_end_layers=False)
    assert [layers for layers, _ in hooks._layer_groups(dues, 3)] == [[0], [1], [2]]
