"""The GPU busy fraction of a decode window: how much of its wall time some kernel (or device copy)
runs on the GPU.

`profile_busy(run)` runs `run()` under torch.profiler with CUDA activity inside a user range named
`WINDOW`, exports the Chrome trace and measures there: the union of the GPU activity intervals
(kernels, device memcpy and memset; kernels replayed from CUDA graphs included, CUPTI reports
them one by one) clipped to the range, over the range's length. Overlapping kernels count once,
and the host's gaps between steps (scheduling, input preparation, sampling, Python hooks) count as
idle: exactly what the acceptance's "GPU busy during steady decode" asks. Profiling slows the host
slightly, so the fraction is a lower bound of the unprofiled one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable

import torch

WINDOW = "kvc_decode_window"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def union_length(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Total length covered by `intervals` ([start, end) pairs) inside `window`, overlaps once."""
    lo, hi = window
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    total, cur_start, cur_end = 0.0, None, None
    for start, end in clipped:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def busy_from_trace(trace: dict) -> dict:
    """{busy, window_ms, gpu_ms, kernels} of a Chrome trace holding one `WINDOW` range."""
    events = trace.get("traceEvents", [])
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and e.get("name") == WINDOW and e.get("cat") == "user_annotation"]
    if len(ranges) != 1:
        raise RuntimeError(f"the profile holds {len(ranges)} '{WINDOW}' ranges, expected one")
    window = ranges[0]
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
           if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    busy = union_length(gpu, window)
    length = window[1] - window[0]
    return {"busy": busy / length if length > 0 else 0.0, "window_ms": length / 1e3, "gpu_ms": busy / 1e3,
            "kernels": sum(1 for s, e in gpu if e > window[0] and s < window[1])}


def profile_busy(run: Callable[[], None], device: torch.device) -> dict:
    """Runs `run()` (synchronised at both ends) under the profiler; its busy fraction."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function(WINDOW):
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    fd, path = tempfile.mkstemp(suffix=".json", prefix="kvc-busy-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    return busy_from_trace(trace)
