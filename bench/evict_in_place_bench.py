"""One layer's decode-time eviction: compacting in order against evicting in place (runtime/kv/slot_order.py).

B rows each store W + E tokens in shuffled pages and keep W of them per KV head: E tokens dropped at
random below the newest `--recent` (H2O-like), or the oldest after the sinks (`--oldest`:
StreamingLLM). Modes:
- `ordered` (torch): every kept token behind the first dropped one moves (compaction.compact_tensors);
- `ordered` (triton, on a GPU or under TRITON_INTERPRET=1): the same with the compaction kernel;
- `in_place`: the executor's fill, which sorts the slots' positions to map the plan and moves at most
  E slots a head.
Before timing, every mode's layers are checked equal to the ordered torch result read in time order.
Time per layer call: CUDA events on a GPU (median of `--repeat`), else wall time. K/V bytes moved:
slots rewritten x 2 x head_dim x dtype bytes x KV heads.

    python bench/evict_in_place_bench.py --device cuda --rows 317 --window 2048 --out evict.json
    python bench/evict_in_place_bench.py --rows 32 --window 512 --head-dim 64   # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import numpy as np
import torch

from kvc.runtime.kv import slot_order
from kvc.runtime.kv.compaction import CompactionBatch, compact_tensors
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.spec import Extent, TensorSpec, dense_spec
from kvc.runtime.kv.store import KVStore


def make(rows: int, window: int, dropped: int, heads: int, head_dim: int, page: int, dtype: torch.dtype,
         device: str, seed: int) -> tuple[KVStore, np.ndarray, int]:
    """(store, tables, length): `rows` layers of window + dropped slots, positions in slot order."""
    length = window + dropped
    per_row = -(-length // page)
    spec = dense_spec(head_dim, dtype, extra=(TensorSpec("slot.position", Extent.TOKEN, torch.int32),))
    spec = dataclasses.replace(spec, positions="slot.position", in_place=True)
    store = KVStore(spec, rows * per_row, heads, page, 1, device)
    g = torch.Generator().manual_seed(seed)
    for name in ("k", "v"):
        store[name].copy_(torch.randn(store[name].shape, generator=g).to(dtype))
    tables = torch.randperm(rows * per_row, generator=g).reshape(rows, per_row).numpy()
    slots = torch.arange(per_row * page)
    store["slot.position"][torch.from_numpy(tables)[:, slots // page].to(device), :, (slots % page).to(device)] = \
        slots.to(device=device, dtype=torch.int32)[None, :, None]
    return store, tables, length


def plans(rows: int, heads: int, window: int, dropped: int, recent: int, oldest: bool, sinks: int,
          seed: int) -> torch.Tensor:
    """[rows, Hkv, window] ascending time-order indices kept of window + dropped."""
    length = window + dropped
    if oldest:  # StreamingLLM: first `sinks` + the newest
        keep = torch.cat([torch.arange(sinks), torch.arange(sinks + dropped, length)])
        return keep.expand(rows, heads, -1).clone()
    g = torch.Generator().manual_seed(seed)
    older = length - recent
    drop = torch.rand(rows, heads, older, generator=g).argsort(-1)[..., :dropped]
    mask = torch.ones(rows, heads, length, dtype=torch.bool)
    mask.scatter_(2, drop, False)
    return torch.arange(length).expand(rows, heads, -1)[mask].reshape(rows, heads, window)


def batch_of(keep: torch.Tensor, window: int, length: int, tables: np.ndarray, page: int) -> CompactionBatch:
    rows, heads = keep.shape[:2]
    widths = np.full(rows, window, dtype=np.int64)
    return CompactionBatch(keep, np.arange(rows), widths, np.full((rows, heads), window, dtype=np.int64),
                           np.full(rows, length, dtype=np.int64), tables, np.full(rows, tables.shape[1]))


def in_time_order(store: KVStore, tables: np.ndarray, window: int) -> torch.Tensor:
    order = slot_order.orders(store["slot.position"], tables, np.full(len(tables), window))
    page = store.page_size
    slots = torch.arange(window, device=store.device)
    ids = torch.from_numpy(tables).to(store.device)[:, slots // page]  # [B, W]
    k = store["k"][ids, :, slots % page].permute(0, 2, 1, 3)  # [B, Hkv, W, D]
    return slot_order.in_order(k, order)


def timed(fn, device: str, repeat: int) -> float:
    """Median ms of fn() (each call on a fresh copy of the state: fn resets it)."""
    times = []
    for _ in range(repeat):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn(prepare=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            fn(prepare=True)
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--dropped", type=int, default=1)
    parser.add_argument("--recent", type=int, default=64, help="H2O-like: drop only below the newest N")
    parser.add_argument("--oldest", action="store_true", help="StreamingLLM: drop the oldest after 4 sinks")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    store, tables, length = make(args.rows, args.window, args.dropped, args.heads, args.head_dim, args.page, dtype,
                                 args.device, 0)
    pristine = {name: t.clone() for name, t in store.tensors.items()}
    keep = plans(args.rows, args.heads, args.window, args.dropped, args.recent, args.oldest, 4, 1).to(args.device)
    batch = batch_of(keep, args.window, length, tables, args.page)
    modes = {"ordered torch": lambda: compact_tensors(store.token_tensors(), batch, checked=False, backend="torch"),
             "in place": lambda: KVExecutor(store).compact(batch, in_place=True)}
    if args.device.startswith("cuda"):
        modes["ordered triton"] = lambda: compact_tensors(store.token_tensors(), batch, checked=False,
                                                          backend="triton")
    results, want = [], None
    for name, run in modes.items():
        def fn(prepare: bool = False, run=run):
            if prepare:
                for n, t in store.tensors.items():
                    t.copy_(pristine[n])
            else:
                run()

        fn(prepare=True)
        run()
        got = in_time_order(store, tables, args.window)
        if want is None:
            want = got
        if not torch.equal(got, want):
            raise SystemExit(f"{name}: layers differ from the ordered compaction's")
        moved = (store["k"] != pristine["k"]).flatten(3).any(-1).sum().item()  # slots x heads rewritten
        ms = timed(fn, args.device, args.repeat)
        row = {"mode": name, "rows": args.rows, "window": args.window, "dropped": args.dropped,
               "oldest": args.oldest, "ms": round(ms, 4), "slots_moved_per_head": moved / args.rows / args.heads,
               "kv_bytes_moved": int(moved * 2 * args.head_dim * store["k"].element_size()),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
