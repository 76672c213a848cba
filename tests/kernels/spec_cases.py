"""Paged cases stored as a KV spec says (dense or quantized K and V, a residual window) and read
plans, with a dense attention oracle written from the definitions, shared by the spec kernel tests.

The oracle never looks at pages nor at torch_ops: each case keeps, per sequence, the K/V that
attention must see (`keys`/`values`: the codes decoded by runtime/kv/encodings.py, the reference of
the encodings, except the newest `resid_lens[b]` slots, which are the full-precision tokens), and
`oracle_*` attend over them in float64 with an explicit mask of the slots each KV head reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvc.runtime.attention.sources import QuantizedPages
from kvc.runtime.kv import encodings
from kvc.runtime.kv.plans import ReadPlan
from kvc.runtime.kv.spec import Quantized


@dataclass(frozen=True)
class Enc:
    """How a test stores one operand: bits, group, symmetric, packing ("" or int4x2/int2x4/int3x8),
    codebook (None: codes count steps), rotation (None, "random" or "hadamard": stored as `x @ R.T`),
    exact (a prefill chunk reads its own rows as computed, `Quantized.prefill_exact`)."""

    bits: int
    group: int
    symmetric: bool
    packing: str = ""
    codebook: str | None = None
    rotation: str | None = None
    exact: bool = False

    def quantized(self, name: str, window: int) -> Quantized:
        return Quantized(f"{name}_codes", f"{name}_scale", self.bits, self.group,
                         zero=None if self.symmetric else f"{name}_zero", residual=f"{name}_resid" if window else None,
                         codebook=self.codebook, rotation=self.rotation, prefill_exact=self.exact)

    @property
    def code_dtype(self) -> torch.dtype:
        if self.packing:
            return torch.uint8
        return torch.int8 if self.symmetric else torch.uint8


INT8_PER_TOKEN = "int8-sym-token"  # group = D, filled in by make_spec_case
INT4_ASYM_G8 = Enc(4, 8, False, "int4x2")
INT2_SYM_G16 = Enc(2, 16, True, "int2x4")
SPHERE3_G16 = Enc(3, 16, True, "int3x8", "sphere")  # TurboQuant's levels, 3-bit codes
SPHERE3_ROTATED = Enc(3, 16, True, "int3x8", "sphere", "random", exact=True)  # TurboQuant as turboquant.kvm stores it
INT4_HADAMARD = Enc(4, 8, False, "int4x2", rotation="hadamard")


@dataclass
class SpecCase:
    k_source: torch.Tensor | QuantizedPages
    v_source: torch.Tensor | QuantizedPages
    full_keys: list[torch.Tensor]  # per sequence [L_b, Hkv, D]: the tokens as the model computed them
    full_values: list[torch.Tensor]
    keys: list[torch.Tensor]  # per sequence [L_b, Hkv, D]: what attention must read (decoded / residual)
    values: list[torch.Tensor]
    block_tables: torch.Tensor  # [B, max_pages] int32
    context_lens: torch.Tensor  # [B] int32
    rows: torch.Tensor  # [B] int32 SEQ rows (permuted)
    exact_lens: torch.Tensor | None  # [B] int32: the newest slots attention reads from the window
    page_size: int

    @property
    def lengths(self) -> list[int]:
        return self.context_lens.tolist()

    @property
    def resid_lens(self) -> torch.Tensor | None:
        """[B] int32 for a decode: what the window held before the step (the ops add the step's token)."""
        return self.held(1)

    def held(self, new) -> torch.Tensor | None:
        """[B] int32 for a step of `new` tokens a row (an int or [B]): what the window held before it,
        so that the ops read exactly `exact_lens` slots from the window (at least the step's own)."""
        if self.exact_lens is None:
            return None
        return (self.exact_lens - torch.as_tensor(new)).clamp(min=0).to(torch.int32)


def _source(enc: Enc | str | None, name: str, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
            dtype: torch.dtype, window: int, num_rows: int, gen: torch.Generator, stale: float | None):
    """(the pool of one operand, its Enc or None when dense): unowned entries random, or `stale`
    wherever a float can hold it."""
    if enc is None:
        cache = torch.randn(num_pages, num_kv_heads, page_size, head_dim, generator=gen).to(dtype)
        return (cache.fill_(stale) if stale is not None else cache), None
    if enc == INT8_PER_TOKEN:
        enc = Enc(8, head_dim, True)
    q = enc.quantized(name, window)
    stored = encodings.stored_width(head_dim, enc.packing)
    info = torch.iinfo(enc.code_dtype)
    codes = torch.randint(max(info.min, -128), min(info.max, 255) + 1, (num_pages, num_kv_heads, page_size, stored),
                          generator=gen).to(enc.code_dtype)
    shape = (num_pages, num_kv_heads, page_size, head_dim // enc.group)
    scale = torch.rand(shape, generator=gen) + 0.5
    zero = None if enc.symmetric else torch.rand(shape, generator=gen) * 4
    residual = torch.randn(num_rows, num_kv_heads, window, head_dim, generator=gen).to(dtype) if window else None
    if stale is not None:
        scale.fill_(stale)
        if zero is not None:
            zero.fill_(stale)
        if residual is not None:
            residual.fill_(stale)
    return QuantizedPages(q, codes, scale, zero, head_dim, dtype, residual), enc


def make_spec_case(
    lengths: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    *,
    k_enc: Enc | str | None,
    v_enc: Enc | str | None,
    gen: torch.Generator,
    window: int = 0,
    resid_lens: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    stale: float | None = None,
    spare_pages: int = 2,
) -> SpecCase:
    """Sequences of `lengths` tokens on permuted pages; each operand dense (None) or quantized as
    `Enc` says, with a residual window of `window` slots whose newest `resid_lens[b]` (default:
    min(window, length); at least 1, the step's token) slots attention reads instead of the codes."""
    pages_per_seq = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_per_seq) + spare_pages
    num_rows = len(lengths) + 2
    k_source = _source(k_enc, "k", num_pages, num_kv_heads, page_size, head_dim, dtype, window, num_rows, gen, stale)
    v_source = _source(v_enc, "v", num_pages, num_kv_heads, page_size, head_dim, dtype, window, num_rows, gen, stale)
    order = torch.randperm(num_pages, generator=gen).tolist()
    rows = torch.randperm(num_rows, generator=gen)[: len(lengths)].to(torch.int32)
    if resid_lens is None and window:
        resid_lens = [min(window, n) for n in lengths]
    width = max(pages_per_seq + [1]) + 1
    block_tables = torch.zeros((len(lengths), width), dtype=torch.int32)
    full = {"k": [], "v": []}
    seen = {"k": [], "v": []}
    for b, n in enumerate(lengths):
        pages = [order.pop() for _ in range(pages_per_seq[b])]
        block_tables[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        newest = n - (resid_lens[b] if resid_lens else 0)
        for name, source in (("k", k_source), ("v", v_source)):
            x = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
            full[name].append(x)
            src, enc = source
            if enc is None:
                _place(src, x, pages, page_size)
                seen[name].append(x)
                continue
            codes, scale, zero = encodings.quantize(x, src.enc, enc.code_dtype, packing=enc.packing)
            for dst, val in ((src.codes, codes), (src.scale, scale), (src.zero, zero)):
                if dst is not None:
                    _place(dst, val, pages, page_size)
            decoded = encodings.dequantize(codes, scale, zero, src.enc, head_dim, dtype)
            if src.residual is not None:
                for t in range(max(0, n - window), n):
                    src.residual[rows[b], :, t % window] = x[t]
            decoded[newest:] = x[newest:]
            seen[name].append(decoded)
    return SpecCase(k_source[0], v_source[0], full["k"], full["v"], seen["k"], seen["v"], block_tables,
                    torch.tensor(lengths, dtype=torch.int32), rows,
                    None if resid_lens is None else torch.tensor(resid_lens, dtype=torch.int32), page_size)


def _place(dst: torch.Tensor, x: torch.Tensor, pages: list[int], page_size: int) -> None:
    """Token t of x [n, Hkv, E] into slot t of the sequence on `pages` of dst [P, Hkv, S, E]."""
    for j, page in enumerate(pages):
        chunk = slice(j * page_size, min((j + 1) * page_size, x.shape[0]))
        dst[page, :, : chunk.stop - chunk.start] = x[chunk].transpose(0, 1).to(dst.dtype)


def _each(source, fn):
    """`fn` applied to every tensor of a source (a dense cache, or the parts of QuantizedPages)."""
    if isinstance(source, torch.Tensor):
        return fn(source)
    opt = (lambda t: None if t is None else fn(t))  # noqa: E731
    return QuantizedPages(source.enc, fn(source.codes), opt(source.scale), opt(source.zero), source.head_dim,
                          source.dtype, opt(source.residual))


def moved(source, device):
    return _each(source, lambda t: t.to(device))


def emptied(source):
    """The source with every entry 0 (a store must fill what a test reads)."""
    return _each(source, torch.zeros_like)


def nan_free(source):
    """The source with NaN (unowned) entries 0: the torch ops' copy of a poisoned pool."""
    return _each(source, lambda t: t.nan_to_num(0.0) if t.is_floating_point() else t)


def tensors(source) -> list[torch.Tensor]:
    if isinstance(source, torch.Tensor):
        return [source]
    return [t for t in (source.codes, source.scale, source.zero, source.residual) if t is not None]


def assert_stored_alike(got, want) -> None:
    """A Triton store equals the torch store: bit for bit, except codebook and rotated sources, whose
    scale is a sum of squares, or whose rows a product with R, that the two reduce in different orders:
    there the scales and zero points agree to float32 rounding (1e-6) and the codes as well, but for an
    element sitting on a rounding boundary (at most one in 200, and one step apart)."""
    if isinstance(want, torch.Tensor) or (want.enc.codebook is None and want.enc.rotation is None):
        for a, b in zip(tensors(got), tensors(want)):
            assert torch.equal(a.cpu(), b), (a.dtype, a.shape)
        return
    torch.testing.assert_close(got.scale.cpu(), want.scale, rtol=1e-6, atol=0)
    if want.zero is not None:
        torch.testing.assert_close(got.zero.cpu(), want.zero, rtol=1e-6, atol=1e-6)
    packing, bits = want.packing, want.enc.bits
    a = encodings.unpack(got.codes.cpu(), bits, packing, False) if packing else got.codes.cpu().long()
    b = encodings.unpack(want.codes, bits, packing, False) if packing else want.codes.long()
    differ = a != b
    assert int(differ.sum()) <= differ.numel() // 200 and int((a - b).abs().max()) <= 1
    for x, y in ((got.residual, want.residual),):
        assert x is None or torch.equal(x.cpu(), y)


# ---- read plans and the oracle -------------------------------------------------------------------


def random_plan(case: SpecCase, num_kv_heads: int, by: str, width: int, gen: torch.Generator,
                last: list[int] | None = None) -> ReadPlan:
    """A plan of `width` entries per (row, KV head): distinct pages of the row's table (by="pages")
    or distinct slots (by="tokens", some past the row's length), padded with -1 at random places.
    With `last` (tokens only): each row b also reads its newest last[b] slots, which the listed
    tokens then stay below."""
    plan = torch.full((len(case.lengths), num_kv_heads, width), -1, dtype=torch.int32)
    for b, n in enumerate(case.lengths):
        limit = -(-n // case.page_size) if by == "pages" else n + 3
        if last is not None:
            limit = max(n - last[b], 0)
        for h in range(num_kv_heads):
            count = int(torch.randint(0, min(width, limit) + 1, (1,), generator=gen)) if limit else 0
            chosen = torch.randperm(limit, generator=gen)[:count].to(torch.int32) if limit else plan.new_zeros(0)
            where = torch.randperm(width, generator=gen)[:count]
            plan[b, h, where] = chosen
    if last is not None:
        return ReadPlan(tokens=plan, last=torch.tensor(last, dtype=torch.int32))
    return ReadPlan(pages=plan) if by == "pages" else ReadPlan(tokens=plan)


def read_mask(case: SpecCase, plan: ReadPlan | None, num_kv_heads: int, starts: torch.Tensor | None,
              b: int) -> torch.Tensor:
    """[Hkv, L_b] bool: the slots KV head h of row b attends to."""
    n = case.lengths[b]
    mask = torch.zeros(num_kv_heads, n, dtype=torch.bool)
    for h in range(num_kv_heads):
        if plan is None:
            mask[h] = True
        elif plan.pages is not None:
            for p in plan.pages[b, h].tolist():
                if p >= 0:
                    mask[h, p * case.page_size: (p + 1) * case.page_size] = True
        else:
            for t in plan.tokens[b, h].tolist():
                if 0 <= t < n:
                    mask[h, t] = True
            if plan.last is not None:
                mask[h, max(n - int(plan.last[b]), 0):] = True
        if starts is not None:
            mask[h, : int(starts[b, h])] = False
    return mask


def oracle_decode(case: SpecCase, q: torch.Tensor, scale: float, plan: ReadPlan | None = None,
                  starts: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(out [B, Hq, D] float64, per row probabilities [Hq, L_b]): softmax over the read slots."""
    q = q.double().cpu()
    num_q_heads = q.shape[1]
    num_kv_heads = case.keys[0].shape[1] if case.keys else 1
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    probs = []
    for b, n in enumerate(case.lengths):
        p_row = torch.zeros(num_q_heads, n, dtype=torch.float64)
        if n:
            mask = read_mask(case, plan, num_kv_heads, starts, b).repeat_interleave(group, 0)  # [Hq, L]
            k = case.keys[b].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
            v = case.values[b].double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[b], k) * scale
            p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
            out[b] = torch.einsum("hl,lhd->hd", p, v)
            p_row = p
        probs.append(p_row)
    return out, probs


def fold_oracle(probs: list[torch.Tensor], num_kv_heads: int, width: int, reduce: str, fn: str | None):
    """Per row probabilities [Hq, L_b] folded as decode statistics: [B, R, width] float64."""
    num_q_heads = probs[0].shape[0]
    group = num_q_heads // num_kv_heads
    rows = {"group": num_kv_heads, "head": 1, "none": num_q_heads}[reduce]
    out = torch.zeros(len(probs), rows, width, dtype=torch.float64)
    for b, p in enumerate(probs):
        n = p.shape[1]
        if reduce == "group":
            g = p.reshape(num_kv_heads, group, n)
            out[b, :, :n] = g.mean(1) if fn == "mean" else g.sum(1)
        elif reduce == "head":
            out[b, 0, :n] = p.mean(0) if fn == "mean" else p.sum(0)
        else:
            out[b, :, :n] = p
    return out


def oracle_prefill(case: SpecCase, q: torch.Tensor, cu_seqlens: list[int], scale: float,
                   starts: torch.Tensor | None = None, fresh: tuple | None = None) -> torch.Tensor:
    """Causal attention of each row's chunk (the last q_len of its tokens) over its keys, float64;
    `fresh` (k_new, v_new [T, Hkv, D]): an operand with a residual window reads its chunk slots
    from these instead."""
    q = q.double().cpu()
    num_q_heads = q.shape[1]
    num_kv_heads = case.keys[0].shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(case.lengths):
        lo, hi = cu_seqlens[b], cu_seqlens[b + 1]
        if hi == lo:
            continue
        k, v = case.keys[b].double().clone(), case.values[b].double().clone()
        if fresh is not None:
            for x, source, new in ((k, case.k_source, fresh[0]), (v, case.v_source, fresh[1])):
                if not isinstance(source, torch.Tensor) and source.residual is not None:  # windowed operands
                    x[n - (hi - lo):] = new[lo:hi].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        positions = torch.arange(n - (hi - lo), n)
        visible = torch.arange(n)[None, :] <= positions[:, None]  # [q, L]
        scores = torch.einsum("qhd,lhd->hql", q[lo:hi], k) * scale
        mask = visible[None].expand(num_q_heads, -1, -1).clone()
        if starts is not None:
            first = starts[b].cpu().long().repeat_interleave(group)
            mask &= torch.arange(n)[None, None, :] >= first[:, None, None]
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        out[lo:hi] = torch.einsum("hql,lhd->qhd", p, v)
    return out
