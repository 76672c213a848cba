"""Turning a model reference into a ready `LoadedModel`. A reference is one of:
- None: the embedded default model (SmolLM2-135M-Instruct, runtime/default_model.py);
- a local Hugging Face directory;
- `gguf:PATH` or a `.gguf` path: a GGUF file, converted once into the model cache (gguf.py);
- `random:tiny`: the tiny random-weight Qwen3 with a byte tokenizer that tests use (random_tiny.py);
- `random:NAME`: a named full-size shape with random weights (`random:qwen3-30b-a3b`) for benchmarks;
  `random:NAME,fp8_block=128` stores its layers' weights as FP8 codes with 128 x 128 block scales, as the
  published FP8 checkpoints do (runtime/models/fp8_weights.py).

Loading a directory: check it, read config.json (our own JSON read first, so a broken file gets a
precise message; then transformers' AutoConfig, local files only), pick the kvc class, allocate
the model empty on the target device, and fill it from the safetensors shards (weights.py).
Every failure a user can cause is a `ModelLoadError` that names the file and the problem.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from kvc.runtime.errors import ModelLoadError
from kvc.runtime.models.base import CausalLM
from kvc.runtime.models.fp8_weights import CODES, BlockFp8, published_rule, quantize_modules, quantized_weights
from kvc.runtime.models.gguf import ensure_converted, is_gguf
from kvc.runtime.models.layers import RMSNorm
from kvc.runtime.models.named_configs import named_config
from kvc.runtime.models.registry import (
    LoadedModel,
    default_dtype,
    empty_model,
    eos_ids_of,
    model_class_for,
    model_class_for_config,
)
from kvc.runtime.models.random_tiny import NAME as TINY_NAME
from kvc.runtime.models.random_tiny import ensure_tiny_model
from kvc.runtime.models.weights import load_checkpoint

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
RANDOM_INIT_STD = 0.02


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    cut: Callable[[CausalLM], None] | None = None,
) -> LoadedModel:
    """Load a local Hugging Face checkpoint directory (config.json + safetensors). `cut`: changes the
    model on the meta device before any weight is allocated or read (a tensor-parallel rank's part:
    runtime/distributed/shard.py), so only what it keeps is loaded."""
    path = Path(path).expanduser()
    device = torch.device(device)
    raw = _read_json_object(_check_dir(path) / "config.json", required=True)
    model_class_for(raw.get("architectures"), raw.get("model_type"))
    quantization = raw.get("quantization_config")
    fmt = BlockFp8.of_config(quantization, str(path / "config.json")) if quantization else None
    config = _auto_config(path)
    generation = _read_json_object(path / "generation_config.json", required=False)
    eos = eos_ids_of(config, generation)
    dtype = dtype or default_dtype(config, device)
    transform = None
    if fmt is not None:  # FP8 codes where the checkpoint has block scales (runtime/models/fp8_weights.py)
        quantized = quantized_weights(path)

        def transform(model: CausalLM) -> None:
            model.fp8_weights = (quantize_modules(model, model.checkpoint_layout(), quantized, fmt), fmt)

    if cut is not None:
        fp8 = transform

        def transform(model: CausalLM) -> None:
            if fp8 is not None:
                fp8(model)
            cut(model)

    model = empty_model(config, device, dtype, eos, transform)
    load_checkpoint(model, path, device)
    logger.info("loaded %s from %s (%s, %s)", model.spec.architecture, path, dtype, device)
    return LoadedModel(model=model, spec=model.spec, hf_config=config, path=path)


def build_random_model(
    name_or_config: str | PretrainedConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    fp8_block: int = 0,
    **overrides: Any,
) -> LoadedModel:
    """A model of a named (or given) shape with random weights, allocated on `device` directly.

    Weights are N(0, 0.02), norms 1, biases 0 — cheap in-place fills on the device. `overrides`
    replace config fields (e.g. `num_hidden_layers=2` for a quick test). The meta device gives a
    shape-only model. `fp8_block` > 0: the weights the published FP8 files quantize are FP8 codes (N(0, 1)
    rounded to e4m3) with square blocks of that size, every scale 0.02.
    """
    if isinstance(name_or_config, str):
        config = named_config(name_or_config, **overrides)
    else:
        config = copy.deepcopy(name_or_config)
        for key, value in overrides.items():
            setattr(config, key, value)
    model_class_for_config(config)
    device = torch.device(device)
    dtype = dtype or default_dtype(config, device)
    transform = None
    if fp8_block:
        fmt = BlockFp8((fp8_block, fp8_block))

        def transform(model: CausalLM) -> None:
            layout = model.checkpoint_layout()
            model.fp8_weights = (quantize_modules(model, layout, published_rule(layout), fmt), fmt)

    model = empty_model(config, device, dtype, eos_ids_of(config), transform)
    if device.type != "meta":
        _init_random_(model, device, seed)
    return LoadedModel(model=model, spec=model.spec, hf_config=config, path=None)


def resolve_model(
    spec: str | None, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
    cut: Callable[[CausalLM], None] | None = None,
) -> LoadedModel:
    """A model reference (module docstring) loaded. `random:NAME,key=value,...` overrides integer
    config fields of the named shape (e.g. `max_position_embeddings=139264`: random weights have no
    trained context to respect). `cut`: as `load_model`'s, for a checkpoint; random weights are built
    whole and never cut here (the caller cuts them)."""
    directory = model_directory(spec)
    if directory is not None:
        return load_model(directory, device, dtype, cut)
    name, *fields = spec[len(RANDOM_PREFIX) :].split(",")
    overrides = _int_overrides(spec, fields)
    return build_random_model(name, device, dtype, fp8_block=overrides.pop("fp8_block", 0), **overrides)


def model_directory(spec: str | None) -> Path | None:
    """The Hugging Face directory a reference loads from (built or converted on first use), or None
    for `random:NAME` shapes, which have none."""
    if spec is None:
        from kvc.runtime.default_model import ensure_default_model

        return ensure_default_model()
    if spec == RANDOM_PREFIX + TINY_NAME:
        return ensure_tiny_model()
    if spec.startswith(RANDOM_PREFIX):
        return None
    if is_gguf(spec):
        return ensure_converted(spec)
    return Path(spec).expanduser()


def _int_overrides(spec: str, fields: list[str]) -> dict[str, int]:
    overrides = {}
    for field in fields:
        key, eq, value = field.partition("=")
        if not eq or not key.strip() or not value.strip().isdigit():
            raise ModelLoadError(f"model {spec!r}: config overrides are key=integer, got {field!r}")
        overrides[key.strip()] = int(value)
    return overrides


def _check_dir(path: Path) -> Path:
    if not path.exists():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; pass the folder that holds config.json")
    return path


def _read_json_object(file: Path, required: bool) -> dict[str, Any]:
    if not file.exists():
        if required:
            raise ModelLoadError(f"{file.parent}: no {file.name} (is this a Hugging Face model directory?)")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise ModelLoadError(f"{file}: cannot read it ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise ModelLoadError(f"{file}: not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{file}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _auto_config(path: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types; the user needs the message
        raise ModelLoadError(f"{path / 'config.json'}: transformers cannot read it: {err}") from None


@torch.no_grad()
def _init_random_(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    generator = torch.Generator(device=device).manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, param in model.named_parameters():
        if id(param) in norms:
            param.fill_(1.0)
        elif param.dtype == CODES:  # FP8 codes N(0, 1), their scales RANDOM_INIT_STD (below)
            for row in param.view(-1, param.shape[-1]).split(4096):
                row.copy_(torch.randn(row.shape, generator=generator, device=device))
        elif name.endswith("_scale"):
            param.fill_(RANDOM_INIT_STD)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, RANDOM_INIT_STD, generator=generator)
