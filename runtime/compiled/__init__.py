"""Compiled methods as `KVMethod`s: one generic adapter over a folder of generated code
(docs/design.md, "Compiled methods" and "Decode-time eviction"; `runtime/methods.py` resolves a
method through it).

- `folder.py`: locating a method through the compile cache, checking its parameters, and its
  generated modules behind one typed object (`GeneratedCode`); `available()` lists shipped methods.
- `budget.py`: `CompiledBudget`, the physical tokens per layer a request holds.
- `state.py`: the per-(sequence, layer) stores and the lifecycle points (turns, clones, release).
- `prefill.py`: `prefill_chunk` / `prefill_end` (query windows, chunk hooks, keep plans).
- `decode.py`: the decode facts of the manifest and `decode_after_attention` (dicts or state planes).
- `read.py`: a reading `decode_before_attention` over the decode batch, answered as a `ReadPlan`.
- `step_end.py`: step-end plans, which rows are due, the decode bound, and batching by group.
- `method.py`: `CompiledMethod`, composing the above, and `resolve_compiled`.
"""
