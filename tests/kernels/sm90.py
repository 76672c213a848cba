"""Compiling kernels for an H100/H200 on a machine without a GPU, outside the interpreter: run one of the
`tests.kernels.sm90_compile*` modules in a subprocess (Triton's passes and ptxas run here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def compiles_for_sm90(module: str, *args: str) -> None:
    """`python -m module args` succeeds; skips where Triton's NVIDIA backend is not installed."""
    _succeeds("-m", module, *args)


def code_compiles_for_sm90(code: str) -> None:
    """`python -c code` succeeds (code calling `tests.kernels.sm90_compile.build`); skips as above."""
    _succeeds("-c", code)


def _succeeds(*argv: str) -> None:
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True, timeout=600)
    if "No module named 'triton.backends.nvidia'" in done.stderr:
        pytest.skip("Triton's NVIDIA backend is not installed")
    assert done.returncode == 0, done.stderr[-3000:]
