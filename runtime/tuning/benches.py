"""One runnable benchmark per kernel and shape bucket: inputs on the device, the heuristic config,
the candidates, and a launch per config. The tuner (tuner.py) times `launch(config)` and checks
that a candidate's `result(config)` equals the heuristic's.

Inputs are random (speed does not depend on values). A decode bucket's KV may exceed the memory
budget (`memory_bytes`): its block tables then name random pages of a smaller pool, which still
reads as many bytes per step from far more memory than the L2 holds. Buckets whose other buffers
do not fit are skipped (`Skip`) and reported.

Kernels: per attention variant `attention.<variant>.{decode,prefill,store_kv}` (the variant's
generated module; `decode_stats` decodes emit statistics, as the methods naming it always ask),
`moe.fused_experts` (runtime/models/moe_triton.py), `kv.compaction` (runtime/kv/compaction_triton.py),
`scores.column_votes` (runtime/primitives/triton_primitives.py: the generated window scores and column sums).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from kvc.runtime.tuning import buckets, space
from kvc.runtime.tuning.keys import source_hash
from kvc.runtime.tuning.shapes import ModelShape

PAGE_SIZE = 16  # EngineConfig.page_size's default


class Skip(Exception):
    """A bucket this run cannot measure (the message says why)."""


@dataclass
class Bench:
    kernel: str
    family: str
    bucket: tuple
    source: Path
    heuristic: dict
    candidates: list[dict]
    launch: Callable[[dict], Callable[[], None]]  # config -> one launch, inputs already in place
    result: Callable[[dict], torch.Tensor]  # config -> its output from fresh inputs (to compare)
    tolerance: dict = field(default_factory=lambda: {"atol": 0.0, "rtol": 0.0})

    @property
    def source_hash(self) -> str:
        return source_hash(self.source)

    @property
    def label(self) -> str:
        return f"{self.kernel} [{buckets.describe(self.family, self.bucket)}]"


@dataclass(frozen=True)
class Planned:
    """A bench not built yet (its inputs are allocated only when the tuner reaches it)."""

    kernel: str
    family: str
    bucket: tuple
    build: Callable[[], Bench]

    @property
    def label(self) -> str:
        return f"{self.kernel} [{buckets.describe(self.family, self.bucket)}]"


def _tolerance(dtype: torch.dtype) -> dict:
    # Candidates change the summation order (splits, tiles), not the maths.
    return {torch.float32: {"atol": 1e-4, "rtol": 1e-3}, torch.float16: {"atol": 5e-3, "rtol": 5e-3}}.get(
        dtype, {"atol": 3e-2, "rtol": 3e-2})


def _randn(*shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device="cpu").to(device=device, dtype=dtype)


def _kv_pool(tokens: int, shape: ModelShape, device, memory_bytes: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    token_bytes = 2 * shape.kv_heads * shape.head_dim * torch.finfo(shape.dtype).bits // 8
    pages = max(1, min(-(-tokens // PAGE_SIZE), memory_bytes // (token_bytes * PAGE_SIZE)))
    dims = (pages, shape.kv_heads, PAGE_SIZE, shape.head_dim)
    return (torch.empty(dims, device=device, dtype=shape.dtype).normal_(),
            torch.empty(dims, device=device, dtype=shape.dtype).normal_())


def attention(ops, variant: str, shape: ModelShape, effort: str, limits: space.Limits, device: torch.device,
              memory_bytes: int) -> list[Planned]:
    """The variant's benches, planned (built one at a time, so one bucket's inputs live at once)."""
    s, name = shape, f"attention.{variant}"
    out = [Planned(f"{name}.decode", "decode", buckets.decode(b, c, s.q_heads, s.kv_heads, s.head_dim, s.dtype),
                   lambda b=b, c=c: _decode(ops, variant, s, b, c, effort, device, memory_bytes))
           for b, c in space.decode_buckets(s, effort, limits)]
    out += [Planned(f"{name}.prefill", "prefill", buckets.prefill(t, s.q_heads, s.kv_heads, s.head_dim, s.dtype),
                    lambda t=t: _prefill(ops, variant, s, t, effort, device, memory_bytes))
            for t in space.chunk_buckets(effort, limits)]
    out += [Planned(f"{name}.store_kv", "store_kv", buckets.store_kv(t, s.kv_heads, s.head_dim, s.dtype),
                    lambda t=t: _store_kv(ops, variant, s, t, effort, device, memory_bytes))
            for t in space.token_buckets(effort, limits)]
    return out


def _decode(ops, variant, shape, batch, context, effort, device, memory_bytes) -> Bench:
    gen = torch.Generator().manual_seed(batch * 7 + context)
    stats = None
    if ops.EMITS_DECODE_STATS:  # the methods naming this variant always ask (H2O's fold)
        from kvc.runtime.attention.metadata import DecodeStats

        stat_bytes = batch * (shape.q_heads + shape.kv_heads) * context * 4
        if stat_bytes > memory_bytes:
            raise Skip(f"decode statistics of {stat_bytes / 2**30:.1f} GiB exceed the memory budget")
        stats = DecodeStats("group", "sum", torch.empty(batch, shape.kv_heads, context, device=device))
    k, v = _kv_pool(batch * context, shape, device, memory_bytes, gen)
    width = -(-context // PAGE_SIZE)
    tables = torch.randint(0, k.shape[0], (batch, width), generator=gen).to(device=device, dtype=torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = _randn(batch, shape.q_heads, shape.head_dim, dtype=shape.dtype, device=device, gen=gen)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(shape.head_dim)
    heuristic = asdict(ops.decode_config(batch, shape.kv_heads, shape.head_dim, context, ops.num_sms(device)))
    heuristic.pop("use_dot")

    def launch(cfg):
        return lambda: ops.paged_decode(q, k, v, tables, lens, scale, context, out=out, stats=stats, **cfg)

    def result(cfg):
        launch(cfg)()
        return torch.cat([out.float().flatten(), stats.out.flatten()]) if stats is not None else out.float().clone()

    bucket = buckets.decode(batch, context, shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype)
    return Bench(f"attention.{variant}.decode", "decode", bucket, Path(ops.__file__), heuristic,
                 space.decode(heuristic, effort, ops.MAX_SPLITS), launch, result, _tolerance(shape.dtype))


def _prefill(ops, variant, shape, tokens, effort, device, memory_bytes) -> Bench:
    gen = torch.Generator().manual_seed(tokens)
    k, v = _kv_pool(tokens, shape, device, memory_bytes, gen)
    pages = -(-tokens // PAGE_SIZE)
    if pages > k.shape[0]:
        raise Skip("the chunk's KV exceeds the memory budget")
    tables = torch.randperm(k.shape[0], generator=gen)[:pages][None].to(device=device, dtype=torch.int32)
    lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    q = _randn(tokens, shape.q_heads, shape.head_dim, dtype=shape.dtype, device=device, gen=gen)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(shape.head_dim)
    heuristic = asdict(ops.prefill_config(shape.head_dim, shape.dtype, device))

    def launch(cfg):
        return lambda: ops.paged_prefill(q, k, v, tables, cu, lens, scale, tokens, out=out, **cfg)

    def result(cfg):
        launch(cfg)()
        return out.float().clone()

    bucket = buckets.prefill(tokens, shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype)
    return Bench(f"attention.{variant}.prefill", "prefill", bucket, Path(ops.__file__), heuristic,
                 space.prefill(heuristic, effort), launch, result, _tolerance(shape.dtype))


def _store_kv(ops, variant, shape, tokens, effort, device, memory_bytes) -> Bench:
    gen = torch.Generator().manual_seed(tokens)
    k_cache, v_cache = _kv_pool(tokens, shape, device, memory_bytes, gen)
    slots = torch.randperm(k_cache.shape[0] * PAGE_SIZE, generator=gen)[:tokens].to(device)
    if slots.numel() < tokens:
        raise Skip("the tokens exceed the memory budget")
    k = _randn(tokens, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=device, gen=gen)
    v = _randn(tokens, shape.kv_heads, shape.head_dim, dtype=shape.dtype, device=device, gen=gen)
    heuristic = {"num_warps": ops.store_kv_num_warps(shape.kv_heads, shape.head_dim)}

    def launch(cfg):
        return lambda: ops.store_kv(k, v, k_cache, v_cache, slots, **cfg)

    def result(cfg):
        launch(cfg)()
        pages, offsets = slots // PAGE_SIZE, slots % PAGE_SIZE
        return torch.cat([k_cache[pages, :, offsets].float().flatten(), v_cache[pages, :, offsets].float().flatten()])

    bucket = buckets.store_kv(tokens, shape.kv_heads, shape.head_dim, shape.dtype)
    return Bench(f"attention.{variant}.store_kv", "store_kv", bucket, Path(ops.__file__), heuristic,
                 space.store_kv(heuristic, effort), launch, result)


def moe(shape: ModelShape, effort: str, limits: space.Limits, device: torch.device, memory_bytes: int) -> list[Planned]:
    m = shape.moe
    if m is None:
        return []
    return [Planned("moe.fused_experts", "moe", buckets.moe(t, m.experts, m.top_k, m.hidden, m.inter, shape.dtype),
                    lambda t=t: _moe(shape, t, effort, device, memory_bytes))
            for t in space.token_buckets(effort, limits)]


def _moe(shape: ModelShape, tokens: int, effort: str, device: torch.device, memory_bytes: int) -> Bench:
    from kvc.runtime.models import moe_triton

    m = shape.moe
    weight_bytes = 3 * m.experts * m.inter * m.hidden * torch.finfo(shape.dtype).bits // 8
    if weight_bytes > memory_bytes:
        raise Skip(f"expert weights of {weight_bytes / 2**30:.1f} GiB exceed the memory budget")
    gen = torch.Generator().manual_seed(tokens)
    x = _randn(tokens, m.hidden, dtype=shape.dtype, device=device, gen=gen)
    gate_up = torch.empty(m.experts, 2 * m.inter, m.hidden, device=device, dtype=shape.dtype).normal_(0, 0.02)
    down = torch.empty(m.experts, m.hidden, m.inter, device=device, dtype=shape.dtype).normal_(0, 0.02)
    scores = torch.rand(tokens, m.experts, generator=gen).to(device)
    weights, ids = scores.topk(m.top_k, dim=1)
    weights = (weights / weights.sum(dim=1, keepdim=True)).contiguous()
    ids = ids.to(torch.int32).contiguous()
    heuristic = asdict(moe_triton.default_config(tokens, m.top_k, m.experts, shape.dtype))

    def launch(cfg):
        config = moe_triton.MoeTileConfig(**cfg)
        return lambda: moe_triton.fused_experts(x, gate_up, down, ids, weights, config)

    def result(cfg):
        return launch(cfg)().float()

    bucket = buckets.moe(tokens, m.experts, m.top_k, m.hidden, m.inter, shape.dtype)
    return Bench(moe_triton.KERNEL, "moe", bucket, Path(moe_triton.__file__), heuristic,
                 space.moe(heuristic, effort), launch, result, _tolerance(shape.dtype))


def compaction(shape: ModelShape, effort: str, limits: space.Limits, device: torch.device,
               memory_bytes: int) -> list[Planned]:
    s = shape
    return [Planned("kv.compaction", "compaction", buckets.compaction(p, n, s.kv_heads, s.head_dim, s.dtype),
                    lambda p=p, n=n: _compaction(s, p, n, effort, device, memory_bytes))
            for p, n in space.compaction_buckets(effort, limits)]


def _compaction(shape: ModelShape, plans: int, kept: int, effort: str, device: torch.device,
                memory_bytes: int) -> Bench:
    from kvc.runtime.kv import compaction_triton
    from kvc.runtime.kv.compaction import HostPlan

    length = 2 * kept  # the prompt a plan compacts to half
    pages_each = -(-length // PAGE_SIZE)
    gen = torch.Generator().manual_seed(plans * 31 + kept)
    k0, v0 = _kv_pool(plans * length, shape, device, memory_bytes // 2, gen)  # half: the fresh copy below
    if k0.shape[0] < plans * pages_each:
        raise Skip("the plans' pages exceed the memory budget")
    k, v = k0.clone(), v0.clone()
    order = torch.randperm(k0.shape[0], generator=gen)[: plans * pages_each].tolist()
    host_plans = []
    for j in range(plans):
        keep = torch.stack([torch.randperm(length, generator=gen)[:kept].sort().values for _ in range(shape.kv_heads)])
        host_plans.append(HostPlan(order[j * pages_each:(j + 1) * pages_each], keep.to(device),
                                   [kept] * shape.kv_heads, kept))
    used = torch.tensor(order, device=device)
    heuristic = compaction_triton.default_config(shape.head_dim)

    def launch(cfg):
        return lambda: compaction_triton.compact_triton(k, v, host_plans, **cfg)

    def result(cfg):
        k.copy_(k0)
        v.copy_(v0)
        launch(cfg)()
        return torch.cat([k[used].float().flatten(), v[used].float().flatten()])

    bucket = buckets.compaction(plans, kept, shape.kv_heads, shape.head_dim, shape.dtype)
    return Bench(compaction_triton.KERNEL, "compaction", bucket, Path(compaction_triton.__file__), heuristic,
                 space.compaction(heuristic, effort, shape.head_dim), launch, result)


def votes(shape: ModelShape, effort: str, limits: space.Limits, device: torch.device,
          memory_bytes: int) -> list[Planned]:
    s = shape
    return [Planned("scores.column_votes", "votes", buckets.votes(q, n, s.q_heads, s.kv_heads, s.head_dim, s.dtype),
                    lambda q=q, n=n: _votes(s, q, n, effort, device, memory_bytes))
            for q, n in space.votes_buckets(effort, limits, s.max_len)]


def _votes(shape: ModelShape, queries: int, keys: int, effort: str, device: torch.device,
           memory_bytes: int) -> Bench:
    from kvc.runtime.primitives import triton_primitives

    s = shape
    key_bytes = s.kv_heads * keys * s.head_dim * torch.finfo(s.dtype).bits // 8
    if key_bytes + 2 * s.q_heads * queries * 4 * 8 > memory_bytes:
        raise Skip(f"keys of {key_bytes / 2**30:.1f} GiB exceed the memory budget")
    gen = torch.Generator().manual_seed(queries * 13 + keys)
    q = _randn(s.q_heads, queries, s.head_dim, dtype=s.dtype, device=device, gen=gen)
    k = _randn(s.kv_heads, keys, s.head_dim, dtype=s.dtype, device=device, gen=gen)
    n_keys = keys - queries  # a window's scores cover the keys before it (SnapKV's sliced keys)
    heuristic = triton_primitives.votes_config(queries, device.type != "cpu", s.head_dim,
                                               torch.finfo(s.dtype).bits // 8)

    def launch(cfg):
        return lambda: triton_primitives.column_votes(q, k, n_keys, **cfg)

    def result(cfg):
        return launch(cfg)().clone()

    bucket = buckets.votes(queries, keys, s.q_heads, s.kv_heads, s.head_dim, s.dtype)
    return Bench(triton_primitives.KERNEL, "votes", bucket, Path(triton_primitives.__file__), heuristic,
                 space.votes(heuristic, effort), launch, result, _tolerance(s.dtype))
