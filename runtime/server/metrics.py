"""Prometheus metrics of the server, served at /metrics (names follow vLLM's, with `kvc:`).

Two sources: the engine thread's `EngineStats` snapshot, read at scrape time by a collector (queue
lengths, KV pages, prefix cache, chain cache), and per-request observations the handlers make when
a request ends (latencies, token counts, prompt tokens reused vs prefilled). Each server has its
own registry, so several servers can live in one process (the tests do that).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvc.runtime.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    """Reads the engine's latest snapshot at scrape time."""

    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.aengine = aengine
        self.labels = {"model_name": model_name}

    def collect(self):
        s = self.aengine.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=list(self.labels))
            g.add_metric(list(self.labels.values()), value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=list(self.labels))
            c.add_metric(list(self.labels.values()), value)
            return c

        yield gauge("kvc:num_requests_running", "Sequences admitted to the running batch.", s.num_running)
        yield gauge("kvc:num_requests_waiting", "Sequences waiting for admission.", s.num_waiting)
        yield gauge("kvc:kv_pages_used", "KV pages held by sequences.", s.pages_used)
        yield gauge("kvc:kv_pages_free", "KV pages free (including cached prefix pages).", s.pages_free)
        yield gauge("kvc:kv_pages_total", "KV pages in the pool.", s.pages_total)
        yield gauge("kvc:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).",
                    s.pages_used / s.pages_total if s.pages_total else 0.0)
        rate = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield gauge("kvc:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up.", rate)
        yield counter("kvc:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_query_tokens)
        yield counter("kvc:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield counter("kvc:num_preemptions", "Sequences preempted for lack of KV pages.", s.num_preemptions)
        yield counter("kvc:engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("kvc:chains_active", "Chains with a request running on them.", s.chains_active)
        yield gauge("kvc:chains_idle", "Chains kept between turns (evictable, oldest first).", s.chains_idle)
        yield gauge("kvc:chain_pages", "KV pages held by chains.", s.chain_pages)
        yield counter("kvc:chains_evicted", "Idle chains evicted under memory pressure.", s.chains_evicted_total)
        yield counter("kvc:chain_prunes", "Prunes applied to chains (explicit and automatic).", s.chain_prunes_total)
        yield counter("kvc:chain_pruned_tokens", "Stored token slots dropped by prunes (over layers and KV heads).",
                      s.chain_pruned_tokens_total)


class ServerMetrics:
    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("kvc:time_to_first_token_seconds", "Time to the first generated token.",
                              m, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvc:time_per_output_token_seconds",
                              "Mean time between output tokens of a request (after the first).",
                              m, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("kvc:e2e_request_latency_seconds", "Arrival to last token.",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvc:prompt_tokens", "Prompt tokens of finished sequences.", m, registry=r)
        self.reused_tokens = Counter("kvc:prompt_tokens_reused",
                                     "Prompt tokens not prefilled: prefix-cache hits and chain reuse.", m, registry=r)
        self.prefilled_tokens = Counter("kvc:prompt_tokens_prefilled", "Prompt tokens prefilled.", m, registry=r)
        self.generation_tokens = Counter("kvc:generation_tokens", "Generated tokens of finished sequences.",
                                         m, registry=r)
        self.requests = Counter("kvc:request_success", "Finished sequences by finish reason.",
                                m + ["finished_reason"], registry=r)
        self.errors = Counter("kvc:http_errors", "Error responses by status code.", m + ["status"], registry=r)
        r.register(_EngineCollector(aengine, model_name))

    def observe_sequence(self, *, arrival: float, first: float | None, last: float, prompt_tokens: int,
                         output_tokens: int, finish_reason: str, cached_tokens: int = 0) -> None:
        """One finished sequence: perf_counter times of arrival, first and last token."""
        m = self.model_name
        if first is not None:
            self.ttft.labels(m).observe(first - arrival)
            if output_tokens > 1:
                self.tpot.labels(m).observe((last - first) / (output_tokens - 1))
        self.e2e.labels(m).observe(last - arrival)
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.reused_tokens.labels(m).inc(cached_tokens)
        self.prefilled_tokens.labels(m).inc(max(0, prompt_tokens - cached_tokens))
        self.generation_tokens.labels(m).inc(output_tokens)
        self.requests.labels(m, finish_reason).inc()

    def observe_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
