"""A spy on `ReadHook.plan` for the sparse-method tests: how many read plans a compiled method gave."""

import pytest

from kvc.runtime.compiled.read import ReadHook


class Plans:
    """How many read plans the compiled method gave (a spy on `ReadHook.plan`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        plan = ReadHook.plan

        def spy(hook, *args, **kwargs):
            out = plan(hook, *args, **kwargs)
            self.count += out is not None
            return out

        monkeypatch.setattr(ReadHook, "plan", spy)
