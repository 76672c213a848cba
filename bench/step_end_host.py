"""Host time of step end for decode-time eviction, per decode step, without a model or a GPU:
`step_end` called per (sequence, layer) (the runner before `step_end_batch`) against one
`step_end_batch` per layer (runtime/compiled/step_end.py), over a batch of sequences that
each store `--kv` tokens plus the step's in every one of `--layers` layers, all at the point
where the method evicts (the decode window of `kvc bench throughput`: every row has the same
lengths). The state planes hold random scores (few distinct values: ties), so rows keep different
tokens; both paths' plans are checked tensor-equal before timing. Compaction is not timed (one
`compact_many` per layer either way).

On this CPU the torch ops compute too (the selection's sorts over every stored token), which a
GPU does asynchronously; `--device meta` runs the same calls on shape-only tensors, leaving the
host's own time (Python, dispatch): what a GPU decode step waits for. Plans are compared on the
CPU first either way.

    python bench/step_end_host.py --batch 64 --layers 8 --kv 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvc.runtime.kv.store import KVStore
from kvc.runtime.method_api import LayerCacheView, StepView
from kvc.runtime.methods import resolve_method

PARAMS = {"streamingllm": {"sink": 4}, "h2o": {"heavy": 0.0625, "recent": 0.0625}, "tova": {}}


def synthetic(name: str, batch: int, layers: int, kv: int, page: int = 16, kv_heads: int = 4,
              head_dim: int = 8, seed: int = 0, ragged: bool = False, device: str = "cpu"):
    """(method, views per layer): `batch` sequences storing kv + 1 tokens (kv kept before the step),
    their page tables shuffled over one pool that all layers share (step end only reads it).
    `ragged`: every third row stores a token more (another group)."""
    params = dict(PARAMS.get(name, {}))
    if name == "streamingllm":
        params["recent"] = kv - params["sink"]
    elif name == "tova":
        params["budget"] = kv
    method = resolve_method(name, params)
    method.bind(layers, kv_heads)
    prompt = kv * 8 if name == "h2o" else kv  # H2O keeps fractions of the prompt: 2 * 0.0625 * 8 = 1
    length = kv + 1
    per_seq = -(-(length + 1) // page)
    g = torch.Generator().manual_seed(seed)
    store = KVStore(method.kv_spec(kv_heads, head_dim, torch.float32, page), batch * per_seq, kv_heads, page, layers,
                    "cpu")
    for tensor in store.tensors.values():  # K/V random; the state planes random scores with ties
        random = torch.randint(0, 4, tensor.shape, generator=g).float() if tensor.dim() == 3 else \
            torch.randn(tensor.shape, generator=g)
        tensor.copy_(random)
    store.tensors = {name: t.to(device) for name, t in store.tensors.items()}
    store.device = torch.device(device)
    order = torch.randperm(batch * per_seq, generator=g).tolist()
    views = []
    for layer in range(layers):
        row = []
        for b in range(batch):
            n = length + 1 if ragged and b % 3 == 2 else length
            cache = LayerCacheView(store, order[b * per_seq: (b + 1) * per_seq], n, None)
            row.append(StepView(b, layer, layers, prompt + (n - kv), prompt, cache))
        views.append(row)
    return method, views


def per_row(method, views) -> list:
    return [[method.step_end(layer, view) for view in row] for layer, row in enumerate(views)]


def batched(method, views) -> list:
    return [method.step_end_batch(layer, row) for layer, row in enumerate(views)]


def same_plans(a: list, b: list) -> bool:
    return all((x is None) == (y is None) and (x is None or (torch.equal(x.indices, y.indices) and x.tail == y.tail))
               for la, lb in zip(a, b) for x, y in zip(la, lb))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="streamingllm,h2o,tova")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--kv", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "meta"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"step end host time per decode step, batch {args.batch} x {args.layers} layers, {args.kv} kept tokens, "
          f"head dim {args.head_dim}, device {args.device}, 1 thread")
    for name in args.methods.split(","):
        method, views = synthetic(name, args.batch, args.layers, args.kv, head_dim=args.head_dim)
        plans = per_row(method, views)
        if not same_plans(plans, batched(method, views)):
            raise SystemExit(f"{name}: step_end_batch's plans differ from step_end's")
        evicting = sum(p is not None for layer in plans for p in layer)
        if args.device != "cpu":
            method, views = synthetic(name, args.batch, args.layers, args.kv, head_dim=args.head_dim,
                                      device=args.device)
        times = {}
        for label, fn in (("per row", per_row), ("batched", batched)):
            runs = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                fn(method, views)
                runs.append(time.perf_counter() - start)
            times[label] = statistics.median(runs)
        print(f"{name:>13}: per row {times['per row'] * 1e3:9.1f} ms   batched {times['batched'] * 1e3:8.1f} ms   "
              f"x{times['per row'] / times['batched']:.1f}   ({evicting} plans, equal)")


if __name__ == "__main__":
    main()
