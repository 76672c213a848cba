"""Host <-> device copies that never stall the host behind queued GPU work.

A copy from pageable host memory to the GPU, and any read of a device tensor (`.tolist()`,
`.item()`), wait for the whole stream: with async scheduling the next step is already queued, so
such a wait would serialise the host with it. Here host data goes through pinned memory (torch's
caching host allocator records each copy's use, so a block is reused only once its copy is done),
and a step's sampled tokens come back through a pinned buffer and an event recorded right after
their copy (`PendingTokens.resolve` waits for that step only, not for what was queued after it).
On the CPU the same calls are plain conversions.
"""

from __future__ import annotations

import numpy as np
import torch


def _host(values, dtype: torch.dtype | None) -> torch.Tensor:
    """A list, numpy array or CPU tensor as a CPU tensor (of `dtype` when given)."""
    if isinstance(values, np.ndarray):
        values = torch.from_numpy(values)
    if isinstance(values, torch.Tensor):
        return values if dtype is None else values.to(dtype)
    return torch.tensor(values, dtype=dtype)


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list, numpy array or CPU tensor on `device`, copied without a stream wait on CUDA."""
    host = _host(values, dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(dst: torch.Tensor, values) -> None:
    """dst.copy_(values) from host data, without a stream wait on CUDA."""
    host = _host(values, None if isinstance(values, (torch.Tensor, np.ndarray)) else dst.dtype)
    if dst.device.type == "cuda":
        host = host.pin_memory()
    dst.copy_(host, non_blocking=dst.device.type == "cuda")


# (a previous step's sampled tokens on the device, (rows of this step, their rows in those tokens))
Feed = tuple[torch.Tensor, tuple[list[int], list[int]]]


def feed_pending(input_ids: torch.Tensor, tokens: torch.Tensor, rows: tuple[list[int], list[int]],
                 offsets: list[int]) -> None:
    """Writes pending input tokens, still on the device, into a step's token ids: sequence i of
    `rows[0]` (its last token sits at offsets[i + 1] - 1) takes `tokens[rows[1][k]]`."""
    dst, src = rows
    at = to_device([int(offsets[i + 1]) - 1 for i in dst], input_ids.device, torch.int64)
    input_ids.index_copy_(0, at, tokens.index_select(0, to_device(src, tokens.device, torch.int64)))


class PendingTensors:
    """Device tensors of a step on their way to the host: copied into pinned buffers at once (an
    event recorded right after), readable once `resolve()` returns."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._event = None
        if tensors and tensors[0].device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for host, t in zip(self._host, tensors):
                host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = list(tensors)

    def resolve(self) -> list[torch.Tensor]:
        """The tensors on the host (waits for their step's kernels, not for later ones)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


class PendingTokens:
    """A step's sampled token ids: on the device at once (the next step can feed them), on the host
    once `resolve()` returns. `extras`: more of the step's device tensors (its logprobs) that come
    back with them, under the same event (`resolve_extras()`)."""

    def __init__(self, tokens: torch.Tensor, extras: list[torch.Tensor] | None = None) -> None:
        self.device = tokens  # [N] int64
        self._pending = PendingTensors([tokens, *(extras or [])])
        self._values: list[int] | None = None

    def resolve(self) -> list[int]:
        """The token ids (waits for their step's kernels, not for later ones)."""
        if self._values is None:
            self._values = self._pending.resolve()[0].tolist()
        return self._values

    def resolve_extras(self) -> list[torch.Tensor]:
        """The extra tensors, on the host."""
        return self._pending.resolve()[1:]
