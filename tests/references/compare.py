"""Assertions for comparing another implementation with the references: kept tokens, logits.

`assert_same_kept` accepts a different choice only among near-ties: the other selection must
keep as many tokens per head (per layer for Ada-KV) and be a top-k of the reference scores up to
`rel_tol` of the largest finite score. kvc's tests use the same two assertions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.references.eviction import Ranking


def assert_same_kept(
    ranking: Ranking, other: Sequence[torch.Tensor], *, rel_tol: float = 1e-5, where: str = ""
) -> None:
    ours = list(ranking.kept())
    other = [torch.as_tensor(idx).sort().values for idx in other]
    if len(ours) == len(other) and all(torch.equal(a, b) for a, b in zip(ours, other)):
        return
    scores = ranking.scores
    if len(other) != scores.shape[0]:
        raise AssertionError(f"{where}: {len(other)} heads, expected {scores.shape[0]}")
    kept = torch.zeros(scores.shape, dtype=torch.bool)
    for head, idx in enumerate(other):
        kept[head, idx] = True
    finite = scores[scores.isfinite()]
    tol = rel_tol * float(finite.abs().max()) if finite.numel() else 0.0
    groups = [(scores.reshape(-1), kept.reshape(-1), "layer")] if ranking.across_heads else [
        (scores[h], kept[h], f"head {h}") for h in range(scores.shape[0])
    ]
    for group_scores, group_kept, name in groups:
        diff = f"{where} {name}: ours {[t.tolist() for t in ours]}, theirs {[t.tolist() for t in other]}"
        if int(group_kept.sum()) != ranking.count:
            raise AssertionError(f"{diff}: kept {int(group_kept.sum())} tokens, expected {ranking.count}")
        if bool(group_kept.all()):
            continue
        lowest_kept = float(group_scores[group_kept].min())
        highest_dropped = float(group_scores[~group_kept].max())
        if not lowest_kept >= highest_dropped - tol:
            raise AssertionError(
                f"{diff}: kept a token scoring {lowest_kept:.7g}, dropped one scoring {highest_dropped:.7g}"
            )


def assert_logits_close(
    ours: torch.Tensor, theirs: torch.Tensor, *, rel: float = 1e-4, where: str = ""
) -> None:
    """Max |difference| within `rel` of the largest |logit|."""
    if ours.shape != theirs.shape:
        raise AssertionError(f"{where}: logits shape {tuple(ours.shape)} vs {tuple(theirs.shape)}")
    error = float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max())
    if error > rel:
        raise AssertionError(f"{where}: logits differ by {error:.2e} relative (limit {rel:.0e})")
