"""User-facing errors of the runtime.

Every error a user can cause (bad model directory, bad sampling parameters, a prompt that is too
long) is a `KvcError` (defined in the leaf module `kvc.errors`, re-exported here) with a message
that says what to do. The CLI prints the message, never a traceback; the server (runtime/server/)
maps `status` to an HTTP code.
"""

from __future__ import annotations

from kvc.errors import KvcError

__all__ = [
    "ChainBusy", "ChainCapacity", "ChainDiverged", "ChainError", "ChainEvicted", "ChainNotFound", "ConfigError",
    "InvalidPromptError", "InvalidSamplingParams", "KvcError", "ModelLoadError", "OutOfKVMemory",
    "PromptTooLongError", "UnsupportedArchitectureError",
]


class ModelLoadError(KvcError):
    """The model directory is missing, unreadable or incomplete."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture kvc has no model code for."""


class InvalidSamplingParams(KvcError):
    """A sampling parameter is out of range or of the wrong type."""


class InvalidPromptError(KvcError):
    """The prompt is empty, not text or token ids, or holds ids outside the vocabulary."""


class PromptTooLongError(InvalidPromptError):
    """The prompt (plus at least one new token) does not fit the model's context."""


class ConfigError(KvcError):
    """An engine option is invalid (page size, memory budget, device, dtype, method)."""


class OutOfKVMemory(KvcError):
    """A single request can never fit the KV page pool, even alone."""

    status = 503


class ChainError(KvcError):
    """A chain-cache request that cannot be served (runtime/chains.py); `code` names which."""


class ChainNotFound(ChainError):
    """Unknown chain id, or a chain of another owner (never told apart: ids are not probed)."""

    status = 404
    code = "chain_not_found"


class ChainBusy(ChainError):
    """A request is already running on the chain (one at a time)."""

    status = 409
    code = "chain_busy"


class ChainDiverged(ChainError):
    """The prompt does not extend the chain's history and the chain cannot roll back to it."""

    status = 409
    code = "chain_diverged"


class ChainMethodMismatch(ChainError):
    """The chain was recorded by another KV method (or parameters) than the request asks for."""

    status = 409
    code = "chain_method_mismatch"


class ChainEvicted(ChainError):
    """The chain existed but was evicted under memory pressure, or dropped."""

    status = 410
    code = "chain_evicted"


class ChainCapacity(ChainError):
    """No memory for the chain's request, even with every idle chain evicted; retry later."""

    status = 503
    code = "chain_capacity"
