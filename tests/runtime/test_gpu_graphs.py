"""On a CUDA GPU: decode steps of H2O and TOVA replay CUDA graphs with decode_after_attention
captured inside them (state in paged planes), and R-KV's with its rows' query windows written inside them
(runtime/kv/query_window.py), and give the same greedy tokens and physical lengths as eager steps and as
the per-row dict path (`use_state_planes = False`, eager only).
Batches of several lengths cross graph buckets (1, 2, 4) as requests finish; one request is
chained for two turns. Skipped on CPU (tests/runtime/test_state_planes.py runs the same decode
code eagerly there)."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.chains import ChainSpec
from kvc.runtime.compiled.method import CompiledMethod
from tests.models.tiny import make_tiny_qwen3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {"h2o": {"heavy": 0.25, "recent": 0.1}, "tova": {"budget": 40},
         "rkv": {"budget": 40, "window": 8, "kernel": 5, "every": 4},  # its query windows written in the graphs
         "streamingllm": {"sink": 4, "recent": 36},  # keeps in place: positions recorded in the graphs
         "snapkv": {"budget": 40, "window": 8, "kernel": 5, "every": 4},  # a decode budget
         "adakv": {"budget": 40, "window": 8, "kernel": 5, "every": 4},  # one with per-head counts (starts)
         "skipkv": {"budget": 40, "window": 8, "kernel": 5, "every": 4}}  # whole sentences of the tokens' text
LENGTHS = (60, 150, 299, 97)


def serve(model_dir, method: str, graphs: bool, planes: bool, monkeypatch):
    monkeypatch.setattr(CompiledMethod, "use_state_planes", planes)
    llm = LLM(str(model_dir), device="cuda", dtype="float32", page_size=16, max_num_batched_tokens=512,
              max_prefill_chunk=128, method=method, method_params=CASES[method], kv_cache_memory=2**26,
              cuda_graphs=graphs)
    engine = llm.engine
    assert (engine.runner.graphs is not None) is (graphs and planes)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in LENGTHS]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=12 + 6 * i, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    lengths = []
    while engine.has_unfinished():
        engine.step()
        lengths.append([list(s.kv_lens) for s in seqs if not s.is_finished])
    tokens = [s.generated_ids for s in seqs]
    chained = llm.generate(prompts[0], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                           chain=ChainSpec(open=True))[0]
    history = prompts[0] + chained.token_ids
    again = llm.generate(history + prompts[1][:20], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                         chain=ChainSpec(continue_id=chained.chain_id))[0]
    graphs_used = sorted(engine.runner.graphs.graphs) if engine.runner.graphs is not None else []
    rings = engine.scheduler.rules.rings is not None  # StreamingLLM's window rings (runtime/kv/ring.py)
    del llm, engine
    torch.cuda.empty_cache()
    return tokens, lengths, [chained.token_ids, again.token_ids], graphs_used, rings


@pytest.mark.parametrize("method", sorted(CASES))
def test_graph_decode_equals_eager(tmp_path, method, monkeypatch):
    model_dir = make_tiny_qwen3(tmp_path, tokenizer=True)  # SkipKV reads the tokens' text
    oracle = serve(model_dir, method, graphs=False, planes=False, monkeypatch=monkeypatch)
    eager = serve(model_dir, method, graphs=False, planes=True, monkeypatch=monkeypatch)
    graph = serve(model_dir, method, graphs=True, planes=True, monkeypatch=monkeypatch)
    assert graph[3], "decode steps must have replayed captured graphs"
    for got in (eager, graph):
        assert got[0] == oracle[0]  # greedy tokens
        assert got[2] == oracle[2]  # chained turns
    assert graph[1] == eager[1]  # physical lengths after every step
    if not eager[4]:  # a ring holds the slot it writes next: one more than the step end leaves
        assert eager[1] == oracle[1]


GROWING = {"full": {}, "h2o": {"heavy": 0.6, "recent": 0.6}, "tova": {"budget": 300}}


@pytest.mark.parametrize("method", sorted(GROWING))
def test_decode_crosses_a_context_bucket(tmp_path, method):
    """Prompts of 250 and 240 tokens decode 20 and 12 tokens without evicting (H2O keeps 1.2 x the
    prompt, TOVA 300), so the longest context grows past the 256 rung: graphs of context buckets
    256 and 512 (max_model_len) replay, and the greedy tokens equal eager steps'."""
    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (250, 240)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 12)]
    outputs = []
    for graphs in (False, True):
        llm = LLM(str(model_dir), device="cuda", dtype="float32", page_size=16, method=method,
                  method_params=GROWING[method], kv_cache_memory=2**26, cuda_graphs=graphs,
                  decode_rings=False)  # TOVA's ring would add its capacity, 301, as a rung
        outputs.append([o.token_ids for o in llm.generate(prompts, params)])
        if graphs:
            captured = llm.engine.runner.graphs
            assert captured.contexts == [256, 512]
            assert {key.context for key in captured.graphs} == {256, 512}
            assert captured.num_graphs == len(captured.graphs) <= 2 * len(captured.buckets) * len(captured.contexts)
        del llm
        torch.cuda.empty_cache()
    assert outputs[0] == outputs[1]
