"""Timing for the GPU benchmarks: median milliseconds of a call, by CUDA events on the GPU (triton's
do_bench) and by the host clock elsewhere (the CPU dry runs). Scripts run as `python3 bench/x.py`
import it as `timing` (their folder is on sys.path)."""

from __future__ import annotations

import time

import torch


def time_ms(fn, device: torch.device, rep_ms: int = 100, min_warmup: int = 5) -> float:
    """Median ms of fn() over about rep_ms of repeats (three host-clock runs off the GPU)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, min_warmup), rep=rep_ms, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]
