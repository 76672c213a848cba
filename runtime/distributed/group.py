"""The tensor-parallel group of an engine: its rank, its size and the collectives the engine uses
(docs/design.md, "Tensor parallelism"). Rank 0 leads: it owns the requests and broadcasts every
command that changes engine state; the partial sums of sharded layers are all-reduced; a method's
cross-head selection gathers every rank's KV heads (`gather_heads`). Backend: NCCL where the
engine runs on CUDA, gloo on the CPU (the tests)."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT = datetime.timedelta(minutes=30)  # a follower waits this long for the leader's next command


class TPGroup:
    """One rank's view of the group (`rank` 0 leads): `group` carries tensors (NCCL on GPUs), `host` the
    engine's commands and sampled tokens as Python objects (gloo, on the CPU: no device copy or sync)."""

    def __init__(self, rank: int, size: int, group: Any, device: torch.device, host: Any = None) -> None:
        self.rank, self.size, self.group, self.device = rank, size, group, device
        self.host = group if host is None else host

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: torch.device) -> TPGroup:
        """Joins (or starts, at rank 0) the group every rank of the engine joins with `init_method`."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT)
        host = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend != "gloo" else None
        return cls(rank, size, dist.group.WORLD, device, host)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Every rank's `x` combined by `op` (sum, max or min), in place (every rank gets the same values)."""
        reduce = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(x, op=reduce, group=self.group)
        return x

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (what every rank can hold)."""
        return min(self.all_gather_objects(value))

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.host)
        return out

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's `obj` on every rank (a follower passes nothing)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host)
        return box[0]

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (of one shape on every rank), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class HeadShards:
    """Which of the model's heads a rank holds: query heads split evenly; KV heads split evenly too,
    or, where there are fewer KV heads than ranks, replicated: rank r holds the KV head of its query
    heads' group (docs/design.md, "Tensor parallelism")."""

    def __init__(self, num_heads: int, num_kv_heads: int, rank: int, size: int) -> None:
        from kvc.runtime.errors import ConfigError

        if num_heads % size:
            raise ConfigError(f"tensor_parallel_size={size} must divide the model's {num_heads} attention heads",
                              param="tensor_parallel_size")
        if num_kv_heads % size and size % num_kv_heads:
            raise ConfigError(f"tensor_parallel_size={size} and the model's {num_kv_heads} KV heads: one must divide "
                              "the other", param="tensor_parallel_size")
        self.num_heads, self.num_kv_heads, self.rank, self.size = num_heads, num_kv_heads, rank, size
        self.heads = range(rank * num_heads // size, (rank + 1) * num_heads // size)
        if num_kv_heads >= size:
            self.kv_heads = range(rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size)
        else:  # replicated: the KV head of this rank's query group
            first = self.heads[0] // (num_heads // num_kv_heads)
            self.kv_heads = range(first, first + 1)

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (1: none replicated)."""
        return max(1, self.size // self.num_kv_heads)

    def gather_heads(self, tp: TPGroup, x: torch.Tensor) -> torch.Tensor:
        """`x [local kv_heads, ...]` of every rank as the model's `[kv_heads, ...]` (a replicated head once)."""
        parts = tp.all_gather(x)
        return torch.cat(parts[:: self.replicas], dim=0)

    def local_kv(self) -> slice:
        """This rank's KV heads within the model's `[kv_heads, ...]`."""
        return slice(self.kv_heads.start, self.kv_heads.stop)


class HeadCollective:
    """What a compiled method's hooks need of the other ranks (compiler/hook_facts.py, `ranks`): for a
    selection across KV heads ("gather"), every rank's score rows in the model's head order and which of
    them are this rank's; for reductions over query heads (`ranks_scope`, torch_primitives), the group's
    all-reduce, and where KV heads are replicated, each KV head's query group combined over its replicas
    (`across_replicas`)."""

    def __init__(self, tp: TPGroup, shards: HeadShards) -> None:
        self.tp, self.shards = tp, shards

    @property
    def size(self) -> int:
        return self.tp.size

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head (1: none replicated)."""
        return self.shards.replicas

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.tp.all_reduce(x, op)

    def across_replicas(self, x: torch.Tensor, op: str, dim: int) -> torch.Tensor:
        """`x` with this rank's KV heads along `dim`, one rank's partial fold of each KV head's query group:
        the folds of every rank holding that KV head combined by `op` (sum, max or min). One all-reduce over
        the model's KV heads, each rank's rows in place and the identity of `op` elsewhere."""
        shape = list(x.shape)
        shape[dim] = self.shards.num_kv_heads
        identity = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[op]
        whole = x.new_full(shape, identity)
        local = self.local
        whole.narrow(dim, local.start, local.stop - local.start).copy_(x)
        self.tp.all_reduce(whole, op)
        return whole.narrow(dim, local.start, local.stop - local.start)

    @property
    def total(self) -> int:
        """The model's KV heads."""
        return self.shards.num_kv_heads

    @property
    def local(self) -> slice:
        return self.shards.local_kv()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x [local kv_heads, ...]` of every rank: `[kv_heads, ...]`."""
        return self.shards.gather_heads(self.tp, x)

    def gather_ints(self, values: list[int]) -> list[int]:
        """Per-head integers (start slots) of every rank, in head order."""
        return self.gather(torch.tensor(values, dtype=torch.int64, device=self.tp.device)).tolist()
