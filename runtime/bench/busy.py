"""The GPU profile of a decode window: how much of its wall time some kernel (or device copy) runs
on the GPU, which kernels that time goes to, and how much host time the GPU waits for per step.

`profile_busy(run, device, steps)` runs `run()` (`steps` engine steps) under torch.profiler with
CUDA activity inside a user range named `WINDOW`, exports the Chrome trace and measures there
(`busy_from_trace`, pure over the trace dict, so it is tested on CPU with synthetic traces):

- `busy`: the union of the GPU activity intervals (kernels, device memcpy and memset; kernels
  replayed from CUDA graphs included, CUPTI reports them one by one) clipped to the range, over the
  range's length. Overlapping kernels count once, and the host's gaps between steps (scheduling,
  input preparation, sampling, Python hooks) count as idle: exactly what the acceptance's "GPU busy
  during steady decode" asks. Profiling slows the host slightly, so the fraction is a lower bound
  of the unprofiled one.
- `host_gap_ms_per_step`: the window minus that union, per step: the time per step no GPU work runs.
- `launches_per_step`: the kernels that ran in the window, per step (CUDA-graph replays count each
  kernel of the graph: the GPU's launches, which fusing small steps reduces, not the host's), and
  `copies_per_step`: the device memcpy and memset operations, per step.
- `host_ranges`: the host time of each of the engine's named ranges ("kvc.schedule", "kvc.forward",
  "kvc.step_end", "kvc.step_end.select", ...: runtime/host_ranges.py) started in the window, per step;
  `host_waits`: the CUDA runtime calls in which the host waits for the GPU (stream, event and device
  synchronisations, blocking copies), their count and time per step: a host range long with waits is
  the GPU's time, one long without them the host's own.
- `by_kernel`: every kernel name's GPU time inside the window (clipped to it), largest first, with
  its calls, total and per-step milliseconds and share of the summed kernel time. Names are
  shortened (`short_kernel_name`): C++ namespaces, return type and parameter list dropped, one
  telling template argument kept (the functor of an elementwise kernel, the op of a reduction), so
  instantiations of one kernel for different dtypes group together.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable

import torch

WINDOW = "kvc_decode_window"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_RANGE_PREFIX = "kvc."  # the engine's named host ranges (runtime/host_ranges.py)
# CUDA runtime calls in which the host waits for the device: synchronisations, and blocking copies
_WAITS = re.compile(r"Synchronize|^cudaMemcpy$|^cudaMemcpy2D$|^cudaMemset$")
NAME_LIMIT = 120  # characters of a shortened kernel name

_IDENT = re.compile(r"[A-Za-z_]\w*")
# identifiers inside template arguments that name what an elementwise/reduce kernel computes
_TELLING = re.compile(r"Functor|Ops?$|_cuda$|kernel")
_OPS = re.compile(r"Functor|Ops?$")
_GENERIC = re.compile(r"^(gpu_|launch_|elementwise_kernel|vectorized_|unrolled_)")
_WRAPPERS = re.compile(r"^(Kernel\d*|device_kernel|kernel)$")  # a launcher whose template argument is the kernel
_NAMESPACE = re.compile(r"\(anonymous namespace\)::|\b\w+::")


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


def _split_head(text: str) -> tuple[str, str]:
    """("ns::name", "<...>(...)"): the qualified name before its first template or parameter list."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "<(" and depth == 0 and not text[:i].endswith("operator"):
            return text[:i], text[i:]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
    return text, ""


def _template_args(rest: str) -> str:
    """The text between `rest`'s leading '<' and its matching '>' ('' when it has none)."""
    if not rest.startswith("<"):
        return ""
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "<"
        depth -= ch == ">"
        if depth == 0:
            return rest[1:i]
    return rest[1:]


def short_kernel_name(name: str, limit: int = NAME_LIMIT) -> str:
    """A readable kernel name: `void at::native::vectorized_elementwise_kernel<4, at::native::
    FillFunctor<float>, ...>(int, ...)` -> `vectorized_elementwise_kernel<FillFunctor>`; Triton and
    cuBLAS names (plain identifiers) stay as they are, cut at `limit` characters."""
    text = name.strip()
    if text.startswith("void "):
        text = text[5:]
    head, rest = _split_head(_NAMESPACE.sub("", text))
    base = head.strip() or text
    idents = _IDENT.findall(_template_args(rest))
    args = [ident for ident in idents if ident != base and _TELLING.search(ident) and not _GENERIC.search(ident)]
    ops = [ident for ident in args if _OPS.search(ident)]
    hint = ops[-1] if ops else (args[0] if args else None)  # the innermost op, else the first telling name
    if _WRAPPERS.match(base) and idents:
        hint = idents[0]
    out = f"{base}<{hint}>" if hint else base
    return out if len(out) <= limit else out[:limit - 1] + "~"


def _display_name(event: dict) -> str:
    name = str(event.get("name", "?"))
    return short_kernel_name(name) if event.get("cat") == "kernel" else name


def kernel_table(events: list[dict], window: tuple[float, float], steps: int) -> list[dict]:
    """Per shortened name: calls, GPU time inside `window` (clipped), per step and share; largest first."""
    lo, hi = window
    groups: dict[str, list[float]] = {}
    for e in events:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        if end <= lo or start >= hi:
            continue
        group = groups.setdefault(_display_name(e), [0, 0.0])
        group[0] += 1
        group[1] += min(end, hi) - max(start, lo)
    total = sum(us for _, us in groups.values())
    rows = [{"name": name, "calls": calls, "total_ms": us / 1e3, "ms_per_step": us / 1e3 / steps,
             "share": us / total if total > 0 else 0.0} for name, (calls, us) in groups.items()]
    return sorted(rows, key=lambda r: (-r["total_ms"], r["name"]))


def busy_from_trace(trace: dict, steps: int = 1) -> dict:
    """The profile of a Chrome trace holding one `WINDOW` range over `steps` engine steps: {busy,
    window_ms, gpu_ms, kernels (GPU operations: kernels, copies and sets), steps, window_ms_per_step,
    gpu_ms_per_step, host_gap_ms_per_step, launches_per_step, copies_per_step, all_reduce_share (NCCL
    kernels' time over the window), by_kernel} (module docstring)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    events = trace.get("traceEvents", [])
    ranges = [(e["ts"], e["ts"] + e["dur"]) for e in events
              if e.get("ph") == "X" and e.get("name") == WINDOW and e.get("cat") == "user_annotation"]
    if len(ranges) != 1:
        raise RuntimeError(f"the profile holds {len(ranges)} '{WINDOW}' ranges, expected one")
    window = ranges[0]
    gpu_events = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu_events]
    inside = [e for e, (s, end) in zip(gpu_events, gpu) if end > window[0] and s < window[1]]
    launches = sum(1 for e in inside if e["cat"] == "kernel")
    busy = union_length(gpu, window)
    length = window[1] - window[0]
    # tensor parallelism: the GPU time of the ranks' collectives (NCCL's kernels), over the window
    collective = union_length([(e["ts"], e["ts"] + e.get("dur", 0)) for e in gpu_events
                               if "nccl" in str(e.get("name", "")).lower()], window)
    return {"busy": busy / length if length > 0 else 0.0, "window_ms": length / 1e3, "gpu_ms": busy / 1e3,
            "kernels": len(inside), "steps": steps,
            "window_ms_per_step": length / 1e3 / steps, "gpu_ms_per_step": busy / 1e3 / steps,
            "host_gap_ms_per_step": (length - busy) / 1e3 / steps,
            "launches_per_step": launches / steps, "copies_per_step": (len(inside) - launches) / steps,
            "all_reduce_share": collective / length if length > 0 else 0.0,
            "by_kernel": kernel_table(gpu_events, window, steps),
            "host_ranges": range_table(events, window, steps, lambda e: e.get("cat") == "user_annotation"
                                       and str(e.get("name", "")).startswith(HOST_RANGE_PREFIX)),
            "host_waits": range_table(events, window, steps, lambda e: e.get("cat") == "cuda_runtime"
                                      and bool(_WAITS.search(str(e.get("name", "")))))}


def range_table(events: list[dict], window: tuple[float, float], steps: int,
                chosen: Callable[[dict], bool]) -> list[dict]:
    """Per name, the host events `chosen` picks that start inside `window`: calls, total and per-step
    milliseconds; largest first."""
    lo, hi = window
    groups: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") != "X" or not lo <= e["ts"] < hi or not chosen(e):
            continue
        group = groups.setdefault(str(e["name"]), [0, 0.0])
        group[0] += 1
        group[1] += e.get("dur", 0)
    rows = [{"name": name, "calls": calls, "total_ms": us / 1e3, "ms_per_step": us / 1e3 / steps}
            for name, (calls, us) in groups.items()]
    return sorted(rows, key=lambda r: (-r["total_ms"], r["name"]))


def profile_busy(run: Callable[[], None], device: torch.device, steps: int = 1) -> dict:
    """Runs `run()` (`steps` engine steps, synchronised at both ends) under the profiler; its profile."""
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
    return busy_from_trace(trace, steps)
