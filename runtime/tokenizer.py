"""Loads a model directory's tokenizer through transformers, offline; None when there is none."""

from __future__ import annotations

import logging
from pathlib import Path

from kvc.runtime.errors import ModelLoadError

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    path = Path(path)
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here; the user needs the reason
        raise ModelLoadError(f"{path}: cannot load the tokenizer: {e}") from None
