"""`kvc bench throughput`: decode tokens/s of each method at the largest batch a fixed KV memory holds.

Per (method, input length), one engine (freed before the next) whose pool is `--kv-memory` bytes,
the same for every method, and whose seats and CUDA-graph buckets end at the planned batch
(`plan.py`: the pool over one sequence's steady-state pages with input + the whole output
stored):

1. warm-up: one short request end to end (compiles the kernels, so no timing below includes JIT);
2. prefill: ONE real request of the input length -> `prefill_s` (the engine steps that prefilled
   it, synchronised) and `ttft_s` (add_request to its first token on the host);
3. decode window (`"mode": "decode_window"`): the request, in its method's real post-prefill
   state, is cloned into batch - 1 more sequences (`Engine.clone_sequence`: each clone owns a copy
   of its pages, bookkeeping and method state), then `warmup` steps and `steps` timed steps
   (synchronised wall time around `Engine.step`, scheduling and sampling included):
   `decode_tok_s = batch * steps / time`, `step_ms = time / steps`. Every timed step decodes the
   whole batch (checked: no preemption, every sequence advanced by one token per step);
4. `--busy`: the batch is cut to `--busy-batch` (64) sequences and a profiled window gives the GPU
   busy fraction (`busy.py`);
5. `--e2e`: a second engine prefills `batch` real prompts end to end, then times the same decode
   window (`"mode": "e2e"`, with `window_step_ratio` = its step time over the decode window's).

Prefilling hundreds of long prompts does not fit a short GPU call; the decode window is the
shortcut, and the e2e row is its check (the acceptance: within 10% at 32K, batch >= 64).
The decode window starts right after prefill (`--decode-offset N` lets the single request decode
N tokens before cloning, to measure later in the output). Phases are timed (`phases` per row).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from kvc.runtime.bench.plan import (
    BatchPlan,
    declared_parameters,
    equal_budget_params,
    model_for_context,
    model_spec,
    plan_batch,
)
from kvc.runtime.config import EngineConfig
from kvc.runtime.errors import ConfigError, OutOfKVMemory
from kvc.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)

WARMUP_PROMPT_EXTRA = 256  # the warm-up prompt: budget * 2 + this (so methods compact), capped by the input


@dataclass
class ThroughputConfig:
    methods: list[str]
    inputs: list[int]
    kv_memory: int  # bytes of the KV page pool, the same for every method
    model: str | None = None  # None: the embedded default model
    output_len: int = 2048
    budget: int = 2048  # tokens per KV head and layer every method keeps (plan.equal_budget_params)
    method_params: dict[str, dict] = field(default_factory=dict)  # per method: overrides
    steps: int = 32
    warmup: int = 4
    max_batch: int = 1024
    decode_offset: int = 0
    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int | None = None
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    e2e: bool = False
    e2e_batch: int | None = None  # None: the planned (largest) batch
    busy: bool = False
    busy_batch: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("output_len", "budget", "steps", "max_batch", "page_size", "busy_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
        if self.warmup < 1 or self.decode_offset < 0:
            raise ConfigError("warmup must be at least 1 (it captures the decode graph) and decode_offset at "
                              "least 0", param="warmup")
        if not self.methods or not self.inputs or any(n < 2 for n in self.inputs):
            raise ConfigError("give at least one method and input lengths of at least 2 tokens", param="inputs")
        if self.decode_offset + self.warmup + self.steps >= self.output_len:
            raise ConfigError(f"decode_offset + warmup + steps ({self.decode_offset + self.warmup + self.steps}) must "
                              f"stay below the output length ({self.output_len}): sequences must not finish "
                              "inside the window", param="steps")
        unknown = set(self.method_params) - set(self.methods)
        if unknown:
            raise ConfigError(f"--method-params names method(s) not in --methods: {', '.join(sorted(unknown))}",
                              param="method_params")


class _Clock:
    """Synchronised wall time on the engine's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def _engine(cfg: ThroughputConfig, model: str, method, params: dict, input_len: int, seats: int):
    from kvc.runtime.engine import Engine

    config = EngineConfig(
        model=model, method=method.name, method_params=params or None, device=cfg.device, dtype=cfg.dtype,
        page_size=cfg.page_size, kv_cache_memory=cfg.kv_memory, max_num_seqs=seats,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_prefill_chunk=cfg.max_prefill_chunk,
        max_model_len=input_len + cfg.output_len + 1, enable_prefix_caching=False,
        attention_backend=cfg.attention_backend, cuda_graphs=cfg.cuda_graphs, seed=cfg.seed)
    return Engine(config, method=method)


def _abort_all(engine) -> None:
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)


def _collect() -> None:
    """Frees the device memory of an engine nothing references any more (one engine at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _until(engine, done: Callable[[], bool], clock: _Clock, limit: int) -> float:
    """Steps the engine until `done()`; the synchronised time of those steps."""
    total, steps = 0.0, 0
    while not done():
        if steps >= limit:
            raise RuntimeError(f"the engine did not get there in {limit} steps")
        total += clock.time(engine.step)
        steps += 1
    return total


def _window(engine, seqs: list, steps: int, clock: _Clock) -> float:
    """Seconds of `steps` engine steps, each decoding every one of `seqs` (checked)."""
    before = [s.num_generated for s in seqs]
    preemptions = engine.scheduler.num_preemptions
    seconds = clock.time(lambda: [engine.step() for _ in range(steps)])
    advanced = {s.num_generated - b for s, b in zip(seqs, before)}
    if engine.scheduler.num_preemptions != preemptions or advanced != {steps} or engine.scheduler.num_waiting:
        raise RuntimeError(f"the decode window did not decode all {len(seqs)} sequences at every step "
                           f"(advanced {sorted(advanced)} tokens, {engine.scheduler.num_preemptions - preemptions} "
                           "preemptions); the planned batch does not hold")
    return seconds


def _warm_up(engine, cfg: ThroughputConfig, input_len: int) -> None:
    n = min(input_len, 2 * cfg.budget + WARMUP_PROMPT_EXTRA)
    seq = engine.add_request(_prompt(engine.spec.vocab_size, n, cfg.seed + 1),
                             SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while not seq.is_finished:
        engine.step()


@dataclass
class Case:
    """One (method, input length), resolved and planned before any engine is built."""

    method: str  # as given
    input_len: int
    params: dict  # what the method was resolved with (equal-budget defaults + overrides)
    resolved: dict  # every parameter's value (the .kvm defaults filled in)
    model: str  # the model reference (context lengthened when needed)
    plan: BatchPlan


def prepare(cfg: ThroughputConfig, model: str) -> list[Case]:
    """Resolves every method at every input and plans its batch; raises the user's errors (unknown
    method, bad parameters, a model too short) before anything is measured."""
    from kvc.runtime.methods import resolve_method

    device = EngineConfig(device=cfg.device).resolve_device()
    spec = model_spec(model, device, cfg.dtype)
    cases = []
    for input_len in cfg.inputs:
        ref = model_for_context(model, input_len + cfg.output_len + 1, spec)
        for name in cfg.methods:
            params = {**equal_budget_params(declared_parameters(name), input_len, cfg.budget),
                      **cfg.method_params.get(name, {})}
            try:
                method = resolve_method(name, params or None)
            except ConfigError as e:
                raise ConfigError(f"{name} at {input_len} input tokens with {params}: {e.message}",
                                  param=e.param) from None
            plan = plan_batch(method, spec, cfg.kv_memory, cfg.page_size, input_len, cfg.output_len, cfg.max_batch)
            cases.append(Case(name, input_len, params, dict(getattr(method, "params", params)), ref, plan))
    return cases


def measure(cfg: ThroughputConfig, case: Case) -> list[dict]:
    """The rows of one case: its decode window, and its e2e run when asked."""
    from kvc.runtime.methods import resolve_method

    phases: dict[str, float] = {}
    start = time.perf_counter()
    plan = case.plan
    row = {"method": case.method, "params": case.resolved, "input_len": case.input_len,
           "output_len": cfg.output_len, "mode": "decode_window", "batch": plan.batch,
           "pages_per_seq": plan.pages_per_seq, "plan": plan.to_json()}
    if plan.batch == 0:
        row["error"] = (f"one request of {case.input_len} + {cfg.output_len} tokens needs {plan.prefill_pages} "
                        f"pages, the pool has {plan.num_pages}")
        return [row]
    method = resolve_method(case.method, case.params or None)
    engine = _engine(cfg, case.model, method, case.params, case.input_len, plan.batch)
    try:
        _check_plan(engine, plan)
        clock = _Clock(engine.device)
        phases["load_s"] = time.perf_counter() - start
        phases["warmup_s"] = clock.time(partial(_warm_up, engine, cfg, case.input_len))
        row.update(_decode_window(engine, cfg, case.input_len, plan.batch, clock, phases))
    finally:
        _abort_all(engine)
        del engine
        _collect()
    row["phases"] = phases
    rows = [row]
    if cfg.e2e:
        rows.append(_e2e(cfg, case, row))
    return rows


def _check_plan(engine, plan: BatchPlan) -> None:
    if engine.num_pages != plan.num_pages:
        raise RuntimeError(f"the engine allocated {engine.num_pages} KV pages, the plan counted {plan.num_pages}")


def _decode_window(engine, cfg: ThroughputConfig, input_len: int, batch: int, clock: _Clock,
                   phases: dict) -> dict:
    params = SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
    prompt = _prompt(engine.spec.vocab_size, input_len, cfg.seed)
    clock.sync()
    t0 = time.perf_counter()
    seq = engine.add_request(prompt, params)
    prefill_s = _until(engine, lambda: seq.num_generated >= 1, clock, limit=input_len + 1)
    ttft_s = time.perf_counter() - t0
    phases["prefill_s"] = ttft_s
    if cfg.decode_offset:
        phases["offset_s"] = _until(engine, lambda: seq.num_generated >= 1 + cfg.decode_offset, clock,
                                    limit=cfg.decode_offset)
    kv_tokens = sum(seq.kv_lens) / len(seq.kv_lens)
    clock.sync()
    t0 = time.perf_counter()
    clones = engine.clone_sequence(seq, batch - 1)
    _diverge(clones, engine.spec.vocab_size, cfg.seed)
    seqs = [seq, *clones]
    clock.sync()
    phases["clone_s"] = time.perf_counter() - t0
    phases["warmup_steps_s"] = _window(engine, seqs, cfg.warmup, clock)
    seconds = _window(engine, seqs, cfg.steps, clock)
    phases["window_s"] = seconds
    out = {"decode_tok_s": batch * cfg.steps / seconds, "step_ms": 1e3 * seconds / cfg.steps,
           "prefill_s": prefill_s, "ttft_s": ttft_s, "kv_tokens_at_window": kv_tokens, "busy": None}
    if cfg.busy:
        out.update(_busy(engine, cfg, seqs, clock, phases))
    return out


def _diverge(clones: list, vocab: int, seed: int) -> None:
    """Each clone feeds a different next token (its last, not yet computed one), so from the first
    window step on the batch's rows are distinct requests: identical rows would all route to the
    same experts of an MoE layer and make the window far cheaper than real traffic."""
    g = torch.Generator().manual_seed(seed + 7)
    for clone, token in zip(clones, torch.randint(0, vocab, (len(clones),), generator=g).tolist()):
        clone.token_ids[-1] = token


def _busy(engine, cfg: ThroughputConfig, seqs: list, clock: _Clock, phases: dict) -> dict:
    """The GPU busy fraction of a profiled window at `busy_batch` sequences (fewer when the batch
    is smaller); None off CUDA."""
    if engine.device.type != "cuda":
        return {"busy": None, "busy_note": "needs a CUDA device"}
    from kvc.runtime.bench.busy import profile_busy

    keep = min(cfg.busy_batch, len(seqs))
    for seq in seqs[keep:]:
        engine.abort(seq.seq_id)
    seqs = seqs[:keep]
    t0 = time.perf_counter()
    _window(engine, seqs, 2, clock)  # the bucket's graph, captured outside the profile
    result = profile_busy(lambda: _window(engine, seqs, min(cfg.steps, 16), clock), engine.device)
    phases["busy_s"] = time.perf_counter() - t0
    return {"busy": result["busy"], "busy_batch": keep, "busy_profile": result}


def _e2e(cfg: ThroughputConfig, case: Case, window_row: dict) -> dict:
    """`batch` real prompts prefilled end to end, then the same decode window."""
    from kvc.runtime.methods import resolve_method

    plan, input_len = case.plan, case.input_len
    batch = min(cfg.e2e_batch or plan.batch, plan.batch)
    row = {"method": window_row["method"], "params": window_row["params"], "input_len": input_len,
           "output_len": cfg.output_len, "mode": "e2e", "batch": batch, "pages_per_seq": plan.pages_per_seq}
    phases: dict[str, float] = {}
    start = time.perf_counter()
    engine = _engine(cfg, case.model, resolve_method(case.method, case.params or None), case.params, input_len, batch)
    try:
        clock = _Clock(engine.device)
        phases["load_s"] = time.perf_counter() - start
        phases["warmup_s"] = clock.time(partial(_warm_up, engine, cfg, input_len))
        sampling = SamplingParams(max_tokens=cfg.output_len, temperature=0.0, ignore_eos=True)
        clock.sync()
        t0 = time.perf_counter()
        seqs = [engine.add_request(_prompt(engine.spec.vocab_size, input_len, cfg.seed + 2 + i), sampling)
                for i in range(batch)]
        first: dict[int, float] = {}

        def all_started() -> bool:
            now = time.perf_counter()
            for s in seqs:
                if s.num_generated >= 1 and s.seq_id not in first:
                    first[s.seq_id] = now - t0
            return len(first) == len(seqs)

        row["prefill_s"] = _until(engine, all_started, clock, limit=batch * (input_len + 1))
        phases["prefill_s"] = time.perf_counter() - t0
        row["ttft_s"] = sum(first.values()) / len(first)
        row["ttft_max_s"] = max(first.values())
        left = min(cfg.output_len - s.num_generated for s in seqs)
        if left <= cfg.warmup + cfg.steps:
            raise RuntimeError(f"the first requests generated all but {left} of their {cfg.output_len} tokens while "
                               "the others prefilled; lower --e2e-batch or raise --output")
        phases["warmup_steps_s"] = _window(engine, seqs, cfg.warmup, clock)
        seconds = _window(engine, seqs, cfg.steps, clock)
        phases["window_s"] = seconds
    finally:
        _abort_all(engine)
        del engine
        _collect()
    row.update({"decode_tok_s": batch * cfg.steps / seconds, "step_ms": 1e3 * seconds / cfg.steps, "busy": None,
                "phases": phases})
    if batch == window_row.get("batch") and window_row.get("step_ms"):
        row["window_step_ratio"] = row["step_ms"] / window_row["step_ms"]
    return row


def ratios(rows: list[dict], baseline: str = "full") -> dict[str, dict[str, dict]]:
    """Per input length, per method: decode tok/s and batch over the baseline's (decode windows)."""
    windows = [r for r in rows if r["mode"] == "decode_window" and r.get("decode_tok_s")]
    base = {r["input_len"]: r for r in windows if r["method"] == baseline}
    out: dict[str, dict[str, dict]] = {}
    for r in windows:
        b = base.get(r["input_len"])
        if b is None:
            continue
        out.setdefault(str(r["input_len"]), {})[r["method"]] = {
            "decode_tok_s": r["decode_tok_s"] / b["decode_tok_s"], "batch": r["batch"] / b["batch"]}
    return out


def run(cfg: ThroughputConfig, progress: bool = False, on_row: Callable[[dict], None] | None = None) -> dict:
    """Every (method, input) of `cfg`; the result object (`result.header` + rows + ratios)."""
    from kvc.runtime.bench.result import header

    model = cfg.model
    if model is None:
        from kvc.runtime.default_model import ensure_default_model

        model = str(ensure_default_model())
    result = header(cfg, model)
    cases = prepare(cfg, model)
    for case in cases:
        log.info("plan: %s at %d input tokens: batch %d (%d pages of %d per sequence)", case.method, case.input_len,
                 case.plan.batch, case.plan.pages_per_seq, case.plan.num_pages)
    rows: list[dict] = []
    bar = _progress(progress, len(cases))
    try:
        for case in cases:
            if bar is not None:
                bar.update(bar.task_ids[0], description=f"{case.method} @ {case.input_len}")
            try:
                new = measure(cfg, case)
            except (RuntimeError, OutOfKVMemory) as e:  # out of device memory, a batch that did not hold: a row
                log.exception("bench throughput: %s at %d input tokens failed", case.method, case.input_len)
                what = "out of device memory" if isinstance(e, torch.cuda.OutOfMemoryError) else "failed"
                new = [{"method": case.method, "params": case.resolved, "input_len": case.input_len,
                        "output_len": cfg.output_len, "mode": "decode_window", "batch": case.plan.batch,
                        "pages_per_seq": case.plan.pages_per_seq, "error": f"{what}: {e}"}]
                _collect()
            rows += new
            for row in new:
                if on_row is not None:
                    on_row(row)
            if bar is not None:
                bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    result["rows"] = rows
    result["ratios_vs_full"] = ratios(rows)
    return result


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.progress import Progress

    bar = Progress(transient=False)
    bar.add_task("bench throughput", total=total)
    bar.start()
    return bar
