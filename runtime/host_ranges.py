"""Named host ranges of an engine step ("kvc.schedule", "kvc.forward", "kvc.step_end", ...) for torch.profiler:
`kvc bench throughput --busy` reports each one's host time (runtime/bench/busy.py, `host_ranges`). Outside a
profile a range is a shared no-op context, so the engine pays nothing for them."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.profiler import record_function

_OFF = nullcontext()


def host_range(name: str):
    """A profiler range named `name` while torch.profiler records, else a no-op."""
    return record_function(name) if torch.autograd._profiler_enabled() else _OFF
