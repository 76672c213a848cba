"""The `kvc` package: a compiler for KV-cache methods and the engine that runs them.

This file is the top of the import namespace (pyproject maps `kvc` to runtime/_top); it only
re-exports the public Python API. The pipeline lives in `kvc.dsl`, `kvc.compiler`, `kvc.runtime`.
The exports load lazily (PEP 562), so tools that need no torch (`kvc check`, `kvc fmt`) start fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "ChainSpec", "RequestOutput", "SamplingParams", "StructuredOutputs", "TokenLogprobs", "__version__"]

_EXPORTS = {
    "LLM": "kvc.runtime.llm",
    "ChainSpec": "kvc.runtime.chains",
    "RequestOutput": "kvc.runtime.llm",
    "SamplingParams": "kvc.runtime.sampling_params",
    "StructuredOutputs": "kvc.runtime.structured_outputs",
    "TokenLogprobs": "kvc.runtime.logprobs",
}

if TYPE_CHECKING:
    from kvc.runtime.chains import ChainSpec
    from kvc.runtime.llm import LLM, RequestOutput
    from kvc.runtime.logprobs import TokenLogprobs
    from kvc.runtime.sampling_params import SamplingParams
    from kvc.runtime.structured_outputs import StructuredOutputs


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvc' has no attribute {name!r}")
