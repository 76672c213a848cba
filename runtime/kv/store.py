"""The KV store: every tensor of a method's KV spec (runtime/kv/spec.py), allocated over the pool.

TOKEN tensors are `[pages + 1, Hkv, page_size, *shape]`, PAGE tensors `[pages + 1, Hkv, *shape]`,
SEQ tensors `[rows + 1, layers, Hkv, *shape]`, LAYER tensors `[layers, Hkv, *shape]` (FP8 scales:
1.0, or 0 until `settle_scales` sets a dynamic one); the last page and row are scratch. Page ids come
from the page pool (runtime/kv/page_pool.py), row ids from a row pool; the store only holds the
tensors and does what any spec tensor needs done: copy pages or rows, write a step's new tokens
(encoding K and V as the spec says), keep page summaries current, and decode one sequence's keys
or values for hooks that read them densely. Moving slots (keep plans) and re-encoding ranges
(rewrite plans) is the executor's (runtime/kv/executor.py). docs/design.md, "KV spec".
"""

from __future__ import annotations

import functools
import math

import torch

from kvc.runtime.kv import encodings, lowrank, rotation
from kvc.runtime.kv.spec import K, V, Delta, Dense, Extent, KVSpec, LowRank, Quantized
from kvc.runtime.transfer import to_device

COPY_BYTES = 256 * 2**20  # bytes of one tensor gathered at once by copy_pages


class KVStore:
    def __init__(self, spec: KVSpec, num_pages: int, num_kv_heads: int, page_size: int, num_layers: int,
                 device: torch.device | str, num_rows: int = 0) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.spec = spec
        self.num_pages, self.page_size = num_pages, page_size
        self.num_kv_heads, self.num_layers = num_kv_heads, num_layers
        self.num_rows = num_rows if spec.uses_rows else 0
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        for t in spec.tensors:
            if t.extent is Extent.TOKEN:
                shape = (num_pages + 1, num_kv_heads, page_size, *t.shape)
            elif t.extent is Extent.PAGE:
                shape = (num_pages + 1, num_kv_heads, *t.shape)
            elif t.extent is Extent.LAYER:
                shape = (num_layers, num_kv_heads, *t.shape)
            else:
                shape = (self.num_rows + 1, num_layers, num_kv_heads, *t.shape)
            self.tensors[t.name] = torch.zeros(shape, dtype=t.dtype, device=self.device)
        for enc in self._float_codes():
            if enc.scaling == "unit":
                self.tensors[enc.scale].fill_(1.0)
        # per layer: whether a dynamic scale may still be unset (a host flag: no device read)
        self._unsettled = [any(e.scaling == "dynamic" for e in self._float_codes())] * num_layers
        self.rope_freq: torch.Tensor | None = None  # the model's RoPE, for keys stored before it (`LowRank`)

    @classmethod
    def from_tensors(cls, spec: KVSpec, tensors: dict[str, torch.Tensor], num_layers: int) -> KVStore:
        """A store adopting existing TOKEN tensors (tests, tools); their last page is the scratch page."""
        first = tensors[spec.of(Extent.TOKEN)[0].name]
        store = cls.__new__(cls)
        store.spec = spec
        store.num_pages, store.page_size = first.shape[0] - 1, first.shape[2]
        store.num_kv_heads, store.num_layers, store.num_rows = first.shape[1], num_layers, 0
        store.device = first.device
        store.tensors = dict(tensors)
        store._unsettled = [False] * num_layers
        store.rope_freq = None
        return store

    # ---- lookups -------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def scratch_page(self) -> int:
        return self.num_pages

    @property
    def scratch_row(self) -> int:
        return self.num_rows

    @property
    def k_cache(self) -> torch.Tensor:
        """The dense keys `[pages + 1, Hkv, page_size, D]` (a spec whose keys are `Dense`)."""
        return self._dense(self.spec.keys, "keys")

    @property
    def v_cache(self) -> torch.Tensor:
        return self._dense(self.spec.values, "values")

    def _dense(self, enc, what: str) -> torch.Tensor:
        if not isinstance(enc, Dense):
            raise TypeError(f"the KV spec stores {what} encoded ({type(enc).__name__}), not as a dense tensor")
        return enc.view(self.tensors[enc.tensor])

    @property
    def flushes_blocks(self) -> bool:
        """K or V is written a block at a time (`Quantized.flush_block`): the store needs the tables."""
        return self.flush_block > 0

    @functools.cached_property
    def flush_block(self) -> int:
        """Tokens of a block of codes written at once (`Quantized.flush_block`; 0: token by token)."""
        blocks = [e.flush_block for e in (self.spec.keys, self.spec.values)
                  if isinstance(e, Quantized) and e.flush_block]
        return math.lcm(*blocks) if blocks else 0

    def window_after(self, length: int) -> int:
        """The slots a sequence's residual window holds after a keep plan left `length`: none (moved
        slots are read from their codes), or, for a spec written a block at a time (whose kept tokens
        are stored again, runtime/kv/executor.py), the newest min(length, W)."""
        return min(length, self.residual_window) if self.flushes_blocks else 0

    @functools.cached_property
    def residual_window(self) -> int:
        """Slots a residual window holds (the K or V encoding's SEQ residual; 0: none). K's and V's
        must agree: one count per sequence and layer says how many newest slots both read from it."""
        windows = {self.spec.tensor(e.residual).shape[0] for e in (self.spec.keys, self.spec.values)
                   if isinstance(e, Quantized) and e.residual is not None}
        if len(windows) > 1:
            raise ValueError(f"the KV spec's K and V residual windows differ ({sorted(windows)}); they must agree")
        return windows.pop() if windows else 0

    def _float_codes(self) -> list[Quantized]:
        return [e for e in (self.spec.keys, self.spec.values) if isinstance(e, Quantized) and e.format]

    def scale_slots(self, name: str, layer: int | None) -> torch.Tensor:
        """Scale (or zero point) tensor `name` as a TOKEN tensor `[pages + 1, Hkv, page_size, G]`:
        itself; a PAGE tensor's one row per page (groups over tokens) seen at every slot of its page;
        or a LAYER tensor's slice for `layer`, seen at every page and slot (strides 0: no copy)."""
        t = self.tensors[name]
        extent = self.spec.tensor(name).extent
        if extent is Extent.PAGE:
            return t.as_strided((t.shape[0], t.shape[1], self.page_size, t.shape[3]),
                                (t.stride(0), t.stride(1), 0, t.stride(3)))
        if extent is not Extent.LAYER:
            return t
        if layer is None:
            raise ValueError(f"scale {name!r} is stored per layer: read it with the layer")
        at = t[layer]  # [Hkv, G]
        return at.as_strided((self.num_pages + 1, at.shape[0], self.page_size, at.shape[1]),
                             (0, at.stride(0), 0, at.stride(1)))

    def settle_scales(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Sets layer `layer`'s dynamic FP8 scales from a step's new k, v [T, Hkv, D] (`slots [T]`, -1:
        padding) where they are still unset (0), before the step is stored with them; the runner
        calls it with the first step that stores tokens (a prefill), after which the layer's scales
        are fixed and this does nothing. No host read."""
        if not self._unsettled[layer]:
            return
        self._unsettled[layer] = False
        stored = slots >= 0
        for which, x in ((K, k),) if self.spec.latent else ((K, k), (V, v)):  # a latent cache's values: K's scale
            enc = encoding_of(self.spec, which)
            if isinstance(enc, Quantized) and enc.format and enc.scaling == "dynamic":
                scale = self.tensors[enc.scale][layer]
                new = encodings.dynamic_scale(rotation.to_stored(x, enc.rotation), stored, enc.shared_heads,
                                              encodings.DYNAMIC_RANGE[which])
                scale.copy_(torch.where(scale > 0, scale, new))

    def token_tensors(self) -> list[torch.Tensor]:
        """Every TOKEN tensor (what a keep plan moves) once, dense K and V first (a latent cache's values are a
        view of the keys' tensor: it moves once)."""
        dense = [e.tensor for e in (self.spec.keys, self.spec.values) if isinstance(e, Dense)]
        return [self.tensors[name] for name in dict.fromkeys([*dense, *(t.name for t in self.spec.of(Extent.TOKEN))])]

    def method_tensors(self) -> dict[str, torch.Tensor]:
        """The method's own tensors (per-token state: H2O's `seen`), by name."""
        return {t.name: self.tensors[t.name] for t in self.spec.method_tensors}

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    # ---- copies --------------------------------------------------------------------------------
    @torch.no_grad()
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Page src[i] -> page dst[i] for every TOKEN and PAGE tensor (a page's whole content), at most
        COPY_BYTES of one tensor gathered at once. Copy-on-write, clones and prunes call it."""
        self._copy([t for t in self.spec.tensors if t.extent in (Extent.TOKEN, Extent.PAGE)], src, dst)

    @torch.no_grad()
    def copy_rows(self, src: list[int], dst: list[int]) -> None:
        """Row src[i] -> row dst[i] for every SEQ tensor (every layer)."""
        self._copy(self.spec.of(Extent.SEQ), src, dst)

    def _copy(self, specs, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        src_t, dst_t = to_device(src, self.device, torch.long), to_device(dst, self.device, torch.long)
        for t in specs:
            tensor = encodings.raw(self.tensors[t.name])
            step = max(1, COPY_BYTES // max(1, tensor[0].numel() * tensor.element_size()))
            for i in range(0, len(src), step):
                tensor.index_copy_(0, dst_t[i : i + step], tensor.index_select(0, src_t[i : i + step]))

    # ---- dense reads (hooks, prunes) -------------------------------------------------------------
    def decoded(self, which: str, page_ids: list[int], length: int, layer: int | None = None,
                row: int | None = None, resid_len: int = 0) -> torch.Tensor:
        """The keys (`which` "k") or values ("v") of one sequence's layer, slots [0, length), dense:
        [Hkv, length, D] in the stored dtype (dequantized, the residual window's full-precision
        copies for the newest of the `resid_len` slots it holds that the next step reads from it:
        torch_ops.window_reads)."""
        enc = self.spec.keys if which == K else self.spec.values
        pages = self._page_index(page_ids, length)
        if isinstance(enc, Dense):
            return enc.view(_flat(self.tensors[enc.tensor], pages, length))
        if isinstance(enc, LowRank):
            if layer is None:
                raise ValueError(f"low-rank {enc.latent!r} is read with its layer's projections: pass the layer")
            return self._low_rank(enc, _flat(self.tensors[enc.latent], pages, length), layer,
                                  torch.arange(length, device=self.device), which)
        x = encodings.dequantize(
            enc.view(_flat(self.tensors[enc.codes], pages, length)),
            _flat(self.scale_slots(enc.scale, layer), pages, length),
            None if enc.zero is None else _flat(self.scale_slots(enc.zero, layer), pages, length), enc,
            self.head_dim(which), self.model_dtype(which))
        if enc.flush_block and length:  # only the newest, unfinished block is read from the window
            resid_len = min(resid_len, (length - 1) % enc.flush_block + 1)
        elif enc.residual is not None:  # as the next step reads them: the newest W - 1 (R) exactly
            resid_len = min(resid_len, self.spec.tensor(enc.residual).shape[0] - 1)
        if enc.residual is not None and resid_len > 0:
            if layer is None or row is None:
                raise ValueError("a residual window is read with the sequence's layer and row")
            resid = self.tensors[enc.residual][row, layer]  # [Hkv, W, D]
            slots = torch.arange(length - resid_len, length, device=self.device)
            x[:, length - resid_len:] = resid[:, slots % resid.shape[1]].to(x.dtype)
        return x

    def _low_rank(self, enc: LowRank, latent: torch.Tensor, layer: int, positions: torch.Tensor,
                  which: str) -> torch.Tensor:
        """Latents [..., Hkv, L, rank / group] of `layer` decoded at `positions` (runtime/kv/lowrank.py)."""
        if enc.prerope and self.rope_freq is None:
            raise RuntimeError(f"low-rank {enc.latent!r} stores keys before RoPE: the store needs the model's RoPE")
        x = lowrank.decode(latent, self.tensors[enc.up][layer], enc.group, positions,
                           self.rope_freq if enc.prerope else None)
        return x.to(self.model_dtype(which))

    def head_dim(self, which: str) -> int:
        enc = self.spec.keys if which == K else self.spec.values
        if isinstance(enc, Dense):
            return enc.channels or self.spec.tensor(enc.tensor).shape[-1]
        if isinstance(enc, LowRank):
            return self.spec.tensor(enc.up).shape[0]
        if isinstance(enc, Delta):  # a head's [k_pre | v]
            return self.spec.tensor(enc.window).shape[-1] // 2
        if enc.format:
            return enc.group  # one scale per token's channels
        scale = self.spec.tensor(enc.scale).shape[-1]
        return scale * enc.group if enc.axis == "channel" else scale

    def model_dtype(self, which: str) -> torch.dtype:
        """The dtype K (or V) decode to: the dense tensor's, or the residual's / scale's."""
        enc = self.spec.keys if which == K else self.spec.values
        if isinstance(enc, Dense):
            return self.spec.tensor(enc.tensor).dtype
        if isinstance(enc, (LowRank, Delta)):
            return self.spec.tensor(enc.latent).dtype
        return self.spec.tensor(enc.residual or enc.scale).dtype

    def _page_index(self, page_ids: list[int], length: int) -> torch.Tensor:
        pages = -(-length // self.page_size)
        if len(page_ids) < pages:
            raise ValueError(f"{len(page_ids)} pages of {self.page_size} slots cannot hold {length} tokens")
        return to_device(page_ids[:pages], self.device, torch.long)

    # ---- page summaries --------------------------------------------------------------------------
    def refresh_summaries(self, pages: torch.Tensor, lengths: torch.Tensor, layer: int | None = None) -> None:
        """Recomputes every summary of the given pages from their stored slots: `pages [n]` page ids
        of layer `layer` (decoding codes whose scale is the layer's, FP8's, needs it), `lengths [n]`
        the slots each page stores (1..page_size; 0: leave the page alone). Static shapes, no host
        read: runs inside captured decode graphs (padding rows point at the scratch page with
        length 0)."""
        if not self.spec.summaries or pages.numel() == 0:
            return
        pages = pages.long()
        slot = torch.arange(self.page_size, device=self.device)
        valid = (slot[None, :] < lengths.long()[:, None])  # [n, S]
        for which in {s.source for s in self.spec.summaries}:
            x = self._page_values(which, pages, layer).float()  # [n, Hkv, S, D]
            for s in (s for s in self.spec.summaries if s.source == which):
                out = self.tensors[s.tensor]
                value = _reduce_slots(x, valid, s.fn).to(out.dtype)  # [n, Hkv, D]
                keep = (lengths > 0).view(-1, *([1] * (value.dim() - 1)))
                out[pages] = torch.where(keep, value, out[pages])

    @functools.cached_property
    def folds_summaries(self) -> bool:
        """Whether the summaries are of rows as computed, folded in as they are stored (`fold_summaries`): a
        summarised source is written a block at a time, so its pages' codes come later than their slots."""
        return any(getattr(self.spec.keys if s.source == K else self.spec.values, "flush_block", 0)
                   for s in self.spec.summaries)

    def fold_summaries(self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Folds rows k, v [T, Hkv, D] stored at `slots [T]` (-1: padding) into their pages' summaries: `fn` over
        the page's rows so far, a row at a page's first slot starting the page over. The rows of one page are
        consecutive (a sequence's tokens are), so each run of one page reduces once. Static shapes, no host
        read: runs inside captured decode graphs."""
        n = slots.numel()
        if not self.spec.summaries or n == 0:
            return
        size, slots = self.page_size, slots.long()
        stored = slots >= 0
        page = torch.where(stored, slots // size, self.scratch_page)
        starts = torch.ones(n, dtype=torch.bool, device=slots.device)
        starts[1:] = page[1:] != page[:-1]
        run = torch.cumsum(starts.long(), 0) - 1  # [T]: the run of one page each row is in
        run_page = torch.full_like(page, self.scratch_page).scatter(0, run, page)  # runs past the last: scratch
        fresh = torch.zeros(n, dtype=torch.long, device=slots.device).scatter_reduce(
            0, run, (stored & (slots % size == 0)).long(), "amax") > 0
        for s in self.spec.summaries:
            x = (k if s.source == K else v).float()
            out = self.tensors[s.tensor]
            reduce, combine = _FOLDS[s.fn]
            folded = torch.zeros_like(x).scatter_reduce(0, run[:, None, None].expand_as(x), x, reduce,
                                                        include_self=False)  # [runs, Hkv, D]
            both = combine(out[run_page].float(), folded)
            out[run_page] = torch.where(fresh[:, None, None], folded, both).to(out.dtype)

    @functools.cached_property
    def appends_summaries(self) -> bool:
        """Whether `append_summaries` can keep every summary current (each one's source stored dense)."""
        return bool(self.spec.summaries) and all(
            isinstance(self.spec.keys if s.source == K else self.spec.values, Dense) for s in self.spec.summaries)

    def append_summaries(self, slots: torch.Tensor) -> None:
        """Folds a decode step's newly stored slots `slots [T]` (-1: padding; one per sequence, so at
        most one per page) into their pages' summaries: equal to `refresh_summaries` of those pages,
        in one GPU launch per summary (runtime/kv/summary_kernels.py). Needs `appends_summaries`."""
        from kvc.runtime.kv import summary_kernels

        for s in self.spec.summaries:
            enc = self.spec.keys if s.source == K else self.spec.values
            summary_kernels.append(self.tensors[s.tensor], s.fn, self.tensors[enc.tensor], slots)

    def _page_values(self, which: str, pages: torch.Tensor, layer: int | None) -> torch.Tensor:
        """K or V of `pages` (layer `layer`'s) decoded: [n, Hkv, S, D]."""
        enc = self.spec.keys if which == K else self.spec.values
        if isinstance(enc, Dense):
            return enc.view(self.tensors[enc.tensor][pages])
        if isinstance(enc, LowRank):
            raise NotImplementedError(f"page summaries of low-rank {enc.latent!r}: a page's slots have no layer here")
        zero = None if enc.zero is None else self.scale_slots(enc.zero, layer)[pages]
        scale = self.scale_slots(enc.scale, layer)[pages]
        return encodings.dequantize(enc.view(self.tensors[enc.codes][pages]), scale, zero, enc,
                                    self.head_dim(which), self.model_dtype(which))


# a summary's fn as `fold_summaries` takes it: the scatter_reduce over a run of rows, and its merge with the page's
_FOLDS = {"max": ("amax", torch.maximum), "min": ("amin", torch.minimum), "sum": ("sum", torch.add)}


def _flat(tensor: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """TOKEN tensor slots [0, length) of the pages `pages` as [Hkv, length, *shape] (a copy)."""
    x = tensor.index_select(0, pages)  # [n, Hkv, S, *shape]
    return x.movedim(1, 0).flatten(1, 2)[:, :length]


def _reduce_slots(x: torch.Tensor, valid: torch.Tensor, fn: str) -> torch.Tensor:
    """`fn` over the valid slots of each page: x [n, Hkv, S, D], valid [n, S] -> [n, Hkv, D]."""
    mask = valid[:, None, :, None]
    if fn == "max":
        return torch.where(mask, x, torch.full_like(x, float("-inf"))).amax(dim=2)
    if fn == "min":
        return torch.where(mask, x, torch.full_like(x, float("inf"))).amin(dim=2)
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=2)
    if fn == "sum":
        return total
    return total / valid.sum(dim=1).clamp(min=1)[:, None, None]


def encoding_of(spec: KVSpec, which: str) -> Dense | Quantized | LowRank:
    return spec.keys if which == K else spec.values


__all__ = ["KVStore", "K", "V", "encoding_of"]
