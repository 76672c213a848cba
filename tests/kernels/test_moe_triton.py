"""Oracle 4 for the MoE layer: the fused Triton experts (runtime/models/moe_triton.py) against the
torch path (`RoutedExperts.forward_torch`) and a per-token loop written from the definition; the
expert alignment (runtime/models/moe_align.py) against its invariants and, bit for bit, against
the torch sort.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it before triton
is imported), so the sizes stay small: 8 experts, top-2, hidden 64, intermediate 32. Outputs that
the kernels write are poisoned first where a stray unwritten row would show.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from kvc.runtime.errors import ConfigError  # noqa: E402
from kvc.runtime.models import moe_triton  # noqa: E402
from kvc.runtime.models.experts import RoutedExperts, set_moe_impl  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-2, rtol=2e-2),
    torch.bfloat16: dict(atol=6e-2, rtol=6e-2),
}


def make_experts(num_experts, hidden, inter, dtype=torch.float32, seed=0) -> RoutedExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = RoutedExperts(num_experts, hidden, inter)
    with torch.no_grad():  # scaled so that activations stay O(1) through both projections
        experts.gate_up_proj.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5)
    return experts.to(DEVICE, dtype).requires_grad_(False)


def random_routing(num_tokens, num_experts, top_k, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return ids.reshape(num_tokens, top_k).to(DEVICE), weights.to(DEVICE)


def per_token_reference(experts: RoutedExperts, x, ids, weights) -> torch.Tensor:
    """The definition, one token and one expert at a time, in float64."""
    gate_up, down = experts.gate_up_proj.double().cpu(), experts.down_proj.double().cpu()
    x, ids, weights = x.double().cpu(), ids.cpu(), weights.double().cpu()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    return out


def spy_launches(monkeypatch, module, name: str, calls: list[str]) -> None:
    """`module.name[grid](...)` launches as before and appends `name` to `calls` each time."""
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            calls.append(name)
            return real[grid]

    monkeypatch.setattr(module, name, Spy())


# ---- alignment ---------------------------------------------------------------------------------


def check_alignment(align: moe_triton.ExpertAlignment, ids: torch.Tensor, num_experts: int) -> None:
    """The invariants the GEMMs rely on, checked from the definition."""
    flat = ids.reshape(-1).cpu()
    num_pairs, bm = flat.numel(), align.block_m
    sorted_pairs = align.sorted_pairs.cpu().tolist()
    block_experts = align.block_experts.cpu().tolist()
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    padded = [-(-c // bm) * bm for c in counts]
    assert len(sorted_pairs) == moe_triton.alignment_capacity(num_pairs, num_experts, bm)
    assert int(align.num_padded) == sum(padded)
    start = 0
    for e in range(num_experts):
        segment = sorted_pairs[start : start + padded[e]]
        want = [p for p in range(num_pairs) if int(flat[p]) == e]  # stable: in pair order
        assert segment == want + [num_pairs] * (padded[e] - counts[e]), f"expert {e}"
        for b in range(start // bm, (start + padded[e]) // bm):
            assert block_experts[b] == e
        start += padded[e]
    assert all(p == num_pairs for p in sorted_pairs[start:])
    assert all(0 <= e < num_experts for e in block_experts)


@pytest.mark.parametrize("impl", ["triton", "single", "torch"])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m", [
    (1, 8, 2, 16), (5, 8, 2, 16), (33, 8, 2, 16), (33, 6, 3, 32), (70, 128, 8, 16), (4, 3, 1, 64),
])
def test_alignment_groups_pairs_by_expert(impl, num_tokens, num_experts, top_k, block_m):
    ids, _ = random_routing(num_tokens, num_experts, top_k, seed=num_tokens)
    align = moe_triton.align_by_expert(ids, num_experts, block_m, impl=impl)
    check_alignment(align, ids, num_experts)


def test_alignment_of_skewed_routing_spans_several_blocks():
    ids = torch.tensor([[0, 5]] * 40 + [[5, 2]] * 3, device=DEVICE)  # expert 5 gets 43 rows
    for impl in ("triton", "single", "torch"):
        align = moe_triton.align_by_expert(ids, 8, 16, impl=impl)
        check_alignment(align, ids, 8)
        assert align.block_experts.cpu().tolist().count(5) >= 3


def routing_ids(num_pairs: int, num_experts: int, kind: str, seed: int) -> torch.Tensor:
    """[num_pairs, 1] expert ids: uniform, skewed (half the pairs on three experts), one (every
    pair on the last expert) or sparse (only every fourth expert used; the rest get no pair)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        ids = torch.randint(0, num_experts, (num_pairs,), generator=gen)
    elif kind == "skewed":
        hot = torch.tensor([0, num_experts // 2, num_experts - 1])
        ids = torch.where(torch.rand(num_pairs, generator=gen) < 0.5,
                          hot[torch.randint(0, 3, (num_pairs,), generator=gen)],
                          torch.randint(0, num_experts, (num_pairs,), generator=gen))
    elif kind == "one":
        ids = torch.full((num_pairs,), num_experts - 1)
    else:
        ids = torch.randint(0, -(-num_experts // 4), (num_pairs,), generator=gen) * 4
    return ids.view(num_pairs, 1).to(DEVICE)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty filled with -7: an output row the kernel forgets to write cannot pass."""
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real(*a, **kw).fill_(-7))


# (pairs, experts, block_m, routing): no pairs; one chunk exactly and one past it (128 / 129
# pairs, the smallest chunk); 8-warp chunks (2049 and 3000 pairs: 2048 per chunk); decode at 18
# tokens x top-8 (144); empty experts; all pairs on one expert (many blocks of one expert, expert 0
# empty: the chunk overrun comes off bin 0 all the same)
PARALLEL_CASES = [
    (0, 8, 16, "uniform"), (1, 128, 16, "uniform"), (2, 8, 64, "one"), (17, 60, 32, "uniform"), (128, 8, 16, "uniform"),
    (129, 8, 64, "skewed"), (144, 128, 16, "uniform"), (300, 60, 16, "sparse"), (640, 60, 64, "skewed"),
    (1025, 8, 32, "one"), (1280, 8, 16, "sparse"), (2049, 128, 32, "skewed"), (3000, 60, 16, "uniform"),
    (3000, 8, 64, "uniform"),
]


@pytest.mark.parametrize("impl", ["triton", "split", "split-128"])
@pytest.mark.parametrize("num_pairs,num_experts,block_m,kind", PARALLEL_CASES)
def test_parallel_alignment_equals_the_torch_path_exactly(poisoned_empty, monkeypatch, num_pairs, num_experts, block_m,
                                                          kind, impl):
    from kvc.runtime.models import moe_align

    if impl == "split-128":  # splits of 128 pairs (up to 24 here): later splits start after earlier ones
        monkeypatch.setattr(moe_align, "split_launch", lambda n: (128, max(1, -(-n // 128)), 128, 4))
    ids = routing_ids(num_pairs, num_experts, kind, seed=num_pairs)
    want = moe_triton.align_by_expert(ids, num_experts, block_m, impl="torch")
    got = moe_triton.align_by_expert(ids, num_experts, block_m, impl=impl.removesuffix("-128"))
    assert got.block_m == block_m
    assert torch.equal(got.num_padded, want.num_padded)
    assert torch.equal(got.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.block_experts, want.block_experts)


def test_parallel_alignment_of_int32_ids_and_many_tokens_per_row(poisoned_empty):
    ids, _ = random_routing(40, 16, 6, seed=11)  # [40, 6]: pair = token * 6 + j
    got = moe_triton.align_by_expert(ids.to(torch.int32), 16, 32, impl="triton")
    check_alignment(got, ids, 16)


def test_auto_alignment_runs_one_launch_up_to_the_threshold_then_the_split_kernels(monkeypatch):
    from kvc.runtime.models import moe_align

    assert moe_align.ALIGN_ONE_LAUNCH_MAX_PAIRS >= 8192  # decode batches of 1024 x top-8 stay on one launch
    calls = []
    for name in ("_align_parallel_kernel", "_align_split_kernel"):
        spy_launches(monkeypatch, moe_align, name, calls)
    monkeypatch.setattr(moe_align, "ALIGN_ONE_LAUNCH_MAX_PAIRS", 20)
    ids, _ = random_routing(10, 8, 2, seed=12)
    check_alignment(moe_triton.align_by_expert(ids, 8, 16), ids, 8)
    assert calls == ["_align_parallel_kernel"]
    ids, _ = random_routing(11, 8, 2, seed=12)
    check_alignment(moe_triton.align_by_expert(ids, 8, 16), ids, 8)
    assert calls == ["_align_parallel_kernel", "_align_split_kernel"]
    with pytest.raises(ValueError, match="align impl must be one of"):
        moe_triton.align_by_expert(ids, 8, 16, impl="sort")
    with pytest.raises(ValueError, match="power of two"):
        moe_triton.align_by_expert(ids, 8, 24)


HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvc.runtime.models import moe_align
signature = {"ids_ptr": "*i64", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
             "num_pairs": "i32", "capacity": "i32", "num_experts": "i32", "BLOCK_M": "constexpr",
             "BLOCK_E": "constexpr", "BLOCK_P": "constexpr", "BLOCK_FILL": "constexpr", "PDL": "constexpr"}
block_p, num_warps = moe_align.parallel_launch(3000)
source = ASTSource(fn=moe_align._align_parallel_kernel, signature=signature,
                   constexprs={"BLOCK_M": 16, "BLOCK_E": 128, "BLOCK_P": block_p, "BLOCK_FILL": 128, "PDL": True})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
assert kernel.asm["cubin"]
split, num_splits, block_p, num_warps = moe_align.split_launch(70000)
assert num_splits > 1
counts = ASTSource(fn=moe_align._align_counts_kernel, signature={
    "ids_ptr": "*i64", "counts_ptr": "*i32", "num_pairs": "i32", "split": "i32", "BLOCK_E": "constexpr",
    "BLOCK_P": "constexpr", "PDL": "constexpr"}, constexprs={"BLOCK_E": 128, "BLOCK_P": block_p, "PDL": True})
assert triton.compile(counts, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]
signature = {"ids_ptr": "*i64", "counts_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "num_pairs": "i32", "capacity": "i32", "num_experts": "i32", "split": "i32",
             "num_splits": "i32", "BLOCK_M": "constexpr", "BLOCK_E": "constexpr", "BLOCK_S": "constexpr",
             "BLOCK_P": "constexpr", "BLOCK_FILL": "constexpr", "PDL": "constexpr"}
place = ASTSource(fn=moe_align._align_split_kernel, signature=signature, constexprs={
    "BLOCK_M": 128, "BLOCK_E": 128, "BLOCK_S": 16, "BLOCK_P": block_p, "BLOCK_FILL": 128, "PDL": True})
assert triton.compile(place, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["cubin"]
"""


def test_parallel_align_kernels_compile_for_hopper():
    """The interpreter does not lower tl.histogram or the dynamic loops: compile the kernel for
    sm_90 ahead of time (no GPU needed), in a process without TRITON_INTERPRET."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_prefill_tiles_compile_for_sm90_with_tma():
    from tests.kernels.sm90 import compiles_for_sm90

    compiles_for_sm90("tests.kernels.sm90_compile_moe")


# ---- the fused experts ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_fused_experts_match_torch_path_and_definition(dtype, num_tokens):
    experts = make_experts(8, 64, 32, dtype)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 64, generator=gen).to(DEVICE, dtype)
    ids, weights = random_routing(num_tokens, 8, 2, seed=num_tokens)
    got = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    assert got.dtype == dtype and got.shape == (num_tokens, 64)
    torch_path = experts.forward_torch(x, ids, weights)
    definition = per_token_reference(experts, x, ids, weights)
    torch.testing.assert_close(got, torch_path, **TOLERANCES[dtype])
    torch.testing.assert_close(got.double().cpu(), definition, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unreduced_rows_sum_to_the_reduced_output(dtype):
    """`reduce=False`: each token's k weighted expert rows [T, k, H], whose sum in order (`sum_parts`, as the
    next residual add + norm takes it) is the reduced output (float32: bit for bit; bf16 within a rounding,
    the interpreter's cast truncating)."""
    from kvc.runtime.models.layers import sum_parts

    experts = make_experts(8, 64, 32, dtype)
    x = torch.randn(19, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    ids, weights = random_routing(19, 8, 3, seed=2)
    args = (x, experts.gate_up_proj, experts.down_proj, ids, weights)
    reduced, rows = moe_triton.fused_experts(*args), moe_triton.fused_experts(*args, reduce=False)
    assert rows.shape == (19, 3, 64) and rows.dtype == dtype
    if dtype == torch.float32 or DEVICE.type == "cuda":
        assert torch.equal(sum_parts(rows), reduced)
    torch.testing.assert_close(sum_parts(rows), reduced, **TOLERANCES[dtype])
    experts.impl = "torch"
    assert experts(x, ids, weights, reduce=False).shape == (19, 64)  # the torch path sums them anyway


@pytest.mark.parametrize("config", [
    moe_triton.MoeTileConfig(block_m=16, block_n=16, block_k=16, group_m=1),
    moe_triton.MoeTileConfig(block_m=32, block_n=32, block_k=32, group_m=4),
    moe_triton.MoeTileConfig(block_m=64, block_n=128, block_k=64, group_m=8),
])
def test_fused_experts_any_tiles_odd_sizes_and_strided_input(config):
    # hidden 48 / inter 40: partial tiles along both GEMMs' N and K; x a strided view
    experts = make_experts(6, 48, 40)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(21, 2 * 48, generator=gen).to(DEVICE)[:, ::2]
    ids, weights = random_routing(21, 6, 3, seed=3)
    got = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, config)
    torch.testing.assert_close(got.double().cpu(), per_token_reference(experts, x, ids, weights),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [
    moe_triton.MoeTileConfig(block_m=16, block_n=16, block_k=32, tma=True),
    moe_triton.MoeTileConfig(block_m=32, block_n=32, block_k=16, down_block_n=64, down_block_k=32,
                             down_num_warps=8, down_num_stages=2, tma=True),
    moe_triton.MoeTileConfig(block_m=16, block_n=32, block_k=64, down_block_n=16, down_block_k=16),
])
def test_fused_experts_even_tiles_tma_and_down_tiles_of_their_own(config, dtype, monkeypatch):
    # hidden 64 / inter 32: every tile divides the weights (no masks); with `tma` the weight tiles come
    # through descriptors (the interpreter emulates them), one per GEMM; fp32 weights never take TMA
    made = []
    real = moe_triton.TensorDescriptor.from_tensor
    monkeypatch.setattr(moe_triton.TensorDescriptor, "from_tensor", lambda *a: made.append(a[1]) or real(*a))
    experts = make_experts(8, 64, 32, dtype)
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    ids, weights = random_routing(29, 8, 3, seed=6)
    got = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, config)
    want = per_token_reference(experts, x, ids, weights)
    torch.testing.assert_close(got.double().cpu(), want, **TOLERANCES[dtype])
    down = config.down()
    tiles = [[config.block_n, config.block_k], [down.block_n, down.block_k]]
    assert made == (tiles if config.tma and dtype == torch.bfloat16 else [])


def test_fused_experts_past_the_align_threshold_use_the_split_alignment(monkeypatch):
    from kvc.runtime.models import moe_align

    monkeypatch.setattr(moe_align, "ALIGN_ONE_LAUNCH_MAX_PAIRS", 64)  # the real one is too big to interpret
    calls = []
    spy_launches(monkeypatch, moe_align, "_align_split_kernel", calls)
    experts = make_experts(8, 16, 16)
    x = torch.randn(39, 16, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids, weights = random_routing(39, 8, 2, seed=4)  # 78 pairs
    config = moe_triton.MoeTileConfig(block_m=64, block_n=16, block_k=16)
    got = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights, config)
    assert calls == ["_align_split_kernel"]
    torch.testing.assert_close(got, experts.forward_torch(x, ids, weights), atol=1e-5, rtol=1e-4)


def test_idle_experts_and_repeated_tokens():
    experts = make_experts(8, 64, 32)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ids = torch.tensor([[7, 7], [7, 0], [0, 7]], device=DEVICE)  # 6 idle experts; an id twice
    weights = torch.tensor([[0.5, 0.25], [1.0, -2.0], [0.0, 3.0]], device=DEVICE)
    got = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    torch.testing.assert_close(got.double().cpu(), per_token_reference(experts, x, ids, weights),
                               atol=1e-5, rtol=1e-4)


def test_routed_experts_dispatch_and_errors(monkeypatch):
    experts = make_experts(8, 64, 32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids, weights = random_routing(4, 8, 2, seed=6)
    calls = []
    real = moe_triton.fused_experts
    monkeypatch.setattr(moe_triton, "fused_experts", lambda *a: calls.append(1) or real(*a))
    assert set_moe_impl(torch.nn.Sequential(experts, make_experts(4, 64, 32)), "triton") == 2
    torch.testing.assert_close(experts(x, ids, weights), experts.forward_torch(x, ids, weights),
                               atol=1e-5, rtol=1e-4)
    assert calls == [1]
    experts.impl = "torch"
    experts(x, ids, weights)
    assert calls == [1]
    with pytest.raises(ConfigError, match="must be one of"):
        set_moe_impl(experts, "cutlass")
    with pytest.raises(ValueError, match="down_proj must be"):
        real(x, experts.gate_up_proj, experts.gate_up_proj, ids, weights)
    if DEVICE.type == "cpu":
        experts.impl = "auto"  # the CPU default stays the torch path, even under the interpreter
        experts(x, ids, weights)
        assert calls == [1]
        experts.impl = "triton"
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
            experts(x, ids, weights)


def test_default_config_buckets_and_fits():
    decode = moe_triton.default_config(1, 8, 128, torch.bfloat16)
    prefill = moe_triton.default_config(4096, 8, 128, torch.bfloat16)
    assert decode.block_m == 16 and prefill.block_m > decode.block_m
    assert replace(prefill, block_m=32).block_m == 32  # a plain dataclass a tuner can vary
    fitted = prefill.fit(24, 40)
    assert (fitted.block_n, fitted.block_k) == (32, 64)
    assert moe_triton.MoeTileConfig(block_n=128, block_k=128).fit(8, 8).block_n == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_fused_experts_capture_in_a_cuda_graph():
    experts = make_experts(16, 128, 64, torch.bfloat16)
    x = torch.randn(8, 128, device=DEVICE, dtype=torch.bfloat16)
    ids, weights = random_routing(8, 16, 4, seed=7)
    for _ in range(2):  # compile outside the graph
        moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.fused_experts(x, experts.gate_up_proj, experts.down_proj, ids, weights)
    new_ids, new_weights = random_routing(8, 16, 4, seed=8)
    ids.copy_(new_ids)
    weights.copy_(new_weights)
    x.normal_()
    graph.replay()
    torch.testing.assert_close(out, experts.forward_torch(x, ids, weights), **TOLERANCES[torch.bfloat16])



# ---- in the models ------------------------------------------------------------------------------


def test_qwen3_moe_engine_greedy_tokens_with_triton_experts_equal_torch(tmp_path):
    from kvc import LLM, SamplingParams
    from tests.models.tiny import make_tiny_qwen3_moe

    model_dir = make_tiny_qwen3_moe(tmp_path, mlp_only_layers=[1])  # sparse, dense, sparse
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 320, (n,), generator=gen).tolist() for n in (1, 40)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for impl in ("torch", "triton"):
        # chunks of 32 and a 64-token step budget: prefill chunks and decodes share steps. On a
        # GPU the Triton run replays CUDA graphs of its decode steps; the torch path's fp32 loop
        # over experts syncs the host, so it runs eagerly.
        llm = LLM(str(model_dir), method="full", device=str(DEVICE), dtype="float32", page_size=16,
                  max_num_batched_tokens=64, max_prefill_chunk=32, cuda_graphs=impl == "triton")
        assert set_moe_impl(llm.engine.model, impl) == 2
        tokens[impl] = [out.token_ids for out in llm.generate(prompts, greedy)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["triton"])


def test_glm4_moe_lite_block_with_triton_experts_equals_transformers():
    """GLM-4.7-Flash's MoE (sigmoid router with group-limited top-k, scaling factor, a shared
    expert): transformers' block against its own router feeding the Triton experts."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm

    config = transformers.Glm4MoeLiteConfig(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True,
    )
    torch.manual_seed(10)
    block = glm.Glm4MoeLiteMoE(config).eval()
    if not all(hasattr(block, name) for name in ("route_tokens_to_experts", "gate", "experts", "shared_experts")) \
            or not hasattr(block.gate, "e_score_correction_bias"):
        pytest.skip(f"transformers {transformers.__version__}: Glm4MoeLiteMoE has another layout than this test reads")
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.1)
        block.gate.e_score_correction_bias.normal_(0.0, 0.1)
    experts = RoutedExperts(8, 64, 32)
    experts.load_state_dict(block.experts.state_dict())
    experts = experts.to(DEVICE).requires_grad_(False)
    experts.impl = "triton"
    x = torch.randn(1, 13, 64)
    with torch.no_grad():
        want = block(x)[0]
        ids, weights = block.route_tokens_to_experts(block.gate(x))
        routed = experts(x[0].to(DEVICE), ids.to(DEVICE), weights.contiguous().to(DEVICE)).cpu()
        got = routed + block.shared_experts(x[0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [24, 64])  # tiles across scale blocks (a scale a weight); tiles inside one
def test_fp8_experts_equal_the_dequantized_ones(dtype, block):
    """FP8 expert weights (codes plus per-row scales of `block`-column blocks, runtime/models/fp8_weights.py),
    dequantized tile by tile in the kernels, give what the kernels give over the weights dequantized first."""
    from kvc.runtime.models.fp8_weights import dequantize

    experts = make_experts(8, 64, 32, dtype)
    gen = torch.Generator().manual_seed(3)
    codes, scales = [], []
    for w in (experts.gate_up_proj, experts.down_proj):
        cols = -(-w.shape[2] // block)
        # codes ~ N(0, 40): weights ~ N(0, 1 / in), as make_experts' (outputs of the tolerances' scale)
        scale = ((torch.rand(*w.shape[:2], cols, generator=gen) * 0.5 + 0.75) / (40 * w.shape[2] ** 0.5)).to(DEVICE)
        codes.append((torch.randn(w.shape, generator=gen) * 40).to(torch.float8_e4m3fn).to(DEVICE))
        scales.append(scale)
    x = torch.randn(9, 64, generator=gen).to(DEVICE, dtype)
    ids, weights = random_routing(9, 8, 2, seed=4)
    got = moe_triton.fused_experts(x, *codes, ids, weights, scales=tuple(scales), scale_columns=block)
    dense = [dequantize(c, s, block, dtype) for c, s in zip(codes, scales)]
    want = moe_triton.fused_experts(x, *dense, ids, weights)
    torch.testing.assert_close(got, want, **TOLERANCES[dtype])
    with pytest.raises(ValueError, match="FP8 expert scales"):
        moe_triton.fused_experts(x, *codes, ids, weights, scales=(scales[0], scales[1].repeat(1, 1, 2)),
                                 scale_columns=block)


@pytest.mark.parametrize("impl", ["triton", "triton-split", "torch"])
def test_a_ranks_own_experts_skip_the_others_pairs(impl, monkeypatch):
    """Expert parallelism (runtime/distributed/shard.py): a rank holding some of 8 experts computes only the
    pairs routed to them; the ranks' outputs add up to the whole layer's (the Triton kernels skip the other
    pairs in the alignment, parallel or sorted; the torch path weights them 0)."""
    from kvc.runtime.models import moe_align

    whole = make_experts(8, 64, 32)
    x = torch.randn(10, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids, weights = random_routing(10, 8, 2)
    want = per_token_reference(whole, x, ids, weights)
    if impl == "triton-split":
        monkeypatch.setattr(moe_align, "ALIGN_ONE_LAUNCH_MAX_PAIRS", 0)
    total = torch.zeros_like(want)
    for first, last in ((0, 2), (2, 6), (6, 8)):
        part = make_experts(last - first, 64, 32)
        with torch.no_grad():
            part.gate_up_proj.copy_(whole.gate_up_proj[first:last])
            part.down_proj.copy_(whole.down_proj[first:last])
        part.first_expert = first
        if impl == "torch":
            part.impl = "torch"
            got = part(x, ids, weights)
        else:
            local, local_w = part.local_pairs(ids, weights)
            got = moe_triton.fused_experts(x, part.gate_up_proj, part.down_proj, local, local_w, skips=True)
        total += got.double().cpu()
    torch.testing.assert_close(total, want, **TOLERANCES[torch.float32])
