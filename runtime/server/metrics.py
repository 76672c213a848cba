"""Prometheus metrics of the server, served at /metrics: kvc's own (`kvc:`) and vLLM's names (`vllm:`).

Two sources: the engine thread's `EngineStats` snapshot, read at scrape time by a collector (queue
lengths, KV pages, prefix cache, chain cache), and observations the handlers and the engine thread
make as requests run and end (latencies, token counts, tokens per engine step). Each server has its
own registry, so several servers can live in one process (the tests do that).

The `vllm:` families carry vLLM v1's names and labels (`model_name`, `engine`) as of vLLM 0.11, so
dashboards, autoscalers and routers written for vLLM read kvc unchanged; each is fed by the same
observation as its `kvc:` twin. Where vLLM 0.11 renamed a metric, the old name is exported too
(`vllm:gpu_cache_usage_perc`, `vllm:time_per_output_token_seconds`, which vLLM <= 0.10 used for the
inter-token latency). docs/serving.md lists them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvc.runtime.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 80.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_ENGINE = "0"  # vLLM's `engine` label: the index of the engine core; kvc serves one engine


class _EngineCollector:
    """Reads the engine's latest snapshot at scrape time."""

    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.aengine = aengine
        self.model_name = model_name

    def collect(self):
        s = self.aengine.stats
        usage = s.pages_used / s.pages_total if s.pages_total else 0.0

        def gauge(name: str, doc: str, value: float, vllm: bool = False) -> GaugeMetricFamily:
            return self._family(GaugeMetricFamily, name, doc, value, vllm)

        def counter(name: str, doc: str, value: float, vllm: bool = False) -> CounterMetricFamily:
            return self._family(CounterMetricFamily, name, doc, value, vllm)

        for prefix in ("kvc", "vllm"):
            v = prefix == "vllm"
            yield gauge(f"{prefix}:num_requests_running", "Sequences admitted to the running batch.", s.num_running, v)
            yield gauge(f"{prefix}:num_requests_waiting", "Sequences waiting for admission.", s.num_waiting, v)
            yield gauge(f"{prefix}:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", usage, v)
            yield counter(f"{prefix}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                          s.prefix_query_tokens, v)
            yield counter(f"{prefix}:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                          s.prefix_hit_tokens, v)
            yield counter(f"{prefix}:num_preemptions", "Sequences preempted for lack of KV pages.",
                          s.num_preemptions, v)
        yield gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full); vLLM <= 0.10's name of "
                    "vllm:kv_cache_usage_perc.", usage, True)
        yield gauge("kvc:kv_pages_used", "KV pages held by sequences.", s.pages_used)
        yield gauge("kvc:kv_pages_free", "KV pages free (including cached prefix pages).", s.pages_free)
        yield gauge("kvc:kv_pages_total", "KV pages in the pool.", s.pages_total)
        rate = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield gauge("kvc:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up.", rate)
        yield counter("kvc:engine_steps", "Engine steps run.", s.num_steps)
        yield gauge("kvc:chains_active", "Chains with a request running on them.", s.chains_active)
        yield gauge("kvc:chains_idle", "Chains kept between turns (evictable, oldest first).", s.chains_idle)
        yield gauge("kvc:chain_pages", "KV pages held by chains.", s.chain_pages)
        yield counter("kvc:chains_evicted", "Idle chains evicted under memory pressure.", s.chains_evicted_total)
        yield counter("kvc:chains_expired", "Idle chains dropped by --chain-ttl or --max-chains.",
                      s.chains_expired_total)
        yield counter("kvc:chain_prunes", "Prunes applied to chains (explicit and automatic).", s.chain_prunes_total)
        yield counter("kvc:chain_pruned_tokens", "Stored token slots dropped by prunes (over layers and KV heads).",
                      s.chain_pruned_tokens_total)

        yield from self._per_method(s.methods)

    def _per_method(self, methods: tuple[dict, ...]):
        """kvc's per-method families, labelled `method` (runtime/lanes.py: a lane's key)."""
        families = [
            (CounterMetricFamily, "kvc:method_requests", "Requests added, by KV method.", "requests"),
            (CounterMetricFamily, "kvc:method_prompt_tokens", "Prompt tokens of the requests added, by KV method.",
             "prompt_tokens"),
            (CounterMetricFamily, "kvc:method_generation_tokens",
             "Tokens generated by finished requests, by KV method.", "generated_tokens"),
            (GaugeMetricFamily, "kvc:method_requests_running", "Sequences running, by KV method.", "running"),
            (GaugeMetricFamily, "kvc:method_kv_pages", "KV pages held by running sequences, by KV method.", "kv_pages"),
        ]
        for kind, name, doc, field in families:
            family = kind(name, doc, labels=["model_name", "method"])
            for lane in methods:
                family.add_metric([self.model_name, lane["method"]], lane[field])
            yield family

    def _family(self, kind, name: str, doc: str, value: float, vllm: bool):
        labels = {"model_name": self.model_name, **({"engine": _ENGINE} if vllm else {})}
        family = kind(name, doc, labels=list(labels))
        family.add_metric(list(labels.values()), value)
        return family


class _Twins:
    """One observation, recorded under each of several metrics (kvc's name, vLLM's names)."""

    def __init__(self, *children) -> None:
        self.children = children

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)

    def inc(self, value: float = 1.0) -> None:
        for child in self.children:
            child.inc(value)


class ServerMetrics:
    def __init__(self, aengine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._kvc_labels = (model_name,)
        self._vllm_labels = (model_name, _ENGINE)
        self._reason_metrics: list[tuple[Counter, tuple[str, ...]]] = []

        self.ttft = self._histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.",
                                    _LATENCY_BUCKETS, vllm=["time_to_first_token_seconds"])
        self.tpot = self._histogram(
            "time_per_output_token_seconds", "Per request: mean time between output tokens (after the first).",
            _TPOT_BUCKETS, vllm=["request_time_per_output_token_seconds"])
        self.itl = self._histogram(
            None, "Time between a request's consecutive token outputs.", _TPOT_BUCKETS,
            vllm=["inter_token_latency_seconds", "time_per_output_token_seconds"])
        self.e2e = self._histogram("e2e_request_latency_seconds", "Time from arrival to the last token.",
                                   _LATENCY_BUCKETS, vllm=["e2e_request_latency_seconds"])
        self.queue_time = self._histogram(None, "Time from arrival to the first engine step that ran the request.",
                                          _LATENCY_BUCKETS, vllm=["request_queue_time_seconds"])
        self.prefill_time = self._histogram(None, "Time from the request's first step to its first token.",
                                            _LATENCY_BUCKETS, vllm=["request_prefill_time_seconds"])
        self.decode_time = self._histogram(None, "Time from the request's first token to its last.",
                                           _LATENCY_BUCKETS, vllm=["request_decode_time_seconds"])
        self.inference_time = self._histogram(None, "Time from the request's first step to its last token.",
                                              _LATENCY_BUCKETS, vllm=["request_inference_time_seconds"])
        self.step_tokens = self._histogram(None, "Tokens per engine step (prefill chunks and decodes).",
                                           _TOKEN_BUCKETS, vllm=["iteration_tokens_total"])
        self.request_prompt_tokens = self._histogram(None, "Prompt tokens per finished request.", _TOKEN_BUCKETS,
                                                     vllm=["request_prompt_tokens"])
        self.request_generation_tokens = self._histogram(None, "Generated tokens per finished request.",
                                                         _TOKEN_BUCKETS, vllm=["request_generation_tokens"])
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of finished sequences.",
                                           vllm=["prompt_tokens"])
        self.generation_tokens = self._counter("generation_tokens", "Generated tokens of finished sequences.",
                                               vllm=["generation_tokens"])
        self.reused_tokens = self._counter("prompt_tokens_reused",
                                           "Prompt tokens not prefilled: prefix-cache hits and chain reuse.")
        self.prefilled_tokens = self._counter("prompt_tokens_prefilled", "Prompt tokens prefilled.")
        r = self.registry
        self._reason_metrics = [
            (Counter("kvc:request_success", "Finished sequences by finish reason.",
                     ["model_name", "finished_reason"], registry=r), self._kvc_labels),
            (Counter("vllm:request_success", "Finished sequences by finish reason.",
                     ["model_name", "engine", "finished_reason"], registry=r), self._vllm_labels),
        ]
        self.errors = Counter("kvc:http_errors", "Error responses by status code.", ["model_name", "status"],
                              registry=r)
        r.register(_EngineCollector(aengine, model_name))
        aengine.on_step = self.step_tokens.observe  # called on the engine thread; the client is thread-safe

    def _histogram(self, kvc: str | None, doc: str, buckets, vllm: list[str] = ()) -> _Twins:
        children = []
        if kvc is not None:
            children.append(Histogram(f"kvc:{kvc}", doc, ["model_name"], buckets=buckets, registry=self.registry)
                            .labels(*self._kvc_labels))
        for name in vllm:
            children.append(Histogram(f"vllm:{name}", doc, ["model_name", "engine"], buckets=buckets,
                                      registry=self.registry).labels(*self._vllm_labels))
        return _Twins(*children)

    def _counter(self, kvc: str, doc: str, vllm: list[str] = ()) -> _Twins:
        children = [Counter(f"kvc:{kvc}", doc, ["model_name"], registry=self.registry).labels(*self._kvc_labels)]
        for name in vllm:
            children.append(Counter(f"vllm:{name}", doc, ["model_name", "engine"], registry=self.registry)
                            .labels(*self._vllm_labels))
        return _Twins(*children)

    def observe_sequence(self, *, arrival: float, first: float | None, last: float, prompt_tokens: int,
                         output_tokens: int, finish_reason: str, cached_tokens: int = 0,
                         scheduled: float | None = None) -> None:
        """One finished sequence: perf_counter times of arrival, first admission to a step, first
        and last token (aborted ones too, with what they got)."""
        if first is not None:
            self.ttft.observe(first - arrival)
            if output_tokens > 1:
                self.tpot.observe((last - first) / (output_tokens - 1))
            self.decode_time.observe(last - first)
        self.e2e.observe(last - arrival)
        if scheduled is not None:
            self.queue_time.observe(max(0.0, scheduled - arrival))
            self.inference_time.observe(max(0.0, last - scheduled))
            if first is not None:
                self.prefill_time.observe(max(0.0, first - scheduled))
        self.prompt_tokens.inc(prompt_tokens)
        self.reused_tokens.inc(cached_tokens)
        self.prefilled_tokens.inc(max(0, prompt_tokens - cached_tokens))
        self.generation_tokens.inc(output_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(output_tokens)
        for counter, labels in self._reason_metrics:
            counter.labels(*labels, finish_reason).inc()

    def observe_token_gap(self, seconds: float) -> None:
        """The time between two consecutive token outputs of one sequence."""
        self.itl.observe(seconds)

    def observe_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
