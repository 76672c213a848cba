"""The compiled `kivi` method (methods/kivi.kvm) served on tiny random Llama and Qwen3 models, against
the hand-written KIVI reference (tests/references/kivi.py): keys quantized per channel over groups
of tokens, a block of `residual_length` at a time; values per token; the newest tokens exact; the
step's own tokens exact (KIVI's full-precision prefill). The quantizer is bit-exact against the
reference's numpy one; greedy tokens and every sampled logit row match through a batch, chunked
prefills, a chain continued and forked, a preemption, and the Triton kernels (interpreted); the
pool holds the tokens its bytes per token say.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import encodings
from kvc.runtime.kv.spec import Quantized
from kvc.runtime.llm import LLM
from tests.kernels.sm90 import compiles_for_sm90
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import kivi as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

GROUP, RESIDUAL = 4, 8  # pages of one group (the method's page size)
PARAMS = {"bits": 2, "group_size": GROUP, "residual_length": RESIDUAL}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    return make(tmp_path_factory.mktemp(f"kivi-{request.param}"), seed=7, num_hidden_layers=2, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def make_llm(model_dir: Path, bits: int = 2, method_params: dict | None = None, **options) -> LLM:
    config = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=2**22, method="kivi",
                          method_params=method_params or {**PARAMS, "bits": bits},
                          **{"device": "cpu", "attention_backend": "torch", "max_num_batched_tokens": 4096, **options})
    return LLM.from_engine(Engine(config))


def session(bits: int = 2) -> ref.Session:
    return ref.Session(bits=bits, group=GROUP, residual=RESIDUAL)


# ---- the quantizer ------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
def test_the_encodings_are_the_reference_quantizer_bit_for_bit(bits: int) -> None:
    """Keys per channel over groups of tokens, values per token over groups of channels: kvc's codes
    (unpacked), scales, zero points (the group minima) and decoded values equal the numpy
    reference's, ties to even included (values on the half steps of a 0..3 grid)."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(16, 3, 32, generator=gen)
    x[:8, 0, :4] = torch.tensor([0.0, 0.5, 1.5, 3.0])[:, None].repeat(2, 1)  # ties at 0.5 and 1.5 steps
    packing = {2: "int2x4", 4: "int4x2"}[bits]
    keys = Quantized("c", "s", bits, GROUP, zero="z", residual="r", axis="token", flush_block=8)
    codes, scale, zero = encodings.quantize(x, keys, torch.uint8, packing=packing)
    grouped = x.numpy().reshape(4, GROUP, 3, 32).transpose(0, 2, 3, 1)  # [n/g, H, D, g]
    want_codes, want_scale, want_mn = ref.quantize_groups(grouped, bits)
    assert np.array_equal(encodings.unpack(codes, bits, packing, False).numpy(),
                          want_codes.transpose(0, 3, 1, 2).reshape(16, 3, 32))
    assert np.array_equal(scale.numpy(), want_scale) and np.array_equal(zero.numpy(), want_mn)
    back = encodings.dequantize(codes, scale.repeat_interleave(GROUP, 0), zero.repeat_interleave(GROUP, 0), keys, 32,
                                torch.float32)
    want = ref.keys_round_trip(x.numpy().transpose(1, 0, 2), bits, GROUP).transpose(1, 0, 2)
    assert np.array_equal(back.numpy(), want)
    assert {0, 2} <= set(want_codes[0, 0, 0].tolist())  # 0.5 -> 0 and 1.5 -> 2: ties went to even
    values = Quantized("c", "s", bits, GROUP, zero="z", residual="r", axis="channel")
    codes, scale, zero = encodings.quantize(x, values, torch.uint8, packing=packing)
    back = encodings.dequantize(codes, scale, zero, values, 32, torch.float32)
    assert np.array_equal(back.numpy(), ref.values_round_trip(x.numpy().transpose(1, 0, 2), bits,
                                                              GROUP).transpose(1, 0, 2))


# ---- served against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
def test_batch_equals_the_reference(model_dir, hf, monkeypatch, bits: int) -> None:
    """Prompts shorter than the window, across one block and several, each one prefill chunk, then
    decode steps that cross block boundaries (R = 8): the reference's tokens and logits; and the
    quantization changes them (KIVI-2 against exact K/V)."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, bits)
    prompts = [prompt(n, seed) for n, seed in ((5, 1), (16, 2), (23, 3), (41, 4))]
    params = [greedy(12) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, session(bits), p, 12)
        check(out.token_ids, spy.of(sp), want)
    exact = ref.generate(hf, ref.Session(bits=bits, group=GROUP, residual=10**6), prompts[3], 12)[1]
    if bits == 2:
        assert (exact - want[1]).abs().max() > 10 * ATOL, "KIVI changes nothing: the test is blind"


def test_chunked_prefill_reads_earlier_chunks_as_stored(model_dir, hf, monkeypatch) -> None:
    """A prompt prefilled in chunks of 8: each chunk reads its own tokens exactly, the earlier ones
    as KIVI's cache holds them (the reference chunked the same way)."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_num_batched_tokens=8, max_prefill_chunk=8)
    p, params = prompt(29, 9), greedy(6)
    out = llm.generate(p, params)[0]
    check(out.token_ids, spy.of(params), ref.generate(hf, session(), p, 6, chunk=8))
    one = ref.generate(hf, session(), p, 6)[1]
    assert (one - spy.of(params)).abs().max() > 10 * ATOL  # one chunk would differ: the chunking is seen


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    """A chain carries its pages and its row (the windows): two forks and a continuation each
    continue the reference session of the first turn."""
    llm = make_llm(model_dir)
    served.chain_continued_and_forked(llm, Logits(monkeypatch), partial(ref.generate, hf), session)


def test_preemption_recomputes(model_dir, hf, monkeypatch) -> None:
    """The recompute hits the prefix cache in whole key blocks (RESIDUAL tokens) whose codes are written."""
    llm = make_llm(model_dir)
    assert llm.engine.scheduler.prefix_caching and llm.engine.pool.prefix_pages == RESIDUAL // GROUP
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), session, RESIDUAL, True, 14)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_prefix_cache_hit_shares_whole_written_blocks(model_dir, hf, monkeypatch, backend: str) -> None:
    """A second prompt sharing 27 tokens with a first one (30 tokens, one more generated) hits the 24 of
    whole key blocks with codes (pages of 4, blocks of 8; the unfinished block [24, 32) is only in the first
    request's window), reads them from their codes (the reference truncated as stored: the hit's window
    starts empty) and writes nothing into the shared pages."""
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        device = triton_device_and_ops("spec")[0].type
        options = dict(attention_backend="triton", device=device, cuda_graphs=False)
    else:
        options = {}
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, **options)
    first = prompt(30, 3)
    llm.generate(first, greedy(2))
    pool, store = llm.engine.pool, llm.engine.attention.stores[0]
    assert sum(pool.is_registered(p) for p in range(pool.num_pages)) == 2 * (24 // GROUP)  # 2 layers, [0, 24)
    shared = [p for table in pool.lookup_layers(first, 2) for p in table]
    paged = {name: t for name, t in store.tensors.items() if t.shape[0] == pool.num_pages + 1}
    written = {name: t[shared].clone() for name, t in paged.items()}
    second, params = first[:27] + prompt(9, 4), greedy(6)
    seq = llm.engine.add_request(second, params)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seq.num_cached_tokens == 24
    check_books(llm.engine)
    for name, t in paged.items():  # the shared pages hold what the first request wrote
        assert torch.equal(t[shared], written[name]), name
    s = session()
    ref.generate(hf, s, first, 2)
    want = ref.generate(hf, s.truncate(24), second[24:], 6)
    check(seq.generated_ids, spy.of(params), want)


@pytest.mark.parametrize("dense_layers", [[], [0], [1]])
def test_the_graph_step_run_uncaptured(model_dir, hf, monkeypatch, dense_layers: list[int]) -> None:
    """Decode-only steps through the CUDA-graph runner's own step (static buffers with the rows and
    what their windows hold, a padding row), run without capture on the CPU: the reference's tokens
    across key blocks flushed inside the step; with a dense layer, two storage classes in one step."""
    prompts = [prompt(n, seed) for n, seed in ((13, 21), (18, 22), (6, 23))]
    llm = make_llm(model_dir, max_model_len=80, max_num_seqs=6,
                   method_params={**PARAMS, "dense_layers": dense_layers})
    replays = served.graph_steps(llm, monkeypatch)
    outs = llm.generate(prompts, [greedy(12) for _ in prompts])
    assert 3 in replays  # bucket 4: one padding row
    for p, out in zip(prompts, outs):
        want = ref.Session(bits=2, group=GROUP, residual=RESIDUAL, dense_layers=frozenset(dense_layers))
        assert out.token_ids == ref.generate(hf, want, p, 12)[0]


def test_the_pool_holds_the_spec_bytes(model_dir) -> None:
    """Bytes per token from the spec: KIVI-2 with groups of 8 stores D / 4 bytes of codes for K and
    for V, V's scales and minima per 8 channels, and K's scales and minima once a page of 8 tokens;
    the pool's pages are what the budget (less the rows' windows) buys at that size."""
    config = dict(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                  kv_cache_memory=2**21)
    kivi = Engine(EngineConfig(**config, method="kivi", method_params={"bits": 2, "group_size": 8,
                                                                        "residual_length": 16}))
    full = Engine(EngineConfig(**config, method="full", page_size=8))
    heads, dim, layers = full.layout.kv_heads, full.spec.head_dim, full.layout.layers
    spec = kivi.attention.store.spec
    assert kivi.config.page_size == 8  # the method's: pages of one key group
    per_page = heads * (8 * (2 * dim // 4 + 2 * 4 * dim // 8) + 2 * 4 * dim)
    assert spec.bytes_per_page(heads, 8) == per_page
    assert full.attention.store.spec.bytes_per_page(heads, 8) == heads * 8 * 2 * dim * 4
    rows = kivi.attention.store.num_rows * spec.bytes_per_row(heads, layers)  # the windows, off the budget first
    for engine, page in ((kivi, per_page), (full, heads * 8 * 2 * dim * 4)):  # a page of one layer each
        assert 2**21 - page < engine.num_pages * page + (rows if engine is kivi else 0) <= 2**21
    assert kivi.num_pages * per_page >= (2**21 - rows) - per_page
    out = LLM.from_engine(kivi).generate(prompt(70, 5), greedy(4))[0]
    assert len(out.token_ids) == 4


def test_dense_layers_are_a_storage_class_of_their_own(model_dir, hf, monkeypatch) -> None:
    """`dense_layers = [0]`: layer 0 stores K and V in the model dtype (its own storage class: a store of
    dense pages, page ids of its own), layer 1 KIVI-2 codes; a batch, a chained continuation and a
    fork give the reference's tokens and logits with layer 0 exact, which differ from KIVI's in every
    layer; the pool splits the budget so that both classes hold as many tokens."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, method_params={**PARAMS, "dense_layers": [0]})
    engine = llm.engine
    assert engine.storage.layer_class == (0, 1) and len(engine.attention.stores) == 2
    dense, codes = (store.spec for store in engine.attention.stores)
    assert dense.dense and not codes.dense
    heads = engine.layout.kv_heads
    assert engine.pages_by_class[0] == engine.pages_by_class[1]  # one layer each: as many pages
    page_bytes = [s.bytes_per_page(heads, GROUP) for s in (dense, codes)]
    assert page_bytes[0] > page_bytes[1]
    rows = engine.attention.num_rows * codes.bytes_per_row(heads, 2)
    used = sum(n * b for n, b in zip(engine.pages_by_class, page_bytes)) + rows
    assert 2**22 - sum(page_bytes) < used <= 2**22
    with pytest.raises(TypeError, match="storage classes"):
        engine.attention.store  # noqa: B018 -- one store per class: asking for "the" store is a bug
    engine.pruner.check_prunable()  # chain prunes move each class's tokens (test_a_chain_prune_over_both_classes)
    from kvc.runtime.bench.plan import plan_batch  # the throughput plan sizes the classes as the engine does

    plan = plan_batch(engine.method, engine.spec, 2**22, GROUP, 48, 16, 10**6)
    sized = make_llm(model_dir, method_params={**PARAMS, "dense_layers": [0]}, max_num_seqs=plan.batch).engine
    assert sized.num_pages == plan.num_pages and plan.batch > 0

    def mixed() -> ref.Session:
        return ref.Session(bits=2, group=GROUP, residual=RESIDUAL, dense_layers=frozenset({0}))

    prompts = [prompt(n, seed) for n, seed in ((16, 2), (41, 4))]
    params = [greedy(12) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(engine)
    for p, out, sp in zip(prompts, outs, params):
        check(out.token_ids, spy.of(sp), ref.generate(hf, mixed(), p, 12))
    assert (ref.generate(hf, session(), prompts[1], 12)[1] - spy.of(params[1])).abs().max() > 10 * ATOL
    served.chain_continued_and_forked(llm, spy, partial(ref.generate, hf), mixed)
    served.preemption_recomputes(llm, spy, partial(ref.generate, hf), mixed, RESIDUAL, True, 14)  # whole blocks hit


def test_a_chain_prune_over_both_classes(model_dir) -> None:
    """`dense_layers = [0]`: a chain prune drops the same logical tokens in the dense layer's class and in
    the codes' class, each through its own store and executor over its store's page indices: the dense
    layer keeps its stored keys exactly (slots move), the coded layer's kept keys are decoded and stored
    again (a fresh prefill of them: within a requantization step of what they were); the pool's books
    balance, and the chain continues on the pruned pages."""
    from kvc.runtime.chain_prune import PruneRequest
    from kvc.runtime.chains import ChainSpec
    from kvc.runtime.kv.positions import full_map
    from kvc.runtime.method_api import LayerCacheView

    llm = make_llm(model_dir, method_params={**PARAMS, "dense_layers": [0]}, prune_scorer="snapkv")
    engine = llm.engine
    ids = prompt(40, 6)
    first = llm.generate(ids, greedy(5), chain=ChainSpec(open=True))[0]
    record = next(r for r in engine.chains.records() if r.chain_id == first.chain_id)

    def keys(layer: int) -> torch.Tensor:
        cls = engine.attention.layer_class[layer]
        local = [p - engine.attention.page_starts[cls] for p in record.page_tables[layer]]
        view = LayerCacheView(engine.attention.stores[cls], local, record.kv_lens[layer], record.kv_starts[layer],
                              layer, row=record.row, resid_len=record.resid_lens[layer])
        return view.keys().clone()

    assert engine.attention.page_starts[1] > 0  # the codes' class has pool ids of its own
    before = [keys(layer) for layer in range(2)]
    report = engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((4, 30),), keep=0.5,
                                                                   scorer="snapkv", scorer_params={"window": 4}))
    check_books(engine)
    assert report["stored_tokens"] == report["stored_tokens_before"] - 2 * 13
    for layer in range(2):
        held = full_map(record.positions[layer], record.kv_lens[layer], len(record.tokens), 2, torch.device("cpu"))
        after = keys(layer)
        want = torch.stack([before[layer][h, held[h]] for h in range(2)])
        if layer == 0:
            assert torch.equal(after, want)
        else:
            step = (before[layer].amax() - before[layer].amin()) / 3
            assert (after - want).abs().max() <= step
    convo = ids + first.token_ids + prompt(6, 7)
    second = llm.generate(convo, greedy(4), chain=ChainSpec(continue_id=first.chain_id))[0]
    assert second.num_cached_tokens == len(ids) + 4 and len(second.token_ids) == 4
    check_books(engine)


def test_bad_parameters_are_clear_errors(model_dir) -> None:
    """Keys grouped over tokens need a window of whole groups; the spec packs 2, 4 or 8 bits."""
    for params, words in (({"residual_length": 0}, "residual window"), ({"residual_length": 6}, "multiple"),
                          ({"bits": 3}, "bits")):
        with pytest.raises(ConfigError, match=words):
            Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                                kv_cache_memory=2**22, method="kivi", method_params={**PARAMS, **params}))


# ---- the Triton kernels ---------------------------------------------------------------------------


@pytest.mark.parametrize("dense_layers", [[], [0]])
def test_the_triton_backend_equals_the_reference(model_dir, hf, monkeypatch, dense_layers: list[int]) -> None:
    """The generated `spec` kernels (interpreted here): the store writes the windows, the flush kernel
    quantizes finished key blocks, the decode and prefill tiles decode 2-bit codes (prefill reading
    its chunk as computed): the reference's tokens and logits; with a dense layer, that layer's class
    runs the `plain` kernels over its own store."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    spy = Logits(monkeypatch)
    config = EngineConfig(model=str(model_dir), device=device.type, dtype="float32", attention_backend="triton",
                          cuda_graphs=False, kv_cache_memory=2**22, method="kivi",
                          method_params={**PARAMS, "dense_layers": dense_layers}, max_num_batched_tokens=4096)
    llm = LLM.from_engine(Engine(config))
    assert llm.engine.attention.variants == ["plain"] * len(dense_layers) + ["spec"]
    prompts = [prompt(n, seed) for n, seed in ((19, 1), (9, 4))]
    params = [greedy(10) for _ in prompts]
    want = ref.Session(bits=2, group=GROUP, residual=RESIDUAL, dense_layers=frozenset(dense_layers))
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, want.copy(), p, 10))


def test_the_kernels_compile_for_sm90() -> None:
    """The 2-bit store, flush, decode and prefill kernels compile for an H100/H200 (ptxas here)."""
    compiles_for_sm90("tests.kernels.sm90_compile", "int2")


# ---- composed with a keep policy (bench/variants/snapkv_kivi.kvm) ------------------------------------

COMPOSED = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "snapkv_kivi.kvm")


def composed_llm(model_dir: Path, budget: int, dense_layers: list[int] = (), **options) -> LLM:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                          kv_cache_memory=2**22, method=COMPOSED,
                          method_params={**PARAMS, "budget": budget, "window": 4, "dense_layers": list(dense_layers)},
                          max_num_batched_tokens=4096, **options)
    return LLM.from_engine(Engine(config))


@pytest.mark.parametrize("dense_layers", [[], [0]])
def test_snapkv_over_kivi_stores_the_kept_tokens_as_kivi_stores_a_prompt(model_dir, monkeypatch,
                                                                         dense_layers: list[int]) -> None:
    """SnapKV's prefill_end keeps 16 of 41 tokens; the kept tokens (decoded from the codes and the
    window, as the hook saw them) are stored again from slot 0: keys of whole blocks per channel,
    older values per token, the newest in the window; every layer's stored cache equals the
    reference quantizer over the kept tokens, bit for bit, and the sequence decodes on. With a dense
    layer (its own storage class: the hook reads and the keep moves its store), that layer holds
    the kept tokens exactly."""
    from kvc.runtime.chains import ChainSpec

    llm = composed_llm(model_dir, 16, dense_layers)
    stores = llm.engine.attention.stores
    assert stores[-1].spec == make_llm(model_dir).engine.attention.store.spec
    seen = {}
    original = llm.engine.method.prefill_end

    def spy(layer, view):
        plan = original(layer, view)
        k, v = view.cache.keys().clone(), view.cache.values().clone()
        keep = plan.indices.long().cpu()
        seen[layer] = (k.gather(1, keep[:, :, None].expand(-1, -1, k.shape[-1])),
                       v.gather(1, keep[:, :, None].expand(-1, -1, v.shape[-1])))
        return plan

    monkeypatch.setattr(llm.engine.method, "prefill_end", spy)
    out = llm.generate(prompt(41, 3), greedy(1), chain=ChainSpec(open=True))[0]
    record = next(r for r in llm.engine.chains.records() if r.chain_id == out.chain_id)
    assert sorted(seen) == [0, 1]
    for layer, (k, v) in seen.items():
        assert k.shape[1] == 16 and record.kv_lens[layer] == 16  # the step's token not stored yet
        store = llm.engine.attention.store_of(layer)
        table = llm.engine.runner.tables.local(layer, record.page_tables[layer])
        got_k = store.decoded("k", table, 16, layer, record.row, record.resid_lens[layer])
        got_v = store.decoded("v", table, 16, layer, record.row, record.resid_lens[layer])
        want_k, want_v = k.clone(), v.clone()
        if layer not in dense_layers:
            assert record.resid_lens[layer] == 9  # the window holds the newest W = 9 of the 16
            want_k[:, :8] = torch.from_numpy(ref.keys_round_trip(k[:, :8].numpy(), 2, GROUP))  # block 0 of 8
            want_v[:, :8] = torch.from_numpy(ref.values_round_trip(v[:, :8].numpy(), 2, GROUP))  # all but newest 8
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    history = prompt(41, 3) + out.token_ids
    more = llm.generate(history + prompt(5, 4), greedy(6), chain=ChainSpec(continue_id=out.chain_id))[0]
    assert len(more.token_ids) == 6
    check_books(llm.engine)


@pytest.mark.parametrize("dense_layers", [[], [1]])
def test_snapkv_over_kivi_keeping_everything_is_kivi(model_dir, monkeypatch, dense_layers: list[int]) -> None:
    """A budget over the prompt keeps every slot in place (nothing stored again): KIVI's tokens (with
    the same dense layers)."""
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    kivi = make_llm(model_dir, method_params={**PARAMS, "dense_layers": dense_layers})
    want = [o.token_ids for o in kivi.generate(prompts, [greedy(8) for _ in prompts])]
    composed = composed_llm(model_dir, 64, dense_layers)
    got = [o.token_ids for o in composed.generate(prompts, [greedy(8) for _ in prompts])]
    assert got == want


def test_a_pruned_chain_is_stored_again_and_continues(model_dir) -> None:
    """A chain prune keeps some of a KIVI chain's tokens: they are stored again from slot 0 (the
    window then holds their newest), and the chain continues."""
    from kvc.runtime.chain_prune import PruneRequest
    from kvc.runtime.chains import ChainSpec

    llm = make_llm(model_dir, prune_scorer="snapkv")
    first = llm.generate(prompt(40, 13), greedy(4), chain=ChainSpec(open=True))[0]
    llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((3, 30),), keep=0.4))
    check_books(llm.engine)
    record = next(r for r in llm.engine.chains.records() if r.chain_id == first.chain_id)
    window = llm.engine.attention.store.residual_window
    assert max(record.kv_lens) < 40
    assert record.resid_lens == [min(n, window) for n in record.kv_lens]
    history = prompt(40, 13) + first.token_ids
    out = llm.generate(history + prompt(3, 14), greedy(3), chain=ChainSpec(continue_id=first.chain_id))[0]
    assert len(out.token_ids) == 3
    check_books(llm.engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the register-mma decode is Gluon)")
def test_the_register_mma_decode_serves_the_split_kernels_tokens(tmp_path, monkeypatch) -> None:
    """KIVI-2 served in bf16 at the shape the register-mma decode takes (head_dim 128, 8 query heads a KV head,
    pages of a 32-token key group): the engine's decode steps run it (each row's coded pages; windows and flushes
    in between), and its logits are as close to the split kernel's as those of the torch backend (which dequantizes
    first, in bf16) are, so its tokens are the split kernel's up to a near tie."""
    model = make_tiny_qwen3(tmp_path / "mma", seed=3, num_hidden_layers=2, head_dim=128, num_attention_heads=16,
                            num_key_value_heads=2, initializer_range=0.25)
    prompts = [prompt(n, seed) for n, seed in ((300, 31), (170, 32), (45, 33))]

    def serve(mma: bool, backend: str = "triton"):
        spy = Logits(monkeypatch)
        config = EngineConfig(model=str(model), dtype="bfloat16", kv_cache_memory=2**26, method="kivi",
                              method_params={"bits": 2, "group_size": 32, "residual_length": 64}, device="cuda",
                              attention_backend=backend, page_size=32, cuda_graphs=False, max_num_batched_tokens=4096)
        llm = LLM.from_engine(Engine(config))
        calls = []
        if backend == "triton":
            ops = llm.engine.attention.ops  # the generated `spec` module
            launch = ops.mma_decode_launch
            monkeypatch.setattr(ops, "mma_decode_launch", lambda *a, **k: (calls.append(1), launch(*a, **k))[1])
            if not mma:
                monkeypatch.setattr(ops, "mma_decode_fits", lambda *a, **k: False)
        params = [greedy(40) for _ in prompts]
        outs = llm.generate(prompts, params)
        monkeypatch.undo()
        return [o.token_ids for o in outs], [spy.of(p) for p in params], len(calls)

    got, got_logits, launches = serve(True)
    want, want_logits, none = serve(False)
    base, base_logits, _ = serve(False, "torch")
    assert launches > 0 and none == 0
    for run in zip(got, want, base, got_logits, want_logits, base_logits):
        tokens, split, dequantized, logits, split_logits, dequantized_logits = run
        # the steps whose histories agree in all three runs
        part = next((i for i, ts in enumerate(zip(tokens, split, dequantized)) if len(set(ts)) > 1), len(split))
        steps = min(part + 1, len(split))
        ours = (logits[:steps] - split_logits[:steps]).abs().max().item()
        theirs = (dequantized_logits[:steps] - split_logits[:steps]).abs().max().item()
        assert ours <= 2 * theirs + 1e-2, (ours, theirs)
        if part < len(split) and tokens[part] != split[part]:  # a near tie, within the kernels' difference
            gap = (split_logits[part, split[part]] - split_logits[part, tokens[part]]).item()
            assert 0 <= gap <= 2 * ours, (part, gap, ours)
