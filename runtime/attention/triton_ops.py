"""The triton attention backend: loads the generated paged-attention kernels. No kernel code here.

The kernels (store_kv, split-KV paged_decode, paged_prefill; same signatures as `torch_ops.py`)
are rendered by the compiler from its templates (compiler/attention.py) into
kernels_generated/_attention/<variant>.py, one module per attention variant: `plain`, and
variants that splice a method's code in (e.g. `decode_stats`, whose decode kernels also emit the
attention statistics a method reads). `load(variant)` imports the module the method's manifest
names (the shipped one when it matches the templates, else one rendered into the compile cache).

`triton_ops.<name>` is `load("plain").<name>` (tools and tests that want the plain kernels).
Importing Triton is deferred to `load`; without it `load` raises `ModuleNotFoundError`, which the
backend turns into an actionable error.
"""

from __future__ import annotations

import hashlib
import importlib
from types import ModuleType

MODULE_PREFIX = "kvc_attention_"  # sys.modules names of loaded variants
_LOADED: dict[str, ModuleType] = {}  # variant -> module: located (templates rendered, hashed) once a process


def load(variant: str = "plain") -> ModuleType:
    """The generated attention module of `variant`, imported once per file content and located
    once per process (locating renders the templates: far too slow for a per-call lookup).

    Raises ModuleNotFoundError without Triton, KeyError for a variant this compiler does not have."""
    module = _LOADED.get(variant)
    if module is None:
        module = _LOADED[variant] = _load(variant)
    return module


def _load(variant: str) -> ModuleType:
    importlib.import_module("triton")  # fail here, with the package's name, when it is missing

    from kvc.compiler.attention import locate
    from kvc.compiler.cache import import_file

    path = locate(variant)
    tag = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return import_file(f"{MODULE_PREFIX}{variant}_{tag}", path)


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(load("plain"), name)
