"""Tensor parallelism on the CPU (runtime/distributed/): two ranks over gloo, the follower spawned by the
engine, give the greedy tokens of one rank for full, SnapKV, Ada-KV (whose selection across KV heads
gathers every rank's scores) and TOVA (whose mean over the query heads the ranks combine), on tiny random
Qwen3 and Qwen3-MoE, with chunked prefill, a chain continued and a prefix-cache hit; what does not split
over ranks is refused up front."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.chains import ChainSpec
from kvc.runtime.distributed.group import HeadShards
from kvc.runtime.errors import ConfigError
from tests.models.tiny import make_tiny_glm4_moe_lite, make_tiny_llama, make_tiny_qwen3, make_tiny_qwen3_moe

PARAMS = {"snapkv": {"budget": 32, "window": 8}, "adakv": {"budget": 32, "window": 8}, "tova": {"budget": 32}}
OPTIONS = dict(device="cpu", dtype="float32", kv_cache_memory=2**24, max_num_batched_tokens=256, max_prefill_chunk=64)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
METHODS = ["full", "snapkv", "adakv", "tova"]


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(40, 120, (n,), generator=g)]


@pytest.mark.parametrize("make", [make_tiny_qwen3, make_tiny_qwen3_moe], ids=["qwen3", "qwen3_moe"])
def test_two_ranks_give_one_ranks_tokens(tmp_path: Path, make):
    model = str(make(tmp_path))
    prompts = _prompts(12)
    which = [METHODS[i % 4] for i in range(12)]
    tp = LLM(model, method="full", methods=METHODS[1:], methods_params=PARAMS, tensor_parallel_size=2, **OPTIONS)
    try:
        engine = tp.engine
        assert engine.spec.num_heads == 2 and engine.spec.num_kv_heads == 1  # this rank's half of 4 / 2
        out = tp.generate(prompts, GREEDY, method=which)
        # a chain continued on both ranks, and a prefix-cache hit (full's pages, named on both ranks)
        first = tp.generate(prompts[0], GREEDY, chain=ChainSpec(open=True))[0]
        history = prompts[0] + first.token_ids + [7, 8, 9]
        turn = tp.generate(history, GREEDY, chain=ChainSpec(continue_id=first.chain_id))[0]
        hit = tp.generate(prompts[4] + [5], GREEDY)[0]
    finally:
        tp.engine.close()
    assert turn.num_cached_tokens > 0 and hit.num_cached_tokens > 0
    for method in METHODS:
        rows = [i for i, w in enumerate(which) if w == method]
        one = LLM(model, method=method, method_params=PARAMS.get(method), **OPTIONS)
        ref = one.generate([prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
        if method == "full":
            ref_first = one.generate(prompts[0], GREEDY, chain=ChainSpec(open=True))[0]
            assert ref_first.token_ids == first.token_ids
            ref_turn = one.generate(history, GREEDY, chain=ChainSpec(continue_id=ref_first.chain_id))[0]
            assert ref_turn.token_ids == turn.token_ids
            assert one.generate(prompts[4] + [5], GREEDY)[0].token_ids == hit.token_ids


def test_head_shards_split_and_replicate():
    """Query heads split evenly; KV heads too, or replicated when fewer than ranks (each rank its group's)."""
    split = [HeadShards(8, 4, r, 2) for r in range(2)]
    assert [(list(s.heads), list(s.kv_heads)) for s in split] == [([0, 1, 2, 3], [0, 1]), ([4, 5, 6, 7], [2, 3])]
    replicated = [HeadShards(8, 2, r, 4) for r in range(4)]
    assert [list(s.kv_heads) for s in replicated] == [[0], [0], [1], [1]] and replicated[0].replicas == 2
    with pytest.raises(ConfigError, match="must divide the model's 6 attention heads"):
        HeadShards(6, 2, 0, 4)


@pytest.mark.parametrize("method, message", [
    ("kvzip", "its replay_end computes across KV heads"),
    ("duoattention", "it reads per-head inputs indexed by the model's heads"),
])
def test_methods_that_cross_ranks_are_refused(tmp_path: Path, method, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(make_tiny_qwen3(tmp_path)), method=method, tensor_parallel_size=2, **OPTIONS)


@pytest.mark.parametrize("method, params", [("snapkv", PARAMS["snapkv"]), ("h2o", {"budget": 32}),
                                            ("quest", {"budget": 32})])
def test_replicated_kv_heads_combine_their_query_groups(tmp_path: Path, method, params):
    """Four ranks over two KV heads: each KV head lives on two ranks, each with half its query group. The
    folds over a query group (SnapKV's window scores at prefill end, H2O's decode statistics folded by the
    kernel, Quest's page bound) combine the two halves, so both replicas keep and read alike: one rank's
    tokens."""
    model = str(make_tiny_qwen3(tmp_path))
    prompts = _prompts(3, seed=4)
    with LLM(model, method=method, method_params=params, tensor_parallel_size=4, **OPTIONS) as tp:
        assert tp.engine.heads.replicas == 2
        out = tp.generate(prompts, GREEDY)
    ref = LLM(model, method=method, method_params=params, **OPTIONS).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


def test_bad_sizes_are_refused(tmp_path: Path):
    with pytest.raises(ConfigError, match="tensor_parallel_size=3 must divide the model's 4 attention heads"):
        LLM(str(make_tiny_qwen3(tmp_path)), tensor_parallel_size=3, **OPTIONS)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(make_tiny_qwen3(tmp_path)), tensor_parallel_size=0, **OPTIONS)


def test_expert_parallel_ranks_give_one_ranks_tokens(tmp_path: Path):
    """--expert-parallel: each rank holds 4 of the 8 experts whole (a pair routed to the other rank's adds
    nothing here); the layer's all-reduce adds the ranks' shares: one rank's tokens."""
    model = str(make_tiny_qwen3_moe(tmp_path))
    prompts = _prompts(4, seed=1)
    with LLM(model, tensor_parallel_size=2, expert_parallel=True, **OPTIONS) as tp:
        experts = tp.engine.model.layers[0].mlp.experts
        assert (experts.num_experts, experts.first_expert) == (4, 0)
        out = tp.generate(prompts, GREEDY)
    ref = LLM(model, **OPTIONS).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


class _Ranks:
    """What shard_model reads of a TPGroup: the rank, the size, and the all-reduce its hooks call."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("make, overrides, expert_parallel", [
    (make_tiny_llama, {"attention_bias": True, "mlp_bias": True}, False),
    (make_tiny_qwen3, {}, False),
    (make_tiny_qwen3_moe, {}, False),
    (make_tiny_qwen3_moe, {}, True),
    (make_tiny_glm4_moe_lite, {}, False),
], ids=["llama-biases", "qwen3", "qwen3_moe", "qwen3_moe-expert-parallel", "glm"])
def test_a_rank_loads_only_its_part_and_the_part_equals_the_whole_model_cut(tmp_path: Path, make, overrides,
                                                                             expert_parallel):
    """Cut on the meta device, then read: every rank's parameters (rows, columns, experts; rank 0's biases after
    an all-reduce, the others' none) equal the whole loaded model cut, and the rank allocates less than the
    whole model."""
    from kvc.runtime.distributed.shard import shard_model
    from kvc.runtime.models.loader import load_model

    model_dir = make(tmp_path, **overrides)
    whole = load_model(model_dir).model
    size = sum(p.numel() for p in whole.parameters())
    for rank in range(2):
        cut = load_model(model_dir).model
        shard_model(cut, _Ranks(rank, 2), expert_parallel)
        want = dict(cut.named_parameters())
        got = dict(load_model(model_dir, cut=lambda m: shard_model(m, _Ranks(rank, 2), expert_parallel))
                   .model.named_parameters())
        assert sorted(got) == sorted(want)
        for name, p in got.items():
            assert torch.equal(p, want[name]), name
        assert sum(p.numel() for p in got.values()) < size
        # an MoE layer's output is all-reduced: its k expert rows per token come summed, not left to the norm
        assert all(m.reduce_pairs for m in cut.modules() if hasattr(m, "reduce_pairs"))


@pytest.mark.parametrize("method, params", [("full", None), ("fp8", {"scale": "dynamic"}),
                                            ("snapkv", PARAMS["snapkv"]), ("tova", PARAMS["tova"])])
def test_glm_over_two_ranks_gives_one_ranks_tokens(tmp_path: Path, method, params):
    """GLM-4.7-Flash (MLA): each rank holds half the query heads (their rows of the query and up projections,
    columns of the output one), half of every expert's and the shared experts' columns, and the whole latent
    cache (its one KV head replicated, the scores over it combined from both halves of the query heads);
    chunked prefill in the decompressed form, latent decode: one rank's tokens."""
    model = str(make_tiny_glm4_moe_lite(tmp_path, seed=3))
    prompts = _prompts(3, seed=2)
    with LLM(model, method=method, method_params=params, tensor_parallel_size=2, **OPTIONS) as tp:
        assert tp.engine.spec.num_heads * 2 == LLM(model, **OPTIONS).engine.spec.num_heads
        out = tp.generate(prompts, GREEDY)
    ref = LLM(model, method=method, method_params=params, **OPTIONS).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


def test_chain_limits_drop_the_same_chains_on_every_rank(tmp_path: Path):
    """--max-chains: every rank drops the least recently used idle chain by its logical clock; --chain-ttl: the
    leader's clock decides between steps and the follower drops the same chains. The next steps find both
    ranks' pools alike (each commit checks the free pages), and the tokens are one rank's."""
    import time

    from kvc.runtime.chains import ChainLimits

    model = str(make_tiny_qwen3(tmp_path))
    prompts = _prompts(3, seed=6)
    with LLM(model, tensor_parallel_size=2, **OPTIONS) as tp:
        engine = tp.engine
        free = engine.pool.num_free
        engine.set_chain_limits(ChainLimits(ttl=60, max_chains=2))
        for prompt in prompts:
            tp.generate(prompt, GREEDY, chain=ChainSpec(open=True))
        assert len(engine.chains.records()) == 2 and engine.chains.expired_total == 1
        assert engine.expire_chains() == 0  # not idle for the TTL yet
        assert engine.expire_chains(now=time.time() + 61) == 2 and engine.pool.num_free == free
        out = tp.generate(prompts, GREEDY)
    ref = LLM(model, **OPTIONS).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


@pytest.mark.parametrize("method, params, size", [("full", None, 2), ("adakv", PARAMS["adakv"], 2),
                                                  ("snapkv", PARAMS["snapkv"], 4)],
                         ids=["full-2", "adakv-2", "snapkv-4-replicated"])
def test_a_chain_pruned_over_ranks_continues_as_on_one(tmp_path: Path, method, params, size):
    """A prune of an idle chain (SnapKV's scores over the stored window of queries) runs on every rank: a layer's
    drops and width agree over the ranks' heads (per-head layers of Ada-KV as wide as the widest head anywhere;
    replicated KV heads' scores combined), so the pages stay alike, the next turn gives one rank's tokens, and the
    report counts every rank's heads."""
    from kvc.runtime.chain_prune import PruneRequest

    model = str(make_tiny_qwen3(tmp_path))
    prompt = _prompts(1, seed=8)[0]
    request = PruneRequest(token_ranges=((4, 40),), keep=0.3, scorer="snapkv", scorer_params={"window": 8})

    def session(llm):
        first = llm.generate(prompt, GREEDY, chain=ChainSpec(open=True))[0]
        report = llm.engine.prune_chain(first.chain_id, None, request)
        convo = prompt + first.token_ids + [7, 8, 9]
        second = llm.generate(convo, GREEDY, chain=ChainSpec(continue_id=first.chain_id))[0]
        return first.token_ids, second.token_ids, report["pages"] < report["pages_before"], report["dropped"]

    with LLM(model, method=method, method_params=params, tensor_parallel_size=size, prune_scorer="snapkv",
             **OPTIONS) as tp:
        got = session(tp)
    assert got == session(LLM(model, method=method, method_params=params, prune_scorer="snapkv", **OPTIONS))
    assert got[2]
