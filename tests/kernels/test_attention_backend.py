"""`PagedAttention.forward` on whole steps (store, then decode + prefill) against the reference.

A step mixes decoding sequences (one new token each, maybe a CUDA-graph padding row) with
prefill chunks over cached prefixes. The new tokens' slots hold garbage before the step, so the
output is right only if forward stores K/V first and routes each sequence to the right kernel.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.runtime.attention.backend import PagedAttention, kv_bytes_per_page
from kvc.runtime.attention.metadata import AttentionMetadata
from kvc.runtime.errors import ConfigError
from tests.kernels.paged_cases import make_case, reference_attention

HEAD_DIM = 16
NUM_KV_HEADS = 2


def build_step(gen, decode_lens, prefill_shapes, group, page_size, device="cpu"):
    """(pool caches, q, k, v, metadata for 2 layers (layer 1 is the case's), expected out,
    expected caches after the step).

    decode_lens: context length after the step of each decode (0 = padding row);
    prefill_shapes: (context length after the step, new tokens) of each prefill chunk.
    """
    lengths = list(decode_lens) + [n for n, _ in prefill_shapes]
    new_tokens = [1] * len(decode_lens) + [q for _, q in prefill_shapes]
    case = make_case(lengths, NUM_KV_HEADS, HEAD_DIM, page_size, gen=gen, device=device)
    num_q_heads = NUM_KV_HEADS * group
    q_parts, k_parts, v_parts, slots, cu, expected = [], [], [], [], [0], []
    for b, (n, q_len) in enumerate(zip(lengths, new_tokens)):
        q_b = torch.randn(q_len, num_q_heads, HEAD_DIM, generator=gen).to(device)
        q_parts.append(q_b)
        if n == 0:  # padding decode row: a token that writes nothing and reads nothing
            k_parts.append(torch.zeros(1, NUM_KV_HEADS, HEAD_DIM, device=device))
            v_parts.append(torch.zeros(1, NUM_KV_HEADS, HEAD_DIM, device=device))
            slots.append(-1)
            expected.append(torch.zeros(1, num_q_heads, HEAD_DIM, dtype=torch.float64, device=device))
        else:
            k_parts.append(case.keys[b][n - q_len :])
            v_parts.append(case.values[b][n - q_len :])
            slots.extend(case.slots(b, range(n - q_len, n)))
            expected.append(reference_attention(q_b, case.keys[b], case.values[b], 0.3, list(range(n - q_len, n))))
        cu.append(cu[-1] + q_len)

    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    want_caches = (k_cache.clone(), v_cache.clone())
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    valid = slot_mapping[slot_mapping >= 0]
    for cache in (k_cache, v_cache):  # the step's own slots start out as garbage
        cache[valid // page_size, :, valid % page_size] = torch.randn(
            len(valid), NUM_KV_HEADS, HEAD_DIM, generator=gen).to(device)

    # Layer 0's row points nowhere useful (all slots skipped, lengths 0): forward(1) must not read it.
    md = AttentionMetadata(
        slot_mapping=torch.stack([torch.full_like(slot_mapping, -1), slot_mapping]),
        block_tables=torch.stack([torch.zeros_like(case.block_tables), case.block_tables]),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.stack([torch.zeros_like(case.context_lens), case.context_lens]),
        num_decodes=len(decode_lens),
        max_query_len=max(new_tokens),
        max_context_len=max(lengths),
    )
    step = (torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), md)
    return k_cache, v_cache, step, torch.cat(expected), want_caches


def check_step(backend, gen, decode_lens, prefill_shapes, group, page_size, device="cpu", atol=2e-5):
    k_cache, v_cache, (q, k, v, md), want, want_caches = build_step(
        gen, decode_lens, prefill_shapes, group, page_size, device)
    attention = PagedAttention.from_caches(k_cache, v_cache, backend, num_layers=2)
    out = attention.forward(1, q, k, v, md, 0.3)
    torch.testing.assert_close(out.double(), want, atol=atol, rtol=1e-4)
    assert torch.equal(attention.k_cache, want_caches[0])
    assert torch.equal(attention.v_cache, want_caches[1])


@settings(max_examples=40, deadline=None)
@given(
    decode_lens=st.lists(st.integers(0, 40), max_size=4),
    prefill=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20)), max_size=3),
    group=st.sampled_from([1, 2, 4]),
    page_size=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_torch_backend_steps(decode_lens, prefill, group, page_size, seed):
    prefill_shapes = [(prefix + q_len, q_len) for prefix, q_len in prefill]
    if not decode_lens and not prefill_shapes:
        decode_lens = [3]
    check_step("torch", torch.Generator().manual_seed(seed), decode_lens, prefill_shapes, group, page_size)


@pytest.mark.parametrize("decode_lens,prefill_shapes", [
    ([5, 0, 33], [(20, 20), (47, 9)]),  # mixed step with a padding decode row
    ([17, 1, 0, 0], []),  # decode-only, as captured in a CUDA graph
    ([], [(3, 3), (29, 29)]),  # prefill-only
])
def test_triton_backend_steps(decode_lens, prefill_shapes):
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops()
    check_step("triton", torch.Generator().manual_seed(11), decode_lens, prefill_shapes, 4, 8, device=device)


def test_allocate_and_page_bytes():
    attention = PagedAttention.allocate(num_layers=3, num_pages=7, num_kv_heads=2, page_size=4, head_dim=8,
                                        dtype=torch.bfloat16, device="cpu")
    # one global pool: pages are interchangeable across layers
    assert attention.k_cache.shape == (8, 2, 4, 8) and attention.v_cache.dtype == torch.bfloat16  # + scratch
    assert attention.page_size == 4 and attention.num_pages == 7 and attention.num_layers == 3
    assert kv_bytes_per_page(2, 4, 8, torch.bfloat16) == 2 * 2 * 4 * 8 * 2


def test_unknown_backend_is_a_config_error():
    with pytest.raises(ConfigError, match="attention backend"):
        PagedAttention.allocate(1, 1, 1, 1, 8, torch.float32, "cpu", backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="CUDA"):
        PagedAttention.allocate(1, 1, 1, 1, 8, torch.float32, "cpu", backend="triton")
