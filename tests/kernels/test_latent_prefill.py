"""MLA's prefill in the decompressed form (runtime/attention/latent_prefill.py) against the absorbed form
(torch_ops.paged_prefill over the latents, then up-projected) and a float64 reference over the decompressed
model's own per-head keys and values: chunks fresh and over a cached prefix, a one-token chunk, a row with a
start slot. On a GPU also bf16 at sizes where the prefix and the chunk run as two flash calls."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.latent_prefill import decompressed_prefill
from kvc.runtime.models.base import LatentQueries

HEADS, NOPE, ROPE, V_DIM, RANK, PAGE = 3, 24, 8, 32, 40, 4  # nope + rope == v: the flash path's shape
SCALE = (NOPE + ROPE) ** -0.5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _case(gen: torch.Generator, lengths: list[int], q_lens: list[int], device: str, dtype: torch.dtype):
    """(latent queries, absorbed q, latent cache over shuffled pages, tables, cu_seqlens, lens)."""
    pages = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages) + 1, generator=gen)
    cache = torch.randn(sum(pages) + 1, 1, PAGE, RANK + ROPE, generator=gen) * 0.5
    tables = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    at = 0
    for b, count in enumerate(pages):
        tables[b, :count] = order[at:at + count]
        at += count
    t = sum(q_lens)
    latent = LatentQueries(torch.randn(t, HEADS, NOPE, generator=gen), torch.randn(t, HEADS, ROPE, generator=gen),
                           torch.randn(HEADS, NOPE, RANK, generator=gen) * 0.2,
                           torch.randn(HEADS, V_DIM, RANK, generator=gen) * 0.2)
    latent = LatentQueries(*(x.to(device, dtype) for x in (latent.q_nope, latent.q_rope, latent.w_uk, latent.w_uv)))
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", latent.q_nope, latent.w_uk), latent.q_rope], dim=-1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    return latent, q_abs, cache.to(device, dtype), tables.to(device), cu, lens


def _reference(latent: LatentQueries, cache, tables, cu, lens, kv_starts) -> torch.Tensor:
    """Per sequence and head, softmax(q_nope . W_UK c + q_rope . k_rope) over the visible keys, times W_UV c."""
    out = []
    w_uk, w_uv = latent.w_uk.double(), latent.w_uv.double()
    for b, n in enumerate(lens.tolist()):
        start, end = int(cu[b]), int(cu[b + 1])
        flat = cache[tables[b].long()].reshape(-1, RANK + ROPE)[:n].double()  # [n, R + P]
        c, k_rope = flat[:, :RANK], flat[:, RANK:]
        logits = (torch.einsum("thd,hdr,nr->htn", latent.q_nope[start:end].double(), w_uk, c)
                  + torch.einsum("thp,np->htn", latent.q_rope[start:end].double(), k_rope)) * SCALE
        positions = torch.arange(n - (end - start), n)
        first = 0 if kv_starts is None else int(kv_starts[b, 0])
        keys = torch.arange(n)
        visible = (keys[None, :] <= positions[:, None].to(keys.device)) & (keys[None, :] >= first)
        probs = logits.masked_fill(~visible.to(logits.device), float("-inf")).softmax(-1)
        out.append(torch.einsum("htn,nr,hvr->thv", probs, c, w_uv))
    return torch.cat(out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("starts", [False, True], ids=["no-starts", "starts"])
def test_decompressed_equals_absorbed_and_the_reference(device, starts):
    gen = torch.Generator().manual_seed(2)
    lengths, q_lens = [23, 9, 40, 5], [7, 9, 1, 5]  # over a prefix, fresh, one token, fresh
    latent, q_abs, cache, tables, cu, lens = _case(gen, lengths, q_lens, device, torch.float32)
    kv_starts = torch.tensor([[3], [0], [12], [0]], dtype=torch.int32, device=device) if starts else None
    got = decompressed_prefill(latent, cache, tables, cu, lens, SCALE, torch.empty(sum(q_lens), HEADS, V_DIM,
                               device=device), kv_starts=kv_starts)
    absorbed = torch_ops.paged_prefill(q_abs, cache, cache[..., :RANK], tables, cu, lens, SCALE, max(q_lens),
                                       kv_starts=kv_starts)
    want = _reference(latent, cache, tables, cu, lens, kv_starts)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(latent.values(absorbed).double(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the flash path is bf16 on CUDA)")
def test_bf16_chunks_over_a_prefix_on_the_gpu():
    """Chunks of 256 over prefixes up to 1,024 in bf16: the prefix and the chunk as two flash calls merged by
    their log-sum-exps, within bf16 of the float64 reference."""
    gen = torch.Generator().manual_seed(5)
    lengths, q_lens = [1024, 256, 600], [256, 256, 88]
    latent, _, cache, tables, cu, lens = _case(gen, lengths, q_lens, "cuda", torch.bfloat16)
    got = decompressed_prefill(latent, cache, tables, cu, lens, SCALE,
                               torch.empty(sum(q_lens), HEADS, V_DIM, device="cuda", dtype=torch.bfloat16))
    want = _reference(latent, cache, tables, cu, lens, None)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
