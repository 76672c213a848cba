"""The throughput plan's pool equals the engine's (runtime/bench/plan.py `plan_batch` vs
runtime/engine.py): for every shipped method the engine can serve, at one KV memory that is not
a whole number of pages, the plan counts exactly the pages the engine allocates, state planes
included (H2O and TOVA keep per-token state beside K/V: a plan that counted only K/V promised
more pages than the engine had), and so are the rows of per-sequence tensors (RetroInfer's cluster
indices: a row a seat and some for idle chains, off the budget first) and the tensors stored once (FP8's scales: at a
budget of whole pages the plan promised one page more than the engine had)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc import LLM
from kvc.runtime.attention.backend import kv_bytes_per_page, layer_page_bytes
from kvc.runtime.bench.plan import model_spec, plan_batch
from kvc.runtime.errors import ConfigError
from kvc.runtime.methods import resolve_method
from kvc.runtime.compiled.folder import available
from tests.models.tiny import make_tiny_qwen3

PAGE = 4
MEMORY = 1000 * 2 * 2 * 16 * 4 * PAGE + 1234  # ~1000 float32 K/V pages of 2 KV heads x dim 16, plus change


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("plan"))


def test_plan_counts_the_pages_the_engine_allocates(model_dir):
    spec = model_spec(str(model_dir), torch.device("cpu"), "float32")
    served, with_planes = [], []
    for name in available():
        try:
            plan = plan_batch(resolve_method(name, None), spec, MEMORY, PAGE, 150, 24, 1000)
            # the engine of the throughput run (runtime/bench/steps.py `make_engine`)
            llm = LLM(str(model_dir), method=name, device="cpu", dtype="float32", page_size=PAGE,
                      attention_backend="torch", kv_cache_memory=MEMORY, max_model_len=150 + 24 + 1,
                      max_num_seqs=plan.batch)
        except ConfigError:  # a layout the engine cannot hold yet (quantized pages ...): no plan either
            continue
        engine = llm.engine
        assert plan.num_pages == engine.num_pages, name
        # a budget of whole pages: what the store holds once (FP8's scales) must come off in both
        whole = plan.page_bytes * 1000
        exact = plan_batch(resolve_method(name, None), spec, whole, PAGE, 150, 24, 1000)
        again = LLM(str(model_dir), method=name, device="cpu", dtype="float32", page_size=PAGE,
                    attention_backend="torch", kv_cache_memory=whole, max_model_len=150 + 24 + 1,
                    max_num_seqs=max(1, exact.batch))
        assert exact.num_pages == again.engine.num_pages, name
        del again
        assert plan.page_bytes == layer_page_bytes(
            engine.method.kv_spec(spec.num_kv_heads, spec.head_dim, spec.dtype, PAGE), spec.num_kv_heads, PAGE), name
        served.append(name)
        if engine.attention.planes:
            with_planes.append(name)
            assert plan.page_bytes > kv_bytes_per_page(spec.num_kv_heads, PAGE, spec.head_dim, spec.dtype), name
        del llm, engine
    assert {"full", "snapkv", "streamingllm", "h2o", "tova", "retroinfer", "fp8"} <= set(served)
    assert {"h2o", "tova"} <= set(with_planes)  # the case the plan used to miss


def test_rows_a_seat_and_for_idle_chains() -> None:
    """`seq_rows`: a row a running sequence, and one an idle chain where those cost at most IDLE_ROW_SHARE of the
    budget (a quantization's residual window); rows sized by the longest context (a cluster index) keep as many
    for idle chains as that share buys, so they do not halve the batch; and no more than ROW_SHARE in all."""
    from kvc.runtime.attention.backend import IDLE_ROW_SHARE, ROW_SHARE, seq_rows

    memory = 64 * 2**30
    assert seq_rows(18, 0, memory) == 0
    assert seq_rows(18, 2**20, memory) == 36  # small rows: one a seat, one an idle chain
    index_row = 243 * 2**20  # RetroInfer's at max_model_len 34,817 on Qwen3-30B-A3B
    idle = int(IDLE_ROW_SHARE * memory) // index_row
    assert 0 < idle < 18 and seq_rows(18, index_row, memory) == 18 + idle
    assert seq_rows(200, index_row, memory) == int(ROW_SHARE * memory) // index_row  # the cap bounds the batch
    assert seq_rows(1, memory, memory) == 2
