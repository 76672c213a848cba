"""/metrics under vLLM's names (`vllm:`, labels model_name and engine), as vLLM dashboards, autoscalers
and routers read them: after a few requests each name is there, with values the requests explain."""

from __future__ import annotations

import json

import httpx

from tests.server.conftest import live_server, metric_sample

LABELS = {"model_name": "kvc-test", "engine": "0"}
PROMPT = "The quick brown fox jumps over the lazy dog; " * 3  # several 16-token pages: the prefix cache hits
MAX_TOKENS = 5


def _scrape(server) -> str:
    return httpx.get(f"{server.url}/metrics").text


def _value(text: str, name: str, **labels) -> float:
    return metric_sample(text, name, **LABELS, **labels)


def test_vllm_names_after_a_few_requests():
    with live_server({"max_model_len": 4096}) as s:
        usages = []
        for stream in (False, False, True):
            body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                    "stream": stream, "stream_options": {"include_usage": True} if stream else None}
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200
            if stream:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
                usages.append(json.loads(events[-1])["usage"])
            else:
                usages.append(r.json()["usage"])
        n = len(usages)
        prompt = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        assert cached > 0  # the repeated prompt hit the prefix cache

        text = _scrape(s)
        assert _value(text, "vllm:num_requests_running") == 0 and _value(text, "vllm:num_requests_waiting") == 0
        assert _value(text, "vllm:kv_cache_usage_perc") == _value(text, "vllm:gpu_cache_usage_perc") == 0
        assert _value(text, "vllm:prefix_cache_queries_total") >= prompt - 2 * n  # the last token is never looked up
        assert _value(text, "vllm:prefix_cache_hits_total") == cached
        assert _value(text, "vllm:prompt_tokens_total") == prompt
        assert _value(text, "vllm:generation_tokens_total") == n * MAX_TOKENS
        assert _value(text, "vllm:request_success_total", finished_reason="length") == n
        for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                     "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                     "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                     "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                     "vllm:request_generation_tokens"):
            assert _value(text, f"{name}_count") == n, name
            assert _value(text, f"{name}_sum") >= 0, name
        assert _value(text, "vllm:request_prompt_tokens_sum") == prompt
        assert _value(text, "vllm:request_decode_time_seconds_sum") > 0
        # latencies add up: queue + prefill = time to the first token's step end, <= TTFT; e2e >= TTFT
        ttft = _value(text, "vllm:time_to_first_token_seconds_sum")
        assert _value(text, "vllm:request_queue_time_seconds_sum") + \
            _value(text, "vllm:request_prefill_time_seconds_sum") <= ttft + 1e-6
        assert _value(text, "vllm:e2e_request_latency_seconds_sum") >= ttft
        # one gap per token after the first; the old name counts the same gaps
        gaps = n * (MAX_TOKENS - 1)
        assert _value(text, "vllm:inter_token_latency_seconds_count") == gaps
        assert _value(text, "vllm:time_per_output_token_seconds_count") == gaps
        # every computed token was in some step: the prompt's uncached tokens and all but the last generated
        assert _value(text, "vllm:iteration_tokens_total_sum") == prompt - cached + n * (MAX_TOKENS - 1)
        steps = metric_sample(text, "kvc:engine_steps_total")
        assert 0 < _value(text, "vllm:iteration_tokens_total_count") <= steps
        assert _value(text, "vllm:num_preemptions_total") == 0


def test_vllm_gauges_while_a_request_runs():
    with live_server({"max_model_len": 4096}) as s:
        body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as st:
            lines = st.iter_lines()
            next(lines)
            text = _scrape(s)
            assert _value(text, "vllm:num_requests_running") == 1
            assert 0 < _value(text, "vllm:kv_cache_usage_perc") <= 1
        # the stream is closed: its request is aborted
        assert s.wait_metric("vllm:num_requests_running", 0) == 0
