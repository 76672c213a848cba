"""Host (Python) time of a steady decode step with per-layer page tables, without a model or a GPU.

Runs the engine's async-scheduling decode loop over synthetic decoding sequences: the scheduler
(`schedule_ahead`, `commit`, `advance`) and the decode graphs' input building (`DecodeGraphs._load`,
which reads the runner's `TableCache`), on the CPU. Layouts of the stored lengths per layer:

- `snapkv`: every layer stores `--kv` tokens (a page boundary crosses all layers of a row at once,
  once every page_size steps);
- `pyramid`: PyramidKV's linear schedule, from 3x `--kv` in the first layer down to 0.3x in the last
  (some layer of nearly every row crosses a page boundary at every step);
- `adakv`: Ada-KV's per-layer lengths (the layer's most-keeping head: --kv to 1.5x --kv, random)
  with per-KV-head start slots.

Rows start at random offsets inside a page (requests arrive at different times). With async
scheduling a decode step takes max(host, GPU), so this is what the GPU waits for once it passes
the GPU's time (the PyramidKV host gap measured on the H200 at batch 160).

    python bench/decode_host.py --batch 160 --layers 48 --kv 2048
"""

from __future__ import annotations

import argparse
import random
import time
from types import SimpleNamespace

from kvc.runtime.decode_graphs import DecodeGraphs
from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence, SequenceStatus

LAYOUTS = ("snapkv", "pyramid", "adakv")


def layer_lengths(layout: str, layers: int, kv: int, rng: random.Random) -> list[int]:
    """Tokens each layer stores after the prefill's compaction."""
    if layout == "snapkv":
        return [kv] * layers
    if layout == "pyramid":
        top, bottom = 3.0 * kv, 0.3 * kv
        return [round(top + (bottom - top) * layer / max(1, layers - 1)) for layer in range(layers)]
    return [rng.randint(kv, kv * 3 // 2) for _ in range(layers)]


def build(layout: str, batch: int, layers: int, kv: int, page: int, kv_heads: int, steps: int, seed: int = 0):
    """(scheduler, decode graphs): `batch` running sequences decoding one token each."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(batch):
        offset = rng.randrange(page)  # the row's decoded tokens so far, within a page
        lengths.append([n + offset for n in layer_lengths(layout, layers, kv, rng)])
    pages = sum(-(-(n + steps + 2) // page) for row in lengths for n in row)
    pool = PagePool(pages + batch * layers, page, False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                                          enable_prefix_caching=False), pool, num_layers=layers)
    params = SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True)
    for row in lengths:  # a method's post-prefill state: compressed to `row`, the last token sampled
        logical = max(row)
        seq = Sequence(list(range(logical + 1)), params, max_model_len=1 << 30, num_layers=layers)
        seq.page_tables = [pool.allocate(pool.pages_for(n)) for n in row]
        seq.kv_lens, seq.num_computed_tokens, seq.compressed = list(row), logical, True
        seq.prefill_end = logical
        if layout == "adakv":
            for layer, n in enumerate(row):  # the most-keeping head starts at 0, the others later
                seq.set_kv_starts(layer, [0] + [rng.randrange(n // 2) for _ in range(kv_heads - 1)])
        seq.status = SequenceStatus.RUNNING
        scheduler._live[seq.seq_id] = seq
        scheduler.running.append(seq)
    longest = max(max(row) for row in lengths) + steps + 2
    max_pages = -(-longest // page) + 1
    runner = SimpleNamespace(device="cpu", num_layers=layers, max_pages_per_seq=max_pages, num_kv_heads=kv_heads,
                             page_size=page, tables=TableCache(layers, kv_heads), max_model_len=max_pages * page,
                             attention=SimpleNamespace(num_pages=pool.num_pages))
    return scheduler, DecodeGraphs(runner, batch)


def run(layout: str, a) -> dict[str, float]:
    """ms per decode step of each part, over `a.steps` steps after `a.warmup`."""
    scheduler, graphs = build(layout, a.batch, a.layers, a.kv, a.page_size, a.kv_heads, a.steps + a.warmup)
    batch = scheduler.schedule()
    graphs._load(batch)
    scheduler.advance(batch)
    times = {"schedule_ahead": 0.0, "graph inputs": 0.0, "commit+advance": 0.0}
    for step in range(a.steps + a.warmup):
        t0 = time.perf_counter()
        ahead = scheduler.schedule_ahead(batch)
        t1 = time.perf_counter()
        graphs._load(ahead)
        t2 = time.perf_counter()
        scheduler.commit(batch, {s.seq_id: 7 for s in batch.seqs})
        scheduler.advance(ahead)
        t3 = time.perf_counter()
        if ahead is None or len(ahead.seqs) != a.batch:
            raise SystemExit(f"step {step}: the synthetic batch stopped decoding in lockstep")
        batch = ahead
        if step >= a.warmup:
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name] += dt
    return {name: 1e3 * t / a.steps for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=160)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--kv", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs (a shared CPU is noisy)")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    a = p.parse_args()
    print(f"batch {a.batch}, {a.layers} layers, kv {a.kv}, page {a.page_size}, {a.steps} steps (host ms/step):")
    results = {}
    for layout in a.layouts:
        parts = min((run(layout, a) for _ in range(a.repeat)), key=lambda parts: sum(parts.values()))
        results[layout] = total = sum(parts.values())
        cols = "  ".join(f"{name} {ms:6.2f}" for name, ms in parts.items())
        print(f"  {layout:8s} total {total:6.2f}   {cols}")
    if "snapkv" in results:
        for layout in results:
            if layout != "snapkv":
                print(f"  {layout} / snapkv: {results[layout] / results['snapkv']:.2f}x")


if __name__ == "__main__":
    main()
