"""The `kvc` command line. Subcommands: generate (offline generation), serve (the HTTP API),
bench serve (load-test a server), bench throughput (decode tokens/s per method at a fixed KV
memory, runtime/bench/), bench plot (its PNG), check/fmt, compile, tune (per-GPU kernel
autotuning), eval (accuracy against KV budget, runtime/eval/)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvc.runtime.errors import KvcError

ASYNC_SCHEDULING_CHOICES = {"auto": None, "on": True, "off": False}  # --async-scheduling -> EngineConfig
MLA_PREFILL_CHOICES = ("auto", "absorbed", "decompressed")  # --mla-prefill: config.MLA_PREFILL_FORMS (no torch here)
PREFILL_ATTENTION_CHOICES = ("auto", "kernel", "sdpa")  # --prefill-attention: config.PREFILL_ATTENTION


def _interval(text: str) -> int:
    """--evict-interval's value: an integer >= 1 (argparse reports the error with the flag's name)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 (1: evict at every step), got {text!r}")
    return value


def add_evict_interval(p: argparse.ArgumentParser) -> None:
    """`--evict-interval N` and `--no-decode-rings` (EngineConfig.evict_interval, decode_rings), for generate,
    serve and bench throughput."""
    p.add_argument("--evict-interval", type=_interval, default=1, metavar="N",
                   help="decode-time eviction (a method keeping at step end: StreamingLLM, H2O, TOVA) only once "
                   "a row stores N tokens past its kept count, then back down to it; peak KV memory grows by "
                   "N-1 tokens per row and layer (default 1: every step)")
    p.add_argument("--no-decode-rings", action="store_true",
                   help="a window keep at every step (StreamingLLM's) evicts at step end instead of writing each "
                   "decode token over its oldest recent one (docs/design.md, \"Decode rings\")")


def add_prefill_forms(p: argparse.ArgumentParser) -> None:
    """`--prefill-attention` and `--mla-prefill` (EngineConfig), for generate, serve and bench throughput."""
    p.add_argument("--prefill-attention", choices=PREFILL_ATTENTION_CHOICES, default="auto",
                   help="dense layers' prefill attention on the triton backend: the paged kernel, or sdpa (cuDNN's "
                   "fused attention over the chunk or its gathered pages) (auto: sdpa on CUDA, measured faster)")
    p.add_argument("--mla-prefill", choices=MLA_PREFILL_CHOICES, default="auto",
                   help="an MLA model's (GLM-4.7-Flash's) prefill attention: absorbed over the latent cache, or "
                   "decompressed over per-head keys and values (auto: decompressed, fewer FLOPs a pair)")


def add_method_inputs(p: argparse.ArgumentParser) -> None:
    """`--method-inputs DIR` (EngineConfig.method_inputs), for generate, serve, eval and bench throughput."""
    p.add_argument("--method-inputs", metavar="DIR", help="a directory with the method's input files (as `kvc "
                   "calibrate --out` writes them), read instead of the model directory's and the shipped defaults")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local Hugging Face directory, gguf:FILE (or a .gguf path), random:tiny (the test "
                   "model) or random:NAME (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", help="KV-cache method: a shipped name or a .kvm path, compiled on "
                   "start, or a folder compiled by `kvc compile FILE --out DIR` (default: full)")
    p.add_argument("--method-param", action="append", metavar="KEY=VALUE",
                   help="override a parameter of the method's .kvm (repeatable)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--page-size", type=int, help="tokens per KV page (default: the page the method's page summaries "
                   "are over, e.g. Quest's page_size, else 16)")
    p.add_argument("--kv-cache-memory", type=int, help="bytes for the KV page pool")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="fraction of free GPU memory for KV pages when --kv-cache-memory is not given")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="per-step token budget")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks the model's heads, MLP and experts "
                   "are split over (torch.distributed: NCCL on GPUs, one per rank; gloo on the CPU)")
    p.add_argument("--expert-parallel", action="store_true", help="with --tensor-parallel-size: split MoE layers "
                   "by whole experts rather than by every expert's columns")
    p.add_argument("--no-cuda-graphs", action="store_true")
    add_prefill_forms(p)
    p.add_argument("--async-scheduling", choices=tuple(ASYNC_SCHEDULING_CHOICES), default="auto",
                   help="schedule the next decode step while the current one runs (auto: on a GPU)")
    add_evict_interval(p)
    add_method_inputs(p)
    p.add_argument("--seed", type=int, default=0)


def _engine_options(a: argparse.Namespace) -> dict:
    return dict(
        device=a.device,
        dtype=a.dtype,
        page_size=a.page_size,
        kv_cache_memory=a.kv_cache_memory,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        enable_prefix_caching=not a.no_prefix_caching,
        tensor_parallel_size=a.tensor_parallel_size,
        expert_parallel=a.expert_parallel,
        cuda_graphs=not a.no_cuda_graphs,
        async_scheduling=ASYNC_SCHEDULING_CHOICES[a.async_scheduling],
        evict_interval=a.evict_interval,
        decode_rings=not a.no_decode_rings,
        mla_prefill=a.mla_prefill,
        prefill_attention=a.prefill_attention,
        method_inputs=a.method_inputs,
        seed=a.seed,
    )


def _generate(a: argparse.Namespace) -> int:
    from kvc import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        seed=a.sampling_seed,
        ignore_eos=a.ignore_eos,
    )
    prompts: list = list(a.prompt or [])
    for text in a.prompt_ids or []:
        try:
            prompts.append([int(t) for t in text.replace(",", " ").split()])
        except ValueError:
            raise KvcError(f"--prompt-ids takes integers separated by spaces or commas, got {text!r}") from None
    if not prompts:
        prompts = ["Hello, my name is"]
    from kvc.runtime.server.launch import parse_method_params

    method_params = parse_method_params(a.method_param) or None
    llm = LLM(a.model, method=a.method or "full", method_params=method_params, **_engine_options(a))
    outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    for prompt, out in zip(prompts, outputs):
        if a.json:
            print(json.dumps({"prompt": prompt, "token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}))
        else:
            shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
            print(f"--- prompt: {shown!r}\n{out.text!r}\n(token ids: {out.token_ids}, finish: {out.finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvc", description="kvc: a compiler and engine for KV-cache methods")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    _add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    gen.add_argument("--prompt-ids", action="append", help="a prompt as token ids, e.g. '1 2 3' (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=_generate)
    from kvc.runtime.server.cli import add_commands as add_server_commands  # `kvc serve`, `kvc bench serve`

    bench_sub = add_server_commands(sub, _add_engine_args, _engine_options)
    from kvc.runtime.bench.cli import add_commands as add_bench_commands  # `kvc bench throughput`, `plot`, `suite`

    add_bench_commands(bench_sub)
    from kvc.dsl.cli import add_commands  # `kvc check` and `kvc fmt` (the method language)

    add_commands(sub)
    from kvc.compiler.cli import add_command as add_compile_command  # `kvc compile`

    add_compile_command(sub)
    from kvc.runtime.tuning.cli import add_command as add_tune_command  # `kvc tune`

    add_tune_command(sub)
    from kvc.runtime.eval.cli import add_command as add_eval_command  # `kvc eval`

    add_eval_command(sub)
    from kvc.runtime.calibrate.cli import add_command as add_calibrate_command  # `kvc calibrate`

    add_calibrate_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KvcError as e:
        print(f"kvc: error: {e.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
