"""Dense prefill chunks through SDPA (runtime/attention/sdpa_prefill.py) against the paged torch op and a
float64 reference: fresh chunks (read from the step's own k, v, not the pages), chunks over a cached prefix
(gathered pages), one-token chunks, GQA; on a GPU in bf16 through cuDNN. And the engine served with
`prefill_attention="sdpa"` gives the paged prefill's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.sdpa_prefill import sdpa_prefill

PAGE = 4
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _case(gen, lengths, q_lens, heads, kv_heads, dim, device, dtype):
    """(q, the chunks' k and v, caches over shuffled pages holding every row's context, tables, cu)."""
    pages = [-(-n // PAGE) for n in lengths]
    order = torch.randperm(sum(pages) + 1, generator=gen)
    k_cache = torch.randn(sum(pages) + 1, kv_heads, PAGE, dim, generator=gen)
    v_cache = torch.randn(sum(pages) + 1, kv_heads, PAGE, dim, generator=gen)
    tables = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    k, v, at = [], [], 0
    for b, (n, q_len, count) in enumerate(zip(lengths, q_lens, pages)):
        tables[b, :count] = order[at:at + count]
        at += count
        slots = torch.arange(n - q_len, n)
        page_ids = tables[b, slots // PAGE].long()
        k.append(k_cache[page_ids, :, slots % PAGE])  # [q_len, Hkv, D]: the chunk as stored
        v.append(v_cache[page_ids, :, slots % PAGE])
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    to = dict(device=device, dtype=dtype)
    return (q.to(**to), torch.cat(k).to(**to), torch.cat(v).to(**to), k_cache.to(**to), v_cache.to(**to),
            tables.to(device), cu)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
def test_sdpa_prefill_equals_the_paged_op(device, heads, kv_heads):
    gen = torch.Generator().manual_seed(1)
    lengths, q_lens = [21, 9, 40, 1, 13], [6, 9, 1, 1, 13]  # over a prefix, fresh, one token, fresh, fresh
    q, k, v, k_cache, v_cache, tables, cu = _case(gen, lengths, q_lens, heads, kv_heads, 16, device, torch.float32)
    out = torch.full_like(q, float("nan"))
    sdpa_prefill(q, k, v, k_cache, v_cache, tables, cu, lengths, 0.25, out)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    want = torch_ops.paged_prefill(q.double(), k_cache.double(), v_cache.double(), tables,
                                   torch.tensor(cu, dtype=torch.int32, device=device), lens, 0.25, max(q_lens))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_len", [17, 9], ids=["fresh", "over-a-prefix"])
def test_without_out_one_chunk_returns_its_attention(device, q_len):
    """No `out`: one row's result comes back (a fresh chunk's is SDPA's own tensor, on the GPU token-major as
    q, so that the projection after it copies nothing) and equals the paged op's."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, k_cache, v_cache, tables, cu = _case(gen, [17], [q_len], 8, 2, 64, device, dtype)
    out = sdpa_prefill(q, k, v, k_cache, v_cache, tables, cu, [17], 0.25)
    lens = torch.tensor([17], dtype=torch.int32, device=device)
    want = torch_ops.paged_prefill(q.double(), k_cache.double(), v_cache.double(), tables,
                                   torch.tensor(cu, dtype=torch.int32, device=device), lens, 0.25, q_len)
    assert out.shape == q.shape
    tol = 2e-2 if device == "cuda" else 1e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    if device == "cuda" and q_len == 17:
        assert out.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,m,block", [(64, 64, 16), (50, 50, 16), (37, 90, 8), (40, 90, 40)],
                         ids=["fresh", "fresh-uneven", "over-a-prefix", "one-block"])
def test_query_blocks_equal_one_call(device, n, m, block):
    """`attend_chunk(block=)`: a chunk in query blocks (each over the keys before it unmasked, its own causally,
    merged into rows of one token-major output) gives one call's attention, fresh or over a prefix, GQA."""
    gen = torch.Generator().manual_seed(n + m)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dim = 128 if device == "cuda" else 16
    q, k, v = (torch.randn(1, h, length, dim, generator=gen).to(device, dtype)
               for h, length in ((8, n), (2, m), (2, m)))
    got = torch_ops.attend_chunk(q, k, v, dim ** -0.5, block=block)
    want = torch_ops.attend_chunk(q.double(), k.double(), v.double(), dim ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    if block < n:  # rows of one token-major output, as the output projection reads it
        assert got[0].transpose(0, 1).is_contiguous()
    tol = 2e-2 if device == "cuda" else 1e-5
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (cuDNN's attention)")
@pytest.mark.parametrize("kv_heads", [8, 4])
def test_bf16_through_cudnn_on_the_gpu(kv_heads):
    """32 query heads of 128 channels over 8 or 4 KV heads: a fresh 2K chunk and 1K chunks over 3K and 1K
    prefixes, within bf16 of the float64 paged op; the pages of fresh chunks are never read (NaN there)."""
    gen = torch.Generator().manual_seed(2)
    lengths, q_lens = [2048, 4096, 2048], [2048, 1024, 1024]
    q, k, v, k_cache, v_cache, tables, cu = _case(gen, lengths, q_lens, 32, kv_heads, 128, "cuda", torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    want = torch_ops.paged_prefill(q.double(), k_cache.double(), v_cache.double(), tables,
                                   torch.tensor(cu, dtype=torch.int32, device="cuda"), lens, 128 ** -0.5, 2048)
    k_cache[tables[0, : 2048 // PAGE].long()] = float("nan")  # the fresh row's pages (not the table's padding)
    out = sdpa_prefill(q, k, v, k_cache, v_cache, tables, cu, lengths, 128 ** -0.5, torch.empty_like(q))
    err = (out.double() - want).norm() / want.norm()
    assert err < 1e-2, err


def test_served_sdpa_prefill_gives_the_paged_prefills_tokens(tmp_path, monkeypatch):
    """Tiny Qwen3 (GQA), chunked prompts over cached prefixes: `prefill_attention="sdpa"` (every prefill step
    through it) and the paged op give the same greedy tokens."""
    from kvc.runtime.attention import backend
    from kvc.runtime.llm import LLM
    from kvc.runtime.sampling_params import SamplingParams
    from tests.models.tiny import make_tiny_qwen3

    model_dir = make_tiny_qwen3(tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 37, 70)]
    calls = []
    monkeypatch.setattr(backend, "sdpa_prefill", lambda *a: calls.append(1) or sdpa_prefill(*a))
    tokens = {}
    for form in ("kernel", "sdpa"):
        llm = LLM(str(model_dir), device="cpu", dtype="float32", page_size=4, attention_backend="torch",
                  max_num_batched_tokens=64, max_prefill_chunk=20, prefill_attention=form)
        assert llm.engine.attention.prefill_attention == form
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        tokens[form] = [o.token_ids for o in outs]
        assert bool(calls) == (form == "sdpa")
    assert len(calls) == 2 * 4  # both layers of each of the four steps with prefill chunks (64 tokens a step)
    assert tokens["sdpa"] == tokens["kernel"]
