"""The attention layer's entry point: owns the paged KV tensors and routes a step to the kernels.

The model runner calls `PagedAttention.forward` once per layer with the step's new q/k/v and its
`AttentionMetadata`. The step's K/V are stored first; then the decoding sequences (the first
`num_decodes`, one token each) go to `paged_decode` and the prefill chunks to `paged_prefill`,
both writing into one output tensor. `backend` picks the implementation: "torch"
(`torch_ops.py`, CPU, the parity oracle) or "triton": the generated kernels of the attention
variant the method's manifest names (`use_variant`, called by the runner with
`method.attention.variant`; `plain` until then), loaded by `triton_ops.load`. The kernels see one
layer: the pool plus that layer's row of the per-layer tables, lengths, slots and (per-head
variable counts only) KV-head start slots.

State planes (`runtime/kv/state_planes.py`): a method's per-token float32 state, one
`[num_pages + 1, Hkv, page_size]` tensor per name its `KVLayout.state_planes` lists, addressed by
the same page tables and slots as K/V (`planes`; the last page is scratch for batch padding).

Decode statistics: `forward(..., stats=DecodeStats)` asks the decode kernels to also emit the
step's attention probabilities, folded as the method reads them (metadata.py); `stats_request`
gives a request over one float32 buffer reused across layers (grown as needed).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.metadata import AttentionMetadata, DecodeStats, StatsFold
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import state_planes

if TYPE_CHECKING:
    from kvc.runtime.method_api import KVLayout

BACKENDS = ("torch", "triton")


COPY_BYTES = 256 * 2**20  # K or V bytes gathered at once by copy_pages


def kv_bytes_per_page(num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page (one layer's page_size tokens) costs, keys and values together."""
    return 2 * num_kv_heads * page_size * head_dim * dtype.itemsize


def layer_page_bytes(layout: KVLayout, num_kv_heads: int, page_size: int) -> int:
    """Bytes one page of the pool costs (one layer's page_size tokens): the layout's K/V bytes
    plus its state planes. The engine sizes its pool with it and the throughput plan counts
    with it, so the two cannot disagree."""
    return (layout.bytes_per_token + layout.state_bytes_per_token(num_kv_heads)) * page_size


def pool_pages(kv_memory: int, page_bytes: int) -> int:
    """Pages `kv_memory` bytes buy at `page_bytes` each (at least one)."""
    return max(1, kv_memory // page_bytes)


def load_ops(backend: str, device: torch.device, variant: str = "plain") -> ModuleType:
    """The module implementing store_kv / paged_decode / paged_prefill for `backend`: the torch ops,
    or the generated Triton kernels of attention variant `variant` (the method's manifest names it)."""
    if backend == "torch":
        return torch_ops
    if backend != "triton":
        raise ConfigError(f"attention backend must be one of {BACKENDS}, got {backend!r}",
                          param="attention_backend")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"the triton attention backend runs on CUDA devices, not {device.type!r} "
            "(set TRITON_INTERPRET=1 to emulate it, slowly)",
            param="attention_backend",
        )
    from kvc.runtime.attention import triton_ops

    try:
        return triton_ops.load(variant)
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"the triton attention backend needs the `triton` package ({err}); install it with "
            "`pip install kvc[triton]` or use attention_backend='torch'",
            param="attention_backend",
        ) from err
    except KeyError as err:
        raise ConfigError(f"the method's manifest names {err.args[0]}", param="method") from None


class PagedAttention:
    """The global paged K/V pool, k_cache and v_cache each [num_pages, Hkv, page_size, D] (a page
    belongs to one layer of one sequence at a time), and a backend."""

    def __init__(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str = "torch", num_layers: int = 1
    ) -> None:
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
            raise ValueError(
                "k_cache and v_cache must both be [num_pages, num_kv_heads, page_size, head_dim], "
                f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
            )
        self.num_layers = num_layers
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.backend = backend
        self.variant = "plain"
        self.ops = load_ops(backend, k_cache.device)
        self._stats: torch.Tensor | None = None  # decode statistics buffer, reused across layers
        self.planes: dict[str, torch.Tensor] = {}  # state planes, name -> [num_pages + 1, Hkv, page_size]

    def add_planes(self, names: tuple[str, ...]) -> None:
        """Allocates the state planes in `names` that are not there yet (zeroed)."""
        missing = tuple(n for n in names if n not in self.planes)
        self.planes.update(state_planes.allocate(missing, self.num_pages, self.k_cache.shape[1], self.page_size,
                                                 self.k_cache.device))

    @torch.no_grad()
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page src[i] -> page dst[i]: K, V and every state plane (a page's whole content), at
        most COPY_BYTES of K (or V) gathered at once. Copy-on-write, clones and prunes call it."""
        if not src:
            return
        device = self.k_cache.device
        src_t = torch.tensor(src, dtype=torch.long, device=device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=device)
        step = max(1, COPY_BYTES // (self.k_cache[0].numel() * self.k_cache.element_size()))
        for cache in (self.k_cache, self.v_cache, *self.planes.values()):
            for i in range(0, len(src), step):
                cache.index_copy_(0, dst_t[i : i + step], cache.index_select(0, src_t[i : i + step]))

    @property
    def scratch_page(self) -> int:
        """The planes' scratch page (batch padding writes there)."""
        return self.num_pages

    def use_variant(self, variant: str) -> None:
        """Run the generated attention kernels of `variant` (what the method's manifest names)."""
        if variant != self.variant:
            self.ops = load_ops(self.backend, self.k_cache.device, variant)
            self.variant = variant

    def stats_request(self, fold: StatsFold, num_decodes: int, num_heads: int, width: int) -> DecodeStats:
        """A decode-statistics request over a contiguous [num_decodes, R, width] float32 view of one
        buffer kept across layers and steps (grown, never shrunk; the kernels write every entry).
        CUDA graphs capture views of it: the runner asks for the largest request before capturing,
        so it is never reallocated under a captured graph."""
        shape = (num_decodes, fold.rows(num_heads, self.k_cache.shape[1]), width)
        numel = shape[0] * shape[1] * shape[2]
        if self._stats is None or self._stats.numel() < numel:
            self._stats = torch.empty(numel, dtype=torch.float32, device=self.k_cache.device)
        return DecodeStats(fold.reduce, fold.fn, self._stats[:numel].view(shape))

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        page_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: str = "torch",
        state_planes: tuple[str, ...] = (),
    ) -> PagedAttention:
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        k_cache = torch.zeros(shape, dtype=dtype, device=device)
        v_cache = torch.zeros(shape, dtype=dtype, device=device)
        attention = cls(k_cache, v_cache, backend, num_layers)
        attention.add_planes(state_planes)
        return attention

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    def store(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        """Writes the step's keys/values into their slots of layer `layer_idx` (no attention: a
        replayed prefill, runtime/prefill_record.py, needs only the stored K/V)."""
        self.ops.store_kv(k, v, self.k_cache, self.v_cache, md.slot_mapping[layer_idx])

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        stats: DecodeStats | None = None,
    ) -> torch.Tensor:
        """Attention output [T, Hq, D] for the step's queries q [T, Hq, D] (k, v: [T, Hkv, D]);
        with `stats`, the decode rows' attention statistics also land in `stats.out`.

        Rows past cu_seqlens_q[-1] (if any) are left unwritten. A decode-only step
        (num_decodes == B) touches no host value: it can be captured in a CUDA graph with the
        triton backend.
        """
        k_cache, v_cache = self.k_cache, self.v_cache
        tables, lens = md.block_tables[layer_idx], md.context_lens[layer_idx]
        starts = None if md.kv_starts is None else md.kv_starts[layer_idx]  # [B, Hkv]
        ops = self.ops
        self.store(layer_idx, k, v, md)
        out = torch.empty_like(q)
        num_decodes = md.num_decodes
        if num_decodes > 0:
            ops.paged_decode(
                q[:num_decodes], k_cache, v_cache,
                tables[:num_decodes], lens[:num_decodes], scale,
                max_context_len=md.max_context_len, out=out[:num_decodes],
                kv_starts=None if starts is None else starts[:num_decodes], stats=stats,
            )
        if md.num_prefills > 0:
            # Each decode owns exactly one token, so the prefill tokens start at num_decodes.
            ops.paged_prefill(
                q[num_decodes:], k_cache, v_cache,
                tables[num_decodes:], md.cu_seqlens_q[num_decodes:] - num_decodes,
                lens[num_decodes:], scale, md.max_query_len,
                out=out[num_decodes:], kv_starts=None if starts is None else starts[num_decodes:],
            )
        return out
