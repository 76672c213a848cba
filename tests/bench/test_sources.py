"""The decode window's sources (runtime/bench/sources.py): clones of one request take, layer by
layer, the stored KV of a random real source, so their contexts differ.

Checked on a tiny random Qwen3 on the CPU with SnapKV and Ada-KV (per-KV-head start slots): after
`mix_layers`, each clone's every layer holds, in its whole pages below the shorter length, exactly
the K/V of one source (with that source's start slots), more than one source was drawn, the clones
decode on, and the bench's decode window records the sources. `first_tokens` (runtime/bench/steps.py) times
a prefill's steps only, with and without async scheduling.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.bench.sources import mix_layers, prefill_sources
from kvc.runtime.bench.steps import Clock
from kvc.runtime.bench.throughput import ThroughputConfig, run
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import LayerCacheView
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_qwen3

PAGE = 4
PARAMS = {"snapkv": {"budget": 24, "window": 8}, "adakv": {"budget": 24, "window": 8}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def _keys(engine, seq, layer: int, tokens: int) -> torch.Tensor:
    view = LayerCacheView(engine.attention.store, seq.page_tables[layer], tokens,
                          seq.kv_starts[layer])
    return torch.cat([view.keys(), view.values()])


@pytest.mark.parametrize("method", ["snapkv", "adakv"])
def test_clones_take_each_layer_from_one_source(model_dir, method):
    engine = LLM(str(model_dir), method=method, method_params=PARAMS[method], device="cpu", dtype="float32",
                 page_size=PAGE, attention_backend="torch", max_num_batched_tokens=64).engine
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = engine.add_request(list(range(3, 103)), params)
    clock = Clock(engine.device)
    while first.num_generated < 1:
        engine.step()
    sources = [first, *prefill_sources(engine, params, 100, 2, seed=0, clock=clock)]
    clones = engine.clone_sequence(first, 4)
    before = {c.seq_id: [_keys(engine, c, layer, c.kv_lens[layer]) for layer in range(len(c.kv_lens))]
              for c in clones}
    assert mix_layers(engine, clones, sources, seed=0) > 0
    used = set()
    for clone in clones:
        for layer, length in enumerate(clone.kv_lens):
            matches = []
            for i, source in enumerate(sources):
                n = min(length, source.kv_lens[layer]) // PAGE * PAGE
                if source.kv_starts[layer] == clone.kv_starts[layer] and torch.equal(
                        _keys(engine, clone, layer, n), _keys(engine, source, layer, n)):
                    matches.append(i)
            assert matches, f"clone {clone.seq_id} layer {layer} holds no source's KV"
            used.update(matches[:1] if len(matches) == 1 else [])
            copied = min(length, min(s.kv_lens[layer] for s in sources)) // PAGE * PAGE
            if matches == [0]:  # untouched: still exactly what the clone held
                assert torch.equal(_keys(engine, clone, layer, length), before[clone.seq_id][layer])
            assert copied >= 24  # the compacted prefix (budget 24) lies in the copied pages
    assert len(used) >= 2, f"the clones drew their layers from {used} only"
    while engine.has_unfinished():
        engine.step()
    assert all(c.num_generated == 40 for c in clones)


def test_decode_window_records_its_sources(model_dir):
    cfg = ThroughputConfig(methods=["snapkv"], inputs=[100], kv_memory=400 * 2 * 2 * 16 * 4 * PAGE,
                           model=str(model_dir), output_len=40, page_size=PAGE, device="cpu", dtype="float32",
                           attention_backend="torch", method_params={"snapkv": PARAMS["snapkv"]}, steps=3,
                           warmup=1, sources=3, async_scheduling=True)
    row, = run(cfg)["rows"]
    assert row["sources"] == 3 and row["mixed_layers"] > 0 and row["decode_tok_s"] > 0, row


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_first_tokens_time_the_prefill_steps_only(model_dir, async_scheduling):
    """`first_tokens` steps until the first token is sampled and commits it: with async scheduling the step
    that samples it is left running, and the first decode (scheduled ahead of its commit) is not run inside
    the timed prefill. A 40-token prompt in chunks of 16: three steps either way."""
    from kvc.runtime.bench.steps import first_tokens

    engine = LLM(str(model_dir), device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=16,
                 attention_backend="torch", async_scheduling=async_scheduling).engine
    seq = engine.add_request(list(range(3, 43)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    steps, step = [], engine.step

    def counted():
        steps.append(1)
        return step()

    engine.step = counted
    first_tokens(engine, [seq], Clock(engine.device), limit=10)
    assert len(steps) == 3 and seq.num_generated == 1 and seq.pending == 0
    assert seq.num_computed_tokens == 40  # the first decode has not run
