"""Tiny 4-layer checkpoints for the reference tests (4 layers so PyramidKV's schedule has a slope).

Llama gets 8 query heads over 2 KV heads (GQA group 4), Qwen3 4 over 2 (group 2, with q/k norms).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny import make_tiny_llama, make_tiny_qwen3

ARCHS = ("llama", "qwen3")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("references")
    return {
        "llama": make_tiny_llama(root, seed=1, num_hidden_layers=4, num_attention_heads=8),
        "qwen3": make_tiny_qwen3(root, seed=2, num_hidden_layers=4),
    }
