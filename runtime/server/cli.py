"""The `kvc serve` and `kvc bench serve` subcommands (added to the `kvc` parser by runtime/cli.py).

Heavy imports (fastapi, uvicorn, the engine) happen when a command runs, not when `kvc` parses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_commands(sub, add_engine_args, engine_options):
    """Registers `serve` and `bench serve`; `add_engine_args`/`engine_options` are the CLI's
    shared engine flags, so `kvc serve` takes the same ones as `kvc generate`. Returns the `bench`
    subparsers, where runtime/cli.py adds the offline benchmarks."""
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    add_engine_args(serve)
    serve.add_argument("--methods", metavar="M1,M2,...",
                       help="serve several KV methods at once, each request choosing one (extra_body={\"kvc\": "
                       "{\"method\": ...}}); the first is the default, unless --method names another of them; "
                       "--method-param NAME.KEY=VALUE sets a parameter of method NAME")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append",
                       help="require 'Authorization: Bearer KEY' on /v1; repeat for several keys, each its own "
                       "owner of chains (default: $KVC_API_KEY)")
    serve.add_argument("--api-key-file", help="more API keys, one per line ('#' comments and blank lines skipped)")
    serve.add_argument("--served-model-name",
                       help="the model name clients use (default: --model, or SmolLM2-135M-Instruct for the "
                       "default model)")
    serve.add_argument("--max-waiting-requests", type=int, default=1024,
                       help="waiting sequences before new requests get 503")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    serve.add_argument("--max-request-bytes", type=int, default=4 * 2**20, metavar="N",
                       help="request bodies over N bytes get 413 before they are read (default 4 MiB; 0: no limit)")
    serve.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without an API key when keys are set (the schema and /docs stay behind)")
    serve.add_argument("--allow-extra-fields", action="store_true",
                       help="drop unknown request fields instead of answering 400 naming them")
    serve.add_argument("--auto-chain", action="store_true",
                       help="a chat that extends an idle chain of the same API key continues it, else opens one "
                       "(no client change; docs/serving.md, 'Automatic chains')")
    serve.add_argument("--auto-chain-min-tokens", type=int, default=32, metavar="N",
                       help="--auto-chain: tokens a conversation must share with a chain to continue it (default 32)")
    serve.add_argument("--chain-ttl", type=float, metavar="SECONDS",
                       help="drop chains idle for this long (their pages are freed; default: keep until evicted)")
    serve.add_argument("--max-chains", type=int, metavar="N",
                       help="keep at most N chains: the least recently used idle ones are dropped (default: no bound)")
    serve.add_argument("--auto-prune", metavar="SPEC",
                       help="prune chains after each chat turn, e.g. 'role=tool,older_than=2,keep=0.2' (keys: role "
                       "(a|b), older_than (assistant rounds), keep or keep_tokens, scorer); each message once")
    serve.add_argument("--prune-scorer", metavar="METHOD",
                       help="the method whose token scores rank a chain's tokens when a prune names no scorer "
                       "(default: the served method's own; a method without token scores, such as full, then "
                       "needs one in each prune)")
    serve.set_defaults(func=lambda a: _serve(a, engine_options))

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser("serve", help="load-test an OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    b.add_argument("--base-url", help="default: http://HOST:PORT")
    b.add_argument("--host", default="127.0.0.1")
    b.add_argument("--port", type=int, default=8000)
    b.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    b.add_argument("--model", help="default: the server's first model")
    b.add_argument("--api-key", default=os.environ.get("KVC_API_KEY"))
    b.add_argument("--dataset", default="random", choices=["random", "multi-turn", "agent"])
    b.add_argument("--num-prompts", type=int, default=100,
                   help="requests (random), conversations (multi-turn) or sessions (agent)")
    b.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens (multi-turn: new tokens per turn; agent: the task prompt)")
    b.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    b.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len*(1-r)..len*(1+r)")
    b.add_argument("--num-turns", type=int, default=3, help="multi-turn, agent: turns per conversation")
    b.add_argument("--tool-len-min", type=int, default=2048, help="agent: tool result tokens, at least")
    b.add_argument("--tool-len-max", type=int, default=8192, help="agent: tool result tokens, at most")
    b.add_argument("--chains", action="store_true",
                   help="agent: replay each session on a chain (kvc's chain cache): turn k continues turn k-1's")
    b.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests (or conversations) per second, Poisson arrivals; default inf: all at once")
    b.add_argument("--max-concurrency", type=int, help="requests (agent: sessions) in flight at most")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    b.add_argument("--vocab-size", type=int, help="for random token prompts (default: from /v1/models)")
    b.add_argument("--result-file", help="write the JSON result here")
    b.add_argument("--no-progress", action="store_true")
    b.set_defaults(func=_bench_serve)
    return bench_sub


def _serve(a: argparse.Namespace, engine_options) -> int:
    from kvc.runtime.chains import ChainLimits
    from kvc.runtime.errors import ConfigError
    from kvc.runtime.server.auth import read_key_file
    from kvc.runtime.server.launch import engine_config, parse_method_params, serve

    keys = list(a.api_key or ([os.environ["KVC_API_KEY"]] if os.environ.get("KVC_API_KEY") else []))
    if a.api_key_file:
        keys += read_key_file(a.api_key_file)
    options = engine_options(a)
    if a.auto_prune:
        options["auto_prune"] = a.auto_prune
    if a.prune_scorer:
        options["prune_scorer"] = a.prune_scorer
    if a.max_request_bytes < 0:
        raise ConfigError("--max-request-bytes must be 0 (no limit) or more", param="max_request_bytes")
    if a.auto_chain_min_tokens < 1:
        raise ConfigError("--auto-chain-min-tokens must be at least 1", param="auto_chain_min_tokens")
    ChainLimits(ttl=a.chain_ttl, max_chains=a.max_chains)  # refuses bad limits before the model loads
    method, params = a.method or "full", parse_method_params(a.method_param)
    if a.methods:
        names = [m.strip() for m in a.methods.split(",")]
        if not all(names):
            raise ConfigError(f"--methods takes method names separated by commas, got {a.methods!r}", param="methods")
        method = a.method or names[0]
        if method not in names:
            raise ConfigError(f"--method {method!r} is not one of --methods {a.methods!r}", param="methods")
        options["methods"] = names
        # --method-param NAME.KEY=VALUE: a parameter of method NAME of --methods (a plain KEY: the default's)
        per_method: dict[str, dict] = {}
        for key in [k for k in params if "." in k and k.split(".", 1)[0] in names]:
            name, field = key.split(".", 1)
            per_method.setdefault(name, {})[field] = params.pop(key)
        params = {**params, **per_method.pop(method, {})}
        options["methods_params"] = per_method
    cfg = engine_config(a.model, method, params, options)
    return serve(cfg, host=a.host, port=a.port, served_model_name=a.served_model_name, api_keys=keys,
                 max_waiting=a.max_waiting_requests, shutdown_timeout=a.shutdown_timeout,
                 max_request_bytes=a.max_request_bytes or None, public_metrics=a.public_metrics,
                 allow_extra_fields=a.allow_extra_fields,
                 auto_chain_min_tokens=a.auto_chain_min_tokens if a.auto_chain else None,
                 chain_ttl=a.chain_ttl, max_chains=a.max_chains)


def _bench_serve(a: argparse.Namespace) -> int:
    import asyncio

    from kvc.runtime.errors import KvcError
    from kvc.runtime.server.bench import BenchConfig, format_table, run_benchmark

    if a.num_prompts < 1 or a.input_len < 1 or a.output_len < 1 or a.num_turns < 1:
        raise KvcError("--num-prompts, --input-len, --output-len and --num-turns must be at least 1")
    if not 0 <= a.range_ratio < 1:
        raise KvcError("--range-ratio must be in [0, 1)")
    if not 1 <= a.tool_len_min <= a.tool_len_max:
        raise KvcError("--tool-len-min must be at least 1 and at most --tool-len-max")
    if a.chains and a.dataset != "agent":
        raise KvcError("--chains replays the agent dataset on chains; add --dataset agent")
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise KvcError("--max-concurrency must be at least 1")
    cfg = BenchConfig(
        base_url=a.base_url or f"http://{a.host}:{a.port}", endpoint=a.endpoint, model=a.model,
        api_key=a.api_key, dataset=a.dataset, num_prompts=a.num_prompts, input_len=a.input_len,
        output_len=a.output_len, range_ratio=a.range_ratio, num_turns=a.num_turns,
        tool_len_min=a.tool_len_min, tool_len_max=a.tool_len_max, chains=a.chains,
        request_rate=a.request_rate, max_concurrency=a.max_concurrency, seed=a.seed,
        ignore_eos=not a.no_ignore_eos, vocab_size=a.vocab_size,
        progress=not a.no_progress and sys.stderr.isatty(),
    )
    try:
        result = asyncio.run(run_benchmark(cfg))
    except Exception as e:  # unreachable server, failed test request: a message, not a traceback
        raise KvcError(f"bench serve: {type(e).__name__}: {e}") from None
    print(format_table(result))
    if a.result_file:
        with open(a.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] else 1
