"""A compiled method's input tensors (`input NAME: [dims] from "FILE"` in its .kvm), loaded for the model.

runtime/models/method_inputs.py finds the file (the model directory, else the shipped defaults);
this module loads one declared input, given ones first (tests, the calibrators), and checks its
shape. Two readers: per-head roles (roles.py: `[layer, kv_head]` gates) and the KV spec's LAYER
tensors of the same name (`LowRank` projections), which the engine copies into the store.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from kvc.runtime.errors import ConfigError
from kvc.runtime.models.method_inputs import find_input, load_input

log = logging.getLogger(__name__)


def load_declared(method: str, name: str, decl: dict, model_dir: Path | None, shape: tuple[int, ...],
                  given: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Input `name` of `method` (float32, CPU), `shape` as the model needs it."""
    value = (given or {}).get(name)
    if value is None:
        path = find_input(model_dir, decl["file"])
        if path is None and decl.get("fallback") == "zeros":  # `or zeros` (docs/language.md, "Inputs")
            log.warning("method %r: no %r for this model, so its input %r is zeros; `kvc calibrate %s --model DIR` "
                        "writes it", method, decl["file"], name, method)
            return torch.zeros(shape)
        if path is None:
            where = f"the model directory {model_dir}" if model_dir is not None else "a model directory"
            raise ConfigError(f"method {method!r} needs its input {name!r} from {decl['file']!r}, which {where} does "
                              f"not hold (no shipped default for this model either); write it with `kvc calibrate "
                              f"{method} --model DIR`", param="method")
        value = load_input(path, name)
    if tuple(value.shape) != tuple(shape):
        raise ConfigError(f"method {method!r}: input {name!r} has shape {tuple(value.shape)}, the model needs "
                          f"{tuple(shape)} ({', '.join(decl['dims'])}); calibrate it again for this model",
                          param="method")
    return value.float().cpu()


def digest(inputs: dict[str, torch.Tensor]) -> str:
    """What the inputs' content adds to a method's fingerprint (16 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(inputs):
        h.update(name.encode() + inputs[name].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]
