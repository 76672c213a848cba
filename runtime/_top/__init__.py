"""The `kvc` package: a compiler for KV-cache methods and the engine that runs them.

This file is the top of the import namespace (pyproject maps `kvc` to runtime/_top); it only
re-exports the public Python API. The pipeline lives in `kvc.dsl`, `kvc.compiler`, `kvc.runtime`.
"""

from kvc.runtime.llm import LLM, RequestOutput
from kvc.runtime.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
