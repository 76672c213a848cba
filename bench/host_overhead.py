"""Host (Python) time of one decode step of the engine, without a model or a GPU: the scheduler
(`schedule` + `postprocess`) and the decode graphs' input building (`DecodeGraphs._load`), for a
batch of decoding sequences that each store `--kv` tokens in every one of `--layers` layers (the
SnapKV operating point of `kvc bench throughput`: Qwen3-30B-A3B has 48 layers).

The GPU busy fraction of a decode step is GPU time / (GPU time + what the host adds), so this is
the part of the step the H200 waits for.

    python bench/host_overhead.py --batch 160 --layers 48 --kv 2048
    python bench/host_overhead.py --batch 317 --layers 48 --kv 2004 --evict   # per-step eviction's steady state
    python bench/host_overhead.py --batch 315 --layers 48 --kv 2048 --ring 4   # the same keep as decode rings
    python bench/host_overhead.py --batch 312 --layers 48 --kv 2048 --ring 1024 --ranked   # H2O's, ringed

`--evict`: every step, every layer of every row is reported compacted back to `--kv` tokens (a decode-time
keep's steady state, StreamingLLM's at every step: one token in, one out), as the runner's step end reports it.
`--ring A`: the keep `first A + last (kv + 1 - A)` rings instead (runtime/kv/ring.py): each layer's capacity
is kv + 2, reached at the first decode step; then no step end and no length change. `--ranked`: the ring's
first A slots are ranked (H2O's `top(seen, A) + last (kv + 1 - A)`, TOVA's with A = kv + 1): the graph inputs
also name each row's leaving slot (`ring_offsets`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from types import SimpleNamespace

from kvc.runtime.kv.page_pool import PagePool
from kvc.runtime.kv.ring import Ring, RingRules, Rings
from kvc.runtime.decode_graphs import DecodeGraphs
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.model_runner import ScheduledBatch
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.scheduler import Scheduler, SchedulerConfig
from kvc.runtime.sequence import Sequence, SequenceStatus


def build(batch: int, layers: int, kv: int, page: int, kv_heads: int, ring: int | None = None,
          ranked: bool = False):
    pool = PagePool(batch * layers * (kv // page + 8), page, False)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(8192, batch),
                                          enable_prefix_caching=False), pool, num_layers=layers)
    if ring is not None:  # the first step prefills each row's last prompt token, the second decodes: it rings
        rules = RingRules.of([Ring(ring, kv + 2, ranked)] * layers)
        scheduler.rules = replace(scheduler.rules, rings=Rings.fixed(rules))
    params = SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True)
    for _ in range(batch):  # decoding sequences in a method's post-prefill state (compressed to kv)
        seq = Sequence(list(range(kv + 1)), params, max_model_len=1 << 30, num_layers=layers)
        seq.page_tables = [pool.allocate(kv // page) for _ in range(layers)]
        seq.kv_lens, seq.num_computed_tokens, seq.compressed = [kv] * layers, kv, True
        seq.status = SequenceStatus.RUNNING
        scheduler._live[seq.seq_id] = seq
        scheduler.running.append(seq)
    max_pages = kv // page + 64
    runner = SimpleNamespace(device="cpu", lanes=[SimpleNamespace(rules=scheduler.rules)], num_layers=layers,
                             max_pages_per_seq=max_pages, num_kv_heads=kv_heads,
                             page_size=page, tables=TableCache(layers, kv_heads), max_model_len=max_pages * page,
                             attention=SimpleNamespace(num_pages=pool.num_pages, num_rows=0, scratch_row=0,
                                                       residual_window=0))
    return scheduler, DecodeGraphs(runner, batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=160)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--kv", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--evict", action="store_true", help="every layer of every row compacted back to --kv each step")
    p.add_argument("--ring", type=int, default=None, metavar="A", help="the keep first A + last (kv - A) rings")
    p.add_argument("--ranked", action="store_true", help="--ring's first A slots are ranked (H2O, TOVA)")
    a = p.parse_args()
    scheduler, graphs = build(a.batch, a.layers, a.kv, a.page_size, a.kv_heads, a.ring, a.ranked)
    times = {"schedule": 0.0, "graph inputs": 0.0, "postprocess": 0.0}
    for step in range(a.steps + 4):
        t0 = time.perf_counter()
        batch: ScheduledBatch = scheduler.schedule()
        t1 = time.perf_counter()
        graphs._load(batch)
        t2 = time.perf_counter()
        compacted = {s.seq_id: dict.fromkeys(range(a.layers), a.kv) for s in batch.seqs} if a.evict else None
        scheduler.postprocess(batch, {s.seq_id: 7 for s in batch.seqs}, compacted)
        t3 = time.perf_counter()
        if step >= 4:  # warm caches first
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name] += dt
    total = sum(times.values())
    ringed = "" if a.ring is None else ", ranked ring" if a.ranked else ", ringed"
    print(f"batch {a.batch}, {a.layers} layers, {a.kv} tokens stored per layer, {a.steps} steps"
          f"{', every layer evicting back to it' if a.evict else ''}{ringed}:")
    for name, t in times.items():
        print(f"  {name:13s} {1e3 * t / a.steps:7.2f} ms/step")
    print(f"  {'total':13s} {1e3 * total / a.steps:7.2f} ms/step")


if __name__ == "__main__":
    main()
