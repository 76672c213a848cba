"""Timing for the tuner and the GPU benchmarks (bench/*.py import `time_ms` from here): median
milliseconds of a call, by CUDA events on the GPU (triton.testing.do_bench, which also clears the
L2 between repeats) and by the host clock off the GPU (the interpreter runs of the tests and the
benchmarks' CPU dry runs, where only the mechanics matter)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 25, warmup_ms: int = 10) -> float:
    """Median ms of fn() over about rep_ms of repeats after warmup_ms of warmup (three host-clock runs
    after one warmup call off the GPU)."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warmup (and the interpreter's first-call costs)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def time_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 100, min_warmup: int = 5) -> float:
    """The benchmarks' timing: `median_ms` over about rep_ms of repeats, warmed up for a quarter of
    that (at least min_warmup ms)."""
    return median_ms(fn, device, rep_ms, max(rep_ms // 4, min_warmup))
