"""Offline benchmarks of the engine (`kvc bench throughput`, `kvc bench plot`).

- `plan.py`: what a run compares: each method's parameters at one common KV budget, the model's
  shape without its weights, and the largest batch a fixed KV memory holds (the method's budget).
- `throughput.py`: per (method, input length) one engine: prefill one real request (prefill time,
  TTFT), clone it into the largest batch (`Engine.clone_sequence`) and time a decode window.
- `e2e.py`: the window's checks: the same window at the e2e batch and a real end-to-end batch
  (`--e2e`), GPU profiles of the windows (`--busy`).
- `steps.py`: the engine plumbing both share (one engine per run, timed and checked windows).
- `busy.py`: a profiled window's GPU busy fraction (union of kernel intervals / wall time), host
  gap per step and GPU time per kernel, from the profiler's Chrome trace.
- `result.py`: the result's header and its markdown tables.
- `plot.py`: the PNG of a result JSON (matplotlib, the `bench` extra).
- `cli.py`: the argparse side of both subcommands.
"""
