"""`kvc tune [--method NAME|--all] [--effort quick|full]`: autotune the engine's Triton kernels.

Pipeline position: the command-line front of runtime/tuning/. It reads the model's shape
(`--model`), plans a bench per kernel and shape bucket (the attention variants the method names,
or all of them; the fused MoE when the model has experts; the compaction kernel when the method
compacts; the window-score kernel `column_votes` when the method's generated kernels call it),
tunes them with a progress bar, merges the winners into this GPU's file in
`kernels_generated/tuned/` (or `--tuned-dir`), prints the old-vs-new table and writes it as JSON
with `--out`. It needs a CUDA GPU: without one it exits 2 with a message. The hidden `--interpret`
flag runs tiny sizes under TRITON_INTERPRET=1 on the CPU (the tests: mechanics, not speed).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from kvc.runtime.errors import ConfigError

log = logging.getLogger(__name__)
KERNEL_GROUPS = ("attention", "moe", "compaction", "scores")


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="autotune the Triton kernels for this GPU (writes kernels_generated/tuned/)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--method", help="tune the kernels this method runs (its attention variant, compaction if it "
                       "compacts, its generated score kernels)")
    which.add_argument("--all", action="store_true", help="every attention variant and kernel (the default)")
    p.add_argument("--effort", choices=("quick", "full"), default="quick",
                   help="quick: a few buckets, a neighbourhood of the heuristic; "
                   "full: every bucket, the whole space")
    p.add_argument("--model", help="model whose shapes to tune for: a directory, gguf:FILE or random:NAME "
                   "(default: the embedded default model), e.g. random:qwen3-30b-a3b")
    p.add_argument("--dtype", default="auto", help="auto (as served), bfloat16, float16 or float32")
    p.add_argument("--kernels", default=",".join(KERNEL_GROUPS), help="comma list of " + ", ".join(KERNEL_GROUPS))
    p.add_argument("--max-batch", type=int, default=256, help="largest decode batch bucket (the engine's max_num_seqs)")
    p.add_argument("--max-chunk", type=int, default=2048, help="largest prefill chunk (max_num_batched_tokens)")
    p.add_argument("--max-context", type=int, help="largest context bucket (default: the model's max length)")
    p.add_argument("--memory-gib", type=float, default=16.0, help="GPU memory the benches may allocate")
    p.add_argument("--max-candidates", type=int, help="measure at most N configs per bucket (the heuristic first)")
    p.add_argument("--rep-ms", type=int, default=25, help="repeat time per measurement")
    p.add_argument("--tuned-dir", type=Path, help="where the cache files live (default: kernels_generated/tuned/)")
    p.add_argument("--out", type=Path, help="also write the summary table as JSON here")
    p.add_argument("--interpret", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=tune_command)


def _device(args):
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if args.interpret and os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    return None


def _dtype(name: str):
    import torch

    if name == "auto":
        return None
    dtype = getattr(torch, name, None) if name in ("bfloat16", "float16", "float32") else None
    if dtype is None:
        raise ConfigError(f"--dtype must be auto, bfloat16, float16 or float32, got {name!r}", param="dtype")
    return dtype


def _kernel_groups(args) -> list[str]:
    groups = [g.strip() for g in args.kernels.split(",") if g.strip()]
    unknown = sorted(set(groups) - set(KERNEL_GROUPS))
    if unknown:
        raise ConfigError(f"--kernels: unknown {', '.join(unknown)} (choose from {', '.join(KERNEL_GROUPS)})",
                          param="kernels")
    return groups


def _plan(args, groups, device, shape, memory_bytes):
    from kvc.compiler.attention import VARIANTS
    from kvc.runtime.attention import triton_ops
    from kvc.runtime.tuning import benches, space

    variants, compacts, scores = sorted(VARIANTS), True, True
    if args.method:
        from kvc.runtime.methods import resolve_method

        method = resolve_method(args.method)
        variants = [method.attention.variant]
        compacts, scores = "compaction" in method.tuned_kernels, "scores" in method.tuned_kernels
    limits = space.Limits(args.max_batch, args.max_chunk, args.max_context)
    planned = []
    if "attention" in groups:
        for variant in variants:
            ops = triton_ops.load(variant)
            planned += benches.attention(ops, variant, shape, args.effort, limits, device, memory_bytes)
    if "moe" in groups:
        planned += benches.moe(shape, args.effort, limits, device, memory_bytes)
    if "compaction" in groups and compacts:
        planned += benches.compaction(shape, args.effort, limits, device, memory_bytes)
    if "scores" in groups and scores:
        planned += benches.votes(shape, args.effort, limits, device, memory_bytes)
    return planned


def tune_command(args: argparse.Namespace) -> int:
    device = _device(args)
    if device is None:
        print("kvc: error: kvc tune needs a CUDA GPU (tuned configs are measured on the GPU they are for); "
              "none is visible here", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kvc: error: kvc tune needs Triton: `pip install kvc[triton]`", file=sys.stderr)
        return 2
    from kvc.runtime.tuning import lookup, report, tuner
    from kvc.runtime.tuning.keys import gpu_key
    from kvc.runtime.tuning.shapes import model_shape

    groups = _kernel_groups(args)  # flags first: a typo must not wait for the model to load
    dtype = _dtype(args.dtype)
    shape = model_shape(args.model, device, dtype)
    memory_bytes = int(args.memory_gib * 2**30)
    planned = _plan(args, groups, device, shape, memory_bytes)
    if not planned:
        print("kvc tune: nothing to tune for this method and model", file=sys.stderr)
        return 0
    gpu = gpu_key(device)
    log.info("tuning %d kernel buckets for %s on %s (%s)", len(planned), shape.name, gpu.name, args.effort)
    outcomes = tuner.run(planned, device, rep_ms=args.rep_ms, max_candidates=args.max_candidates,
                         progress=sys.stderr.isatty())
    path = tuner.save(outcomes, args.tuned_dir or lookup.tuned_dir(), gpu)
    report.print_table(outcomes)
    if args.out:
        meta = {"model": shape.name, "dtype": str(shape.dtype).removeprefix("torch."), "effort": args.effort,
                "method": args.method or "all", "cache_file": str(path)}
        report.write_json(args.out, outcomes, gpu, meta)
    print(f"tuned configs for {gpu.name}: {path}")
    return 0
