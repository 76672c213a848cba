"""Session-wide test setup.

Without a GPU, Triton kernels run under its interpreter. The switch must be set before anything
imports triton (transformers, kvpress and torch import it lazily, and a kernel decorated before
the switch cannot run interpreted), so it lives here rather than in the kernel test modules."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# transformers' per-tensor loading bars would flood the logs of every failing test
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# `pytest -n N` runs N workers: one thread each, or N workers x all cores oversubscribe the machine
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses the embedded default model (SmolLM2-135M-Instruct)")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct), converted once per machine into kvc's model
    cache (a lock makes parallel workers share one conversion); the README's test command installs
    the package that ships it."""
    from kvc.runtime.default_model import ensure_default_model

    return ensure_default_model()
