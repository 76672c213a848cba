"""Several KV methods in one engine and one batch (runtime/lanes.py, runtime/spec_group.py): each
request runs the method it names, with exactly the tokens a one-method engine gives it, while the
steps mix every method's rows in one forward pass; admission, chains and the prefix cache follow each
request's method; bad choices are refused whole."""

from __future__ import annotations

import pytest
import torch

from kvc import LLM, SamplingParams
from kvc.runtime.chains import ChainSpec
from kvc.runtime.errors import ChainMethodMismatch, ConfigError
from kvc.runtime.model_runner import ModelRunner

# small budgets so that every method changes what a ~100-token prompt keeps or reads
PARAMS = {"snapkv": {"budget": 32, "window": 8}, "quest": {"budget": 32}, "kivi": {"residual_length": 16,
                                                                                 "group_size": 16, "bits": 4}}
METHODS = ["full", "snapkv", "quest", "kivi"]  # dense, evicting, sparse, quantized
OPTIONS = dict(device="cpu", dtype="float32", kv_cache_memory=2**26, max_model_len=512, max_num_batched_tokens=4096,
               attention_backend="torch")
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def _prompts(n: int, low: int = 60, high: int = 120, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(low, high, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _single(method: str, params: dict | None = None) -> LLM:
    return LLM("random:tiny", method=method, method_params=params, **OPTIONS)


@pytest.fixture(scope="module")
def mixed() -> LLM:
    return LLM("random:tiny", method="full", methods=METHODS[1:], methods_params=PARAMS, **OPTIONS)


def test_lanes_group_by_storage_and_kernels(mixed):
    """full and SnapKV store alike and decode alike: one attention launch per layer for both; Quest's read
    plans and KIVI's codes are groups of their own."""
    groups = [[lane.key for lane in group.lanes] for group in mixed.engine.runner.groups]
    assert groups == [["full", "snapkv"], ["quest"], ["kivi"]]
    # three stores: dense K/V (full, SnapKV), dense K/V with page summaries (Quest), KIVI's codes
    assert [lane.layer_class[0] for lane in mixed.engine.lanes] == [0, 0, 1, 2] and len(mixed.engine.stores) == 3
    assert mixed.engine.method_cards()[0] == {"name": "full", "default": True, "parameters": {}}
    snapkv = mixed.engine.method_cards()[1]
    assert snapkv["name"] == "snapkv" and snapkv["parameters"]["budget"] == {"value": 32, "type": "tokens"}


def test_mixed_batch_gives_each_request_its_single_method_tokens(mixed, monkeypatch):
    prompts = _prompts(32)
    which = [METHODS[i % 4] for i in range(32)]
    mixed_steps = []
    forward = ModelRunner._forward_groups

    def spy(self, parts, *args):
        mixed_steps.append(sorted(g.lanes[0].key for g, _ in parts))
        return forward(self, parts, *args)

    monkeypatch.setattr(ModelRunner, "_forward_groups", spy)
    out = mixed.generate(prompts, GREEDY, method=which)
    assert len(mixed_steps) >= GREEDY.max_tokens  # every step mixed the three groups in one forward
    assert all(step == ["full", "kivi", "quest"] for step in mixed_steps)
    for method in METHODS:
        rows = [i for i, w in enumerate(which) if w == method]
        ref = _single(method, PARAMS.get(method)).generate([prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
        assert all(out[i].method == method for i in rows)
    # the methods did change the output (the tokens above are each method's own, not full's)
    full = _single("full").generate(prompts, GREEDY)
    assert any(out[i].token_ids != full[i].token_ids for i in range(32) if which[i] != "full")


def test_mixed_decode_frees_each_methods_pages(mixed):
    """SnapKV's rows hold pages for their budget, full's for their whole context, in one engine."""
    engine = mixed.engine
    prompt = _prompts(1, 200, 201)[0]
    full = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    snap = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, method="snapkv"))
    engine.step()
    assert full.kv_lens[0] == 200 and snap.kv_lens[0] == 32  # prefill_end kept its budget
    pages = {s.seq_id: sum(len(t) for t in s.page_tables) for s in (full, snap)}
    assert pages[snap.seq_id] < pages[full.seq_id] / 3
    stats = {s["method"]: s for s in engine.lane_stats()}
    assert stats["snapkv"]["kv_pages"] == pages[snap.seq_id] and stats["full"]["running"] == 1
    while engine.has_unfinished():
        engine.step()
    # admission counts each request by its own method's budget: SnapKV's peak is its prompt (before
    # prefill_end cuts it), full's its whole context
    rules = {lane.name: lane.rules for lane in engine.lanes}
    layers = engine.layout.layers
    assert engine.scheduler.pages_needed(4000, 4100, rules["snapkv"]) == layers * 4000 // 16
    assert engine.scheduler.pages_needed(4000, 4100, rules["full"]) == layers * -(-4100 // 16)


def test_request_parameters_make_a_lane_of_the_same_storage(mixed):
    prompts = _prompts(4, seed=1)
    params = SamplingParams(max_tokens=8, temperature=0, method="snapkv", method_params={"budget": 48})
    out = mixed.generate(prompts, [params, GREEDY, params, GREEDY])
    ref = _single("snapkv", {**PARAMS["snapkv"], "budget": 48}).generate([prompts[0], prompts[2]],
                                                                           SamplingParams(max_tokens=8, temperature=0))
    assert [out[0].token_ids, out[2].token_ids] == [r.token_ids for r in ref]
    lanes = [lane.key for lane in mixed.engine.lanes]
    assert lanes.count("snapkv(budget=48)") == 1  # made once, reused
    made = next(lane for lane in mixed.engine.lanes if not lane.loaded)
    assert made.group is mixed.engine.lanes[1].group  # its attention: the loaded SnapKV's launch


@pytest.mark.parametrize("method, params, message", [
    ("h2o", None, "is not served here; this server runs full, snapkv, quest, kivi"),
    ("no-such-method", None, "is not served here"),
    ("snapkv", {"budget": 0}, "budget"),
    ("snapkv", {"nope": 1}, "has no parameter"),
    ("kivi", {"bits": 2}, "stores K/V otherwise"),
    ("quest", {"page_size": 32}, "needs pages of 32 tokens"),  # pages of its own size
])
def test_bad_method_choices_are_refused_whole(mixed, method, params, message):
    engine = mixed.engine
    before = (engine.pool.num_free, len(engine.lanes), engine.scheduler.num_waiting)
    with pytest.raises(ConfigError, match=message) as err:
        mixed.generate([[5, 6, 7]], SamplingParams(max_tokens=2, method=method, method_params=params))
    assert err.value.status == 400
    assert (engine.pool.num_free, len(engine.lanes), engine.scheduler.num_waiting) == before
    assert mixed.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids  # the engine serves on


def test_a_chain_continues_only_with_its_method(mixed):
    prompt = _prompts(1, seed=2)[0]
    snap = SamplingParams(max_tokens=4, temperature=0, method="snapkv")
    first = mixed.generate(prompt, snap, chain=ChainSpec(open=True))[0]
    history = prompt + first.token_ids + [9, 10]
    with pytest.raises(ChainMethodMismatch, match="recorded by method 'snapkv'") as err:
        mixed.generate(history, GREEDY, chain=ChainSpec(continue_id=first.chain_id))
    assert err.value.status == 409
    again = mixed.generate(history, snap, chain=ChainSpec(continue_id=first.chain_id))[0]
    assert again.num_cached_tokens > 0 and again.method == "snapkv"
    mixed.engine.drop_chain(first.chain_id, None)


def test_a_dense_prefix_is_shared_by_the_methods_of_its_storage(mixed):
    """full names the prompt's pages; SnapKV (same storage) takes them up to its observation window and
    gives its single-engine tokens; KIVI (codes) and Quest (summaries) store otherwise: no hit."""
    prefix = _prompts(1, 96, 97, seed=3)[0]
    mixed.generate(prefix + [7], GREEDY)
    prompt = prefix + [11, 12, 13]
    snap = SamplingParams(max_tokens=8, temperature=0, method="snapkv")
    out = mixed.generate(prompt, snap)[0]
    assert out.num_cached_tokens == 80  # 96 cached, less its 8-token window, whole pages of 16
    assert out.token_ids == _single("snapkv", PARAMS["snapkv"]).generate(prompt, SamplingParams(
        max_tokens=8, temperature=0))[0].token_ids
    for method in ("kivi", "quest"):
        assert mixed.generate(prompt, SamplingParams(max_tokens=2, method=method))[0].num_cached_tokens == 0
    # and the full prefix stayed cached for the next dense request (SnapKV copied before it cut)
    assert mixed.generate(prompt, GREEDY)[0].num_cached_tokens == 96


@pytest.mark.parametrize("methods", [["full", "snapkv"], ["snapkv", "kivi", "full"]])
def test_one_group_of_two_lanes_and_async_scheduling(methods):
    """full + SnapKV alone are one attention group (their prefill chunks ordered by lane within it); with
    async scheduling the next decode step launches over pending tokens of every lane."""
    llm = LLM("random:tiny", method=methods[0], methods=methods[1:], methods_params=PARAMS, async_scheduling=True,
              **{**OPTIONS, "max_num_batched_tokens": 256, "max_prefill_chunk": 96})
    prompts = _prompts(12, seed=5)
    which = [methods[i % len(methods)] for i in range(12)]
    out = llm.generate(prompts, GREEDY, method=which)
    for method in methods:
        rows = [i for i, w in enumerate(which) if w == method]
        ref = _single(method, PARAMS.get(method)).generate([prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method


def test_preemption_keeps_each_requests_method():
    """A pool too small for every request at once: the newest are preempted and recomputed later, each
    in its own lane (full's rows still give their one-method tokens: a recompute is exact there)."""
    llm = LLM("random:tiny", method="full", methods=["snapkv", "kivi"], methods_params=PARAMS,
              **{**OPTIONS, "kv_cache_memory": 2**19})
    engine = llm.engine
    prompts = _prompts(9, 90, 110, seed=6)
    which = ["full", "snapkv", "kivi"] * 3
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    out = llm.generate(prompts, params, method=which)
    assert engine.scheduler.num_preemptions > 0
    assert [o.method for o in out] == which and all(len(o.token_ids) == 120 for o in out)
    rows = [i for i, w in enumerate(which) if w == "full"]
    ref = _single("full").generate([prompts[i] for i in rows], params)
    assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref]
    assert engine.pool.num_free == engine.pool.num_pages
    assert {s["method"]: s["requests"] for s in engine.lane_stats()} == {"full": 3, "snapkv": 3, "kivi": 3}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_decode_steps_replay_each_groups_graphs(monkeypatch, async_scheduling):
    """With decode graphs (run uncaptured on the CPU: the same buffers and code), a decode step over full,
    Quest and KIVI rows replays each group's graph over its own rows instead of one eager forward, and every
    request still gets its one-method tokens."""
    from kvc.runtime.decode_graphs import DecodeGraphs

    llm = LLM("random:tiny", method="full", methods=["quest", "kivi"], methods_params=PARAMS,
              async_scheduling=async_scheduling, **OPTIONS)
    replays, eager = [], []
    for group in llm.engine.runner.groups:
        group.graphs = DecodeGraphs(group, 4)
        monkeypatch.setattr(group.graphs, "run", lambda batch, feed=None, g=group: replays.append(
            (g.lanes[0].key, len(batch.seqs))) or g.graphs.run_uncaptured(batch, feed))
    forward = ModelRunner._forward_groups
    monkeypatch.setattr(ModelRunner, "_forward_groups", lambda self, parts, *a: eager.append(
        sum(p.num_prefills for _, p in parts)) or forward(self, parts, *a))
    prompts = _prompts(9, seed=3)
    which = [["full", "quest", "kivi"][i % 3] for i in range(9)]
    out = llm.generate(prompts, GREEDY, method=which)
    assert all(eager)  # only steps with prefill chunks ran one eager forward over several groups
    assert {key for key, _ in replays} == {"full", "quest", "kivi"} and max(n for _, n in replays) == 3
    for method in ("full", "quest", "kivi"):
        rows = [i for i, w in enumerate(which) if w == method]
        ref = _single(method, PARAMS.get(method)).generate([prompts[i] for i in rows], GREEDY)
        assert [out[i].token_ids for i in rows] == [r.token_ids for r in ref], method
