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
   (synchronised wall time around `Engine.step`, scheduling and sampling included; a method that keeps
   tokens at decode first steps on until that keep has run over the batch once, `through_decode_keep`, so its
   first run's set-up is not timed):
   `decode_tok_s = batch * steps / time`, `step_ms = time / steps`. Every timed step decodes the
   whole batch (checked: no preemption, every sequence advanced by one token per step). On a GPU,
   `vs_floor`: the step over its memory floor, the bytes it must read over the copy bandwidth
   measured at the run's start (`floor`; floor.py);
4. then the batch is cut down (`e2e.after_window`): with `--e2e`, to the e2e batch, timed again
   (`step_ms_at_e2e_batch`); with `--busy`, to `--busy-batch` (64) sequences for a profiled window
   (`busy`, `busy_profile`: busy fraction, host gap per step, GPU time per kernel; `busy.py`);
   `--busy-prefill` profiles the second source's prefill the same way (`prefill_busy`: where one
   prefill's GPU time goes, kernel by kernel);
5. `--e2e`: a second engine prefills `batch` real prompts end to end, then times the same decode
   window (`"mode": "e2e"`, `window_step_ratio` = its step time over the decode window's at the
   same batch), profiled too with `--busy` (`e2e.py`);
6. `--requests N`: N requests run end to end by one more engine, prefill included, as `vllm bench
   throughput` measures (`"mode": "offline"`: output tok/s, requests/s and TTFT over the whole run;
   `offline.py`);
7. `--mix`: every method's window at the batch all of them hold, then all of them in one engine
   and one batch, an equal share each (`"mode": "mixed_window"`, `vs_slowest`; `mixed.py`).

Prefilling hundreds of long prompts does not fit a short GPU call; the decode window is the
shortcut, and the e2e row is its check (the acceptance: within 10% at 32K, batch >= 64).
The decode window starts right after prefill (`--decode-offset N` lets the single request decode
N tokens before cloning, to measure later in the output). Phases are timed (`phases` per row).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from kvc.runtime.bench.bandwidth import copy_gbps
from kvc.runtime.bench.e2e import after_window, e2e_row, profile_prefill, profiling_supported, steps_after_prefill
from kvc.runtime.bench.floor import kv_bytes, step_floor
from kvc.runtime.bench.mixed import cap_batches, mixed_row
from kvc.runtime.bench.offline import offline_row
from kvc.runtime.bench.plan import (
    BatchPlan,
    rank_spec,
    declared_family,
    declared_parameters,
    equal_budget_params,
    model_for_context,
    model_spec,
    plan_batch,
)
from kvc.runtime.bench.sources import mix_layers, prefill_sources
from kvc.runtime.bench.steps import (
    WARMUP_DECODE,
    Clock,
    collect,
    first_tokens,
    make_engine,
    prompt,
    retire,
    slow_steps,
    through_decode_keep,
    until,
    warm_up,
    window,
)
from kvc.runtime.config import DEFAULT_PAGE_SIZE, EngineConfig
from kvc.runtime.errors import ConfigError, OutOfKVMemory
from kvc.runtime.models.loader import model_directory
from kvc.runtime.sampling_params import SamplingParams

log = logging.getLogger(__name__)


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
    page_size: int | None = None  # None: each method's own (`page_tokens`), else the engine's default
    max_num_batched_tokens: int = 8192
    max_prefill_chunk: int | None = None
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    async_scheduling: bool | None = None  # None: the engine's default (on for a GPU)
    evict_interval: int = 1  # EngineConfig.evict_interval; the plan counts its peak
    decode_rings: bool = True  # EngineConfig.decode_rings (a window keep rings: runtime/kv/ring.py)
    mla_prefill: str = "auto"  # EngineConfig.mla_prefill (an MLA model's prefill form)
    prefill_attention: str = "auto"  # EngineConfig.prefill_attention (dense layers' prefill: kernel or sdpa)
    method_inputs: str | None = None  # EngineConfig.method_inputs (None: the model's directory)
    temperature: float = 1.0  # decode sampling (window and e2e); 0: greedy
    sources: int = 4  # real requests the decode window's clones mix their layers from (sources.py)
    e2e: bool = False
    e2e_batch: int | None = None  # None: the planned (largest) batch
    busy: bool = False
    busy_batch: int = 64
    busy_prefill: bool = False  # profile one source's prefill (`prefill_busy`); needs sources >= 2
    requests: int = 0  # > 0: also run that many requests end to end per case (offline.py)
    mix: bool = False  # also every method together in one batch, at the batch all of them hold (mixed.py)
    tensor_parallel_size: int = 1  # ranks per engine (runtime/distributed/); `kv_memory` is each rank's
    expert_parallel: bool = False  # with tensor_parallel_size > 1: MoE layers split by whole experts
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("output_len", "budget", "steps", "max_batch", "page_size", "busy_batch", "sources",
                     "evict_interval"):
            value = getattr(self, name)
            if name == "page_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0 <= self.temperature <= 100:
            raise ConfigError(f"temperature must be a number in [0, 100], got {self.temperature!r}",
                              param="temperature")
        if self.warmup < 1 or self.decode_offset < 0:
            raise ConfigError("warmup must be at least 1 (it captures the decode graph) and decode_offset at "
                              "least 0", param="warmup")
        if not self.methods or not self.inputs or any(n < 2 for n in self.inputs):
            raise ConfigError("give at least one method and input lengths of at least 2 tokens", param="inputs")
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) or self.requests < 0:
            raise ConfigError(f"requests must be a whole number >= 0, got {self.requests!r}", param="requests")
        if self.e2e_batch is not None and (isinstance(self.e2e_batch, bool) or not isinstance(self.e2e_batch, int)
                                           or self.e2e_batch < 1):
            raise ConfigError(f"e2e_batch must be a positive integer, got {self.e2e_batch!r}", param="e2e_batch")
        needed = steps_after_prefill(self, "decode_window")
        if needed >= self.output_len:
            raise ConfigError(f"the decode window's steps after prefill ({needed}: decode_offset, warmup + steps, "
                              "again at the e2e batch with --e2e, the profile's with --busy) must stay below the "
                              f"output length ({self.output_len}): sequences must not finish inside the window",
                              param="steps")
        if self.busy_prefill and self.sources < 2:
            raise ConfigError("busy_prefill profiles the second source's prefill: give sources >= 2",
                              param="busy_prefill")
        unknown = set(self.method_params) - set(self.methods)
        if unknown:
            raise ConfigError(f"--method-params names method(s) not in --methods: {', '.join(sorted(unknown))}",
                              param="method_params")


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
    spec = rank_spec(model_spec(model, device, cfg.dtype), cfg.tensor_parallel_size)
    inputs_dir = Path(cfg.method_inputs) if cfg.method_inputs is not None else model_directory(model)
    cases = []
    for input_len in cfg.inputs:
        ref = model_for_context(model, input_len + cfg.output_len + 1, spec)
        for name in cfg.methods:
            params = {**equal_budget_params(declared_parameters(name), input_len, cfg.budget, declared_family(name)),
                      **cfg.method_params.get(name, {})}
            try:
                method = resolve_method(name, params or None)
            except ConfigError as e:
                raise ConfigError(f"{name} at {input_len} input tokens with {params}: {e.message}",
                                  param=e.param) from None
            page = cfg.page_size or method.page_tokens() or DEFAULT_PAGE_SIZE  # what its engine will take
            plan = plan_batch(method, spec, cfg.kv_memory, page, input_len, cfg.output_len, cfg.max_batch,
                              cfg.evict_interval, inputs_dir)
            cases.append(Case(name, input_len, params, dict(method.params), ref, plan))
    return cases


def measure(cfg: ThroughputConfig, case: Case, copy_gbps: float | None = None) -> list[dict]:
    """The rows of one case: its decode window (with its memory floor against `copy_gbps`, on a GPU), and its
    e2e run when asked."""
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
    engine = make_engine(cfg, case.model, method, case.params, case.input_len, plan.batch)
    try:
        _check_plan(engine, plan)
        clock = Clock(engine.device)
        phases["load_s"] = time.perf_counter() - start
        phases["warmup_s"] = clock.time(partial(warm_up, engine, cfg, case.input_len))
        row.update(_decode_window(engine, cfg, case.input_len, plan.batch, clock, phases, copy_gbps))
    finally:
        retire(engine)
        del engine
        collect()
    row["phases"] = phases
    rows = [row]
    if cfg.e2e:
        rows.append(e2e_row(cfg, case, row))
    if cfg.requests:
        rows.append(offline_row(cfg, case))
    return rows


def _check_plan(engine, plan: BatchPlan) -> None:
    if engine.num_pages != plan.num_pages:
        raise RuntimeError(f"the engine allocated {engine.num_pages} KV pages, the plan counted {plan.num_pages}")


def _decode_window(engine, cfg: ThroughputConfig, input_len: int, batch: int, clock: Clock,
                   phases: dict, copy_gbps: float | None = None) -> dict:
    params = SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, ignore_eos=True)
    tokens = prompt(engine.spec.vocab_size, input_len, cfg.seed)
    clock.sync()
    t0 = time.perf_counter()
    seq = engine.add_request(tokens, params)
    prefill_s = first_tokens(engine, [seq], clock, limit=input_len + 1)
    ttft_s = time.perf_counter() - t0
    phases["prefill_s"] = ttft_s
    if cfg.decode_offset:
        phases["offset_s"] = until(engine, lambda: seq.num_generated >= 1 + cfg.decode_offset, clock,
                                    limit=cfg.decode_offset)
    kv_tokens = sum(seq.kv_lens) / len(seq.kv_lens)
    count = min(cfg.sources, batch)
    t0 = time.perf_counter()
    sources, profiled = [seq], {}
    if cfg.busy_prefill and count > 1 and profiling_supported(engine.device):
        profiled = profile_prefill(engine, params, input_len, cfg.seed, clock)
        sources.append(profiled.pop("seq"))
    sources += prefill_sources(engine, params, input_len, count - len(sources), cfg.seed, clock, first=len(sources) - 1)
    phases["sources_s"] = time.perf_counter() - t0
    clock.sync()
    t0 = time.perf_counter()
    clones = engine.clone_sequence(seq, batch - count)
    _diverge(clones, engine.spec.vocab_size, cfg.seed)
    mixed = mix_layers(engine, clones, sources, cfg.seed)
    seqs = [*sources, *clones]  # a cut keeps the sources
    clock.sync()
    phases["clone_s"] = time.perf_counter() - t0
    phases["warmup_steps_s"] = window(engine, seqs, cfg.warmup, clock)
    spare = cfg.output_len - 1 - steps_after_prefill(cfg, "decode_window")  # steps the window's rows can spare
    t0 = time.perf_counter()
    # a keep that runs every N <= steps + WARMUP_DECODE tokens runs once before the window (its first run, with its
    # compiles at the batch's shapes, untimed), so the window holds steps / N of its later runs
    out_keep = through_decode_keep(engine, seqs, min(WARMUP_DECODE + cfg.steps, spare), clock)
    phases["warmup_keep_s"], phases["warmup_keep_steps"] = time.perf_counter() - t0, out_keep
    kv_before = kv_bytes(engine, seqs)
    each: list[float] = []
    seconds = window(engine, seqs, cfg.steps, clock, each)
    phases["window_s"] = seconds
    steps_ms = [1e3 * t for t in each]
    out = {"decode_tok_s": batch * cfg.steps / seconds, "step_ms": 1e3 * seconds / cfg.steps,
           "prefill_s": prefill_s, "ttft_s": ttft_s, "kv_tokens_at_window": kv_tokens, "busy": None,
           "sources": count, "mixed_layers": mixed, "steps_ms": [round(t, 3) for t in steps_ms],
           "slow_steps": slow_steps(steps_ms), **profiled}
    if copy_gbps is not None:  # the bytes a step must read, over the run's copy bandwidth (floor.py)
        kv = (kv_before + kv_bytes(engine, seqs)) / 2
        out["floor"] = step_floor(engine.runner.model, batch, kv, copy_gbps, out["step_ms"])
        out["vs_floor"] = out["floor"]["vs_floor"]
    out.update(after_window(engine, cfg, seqs, out["step_ms"], clock, phases))
    return out


def _diverge(clones: list, vocab: int, seed: int) -> None:
    """Each clone feeds a different next token (its last, not yet computed one), so from the first
    window step on the batch's rows are distinct requests: identical rows would all route to the
    same experts of an MoE layer and make the window far cheaper than real traffic."""
    g = torch.Generator().manual_seed(seed + 7)
    for clone, token in zip(clones, torch.randint(0, vocab, (len(clones),), generator=g).tolist()):
        clone.token_ids[-1] = token


def ratios(rows: list[dict], baseline: str = "full") -> dict[str, dict[str, dict]]:
    """Per input length, per method: decode tok/s and batch over the baseline's (decode windows), and the
    whole run's output tok/s over the baseline's (`output_tok_s`, offline rows)."""
    out: dict[str, dict[str, dict]] = {}
    for mode, key in (("decode_window", "decode_tok_s"), ("offline", "output_tok_s")):
        measured = [r for r in rows if r["mode"] == mode and r.get(key)]
        base = {r["input_len"]: r for r in measured if r["method"] == baseline}
        for r in measured:
            b = base.get(r["input_len"])
            if b is None:
                continue
            cell = out.setdefault(str(r["input_len"]), {}).setdefault(r["method"], {})
            cell[key] = r[key] / b[key]
            if mode == "decode_window":
                cell["batch"] = r["batch"] / b["batch"]
    return out


def run(cfg: ThroughputConfig, progress: bool = False, on_row: Callable[[dict], None] | None = None,
        on_partial: Callable[[dict], None] | None = None) -> dict:
    """Every (method, input) of `cfg`; the result object (`result.header` + rows + ratios).
    `on_partial` gets the result so far (`"complete": False`) after every case, so a run cut short
    (a time limit) still leaves the rows it finished."""
    from kvc.runtime.bench.result import header

    model = cfg.model
    if model is None:
        model = str(model_directory(None))
    result = header(cfg, model)
    cases = prepare(cfg, model)
    copy = _copy_bandwidth(cfg)
    result["copy_GBps"] = copy
    if cfg.mix:
        cases = cap_batches(cases)
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
                new = measure(cfg, case, copy)
            except (RuntimeError, OutOfKVMemory) as e:  # out of device memory, a batch that did not hold: a row
                log.exception("bench throughput: %s at %d input tokens failed", case.method, case.input_len)
                what = "out of device memory" if isinstance(e, torch.cuda.OutOfMemoryError) else "failed"
                new = [{"method": case.method, "params": case.resolved, "input_len": case.input_len,
                        "output_len": cfg.output_len, "mode": "decode_window", "batch": case.plan.batch,
                        "pages_per_seq": case.plan.pages_per_seq, "error": f"{what}: {e}"}]
            # after the except block: its exception's traceback held the failed engine's frames
            collect()
            rows += new
            for row in new:
                if on_row is not None:
                    on_row(row)
            last = [c for c in cases if c.input_len == case.input_len][-1]
            if cfg.mix and case is last and len(cfg.methods) > 1:
                try:
                    mixed = mixed_row(cfg, [c for c in cases if c.input_len == case.input_len], rows)
                except (RuntimeError, OutOfKVMemory) as e:
                    log.exception("bench throughput: the mixed window at %d input tokens failed", case.input_len)
                    mixed = {"method": "+".join(cfg.methods), "input_len": case.input_len, "mode": "mixed_window",
                             "error": f"failed: {e}"}
                collect()
                rows.append(mixed)
                if on_row is not None:
                    on_row(mixed)
            if on_partial is not None:
                on_partial({**result, "rows": rows, "ratios_vs_full": ratios(rows), "complete": False})
            if bar is not None:
                bar.advance(bar.task_ids[0])
    finally:
        if bar is not None:
            bar.stop()
    result["rows"] = rows
    result["ratios_vs_full"] = ratios(rows)
    result["complete"] = True
    return result


def _copy_bandwidth(cfg: ThroughputConfig) -> float | None:
    """The device's copy bandwidth (GB/s, read + written; bandwidth.py), measured before any engine holds the
    memory: the memory floors' baseline. None off CUDA and with tensor parallelism (a rank reads its shard)."""
    device = EngineConfig(device=cfg.device).resolve_device()
    if device.type != "cuda" or cfg.tensor_parallel_size > 1:
        return None
    copies = copy_gbps()
    collect()
    return copies["best"]


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from rich.progress import Progress

    bar = Progress(transient=False)
    bar.add_task("bench throughput", total=total)
    bar.start()
    return bar
