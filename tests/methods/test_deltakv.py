"""DeltaKV served on tiny random Llama and Qwen3 models (Qwen3's keys are normed before RoPE), against
the hand-written oracle (tests/references/deltakv.py): methods/deltakv.kvm, whose full layer chooses
the tokens the later compressed layers read, and bench/variants/deltakv_reads_all.kvm, its store with
every layer reading every token (the oracle with a choice larger than any context). The same greedy
tokens and logits through prefills in one chunk and in several and decode steps across compressed
blocks, a chain continued and forked, a preemption; lossless codes give the model's own tokens; the
compressed layers' storage class holds codes, not K/V."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.llm import LLM
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import deltakv
from tests.runtime.test_contract_methods import Logits, check, greedy, prompt

METHOD = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "deltakv_reads_all.kvm")
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 16
FULL = [1]  # layers 0, 2 and 3 store codes
PARAMS = {"sink": 2, "recent": 4, "stride": 2, "neighbours": 2, "full_layers": FULL}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3  # Qwen3: keys normed before RoPE
    return make(tmp_path_factory.mktemp(f"deltakv-{request.param}"), seed=3, num_hidden_layers=LAYERS,
                initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def compressor_file(root: Path, ratio: float, seed: int = 0) -> Path:
    """A deltakv.safetensors in kvc's layout (down, up [layers, Hkv, 2 D, C], bias [layers, Hkv, 2 D]):
    random, or the identity at ratio 1 (C = 2 Hkv D: the code is x - ref itself)."""
    width = 2 * HEAD_DIM
    code = KV_HEADS * round(width * ratio)
    if ratio == 1:
        pick = torch.eye(KV_HEADS * width).reshape(KV_HEADS, width, code)
        down, up = (pick.expand(LAYERS, -1, -1, -1).clone() for _ in range(2))
        bias = torch.zeros(LAYERS, KV_HEADS, width)
    else:
        g = torch.Generator().manual_seed(seed)
        down = torch.randn(LAYERS, KV_HEADS, width, code, generator=g) * 0.2
        up = torch.randn(LAYERS, KV_HEADS, width, code, generator=g) * 0.2
        bias = torch.randn(LAYERS, KV_HEADS, width, generator=g) * 0.1
    root.mkdir(parents=True, exist_ok=True)
    save_file({"down": down, "up": up, "bias": bias}, str(root / "deltakv.safetensors"))
    return root


def make_llm(model_dir: Path, inputs: Path, ratio: float, method_params_extra: dict | None = None,
             **options) -> LLM:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", attention_backend="torch",
                          kv_cache_memory=2**22, method=METHOD,
                          method_params={**PARAMS, "ratio": ratio, **(method_params_extra or {})},
                          method_inputs=str(inputs), **{"max_num_batched_tokens": 4096, **options})
    return LLM.from_engine(Engine(config))


ORACLE = deltakv.Params(sink=2, recent=4, stride=2, neighbours=2, selected=10**6, full_layers=tuple(FULL))


def oracle(hf, inputs: Path, ids: list[int], steps: int, chunk: int | None = None,
           state: deltakv.Session | None = None, params: deltakv.Params = ORACLE):
    """The oracle's tokens and logits (by default reading every token: its choice larger than any
    context); `state` continues a session."""
    compressor = deltakv.Compressor.load(inputs / "deltakv.safetensors")
    state = state if state is not None else deltakv.session(hf, params, compressor)
    logits = []
    original = deltakv._forward

    def spy(model, s, ids):
        out = original(model, s, ids)
        logits.append(out[-1])
        return out

    deltakv._forward = spy
    try:
        tokens = deltakv.generate(hf, ids, params, compressor, steps, chunk=chunk, state=state)
    finally:
        deltakv._forward = original
    return tokens, torch.stack(logits[-steps:]), state


def test_the_spec_has_a_class_of_codes(model_dir, tmp_path) -> None:
    llm = make_llm(model_dir, compressor_file(tmp_path / "c", 0.25), 0.25)
    engine = llm.engine
    assert engine.storage.layer_class == (0, 1, 0, 0)
    codes, dense = (store.spec for store in engine.attention.stores)
    assert codes.delta is not None and dense.dense
    heads = engine.layout.kv_heads
    # per token and head: an 8-channel share of the code and one of the 2 neighbour positions, against 2 x 16 floats
    assert codes.bytes_per_token(heads) == heads * (8 * 4 + 1 * 4) < dense.bytes_per_token(heads) == heads * 32 * 4
    assert not engine.scheduler.prefix_caching  # a page's codes lean on its row's sinks
    with pytest.raises(ConfigError, match=r"page_size/stride = 3.2, is not a whole number.*page_size"):
        make_llm(model_dir, tmp_path / "c", 0.25, page_size=16, method_params_extra={"stride": 5})


def test_lossless_codes_decode_like_the_model(model_dir, hf, tmp_path) -> None:
    llm = make_llm(model_dir, compressor_file(tmp_path / "c", 1.0), 1.0)
    ids = prompt(37, 1)
    out = llm.generate(ids, greedy(12))[0]
    tokens, _, state = oracle(hf, tmp_path / "c", ids, 12)
    assert out.token_ids == tokens
    assert all(state.compressed[layer] >= 24 for layer in (0, 2, 3))  # the oracle really compressed


@pytest.mark.parametrize("chunk", [None, 9])
def test_codes_equal_the_oracle(model_dir, hf, monkeypatch, tmp_path, chunk: int | None) -> None:
    """A lossy random compressor: every step's logits equal the oracle's (one prefill chunk, or chunks
    of 9 that end inside compressed blocks), and they differ from the lossless model's."""
    spy = Logits(monkeypatch)
    inputs = compressor_file(tmp_path / "c", 0.25)
    options = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_prefill_chunk": chunk}
    llm = make_llm(model_dir, inputs, 0.25, **options)
    ids, params = prompt(41, 2), greedy(14)
    out = llm.generate(ids, params)[0]
    tokens, logits, _ = oracle(hf, inputs, ids, 14, chunk=chunk)
    check(out.token_ids, spy.of(params), (tokens, logits))
    lossless = oracle(hf, compressor_file(tmp_path / "i", 1.0), ids, 14, chunk=chunk)[1]
    assert (lossless - logits).abs().max() > 1e-2  # the codes are really read


class Continued:
    """An oracle session for tests/methods/served.py: `generate(session, ids, n)` continues it."""

    def __init__(self, hf, inputs: Path) -> None:
        self.hf, self.inputs = hf, inputs
        self.state = deltakv.session(hf, ORACLE, deltakv.Compressor.load(inputs / "deltakv.safetensors"))

    def copy(self) -> Continued:
        other = copy.copy(self)
        other.state = copy.deepcopy(self.state)
        return other

    @staticmethod
    def generate(session: Continued, ids: list[int], steps: int):
        tokens, logits, _ = oracle(session.hf, session.inputs, ids, steps, state=session.state)
        return tokens, logits


def test_a_chain_and_a_preemption_carry_the_rows(model_dir, hf, monkeypatch, tmp_path) -> None:
    """The sinks and the raw tail live in the sequence's row: a chain continued and forked copies it
    (each turn continues the oracle's session), and a preempted request recomputes everything."""
    inputs = compressor_file(tmp_path / "c", 0.25)
    llm = make_llm(model_dir, inputs, 0.25)
    spy = Logits(monkeypatch)
    served.chain_continued_and_forked(llm, spy, Continued.generate, lambda: Continued(hf, inputs))
    served.preemption_recomputes(llm, spy, Continued.generate, lambda: Continued(hf, inputs), 16, False, 30)


@pytest.mark.parametrize("chunk,backend", [(None, "torch"), (9, "torch"), (9, "triton")])
def test_deltakv_reads_the_full_layers_choice(model_dir, hf, monkeypatch, tmp_path, chunk: int | None,
                                              backend: str) -> None:
    """methods/deltakv.kvm itself: layer 1 (full) chooses the 6 tokens of the largest logit and layers
    2 and 3 read the sinks, that choice and the raw tail from their codes (layer 0, before the first
    full layer, reads everything): the oracle's tokens and logits, which differ from reading every
    token. On the Triton backend (interpreted here) the decode rows of the coded layers attend in the
    `delta` variant's kernel, the full layer in `spec`'s."""
    spy = Logits(monkeypatch)
    inputs = compressor_file(tmp_path / "c", 0.25)
    options = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_prefill_chunk": chunk}
    device = "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        device = triton_device_and_ops("delta")[0].type
        options["cuda_graphs"] = False
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", attention_backend=backend,
                          kv_cache_memory=2**22, method="deltakv",
                          method_params={**PARAMS, "ratio": 0.25, "selected": 6}, method_inputs=str(inputs),
                          **{"max_num_batched_tokens": 4096, **options})
    llm = LLM.from_engine(Engine(config))
    ids, params = prompt(41, 2), greedy(14)
    out = llm.generate(ids, params)[0]
    chosen = dataclasses.replace(ORACLE, selected=6)
    compressor = deltakv.Compressor.load(inputs / "deltakv.safetensors")
    state = deltakv.session(hf, chosen, compressor)
    tokens, logits, _ = oracle(hf, inputs, ids, 14, chunk=chunk, state=state, params=chosen)
    assert all(len(reads[2]) < 41 for reads in state.reads)  # the oracle really read a subset
    if backend == "triton":
        assert sorted(llm.engine.attention.variants) == ["delta", "spec"]
    check(out.token_ids, spy.of(params).cpu(), (tokens, logits))
    assert (oracle(hf, inputs, ids, 14, chunk=chunk)[1] - logits).abs().max() > 1e-3


def test_the_graph_step_run_uncaptured(model_dir, hf, monkeypatch, tmp_path) -> None:
    """methods/deltakv.kvm's decode-only steps through the CUDA-graph runner's own step (static buffers,
    a padding row, no host copies), run without capture with the Triton kernels interpreted: the delta
    layers read nothing on the host (the runner compressed their due blocks before the step, the step
    stores its tokens on the device) and give the oracle's tokens and logits."""
    pytest.importorskip("triton")
    from kvc.runtime.attention import delta_ops
    from tests.kernels.paged_cases import triton_device_and_ops

    device = triton_device_and_ops("delta")[0].type
    inputs = compressor_file(tmp_path / "c", 0.25)
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", attention_backend="triton",
                          cuda_graphs=False, kv_cache_memory=2**22, method="deltakv", max_num_seqs=4,
                          method_params={**PARAMS, "ratio": 0.25, "selected": 6}, method_inputs=str(inputs),
                          max_num_batched_tokens=4096)
    llm = LLM.from_engine(Engine(config))
    spy = Logits(monkeypatch)
    replays = served.graph_steps(llm, monkeypatch)
    listed = delta_ops._sequences

    def host_free(md, layer):
        assert md.host_cu_seqlens is not None, "a graph step listed its sequences on the host"
        return listed(md, layer)

    monkeypatch.setattr(delta_ops, "_sequences", host_free)
    prompts, params = [prompt(41, 2), prompt(23, 5), prompt(30, 7)], [greedy(14) for _ in range(3)]
    outs = llm.generate(prompts, params)
    assert 3 in replays  # bucket 4: one padding row
    chosen = dataclasses.replace(ORACLE, selected=6)
    compressor = deltakv.Compressor.load(inputs / "deltakv.safetensors")
    for p, out, sp in zip(prompts, outs, params):
        tokens, logits, _ = oracle(hf, inputs, p, 14, state=deltakv.session(hf, chosen, compressor), params=chosen)
        check(out.token_ids, spy.of(sp).cpu(), (tokens, logits))
