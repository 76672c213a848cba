"""`kvc bench throughput --requests N` (runtime/bench/offline.py) on a tiny random Qwen3 on the CPU: N requests
run end to end per method at the same KV memory, more requests than a method's seats (so they run in waves:
no more decode at once than the seats), every request to its full output; output tok/s, requests/s and TTFT
over the whole run, the ratio vs full, and the table. The CLI prints it and writes it to the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvc.runtime.bench.result import format_offline
from kvc.runtime.bench.throughput import ThroughputConfig, run
from kvc.runtime.cli import main
from kvc.runtime.errors import ConfigError
from tests.models.tiny import make_tiny_qwen3

INPUT, OUTPUT, REQUESTS = 150, 12, 9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def test_requests_run_end_to_end(model_dir):
    cfg = ThroughputConfig(methods=["full", "snapkv"], inputs=[INPUT], kv_memory=120_000, model=str(model_dir),
                           output_len=OUTPUT, budget=32, steps=2, warmup=1, device="cpu", dtype="float32",
                           page_size=4, sources=1, requests=REQUESTS)
    result = run(cfg)
    offline = {r["method"]: r for r in result["rows"] if r["mode"] == "offline"}
    assert set(offline) == {"full", "snapkv"}
    for row in offline.values():
        assert "error" not in row, row
        assert row["requests"] == REQUESTS and row["steps"] >= OUTPUT
        assert 1 <= row["peak_running"] <= row["batch"]
        assert row["output_tok_s"] == pytest.approx(REQUESTS * OUTPUT / row["wall_s"])
        assert row["total_tok_s"] == pytest.approx(REQUESTS * (INPUT + OUTPUT) / row["wall_s"])
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] <= row["wall_s"] and 0 < row["prefill_share"] <= 1
    assert offline["full"]["batch"] < REQUESTS, "full must run in waves: raise REQUESTS or lower the pool"
    assert offline["full"]["peak_running"] <= offline["full"]["batch"]
    ratio = result["ratios_vs_full"][str(INPUT)]["snapkv"]["output_tok_s"]
    assert ratio == pytest.approx(offline["snapkv"]["output_tok_s"] / offline["full"]["output_tok_s"])
    table = format_offline(result)
    assert "| output tok/s |" in table and f"{ratio:.2f}x" in table


def test_cli_prints_and_writes_the_whole_run(model_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "throughput", "--model", str(model_dir), "--methods", "full", "--inputs", "40",
                 "--output", "8", "--kv-memory", "200000", "--steps", "2", "--warmup", "1", "--device", "cpu",
                 "--sources", "1", "--requests", "3", "--out", str(out), "--no-progress"])
    assert code == 0
    assert "| method | input | output | requests |" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["decode_window", "offline"] and rows[1]["requests"] == 3


def test_negative_requests_are_a_config_error():
    with pytest.raises(ConfigError, match="requests"):
        ThroughputConfig(methods=["full"], inputs=[64], kv_memory=1, requests=-1)
