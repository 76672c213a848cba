"""A batch's next tokens by the exponential race in two Triton launches (CUDA).

Sampling from softmax(logits / T) equals taking argmax(logits / T + G) with G an independent Gumbel
noise per token, G = -log(-log U), which is the sampler's exponential race argmax(p / E) with
E = -log U. The torch path spends about ten launches on it (greedy argmax, a gather, the division,
softmax, the noise, the race, its argmax, a scatter), each a pass over the [rows, vocab] float32 logits:
about 1.4 GB at 160 rows of a 151,936-token vocabulary. Here the first launch reads each logit once,
draws its noise from Philox (the row's key, the token as counter) and keeps a chunk's best as one packed
int64 (the key's bits made order-preserving, then the smallest token among equal keys); the second
takes each row's best chunk. A row with temperature 0 races without noise: its argmax, with torch's tie
rule (the first maximum). docs/design.md, "Sampling".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvc.runtime.primitives.pdl import gate as pdl_gate
from kvc.runtime.primitives.pdl import options as pdl_options

CHUNK = 4096  # tokens a program: 38 programs a row at 151,936 tokens
LOW = 0x7FFFFFFF  # the packed value's low half: LOW - token, so the smaller token wins a tie


@triton.jit(do_not_specialize=["seed"])
def _race_kernel(logits_ptr, stride_row, inv_temp_ptr, best_ptr, vocab, chunks, seed, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    inv_t = tl.load(inv_temp_ptr + row)
    bits = tl.randint(seed + row, cols)  # one Philox stream a row, the token its counter
    u = (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)  # [0, 1 - 2**-24]: -log u > 0; u = 0 never wins
    gumbel = -tl.log(-tl.log(u))
    key = tl.where(inv_t > 0, x * inv_t + gumbel, x)
    kb = key.to(tl.int32, bitcast=True)
    mono = tl.where(kb < 0, kb ^ 0x7FFFFFFF, kb)  # float order as signed int order (NaN above +inf, as argmax)
    packed = (mono.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    tl.store(best_ptr + row * chunks + chunk, tl.max(packed, axis=0))


@triton.jit
def _pick_kernel(best_ptr, out_ptr, chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_gate(PDL)
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    live = c < chunks
    p = tl.load(best_ptr + row * chunks + c, mask=live, other=0)
    p = tl.where(live, p, tl.full([BLOCK_C], -9223372036854775807, tl.int64) - 1)
    best = tl.max(p, axis=0)
    tl.store(out_ptr + row, 0x7FFFFFFF - (best & 0xFFFFFFFF))


def race(logits: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """Next tokens [N] int64 of logits [N, V] (any float dtype, the vocabulary contiguous): row i samples
    from softmax(logits[i] * inv_temperature[i]) (float32 [N]), or takes its argmax where that is 0.
    `seed` (a non-negative int below 2**62) keys the rows' noise: a seed and a row give one draw."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "the vocabulary must be contiguous"
    assert vocab <= LOW and 0 <= seed < 2**62
    block = min(CHUNK, max(16, triton.next_power_of_2(vocab)))
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, block)
    best = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    _race_kernel[(rows, chunks)](logits, logits.stride(0), inv_temperature, best, vocab, chunks, seed,
                                 BLOCK=block, num_warps=8 if block >= 2048 else 4, **pdl_options(logits.device))
    _pick_kernel[(rows,)](best, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1,
                          **pdl_options(logits.device))
    return out
