"""Session-wide test setup.

Without a GPU, Triton kernels run under its interpreter. The switch must be set before anything
imports triton (transformers, kvpress and torch import it lazily, and a kernel decorated before
the switch cannot run interpreted), so it lives here rather than in the kernel test modules."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# transformers' per-tensor loading bars would flood the logs of every failing test
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "real_model: uses the embedded default model (SmolLM2-135M-Instruct)")
