"""The embedded default model for the tests that need a real trained one (SmolLM2-135M-Instruct).

Converted once per machine into kvc's model cache (a lock makes parallel test workers share one
conversion); the README's test command installs the package that ships it."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from kvc.runtime.default_model import ensure_default_model

    return ensure_default_model()
