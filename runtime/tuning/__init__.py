"""Per-GPU autotuning of the engine's Triton kernels (`kvc tune`) and the tuned-config cache.

Pipeline position: beside the kernels. The generated attention wrappers
(kernels_generated/_attention/*.py, from compiler/templates/paged_*.jinja), the fused MoE
(runtime/models/moe_triton.py) and the compaction kernel (runtime/kv/compaction_triton.py) ask
`lookup.tuned(kernel, bucket, source_hash)` for their launch config and keep their heuristic when
it answers None. `kvc tune` measures each kernel's config space at the shape buckets the engine
uses and writes the winners into `kernels_generated/tuned/<gpu-slug>.json`.

Modules, one job each:
- `keys`: the GPU key (device name, compute capability, Triton version) and a kernel's source hash;
- `buckets`: the shape buckets and tunable knobs of each kernel family (launch side and tuner);
- `table`: the cache file format (read with validation, atomic write, merge);
- `lookup`: the per-process table and the launch-time lookup;
- `shapes`: the model shape `--model` names; `space`: candidate configs per family and effort;
- `benches`: a runnable benchmark (inputs + launch) per kernel and bucket;
- `timing`, `tuner`, `report`, `cli`: measuring, choosing, the summary table, `kvc tune`.
"""
