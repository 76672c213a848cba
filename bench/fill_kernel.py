"""One layer's in-place eviction fill (runtime/kv/slot_order.py `fill`): the torch version against the
one-launch Triton kernel (runtime/kv/slot_order_triton.py `fill_triton`).

`--rows` layers of window + E slots on shuffled pages each keep `window` slots per KV head, a random
subset in random order (E evicted), over K/V (bf16, `--head-dim`) and an int32 positions plane. Both
versions are first checked equal, byte for byte. Per call: median of `--repeat` CUDA-event timings
after warm-up (the GPU time between the call's first and last operation, host gaps included), the
host wall time to a synchronize, and the GPU operations of one call (kernels, copies, the kernels'
summed GPU time) from the profiler. CUDA only: on a machine without one it prints "no CUDA".

    python bench/fill_kernel.py --out $OUT/fill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def make(rows: int, heads: int, page: int, length: int, head_dim: int, seed: int):
    """(tensors, tables): K, V [pages + 1, Hkv, page, D] bf16 and positions [pages + 1, Hkv, page] int32,
    rows on disjoint shuffled pages."""
    per_row = -(-length // page)
    pages = rows * per_row
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (pages + 1, heads, page)
    k = torch.randn(*shape, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(*shape, head_dim, generator=g, device="cuda", dtype=torch.bfloat16)
    positions = torch.randint(0, 1 << 30, shape, generator=g, device="cuda", dtype=torch.int32)
    tables = np.random.default_rng(seed).permutation(pages).reshape(rows, per_row).astype(np.int64)
    return [k, v, positions], tables


def keeps(rows: int, heads: int, length: int, count: int, seed: int) -> torch.Tensor:
    """[rows, Hkv, count] kept slots of [0, length), a random subset in random order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(rows, heads, length, generator=g, device="cuda").argsort(dim=-1)[..., :count].contiguous()


def event_ms(fn, repeat: int, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def wall_ms(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def gpu_ops(fn) -> dict:
    """GPU operations of one call, from the profiler: kernels, copies/sets, and the kernels' GPU time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    kernels = [e for e in events if not e.name.lower().startswith(("memcpy", "memset"))]
    return {"kernels": len(kernels), "copies": len(events) - len(kernels),
            "kernel_us": sum(e.time_range.elapsed_us() for e in kernels)}


def measure(a, evict: int) -> list[dict]:
    """Both versions at E = `evict`: checked equal, then timed."""
    from kvc.runtime.kv import slot_order
    from kvc.runtime.kv.slot_order_triton import fill_triton

    length, count = a.window + evict, a.window
    tensors, tables = make(a.rows, a.heads, a.page, length, a.head_dim, seed=evict)
    keep = keeps(a.rows, a.heads, length, count, seed=evict)
    counts, lengths = np.full(a.rows, count, dtype=np.int64), np.full(a.rows, length, dtype=np.int64)
    versions = {"torch": lambda: slot_order.fill(tensors, keep, counts, lengths, tables, backend="torch"),
                "triton": lambda: fill_triton(tensors, keep, counts, lengths, tables)}
    original = [t.clone() for t in tensors]
    outcome = {}
    for name, fn in versions.items():
        for t, o in zip(tensors, original):
            t.copy_(o)
        fn()
        outcome[name] = [t.clone() for t in tensors]
    same = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(*outcome.values()))
    moved = any(not torch.equal(x, o) for x, o in zip(outcome["torch"], original))
    del original, outcome
    if not (same and moved):
        raise SystemExit(f"E={evict}: the kernel's result differs from torch's (or nothing moved)")
    rows = []
    for name, fn in versions.items():
        events, walls = event_ms(fn, a.repeat), wall_ms(fn, a.repeat)
        rows.append({"evict": evict, "version": name, "event_ms": statistics.median(events),
                     "wall_ms": statistics.median(walls), **gpu_ops(fn)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=317)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--evict", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA")
        return
    print(f"{torch.cuda.get_device_name()}: {a.rows} rows, Hkv {a.heads}, page {a.page}, window {a.window}, "
          f"K/V bf16 D={a.head_dim} + int32 positions")
    print(f"{'E':>4} {'version':>8} {'event ms':>9} {'wall ms':>8} {'kernels':>8} {'copies':>7} {'kernel us':>10}")
    results = []
    for evict in a.evict:
        for row in measure(a, evict):
            results.append(row)
            print(f"{evict:>4} {row['version']:>8} {row['event_ms']:>9.3f} {row['wall_ms']:>8.3f} "
                  f"{row['kernels']:>8} {row['copies']:>7} {row['kernel_us']:>10.1f}")
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": a.rows, "heads": a.heads, "page": a.page,
                       "window": a.window, "head_dim": a.head_dim, "repeat": a.repeat, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
