"""The compiled `fp8` method (methods/fp8.kvm) served on tiny random Llama and Qwen3 models, against
the hand-written oracle of tests/references/fp8.py: the model run with every stored K/V replaced by
its FP8 round trip (the reference's own quantizer), dense attention over them. Greedy tokens and
every sampled logit row must match through batching with chunked prefills, a prefix-cache hit, a
chain continued and forked, and a preemption; unit and dynamic scales both. The pool holds twice
the tokens of a bf16 `full` cache (bytes per token from the spec), and the scales are what the
first stored chunk says (dynamic) or 1.0 (unit).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import fp8 as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
SCALINGS = ("unit", "dynamic")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    # sharp attention (as the contract tests): FP8 round trips then change the logits measurably
    return make(tmp_path_factory.mktemp(f"fp8-{request.param}"), seed=7, num_hidden_layers=2, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def make_llm(model_dir: Path, scaling: str, dtype: str = "float32", **options) -> LLM:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype=dtype, page_size=PAGE, attention_backend="torch",
                          kv_cache_memory=2**22, method="fp8", method_params={"scale": scaling},
                          **{"max_num_batched_tokens": 4096, **options})
    return LLM.from_engine(Engine(config))


def calibrated(llm: LLM, hf, scaling: str) -> ref.Session:
    """A reference session holding the scales the engine fixed: for dynamic scales, from a first
    request served alone in one chunk (the reference computes them from the same chunk and must
    agree), whose tokens must match too."""
    template = ref.Session(scaling=scaling)
    if scaling == "dynamic":
        first = prompt(7, 21)  # one chunk even where prefills are chunked by 8
        out = llm.generate(first, greedy(3))[0]
        assert out.token_ids == ref.generate(hf, template, first, 3)[0]
        store = llm.engine.attention.store
        for (layer, which), value in template.scales.items():
            # one scale, every KV head (the models' K agree to rounding: kvc's model code is not HF's)
            torch.testing.assert_close(store[f"{which}_scale"][layer, :, 0].cpu(), torch.tensor(value), rtol=1e-5,
                                       atol=0)
            assert len(set(store[f"{which}_scale"][layer, :, 0].tolist())) == 1
    return ref.Session(scaling=scaling, scales=dict(template.scales))


@pytest.mark.parametrize("scaling", SCALINGS)
def test_batch_with_chunked_prefills_equals_the_oracle(model_dir, hf, monkeypatch, scaling: str) -> None:
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, scaling, max_num_batched_tokens=20, max_prefill_chunk=8)
    template = calibrated(llm, hf, scaling) if scaling == "dynamic" else ref.Session()
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, template.copy(), p, 10)
        check(out.token_ids, spy.of(sp), want)
        exact = ref.Session(fmt=None)  # FP8 off: the exact K/V
        _, dense = ref.generate(hf, exact, p, 10)
        assert (dense - want[1]).abs().max() > 10 * ATOL, "FP8 changes nothing: the test is blind"


@pytest.mark.parametrize("scaling", SCALINGS)
def test_prefix_cache_hit(model_dir, hf, monkeypatch, scaling: str) -> None:
    llm = make_llm(model_dir, scaling)
    template = calibrated(llm, hf, scaling)
    served.prefix_cache_hit(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_chain_continued_and_forked(model_dir, hf, monkeypatch, scaling: str) -> None:
    llm = make_llm(model_dir, scaling)
    template = calibrated(llm, hf, scaling)
    served.chain_continued_and_forked(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_recomputes(model_dir, hf, monkeypatch, prefix_caching: bool) -> None:
    llm = make_llm(model_dir, "dynamic", enable_prefix_caching=prefix_caching)
    template = calibrated(llm, hf, "dynamic")
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), template.copy, PAGE,
                                 prefix_caching, 14)


def test_the_pool_holds_twice_the_tokens_of_bf16_full(model_dir) -> None:
    """Bytes per token come from the spec: FP8 codes are half of bf16 K/V, so the same KV budget
    buys twice the pages (the scales are per layer, outside the pages); a bf16 model serves."""
    config = dict(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE, attention_backend="torch",
                  kv_cache_memory=2**20)
    full = Engine(EngineConfig(**config, method="full"))
    fp8 = Engine(EngineConfig(**config, method="fp8"))
    heads = full.layout.kv_heads
    assert 2 * fp8.attention.store.spec.bytes_per_token(heads) == full.attention.store.spec.bytes_per_token(heads)
    assert fp8.num_pages >= 2 * full.num_pages - 1
    assert fp8.attention.store["k_codes"].dtype == torch.float8_e4m3fn
    out = LLM.from_engine(fp8).generate(prompt(12, 5), greedy(4))[0]
    assert len(out.token_ids) == 4
    assert torch.equal(fp8.attention.store["k_scale"].float(), torch.ones_like(fp8.attention.store["k_scale"].float()))


def test_e5m2_serves_and_differs_from_e4m3(model_dir, hf, monkeypatch) -> None:
    spy = Logits(monkeypatch)
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method="fp8",
                          method_params={"format": "e5m2", "scale": "dynamic"})
    llm = LLM.from_engine(Engine(config))
    p, params = prompt(21, 8), greedy(6)
    out = llm.generate(p, params)[0]
    want = ref.generate(hf, ref.Session(fmt="e5m2", scaling="dynamic"), p, 6)
    check(out.token_ids, spy.of(params), want)
    other = ref.generate(hf, ref.Session(fmt="e4m3", scaling="dynamic"), p, 6)[1]
    assert (other - want[1]).abs().max() > 10 * ATOL


def test_the_graph_step_run_uncaptured(model_dir, hf, monkeypatch) -> None:
    """Decode-only steps through the CUDA-graph runner's own step (static buffers, a padding row
    with slot -1), run without capture on the CPU: the oracle's tokens."""
    prompts = [prompt(n, seed) for n, seed in ((33, 21), (18, 22), (26, 23))]
    llm = make_llm(model_dir, "unit", max_model_len=160, max_num_seqs=6)
    replays = served.graph_steps(llm, monkeypatch)
    outs = llm.generate(prompts, [greedy(8) for _ in prompts])
    assert 3 in replays  # bucket 4: one padding row
    for p, out in zip(prompts, outs):
        assert out.token_ids == ref.generate(hf, ref.Session(), p, 8)[0]


def test_a_pruned_chain_moves_the_codes_and_continues(model_dir) -> None:
    """A prune moves slots of every per-token tensor (the FP8 codes, by their bytes); the scales
    stay; the stored keys decode to those of the kept tokens and the chain continues."""
    from kvc.runtime.chain_prune import PruneRequest
    from kvc.runtime.chains import ChainSpec

    llm = make_llm(model_dir, "dynamic", prune_scorer="snapkv")
    first = llm.generate(prompt(40, 13), greedy(4), chain=ChainSpec(open=True))[0]
    store = llm.engine.attention.store
    scales = store["k_scale"].clone()
    record = next(r for r in llm.engine.chains.records() if r.chain_id == first.chain_id)
    before = [store.decoded("k", table, n, layer=layer) for layer, (table, n) in
              enumerate(zip(record.page_tables, record.kv_lens))]
    llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((3, 30),), keep=0.4))
    check_books(llm.engine)
    record = next(r for r in llm.engine.chains.records() if r.chain_id == first.chain_id)
    assert max(record.kv_lens) < 40 and torch.equal(store["k_scale"], scales)
    for layer, (table, n) in enumerate(zip(record.page_tables, record.kv_lens)):
        after = store.decoded("k", table, n, layer=layer)  # [Hkv, n, D]: each a key stored before
        for h in range(after.shape[0]):
            assert (after[h][:, None] == before[layer][h][None]).all(-1).any(-1).all()
    history = prompt(40, 13) + first.token_ids
    out = llm.generate(history + prompt(3, 14), greedy(3), chain=ChainSpec(continue_id=first.chain_id))[0]
    assert len(out.token_ids) == 3
    check_books(llm.engine)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_bf16_equals_full_over_round_tripped_kv(model_dir, monkeypatch, scaling: str) -> None:
    """A bfloat16 model: fp8 serves the tokens of `full` whose stored K/V are replaced by the
    reference's FP8 round trip (the same model code, so tokens must agree), in a batch."""
    from kvc.runtime.attention.backend import PagedAttention

    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3))]
    config = dict(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE, attention_backend="torch",
                  kv_cache_memory=2**22, max_num_batched_tokens=4096)
    fp8 = LLM.from_engine(Engine(EngineConfig(**config, method="fp8", method_params={"scale": scaling})))
    got = [o.token_ids for o in fp8.generate(prompts, [greedy(8) for _ in prompts])]
    session = ref.Session(scaling=scaling)
    write = PagedAttention._write  # what `forward` and `write` store through

    def round_tripped(self, layer, k, v, md, window_tokens=None):
        stored = md.slot_mapping[layer] >= 0  # the first step fixes the scales from its stored rows
        k2 = session.stored(layer, "k", k[stored].transpose(0, 1)).transpose(0, 1).to(k.dtype)
        v2 = session.stored(layer, "v", v[stored].transpose(0, 1)).transpose(0, 1).to(v.dtype)
        k, v = k.clone(), v.clone()
        k[stored], v[stored] = k2, v2
        return write(self, layer, k, v, md, window_tokens)

    exact = LLM.from_engine(Engine(EngineConfig(**config, method="full")))
    assert got != [o.token_ids for o in exact.generate(prompts, [greedy(8) for _ in prompts])], "the test is blind"
    monkeypatch.setattr(PagedAttention, "_write", round_tripped)
    full = LLM.from_engine(Engine(EngineConfig(**config, method="full")))
    want = [o.token_ids for o in full.generate(prompts, [greedy(8) for _ in prompts])]
    assert got == want



def test_a_scale_per_kv_head_from_a_kvm_file(model_dir, hf, monkeypatch, tmp_path: Path) -> None:
    """`along key, channel`: one dynamic scale per layer and KV head (compiled on start from a
    .kvm file), each from its head's own max |x| in the first chunk: the oracle's scales and tokens."""
    text = (Path(__file__).parents[2] / "methods" / "fp8.kvm").read_text()
    path = tmp_path / "fp8_heads.kvm"
    path.write_text(text.replace("method fp8 :", "method fp8_heads :").replace("along kv_head, key, channel",
                                                                              "along key, channel"))
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", page_size=PAGE,
                          attention_backend="torch", kv_cache_memory=2**22, method=str(path),
                          method_params={"scale": "dynamic"})
    llm = LLM.from_engine(Engine(config))
    spy = Logits(monkeypatch)
    p, params = prompt(21, 8), greedy(6)
    out = llm.generate(p, params)[0]
    session = ref.Session(scaling="dynamic", per_head=True)
    check(out.token_ids, spy.of(params), ref.generate(hf, session, p, 6))
    store = llm.engine.attention.store
    for (layer, which), scales in session.scales.items():
        torch.testing.assert_close(store[f"{which}_scale"][layer, :, 0], torch.tensor(scales), rtol=1e-5, atol=0)
        assert scales[0] != scales[1]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_the_triton_backend_equals_the_oracle(model_dir, hf, monkeypatch, scaling: str) -> None:
    """The generated `spec` kernels (here under TRITON_INTERPRET=1) quantize in the store kernel and
    dequantize in the decode and prefill tiles: the oracle's tokens and logits."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    spy = Logits(monkeypatch)
    config = EngineConfig(model=str(model_dir), device=device.type, dtype="float32", page_size=PAGE,
                          attention_backend="triton", cuda_graphs=False, kv_cache_memory=2**22, method="fp8",
                          method_params={"scale": scaling}, max_num_batched_tokens=4096)
    llm = LLM.from_engine(Engine(config))
    assert llm.engine.attention.variant == "spec"
    template = calibrated(llm, hf, scaling)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 4))]
    params = [greedy(8) for _ in prompts]
    # on a GPU kvc's float32 K differs from Hugging Face's CPU K by matmul rounding, which can move a
    # dynamic scale, and then an FP8 code, by one step: logits within 2e-3 there (2e-4 on the CPU)
    atol = ATOL if device.type == "cpu" else 2e-3
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, template.copy(), p, 8), atol=atol)
