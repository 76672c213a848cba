"""Eviction methods on GLM-4.7-Flash's latent KV cache (MLA) against the references run on the decompressed
model's attention probabilities: the same kept prompt positions, and the same logits, float32 on CPU.

kvc stores one latent per token and layer, `[c, k_rope]`, and scores it with the absorbed queries
(runtime/models/glm4_moe_lite.py): one KV head that all query heads read. The oracle is transformers'
`glm4_moe_lite`, which decompresses every head's key and value; `tests/references/mla.py` writes its heads
as one KV head with the same logits, so the reference methods (`eviction.rank`, configured as in
test_served_parity.py) rank from the decompressed probabilities, averaged over every query head as kvc's
"per kv_head" means on MLA. Logits: the prefill's row and the first decode step's, over the kept tokens of
every decompressed head (`model_forward.decode`).

The sparse method: OmniKV, whose filter layers choose tokens by the step query's logits, the largest over
every query head. Its reference (tests/references/omnikv.py) runs transformers' decompressed attention and
chooses from the decompressed per-head logits; kvc chooses from the absorbed queries' logits over the latents.
Compared: greedy tokens and every sampled logit row, in a batch with chunked prefills.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny import make_tiny_glm4_moe_lite
from tests.references import omnikv as omnikv_ref
from tests.references.compare import assert_logits_close, assert_same_kept
from tests.references.eviction import gather_kv, rank
from tests.references.mla import one_kv_head
from tests.references.model_forward import HeadCache, decode
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.runtime.served import make_llm, serve
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy
from tests.runtime.test_served_parity import METHODS, STEPS, Oracle, prompts_of

PROMPTS = prompts_of([37, 101], seed=23)
# weights 5x the default spread: peaked attention, so a softmax at another temperature (the latent's width
# instead of the model's qk_head_dim) would keep other tokens
CONFIGS = {"one-dense-layer": {"initializer_range": 0.1},
           "three-dense-layers": {"num_hidden_layers": 5, "dense_layers": 3, "q_lora_rank": None,
                                  "initializer_range": 0.1}}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def oracle(request, tmp_path_factory) -> Oracle:
    return Oracle(make_tiny_glm4_moe_lite(tmp_path_factory.mktemp("glm"), seed=4, **CONFIGS[request.param]))


@pytest.mark.parametrize("chunk", [None, 20], ids=["one-step-prefill", "chunks-of-20"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_kept_positions_and_logits_match_the_decompressed_reference(oracle: Oracle, method: str, chunk) -> None:
    params, reference = METHODS[method]
    llm = make_llm(oracle.model_dir, method, params, page_size=16, chunk=chunk)
    assert llm.engine.attention.stores[0].spec.latent  # the latent cache: keys only, values their view
    for served in serve(llm, PROMPTS, STEPS):
        length = len(served.prompt)
        ref_method, ref_params = reference(length)
        layers, prompt_logits = oracle.prefill(served.prompt)
        caches = []
        for layer, t in enumerate(layers):
            q, k = one_kv_head(t.q, t.k)
            ranking = rank(ref_method, q, k, layer=layer, num_layers=len(layers), **ref_params)
            where = f"{method}, {length}-token prompt, layer {layer}"
            assert ranking.count < length, f"{where}: the budget must compress"
            assert_same_kept(ranking, served.kept_heads(layer), where=where)
            kept = served.kept_heads(layer)[0]  # the reference's, or an equal choice among near-ties
            caches.append(HeadCache(*gather_kv(t.k, t.v, [kept] * t.k.shape[0])))
        decoded = decode(oracle.hf, caches, torch.tensor(served.tokens[:-1]), start=length)
        assert_logits_close(served.logits, torch.cat([prompt_logits[-1:], decoded]),
                            where=f"{method}, {length}-token prompt")


def test_omnikv_equals_the_decompressed_reference(oracle: Oracle, monkeypatch) -> None:
    params = {"filters": [1], "selected": 0.3}  # layer 0 dense, 1 chooses, every later one reads its choice
    spy = Logits(monkeypatch)
    llm = make_llm(oracle.model_dir, "omnikv", params, page_size=4, chunk=8)
    steps = 8
    sampling = [greedy(steps) for _ in PROMPTS]
    outs = llm.generate(PROMPTS, sampling)
    blind = True
    for p, out, sp in zip(PROMPTS, outs, sampling):
        want = omnikv_ref.generate(oracle.hf, omnikv_ref.Session(dict(params)), p, steps)
        check(out.token_ids, spy.of(sp), want)
        dense = omnikv_ref.generate(oracle.hf, omnikv_ref.Session({**params, "selected": 1.0}), p, steps)[1]
        blind &= bool((dense[1:] - want[1][1:]).abs().max() <= 10 * ATOL)
    assert not blind, "OmniKV changes nothing: the test is blind"


@pytest.mark.parametrize("method,params", [("full", {}), ("snapkv", {"budget": 24, "window": 8})])
def test_chains_and_prefix_caching_on_the_latent_cache(tmp_path, method, params) -> None:
    """The engine's cache features over latent pages: a chain's turns and prefix-cache hits give the tokens
    of a fresh engine without them (`full`: the whole conversation; SnapKV: each turn compressed again, so
    the first turn equals a fresh engine's), and every page comes back."""
    from kvc.runtime.chains import ChainSpec
    from tests.runtime.chained import check_books, greedy, tokens, turn

    model_dir = make_tiny_glm4_moe_lite(tmp_path, seed=4, initializer_range=0.1)
    options = {"device": "cpu", "dtype": "float32", "page_size": 4, "attention_backend": "torch",
               "kv_cache_memory": 2**22}
    chained = LLM(str(model_dir), method=method, method_params=params or None, **options)
    plain = LLM(str(model_dir), method=method, method_params=params or None, enable_prefix_caching=False, **options)
    conversation, spec, outs = tokens(40, seed=1), ChainSpec(open=True), []
    for k in range(3):
        out = turn(chained, conversation, 5, spec)
        outs.append(out.token_ids)
        if method == "full":
            assert out.token_ids == plain.generate(conversation, greedy(5))[0].token_ids, f"turn {k}"
        spec = ChainSpec(continue_id=out.chain_id)
        conversation = conversation + out.token_ids + tokens(7 + k, seed=10 + k)
    again = [plain.generate(list(p), greedy(5))[0].token_ids for p in [tokens(40, seed=1)]]
    assert outs[0] == again[0]
    shared = tokens(40, seed=1)  # full: a prefix-cache hit on the first turn's pages, then a new suffix
    hit = chained.generate(shared + tokens(6, seed=30), greedy(5))[0]
    assert hit.num_cached_tokens > 0 or method != "full"  # SnapKV's pages were compressed: none to share
    assert hit.token_ids == plain.generate(shared + tokens(6, seed=30), greedy(5))[0].token_ids
    chained.engine.drop_chain(out.chain_id, None)
    check_books(chained.engine)
    assert chained.engine.pool.num_free == chained.engine.pool.num_pages


DECODE_TIME = {"snapkv-every": ("snapkv", {"budget": 24, "window": 8, "every": 4}), "rkv": ("rkv", {}),
               "skipkv": ("skipkv", {}), "h2o": ("h2o", {"budget": 24}),
               "streamingllm": ("streamingllm", {"budget": 20}), "kvzip": ("kvzip", {"ratio": 0.3}),
               "quest": ("quest", {"budget": 16, "page_size": 8})}


@pytest.mark.parametrize("name", sorted(DECODE_TIME))
def test_decode_time_and_replay_methods_run_on_the_latent_cache(tmp_path_factory, name) -> None:
    """The methods whose references above do not reach (decode-time eviction, a replay pass, read plans)
    serve a batch on the latent cache to its full length, within their budget, and give every page back."""
    from tests.runtime.chained import check_books

    method, params = DECODE_TIME[name]
    model_dir = make_tiny_glm4_moe_lite(tmp_path_factory.mktemp("glm"), seed=3, tokenizer=True, vocab_size=320)
    llm = LLM(str(model_dir), method=method, method_params=params, device="cpu", dtype="float32", page_size=8)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (30, 70)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [40, 40]
    check_books(llm.engine)
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
