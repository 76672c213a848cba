"""How the tuner times a launch: median milliseconds over repeats after a warmup, by CUDA events
on the GPU (triton.testing.do_bench, which also clears the L2 between repeats) and by the host
clock off the GPU (the interpreter runs of the tests, where only the mechanics matter). The same
idea as bench/timing.py; kept here so the installed package does not import a script folder."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, rep_ms: int = 25, warmup_ms: int = 10) -> float:
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
