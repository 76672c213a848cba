"""API keys: who may call /v1, and who owns what (chains belong to the key that opened them).

The server holds any number of keys (`--api-key` repeated, `--api-key-file`). A request's owner is
the sha256 hex digest of its bearer key, so the engine never sees a key, only an opaque owner
string; without keys there is no auth and the owner is None.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from kvc.runtime.errors import ConfigError


def owner_of(key: str) -> str:
    """The owner id of an API key: its sha256, hex."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class ApiKeys:
    """The set of accepted keys, stored as digests; matching compares every digest in constant time."""

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._owners = tuple(dict.fromkeys(owner_of(k) for k in keys))

    def __bool__(self) -> bool:
        return bool(self._owners)

    def __len__(self) -> int:
        return len(self._owners)

    def owner(self, authorization: str) -> str | None:
        """The owner of an `Authorization: Bearer KEY` header value, or None if no key matches."""
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        got = owner_of(key.strip())
        match = None
        for owner in self._owners:  # no early exit: the time does not depend on which key matched
            if hmac.compare_digest(got, owner):
                match = owner
        return match


def read_key_file(path: str) -> list[str]:
    """Keys from a file, one per line; blank lines and lines starting with '#' are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the API key file {path!r}: {e}", param="api_key_file") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError(f"the API key file {path!r} holds no keys (one per line)", param="api_key_file")
    if any(any(c.isspace() for c in k) for k in keys):
        raise ConfigError(f"the API key file {path!r} has a key with whitespace inside", param="api_key_file")
    return keys


OWNER_SCOPE_KEY = "kvc.owner"  # where the auth middleware leaves the request's owner in the ASGI scope


def request_owner(scope) -> str | None:
    """The owner the auth middleware found for this request (None without API keys)."""
    return scope.get(OWNER_SCOPE_KEY)
