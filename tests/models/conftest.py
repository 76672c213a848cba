"""Session-wide tiny checkpoints shared by the model tests (saved once, read by many tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.tiny import make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe"))
