"""kvc.runtime.server: the OpenAI-compatible HTTP server (`kvc serve`) and its load generator
(`kvc bench serve`).

    app.py           FastAPI routes, auth, draining, OpenAPI schema
    openai_api.py    completions / chat: request -> token ids + SamplingParams -> JSON or SSE
    generation.py    one request's sequences as per-choice text deltas; disconnect -> abort
    text.py          incremental detokenization and stop strings
    async_engine.py  the thread that owns the Engine; asyncio <-> engine hand-off
    metrics.py       Prometheus metrics (kvc:*)
    errors.py        OpenAI error JSON for every failure
    protocol.py      request / response models (the OpenAPI schema)
    launch.py        uvicorn with drain-on-SIGTERM
    bench.py         the load generator
    cli.py           the `serve` and `bench serve` subcommands
"""
