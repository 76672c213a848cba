"""Offline benchmarks of the engine (`kvc bench throughput`, `kvc bench plot`).

- `plan.py`: what a run compares: each method's parameters at one common KV budget, the model's
  shape without its weights, and the largest batch a fixed KV memory holds (the method's budget).
- `throughput.py`: per (method, input length) one engine: prefill one real request (prefill time,
  TTFT), clone it into the largest batch (`Engine.clone_sequence`) and time a decode window;
  optionally a real end-to-end batch (`--e2e`) and the GPU busy fraction (`--busy`).
- `busy.py`: the GPU busy fraction of a profiled window (union of kernel intervals / wall time).
- `plot.py`: the PNG of a result JSON (matplotlib, the `bench` extra).
- `cli.py`: the argparse side of both subcommands.
"""
