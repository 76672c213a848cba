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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,k,hidden", [(1, 128, 8, 96), (37, 128, 8, 160), (5, 60, 4, 64)])
@torch.no_grad()
def test_gate_in_the_router_launch_equals_gemm_then_route(dtype, renormalize, tokens, experts, k, hidden) -> None:
    """The gate's GEMM fused into the router: the routes of the gate's logits rounded to its dtype. Inputs are
    multiples of 1/4 and 1/8, so every float32 sum is exact and the rounding the same in both: the experts bit
    for bit; the weights to float32 rounding (on a GPU the two kernels' layouts sum the softmax in other orders:
    an H100 differed in the last bits at 37 tokens x 128 experts)."""
    g = torch.Generator().manual_seed(tokens + experts)
    x = (torch.randint(-3, 4, (tokens, hidden + 8), generator=g) / 4).to(dtype)[:, :hidden]  # strided rows
    w = (torch.randint(-3, 4, (experts, hidden), generator=g) / 8).to(dtype)
    logits = (x.double() @ w.double().T).to(dtype)
    ids, weights = router_triton.gate_softmax_topk(x.to(DEV), w.to(DEV), k, renormalize)
    want_ids, want_weights = router_triton.softmax_topk(logits.to(DEV), k, renormalize)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.cpu(), want_weights.cpu(), rtol=1e-6, atol=0)


def test_the_block_fuses_the_gate_for_a_decode_steps_tokens_only(monkeypatch) -> None:
    """SparseMoeBlock.route (on CUDA), with the fused gate switched on, takes it up to GATE_MAX_TOKENS tokens of
    x in the gate's dtype, else the gate's GEMM then `softmax_topk`; it is off by default (slower on an H100)."""
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    torch.nn.Module.__init__(block)
    block.gate = torch.nn.Linear(32, 128, bias=False).to(torch.bfloat16)
    x = torch.zeros(router_triton.GATE_MAX_TOKENS, 32, dtype=torch.bfloat16)
    assert not block.gate_in_router(x[:1])
    monkeypatch.setattr(router_triton, "FUSED_GATE", True)
    assert block.gate_in_router(x) and block.gate_in_router(x[:1])
    assert not block.gate_in_router(torch.zeros(router_triton.GATE_MAX_TOKENS + 1, 32, dtype=torch.bfloat16))
    assert not block.gate_in_router(x.float())  # another dtype than the gate's
    block.gate = torch.nn.Linear(32, router_triton.GATE_MAX_EXPERTS + 1, bias=False).to(torch.bfloat16)
    assert not block.gate_in_router(x[:1])


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        router_triton.softmax_topk(torch.zeros(2, 4, device=DEV), 5, True)
    with pytest.raises(ValueError, match="tokens, experts"):
        router_triton.softmax_topk(torch.zeros(2, 4, 3, device=DEV), 2, True)
    with pytest.raises(ValueError, match="do not fit"):
        router_triton.gate_softmax_topk(torch.zeros(2, 8, device=DEV), torch.zeros(4, 6, device=DEV), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        router_triton.gate_softmax_topk(torch.zeros(2, 8, device=DEV), torch.zeros(4, 8, device=DEV), 5, True)
    ids, weights = router_triton.softmax_topk(torch.zeros(0, 4, device=DEV), 2, True)
    assert ids.shape == weights.shape == (0, 2)


def torch_sigmoid_route(logits, bias, k, n_group, topk_group, renormalize, scaling):
    """LatentMoE.route's torch path (GLM-4.7-Flash) on given float32 logits (its gate an identity)."""
    from kvc.runtime.models.glm4_moe_lite import LatentMoE

    block = LatentMoE.__new__(LatentMoE)
    torch.nn.Module.__init__(block)
    block.top_k, block.num_experts, block.n_group, block.topk_group = k, logits.shape[1], n_group, topk_group
    block.norm_topk_prob, block.scaling = renormalize, scaling
    block.gate = torch.nn.Linear(logits.shape[1], logits.shape[1], bias=False)
    block.gate.weight.data = torch.eye(logits.shape[1])
    block.score_bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
    return block.route(logits.cpu())


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,k,n_group,topk_group", [
    (1, 64, 4, 1, 1), (19, 64, 4, 1, 1),  # GLM-4.7-Flash's routing (one group)
    (19, 64, 6, 8, 3), (11, 48, 4, 6, 2), (5, 16, 16, 4, 4),  # groups (DeepSeek-V3's 8 of 4 kept, here smaller)
])
@torch.no_grad()
def test_sigmoid_topk_equals_torch_route(renormalize, tokens, experts, k, n_group, topk_group) -> None:
    g = torch.Generator().manual_seed(tokens * 100 + experts + n_group)
    logits = torch.randn(tokens, experts, generator=g) * 2
    bias = torch.randn(experts, generator=g) * 0.5 - 0.6  # negative choices too: a dropped group's 0 can win
    ids, weights = router_triton.sigmoid_topk(logits.to(DEV), bias.to(DEV), k, n_group, topk_group, renormalize, 1.8)
    want_ids, want_weights = torch_sigmoid_route(logits, bias, k, n_group, topk_group, renormalize, 1.8)
    # torch's top-k here is unsorted: compare per token as sets, weights matched by id
    order = want_ids.argsort(dim=-1)
    want_ids, want_weights = want_ids.gather(1, order), want_weights.gather(1, order)
    got = ids.cpu().argsort(dim=-1)
    assert torch.equal(ids.cpu().gather(1, got), want_ids)
    torch.testing.assert_close(weights.cpu().gather(1, got), want_weights, rtol=5e-7, atol=1e-8)
    choice = torch.sigmoid(logits) + bias  # largest choice first
    assert (choice.gather(1, ids.cpu()).diff(dim=-1) <= 0).all() or n_group > 1


def test_sigmoid_topk_refuses_groups_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="groups"):
        router_triton.sigmoid_topk(torch.zeros(2, 10, device=DEV), torch.zeros(10, device=DEV), 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        router_triton.sigmoid_topk(torch.zeros(2, 8, device=DEV), torch.zeros(4, device=DEV), 2, 1, 1, True, 1.0)


def test_the_gate_router_compiles_for_sm90_without_spills() -> None:
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_router")
