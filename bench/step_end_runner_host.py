"""Host time of the runner's whole step end for decode-time eviction, per decode step, no model:
`StepHooks.step_end` over a synthetic decode batch (views, `step_end_batch`, compaction jobs,
`compact_many` up to the kernel launch, the per-row result bookkeeping) at every layer.

Each of `--batch` sequences stores `--kv` tokens plus the step's in each of `--layers` layers, at
the point where the method evicts (every third row a token longer with `--ragged`: two groups).
Page tables are shuffled over one pool per layer; the state planes hold random scores with ties.

Modes (`--mode`), each timing what a GPU step's host waits for in its own way; both run the
compaction on the Triton path with its launch stubbed out (here, in the bench only:
`compaction_triton._launch`) and value checks off, as on a GPU:
- `host` (default): float32 CPU tensors of a small head dim; torch ops dispatch in C++ as they
  do on a GPU, but compute too: the selection's sorts over every stored token (H2O, TOVA) are
  real CPU work here, asynchronous on a GPU, so this overstates those methods.
- `meta`: shape-only tensors (no compute), but torch runs meta ops through Python
  decompositions (about a millisecond per op), so this overstates every torch op instead.
`cpu` is the engine's CPU path as it is (torch compaction doing the copies, value checks on).

    PYTHONPATH=. python bench/step_end_runner_host.py --batch 317 --layers 48 --kv 2048
    PYTHONPATH=. python bench/step_end_runner_host.py --methods snapkv --batch 280 --layers 48 --kv 2048

`--methods snapkv`: SnapKV's decode budget (`every` 1: every step evicts), its rows' query windows in the store
and its window scores replaced by random ones of their shape (`flat_scores`: a GPU computes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from types import SimpleNamespace

import torch

from bench.step_end_host import PARAMS
from kvc.runtime.kv import executor
from kvc.runtime.kv.executor import KVExecutor
from kvc.runtime.kv.store import KVStore
from kvc.runtime.kv.tables import TableCache
from kvc.runtime.step_hooks import StepHooks
from kvc.runtime.model_runner import StepOutput
from kvc.runtime.methods import resolve_method
from kvc.runtime.sequence import Sequence


DECODE_BUDGET = {"window": 8, "kernel": 5, "every": 1}  # SnapKV's decode budget (`--methods snapkv`): every step


def make_method(name: str, layers: int, kv: int, kv_heads: int):
    """(method, prompt length): the method evicts back to `kv` kept tokens at length kv + 1."""
    params = dict(PARAMS.get(name, {}))
    if name == "streamingllm":
        params["recent"] = kv - params["sink"]
    elif name in ("tova", "snapkv"):
        params["budget"] = kv
    if name == "snapkv":
        params.update(DECODE_BUDGET)
    method = resolve_method(name, params)
    method.bind(layers, kv_heads, num_heads=kv_heads * GROUP if name == "snapkv" else None)
    return method, kv * 8 if name == "h2o" else kv  # H2O keeps fractions of the prompt


GROUP = 1  # query heads a KV head (a decode budget's query windows)


def flat_scores(method) -> None:
    """A decode budget's step_end scores made random, of their shape (bench only): what is left is the host's
    part and the selection, not the window attention a GPU computes."""
    facts = method.decoding
    method.decoding = dataclasses.replace(facts, step_scores=lambda inputs, state, sym, params: torch.rand(
        sym["kv_heads"], sym["context"]))


def make_runner(name: str, batch: int, layers: int, kv: int, page: int = 16, kv_heads: int = 4,
                head_dim: int = 8, device: str = "cpu", backend: str = "torch", ragged: bool = False,
                seed: int = 0, in_place: bool = True, own_layers: bool = False, shuffled: bool = False):
    """(runner, batch): the runner's facts its step end reads (a stand-in for one attention group,
    runtime/spec_group.py: the method, its store, executor, tables and hooks), and its decode batch.
    `in_place` False: the method's spec without slot positions (its keeps compact in order).
    `own_layers`: each layer its own pages (else the layers share one pool's pages, as timing allows:
    then slot positions and contents are not each layer's own). `shuffled`: each row's stored slots hold their
    positions in a random order per KV head (layers a keep in place already moved), the step's own slot the
    newest."""
    method, prompt = make_method(name, layers, kv, kv_heads)
    per_seq = -(-(kv + 2) // page)
    pages = batch * per_seq * (layers if own_layers else 1)
    g = torch.Generator().manual_seed(seed)
    spec = method.kv_spec(kv_heads, head_dim, torch.float32, page)
    if not in_place and spec.positions is not None:
        spec = dataclasses.replace(spec, tensors=tuple(t for t in spec.tensors if t.name != spec.positions),
                                   positions=None, in_place=False)
    store = KVStore(spec, pages, kv_heads, page, layers, device, num_rows=batch)  # rows: a decode budget's windows
    if device != "meta":  # K/V random; the state planes random scores with ties
        for tensor in store.tensors.values():
            tensor.copy_(torch.randint(0, 4, tensor.shape, generator=g).float() if tensor.dim() == 3 else
                         torch.randn(tensor.shape, generator=g))
    runner = SimpleNamespace()
    runner.method, runner.pool, runner.num_layers, runner.page_size = method, None, layers, page
    runner.attention = SimpleNamespace(store=store, backend=backend, k_cache=store.k_cache, v_cache=store.v_cache)
    runner.planes = store.method_tensors()
    runner.executor = KVExecutor(store, None, "triton" if backend == "triton" else "auto")
    runner.num_kv_heads, runner.tables = kv_heads, TableCache(layers, kv_heads)
    runner.hooks = StepHooks(method, [store], [runner.executor], runner.tables, None, layers)
    seqs = []
    for b in range(batch):
        extra = 1 if ragged and b % 3 == 2 else 0
        seq = Sequence([1] * prompt, SimpleNamespace(max_tokens=1, stop_token_ids=(), ignore_eos=True),
                       max_model_len=prompt + 64, num_layers=layers)
        seq.num_computed_tokens = prompt + extra
        seq.kv_lens = [kv + extra] * layers
        seq.row = b if store.num_rows else None
        seqs.append(seq)
    _distinct_tables(seqs, pages, per_seq, layers, g, own_layers)
    if spec.positions is not None and device != "meta":  # slots in time order: slot s holds position s
        plane = store[spec.positions]
        slots = torch.arange(per_seq * page)
        for layer in range(layers):
            tables = torch.tensor([seq.page_tables[layer] for seq in seqs])  # [B, per_seq]
            values = slots.to(plane.dtype)[None, :, None].expand(len(seqs), -1, kv_heads).clone()
            if shuffled:
                for b, seq in enumerate(seqs):
                    stored = seq.kv_lens[layer]  # the step's token (slot `stored`) stays the newest
                    for h in range(kv_heads):
                        values[b, :stored, h] = torch.randperm(stored, generator=g).to(plane.dtype)
            plane[tables[:, slots // page], :, slots % page] = values.to(plane.device)
    return runner, SimpleNamespace(seqs=seqs, num_decodes=batch)


def _distinct_tables(seqs, pages: int, per_seq: int, layers: int, g: torch.Generator, own_layers: bool) -> None:
    """Within each layer the rows own disjoint pages (one shuffle per layer); `own_layers`: the
    layers too (a shuffle of all pages, split in layers)."""
    if own_layers:
        pool = torch.randperm(pages, generator=g).tolist()
        shuffles = [pool[i * (pages // layers): (i + 1) * (pages // layers)] for i in range(layers)]
    else:
        shuffles = [torch.randperm(pages, generator=g).tolist() for _ in range(min(layers, 4))]
    for layer in range(layers):
        order = shuffles[layer % len(shuffles)]
        for b, seq in enumerate(seqs):
            seq.page_tables[layer] = order[b * per_seq: (b + 1) * per_seq]


def stub_launch() -> None:
    """The Triton launches become no-ops (bench only): what is left is the host's packing (the compaction's
    and the in-place fill's, runtime/kv/slot_order_triton.py)."""
    from kvc.runtime.kv import compaction_triton, slot_order_triton

    compaction_triton._launch = lambda *args, **kwargs: None

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    slot_order_triton._fill_kernel = NoLaunch()


def time_step(runner, batch, repeat: int) -> tuple[float, float, int]:
    """(seconds of one step end, of them in the generated selection, layers x rows compacted),
    the best of `repeat` runs (the machine is shared: the least disturbed one). The selection
    (sorts over every stored token) is device work on a GPU: the host's own time is the rest."""
    method = runner.method
    select, spent = method._select_fn, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = select(*args, **kwargs)
        spent.append(time.perf_counter() - start)
        return out

    method._select_fn = timed
    runner.hooks.step_end(batch, StepOutput({}))  # warm-up: first calls import and memoise
    best, compacted = None, {}
    for _ in range(repeat):
        output, spent[:] = StepOutput({}), []
        start = time.perf_counter()
        runner.hooks.step_end(batch, output)
        compacted = output.compacted
        run = (time.perf_counter() - start, sum(spent))
        if best is None or run[0] < best[0]:
            best = run
    method._select_fn = select
    return best[0], best[1], sum(len(layers) for layers in compacted.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="streamingllm,h2o,tova")
    parser.add_argument("--batch", type=int, default=317)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--kv", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ragged", action="store_true", help="every third row a token longer (two groups)")
    parser.add_argument("--mode", default="host", choices=["host", "meta", "cpu"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.mode != "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # lets compact_many take the Triton path off CUDA
        stub_launch()
        compact = executor.compact_tensors  # the executor's seam: value checks off, as on a GPU
        executor.compact_tensors = lambda *a, **kw: compact(*a, **{**kw, "checked": False})
    device = "meta" if args.mode == "meta" else "cpu"
    backend = "torch" if args.mode == "cpu" else "triton"
    print(f"runner step end per decode step, batch {args.batch} x {args.layers} layers, {args.kv} kept, "
          f"mode {args.mode}{', ragged' if args.ragged else ''}, 1 thread")
    for name in args.methods.split(","):
        runner, batch = make_runner(name, args.batch, args.layers, args.kv, head_dim=args.head_dim, device=device,
                                    backend=backend, ragged=args.ragged)
        if runner.method.decode_window:
            flat_scores(runner.method)
        seconds, selecting, plans = time_step(runner, batch, args.repeat)
        print(f"{name:>13}: {seconds * 1e3:9.1f} ms per step, of which selection {selecting * 1e3:8.1f} ms, "
              f"host {(seconds - selecting) * 1e3:8.1f} ms   ({plans} plans)")


if __name__ == "__main__":
    main()
