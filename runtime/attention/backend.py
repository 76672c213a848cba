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

The tensors live in a `KVStore` (runtime/kv/store.py) built from the method's KV spec: K/V, the
method's per-token state (`planes`) and page summaries, all addressed by the same page ids; a
step's store refreshes the summaries of the pages it wrote (a decode-only step on the GPU folds
its one token per sequence into them instead: `KVStore.append_summaries`). A method whose layers
store K/V differently (storage classes, runtime/kv/spec.py `StorageClasses`) has one store per
class; a layer reads and writes its class's (`store_of`), whose pages are the pool's ids of that
class from its first (`page_starts`: the page tables the kernels see hold the store's indices,
runtime/kv/tables.py).

Decode statistics: `forward(..., stats=DecodeStats)` asks the decode kernels to also emit the
step's attention probabilities, folded as the method reads them (metadata.py); `stats_request`
gives a request over one float32 buffer reused across layers (grown as needed).
"""

from __future__ import annotations

import bisect
import math
import os
from types import ModuleType
from functools import cached_property, partial

import torch

from kvc.runtime.attention import delta_ops, torch_ops
from kvc.runtime.attention.latent_prefill import decompressed_prefill
from kvc.runtime.attention.sdpa_prefill import sdpa_prefill
from kvc.runtime.attention.metadata import AttentionMetadata, DecodeStats, StatsFold
from kvc.runtime.errors import ConfigError
from kvc.runtime.attention.sources import LowRankPages, QuantizedPages, Source
from kvc.runtime.kv import query_window, slot_order
from kvc.runtime.kv.delta_pages import DeltaPages
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.kv.spec import K, V, Dense, KVSpec, LowRank, StorageClasses, dense_spec
from kvc.runtime.kv.store import KVStore
from kvc.runtime.models.base import LatentQueries

BACKENDS = ("torch", "triton")


def kv_bytes_per_page(num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one page of dense K/V (one layer's page_size tokens) costs, keys and values together."""
    return dense_spec(head_dim, dtype).bytes_per_page(num_kv_heads, page_size)


def layer_page_bytes(spec: KVSpec, num_kv_heads: int, page_size: int) -> int:
    """Bytes one page of the pool costs (one layer's page_size slots of every TOKEN tensor of the
    spec, plus its PAGE tensors). The engine sizes its pool with it and the throughput plan counts
    with it, so the two cannot disagree."""
    return spec.bytes_per_page(num_kv_heads, page_size)


def last_in_page(slots: torch.Tensor, page_size: int, scratch_page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pages [T], stored [T]) of a step's new tokens `slots [T]` (-1: padding) for a summary
    refresh: each token that is the last of the step in its page names that page and how many of
    its slots are stored after the step; every other token (and padding) names the scratch page
    with 0. Static shapes, no host read (CUDA-graph safe). A sequence's tokens in one page are
    consecutive in the step and ascending, so "the next token lies in another page" finds them."""
    slots = slots.long()
    pages = torch.where(slots >= 0, slots // page_size, torch.full_like(slots, -1))
    following = torch.cat([pages[1:], pages.new_full((1,), -2)])
    last = (slots >= 0) & (following != pages)
    pages = torch.where(last, pages, torch.full_like(pages, scratch_page))
    return pages, torch.where(last, slots % page_size + 1, torch.zeros_like(slots))


def pool_pages(kv_memory: int, page_bytes: int) -> int:
    """Pages `kv_memory` bytes buy at `page_bytes` each (at least one)."""
    return max(1, kv_memory // page_bytes)


def class_pages(kv_memory: int, classes: StorageClasses, num_kv_heads: int, page_size: int) -> list[int]:
    """Pages of each storage class `kv_memory` bytes buy, sized so that the classes run out together
    when every layer stores as many tokens: class c gets `kv_memory x layers_c / sum_c' layers_c' x
    page_bytes_c'` (one class: `pool_pages`). The engine and the throughput plan both size with it."""
    page_bytes = [layer_page_bytes(s, num_kv_heads, page_size) for s in classes.specs]
    if len(page_bytes) == 1:
        return [pool_pages(kv_memory, page_bytes[0])]
    layers = [len(classes.layers(c)) for c in range(classes.num_classes)]
    per_layer = pool_pages(kv_memory, sum(n * b for n, b in zip(layers, page_bytes)))
    return [per_layer * n for n in layers]


ROW_SHARE = 0.5  # the most of the KV budget per-sequence rows may take before the engine holds fewer
IDLE_ROW_SHARE = 0.02  # the most of it the rows idle chains keep may take, where a row a chain is more


def seq_rows(max_num_seqs: int, row_bytes: int, kv_memory: int) -> int:
    """Rows of per-sequence tensors an engine holds (0 when its specs have none, `row_bytes` 0): one a running
    sequence, and one an idle chain (its record keeps its last turn's row) where those cost at most
    IDLE_ROW_SHARE of the KV budget, else as many for idle chains as that share buys (rows sized by the longest
    context, as a cluster index's: admission evicts an idle chain for a row, as for pages). Where the rows would
    take more than ROW_SHARE of the budget, as many as that share buys, at least two (then the rows bound how many
    sequences run). The engine and the throughput plan both count with it."""
    if not row_bytes:
        return 0
    idle = max_num_seqs
    if max_num_seqs * row_bytes > IDLE_ROW_SHARE * kv_memory:
        idle = int(IDLE_ROW_SHARE * kv_memory) // row_bytes
    rows = max_num_seqs + idle
    if rows * row_bytes > ROW_SHARE * kv_memory:
        rows = max(2, int(ROW_SHARE * kv_memory) // row_bytes)
    return rows


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
    """The attention layer over a `KVStore` (runtime/kv/store.py: every tensor of the method's KV
    spec, paged; a page belongs to one layer of one sequence at a time) and a backend."""

    def __init__(self, store: KVStore | list[KVStore], backend: str = "torch", num_layers: int = 1,
                 layer_class: tuple[int, ...] | None = None, mla_prefill: str = "absorbed",
                 prefill_attention: str = "kernel") -> None:
        self.num_layers = num_layers
        # MLA's prefill chunks: "absorbed" (the latent kernels) or "decompressed" (latent_prefill.py)
        self.mla_prefill = mla_prefill
        # dense layers' prefill chunks: "kernel" (the backend's paged prefill) or "sdpa" (sdpa_prefill.py)
        self.prefill_attention = prefill_attention
        self.stores = list(store) if isinstance(store, list) else [store]
        self.layer_class = tuple(layer_class) if layer_class is not None else (0,) * num_layers
        # the stores its layers use: an engine serving several methods hands every lane all of the pool's
        # stores, each lane's layers using some (runtime/lanes.py)
        self.used = [self.stores[c] for c in sorted(set(self.layer_class))]
        # each class's first page id in the pool (its store's page 0)
        self.page_starts = [sum(s.num_pages for s in self.stores[:c]) for c in range(len(self.stores))]
        self.backend = backend
        self.variant = "plain"
        self.ops = load_ops(backend, self.stores[0].device)
        self.class_ops = [self.ops] * len(self.stores)  # each storage class's kernels (`use_variants`)
        self.variants = ["plain"] * len(self.stores)
        self._stats: torch.Tensor | None = None  # decode statistics buffer, reused across layers
        # a spec storing keys before RoPE builds its sources once the runner gives the RoPE (`use_rope`)
        waits = any(s.spec.prerope and s.rope_freq is None for s in self.stores)
        self._sources = [] if waits else [self._layer_sources(layer) for layer in range(num_layers)]

    @property
    def store(self) -> KVStore:
        """The store (a method with one storage class; otherwise `store_of(layer)`)."""
        if len(self.stores) > 1:
            raise TypeError(f"the KV cache has {len(self.stores)} storage classes: ask store_of(layer)")
        return self.stores[0]

    def store_of(self, layer: int) -> KVStore:
        """Layer `layer`'s store (its storage class's)."""
        return self.stores[self.layer_class[layer]]

    @property
    def num_rows(self) -> int:
        """Rows of the per-sequence tensors (every class with any has as many; 0: none)."""
        return max(s.num_rows for s in self.stores)

    @property
    def scratch_row(self) -> int:
        return self.num_rows

    @property
    def residual_window(self) -> int:
        """Slots a residual window holds (the largest of the classes'; 0: none)."""
        return max(s.residual_window for s in self.used)

    def window_after(self, length: int) -> int:
        return max(s.window_after(length) for s in self.used)

    @property
    def flushes_blocks(self) -> bool:
        return self.flush_block > 0

    @property
    def flush_block(self) -> int:
        """Tokens a block of codes spans where a spec writes them a block at a time (0: none; every
        class's block divides it)."""
        blocks = [s.flush_block for s in self.used if s.flush_block]
        return math.lcm(*blocks) if blocks else 0

    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Row src[i] -> row dst[i] in every store with per-sequence tensors."""
        for store in self.stores:
            if store.num_rows:
                store.copy_rows(src, dst)

    @classmethod
    def from_caches(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, backend: str = "torch",
                    num_layers: int = 1) -> PagedAttention:
        """Over existing dense K/V tensors `[pages, Hkv, page_size, D]` (tests, tools): the last page
        is the store's scratch page."""
        if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
            raise ValueError("k_cache and v_cache must both be [num_pages, num_kv_heads, page_size, head_dim], "
                             f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        spec = dense_spec(k_cache.shape[3], k_cache.dtype)
        store = KVStore.from_tensors(spec, {K: k_cache, V: v_cache}, num_layers)
        return cls(store, backend, num_layers)

    def _layer_sources(self, layer: int) -> tuple[Source, Source]:
        """What the kernels read layer `layer`'s K and V from, as the spec encodes them: the dense
        tensor, or a `QuantizedPages` (codes, scales, zero points, this layer's residual rows)."""
        store = self.store_of(layer)
        enc = store.spec.delta
        if enc is not None:  # one code for K and V: one source read through delta_ops
            pages = DeltaPages(enc, store[enc.latent], store[enc.neighbours], store[enc.centers],
                               None if enc.sinks is None else store[enc.sinks][:, layer], store[enc.window][:, layer],
                               store[enc.down][layer], store[enc.up][layer],
                               None if enc.bias is None else store[enc.bias][layer], store.rope_freq)
            return pages, pages

        def source(enc, which: str) -> Source:
            if isinstance(enc, Dense):
                return enc.view(store[enc.tensor])
            if isinstance(enc, LowRank):
                return LowRankPages(enc, store[enc.latent], store[enc.down][layer], store[enc.up][layer],
                                    store.head_dim(which), store.model_dtype(which), store.rope_freq)
            zero = None if enc.zero is None else store.scale_slots(enc.zero, layer)
            residual = None if enc.residual is None else store[enc.residual][:, layer]
            scale = store.scale_slots(enc.scale, layer)  # a LAYER scale (FP8) seen at every slot
            return QuantizedPages(enc, enc.view(store[enc.codes]), scale, zero, store.head_dim(which),
                                  store.model_dtype(which), residual)

        return source(store.spec.keys, K), source(store.spec.values, V)

    def delta_source(self, layer: int) -> DeltaPages | None:
        """Layer `layer`'s DeltaKV store (runtime/kv/delta_pages.py), or None where it stores no delta code."""
        source = self._layer(layer)[0]
        return source if isinstance(source, DeltaPages) else None

    def _layer(self, layer: int) -> tuple[Source, Source]:
        if not self._sources:
            raise RuntimeError("the KV spec stores keys before RoPE: give the model's RoPE (use_rope) first")
        return self._sources[layer]

    def use_rope(self, inv_freq: torch.Tensor) -> None:
        """The model's RoPE frequencies [D / 2], for a spec that stores keys before RoPE (the runner
        calls it before any step): the store's dense reads and the sources rotate keys with them."""
        for store in self.stores:
            store.rope_freq = inv_freq.to(store.device, torch.float32)
        self._sources = [self._layer_sources(layer) for layer in range(self.num_layers)]

    @property
    def k_cache(self) -> torch.Tensor:
        """The dense keys of the store, `[pages + 1, Hkv, page_size, D]`."""
        return self.store.k_cache

    @property
    def v_cache(self) -> torch.Tensor:
        return self.store.v_cache

    @property
    def planes(self) -> dict[str, torch.Tensor]:
        """The method's per-token tensors (state planes), by name."""
        return self.store.method_tensors()

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page src[i] -> page dst[i] (pool ids; both of one class): every tensor of the spec (a page's
        whole content)."""
        if len(self.stores) == 1:
            self.stores[0].copy_pages(src, dst)
            return
        by_class: dict[int, tuple[list[int], list[int]]] = {}
        for a, b in zip(src, dst):
            cls = self.class_of_page(a)
            first = self.page_starts[cls]
            pair = by_class.setdefault(cls, ([], []))
            pair[0].append(a - first)
            pair[1].append(b - first)
        for cls, (a, b) in by_class.items():
            self.stores[cls].copy_pages(a, b)

    def class_of_page(self, page: int) -> int:
        """The storage class a pool page id belongs to (`page_starts` ascend)."""
        return bisect.bisect_right(self.page_starts, page) - 1

    @property
    def scratch_page(self) -> int:
        """The store's scratch page (batch padding writes there)."""
        return self.store.scratch_page

    def use_variant(self, variant: str) -> None:
        """Run the generated attention kernels of `variant` (what the method's manifest names)."""
        self.use_variants([variant] * len(self.stores))

    def use_variants(self, variants: list[str]) -> None:
        """Each storage class's variant (`use_variant`)."""
        loaded = {}
        for cls, variant in enumerate(variants):
            if variant != self.variants[cls]:
                if variant not in loaded:
                    loaded[variant] = load_ops(self.backend, self.stores[0].device, variant)
                self.class_ops[cls] = loaded[variant]
                self.variants[cls] = variant
        self.ops, self.variant = self.class_ops[0], self.variants[0]

    def stats_request(self, fold: StatsFold, num_decodes: int, num_heads: int, width: int) -> DecodeStats:
        """A decode-statistics request over a contiguous [num_decodes, R, width] float32 view of one
        buffer kept across layers and steps (grown, never shrunk; the kernels write every entry).
        CUDA graphs capture views of it: the runner asks for the largest request before capturing,
        so it is never reallocated under a captured graph."""
        store = self.stores[0]
        shape = (num_decodes, fold.rows(num_heads, store.num_kv_heads), width)
        numel = shape[0] * shape[1] * shape[2]
        if self._stats is None or self._stats.numel() < numel:
            self._stats = torch.empty(numel, dtype=torch.float32, device=store.device)
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
        spec: KVSpec | StorageClasses | None = None,
        num_rows: int = 0,
        num_pages_by_class: list[int] | None = None,
    ) -> PagedAttention:
        """A store of `spec` (None: dense K/V of `head_dim` in `dtype`) over `num_pages` pages; with
        storage classes, one store per class over `num_pages_by_class[c]` pages."""
        spec = spec if spec is not None else dense_spec(head_dim, dtype)
        load_ops(backend, torch.device(device))  # a bad backend fails before the pool is allocated
        if isinstance(spec, KVSpec):
            spec = StorageClasses.single(spec, num_layers)
        sizes = num_pages_by_class or [num_pages]
        stores = [KVStore(s, n, num_kv_heads, page_size, num_layers, device, num_rows)
                  for s, n in zip(spec.specs, sizes)]
        return cls(stores, backend, num_layers, spec.layer_class)

    @property
    def num_pages(self) -> int:
        return sum(s.num_pages for s in self.stores)

    @property
    def page_size(self) -> int:
        return self.stores[0].page_size

    def key_offset(self, layer: int) -> torch.Tensor | None:
        """[Hkv, D]: what layer `layer`'s keys are stored relative to (`Quantized.offset`: the backend
        subtracts it from a step's keys before storing them or attending to them), or None."""
        return self._key_offsets[layer]

    def _relative_keys(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """A step's keys [T, Hkv, D] as layer `layer` stores and attends to them: minus its offset, if any."""
        offset = self._key_offsets[layer]
        return k if offset is None else k - offset

    @cached_property
    def _key_offsets(self) -> list[torch.Tensor | None]:
        out = []
        for layer in range(len(self.layer_class)):
            store = self.store_of(layer)
            name = getattr(store.spec.keys, "offset", None)
            out.append(None if name is None else store[name][layer])
        return out

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> None:
        """Writes the step's keys/values into their slots of layer `layer_idx` (no attention: a
        replayed prefill, runtime/prefill_record.py, needs only the stored K/V)."""
        self._write(layer_idx, self._relative_keys(layer_idx, k), v, md)

    def _write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
               window_tokens: int | None = None) -> None:
        """`write` of keys already relative to the layer's offset; `window_tokens` n: only tokens [0, n)
        enter residual windows now (`forward`: the prefill chunks' after their attention)."""
        slots = md.slot_mapping[layer_idx]
        k_src, v_src = self._layer(layer_idx)
        store = self.store_of(layer_idx)
        if isinstance(k_src, DeltaPages):
            delta_ops.store(k_src, k, v, md, layer_idx)
            return
        ops = self.class_ops[self.layer_class[layer_idx]]
        if md.num_prefills > 0:  # dynamic FP8 scales: fixed by the first prefill step (every sequence starts
            # with one), so decode steps, and the decode graphs captured before any request, never settle
            store.settle_scales(layer_idx, k, v, slots)
        windowed = md.resid_lens is not None and store.residual_window > 0
        if not windowed and not store.spec.prerope:
            ops.store_kv(k, v, k_src, v_src, slots)
        elif not windowed:  # keys stored before RoPE: each new token's slot is its position
            ops.store_kv(k, v, k_src, v_src, slots, cu_seqlens_q=md.cu_seqlens_q,
                              context_lens=md.context_lens[layer_idx])
        else:  # a residual window: each new token finds its sequence's row
            ops.store_kv(k, v, k_src, v_src, slots, cu_seqlens_q=md.cu_seqlens_q,
                              context_lens=md.context_lens[layer_idx], rows=md.rows, window_tokens=window_tokens,
                              **({"block_tables": md.block_tables[layer_idx], "resid_lens": md.resid_lens[layer_idx]}
                                 if store.flushes_blocks else {}))
        if store.spec.positions is not None and md.positions is not None:
            slot_order.record(store[store.spec.positions], slots, md.positions, self.backend)
        if not store.spec.summaries:
            return
        if store.folds_summaries:  # of the rows as computed: the codes of a block come when it is full
            store.fold_summaries(k, v, slots)
        elif self.backend == "triton" and md.num_prefills == 0 and store.appends_summaries:
            store.append_summaries(slots)  # one token per sequence: fold it in, one launch a summary
        else:
            store.refresh_summaries(*last_in_page(slots, store.page_size, store.scratch_page), layer_idx)

    def _prefills_by_sdpa(self, q: torch.Tensor, k_cache: Source, v_cache: Source, resid: torch.Tensor | None,
                          starts: torch.Tensor | None, store: KVStore) -> bool:
        """Do this step's prefill chunks take `sdpa_prefill`: asked for, K/V stored dense in the model's
        dtype with values as wide as keys, no per-head starts or residual window?"""
        return (self.prefill_attention == "sdpa" and isinstance(k_cache, torch.Tensor)
                and isinstance(v_cache, torch.Tensor) and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
                and v_cache.shape[-1] == k_cache.shape[-1] and resid is None and starts is None
                and not store.spec.exact_chunks and not store.spec.prerope)

    @cached_property
    def keeps_queries(self) -> bool:
        """Does some class's spec keep decode query windows (runtime/kv/query_window.py)?"""
        return any(query_window.QUERIES in store.tensors for store in self.used)

    def record_queries(self, layer: int, q: torch.Tensor, md: AttentionMetadata) -> None:
        """The step's queries q [T, Hq, D] into their rows' decode query windows in `layer`, where its class's spec
        keeps them (runtime/kv/query_window.py)."""
        store = self.store_of(layer)
        if query_window.QUERIES in store.tensors:
            query_window.record(store.tensors, layer, q, md.rows, md.num_decodes, md.host_cu_seqlens, md.host_rows,
                                self.backend)

    def store_fresh(self, layer: int, k: torch.Tensor, v: torch.Tensor, table: list[int], row: int | None) -> None:
        """k, v [m, Hkv, D] as slots [0, m) of a sequence's layer over page table `table` (indices of the
        layer's store, `TableCache.local`), stored as
        a fresh prefill of m tokens would be: encoded (codes a block at a time where the spec says),
        the newest in the row's residual window (which then holds min(m, W) of them). What a keep
        plan over a spec with flush blocks does after choosing the tokens (runtime/kv/executor.py)."""
        m, device = k.shape[0], k.device
        store = self.store_of(layer)
        page = store.page_size
        tables = torch.tensor(table, dtype=torch.int32, device=device)
        at = torch.arange(m, device=device)
        slots = tables.long()[at // page] * page + at % page
        k_src, v_src = self._layer(layer)
        as_int = partial(torch.tensor, dtype=torch.int32, device=device)
        torch_ops.store_kv(k, v, k_src, v_src, slots, cu_seqlens_q=as_int([0, m]), context_lens=as_int([m]),
                           rows=as_int([store.scratch_row if row is None else row]), block_tables=tables[None])
        if store.folds_summaries:
            store.fold_summaries(k, v, slots)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        stats: DecodeStats | None = None,
        read: ReadPlan | None = None,
        latent: LatentQueries | None = None,
    ) -> torch.Tensor:
        """Attention output [T, Hq, D] for the step's queries q [T, Hq, D] (k, v: [T, Hkv, D]);
        with `stats`, the decode rows' attention statistics also land in `stats.out`; with `read`
        (a method's ReadPlan) each decode row's KV heads attend only to the slots it lists. With
        `latent` (MLA, runtime/models/base.py) the output is the up-projected values [T, Hq,
        latent.value_dim], the prefill rows attended in the form `mla_prefill` names.

        Rows past cu_seqlens_q[-1] (if any) are left unwritten. A decode-only step
        (num_decodes == B) touches no host value: it can be captured in a CUDA graph with the
        triton backend.
        """
        k_cache, v_cache = self._layer(layer_idx)
        if isinstance(k_cache, DeltaPages):  # stored tokens decoded per sequence, then the step's stored
            if stats is not None or (read is not None and read.tokens is None):
                raise NotImplementedError("a delta-coded layer takes token read plans, not page plans or decode "
                                          "statistics")
            kernels = self.class_ops[self.layer_class[layer_idx]] if self.backend == "triton" else None
            return delta_ops.forward(k_cache, q, k, v, md, layer_idx, scale, read, kernels=kernels)
        store = self.store_of(layer_idx)
        k = self._relative_keys(layer_idx, k)  # every key of the step's softmax and store (`key_offset`)
        tables, lens = md.block_tables[layer_idx], md.context_lens[layer_idx]
        resid = None if md.resid_lens is None or not store.residual_window else md.resid_lens[layer_idx]
        extra_d = {} if resid is None else {"rows": md.rows[:md.num_decodes], "resid_lens": resid[:md.num_decodes]}
        extra_p = {} if resid is None else {"rows": md.rows[md.num_decodes:], "resid_lens": resid[md.num_decodes:]}
        if resid is not None or store.spec.exact_chunks:  # a chunk reads itself as computed (paged_prefill)
            extra_p.update(k_new=k[md.num_decodes:], v_new=v[md.num_decodes:])
        if read is not None:
            extra_d["read"] = read
        starts = None if md.kv_starts is None else md.kv_starts[layer_idx]  # [B, Hkv]
        ops = self.class_ops[self.layer_class[layer_idx]]
        # a prefill chunk reads the window's older slots, which its own would overwrite: they enter after
        self._write(layer_idx, k, v, md, window_tokens=None if resid is None else md.num_decodes)
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # MLA's values are narrower than its keys
        num_decodes = md.num_decodes
        decompress = latent is not None and self.mla_prefill == "decompressed" and md.num_prefills > 0
        if num_decodes > 0:
            ops.paged_decode(
                q[:num_decodes], k_cache, v_cache,
                tables[:num_decodes], lens[:num_decodes], scale,
                max_context_len=md.max_context_len, out=out[:num_decodes],
                kv_starts=None if starts is None else starts[:num_decodes], stats=stats, **extra_d,
            )
        host = _host_prefills(md, layer_idx)  # the prefill rows' offsets and lengths on the host, or None
        if md.num_prefills > 0 and not decompress and host is not None and self._prefills_by_sdpa(
                q, k_cache, v_cache, resid, starts, store):
            d = num_decodes
            if d == 0:  # a prefill-only step takes SDPA's output as it is
                out = sdpa_prefill(q, k, v, k_cache, v_cache, tables, *host, scale)
            else:
                sdpa_prefill(q[d:], k[d:], v[d:], k_cache, v_cache, tables[d:], *host, scale, out[d:])
        elif md.num_prefills > 0 and not decompress:
            # Each decode owns exactly one token, so the prefill tokens start at num_decodes.
            ops.paged_prefill(
                q[num_decodes:], k_cache, v_cache,
                tables[num_decodes:], md.cu_seqlens_q[num_decodes:] - num_decodes,
                lens[num_decodes:], scale, md.max_query_len,
                out=out[num_decodes:], kv_starts=None if starts is None else starts[num_decodes:], **extra_p,
            )
            if resid is not None:
                ops.store_window(k, v, k_cache, v_cache, md.slot_mapping[layer_idx], md.cu_seqlens_q, lens, md.rows,
                                 num_decodes)
        if latent is None:
            return out
        if not decompress:
            return latent.values(out)
        d = num_decodes
        values = q.new_empty(*q.shape[:2], latent.value_dim)
        values[:d] = latent.values(out[:d])
        cu, lengths = host or (md.cu_seqlens_q[d:] - d, lens[d:])
        decompressed_prefill(latent.rows(d, q.shape[0]), k_cache, tables[d:], cu, lengths, scale, values[d:],
                             kv_starts=None if starts is None else starts[d:], k_new=k[d:])
        return values


def _host_prefills(md: AttentionMetadata, layer: int) -> tuple[list[int], list[int]] | None:
    """The step's prefill rows' query offsets (from 0) and `layer`'s context lengths, from the host copies an
    eager step carries (no device sync), or None where it carries none."""
    if md.num_prefills == 0 or md.host_cu_seqlens is None or md.host_context_lens is None:
        return None
    d = md.num_decodes
    return [c - d for c in md.host_cu_seqlens[d:]], md.host_context_lens[layer][d:]
