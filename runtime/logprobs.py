"""Log-probabilities the engine reports: per generated token (`SamplingParams.logprobs`, from the
sampler) and per prompt token (`prompt_logprobs`, from the model runner).

Both are computed on the device as a few tensors per step (`LogprobTensors`: each position's token,
its logprob and rank, and the top N), travel to the host with the step's sampled tokens (one
pinned copy and event, runtime/transfer.py), and become one `TokenLogprobs` per position. Which
distribution: docs/design.md, "Sampling".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the token there (sampled, or the prompt's), its logprob and rank (1 = the
    most likely), and the `n` most likely tokens with theirs, best first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class LogprobTensors:
    """M positions on the device: `token_ids`, `logprobs`, `ranks` [M]; `top_ids`, `top_logprobs`
    [M, K] (K: the most any of them asks for)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_ids, self.logprobs, self.ranks, self.top_ids, self.top_logprobs]


def compute(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """`logprobs` [M, V] (log-softmaxed), `token_ids` [M] -> each token's logprob, rank and the top k."""
    own = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > own).sum(dim=-1) + 1
    top = logprobs.topk(k, dim=-1) if k > 0 else None
    empty_ids = torch.empty((len(token_ids), 0), dtype=torch.int64, device=logprobs.device)
    return LogprobTensors(
        token_ids=token_ids,
        logprobs=own[:, 0],
        ranks=ranks,
        top_ids=top.indices if top is not None else empty_ids,
        top_logprobs=top.values if top is not None else empty_ids.float(),
    )


def to_host(tensors: list[torch.Tensor], num_top: list[int]) -> list[TokenLogprobs]:
    """The host copies of `LogprobTensors.tensors()` as one `TokenLogprobs` per position, position
    i keeping its own `num_top[i]` top entries."""
    token_ids, logprobs, ranks, top_ids, top_logprobs = (t.tolist() for t in tensors)
    return [
        TokenLogprobs(t, lp, r, tuple(zip(ids[:n], lps[:n])))
        for t, lp, r, ids, lps, n in zip(token_ids, logprobs, ranks, top_ids, top_logprobs, num_top)
    ]
