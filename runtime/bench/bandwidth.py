"""Device timing and the copy baseline every bandwidth figure is divided by (docs/benchmarks.md): a CUDA
graph's replays of a call (`graph_ms`), and device-to-device copy bandwidth (`copy_gbps`), (bytes read +
written) / time. The benches in bench/ and `kvc bench throughput`'s memory floor (floor.py) share them."""

from __future__ import annotations

import torch


def graph_ms(fn, reps: int = 20) -> float:
    """Milliseconds per call of `fn`: `reps` calls captured in one CUDA graph (after one eager call), replayed."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (5 * reps)


def copy_gbps(n_bytes: int = 2**30, reps: int = 10) -> dict:
    """Device-to-device copy bandwidth, (bytes read + written) / time, three ways: a copy captured in a CUDA
    graph (a memcpy node, which the driver may give to a copy engine), the same copy launched eagerly, and an
    elementwise kernel (every SM moving bytes). `best`, the fastest, is the baseline the decode benches divide
    by: a graph's memcpy node alone measured 2.7 TB/s on the H200 against 4.2 TB/s for the kernel copy."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    graph = graph_ms(lambda: dst.copy_(src), reps)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    eager = start.elapsed_time(end) / reps
    words, out = src.view(torch.int32), dst.view(torch.int32)
    kernel = graph_ms(lambda: torch.bitwise_or(words, 0, out=out), reps)
    rates = {name: 2 * n_bytes / ms / 1e6 for name, ms in (("graph_memcpy", graph), ("eager_memcpy", eager),
                                                         ("kernel", kernel))}
    return rates | {"best": max(rates.values())}
