"""The decode window's checks: the end-to-end run it stands in for (`--e2e`) and the GPU profiles
(`--busy`) that explain step times kernel by kernel.

- `after_window`: once the decode window (`throughput.py`) has timed its largest batch, the same
  engine cuts the batch down, largest cut first: to the e2e batch, where `warmup` + `steps`
  unprofiled steps give `step_ms_at_e2e_batch` (the e2e row's like-for-like reference), and to
  `--busy-batch`, where a profiled window gives `busy` and `busy_profile` (`busy.py`: busy
  fraction, host gap per step, GPU time per kernel).
- `e2e_row`: a second engine prefills `batch` real prompts end to end, then times the same window
  (`"mode": "e2e"`); `window_step_ratio` = its step time / the decode window's at the same batch
  (the acceptance: within 10% at 32K, batch >= 64). With `--busy` it is profiled the same way, so
  the two rows compare kernel by kernel.

Every window checks that each step decoded the whole batch (`steps.window`); the config checks
the sequences have output left for all of them (`steps_after_prefill`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING

import torch

from kvc.runtime.bench.sources import prefill_sources
from kvc.runtime.bench.steps import Clock, retire, collect, cut, make_engine, prompt, until, warm_up, window
from kvc.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvc.runtime.bench.throughput import Case, ThroughputConfig

PROFILE_STEPS = 16  # profiled steps at most (a profile of many steps is a large trace)
PROFILE_WARMUP = 2  # unprofiled steps first: the batch's CUDA graph is captured outside the profile


def e2e_batch(cfg: ThroughputConfig, batch: int) -> int:
    """The e2e run's batch: --e2e-batch, at most the planned one."""
    return min(cfg.e2e_batch or batch, batch)


def profile_steps(cfg: ThroughputConfig) -> int:
    return min(cfg.steps, PROFILE_STEPS)


def steps_after_prefill(cfg: ThroughputConfig, mode: str) -> int:
    """Decode steps a sequence of a `mode` row runs after its first token (it must not finish)."""
    profiled = PROFILE_WARMUP + profile_steps(cfg) if cfg.busy else 0
    timed = cfg.warmup + cfg.steps
    if mode == "e2e":
        return timed + profiled
    return cfg.decode_offset + timed * (2 if cfg.e2e else 1) + profiled


def profiling_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def profile_window(engine, cfg: ThroughputConfig, seqs: list, clock: Clock, phases: dict) -> dict:
    """The profile of a window of `seqs` (`busy.py`); busy None off CUDA."""
    if not profiling_supported(engine.device):
        return {"busy": None, "busy_note": "needs a CUDA device"}
    from kvc.runtime.bench.busy import profile_busy

    t0 = time.perf_counter()
    window(engine, seqs, PROFILE_WARMUP, clock)
    steps = profile_steps(cfg)
    result = profile_busy(lambda: window(engine, seqs, steps, clock), engine.device, steps)
    phases["busy_s"] = time.perf_counter() - t0
    return {"busy": result["busy"], "busy_batch": len(seqs), "busy_profile": result}


def profile_prefill(engine, params, input_len: int, seed: int, clock: Clock) -> dict:
    """One more source request (the second's prompt) prefilled under the profiler: `prefill_busy` (its
    `busy_profile`, per prefill, not per step), `prefill_profiled_s` (slowed by the profiler) and the
    sequence (`seq`)."""
    from kvc.runtime.bench.busy import profile_busy

    seqs: list = []
    t0 = time.perf_counter()
    result = profile_busy(lambda: seqs.extend(prefill_sources(engine, params, input_len, 1, seed, clock)),
                          engine.device, steps=1)
    return {"prefill_busy": result, "prefill_profiled_s": time.perf_counter() - t0, "seq": seqs[0]}


def after_window(engine, cfg: ThroughputConfig, seqs: list, step_ms: float, clock: Clock, phases: dict) -> dict:
    """The decode window's row fields at smaller batches (module docstring), from its `seqs` after
    the window (`step_ms` its step time at the whole batch)."""
    batch = len(seqs)
    cuts = []
    if cfg.e2e:
        cuts.append((e2e_batch(cfg, batch), "e2e"))
    if cfg.busy:
        cuts.append((min(cfg.busy_batch, batch), "busy"))
    out: dict = {}
    for keep, what in sorted(cuts, key=lambda c: -c[0]):  # stable: the e2e timing first at equal batches
        seqs = cut(engine, seqs, keep)
        if what == "busy":
            out.update(profile_window(engine, cfg, seqs, clock, phases))
        elif keep == batch:
            out.update({"e2e_batch": keep, "step_ms_at_e2e_batch": step_ms})
        else:
            window(engine, seqs, cfg.warmup, clock)
            seconds = window(engine, seqs, cfg.steps, clock)
            phases["window_at_e2e_batch_s"] = seconds
            out.update({"e2e_batch": keep, "step_ms_at_e2e_batch": 1e3 * seconds / cfg.steps})
    return out


def e2e_row(cfg: ThroughputConfig, case: Case, window_row: dict) -> dict:
    """`batch` real prompts prefilled end to end, then the same decode window (module docstring)."""
    from kvc.runtime.methods import resolve_method

    plan, input_len = case.plan, case.input_len
    batch = e2e_batch(cfg, plan.batch)
    row = {"method": window_row["method"], "params": window_row["params"], "input_len": input_len,
           "output_len": cfg.output_len, "mode": "e2e", "batch": batch, "pages_per_seq": plan.pages_per_seq,
           "busy": None}
    phases: dict[str, float] = {}
    start = time.perf_counter()
    engine = make_engine(cfg, case.model, resolve_method(case.method, case.params or None), case.params, input_len,
                         batch)
    try:
        clock = Clock(engine.device)
        phases["load_s"] = time.perf_counter() - start
        phases["warmup_s"] = clock.time(partial(warm_up, engine, cfg, input_len))
        seqs = _prefill_all(engine, cfg, input_len, batch, clock, row, phases)
        phases["warmup_steps_s"] = window(engine, seqs, cfg.warmup, clock)
        seconds = window(engine, seqs, cfg.steps, clock)
        phases["window_s"] = seconds
        if cfg.busy:
            row.update(profile_window(engine, cfg, cut(engine, seqs, min(cfg.busy_batch, batch)), clock, phases))
    finally:
        retire(engine)
        del engine
        collect()
    row.update({"decode_tok_s": batch * cfg.steps / seconds, "step_ms": 1e3 * seconds / cfg.steps, "phases": phases})
    reference = window_row.get("step_ms_at_e2e_batch") if window_row.get("e2e_batch") == batch else None
    if reference:
        row["window_step_ms"] = reference
        row["window_step_ratio"] = row["step_ms"] / reference
    return row


def _prefill_all(engine, cfg: ThroughputConfig, input_len: int, batch: int, clock: Clock, row: dict,
                 phases: dict) -> list:
    """Adds `batch` distinct prompts and steps until each has its first token (prefill_s, ttft_s)."""
    sampling = SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, ignore_eos=True)
    clock.sync()
    t0 = time.perf_counter()
    seqs = [engine.add_request(prompt(engine.spec.vocab_size, input_len, cfg.seed + 2 + i), sampling)
            for i in range(batch)]
    first: dict[int, float] = {}

    def all_started() -> bool:
        now = time.perf_counter()
        for s in seqs:
            if s.num_generated >= 1 and s.seq_id not in first:
                first[s.seq_id] = now - t0
        return len(first) == len(seqs)

    row["prefill_s"] = until(engine, all_started, clock, limit=batch * (input_len + 1))
    phases["prefill_s"] = time.perf_counter() - t0
    row["ttft_s"] = sum(first.values()) / len(first)
    row["ttft_max_s"] = max(first.values())
    left = min(cfg.output_len - s.num_generated for s in seqs)
    if left <= steps_after_prefill(cfg, "e2e"):
        raise RuntimeError(f"the first requests generated all but {left} of their {cfg.output_len} tokens while "
                           "the others prefilled; lower --e2e-batch or raise --output")
    return seqs
