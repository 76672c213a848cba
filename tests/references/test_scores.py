"""The reference scores against loop-by-loop computations written straight from the definitions."""

from __future__ import annotations

import math

import pytest
import torch

from tests.references.scores import (
    accumulated_attention,
    attention_probs,
    last_query_attention,
    pool1d,
    snapkv_scores,
    top_indices,
)


def random_qk(num_heads: int = 4, num_kv_heads: int = 2, length: int = 12, dim: int = 8, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_heads, length, dim, generator=generator)
    k = torch.randn(num_kv_heads, length, dim, generator=generator)
    return q, k


def loop_probs(q: torch.Tensor, k: torch.Tensor, head: int, query: int) -> list[float]:
    """Row `query` of query head `head`'s causal attention, from scalars."""
    kv_head = head // (q.shape[0] // k.shape[0])
    dim = q.shape[2]
    logits = [float(q[head, query] @ k[kv_head, key]) / math.sqrt(dim) for key in range(query + 1)]
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights] + [0.0] * (k.shape[1] - query - 1)


def test_attention_probs_is_causal_softmax_with_gqa_groups() -> None:
    q, k = random_qk()
    probs = attention_probs(q, k, first_query=3)
    assert probs.shape == (4, 9, 12)
    for head in range(4):
        for row, query in enumerate(range(3, 12)):
            torch.testing.assert_close(probs[head, row], torch.tensor(loop_probs(q, k, head, query)))


@pytest.mark.parametrize("pool", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_snapkv_scores_by_hand(pool: str, kernel: int) -> None:
    q, k = random_qk(length=14)
    length, window, group = 14, 4, 2
    scores = snapkv_scores(q, k, window=window, kernel=kernel, pool=pool)
    assert scores.shape == (2, length - window)
    for kv_head in range(2):
        per_head = []
        for head in range(kv_head * group, (kv_head + 1) * group):
            rows = [loop_probs(q, k, head, query) for query in range(length - window, length)]
            mean = [sum(row[key] for row in rows) / window for key in range(length - window)]
            pooled = []
            for key in range(length - window):
                # Neighbours outside 0..T-window-1 are padding: 0 in the average, absent from the max.
                span = range(key - kernel // 2, key + kernel // 2 + 1)
                near = [mean[j] for j in span if 0 <= j < length - window]
                pooled.append(sum(near) / kernel if pool == "avg" else max(near))
            per_head.append(pooled)
        expected = [sum(values) / group for values in zip(*per_head)]
        torch.testing.assert_close(scores[kv_head], torch.tensor(expected))


@pytest.mark.parametrize("normalize", [False, True])
def test_accumulated_attention_by_hand(normalize: bool) -> None:
    q, k = random_qk(length=10)
    scores = accumulated_attention(q, k, normalize=normalize)
    for kv_head in range(2):
        expected = []
        for key in range(10):
            heads = (2 * kv_head, 2 * kv_head + 1)
            sums = [sum(loop_probs(q, k, head, query)[key] for query in range(10)) for head in heads]
            seen_by = 10 - key if normalize else 1
            expected.append(sum(sums) / 2 / seen_by)
        torch.testing.assert_close(scores[kv_head], torch.tensor(expected))


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_last_query_attention_by_hand(per_kv_head: bool) -> None:
    q, k = random_qk(length=9)
    scores = last_query_attention(q, k, per_kv_head=per_kv_head)
    rows = [loop_probs(q, k, head, 8)[:8] for head in range(4)]
    for kv_head in range(2):
        heads = (2 * kv_head, 2 * kv_head + 1) if per_kv_head else range(4)
        expected = [sum(rows[h][key] for h in heads) / len(heads) for key in range(8)]
        torch.testing.assert_close(scores[kv_head], torch.tensor(expected))
    if not per_kv_head:
        assert torch.equal(scores[0], scores[1])


def test_pooling_spreads_a_spike_over_the_kernel() -> None:
    spike = torch.zeros(1, 9)
    spike[0, 4] = 5.0
    assert pool1d(spike, 5, "avg").tolist() == [[0, 0, 1, 1, 1, 1, 1, 0, 0]]
    assert pool1d(spike, 3, "max").tolist() == [[0, 0, 0, 5, 5, 5, 0, 0, 0]]
    edge = torch.tensor([[3.0, 0.0, 0.0, 0.0]])
    assert pool1d(edge, 3, "avg").tolist() == [[1.0, 1.0, 0.0, 0.0]]  # the zero padding counts
    with pytest.raises(ValueError, match="odd"):
        pool1d(spike, 4, "avg")


def test_top_indices_sorted_and_ties_to_the_earlier_token() -> None:
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    assert top_indices(scores, 2).tolist() == [[1, 2]]
    assert top_indices(scores, 4).tolist() == [[1, 2, 4, 5]]
    flat = torch.tensor([2.0, 2.0, 2.0, 2.0])
    assert top_indices(flat, 3).tolist() == [0, 1, 2]
