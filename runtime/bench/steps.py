"""Engine plumbing shared by the benchmark's runs (`throughput.py`'s decode window, `e2e.py`'s
end-to-end run and profiles): build one engine per run, warm it up, step it with synchronised
timing, time a window of decode steps that must decode the whole batch, cut a batch down, and free
the engine's device memory before the next.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.sampling_params import SamplingParams

WARMUP_PROMPT_EXTRA = 256  # the warm-up prompt: budget * 2 + this (so methods compact), capped by the input
WARMUP_DECODE = 64  # warm-up tokens at most, for a method that keeps tokens at decode (until its keep has run)


class Clock:
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


def make_engine(cfg, model: str, method, params: dict, input_len: int, seats: int, methods: list[str] | None = None,
                methods_params: dict | None = None):
    """The engine of one run: `cfg` (a ThroughputConfig)'s settings, `seats` sequences at most; `methods`
    (with `methods_params`): more methods it serves beside `method` (runtime/lanes.py)."""
    from kvc.runtime.engine import Engine

    config = EngineConfig(
        model=model, method=method.name, method_params=params or None, device=cfg.device, dtype=cfg.dtype,
        page_size=cfg.page_size, kv_cache_memory=cfg.kv_memory, max_num_seqs=seats,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_prefill_chunk=cfg.max_prefill_chunk,
        max_model_len=input_len + cfg.output_len + 1, enable_prefix_caching=False,
        attention_backend=cfg.attention_backend, cuda_graphs=cfg.cuda_graphs,
        async_scheduling=cfg.async_scheduling, evict_interval=cfg.evict_interval, decode_rings=cfg.decode_rings,
        mla_prefill=cfg.mla_prefill,
        prefill_attention=cfg.prefill_attention, method_inputs=cfg.method_inputs,
        seed=cfg.seed, methods=methods, methods_params=methods_params, tensor_parallel_size=cfg.tensor_parallel_size,
        expert_parallel=cfg.expert_parallel)
    return Engine(config, method=method)


def retire(engine) -> None:
    """The run is over: every sequence aborted (its pages freed), the follower ranks stopped (tensor parallelism)."""
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    engine.close()


def collect() -> None:
    """Frees the device memory of an engine nothing references any more (one engine at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def until(engine, done: Callable[[], bool], clock: Clock, limit: int) -> float:
    """Steps the engine until `done()`; the synchronised time of those steps."""
    total, steps = 0.0, 0
    while not done():
        if steps >= limit:
            raise RuntimeError(f"the engine did not get there in {limit} steps")
        total += clock.time(engine.step)
        steps += 1
    return total


def first_tokens(engine, seqs: list, clock: Clock, limit: int) -> float:
    """Steps the engine until each of `seqs` has sampled its first token, then commits it; the synchronised
    time of those steps. A token counts once sampled: with async scheduling the step that samples it is
    left running, and the step after it (its first decode, scheduled ahead) is not part of the prefill."""
    total = until(engine, lambda: all(s.num_generated + s.pending >= 1 for s in seqs), clock, limit)
    engine.drain()
    return total


def window(engine, seqs: list, steps: int, clock: Clock, each: list | None = None) -> float:
    """Seconds of `steps` engine steps, each decoding every one of `seqs` (checked). A token counts
    once sampled: with async scheduling the last step's tokens are still pending on the device.
    `each`: filled with each step's seconds on the host's clock, from one step's return to the next (the
    last to the window's synchronised end). The host waits for a step's tokens a step later, so a slow
    step shows in its own interval or the next; the intervals add up to the window."""
    before = [s.num_generated + s.pending for s in seqs]
    preemptions = engine.scheduler.num_preemptions
    stamps: list[float] = []

    def run_steps() -> None:
        stamps.append(time.perf_counter())
        for _ in range(steps):
            engine.step()
            stamps.append(time.perf_counter())

    seconds = clock.time(run_steps)
    advanced = {s.num_generated + s.pending - b for s, b in zip(seqs, before)}
    if engine.scheduler.num_preemptions != preemptions or advanced != {steps} or engine.scheduler.num_waiting:
        raise RuntimeError(f"the decode window did not decode all {len(seqs)} sequences at every step "
                           f"(advanced {sorted(advanced)} tokens, {engine.scheduler.num_preemptions - preemptions} "
                           "preemptions); the planned batch does not hold")
    if each is not None and steps:
        stamps[-1] = stamps[0] + seconds  # the window's end, after its last step's work
        each.extend(b - a for a, b in zip(stamps, stamps[1:]))
    return seconds


def slow_steps(step_ms: list[float], factor: float = 2.0) -> dict:
    """A window's steps split into the steady ones and the slow ones (over `factor` x the median: a decode
    keep's evicting steps, or a hiccup): the median step, how many are slow, and their time above it."""
    if not step_ms:
        return {"median_ms": None, "slow": 0, "slow_extra_ms": 0.0}
    median = float(np.median(step_ms))
    slow = [t for t in step_ms if t > factor * median]
    return {"median_ms": median, "slow": len(slow), "slow_extra_ms": float(sum(t - median for t in slow))}


def cut(engine, seqs: list, keep: int) -> list:
    """The first `keep` of `seqs`; the others are aborted (their pages freed)."""
    for seq in seqs[keep:]:
        engine.abort(seq.seq_id)
    return seqs[:keep]


def through_decode_keep(engine, seqs: list, limit: int, clock: Clock) -> int:
    """Decode steps of `seqs` (each decoding the whole batch, `window`) until a decode-time keep has dropped
    stored tokens of one of them, at most `limit`; none for a method without a `step_end` keep. The steps run."""
    from kvc.runtime.method_api import Hook

    if Hook.STEP_END not in engine.method.hooks:
        return 0
    for done in range(limit):
        engine.drain()
        before = [sum(seq.kv_lens) for seq in seqs]
        window(engine, seqs, 1, clock)
        engine.drain()
        if any(sum(seq.kv_lens) < n for seq, n in zip(seqs, before)):
            return done + 1
    return limit


def warm_up(engine, cfg, input_len: int) -> None:
    """Two short requests (one where the engine seats one), so no timing after includes JIT or a first call's
    set-up: they compile the prefill and decode kernels and, where the method keeps tokens at decode (a
    `step_end` keep, e.g. a decode budget `every` N steps), decode until that keep has run once
    (`through_decode_keep`, WARMUP_DECODE steps at most). Two rows, so no kernel is specialised to a batch
    of one."""
    n = min(input_len, 2 * cfg.budget + WARMUP_PROMPT_EXTRA)
    params = SamplingParams(max_tokens=WARMUP_DECODE + 8, temperature=0.0, ignore_eos=True)
    rows = min(2, engine.config.max_num_seqs)
    seqs = [engine.add_request(prompt(engine.spec.vocab_size, n, cfg.seed + 1 + i), params) for i in range(rows)]
    clock = Clock(engine.device)
    first_tokens(engine, seqs, clock, limit=rows * (n + 1))
    window(engine, seqs, 2, clock)
    through_decode_keep(engine, seqs, WARMUP_DECODE, clock)
    for seq in seqs:
        engine.abort(seq.seq_id)
