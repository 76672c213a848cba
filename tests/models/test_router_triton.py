"""The one-launch softmax router (runtime/models/router_triton.py, used on CUDA) against the torch path of
qwen3_moe.SparseMoeBlock.route it replaces (the CPU runs it under TRITON_INTERPRET): the same expert ids,
largest first, and the same float32 weights up to the order of two sums; ties to the lower expert id."""

import pytest
import torch

from kvc.runtime.models.qwen3_moe import SparseMoeBlock

router_triton = pytest.importorskip("kvc.runtime.models.router_triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def torch_route(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMoeBlock.route's torch path on given logits (its gate an identity)."""
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    torch.nn.Module.__init__(block)
    block.top_k, block.norm_topk_prob, block.gate = k, renormalize, torch.nn.Identity()
    return block.route(logits.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,k", [(1, 128, 8), (37, 128, 8), (5, 60, 4), (3, 8, 8)])
@torch.no_grad()
def test_softmax_topk_equals_torch_route(dtype, renormalize, tokens, experts, k) -> None:
    g = torch.Generator().manual_seed(tokens * 1000 + experts)
    # float32 logits without ties; bf16 ones drawn from distinct values (a bf16 cast of a Gaussian ties often)
    if dtype == torch.float32:
        logits = torch.randn(tokens, experts, generator=g) * 3
    else:
        logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)]).float() / 8 - 4
    logits = logits.to(dtype)
    ids, weights = router_triton.softmax_topk(logits.to(DEV), k, renormalize)
    want_ids, want_weights = torch_route(logits, k, renormalize)
    assert ids.dtype == want_ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=5e-7, atol=1e-8)  # a few ulps: two sums' order
    if renormalize:
        torch.testing.assert_close(weights.sum(-1).cpu(), torch.ones(tokens), rtol=1e-6, atol=0)


@torch.no_grad()
def test_ties_go_to_the_lower_expert_and_strided_rows() -> None:
    logits = torch.zeros(4, 16)
    logits[:, [3, 9, 12]] = 2.0  # three tied leaders, then thirteen tied others
    logits[1, 5] = 3.0
    wide = torch.cat([logits, torch.full((4, 7), 9.0)], dim=1)[:, :16]  # rows strided, the expert axis contiguous
    ids, weights = router_triton.softmax_topk(wide.to(DEV), 5, False)
    assert ids.cpu().tolist()[0] == [3, 9, 12, 0, 1]
    assert ids.cpu().tolist()[1] == [5, 3, 9, 12, 0]
    probs = torch.softmax(logits, dim=-1)
    torch.testing.assert_close(weights.cpu(), probs.gather(1, ids.cpu()), rtol=2e-7, atol=1e-8)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        router_triton.softmax_topk(torch.zeros(2, 4, device=DEV), 5, True)
    with pytest.raises(ValueError, match="tokens, experts"):
        router_triton.softmax_topk(torch.zeros(2, 4, 3, device=DEV), 2, True)
    ids, weights = router_triton.softmax_topk(torch.zeros(0, 4, device=DEV), 2, True)
    assert ids.shape == weights.shape == (0, 2)
