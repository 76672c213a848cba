"""`KvcError`: the base of every error a user can cause, from a .kvm typo to a bad HTTP request.

A leaf module (it imports nothing of kvc), so every stage of the pipeline can raise user-facing
errors without importing a later stage: `kvc.dsl.errors.KvmError` and the runtime's errors
(`kvc.runtime.errors`) derive from it. The CLI prints `message`, never a traceback; the server
maps `status` to an HTTP code and `param`/`code` into OpenAI's error schema.
"""

from __future__ import annotations


class KvcError(Exception):
    """Base class for errors caused by user input or configuration."""

    status: int = 400
    param: str | None = None
    code: str | None = None  # OpenAI's error `code`, where the error has one

    @property
    def http_status(self) -> int:
        return self.status

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
