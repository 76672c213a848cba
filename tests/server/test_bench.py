"""`kvc bench serve` against a CPU server: the full metric set, exact token counts, JSON file."""

from __future__ import annotations

import json

import pytest

from kvc.runtime.cli import main

METRICS = ["completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput",
           "output_throughput", "total_token_throughput"] + [
    f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p90", "p99")]


def test_random_dataset_with_rate_and_concurrency(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8", "--input-len", "24",
               "--output-len", "8", "--range-ratio", "0.5", "--request-rate", "40", "--max-concurrency", "4",
               "--result-file", str(out), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    for key in METRICS:
        assert isinstance(result[key], (int, float)), key
    assert result["completed"] == 8 and result["failed"] == 0
    assert sum(result["per_request"]["output_tokens"]) == result["total_output_tokens"]
    assert 8 * 4 <= result["total_output_tokens"] <= 8 * 12  # lengths in 8 * (1 +- 0.5), EOS ignored
    assert 8 * 12 <= result["total_input_tokens"] <= 8 * 36
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"] and result["mean_tpot_ms"] > 0
    assert all(len(itl) == n - 1 for itl, n in zip(result["per_request"]["itl_s"],
                                                     result["per_request"]["output_tokens"]))
    table = capsys.readouterr().out
    assert "| Output token throughput (tok/s) |" in table and "| P99 ITL (ms) |" in table


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_multi_turn_dataset_resends_the_history(server, tmp_path, endpoint):
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", endpoint, "--dataset", "multi-turn",
               "--num-prompts", "3", "--num-turns", "3", "--input-len", "16", "--output-len", "6",
               "--result-file", str(out), "--no-progress"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 9 and result["total_output_tokens"] == 9 * 6
    lens = result["per_request"]["input_tokens"]
    assert max(lens) > 2 * min(lens)  # later turns carry the earlier ones
    if endpoint == "/v1/completions":  # token ids: turn k = k * (16 + 6) - 6 tokens exactly
        assert sorted(set(lens)) == [16, 38, 60]
