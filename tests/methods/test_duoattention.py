"""DuoAttention (methods/duoattention.kvm) compiled and served, against hand-written oracles.

- The generated roles: `gate <= quantile(gate, sparsity, ...)` makes exactly round(sparsity * heads)
  heads stream, the lowest-gated ones (tests/references/duoattention.streaming_mask).
- Sparsity 0: no head streams, the greedy tokens are `full`'s (tiny Llama and Qwen3); every head
  streaming: StreamingLLM's sink + recent per head (the served streamingllm method at the same sink and window).
- Sparsity 0.5: the engine equals tests/references/duoattention.py (per-head caches, streaming heads
  cut to sink + recent after every prefill chunk and decode step), tokens and every sampled logit
  row: a batch with chunked prefills beside decodes, prefix caching asked for, a chain continued and
  forked, a preemption (recomputed as one prefill).
- Missing gates, or gates of another model's shape, are ConfigErrors that say what to run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.chains import ChainSpec
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from kvc.runtime.models.method_inputs import save_input
from tests.models.tiny import load_hf, make_tiny_llama
from tests.references import duoattention as duo_ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import Logits, check, greedy, prompt

PAGE = 4
SINK, RECENT = 2, 5
GATE_FILE = "duo_attention_heads.safetensors"


def roles_of(gate: torch.Tensor, sparsity: float) -> torch.Tensor:
    from kvc.compiler.cache import locate
    from kvc.runtime.compiled import folder
    from kvc.runtime.compiled.folder import GeneratedCode

    compiled = locate("duoattention", generated=folder.GENERATED)
    code = GeneratedCode("duoattention", compiled.folder, compiled.manifest)
    return code.lowering.roles({"gate": gate}, {"sparsity": sparsity, "sink": SINK, "recent": RECENT})["streaming"]


@pytest.mark.parametrize("shape", [(3, 2), (30, 3), (7, 5)])
def test_quantile_roles_stream_exactly_round_sparsity_heads(shape) -> None:
    gate = torch.rand(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    n = gate.numel()
    for sparsity in (0.0, 0.1, 0.25, 0.5, 0.7, 0.99, 1.0):
        mask = roles_of(gate, sparsity)
        assert mask.shape == shape and mask.dtype == torch.bool
        assert int(mask.sum()) == int(sparsity * n + 0.5), sparsity
        assert torch.equal(mask, duo_ref.streaming_mask(gate, sparsity))
        if 0 < int(mask.sum()) < n:  # the streaming heads are the lowest-gated
            assert gate[mask].max() < gate[~mask].min()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("duo"), seed=7, num_hidden_layers=3, initializer_range=0.25)
    save_input(path / GATE_FILE, "gate", gate())
    return path


def gate() -> torch.Tensor:
    return torch.rand(3, 2, generator=torch.Generator().manual_seed(0))  # [layers, kv_heads] of the tiny Llama


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def make_llm(model_dir: Path, method: str = "duoattention", params: dict | None = None, **options) -> LLM:
    if params is None:
        params = {"sink": SINK, "recent": RECENT, "sparsity": 0.5} if method == "duoattention" else {}
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method=method, method_params=params,
                          **{"max_num_batched_tokens": 4096, **options})
    return LLM.from_engine(Engine(config))


def session(sparsity: float = 0.5) -> duo_ref.Session:
    return duo_ref.Session(duo_ref.streaming_mask(gate(), sparsity), SINK, RECENT)


def test_sparsity_zero_is_full(model_dir) -> None:
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (41, 2), (9, 3))]
    params = [greedy(12) for _ in prompts]
    full = [o.token_ids for o in make_llm(model_dir, "full").generate(prompts, params)]
    zero = make_llm(model_dir, params={"sink": SINK, "recent": RECENT, "sparsity": 0.0}, max_prefill_chunk=8)
    assert [o.token_ids for o in zero.generate(prompts, [greedy(12) for _ in prompts])] == full
    half = make_llm(model_dir, max_prefill_chunk=8)
    assert [o.token_ids for o in half.generate(prompts, [greedy(12) for _ in prompts])] != full, "test is blind"


def test_every_head_streaming_is_streamingllm(model_dir, monkeypatch) -> None:
    """One prefill chunk: StreamingLLM's prefill_end and step_end keep sink + window, as every
    streaming head does."""
    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (17, 2))]
    duo_params, sl_params = [greedy(10) for _ in prompts], [greedy(10) for _ in prompts]
    duo = make_llm(model_dir, params={"sink": SINK, "recent": RECENT, "sparsity": 1.0}).generate(prompts, duo_params)
    sl = make_llm(model_dir, "streamingllm", {"sink": SINK, "recent": RECENT}).generate(prompts, sl_params)
    for a, b, pa, pb in zip(duo, sl, duo_params, sl_params):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(spy.of(pa), spy.of(pb), atol=1e-5, rtol=1e-5)


def test_batch_with_chunked_prefills_equals_the_reference(model_dir, hf, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_prefill_chunk=8)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        check(out.token_ids, spy.of(sp), duo_ref.generate(hf, session(), p, 10, chunk=8))
    one_chunk = duo_ref.generate(hf, session(), prompts[1], 10)
    assert (one_chunk[1] - spy.of(params[1])).abs().max() > 1e-3, "chunks change nothing: the test is blind"


def test_prefix_caching_asked_for(model_dir, hf, monkeypatch) -> None:
    """A method that compacts runs without prefix caching (docs/design.md): asking for it changes nothing."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, enable_prefix_caching=True)
    assert llm.engine.method.compacts
    first, second = prompt(30, 4), prompt(11, 5)
    a = llm.generate(first, greedy(6))[0]
    params = greedy(8)
    b = llm.generate(first[:20] + second, params)[0]
    assert b.num_cached_tokens == 0
    assert a.token_ids == duo_ref.generate(hf, session(), first, 6)[0]
    check(b.token_ids, spy.of(params), duo_ref.generate(hf, session(), first[:20] + second, 8))


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir)
    opening, suffixes = prompt(26, 6), [prompt(1, 7), prompt(2, 8), prompt(3, 12)]
    ref = session()
    first = llm.generate(opening, greedy(5), chain=ChainSpec(open=True))[0]
    assert first.token_ids == duo_ref.generate(hf, ref, opening, 5)[0]
    history = opening + first.token_ids
    specs = [ChainSpec(fork_id=first.chain_id), ChainSpec(fork_id=first.chain_id),
             ChainSpec(continue_id=first.chain_id)]
    for user, spec in zip(suffixes, specs):
        params = greedy(6)
        out = llm.generate(history + user, params, chain=spec)[0]
        check_books(llm.engine)
        assert out.num_cached_tokens == len(history) - 1
        check(out.token_ids, spy.of(params), duo_ref.generate(hf, ref.copy(), [first.token_ids[-1]] + user, 6))


def test_missing_gates_say_how_to_calibrate(tmp_path: Path) -> None:
    bare = make_tiny_llama(tmp_path, seed=1, num_hidden_layers=2)
    with pytest.raises(ConfigError, match="kvc calibrate duoattention"):
        make_llm(bare)
    save_input(bare / GATE_FILE, "gate", torch.rand(3, 2))  # a gate for another model's shape
    with pytest.raises(ConfigError, match="shape"):
        make_llm(bare)


def test_inputs_from_a_directory_of_their_own(tmp_path: Path) -> None:
    """`method_inputs` (`--method-inputs DIR`) is read instead of the model directory, so a model
    without gates (a random-weight benchmark shape) runs with gates written elsewhere; the file
    decides the roles and the fingerprint."""
    bare = make_tiny_llama(tmp_path / "model", seed=1, num_hidden_layers=2)
    gates = tmp_path / "gates"
    gates.mkdir()
    save_input(gates / GATE_FILE, "gate", torch.tensor([[0.9, 0.1], [0.2, 0.8]]))
    llm = make_llm(bare, method_inputs=str(gates))
    assert llm.engine.method.roles.masks == {"streaming": [[False, True], [True, False]]}
    save_input(gates / GATE_FILE, "gate", torch.tensor([[0.1, 0.9], [0.2, 0.8]]))
    other = make_llm(bare, method_inputs=str(gates))
    assert other.engine.method.roles.masks == {"streaming": [[True, False], [True, False]]}
    assert other.engine.method.fingerprint != llm.engine.method.fingerprint
    with pytest.raises(ConfigError, match="kvc calibrate duoattention"):
        make_llm(bare, method_inputs=str(tmp_path / "nowhere"))


def test_preemption_recomputes_as_a_prefill(model_dir, hf, monkeypatch) -> None:
    """A preempted request recomputes prompt + generated tokens as one prefill, cut once after it."""
    spy = Logits(monkeypatch)
    engine = make_llm(model_dir).engine
    p = prompt(21, 9)
    params = greedy(9)
    seq = engine.add_request(p, params)
    for _ in range(4):  # the prefill and three decode steps: four tokens
        engine.step()
    done = len(seq.token_ids) - len(p)
    engine.scheduler._preempt(seq)
    while engine.has_unfinished():
        engine.step()
    assert seq.num_preemptions == 1
    check_books(engine)
    head, head_logits = duo_ref.generate(hf, session(), p, done)
    tail, tail_logits = duo_ref.generate(hf, session(), p + head, 9 - done)
    rows = spy.of(params)
    check(seq.token_ids[len(p):], rows, (head + tail, torch.cat([head_logits, tail_logits])))


@pytest.mark.parametrize("arch", ["qwen3"])
def test_sparsity_zero_is_full_on_qwen3(tmp_path: Path, arch: str) -> None:
    from transformers import AutoConfig

    from tests.models.tiny import make_tiny_qwen3

    path = make_tiny_qwen3(tmp_path, seed=5, num_hidden_layers=3, initializer_range=0.25)
    config = AutoConfig.from_pretrained(path)
    save_input(path / GATE_FILE, "gate", torch.rand(config.num_hidden_layers, config.num_key_value_heads))
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (41, 2))]
    full = [o.token_ids for o in make_llm(path, "full").generate(prompts, [greedy(10) for _ in prompts])]
    zero = make_llm(path, params={"sink": SINK, "recent": RECENT, "sparsity": 0.0}, max_prefill_chunk=8)
    assert [o.token_ids for o in zero.generate(prompts, [greedy(10) for _ in prompts])] == full
    half = make_llm(path, max_prefill_chunk=8)
    assert [o.token_ids for o in half.generate(prompts, [greedy(10) for _ in prompts])] != full


def test_the_embedded_model_has_shipped_gates(tmp_path: Path) -> None:
    """A model converted from the embedded GGUF (its kvc_conversion.json names the file) finds the
    shipped gates, of its shape (30 layers x 3 KV heads); its own directory's file would win."""
    import json

    from kvc.runtime.default_model import GGUF_NAME
    from kvc.runtime.models.method_inputs import SHIPPED, find_input, load_input

    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "kvc_conversion.json").write_text(json.dumps({"source_name": GGUF_NAME}))
    path = find_input(converted, GATE_FILE)
    assert path is not None and path.parent.parent == SHIPPED
    shipped = load_input(path, "gate")
    assert shipped.shape == (30, 3) and shipped.dtype == torch.float32
    assert ((shipped >= 0) & (shipped <= 1)).all() and (shipped < 1).any()
    assert int(roles_of(shipped, 0.5).sum()) == 45
    save_input(converted / GATE_FILE, "gate", torch.zeros(30, 3))
    assert find_input(converted, GATE_FILE) == converted / GATE_FILE
    assert find_input(tmp_path, GATE_FILE) is None  # not converted from a GGUF with shipped inputs


def test_neither_records_nor_replays(model_dir) -> None:
    """Its later chunks attend to what earlier chunks left: a record of its forward is no other
    method's, and another method's record is not its forward."""
    from kvc.runtime.prefill_record import PrefillRecord

    engine = make_llm(model_dir).engine
    assert engine.method.chunk_keeps
    for option in ("record", "replay"):
        with pytest.raises(ConfigError, match="neither records nor replays"):
            engine.add_request(prompt(12, 1), greedy(2), **{option: PrefillRecord()})


def test_streaming_heads_free_their_pages(model_dir) -> None:
    """Each KV head is a cache layer of its own (runtime/kv/layout.py): a streaming head's table
    holds its sink + recent tokens (and the slot its ring writes next), a retrieval head's the whole
    context, so the sequence holds about half of full's KV bytes at sparsity 0.5, and the freed pages
    are back in the pool."""
    p, out = prompt(60, 1), 20
    held = {}
    for method in ("full", "duoattention"):
        engine = make_llm(model_dir, method, max_prefill_chunk=8).engine
        seq = engine.add_request(p, greedy(out))
        for _ in range(12):  # the prefill's 8 chunks and 4 decode steps
            engine.step()
        page_bytes = engine.attention.store.spec.bytes_per_page(engine.layout.kv_heads, PAGE)
        assert engine.pool.num_free == engine.num_pages - sum(len(t) for t in seq.page_tables)
        held[method] = sum(len(t) for t in seq.page_tables) * page_bytes
        context = len(seq.token_ids) - 1  # the newest token is not stored yet
        if method == "full":
            assert engine.layout.layers == 3 and seq.kv_lens == [context] * 3
            continue
        layout, masks = engine.layout, engine.method.roles.masks["streaming"]
        assert layout.per_head and layout.layers == 6 and layout.kv_heads == 1
        for layer in range(3):
            for head, cache_layer in enumerate(layout.cache_layers(layer)):
                # a streaming head rings at sink + recent + 1 slots (runtime/kv/ring.py)
                expected = SINK + RECENT + 1 if masks[layer][head] else context
                assert seq.kv_lens[cache_layer] == expected, (layer, head)
                assert len(seq.page_tables[cache_layer]) == -(-expected // PAGE)
    streaming = sum(sum(m) for m in masks)
    assert 0 < streaming < 6
    assert held["duoattention"] <= held["full"] * ((6 - streaming) / 6 + 0.2)


def test_admission_counts_the_streaming_heads_saving(model_dir) -> None:
    """The budget follows each cache layer's role: a request's steady pages are its retrieval heads'
    context plus its streaming heads' sink + recent (+ the eviction interval), which the throughput
    benchmark's largest batch counts; in a pool that holds two and a half of full's requests, four
    of full's preempt one another, DuoAttention's run to the end together with the tokens they
    give one at a time."""
    from kvc.runtime.bench.plan import plan_batch

    prompt_len, out = 200, 16
    grown = prompt_len + out
    plans, preempted, tokens = {}, {}, {}
    full_bytes = None
    for method in ("full", "duoattention"):
        engine = make_llm(model_dir, method).engine
        plans[method] = plan_batch(engine.method, engine.spec, 2**22, PAGE, prompt_len, out, 10**6,
                                   inputs_dir=model_dir)
        if method == "full":
            page_bytes = engine.attention.store.spec.bytes_per_page(engine.layout.kv_heads, PAGE)
            full_bytes = 3 * -(-grown // PAGE) * page_bytes  # one request at its end
        else:
            masks = engine.method.roles.masks["streaming"]
            steady = [engine.method.budget.steady_tokens(prompt_len, grown, cl) for cl in range(6)]
            assert steady == [SINK + RECENT + 1 if masks[cl // 2][cl % 2] else grown for cl in range(6)]
        params = {"sink": SINK, "recent": RECENT, "sparsity": 0.5} if method == "duoattention" else {}
        config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                              attention_backend="torch", kv_cache_memory=int(2.5 * full_bytes), method=method,
                              method_params=params, max_prefill_chunk=64)
        engine = Engine(config)
        seqs = [engine.add_request(prompt(prompt_len, seed), greedy(out)) for seed in range(4)]
        while engine.has_unfinished():
            engine.step()
        preempted[method] = sum(s.num_preemptions for s in seqs)
        tokens[method] = [s.token_ids[prompt_len:] for s in seqs]
    assert plans["duoattention"].batch >= 1.5 * plans["full"].batch
    assert preempted["full"] > 0 and preempted["duoattention"] == 0
    alone = make_llm(model_dir, max_prefill_chunk=64).generate([prompt(prompt_len, seed) for seed in range(4)],
                                                               [greedy(out) for _ in range(4)])
    assert tokens["duoattention"] == [o.token_ids for o in alone]
