"""Oracle 4 for MLA's latent cache: the `latent` variant's Triton kernels against the torch ops.

One KV head stores `[c, k_rope]` per token; the values are the view of its first RANK channels
(`KVSpec.with_latent_values`), and the queries are absorbed, as wide as the keys. The torch ops read
the same two views. Pages are shuffled, unowned slots hold NaN (a stray read fails), and outputs are
poisoned first. Interpreter sizes on a CPU (TRITON_INTERPRET=1); the same test runs the compiled
kernels on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvc.runtime.attention import torch_ops
from kvc.runtime.attention.sources import fp8_latent_sources
from tests.kernels.paged_cases import triton_device_and_ops

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
pytest.importorskip("triton")
DEVICE, latent_ops = triton_device_and_ops("latent")

RANK, ROPE, HEADS, PAGE = 32, 8, 5, 4  # five heads: a padded head block; RoPE part narrower than a tile
SCALE = 0.3


def _cache(gen: torch.Generator, lengths: list[int], dtype: torch.dtype, rank: int = RANK, rope: int = ROPE,
           page: int = PAGE):
    """A latent cache over shuffled pages, NaN where no sequence owns a slot: (k, v, tables)."""
    pages = [-(-n // page) for n in lengths]
    total = sum(pages) + 2
    cache = torch.full((total, 1, page, rank + rope), float("nan"))
    order = torch.randperm(total - 1, generator=gen)
    tables = torch.zeros(len(lengths), max(pages + [1]), dtype=torch.int32)
    used = 0
    for b, (n, count) in enumerate(zip(lengths, pages)):
        for i in range(count):
            where = int(order[used])
            used += 1
            tables[b, i] = where
            filled = min(page, n - i * page)
            cache[where, 0, :filled] = torch.randn(filled, rank + rope, generator=gen)
    cache = cache.to(dtype).to(DEVICE)
    return cache, cache[..., :rank], tables.to(DEVICE)


def _clean(cache: torch.Tensor, rank: int = RANK) -> tuple[torch.Tensor, torch.Tensor]:
    k = cache.nan_to_num(0.0).float()
    return k, k[..., :rank]


TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


SCHEDULES = {"split": dict(num_splits=3), "balanced": dict(num_programs=3), "balanced-idle": dict(num_programs=40)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("starts", [False, True], ids=["whole", "per-row-starts"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_decode_matches_torch(dtype, starts, schedule):
    """Both schedules; `balanced-idle`: more programs than the batch has tiles (some do nothing)."""
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 37, 0, 70, 9]
    k_cache, v_cache, tables = _cache(gen, lengths, dtype)
    q = torch.randn(len(lengths), HEADS, RANK + ROPE, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kv_starts = torch.tensor([[0], [5], [0], [33], [8]], dtype=torch.int32, device=DEVICE) if starts else None
    out = torch.full((len(lengths), HEADS, RANK), float("nan"), dtype=dtype, device=DEVICE)
    latent_ops.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, max_context_len=70, out=out,
                            kv_starts=kv_starts, block_n=16, schedule=schedule.split("-")[0], **SCHEDULES[schedule])
    k, v = _clean(k_cache)
    want = torch_ops.paged_decode(q.float(), k, v, tables, lens, SCALE, kv_starts=kv_starts)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    assert bool((out[2] == 0).all())  # no context: zeros


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("schedule", ["split", "balanced"])
def test_decode_over_fp8_latents_matches_torch(schedule):
    """FP8 latents (e4m3 codes, the layer's one scale; `fp8_latent_sources` builds them as the engine does) through
    the Triton kernels: `code x scale` rounded to the queries' dtype, as the torch op reads them; NaN codes where no
    sequence owns a slot stay out."""
    gen = torch.Generator().manual_seed(10)
    lengths = [1, 37, 0, 70, 9]
    dense, _, tables = _cache(gen, lengths, torch.float32)
    codes = (dense / 0.05).to(torch.float8_e4m3fn)
    q = torch.randn(len(lengths), HEADS, RANK + ROPE, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    k_src, v_src = fp8_latent_sources(codes, 0.05, RANK, torch.bfloat16)
    out = latent_ops.paged_decode(q, k_src, v_src, tables, lens, SCALE, max_context_len=70, loads="pointers",
                                  block_n=16, schedule=schedule, **SCHEDULES[schedule])
    k_ref, v_ref = fp8_latent_sources(codes.float().nan_to_num(0.0).to(torch.float8_e4m3fn), 0.05, RANK,
                                      torch.bfloat16)
    want = torch_ops.paged_decode(q, k_ref, v_ref, tables, lens, SCALE)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
    assert bool((out[2] == 0).all())


@pytest.mark.skipif(not HOPPER, reason="the TMA decode kernel needs a Hopper GPU")
@pytest.mark.parametrize("starts", [False, True], ids=["whole", "per-row-starts"])
@pytest.mark.parametrize("splits", [None, 3])
def test_tma_decode_matches_torch(starts, splits):
    """The warp-specialized TMA kernel at GLM-4.7-Flash's shape (20 heads, 512 + 64, pages of 16, bf16): whole
    pages are copied, so NaN in the slots no sequence owns (page tails, before a row's start) must not reach the
    output; splits that start mid-page; a context of one tile exactly, of one slot, and none."""
    gen = torch.Generator().manual_seed(6)
    lengths = [1, 37, 0, 700, 2000, 64, 129, 1500]
    k_cache, v_cache, tables = _cache(gen, lengths, torch.bfloat16, rank=512, rope=64, page=16)
    q = torch.randn(len(lengths), 20, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kv_starts = (torch.tensor([[0], [5], [0], [333], [8], [63], [70], [1]], dtype=torch.int32, device=DEVICE)
                 if starts else None)
    if kv_starts is not None:  # slots before a row's start: NaN too
        for b, (n, first) in enumerate(zip(lengths, kv_starts[:, 0].tolist())):
            for slot in range(first):
                k_cache[tables[b, slot // 16], 0, slot % 16] = float("nan")
    out = torch.full((len(lengths), 20, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    latent_ops.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, max_context_len=2000, out=out,
                            kv_starts=kv_starts, loads="tma", num_splits=splits)
    k, v = _clean(k_cache, 512)
    want = torch_ops.paged_decode(q.float(), k, v, tables, lens, SCALE, kv_starts=kv_starts)
    torch.testing.assert_close(out.float(), want, **TOL[torch.bfloat16])
    assert bool((out[2] == 0).all())  # no context: zeros


@pytest.mark.skipif(not HOPPER, reason="the TMA decode kernel needs a Hopper GPU")
@pytest.mark.parametrize("starts", [False, True], ids=["whole", "per-row-starts"])
def test_tma_decode_over_fp8_latents_matches_torch(starts):
    """FP8 latents (e4m3, the layer's one scale): the TMA kernel's converter warpgroup dequantizes each tile
    as the torch op does (`code x scale`, rounded to bf16); NaN codes where no
    sequence owns a slot stay out of the output."""
    gen = torch.Generator().manual_seed(9)
    lengths = [1, 37, 0, 700, 2000, 64, 129, 1500]
    dense, _, tables = _cache(gen, lengths, torch.float32, rank=512, rope=64, page=16)
    scale = 0.02
    codes = (dense / scale).to(torch.float8_e4m3fn)  # NaN stays NaN
    q = torch.randn(len(lengths), 20, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    kv_starts = (torch.tensor([[0], [5], [0], [333], [8], [63], [70], [1]], dtype=torch.int32, device=DEVICE)
                 if starts else None)
    k_src, v_src = fp8_latent_sources(codes.to(DEVICE), scale, 512, torch.bfloat16)
    out = torch.full((len(lengths), 20, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    latent_ops.paged_decode(q, k_src, v_src, tables, lens, SCALE, max_context_len=2000, out=out, kv_starts=kv_starts,
                            loads="tma")
    k_ref, v_ref = fp8_latent_sources(codes.float().nan_to_num(0.0).to(torch.float8_e4m3fn).to(DEVICE), scale, 512,
                                      torch.bfloat16)
    want = torch_ops.paged_decode(q, k_ref, v_ref, tables, lens, SCALE, kv_starts=kv_starts)
    torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
    pointers = latent_ops.paged_decode(q, k_src, v_src, tables, lens, SCALE, max_context_len=2000,
                                       kv_starts=kv_starts, loads="pointers")
    torch.testing.assert_close(out.float(), pointers.float(), **TOL[torch.bfloat16])
    assert bool((out[2] == 0).all())


@pytest.mark.skipif(not HOPPER, reason="the TMA decode kernel needs a Hopper GPU")
def test_tma_decode_replays_in_a_cuda_graph():
    """Captured once (its descriptors hold the cache's address), replayed after the cache, the queries and the
    lengths changed in place: the eager call's output."""
    gen = torch.Generator().manual_seed(8)
    k_cache, v_cache, tables = _cache(gen, [300, 900], torch.bfloat16, rank=512, rope=64, page=16)
    k_cache.nan_to_num_(0.0)
    q = torch.randn(2, 20, 576, generator=gen).to(torch.bfloat16).to(DEVICE)
    lens = torch.tensor([300, 900], dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, 20, 512, dtype=torch.bfloat16, device=DEVICE)

    def step():
        latent_ops.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, max_context_len=900, out=out, loads="tma")

    step()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    k_cache.mul_(0.5)
    q.copy_(torch.randn(2, 20, 576, generator=gen).to(torch.bfloat16))
    lens.copy_(torch.tensor([250, 899], dtype=torch.int32))
    graph.replay()
    replayed = out.clone()
    step()
    assert torch.equal(replayed, out)


@pytest.mark.skipif(HOPPER, reason="off Hopper: the TMA kernel is refused")
def test_tma_decode_off_hopper_is_a_clear_error():
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = _cache(gen, [5], torch.float32)
    q = torch.randn(1, HEADS, RANK + ROPE, generator=gen).to(DEVICE)
    lens = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="the tma decode kernel cannot read this decode"):
        latent_ops.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, loads="tma")
    with pytest.raises(ValueError, match="unknown latent decode loads"):
        latent_ops.paged_decode(q, k_cache, v_cache, tables, lens, SCALE, loads="gather")


@pytest.mark.parametrize("dtype", list(TOL))
def test_prefill_matches_torch(dtype):
    """Chunks over a cached prefix (and a fresh one), their own tokens already stored; per-row starts in
    one row."""
    gen = torch.Generator().manual_seed(4)
    lengths, q_lens = [23, 9, 40], [7, 9, 1]
    k_cache, v_cache, tables = _cache(gen, lengths, dtype)
    cu = torch.tensor([0, 7, 16, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(17, HEADS, RANK + ROPE, generator=gen).to(dtype).to(DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    k, v = _clean(k_cache)
    for kv_starts in (None, torch.tensor([[0], [0], [12]], dtype=torch.int32, device=DEVICE)):
        out = torch.full((17, HEADS, RANK), float("nan"), dtype=dtype, device=DEVICE)
        latent_ops.paged_prefill(q, k_cache, v_cache, tables, cu, lens, SCALE, max(q_lens), out=out,
                                 kv_starts=kv_starts, block_m=16, block_n=16)
        want = torch_ops.paged_prefill(q.float(), k, v, tables, cu, lens, SCALE, max(q_lens), kv_starts=kv_starts)
        torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_store_writes_the_keys_only():
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, _ = _cache(gen, [8], torch.float32)
    before = k_cache.clone()
    k = torch.randn(3, 1, RANK + ROPE, generator=gen).to(DEVICE)
    slots = torch.tensor([2, -1, 5], device=DEVICE)
    latent_ops.store_kv(k, k[..., :RANK], k_cache, v_cache, slots)
    want = before.clone()
    torch_ops.store_kv(k, k[..., :RANK], want, want[..., :RANK], slots)
    scratch = k_cache.shape[0] - 1  # padding rows land on the scratch page; compare the rest
    torch.testing.assert_close(k_cache[:scratch], want[:scratch], equal_nan=True)
    assert torch.equal(k_cache[0, 0, 2], k[0, 0])


# FP8 latents: a float32 roundoff difference in a key can move its code across a rounding boundary, and one
# code's step (1/8 of the value for e4m3) moves this tiny random model's logits by about 1e-3 nats, where its
# greedy choices are often nearer ties than that (0.0004 at one step of the 70-token prompt). Scaling the dynamic
# scale by 1 + 1e-7 on the CPU flips that choice, and the torch backend on a GPU lands on the same tokens. So a
# divergence is allowed at a near tie of the reference (within FP8_TIE nats of its top token), and nowhere else.
FP8_TIE = 0.01


def _assert_same_greedy(want: list, got: list, tie: float) -> None:
    """Each prompt's greedy tokens of `got` equal `want`'s, except that from a step where `want`'s logprobs (top
    5) put `got`'s token within `tie` of its own, the two may go apart."""
    for ref, out in zip(want, got):
        for step, (a, b) in enumerate(zip(ref.token_ids, out.token_ids)):
            if a == b:
                continue
            top = dict(ref.logprobs[step].top)
            assert b in top and top[a] - top[b] <= tie, (
                f"step {step}: {b} against the reference's {a}, not a tie within {tie}: {ref.logprobs[step]}")
            break


@pytest.mark.parametrize("method,params,form", [("full", {}, "absorbed"), ("snapkv", {"budget": 24, "window": 8},
                                                                        "decompressed"),
                                                ("fp8", {"scale": "dynamic"}, "absorbed"),
                                                ("fp8", {"scale": "dynamic"}, "decompressed")])
def test_served_glm_gives_the_torch_backends_tokens(tmp_path, method, params, form):
    """The engine over a tiny GLM-4.7-Flash (`glm4_moe_lite`) with the Triton backend (the `latent` variant:
    store, decode and, in the absorbed form, chunked prefill; FP8 latents with the layer's scale for `fp8`)
    generates the torch backend's greedy tokens, with prefill chunks in either MLA form (`mla_prefill`); with FP8
    latents, up to a near tie of the reference (FP8_TIE)."""
    from kvc.runtime.llm import LLM
    from kvc.runtime.sampling_params import SamplingParams
    from tests.models.tiny import make_tiny_glm4_moe_lite

    model_dir = make_tiny_glm4_moe_lite(tmp_path, seed=3)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 37, 70)]
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(model_dir), method=method, method_params=params, device=DEVICE.type, dtype="float32",
                  page_size=16, attention_backend=backend, max_num_batched_tokens=64, max_prefill_chunk=20,
                  mla_prefill=form)
        assert llm.engine.attention.variants == ["latent"]
        spec = llm.engine.attention.stores[0].spec
        width = 32 + 8  # the tiny latent and RoPE key: one tensor a token, values its view
        assert spec.latent and spec.bytes_per_token(1) == width * (1 if method == "fp8" else 4)
        outs[backend] = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                             logprobs=5))
    if method == "fp8":
        _assert_same_greedy(outs["torch"], outs["triton"], FP8_TIE)
    else:
        assert [o.token_ids for o in outs["triton"]] == [o.token_ids for o in outs["torch"]]


def test_a_divergence_passes_only_at_a_near_tie():
    """`_assert_same_greedy`'s rule on made-up outputs: equal tokens pass; a divergence passes where the reference
    had the other token within the tie, and fails where it did not."""
    from types import SimpleNamespace as Out

    def out(tokens, tops):
        return Out(token_ids=tokens, logprobs=[Out(top=t) for t in tops])

    tops = [((5, -1.0), (6, -1.005)), ((7, -1.0), (8, -2.0))]
    ref = out([5, 7], tops)
    _assert_same_greedy([ref], [out([5, 7], tops)], 0.0)
    _assert_same_greedy([ref], [out([6, 9], tops)], FP8_TIE)  # a tie at step 0; later steps free
    with pytest.raises(AssertionError, match="not a tie"):
        _assert_same_greedy([ref], [out([5, 8], tops)], FP8_TIE)  # 1 nat apart at step 1
    with pytest.raises(AssertionError, match="not a tie"):
        _assert_same_greedy([ref], [out([6, 7], tops)], 0.001)


def test_the_kernels_compile_for_sm90() -> None:
    """Decode and prefill at GLM-4.7-Flash's shape compile for an H100/H200 (ptxas here), within a block's
    shared memory."""
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_latent")
