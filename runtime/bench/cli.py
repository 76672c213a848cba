"""The `kvc bench throughput`, `kvc bench plot` and `kvc bench suite` subcommands (added under `kvc bench`
by runtime/cli.py). The engine is imported when a command runs, not when `kvc` parses."""

from __future__ import annotations

import argparse
import json
import re
import sys

from kvc.runtime.cli import ASYNC_SCHEDULING_CHOICES, add_evict_interval, add_method_inputs, add_prefill_forms
from kvc.runtime.errors import ConfigError, KvcError



def add_commands(bench_sub) -> None:
    t = bench_sub.add_parser("throughput", help="decode tokens/s per method at the largest batch a fixed KV "
                             "memory holds (offline; decode window over cloned post-prefill state)")
    t.add_argument("--model", help="local Hugging Face directory or random:NAME (default: the embedded tiny model)")
    t.add_argument("--methods", default=None,
                   help="comma-separated (default: every shipped method the engine runs)")
    t.add_argument("--method-params", action="append", metavar="METHOD:KEY=VALUE[,KEY=VALUE]",
                   help="override a method's parameters (repeatable), e.g. snapkv:budget=2048,window=32")
    t.add_argument("--budget", type=int, default=2048,
                   help="tokens per KV head and layer every method keeps by default (default 2048)")
    t.add_argument("--inputs", default="32768,131072", help="comma-separated input lengths (default 32768,131072)")
    t.add_argument("--output", type=int, default=2048, help="output tokens each request is sized for (default 2048)")
    t.add_argument("--kv-memory", required=True, help="KV page pool for every method, e.g. 60GiB")
    t.add_argument("--steps", type=int, default=32, help="timed decode steps (default 32)")
    t.add_argument("--warmup", type=int, default=4, help="decode steps before timing (default 4)")
    t.add_argument("--max-batch", type=int, default=1024, help="cap on the batch (default 1024)")
    t.add_argument("--decode-offset", type=int, default=0,
                   help="tokens the single request decodes before it is cloned (default 0: right after prefill)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    t.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    t.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page (default: each method's own, else 16)")
    t.add_argument("--max-num-batched-tokens", type=int, default=8192, help="prefill tokens per step")
    t.add_argument("--max-prefill-chunk", type=int, help="one request's prefill tokens per step")
    t.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    t.add_argument("--no-cuda-graphs", action="store_true")
    t.add_argument("--async-scheduling", choices=tuple(ASYNC_SCHEDULING_CHOICES), default="auto",
                   help="schedule each decode step while the one before runs (auto: on a GPU)")
    add_evict_interval(t)  # the plan sizes the batch by the peak it implies
    add_prefill_forms(t)
    add_method_inputs(t)
    t.add_argument("--temperature", type=float, default=1.0, help="decode sampling temperature (default 1: rows "
                   "stay distinct requests, so MoE layers route like real traffic; 0: greedy)")
    t.add_argument("--sources", type=int, default=4, help="real requests prefilled for the decode window; "
                   "each clone takes every layer's KV from a random one (distinct contexts: MoE routing as "
                   "for independent requests; default 4)")
    t.add_argument("--e2e", action="store_true", help="also prefill the batch's real prompts end to end and "
                   "compare its decode step time with the decode window's")
    t.add_argument("--e2e-batch", type=int, help="batch of the --e2e run (default: the largest batch)")
    t.add_argument("--busy", action="store_true", help="profile a decode window of every row (and the --e2e "
                   "row's): GPU busy fraction, host gap per step, top kernels by GPU time (slow)")
    t.add_argument("--busy-batch", type=int, default=64, help="batch of the --busy windows (default 64; a larger "
                   "value profiles the whole batch)")
    t.add_argument("--busy-prefill", action="store_true", help="profile the second source's prefill (needs "
                   "--sources >= 2): GPU time per kernel of one prefill (`prefill_busy`)")
    t.add_argument("--requests", type=int, default=0, help="also run this many requests end to end per method and "
                   "input, prefill included, as `vllm bench throughput` does: output tok/s, requests/s, TTFT")
    t.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per engine (one GPU each); "
                   "--kv-memory is each rank's, and the plan counts one rank's heads")
    t.add_argument("--expert-parallel", action="store_true", help="with --tensor-parallel-size: MoE layers split "
                   "by whole experts rather than by every expert's columns")
    t.add_argument("--mix", action="store_true", help="also run every method together in one engine and one "
                   "batch (an equal share of rows each) at the batch all of them hold, every method's own window "
                   "at that batch too: the mixed step time over the slowest one's (`vs_slowest`)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", help="write the JSON result here")
    t.add_argument("--plot", help="also render the PNG here (needs matplotlib)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=_throughput)

    p = bench_sub.add_parser("plot", help="render a `bench throughput` JSON result as a PNG bar chart")
    p.add_argument("result", help="the JSON written by `kvc bench throughput --out`")
    p.add_argument("-o", "--out", help="the PNG (default: the result's path with .png)")
    p.set_defaults(func=_plot)

    s = bench_sub.add_parser("suite", help="run a benchmark suite (bench/suites/*.toml: the runs behind published "
                             "tables of docs/benchmarks.md) into a dated result folder")
    s.add_argument("file", help="the suite's TOML file")
    s.add_argument("--out", help="the result folder (default: bench/results/<suite>/<YYYY-MM-DD>-<commit>)")
    s.add_argument("--only", metavar="RUN[,RUN...]", help="run these runs only (default: every run)")
    s.add_argument("--force", action="store_true", help="run again the runs the folder's suite.json records as done "
                   "(default: skip them, so a suite resumes where the last call stopped)")
    s.add_argument("--list", action="store_true", help="print the runs and their commands; run nothing")
    s.set_defaults(func=_suite)


def _csv(text: str, what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise ConfigError(f"--{what} is empty", param=what)
    return items


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(item) for item in _csv(text, what)]
    except ValueError:
        raise ConfigError(f"--{what} takes comma-separated integers, got {text!r}", param=what) from None


def parse_method_params(items: list[str] | None) -> dict[str, dict]:
    """["snapkv:budget=2048,window=32", "h2o:heavy=0.05"] -> {"snapkv": {...}, "h2o": {...}}."""
    from kvc.runtime.server.launch import parse_method_params as parse_pairs

    out: dict[str, dict] = {}
    for item in items or []:
        method, colon, pairs = item.partition(":")
        if not colon or not method.strip():
            raise ConfigError(f"--method-params takes METHOD:KEY=VALUE[,KEY=VALUE], got {item!r}",
                              param="method_params")
        # commas separate pairs, except inside a bracketed list value (filters=[8,18])
        items = [item.strip() for item in re.split(r",(?![^\[]*\])", pairs) if item.strip()]
        if not items:
            raise ConfigError("--method-params is empty", param="method-params")
        out.setdefault(method.strip(), {}).update(parse_pairs(items))
    return out


def _throughput(a: argparse.Namespace) -> int:
    from kvc.runtime.bench.plan import parse_bytes
    from kvc.runtime.bench.result import format_offline, format_profiles, format_table
    from kvc.runtime.bench.throughput import ThroughputConfig, run

    cfg = ThroughputConfig(
        methods=_csv(a.methods, "methods") if a.methods is not None else _served(),
        inputs=_ints(a.inputs, "inputs"), kv_memory=parse_bytes(a.kv_memory),
        model=a.model, output_len=a.output, budget=a.budget, method_params=parse_method_params(a.method_params),
        steps=a.steps, warmup=a.warmup, max_batch=a.max_batch, decode_offset=a.decode_offset, device=a.device,
        dtype=a.dtype, page_size=a.page_size, max_num_batched_tokens=a.max_num_batched_tokens,
        max_prefill_chunk=a.max_prefill_chunk, attention_backend=a.attention_backend,
        cuda_graphs=not a.no_cuda_graphs,
        async_scheduling=ASYNC_SCHEDULING_CHOICES[a.async_scheduling], evict_interval=a.evict_interval,
        decode_rings=not a.no_decode_rings, mla_prefill=a.mla_prefill, prefill_attention=a.prefill_attention,
        method_inputs=a.method_inputs,
        temperature=a.temperature, sources=a.sources, e2e=a.e2e, e2e_batch=a.e2e_batch, busy=a.busy,
        busy_batch=a.busy_batch, busy_prefill=a.busy_prefill, requests=a.requests, mix=a.mix,
        tensor_parallel_size=a.tensor_parallel_size, expert_parallel=a.expert_parallel, seed=a.seed)
    if a.plot:
        from kvc.runtime.bench.plot import _pyplot

        _pyplot()  # missing matplotlib: say so now, not after the run

    def show(row: dict) -> None:
        if "error" in row:
            print(f"{row['method']} @ {row['input_len']}: {row['error']}", file=sys.stderr, flush=True)
        elif row["mode"] == "offline":
            print(f"{row['method']} @ {row['input_len']} (offline, {row['requests']} requests): "
                  f"{row['output_tok_s']:.1f} output tok/s, {row['wall_s']:.1f} s, TTFT {row['ttft_s']:.2f} s",
                  file=sys.stderr, flush=True)
        else:
            checks = "".join([
                f", {row['window_step_ratio']:.2f}x the window's step" if row.get("window_step_ratio") else "",
                f", busy {row['busy']:.3f} @{row['busy_batch']}" if row.get("busy") is not None else "",
                _slow(row.get("slow_steps"))])
            print(f"{row['method']} @ {row['input_len']} ({row['mode']}): batch {row['batch']}, "
                  f"{row['decode_tok_s']:.1f} tok/s, step {row['step_ms']:.2f} ms{checks}, phases "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row.get("phases", {}).items()), file=sys.stderr, flush=True)

    partial = (lambda result: _write(a.out, result)) if a.out else None  # rows so far, after every case
    result = run(cfg, progress=not a.no_progress and sys.stderr.isatty(), on_row=show, on_partial=partial)
    print(format_table(result))
    offline = format_offline(result)
    if offline:
        print("\n" + offline)
    profiles = format_profiles(result)
    if profiles:
        print("\n" + profiles)
    if a.out:
        _write(a.out, result)
    if a.plot:
        from kvc.runtime.bench.plot import render

        render(result, a.plot)
    return 0 if all("error" not in r for r in result["rows"]) else 1


def _write(path: str, result: dict) -> None:
    try:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    except OSError as e:
        raise KvcError(f"cannot write {path}: {e.strerror or e}") from None


def _plot(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvc.runtime.bench.plot import load_result, render

    out = a.out or str(Path(a.result).with_suffix(".png"))
    print(render(load_result(a.result), out))
    return 0


def _slow(split: dict | None) -> str:
    """The window's slow steps (a decode keep's evicting steps) for the row's line, or nothing."""
    if not split or not split.get("slow"):
        return ""
    return (f", median step {split['median_ms']:.2f} ms, {split['slow']} slow "
            f"(+{split['slow_extra_ms']:.1f} ms in all)")


def _suite(a: argparse.Namespace) -> int:
    from kvc.runtime.bench.suite import command

    try:
        return command(a.file, out=a.out, only=a.only, force=a.force, list_only=a.list)
    except ConfigError as e:  # the suite file or the arguments: nothing ran
        print(f"kvc: error: {e.message}", file=sys.stderr)
        return 2


def _served() -> list[str]:
    from kvc.runtime.compiled.folder import served

    return served()
