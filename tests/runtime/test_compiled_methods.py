"""Compiled methods (kernels_generated/<m>/) served end to end through the generic adapter
(`runtime/compiled/`): greedy tokens equal the hand-written oracle
(`tests/references/model_forward.greedy_compressed`, prefill-end compression; for the methods that
also evict while decoding, `greedy_compressed_decode`) with the same semantics, on tiny random
Llama and Qwen3, float32 CPU, chunked prefill of 32, page size 7; pages held after prefill =
ceil(kept / page) per layer; clear ConfigErrors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references.model_forward import greedy_compressed, greedy_compressed_decode

STEPS = 5
LENGTHS = [30, 45, 70, 101]  # 30: shorter than some budgets (keeps all)


def _pyramid_budget(length: int, layer: int, layers: int, kv_heads: int, params: dict) -> int:
    """The compiled schedule's per-layer budget (tests/compiler/test_lowering.py compares the
    compiled pyramidkv with SnapKV at this budget: the .kvm schedule is KVCache-Factory's)."""
    from kvc.kernels_generated.pyramidkv import hooks

    return hooks.kept_tokens(length, layer, layers, kv_heads, params)


# method -> (kvc params, reference method, reference params as a function of (prompt length, layer, layers, kv_heads))
CASES = {
    "streamingllm": ({"sink": 4, "recent": 20}, "streamingllm", lambda n, *_: {"budget": 24, "n_sink": 4}),
    "snapkv": ({"budget": 32, "window": 8, "kernel": 5}, "snapkv",
               lambda n, *_: {"budget": 32, "window": 8, "kernel": 5, "pool": "avg"}),
    "tova": ({"budget": 28}, "tova", lambda n, *_: {"budget": 28}),
    "h2o": ({"heavy": 0.3, "recent": 0.1}, "h2o",
            lambda n, *_: {"budget": int(0.3 * n) + int(0.1 * n), "recent": int(0.1 * n)}),
}
DECODE_EVICTING = {"streamingllm", "tova", "h2o"}  # their .kvm also keeps in decode hooks
PYRAMID = {"budget": 24, "window": 8, "kernel": 5, "pooling": "avg", "beta": 2}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    make = {"llama": make_tiny_llama, "qwen3": make_tiny_qwen3}[request.param]
    return make(tmp_path_factory.mktemp(request.param))


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def make_llm(model_dir: Path, method: str, params: dict | None, page_size: int = 7) -> LLM:
    return LLM(str(model_dir), method=method, method_params=params, device="cpu", dtype="float32",
               page_size=page_size, max_num_batched_tokens=96, max_prefill_chunk=32, attention_backend="torch")


def reference(hf, prompt: list[int], ref_method: str, ref_params) -> list[int]:
    layers = hf.config.num_hidden_layers
    if callable(ref_params):  # per-layer params: compress each layer with its own
        from tests.references import model_forward as mf
        from tests.references.eviction import gather_kv, rank

        ids = torch.tensor(prompt)
        lp, logits = mf.prefill(hf, ids)
        caches = []
        for layer, t in enumerate(lp):
            kept = rank(ref_method, t.q, t.k, layer=layer, num_layers=layers, **ref_params(len(prompt), layer))
            caches.append(mf.HeadCache(*gather_kv(t.k, t.v, list(kept.kept()))))
        tokens = [int(logits[-1].argmax())]
        for step in range(1, STEPS):
            out = mf.decode(hf, caches, torch.tensor([tokens[-1]]), start=len(prompt) + step - 1)
            tokens.append(int(out[-1].argmax()))
        return tokens
    return greedy_compressed(hf, torch.tensor(prompt), STEPS, ref_method, **ref_params)[0].tolist()


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    return [list(o.outputs[0].token_ids) if hasattr(o, "outputs") else list(o.token_ids) for o in outs]


@pytest.mark.parametrize("method", sorted(CASES))
def test_tokens_match_the_reference(model_dir, method):
    ours, ref_method, ref_params = CASES[method]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(LENGTHS, seed=11)
    got = generate(make_llm(model_dir, method, ours), prompts)
    for prompt, tokens in zip(prompts, got):
        if method in DECODE_EVICTING:
            want = greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, method, **ours)[0].tolist()
        else:
            want = reference(hf, prompt, ref_method, {**ref_params(len(prompt))})
        assert tokens == want, f"{method}, prompt of {len(prompt)} tokens"


RKV = {"budget": 24, "window": 4, "kernel": 5, "mix": 0.07, "threshold": 0.5, "every": 2}


@pytest.mark.parametrize("mix", [0.07, 1.0])  # R-KV's default, and its attention importance alone
def test_rkv_evicts_while_decoding_as_the_reference(model_dir, monkeypatch, mix):
    """R-KV keeps every prompt token and evicts at decode steps 2 and 4 (`every` 2), scored with each row's newest
    4 queries (2 of the prompt's at step 2: the query window the prefill seeded): the reference's tokens, and the
    rows really shrink to the budget."""
    from kvc.runtime.compiled.method import CompiledMethod

    kept = []
    step_end_batch = CompiledMethod.step_end_batch

    def spy(self, layer, views):
        plans = step_end_batch(self, layer, views)
        kept.extend((view.cache.length, plan.indices.shape[1]) for view, plan in zip(views, plans) if plan is not None)
        return plans

    monkeypatch.setattr(CompiledMethod, "step_end_batch", spy)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(LENGTHS, seed=13)
    params = RKV | {"mix": mix}
    got = generate(make_llm(model_dir, "rkv", params), prompts)
    for prompt, tokens in zip(prompts, got):
        want = greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, "rkv", **params)[0].tolist()
        assert tokens == want, f"prompt of {len(prompt)} tokens"
    assert kept and all(count == RKV["budget"] < length for length, count in kept)


def test_rkv_in_graph_steps(model_dir, monkeypatch):
    """R-KV's decode steps through the CUDA-graph runner's own step, uncaptured on the CPU (static buffers,
    padding rows, no host rows: each decode row's query goes to its window on the device): the reference's
    tokens."""
    from tests.methods import served

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(LENGTHS[1:], seed=14)
    llm = make_llm(model_dir, "rkv", RKV)
    replays = served.graph_steps(llm, monkeypatch)
    got = generate(llm, prompts)
    assert replays and 3 in replays  # bucket 4: one padding row
    for prompt, tokens in zip(prompts, got):
        assert tokens == greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, "rkv", **RKV)[0].tolist()


def test_chunk_hooks_in_query_blocks_keep_the_same_tokens(model_dir, monkeypatch):
    """The torch path runs a chunk hook over blocks of the chunk's queries (16 here, the smallest
    block, so each chunk of 32 is two): H2O's accumulated scores, hence its tokens, are unchanged."""
    from kvc.runtime.compiled.method import CompiledMethod

    monkeypatch.setattr(CompiledMethod, "QUERY_BLOCK_BYTES", 1)
    ours = CASES["h2o"][0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = prompts_of(LENGTHS, seed=11)
    for prompt, tokens in zip(prompts, generate(make_llm(model_dir, "h2o", ours), prompts)):
        want = greedy_compressed_decode(hf, torch.tensor(prompt), STEPS, "h2o", **ours)[0].tolist()
        assert tokens == want, f"prompt of {len(prompt)} tokens"


def test_pyramidkv_matches_snapkv_at_the_compiled_schedule(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kv_heads, layers = hf.config.num_key_value_heads, hf.config.num_hidden_layers
    prompts = prompts_of(LENGTHS, seed=12)
    got = generate(make_llm(model_dir, "pyramidkv", PYRAMID), prompts)
    for prompt, tokens in zip(prompts, got):
        def per_layer(n, layer):
            budget = _pyramid_budget(n, layer, layers, kv_heads, PYRAMID)
            return {"budget": budget, "window": 8, "kernel": 5, "pool": "avg"}
        assert tokens == reference(hf, prompt, "snapkv", per_layer), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv", "h2o"])
def test_pages_after_prefill(model_dir, method):
    params = PYRAMID if method == "pyramidkv" else CASES[method][0]
    page, prompt_len = 7, 101
    llm = make_llm(model_dir, method, params, page_size=page)
    engine: Engine = llm.engine
    seq = engine.add_request(prompts_of([prompt_len], seed=5)[0],
                             SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True))
    while seq.is_prefill:
        engine.step()
    layers = engine.spec.num_layers
    kept = [engine.method.budget.kept(prompt_len, layer) for layer in range(layers)]
    assert all(k < prompt_len for k in kept)
    assert seq.kv_lens == kept
    assert [len(t) for t in seq.page_tables] == [-(-k // page) for k in kept]
    assert engine.pool.num_used == sum(-(-k // page) for k in kept)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_pages
    assert not engine.method._q and not engine.method._state  # released


def test_budget_formula():
    from kvc.runtime.methods import resolve_method

    m = resolve_method("snapkv", {"budget": 32, "window": 8})
    m.bind(2, 2)
    assert m.budget.peak_tokens(100, 0) == 100
    assert m.budget.steady_tokens(100, 110, 1) == 32 + 10
    assert m.budget.steady_tokens(20, 25, 0) == 25


def test_full_is_a_compiled_method():
    """`full` comes from methods/full.kvm through the same adapter: no hooks, nothing evicted."""
    from kvc.runtime.methods import resolve_method
    from kvc.runtime.compiled.method import CompiledMethod

    m = resolve_method("full")
    m.bind(2, 2)
    assert isinstance(m, CompiledMethod) and m.hooks == frozenset() and not m.compacts and m.decode_graphs
    assert m.budget.peak_tokens(100, 0) == 100 and m.budget.steady_tokens(100, 130, 1) == 130


def test_fingerprint_tells_parameters_apart():
    from kvc.runtime.methods import resolve_method

    a, b = resolve_method("snapkv", {"budget": 32}), resolve_method("snapkv", {"budget": 64})
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint == resolve_method("snapkv", {"budget": 32}).fingerprint
    assert resolve_method("full").fingerprint.startswith("full()@")


def test_config_errors(tmp_path):
    from kvc.runtime.methods import resolve_method

    with pytest.raises(ConfigError, match="unknown method 'nope'.*snapkv"):
        resolve_method("nope")
    variant = Path(__file__).resolve().parents[2] / "bench" / "variants" / "turboquant_prod.kvm"  # QJL: not lowered
    with pytest.raises(ConfigError, match=r"not lowered.*qjl.*turboquant_prod.kvm:10:1"):
        resolve_method(str(variant))
    with pytest.raises(ConfigError, match="no parameter.*'bogus'"):
        resolve_method("snapkv", {"bogus": 1})
    with pytest.raises(ConfigError, match="window"):
        resolve_method("snapkv", {"window": -3})
    with pytest.raises(ConfigError, match="pooling"):
        resolve_method("snapkv", {"pooling": "median"})
    with pytest.raises(ConfigError, match="'full' has no parameter.*'budget'.*none"):
        resolve_method("full", {"budget": 3})
    with pytest.raises(ConfigError, match="unknown method"):
        LLM(str(make_tiny_llama(tmp_path)), method="nope", device="cpu")
