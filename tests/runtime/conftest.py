"""Fixtures the runtime tests share."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def hf(model_dir):
    """The module's `model_dir` loaded by transformers, float32: the reference the engine's tokens are held to."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
