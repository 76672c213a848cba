"""`kvc bench serve`: a load generator for any OpenAI-compatible server (like `vllm bench serve`).

Requests come from a dataset (random lengths; multi-turn conversations whose every turn resends
the whole history; agent sessions with long tool results, replayed with or without chains, in
`bench_agent.py`), are sent at a request rate (Poisson arrivals, or all at once) under a
concurrency cap, and are streamed; each is timed from the client: time to first token (TTFT),
inter-token latencies (ITL), time per output token after the first (TPOT), end-to-end latency.
The summary (mean, median, p90, p99 in ms; request and token throughput) is printed as a markdown
table and written as JSON with the per-request figures.

Prompts are token ids on /v1/completions (exact lengths, works for models without a tokenizer)
and random words on /v1/chat/completions. kvc's `return_token_ids` gives exact token counts per
chunk; on other servers a chunk counts as one token.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import httpx

_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this from "
          "or had by word but what some we can out other were all there when up use your how said an each "
          "she which do their time if will way about many then them write would like so these her long make "
          "thing see him two has look more day could go come did number sound no most people my over know "
          "water than call first who may down side been now find any new work part take get place made live "
          "where after back little only round man year came show every good me give our under name very").split()


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    dataset: str = "random"  # random | multi-turn | agent
    num_prompts: int = 100  # random: requests; multi-turn: conversations; agent: sessions
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    num_turns: int = 3  # multi-turn, agent: turns per conversation (session)
    tool_len_min: int = 2048  # agent: tokens of a tool result, uniform in [min, max]
    tool_len_max: int = 8192
    chains: bool = False  # agent: replay each session on a chain (kvc's chain cache)
    request_rate: float = float("inf")  # requests (or conversations) per second; inf: all at once
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = True
    vocab_size: int | None = None  # default: from the server's /v1/models (kvc)
    timeout: float = 600.0
    progress: bool = True


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    chain_id: str | None = None  # kvc: the chain the response named
    status: int = 0  # the HTTP status
    error_code: str | None = None  # the OpenAI error `code` of a failed request

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


class _Client:
    def __init__(self, cfg: BenchConfig, http: httpx.AsyncClient, model: str) -> None:
        self.cfg, self.http, self.model = cfg, http, model
        self.chat = cfg.endpoint.rstrip("/").endswith("chat/completions")

    async def send(self, prompt, max_tokens: int, extra: dict | None = None) -> RequestResult:
        """Streams one request; prompt is token ids (completions) or a message list (chat);
        `extra` adds fields to the body (e.g. kvc's chain fields)."""
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": self.cfg.ignore_eos,
                "return_token_ids": True, **(extra or {})}
        body["messages" if self.chat else "prompt"] = prompt
        res = RequestResult()
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", self.cfg.endpoint, json=body) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    res.error = f"HTTP {r.status_code}: {text[:300]}"
                    res.error_code = _error_code(text)
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        res.error = str(event["error"].get("message"))
                        return res
                    if event.get("chain_id"):
                        res.chain_id = event["chain_id"]
                    if usage := event.get("usage"):
                        res.prompt_tokens = usage["prompt_tokens"]
                        res.output_tokens = usage["completion_tokens"]
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for choice in event.get("choices", []):
                        text = choice.get("text") if not self.chat else (choice.get("delta") or {}).get("content")
                        ids = choice.get("token_ids")
                        if not text and not ids:
                            continue
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.output_ids += ids or []
                        res.output_text += text or ""
            res.e2e = time.perf_counter() - start
            res.output_tokens = res.output_tokens or len(res.output_ids)
            res.ok = res.ttft > 0.0
            if not res.ok:
                res.error = "no tokens received"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
            res.error = f"{type(e).__name__}: {e}"
        return res


def _error_code(text: str) -> str | None:
    try:
        return (json.loads(text).get("error") or {}).get("code")
    except (ValueError, AttributeError):
        return None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


async def _run_random(cfg, client, rng, vocab, gate, results, tick) -> None:
    async def one(prompt, out_len):
        async with gate:
            results.append(await client.send(prompt, out_len))
        tick()

    tasks = []
    for _ in range(cfg.num_prompts):
        in_len, out_len = _lengths(rng, cfg.input_len, cfg.range_ratio), _lengths(rng, cfg.output_len, cfg.range_ratio)
        prompt = ([{"role": "user", "content": _words(rng, in_len)}] if client.chat
                  else [rng.randrange(vocab) for _ in range(in_len)])
        tasks.append(asyncio.ensure_future(one(prompt, out_len)))
        await _pause(cfg, rng)
    await asyncio.gather(*tasks)


async def _run_multi_turn(cfg, client, rng, vocab, gate, results, tick) -> None:
    async def conversation(turns):
        history: list = []
        for user, out_len in turns:
            async with gate:  # a conversation holds its slot only while a turn runs
                if client.chat:
                    history.append({"role": "user", "content": user})
                else:
                    history = history + user
                res = await client.send(history, out_len)
            results.append(res)
            tick()
            if not res.ok:
                break
            if client.chat:
                history.append({"role": "assistant", "content": res.output_text})
            else:
                history = history + res.output_ids

    tasks = []
    for _ in range(cfg.num_prompts):
        turns = []
        for _ in range(cfg.num_turns):
            in_len = _lengths(rng, cfg.input_len, cfg.range_ratio)
            out_len = _lengths(rng, cfg.output_len, cfg.range_ratio)
            user = _words(rng, in_len) if client.chat else [rng.randrange(vocab) for _ in range(in_len)]
            turns.append((user, out_len))
        tasks.append(asyncio.ensure_future(conversation(turns)))
        await _pause(cfg, rng)
    await asyncio.gather(*tasks)


async def _pause(cfg: BenchConfig, rng: random.Random) -> None:
    if cfg.request_rate != float("inf"):
        await asyncio.sleep(rng.expovariate(cfg.request_rate))


def _stats(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 of seconds, in ms."""
    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ms = sorted(v * 1000 for v in values_s)

    def pct(p: float) -> float:
        k = (len(ms) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(ms) - 1)
        return ms[lo] + (ms[hi] - ms[lo]) * (k - lo)

    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "p90": pct(90), "p99": pct(99)}


def summarize(cfg: BenchConfig, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    for name, values in [
        ("ttft", [r.ttft for r in ok]),
        ("tpot", [t for r in ok if (t := r.tpot) is not None]),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.e2e for r in ok]),
    ]:
        for stat, value in _stats(values).items():
            summary[f"{stat}_{name}_ms"] = value
    return summary


def format_table(result: dict) -> str:
    """The summary as a markdown table."""
    rows = [
        ("Successful requests", f"{result['completed']}"),
        ("Failed requests", f"{result['failed']}"),
        ("Benchmark duration (s)", f"{result['duration_s']:.2f}"),
        ("Total input tokens", f"{result['total_input_tokens']}"),
        ("Total generated tokens", f"{result['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{result['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{result['total_token_throughput']:.1f}"),
    ]
    for name, label in [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")]:
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{result[f'{stat}_{name}_ms']:.2f}"))
    if "agent" in result:
        from kvc.runtime.server.bench_agent import table_rows

        rows += table_rows(result["agent"])
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


async def _discover(cfg: BenchConfig, http: httpx.AsyncClient) -> tuple[str, int]:
    r = await http.get("/v1/models")
    r.raise_for_status()
    cards = r.json()["data"]
    model = cfg.model or cards[0]["id"]
    vocab = cfg.vocab_size or next((c.get("vocab_size") for c in cards if c["id"] == model), None)
    if vocab is None:
        raise ValueError("the server does not report vocab_size; pass --vocab-size")
    return model, int(vocab)


async def run_benchmark(cfg: BenchConfig) -> dict:
    from kvc.runtime.server import bench_agent  # it builds on this module

    rng = random.Random(cfg.seed)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.timeout, limits=limits) as http:
        model, vocab = await _discover(cfg, http)
        client = _Client(cfg, http, model)
        probe = await client.send([{"role": "user", "content": "hi"}] if client.chat else [1, 2, 3], 2)
        if not probe.ok:
            raise RuntimeError(f"test request failed: {probe.error}")
        total = cfg.num_prompts * (cfg.num_turns if cfg.dataset in ("multi-turn", "agent") else 1)
        gate = asyncio.Semaphore(cfg.max_concurrency or total)  # agent: sessions in flight
        results: list[RequestResult] = []
        run = {"random": _run_random, "multi-turn": _run_multi_turn, "agent": bench_agent.run_agent}[cfg.dataset]
        start = time.perf_counter()
        if cfg.progress:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task(f"bench {cfg.dataset}", total=total)
                extra = await run(cfg, client, rng, vocab, gate, results, lambda: bar.advance(task))
        else:
            extra = await run(cfg, client, rng, vocab, gate, results, lambda: None)
        duration = time.perf_counter() - start
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": "openai",
        "model": model,
        "config": {k: (None if v == float("inf") else v) for k, v in asdict(cfg).items() if k != "api_key"},
        **summarize(cfg, results, duration),
        **({"agent": extra} if extra is not None else {}),
        "errors": errors[:10],
        "per_request": {
            "input_tokens": [r.prompt_tokens for r in results],
            "cached_tokens": [r.cached_tokens for r in results],
            "output_tokens": [r.output_tokens for r in results],
            "ttft_s": [r.ttft for r in results],
            "e2el_s": [r.e2e for r in results],
            "itl_s": [r.itl for r in results],
        },
    }
