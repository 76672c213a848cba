"""Engine options, one dataclass, validated once: what `LLM(...)` and `kvc generate` accept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.errors import ConfigError

MLA_PREFILL_FORMS = ("auto", "absorbed", "decompressed")  # EngineConfig.mla_prefill (latent_prefill.py)
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")  # EngineConfig.prefill_attention (sdpa_prefill.py)
DEFAULT_PAGE_SIZE = 16  # tokens per KV page when neither the config nor the method sets one

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _with_index(device: torch.device) -> torch.device:
    """`cuda` -> `cuda:N` (the current device): APIs like torch.cuda.set_device need the index."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass
class EngineConfig:
    model: str | None = None  # local HF directory, "random:NAME", or None for the embedded default
    method: str = "full"
    method_params: dict | None = None  # overrides of the method's .kvm parameters (checked at resolve)
    # more methods served beside `method` (the default), each request choosing one (runtime/lanes.py):
    # names, .kvm paths or compiled folders, with their default parameters
    methods: tuple[str, ...] | list[str] | None = None
    # per method of `methods` and the default (by name): its parameters' overrides (`method_params` over them)
    methods_params: dict[str, dict] | None = None
    # a directory holding the method's input files (`input NAME ... from "FILE"`, as `kvc calibrate
    # --out` writes them), read instead of the model's directory and the shipped defaults
    method_inputs: str | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str | torch.dtype = "auto"  # "auto": float32 on CPU, the checkpoint's dtype on GPU
    # tokens per KV page; None: the page the method's page summaries are over (Quest's `page_size`),
    # else DEFAULT_PAGE_SIZE
    page_size: int | None = None
    kv_cache_memory: int | None = None  # bytes for KV pages; None: a fraction of free memory
    gpu_memory_utilization: float = 0.85  # fraction of free GPU memory for KV when no bytes given
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # per-step token budget (decodes + prefill chunks)
    max_prefill_chunk: int | None = None  # cap on one sequence's prefill tokens per step
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # "auto" | "torch" | "triton"
    # an MLA model's prefill chunks (runtime/attention/latent_prefill.py): "absorbed" over the latents,
    # "decompressed" over per-head keys and values up-projected per chunk; "auto": decompressed
    mla_prefill: str = "auto"
    # dense layers' prefill chunks: "kernel" (the backend's paged prefill) or "sdpa"
    # (runtime/attention/sdpa_prefill.py: cuDNN's fused attention over the chunk, or over its gathered
    # pages); "auto": sdpa on CUDA, kernel elsewhere
    prefill_attention: str = "auto"
    cuda_graphs: bool = True
    # schedule the next decode step while the current one runs (runtime/engine.py `step`);
    # None: on for a GPU, off on the CPU (where it buys nothing; tests turn it on)
    async_scheduling: bool | None = None
    # prune chains automatically after each chat turn, e.g. "role=tool,older_than=2,keep=0.2"
    # (runtime/chain_prune.py parse_auto_prune); None: only explicit prunes
    auto_prune: str | None = None
    # the method whose token scores rank a chain's tokens when a prune names no scorer; None: the
    # served method's own (a method without token scores then needs a scorer in each prune)
    prune_scorer: str | None = None
    # queries a chain keeps per layer for a scorer that reads every prefill query (H2O's attention
    # sums); a scorer with an observation window keeps exactly its window
    chain_queries: int = 32
    # decode-time eviction (a method keeping at step end: StreamingLLM, H2O, TOVA) evicts a row
    # only once it stores `evict_interval` tokens past its kept count, then back down to the count
    # (kvpress DecodingPress's compression_interval); 1: every step. Peak memory grows by N - 1
    # tokens per layer and row (docs/design.md, "Eviction interval")
    evict_interval: int = 1
    # a window keep at every step (StreamingLLM's `first a + last b`) writes each decode token over the
    # oldest recent one instead of evicting at step end (runtime/kv/ring.py; docs/design.md, "Decode
    # rings"); False: every decode step appends and the step end evicts in place (the rings' oracle)
    decode_rings: bool = True
    # prefill first: while a request prefills or waits to be admitted, steps run prefill chunks only
    # and decodes wait (throughput over latency; it keeps replayed prefills, runtime/prefill_record.py,
    # out of mixed steps). False: decodes first, then prefill chunks, in one step
    prefill_first: bool = False
    # ranks the model's heads, MLP and expert columns are split over (runtime/distributed/): rank 0 is
    # this process, the others are spawned; torch.distributed with NCCL on GPUs, gloo on the CPU
    tensor_parallel_size: int = 1
    # under tensor parallelism, split MoE layers by whole experts (an even share per rank) rather than by
    # every expert's intermediate columns (runtime/distributed/shard.py)
    expert_parallel: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        def positive_int(name: str, value: object) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}", param=name)

        if self.method_params is not None and not isinstance(self.method_params, dict):
            raise ConfigError(f"method_params must be a dict, got {self.method_params!r}", param="method_params")
        if self.methods is not None and (isinstance(self.methods, str)
                                         or not all(isinstance(m, str) and m for m in self.methods)):
            raise ConfigError(f"methods must be a list of method names, got {self.methods!r}", param="methods")
        if self.methods_params is not None and not (isinstance(self.methods_params, dict) and all(
                isinstance(v, dict) for v in self.methods_params.values())):
            raise ConfigError(f"methods_params must map method names to parameter dicts, got {self.methods_params!r}",
                              param="methods_params")
        if self.page_size is not None:
            positive_int("page_size", self.page_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        positive_int("evict_interval", self.evict_interval)
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        for name in ("max_prefill_chunk", "max_model_len", "kv_cache_memory"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]", param="gpu_memory_utilization")
        if self.mla_prefill not in MLA_PREFILL_FORMS:
            raise ConfigError(f"mla_prefill must be one of {', '.join(MLA_PREFILL_FORMS)}, got {self.mla_prefill!r}",
                              param="mla_prefill")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ConfigError(f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}, got "
                              f"{self.prefill_attention!r}", param="prefill_attention")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}",
                param="attention_backend",
            )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return _with_index(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"invalid device {self.device!r}: {e}", param="device") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} asked for, but no CUDA GPU is available", param="device")
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"unsupported device {self.device!r} (use cpu or cuda)", param="device")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {self.device!r}: only {torch.cuda.device_count()} GPU(s) visible",
                              param="device")
        return _with_index(device)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            if device.type == "cpu":
                return torch.float32
            return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        if self.dtype not in _DTYPES:
            raise ConfigError(
                f"unsupported dtype {self.dtype!r}; use one of auto, {', '.join(sorted(set(_DTYPES)))}",
                param="dtype",
            )
        return _DTYPES[self.dtype]
