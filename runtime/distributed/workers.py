"""The follower ranks of a tensor-parallel engine (docs/design.md, "Tensor parallelism").

The leader (rank 0, the process that built the engine) spawns one process per other rank; each
builds the same engine over its shard of the model and then replays the leader's commands in
order (`follow`): requests added (with the leader's sequence and chain ids), aborts, clones,
dropped chains, steps. Every rank's scheduler therefore takes the same decisions; a step's forward
meets the other ranks in its all-reduces, and the leader's sampled tokens are broadcast at each
commit (`Engine._commit`), so the ranks' sequences never drift apart. Only the leader's outputs are
read. Commands that run collectives (a step) are sent before the leader runs them; the others
after, with what the leader assigned, and only when they succeeded there.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace

import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.distributed.group import TPGroup
from kvc.runtime.errors import KvcError

log = logging.getLogger(__name__)


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r's device: cuda:r on GPUs (the leader's index plus r), the CPU otherwise."""
    device = config.resolve_device()
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


def launch(config: EngineConfig) -> tuple[list, str]:
    """Starts the followers of an engine of `config.tensor_parallel_size` ranks; (processes, init method)."""
    size = config.tensor_parallel_size
    handle, path = tempfile.mkstemp(prefix="kvc-tp-")
    os.close(handle)
    os.unlink(path)  # the file store creates it
    init = f"file://{path}"
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=follow, args=(config, rank, init), daemon=True, name=f"kvc-tp-rank{rank}")
             for rank in range(1, size)]
    for proc in procs:
        proc.start()
    return procs, init


def follow(config: EngineConfig, rank: int, init: str) -> None:
    """A follower rank: its engine over its shard, replaying the leader's commands until told to stop."""
    from kvc.runtime.engine import Engine

    config = replace(config, device=rank_device(config, rank))
    tp = TPGroup.join(rank, config.tensor_parallel_size, init, config.resolve_device())
    engine = Engine(config, tp=tp)
    try:
        while True:
            command = tp.broadcast()
            if command is None:
                break
            name, args, kwargs = command
            try:
                getattr(engine, name)(*args, **kwargs)
            except KvcError as e:  # the leader met the same (it answered the client)
                log.debug("rank %d: %s: %s", rank, name, e.message)
    finally:
        tp.close()
