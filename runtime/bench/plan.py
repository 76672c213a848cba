"""What a throughput run compares, decided before any engine is built.

- `equal_budget_params`: each method's parameters at one common KV budget (tokens kept per KV head
  and layer, 2048 by default), derived from the parameters its manifest declares, by their names
  and types, never by the method's name: a `budget` in tokens is the budget, and then the only
  parameter set (the .kvm convention: it overrides the method's native sizes); otherwise a `recent`
  window in tokens next to `sink` tokens is the budget minus the sinks, and fractions of the prompt
  named `heavy` / `recent` split the budget between them at the given input length. Anything else keeps
  its .kvm default; the user's `--method-params` override all of it. The JSON records the result.
  Quantization and compression methods keep their defaults (`UNBUDGETED`: their token parameters
  size a format, such as DeltaKV's raw tail, not a budget).
- `model_spec`: the model's shape (layers, KV heads, head dim, dtype) from its config alone, so the
  batch is known before the weights are loaded; `model_for_context` lengthens a random model's
  context when input + output need it (random weights have no trained context to respect).
- `plan_batch`: the pool the engine will allocate for `--kv-memory` (the engine's own functions,
  `attention.backend.layer_page_bytes` / `class_pages`: bytes // one layer-page of the method's
  layout, K/V and state planes, after two rows of its per-sequence tensors a seat, as the engine
  takes them; the caller checks the engine agrees) and the
  pages one sequence holds at steady state with its whole output generated (the method's
  `budget.steady_tokens(prompt, prompt + output, layer)` per layer, in pages); the largest batch is
  the pool over that, capped by `--max-batch`. One request's prefill peak (the whole prompt
  resident until prefill end) must also fit, or the method does not run at that input. The method
  gets the run's `--evict-interval` first, as the engine gives it: a decode-time keep's steady
  tokens are then its peak between evictions (the kept count + N), so the batch never outgrows
  the pool.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvc.runtime.attention.backend import class_pages, layer_page_bytes, seq_rows
from kvc.runtime.config import EngineConfig
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv.layout import CacheLayout
from kvc.runtime.models.base import ModelSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`60GiB`, `512MiB`, `1.5GB`, `1073741824` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if match is None or unit not in _UNITS:
        raise ConfigError(f"--kv-memory takes a size such as 60GiB, 512MiB or a byte count, got {text!r}",
                          param="kv_memory")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ConfigError(f"--kv-memory must be positive, got {text!r}", param="kv_memory")
    return value


def _fraction(tokens: int, input_len: int) -> float:
    """The smallest float f <= 1 with floor(f * input_len) >= tokens (a count the lowering floors)."""
    if tokens >= input_len:
        return 1.0
    f = tokens / input_len
    while math.floor(f * input_len) < tokens:
        f = math.nextafter(f, 2.0)
    return f


def _manifest(method: str) -> dict:
    """A method's manifest; {} when the method cannot be located (resolving it later gives the user the
    clear error)."""
    from kvc.compiler import cache as method_cache
    from kvc.runtime.compiled.folder import GENERATED

    try:
        compiled = method_cache.locate(method, generated=GENERATED)
    except Exception:  # noqa: BLE001 -- resolve_method reports it properly
        return {}
    return {} if compiled is None else compiled.manifest


def declared_parameters(method: str) -> dict[str, dict]:
    """The parameters a method's manifest declares (name -> {type, default}); {} when unknown."""
    return dict(_manifest(method).get("parameters", {}))


def declared_family(method: str) -> str | None:
    """The family a method's `.kvm` declares (`method NAME : FAMILY`); None when unknown."""
    return _manifest(method).get("family")


# families whose token parameters size a stored format (a residual window, a raw tail, a block), not a budget of
# kept or read tokens: they run at their .kvm defaults
UNBUDGETED = ("quantization", "compression")


def equal_budget_params(declared: dict[str, dict], input_len: int, budget: int,
                        family: str | None = None) -> dict[str, object]:
    """Parameter values that keep about `budget` tokens per KV head and layer (module docstring); none for a
    family in UNBUDGETED (DeltaKV's `recent` is its raw tail, not StreamingLLM's window)."""
    params: dict[str, object] = {}
    if family in UNBUDGETED:
        return params

    def kind(name: str) -> str | None:
        return declared.get(name, {}).get("type")

    if kind("budget") == "tokens":
        return {"budget": budget}
    if kind("recent") == "tokens":
        sink = int(declared["sink"]["default"]) if kind("sink") == "tokens" else 0
        params["recent"] = max(1, budget - sink)
    fractions = [name for name in ("heavy", "recent") if kind(name) == "float"]
    for name in fractions:
        params[name] = _fraction(budget // len(fractions), input_len)
    return params


def model_for_context(model: str, needed: int, spec: ModelSpec) -> str:
    """`random:NAME` with its context raised to `needed` tokens when it is shorter; a checkpoint
    directory must hold them itself."""
    if spec.max_position_embeddings >= needed:
        return model
    if model.startswith("random:"):
        return f"{model},max_position_embeddings={needed}"
    raise ConfigError(f"model {model} holds {spec.max_position_embeddings} tokens, the run needs {needed} "
                      "(input + output)", param="inputs")


def model_spec(model: str, device: torch.device, dtype: str) -> ModelSpec:
    """The model's shape and dtype as the engine will load it, from its config alone."""
    from kvc.runtime.models.registry import default_dtype, make_spec, model_class_for_config

    from kvc.runtime.models.loader import model_directory, resolve_model

    directory = model_directory(model)  # random:tiny, gguf: and the default have one too
    if directory is None:  # a random:NAME shape: built on the meta device, no memory
        return resolve_model(model, "meta", None if dtype == "auto" else _dtype(dtype, device)).spec
    from transformers import AutoConfig

    from kvc.runtime.errors import ModelLoadError

    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- transformers raises many types; the user needs the message
        raise ModelLoadError(f"{model}: cannot read its config: {e}") from None
    resolved = default_dtype(config, device) if dtype == "auto" else _dtype(dtype, device)
    return make_spec(model_class_for_config(config), config, resolved, ())


def rank_spec(spec: ModelSpec, tensor_parallel_size: int) -> ModelSpec:
    """The shape one rank of a tensor-parallel engine holds (its heads: runtime/distributed/group.py)."""
    if tensor_parallel_size == 1:
        return spec
    from dataclasses import replace

    from kvc.runtime.distributed.group import HeadShards

    shards = HeadShards(spec.num_heads, spec.num_kv_heads, 0, tensor_parallel_size)
    return replace(spec, num_heads=len(shards.heads), num_kv_heads=len(shards.kv_heads))


def _dtype(dtype: str, device: torch.device) -> torch.dtype:
    return EngineConfig(dtype=dtype).resolve_dtype(device, None)


@dataclass(frozen=True)
class BatchPlan:
    num_pages: int  # the pool --kv-memory buys for this method's layout
    page_bytes: int  # one layer-page (K, V and the method's state planes)
    pages_per_seq: int  # one sequence at steady state, input + the whole output stored (all layers)
    steady_tokens: float  # physical tokens per layer at that point, averaged over layers
    prefill_pages: int  # one request alone at its worst: prefill peak (whole prompt) or steady (all layers)
    fits: int  # sequences the pool holds at steady state
    batch: int  # min(fits, max_batch); 0: the method does not run at this input
    evict_interval: int = 1  # the decode-time eviction interval the steady state was counted with

    def to_json(self) -> dict:
        return asdict(self)


def plan_batch(method, spec: ModelSpec, kv_memory: int, page_size: int, input_len: int, output_len: int,
               max_batch: int, evict_interval: int = 1, inputs_dir: Path | None = None) -> BatchPlan:
    """The largest batch of `method` at `input_len` + `output_len` in `kv_memory` bytes (module
    docstring); `method` is bound to the model's shape (its input files from `inputs_dir`) and given
    `evict_interval` here, as the engine does."""
    method.evict_interval = evict_interval
    longest = input_len + output_len + 1  # the engine's max_model_len (bench/steps.py `make_engine`)
    method.bind(spec.num_layers, spec.num_kv_heads, model_dir=inputs_dir, max_context=longest,
                num_heads=spec.num_heads)
    layout = CacheLayout.of(spec, method)  # as the engine's
    classes = layout.storage(spec, method, page_size)
    # a layer-page: with several storage classes, their mean over the layers (the engine sizes the
    # classes to run out together, at equal tokens per layer)
    page_bytes = -(-sum(layer_page_bytes(classes.spec_of(layer), layout.kv_heads, page_size)
                        for layer in range(layout.layers)) // layout.layers)
    # the rows of the per-sequence tensors (`seq_rows`: two a seat, fewer where they would crowd out
    # the pages) and the LAYER tensors (stored once) come off the budget first, as the engine's
    row_bytes = sum(s.bytes_per_row(layout.kv_heads, layout.layers) for s in classes.specs) \
        if any(s.uses_rows for s in classes.specs) else 0
    fixed = sum(s.bytes_per_layers(layout.kv_heads, layout.layers) for s in classes.specs)

    def pages(seats: int) -> int:
        left = kv_memory - fixed - seq_rows(seats, row_bytes, kv_memory) * row_bytes
        return sum(class_pages(left, classes, layout.kv_heads, page_size)) if left > 0 else 0

    budget, layers = method.budget, range(layout.layers)
    steady = [budget.steady_tokens(input_len, input_len + output_len, layer) for layer in layers]
    per_seq = sum(-(-tokens // page_size) for tokens in steady)
    peak = sum(-(-max(budget.peak_tokens(input_len, layer), tokens) // page_size)
               for layer, tokens in zip(layers, steady))
    fits = pages(0) // per_seq
    while fits > 0 and fits * per_seq > pages(fits):  # rows take part of the pool
        fits -= 1
    if row_bytes:  # a sequence runs in a row: capped rows bound the batch
        fits = min(fits, seq_rows(max(1, fits), row_bytes, kv_memory))
    batch = min(fits, max_batch)
    num_pages = pages(max(1, batch)) if row_bytes else pages(0)
    fits = fits if peak <= num_pages else 0
    return BatchPlan(num_pages, page_bytes, per_seq, sum(steady) / len(steady), peak, fits, min(fits, max_batch),
                     evict_interval)
