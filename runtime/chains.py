"""Chain cache (issue 6): a session's KV kept between turns, so that a turn prefills only its suffix.

`ChainSpec` is what one request asks of the chain cache; the server builds it from the request's
`chain` / `chain_id` / `chain_fork` fields and passes it to `Engine.add_request`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChainSpec:
    open: bool = False  # {"chain": true}: record this request's KV as a new chain
    continue_id: str | None = None  # {"chain_id": ID}
    fork_id: str | None = None  # {"chain_fork": ID}: a new chain starting from ID's state
    owner: str | None = None  # opaque owner key (the server passes sha256 of the API key); None: no auth
