"""Every tuning test starts and ends with no process-wide tuning table installed."""

import pytest

from kvc.runtime.tuning import lookup


@pytest.fixture(autouse=True)
def _no_active_table(monkeypatch, tmp_path):
    monkeypatch.setenv("KVC_TUNED_DIR", str(tmp_path / "tuned-empty"))  # the lazy load finds nothing
    lookup.activate(None)
    yield
    lookup.activate(None)
