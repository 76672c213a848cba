"""The attention layer's entry point: owns the paged KV tensors and routes a step to the kernels.

The model runner calls `PagedAttention.forward` once per layer with the step's new q/k/v and its
`AttentionMetadata`. The step's K/V are stored first; then the decoding sequences (the first
`num_decodes`, one token each) go to `paged_decode` and the prefill chunks to `paged_prefill`,
both writing into one output tensor. `backend` picks the implementation: "torch"
(`torch_ops.py`, CPU, the parity oracle) or "triton" (`triton_ops.py`, GPU). The kernels see one
layer: the pool plus that layer's row of the per-layer tables, lengths, slots and (per-head
variable counts only) KV-head start slots.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.errors import ConfigError

BACKENDS = ("torch", "triton")


def kv_bytes_per_page(num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page (one layer's page_size tokens) costs, keys and values together."""
    return 2 * num_kv_heads * page_size * head_dim * dtype.itemsize


def load_ops(backend: str, device: torch.device) -> ModuleType:
    """The module implementing store_kv / paged_decode / paged_prefill for `backend`."""
    if backend == "torch":
        return torch_ops
    if backend != "triton":
        raise ConfigError(f"attention backend must be one of {BACKENDS}, got {backend!r}",
                          param="attention_backend")
    try:
        from kvc.runtime.attention import triton_ops
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"the triton attention backend needs the `triton` package ({err}); install it with "
            "`pip install kvc[triton]` or use attention_backend='torch'",
            param="attention_backend",
        ) from err
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            f"the triton attention backend runs on CUDA devices, not {device.type!r} "
            "(set TRITON_INTERPRET=1 to emulate it, slowly)",
            param="attention_backend",
        )
    return triton_ops


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
        self.ops = load_ops(backend, k_cache.device)

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
    ) -> PagedAttention:
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        k_cache = torch.zeros(shape, dtype=dtype, device=device)
        v_cache = torch.zeros(shape, dtype=dtype, device=device)
        return cls(k_cache, v_cache, backend, num_layers)

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention output [T, Hq, D] for the step's queries q [T, Hq, D] (k, v: [T, Hkv, D]).

        Rows past cu_seqlens_q[-1] (if any) are left unwritten. A decode-only step
        (num_decodes == B) touches no host value: it can be captured in a CUDA graph with the
        triton backend.
        """
        k_cache, v_cache = self.k_cache, self.v_cache
        tables, lens = md.block_tables[layer_idx], md.context_lens[layer_idx]
        starts = None if md.kv_starts is None else md.kv_starts[layer_idx]  # [B, Hkv]
        ops = self.ops
        ops.store_kv(k, v, k_cache, v_cache, md.slot_mapping[layer_idx])
        out = torch.empty_like(q)
        num_decodes = md.num_decodes
        if num_decodes > 0:
            ops.paged_decode(
                q[:num_decodes], k_cache, v_cache,
                tables[:num_decodes], lens[:num_decodes], scale,
                max_context_len=md.max_context_len, out=out[:num_decodes],
                kv_starts=None if starts is None else starts[:num_decodes],
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
