"""kvc.runtime.server: the OpenAI-compatible HTTP server (`kvc serve`) and its load generator
(`kvc bench serve`).

    app.py           FastAPI routes (incl. /v1/chains), the OpenAPI schema
    middleware.py    before the routes: X-Request-Id, body limit (413), draining and API keys, extra fields
    auth.py          API keys; a request's owner (sha256 of its key) for chains
    openai_api.py    completions / chat: request -> token ids + SamplingParams (+ ChainSpec) -> JSON or SSE
    generation.py    one request's sequences as per-choice text deltas; disconnect -> abort
    text.py          incremental detokenization and stop strings
    async_engine.py  the thread that owns the Engine; asyncio <-> engine hand-off
    metrics.py       Prometheus metrics (kvc:* and vLLM's vllm:* names)
    errors.py        OpenAI error JSON for every failure
    protocol.py      request / response models (the OpenAPI schema)
    launch.py        uvicorn with drain-on-SIGTERM (a second signal stops within a second)
    bench.py         the load generator
    bench_agent.py   its agent-trace dataset (long tool results; with or without chains)
    cli.py           the `serve` and `bench serve` subcommands
"""
