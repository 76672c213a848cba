"""Two KV methods written only against the contract (runtime/method_api.py), outside methods/: the
proof that the engine runs a sparse and a quantizing method with no change of its own.

- `PageTopK`: per-page key max/min summaries (PAGE tensors kept current by the store); each decode
  step reads, per KV head, the `pages` pages with the highest bound sum_d max(q k_max, q k_min)
  over the head's query group (Quest's page bound), the newest page always: a `ReadPlan`.
- `Int8Keys`: keys stored as int8 codes with one float32 scale per token (symmetric), values dense;
  the newest `window` stored keys stay in full precision in a residual window (a SEQ tensor); when
  the window is full, prefill end and step end return a `RewritePlan` that re-encodes it.

Their oracles: tests/references/contract_methods.py (dense attention over the selected pages, or
over the dequantized keys with the window in full precision).
"""

from __future__ import annotations

import torch

from kvc.runtime.kv.spec import Dense, Extent, KVSpec, Quantized, Summary, TensorSpec, dense_spec
from kvc.runtime.method_api import DecodeView, Hook, MethodBase, PrefillView, ReadPlan, RewritePlan, StepView


class PageTopK(MethodBase):
    name = "contract_pagetopk"
    hooks = frozenset({Hook.DECODE_BEFORE_ATTENTION})

    def __init__(self, pages: int = 2) -> None:
        self.pages = pages
        self.params = {"pages": pages}

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec:
        summaries = (TensorSpec("kmax", Extent.PAGE, torch.float32, (head_dim,)),
                     TensorSpec("kmin", Extent.PAGE, torch.float32, (head_dim,)))
        return dense_spec(head_dim, dtype, summaries, (Summary("kmax", "k", "max"), Summary("kmin", "k", "min")))

    def decode_before_attention(self, layer: int, view: DecodeView) -> ReadPlan:
        store = view.store
        tables = view.block_tables.long()  # [B, W]
        batch, width = tables.shape
        kv_heads, group = view.k.shape[1], view.q.shape[1] // view.k.shape[1]
        kmax = store["kmax"][tables].permute(0, 2, 1, 3)  # [B, Hkv, W, D]
        kmin = store["kmin"][tables].permute(0, 2, 1, 3)
        q = view.q.float().view(batch, kv_heads, group, 1, -1)  # [B, Hkv, G, 1, D]
        bound = torch.maximum(q * kmax[:, :, None], q * kmin[:, :, None]).sum(-1).amax(2)  # [B, Hkv, W]
        stored = -(-view.context_lens.long() // store.page_size)  # pages per row
        column = torch.arange(width, device=tables.device)[None, :]
        bound = bound.masked_fill((column >= stored[:, None])[:, None], float("-inf"))
        bound = bound.masked_fill((column == stored[:, None] - 1)[:, None], float("inf"))  # the newest page
        top = bound.topk(min(self.pages, width), dim=-1)
        pages = torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))
        return ReadPlan(pages=pages.to(torch.int32))


class Int8Keys(MethodBase):
    name = "contract_int8keys"
    hooks = frozenset({Hook.PREFILL_END, Hook.STEP_END})
    rewrites = True

    def __init__(self, window: int = 8) -> None:
        self.window = window
        self.params = {"window": window}

    def kv_spec(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, page_size: int) -> KVSpec:
        tensors = (TensorSpec("k_codes", Extent.TOKEN, torch.int8, (head_dim,)),
                   TensorSpec("k_scale", Extent.TOKEN, torch.float32, (1,)),
                   TensorSpec("k_resid", Extent.SEQ, dtype, (self.window, head_dim)),
                   TensorSpec("v", Extent.TOKEN, dtype, (head_dim,)))
        keys = Quantized("k_codes", "k_scale", bits=8, group=head_dim, residual="k_resid")
        return KVSpec(tensors, keys=keys, values=Dense("v"))

    def _flush(self, cache) -> RewritePlan | None:
        """The whole window re-encoded once it is full."""
        if cache.resid_len < self.window:
            return None
        return RewritePlan(cache.length - cache.resid_len, cache.length)

    def prefill_end(self, layer: int, view: PrefillView) -> RewritePlan | None:
        return self._flush(view.cache)

    def step_end(self, layer: int, view: StepView) -> RewritePlan | None:
        return self._flush(view.cache)
