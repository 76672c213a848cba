"""Turns a step's logits into next tokens (and, for the rows that ask, their logprobs).

One batched pass over all rows, in vLLM's order:
1. what changes the logits themselves: logit bias, the min_tokens mask (EOS and stop tokens get
   -inf), then the presence / frequency / repetition penalties (runtime/penalties.py);
2. greedy rows take the argmax of those logits;
3. the other rows: temperature, then min_p, top-k and top-p masks (one sort), then sampling by the
   exponential race (argmax of p / E with E ~ Exp(1)), which equals drawing from p. Rows with their
   own seed draw E from their own generator, so a request's tokens do not depend on its batch.
   Where the runner hands a race generator (CUDA logits, the triton backend) and no sampled row
   has a filter, a seed of its own or asks for logprobs, steps 2-3 are one fused race over the
   logits (runtime/primitives/race_triton.py), its noise keyed by a draw from that generator.
Logprobs are of the distribution a token is drawn from: after step 1 for greedy rows, after
step 3's temperature and masks for the others (a masked token's logprob is -inf). A batch in which
no row changes its logits or asks for logprobs runs steps 2-3 only, as before these existed.
docs/design.md, "Sampling".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvc.runtime.logprobs import LogprobTensors, compute
from kvc.runtime.penalties import apply_penalties
from kvc.runtime.sampling_params import SamplingParams
from kvc.runtime.transfer import to_device


@dataclass
class RowHistory:
    """What the sampler reads about the rows beyond their SamplingParams (the model runner builds
    it when some row changes its logits)."""

    num_generated: list[int]  # per row: tokens it generated before this one (committed + pending)
    stop_ids: list[Sequence[int]]  # per row: what min_tokens masks (stop tokens, and EOS unless ignore_eos)
    penalty_rows: list[int]  # rows with a penalty ...
    counts: torch.Tensor | None = None  # ... their generated-token counts [R, V]
    prompt: torch.Tensor | None = None  # ... and prompt masks [R, V]


@dataclass
class SamplerOutput:
    tokens: torch.Tensor  # [N] int64, on the logits' device
    logprob_rows: list[int]  # the rows that asked for logprobs ...
    logprobs: LogprobTensors | None = None  # ... their sampled tokens' logprobs and top ones


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
    history: RowHistory | None = None,
    race_generator: torch.Generator | None = None,
) -> SamplerOutput:
    """logits [N, V] (float32) -> token ids [N] (and the asked logprobs). `race_generator`: a CPU
    generator whose draws key the fused race's noise (None: the torch path only)."""
    if history is not None:
        logits = _changed_logits(logits, params, history)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if race_generator is not None and not asking and _raceable(params, generators, logits.shape[1]):
        from kvc.runtime.primitives.race_triton import race

        inv = to_device([0.0 if p.greedy else 1.0 / p.temperature for p in params], logits.device, torch.float32)
        seed = int(torch.randint(0, 2**62, (1,), generator=race_generator))
        return SamplerOutput(race(logits, inv, seed), [])
    tokens = logits.argmax(dim=-1)
    final = None  # the asking rows' logits after temperature and masks
    if not all(p.greedy for p in params):  # decided on the host: greedy needs no device round trip
        tokens, final = _draw(logits, tokens, params, generators, default_generator, asking)
    if not asking:
        return SamplerOutput(tokens, [])
    dev = logits.device
    index = to_device(asking, dev, torch.int64)
    if final is None:
        final = logits.index_select(0, index).float()
    k = max(params[i].logprobs for i in asking)
    return SamplerOutput(tokens, asking, compute(torch.log_softmax(final, dim=-1), tokens.index_select(0, index), k))


def _raceable(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None], vocab: int) -> bool:
    """Can the fused race sample these rows: some row samples, and no sampled row filters its
    tokens or draws from a generator of its own (those keep the torch path)?"""
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    return bool(sampled) and all(
        generators[i] is None and params[i].min_p <= 0 and params[i].top_p >= 1.0
        and (params[i].top_k <= 0 or params[i].top_k >= vocab) for i in sampled)


def _changed_logits(logits: torch.Tensor, params: Sequence[SamplingParams], history: RowHistory) -> torch.Tensor:
    """A float32 copy of the logits with each row's bias, min_tokens mask and penalties applied."""
    logits = logits.float().clone()
    dev = logits.device
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(token)
            values.append(bias)
        if history.num_generated[i] < p.min_tokens:
            for token in history.stop_ids[i]:
                rows.append(i)
                ids.append(token)
                values.append(float("-inf"))
    if rows:  # a bias adds up; a mask's -inf wins over any bias
        logits.index_put_((to_device(rows, dev, torch.int64), to_device(ids, dev, torch.int64)),
                          to_device(values, dev, torch.float32), accumulate=True)
    if history.penalty_rows:
        pr = history.penalty_rows
        index = to_device(pr, dev, torch.int64)
        per_row = to_device([[params[i].presence_penalty, params[i].frequency_penalty, params[i].repetition_penalty]
                             for i in pr], dev, torch.float32)
        penalised = apply_penalties(logits.index_select(0, index), history.counts, history.prompt,
                                    per_row[:, 0], per_row[:, 1], per_row[:, 2])
        # a repetition penalty near 0 overflows a positive logit: the largest float, not inf (NaN later)
        logits.index_copy_(0, index, penalised.nan_to_num(
            nan=float("-inf"), posinf=torch.finfo(torch.float32).max, neginf=float("-inf")))
    return logits


def _draw(logits, tokens, params, generators, default_generator, asking):
    """Samples the non-greedy rows into `tokens`; also the logits [len(asking), V] that the asking
    rows' logprobs come from (None when none asks)."""
    dev = logits.device
    rows = [i for i, p in enumerate(params) if not p.greedy]
    index = to_device(rows, dev, torch.int64)  # host lists reach the device without a stream wait
    sub = logits.index_select(0, index).float()
    temps = to_device([params[i].temperature for i in rows], dev, sub.dtype)
    filtered = _filtered_logits(
        sub / temps[:, None],
        top_k=[params[i].top_k for i in rows],
        top_p=[params[i].top_p for i in rows],
        min_p=[params[i].min_p for i in rows],
    )
    probs = torch.softmax(filtered, dim=-1)
    noise = torch.empty_like(probs)
    shared = [j for j, i in enumerate(rows) if generators[i] is None]
    if len(shared) == len(rows):
        noise.exponential_(generator=default_generator)
    elif shared:
        noise[to_device(shared, dev, torch.int64)] = torch.empty(
            (len(shared), probs.shape[1]), device=probs.device, dtype=probs.dtype
        ).exponential_(generator=default_generator)
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    tokens = tokens.index_copy(0, index, (probs / noise).argmax(dim=-1))
    if not asking:
        return tokens, None
    # each asking row's logits: greedy rows' as they are, sampled rows' as filtered
    where = {i: j for j, i in enumerate(rows)}
    final = logits.index_select(0, to_device(asking, dev, torch.int64)).float()
    sampled = [a for a, i in enumerate(asking) if i in where]
    if sampled:
        final.index_copy_(0, to_device(sampled, dev, torch.int64),
                          filtered.index_select(0, to_device([where[asking[a]] for a in sampled], dev, torch.int64)))
    return tokens, final


def _filtered_probs(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Softmax over the tokens that survive each row's top-k and top-p cut."""
    return torch.softmax(_filtered_logits(logits, top_k, top_p, [0.0] * len(top_k)), dim=-1)


def _filtered_logits(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """The logits with -inf for every token cut by its row's min_p, top-k or top-p (min_p first,
    against the top token's probability; then top-k and top-p on one sort)."""
    vocab = logits.shape[1]
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = to_device(min_p, logits.device, probs.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if all(k <= 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = to_device([kk if 0 < kk < vocab else vocab for kk in top_k], logits.device, torch.int64)
    drop = rank >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    p = to_device(top_p, logits.device, sorted_probs.dtype)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = drop | (mass_before >= p[:, None])  # the top token always survives: its mass_before is 0
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
