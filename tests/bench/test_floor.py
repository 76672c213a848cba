"""The decode step's memory floor (runtime/bench/floor.py) on tiny random models through the real loader, counted
by hand from the configs: the dense weights once (the embedding table's batch rows only, unless it is the
output projection), the routed experts a batch's tokens choose in expectation, the KV the rows hold; and the
table's `vs floor` column."""

from __future__ import annotations

import pytest

from kvc import LLM, SamplingParams
from kvc.runtime.bench.floor import kv_bytes, step_floor, weight_bytes
from kvc.runtime.bench.result import format_table
from tests.models.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

HIDDEN, VOCAB, LAYERS = 64, 320, 3
EXPERTS, TOP_K, MOE_INTER = 8, 2, 32
KV_HEADS, HEAD_DIM, HEADS = 2, 16, 4


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return LLM(str(make_tiny_qwen3_moe(tmp_path_factory.mktemp("moe"), tie_word_embeddings=False)),
               dtype="float32", page_size=4)


def _expert_bytes() -> int:
    """One layer's routed experts: gate and up [E, 2I, H], down [E, H, I], float32."""
    return EXPERTS * 3 * MOE_INTER * HIDDEN * 4


def test_weights_count_the_chosen_experts_and_the_tables_rows(moe):
    model = moe.engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = LAYERS * _expert_bytes()
    table = VOCAB * HIDDEN * 4
    for batch in (1, 5, 64):
        counted = weight_bytes(model, batch)
        assert counted["experts_all"] == experts
        assert counted["dense"] == total - experts - table + batch * HIDDEN * 4  # the batch's embedding rows
        chosen = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** batch)  # expected experts chosen, uniform routing
        assert counted["experts_read"] == pytest.approx(LAYERS * _expert_bytes() * chosen / EXPERTS)
    assert weight_bytes(model, 1)["experts_read"] == pytest.approx(experts * TOP_K / EXPERTS)  # one token: k
    assert weight_bytes(model, 10_000)["experts_read"] == pytest.approx(experts)  # many: every expert


def test_a_tied_table_is_read_whole_by_the_logits(tmp_path):
    llm = LLM(str(make_tiny_qwen3(tmp_path, tie_word_embeddings=True)), dtype="float32", page_size=4)
    model = llm.engine.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model, 3) == {"dense": total, "experts_all": 0, "experts_read": 0.0}


def test_kv_bytes_and_the_floor(moe):
    engine = moe.engine
    prompts = [list(range(3, 3 + n)) for n in (10, 23)]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)) for p in prompts]
    while any(s.num_generated < 2 for s in seqs):
        engine.step()
    per_token = 2 * KV_HEADS * HEAD_DIM * 4  # K and V, float32, a layer
    held = sum(sum(s.kv_lens) for s in seqs) * per_token
    assert held == sum(LAYERS * (len(p) + 1) for p in prompts) * per_token  # every token of every layer
    assert kv_bytes(engine, seqs) == held
    weights = weight_bytes(engine.runner.model, 2)
    floor = step_floor(engine.runner.model, 2, held, copy_gbps=100.0, step_ms=3.0)
    bytes_read = weights["dense"] + weights["experts_read"] + held
    assert floor["floor_ms"] == pytest.approx(bytes_read / 100e6)  # GB/s = 1e6 bytes a millisecond
    assert floor["vs_floor"] == pytest.approx(3.0 / floor["floor_ms"])
    while engine.has_unfinished():
        engine.step()


def test_the_table_shows_the_step_over_its_floor():
    row = {"method": "full", "input_len": 8, "mode": "decode_window", "batch": 2, "pages_per_seq": 3,
           "step_ms": 2.5, "decode_tok_s": 800.0, "prefill_s": 0.1, "ttft_s": 0.1, "busy": None}
    result = {"rows": [row, {**row, "method": "snapkv", "vs_floor": 1.234}], "ratios_vs_full": {}}
    lines = format_table(result).splitlines()
    assert "| vs floor |" in lines[0] and len(lines[1].split("|")) == len(lines[0].split("|"))
    assert " | - | " in lines[2] and "| 1.23x |" in lines[3]
    assert all(len(line.split("|")) == len(lines[0].split("|")) for line in lines)


def test_a_run_reports_each_windows_floor(tmp_path, monkeypatch):
    """`kvc bench throughput` with a copy bandwidth (on a GPU: measured at the run's start; here given) puts the
    floor in every decode window's row: the weights of an MoE model at the window's batch, the KV its rows hold
    (between the window's first and last step), the step over their sum."""
    import json

    from kvc.runtime.bench import throughput
    from kvc.runtime.cli import main

    model_dir = make_tiny_qwen3_moe(tmp_path / "moe", tie_word_embeddings=False)
    monkeypatch.setattr(throughput, "_copy_bandwidth", lambda cfg: 50.0)
    out = tmp_path / "result.json"
    page_bytes = 2 * KV_HEADS * HEAD_DIM * 4 * 4 * LAYERS  # a page of 4 slots, every layer, float32
    code = main(["bench", "throughput", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                 "--methods", "full,snapkv", "--method-params", "snapkv:budget=40,window=8", "--inputs", "120",
                 "--output", "16", "--kv-memory", str(120 * page_bytes), "--page-size", "4", "--steps", "3",
                 "--warmup", "1", "--sources", "1", "--attention-backend", "torch", "--out", str(out),
                 "--no-progress"])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["copy_GBps"] == 50.0
    per_token = 2 * KV_HEADS * HEAD_DIM * 4 * LAYERS
    for row in result["rows"]:
        floor = row["floor"]
        batch = row["batch"]
        stored = row["kv_tokens_at_window"] * batch * per_token  # a row's tokens when the window began
        assert stored <= floor["kv_bytes"] <= stored + 6 * batch * per_token  # + up to warmup + steps tokens
        chosen = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** batch)
        assert floor["expert_bytes_read"] == pytest.approx(LAYERS * _expert_bytes() * chosen / EXPERTS, rel=1e-6)
        total = floor["weight_bytes"] + floor["expert_bytes_read"] + floor["kv_bytes"]
        assert floor["floor_ms"] == pytest.approx(total / 50e6, rel=1e-6)
        assert row["vs_floor"] == pytest.approx(row["step_ms"] / floor["floor_ms"])

