"""The compiled `turboquant` method (methods/turboquant.kvm) served on tiny random Llama and Qwen3
models, against the hand-written TurboQuant reference (tests/references/turboquant.py): K and V
rotated by a random orthogonal matrix, each token quantized against its RMS with the Lloyd-Max levels
of a rotated unit vector's coordinate, 3-bit codes packed 8 to 3 bytes. The levels, the rotation and
the quantizer's decisions equal the reference's; greedy tokens and every sampled logit row match
through a batch, chunked prefills, a prefix-cache hit, a chain continued and forked, a preemption,
the graph step and the Triton kernels (interpreted); the pool holds the tokens its bytes say. The variant
with key offsets (bench/variants/turboquant_offsets.kvm): calibrated means, keys stored and attended relative
to them as the reference does it.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import encodings, rotation
from kvc.runtime.kv.spec import Quantized
from kvc.runtime.llm import LLM
from tests.kernels.sm90 import compiles_for_sm90
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import turboquant as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

PAGE = 4
# Max (1960), "Quantizing for minimum distortion": the Gaussian's Lloyd-Max levels (positive half),
# which the sphere's approach as the dimension grows
MAX_1960 = {2: (0.4528, 1.5104), 3: (0.2451, 0.7560, 1.3440, 2.1520)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    return make(tmp_path_factory.mktemp(f"tq-{request.param}"), seed=7, num_hidden_layers=2, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


def make_llm(model_dir: Path, key_bits: int = 3, value_bits: int = 3, method: str = "turboquant",
             method_params: dict | None = None, **options) -> LLM:
    config = EngineConfig(model=str(model_dir), dtype="float32", page_size=PAGE, kv_cache_memory=2**22, method=method,
                          method_params={"key_bits": key_bits, "value_bits": value_bits, **(method_params or {})},
                          **{"max_num_batched_tokens": 4096, "device": "cpu", "attention_backend": "torch", **options})
    return LLM.from_engine(Engine(config))


# ---- the codebook, the rotation, the quantizer ---------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_the_levels_are_the_references_lloyd_max(bits: int, dim: int) -> None:
    """kvc's levels (Gauss-Legendre cells) equal the reference's (closed-form moments, Simpson), are
    symmetric and ascending; at a large dimension they are the Gaussian's (Max's table)."""
    got = np.array(encodings.sphere_levels(bits, dim))
    np.testing.assert_allclose(got, ref.levels(bits, dim), rtol=0, atol=1e-9)
    assert (np.diff(got) > 0).all() and np.array_equal(got, -got[::-1])
    if bits in MAX_1960:
        np.testing.assert_allclose(np.array(encodings.sphere_levels(bits, 4096))[2**(bits - 1):], MAX_1960[bits],
                                   atol=2e-3)


@pytest.mark.parametrize("kind", ["random", "hadamard"])
def test_the_rotation_is_the_references(kind: str) -> None:
    for dim in (16, 64):
        r = rotation.matrix(dim, kind)
        np.testing.assert_allclose(r.numpy(), ref.rotation(dim, kind), rtol=0, atol=1e-12)
        torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    np.testing.assert_allclose(rotation.matrix(24, "random").numpy(), ref.rotation(24), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="power-of-two"):
        rotation.matrix(24, "hadamard")


@pytest.mark.parametrize("bits,packing", [(2, "int2x4"), (3, "int3x8"), (4, "int4x2")])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_the_quantizer_is_the_references(bits: int, packing: str, scale_dtype: torch.dtype) -> None:
    """Scales agree to float32 rounding (a sum of squares, reduced in another order); given the stored
    scale, every code is the reference's, the packed bytes are, and decoding is `levels[code] * scale`
    exactly. Zero vectors get scale 1 and decode to the levels nearest 0."""
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(40, 3, 64, generator=gen) * torch.rand(40, 3, 1, generator=gen) * 4
    x[0] = 0.0
    enc = Quantized("c", "s", bits, 64, codebook="sphere")
    codes, scale, zero = encodings.quantize(x, enc, torch.uint8, packing=packing, scale_dtype=scale_dtype)
    assert zero is None and codes.shape == (40, 3, 64 * bits // 8) and scale.shape == (40, 3, 1)
    book = ref.levels(bits, 64).astype(np.float32)
    _, want_scale = ref.quantize(x.numpy(), book, scale_dtype=np.float32)
    np.testing.assert_allclose(scale.float().numpy()[..., 0], want_scale, rtol=1e-2 if scale_dtype != torch.float32
                               else 1e-6)
    stored = scale.float().numpy()[..., 0]
    want_codes = ref.codes_given_scale(x.numpy(), stored, book)
    got_codes = encodings.unpack(codes, bits, packing, False).numpy()
    assert np.array_equal(got_codes, want_codes)
    if bits == 3:
        assert np.array_equal(codes.numpy(), ref.pack3(want_codes))
    back = encodings.dequantize(codes, scale, None, enc, 64, torch.float32)
    assert np.array_equal(back.numpy(), book[want_codes] * stored[..., None])
    assert (scale[0] == 1).all()


def test_the_spec_bytes_and_bad_parameters(model_dir) -> None:
    """3-bit codes are 3/8 of a channel's byte, plus one scale a token: the pool holds what the spec
    says; bit widths outside 2..4 are a clear error."""
    config = dict(model=str(model_dir), device="cpu", dtype="bfloat16", page_size=PAGE, attention_backend="torch",
                  kv_cache_memory=2**20)
    tq = Engine(EngineConfig(**config, method="turboquant"))
    full = Engine(EngineConfig(**config, method="full"))
    heads, dim = full.layout.kv_heads, full.spec.head_dim
    spec = tq.attention.store.spec
    assert spec.bytes_per_token(heads) == heads * 2 * (3 * dim // 8 + 2)
    assert tq.num_pages * spec.bytes_per_page(heads, PAGE) <= 2**20 < (tq.num_pages + 1) * spec.bytes_per_page(
        heads, PAGE)
    assert tq.num_pages >= full.num_pages * (2 * dim) // (3 * dim // 8 + 2) - 1
    assert LLM.from_engine(tq).generate(prompt(12, 5), greedy(4))[0].token_ids
    for params in ({"key_bits": 5}, {"value_bits": 1}):
        with pytest.raises(ConfigError, match="bits"):
            Engine(EngineConfig(**config, method="turboquant", method_params=params))


# ---- served against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("bits", [(3, 3), (4, 2)])
def test_batch_equals_the_reference(model_dir, hf, monkeypatch, bits) -> None:
    """A batch, each prompt one prefill chunk (attending to itself as computed), then decode steps
    (every token read as stored): the reference's tokens and logits; and TurboQuant changes them."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, *bits)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (37, 2), (9, 3), (30, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, ref.Session(*bits), p, 10)
        check(out.token_ids, spy.of(sp), want)
    exact = ref.generate(hf, ref.Session(None, None), prompts[1], 10)[1]
    assert (exact - want[1]).abs().max() > 100 * ATOL, "TurboQuant changes nothing: the test is blind"


def test_chunked_prefill_reads_earlier_chunks_as_stored(model_dir, hf, monkeypatch) -> None:
    """A prompt prefilled in chunks of 8: each chunk reads its own tokens as computed, the earlier
    ones as stored (the reference chunked the same way); one chunk would differ."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, max_num_batched_tokens=8, max_prefill_chunk=8)
    p, params = prompt(29, 9), greedy(6)
    out = llm.generate(p, params)[0]
    check(out.token_ids, spy.of(params), ref.generate(hf, ref.Session(), p, 6, chunk=8))
    one = ref.generate(hf, ref.Session(), p, 6)[1]
    assert (one - spy.of(params)).abs().max() > 10 * ATOL


def test_prefix_cache_hit(model_dir, hf, monkeypatch) -> None:
    llm = make_llm(model_dir)
    assert llm.engine.scheduler.prefix_caching  # codes per token: whole pages are shareable
    served.prefix_cache_hit(llm, Logits(monkeypatch), partial(ref.generate, hf), ref.Session)


def test_chain_continued_and_forked(model_dir, hf, monkeypatch) -> None:
    served.chain_continued_and_forked(make_llm(model_dir), Logits(monkeypatch), partial(ref.generate, hf),
                                      ref.Session)


def test_preemption_recomputes(model_dir, hf, monkeypatch) -> None:
    llm = make_llm(model_dir)
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), ref.Session, PAGE, True, 14)


def test_the_graph_step_run_uncaptured(model_dir, hf, monkeypatch) -> None:
    prompts = [prompt(n, seed) for n, seed in ((33, 21), (18, 22), (26, 23))]
    llm = make_llm(model_dir, max_model_len=160, max_num_seqs=6)
    replays = served.graph_steps(llm, monkeypatch)
    outs = llm.generate(prompts, [greedy(8) for _ in prompts])
    assert 3 in replays  # bucket 4: one padding row
    for p, out in zip(prompts, outs):
        assert out.token_ids == ref.generate(hf, ref.Session(), p, 8)[0]


def test_prefill_records_are_refused(model_dir) -> None:
    """TurboQuant's prefill reads its own chunk as stored, so its forward is not `full`'s: its engine
    neither records nor replays prefill records (kvc eval prefills it itself), with a clear error."""
    from kvc.runtime.prefill_record import PrefillRecord

    llm = make_llm(model_dir)
    assert not llm.engine.shares_prefills
    with pytest.raises(ConfigError, match="neither records nor replays"):
        llm.generate(prompt(10, 3), greedy(2), record=[PrefillRecord()])


# ---- the Triton kernels ---------------------------------------------------------------------------


def test_the_triton_backend_equals_the_reference(model_dir, hf, monkeypatch) -> None:
    """The generated `spec` kernels (interpreted here): the store quantizes against the RMS and packs
    3-bit codes, decode and prefill tiles look the codes up in the levels: the reference's tokens
    and logits."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("spec")
    spy = Logits(monkeypatch)
    config = EngineConfig(model=str(model_dir), device=device.type, dtype="float32", page_size=PAGE,
                          attention_backend="triton", cuda_graphs=False, kv_cache_memory=2**22, method="turboquant",
                          max_num_batched_tokens=4096)
    llm = LLM.from_engine(Engine(config))
    assert llm.engine.attention.variant == "spec"
    prompts = [prompt(n, seed) for n, seed in ((19, 1), (9, 4))]
    params = [greedy(8) for _ in prompts]
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, ref.Session(), p, 8))


def test_the_kernels_compile_for_sm90() -> None:
    """The 3-bit codebook store, decode and prefill kernels compile for an H100/H200 (ptxas here)."""
    compiles_for_sm90("tests.kernels.sm90_compile", "sphere3")


# ---- composed with a keep policy (bench/variants/snapkv_turboquant.kvm) -------------------------------

COMPOSED = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "snapkv_turboquant.kvm")


def test_snapkv_over_turboquant(model_dir, monkeypatch) -> None:
    """The composed method's spec is TurboQuant's; a budget that keeps everything gives TurboQuant's
    tokens; a smaller one keeps the positions SnapKV's own selection picks from the hook's queries
    and stored keys (both in the model's basis: the rotation is the store's), moves their codes and
    scales, and decodes on; the throughput plan's batch is the memory product (TurboQuant's bytes
    times SnapKV's tokens)."""
    from kvc.runtime.bench.plan import model_spec, plan_batch
    from kvc.runtime.method_api import KeepPlan
    from kvc.runtime.methods import resolve_method

    composed = make_llm(model_dir, method=COMPOSED, method_params={"budget": 64, "window": 4})
    assert composed.engine.attention.store.spec == make_llm(model_dir).engine.attention.store.spec
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (30, 2))]
    want = [o.token_ids for o in make_llm(model_dir).generate(prompts, [greedy(8) for _ in prompts])]
    assert [o.token_ids for o in composed.generate(prompts, [greedy(8) for _ in prompts])] == want

    small = make_llm(model_dir, method=COMPOSED, method_params={"budget": 16, "window": 4})
    method, snapkv = small.engine.method, resolve_method("snapkv", {"budget": 16, "window": 4})
    seen, original = [], method.prefill_end

    def spy(layer, view):
        q, keys = view.q.transpose(0, 1).clone(), view.cache.keys().clone()
        plan = original(layer, view)
        seen.append((layer, plan, q, keys))
        return plan

    monkeypatch.setattr(method, "prefill_end", spy)
    out = small.generate(prompt(40, 3), greedy(6))[0]
    check_books(small.engine)
    assert len(out.token_ids) == 6 and len(seen) == 2
    for layer, plan, q, keys in seen:
        assert isinstance(plan, KeepPlan) and plan.indices.shape[1] == 16
        scores = snapkv.code.score(q, keys, layer=layer, num_layers=2, params=snapkv.params)
        pick = snapkv.lowering.select(scores, keys.shape[1], layer=layer, num_layers=2, params=snapkv.params)
        assert [sorted(t.tolist()) for t in pick] == [sorted(row.tolist()) for row in plan.indices.cpu()], layer

    spec = model_spec(str(model_dir), torch.device("cpu"), "bfloat16")
    plans = {name: plan_batch(resolve_method(name, {"budget": 64, "window": 4} if name != "turboquant" else None),
                              spec, 2**24, PAGE, 1024, 64, 10**6) for name in ("snapkv", COMPOSED, "turboquant")}
    assert plans[COMPOSED].batch >= 3 * plans["snapkv"].batch


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_rotation_before_fp8_codes(model_dir, hf, monkeypatch, backend) -> None:
    """`rotate(hadamard) then fp8(...)` (bench/variants/fp8_rotated.kvm) lowers and serves: K and V are
    the FP8 round trip (tests/references/fp8.py) of the Hadamard-rotated vectors, rotated back, and
    a prefill chunk reads itself as stored (FP8's rule): the reference's tokens and logits. On the
    Triton kernels (interpreted here) the store rotates the rows, decode and prefill the query and
    their output."""
    from tests.references import fp8

    device = "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        device = triton_device_and_ops("spec")[0].type
    variant = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "fp8_rotated.kvm")
    config = EngineConfig(model=str(model_dir), device=device, dtype="float32", page_size=PAGE,
                          attention_backend=backend, cuda_graphs=False, kv_cache_memory=2**22, method=variant,
                          max_num_batched_tokens=4096)
    llm = LLM.from_engine(Engine(config))
    assert llm.engine.attention.store.spec.keys.rotation == "hadamard"
    r = torch.from_numpy(ref.rotation(llm.engine.spec.head_dim, "hadamard"))

    def stored(x: torch.Tensor) -> torch.Tensor:
        rotated = (x.double() @ r.T).float()
        return (fp8.round_trip(rotated, 1.0, "e4m3").double() @ r).float()

    spy = Logits(monkeypatch)
    prompts = [prompt(n, seed) for n, seed in ((23, 1), (9, 3))]
    params = [greedy(8) for _ in prompts]
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, ref.Session(exact_prefill=False, stored=stored), p, 8))


# ---- key offsets (docs/design.md, "Key offsets"; bench/variants/turboquant_offsets.kvm) ---------------

OFFSETS = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "turboquant_offsets.kvm")


def _calibrate(model_dir: Path, out: Path) -> argparse.Namespace:
    """`kvc calibrate bench/variants/turboquant_offsets.kvm --model DIR --out OUT --samples 3 --target-context
    24`: its arguments."""
    from kvc.runtime.calibrate.cli import run as calibrate

    args = argparse.Namespace(method=OFFSETS, model=str(model_dir), out=str(out), method_param=None,
                              device="cpu", calibration=None, samples=3, context=8, target_context=24, seed=5)
    assert calibrate(args) == 0
    return args


def test_calibrated_key_offsets_are_the_mean_keys(model_dir, hf, tmp_path) -> None:
    """`kvc calibrate` of the variant writes each layer and KV head's mean key, after RoPE, over its
    calibration sequences: the mean of the Hugging Face model's keys over the same ids."""
    from transformers import AttentionInterface

    from kvc.runtime.calibrate.cli import _calibration_ids
    from kvc.runtime.models.method_inputs import load_input
    from tests.references import harness

    args = _calibrate(model_dir, tmp_path / "key_means.safetensors")
    got = load_input(tmp_path / "key_means.safetensors", "k_mean")
    batches, _ = _calibration_ids(args, model_dir, hf.config.vocab_size, "cpu")
    sums: dict[int, torch.Tensor] = {}

    def capture(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        sums[module.layer_idx] = sums.get(module.layer_idx, 0) + key[0].double().sum(1)  # [Hkv, D]
        return harness.causal_attention(query, key[0].float(), value[0].float(), scaling), None

    AttentionInterface.register("kvc_key_means", capture)
    for ids in batches:
        harness.forward(hf, "kvc_key_means", ids.tolist(), 0)
    want = torch.stack([sums[i] for i in sorted(sums)]) / sum(len(b) for b in batches)
    assert got.shape == want.shape == (hf.config.num_hidden_layers, hf.config.num_key_value_heads,
                                       hf.config.hidden_size // hf.config.num_attention_heads)
    assert want.abs().max() > 0.01
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_keys_are_stored_relative_to_their_offsets(model_dir, hf, monkeypatch, tmp_path, backend) -> None:
    """With a `key_means.safetensors` in the inputs folder, every key of a layer, stored or attended
    as computed, is `k - k_mean[layer]`: the reference's tokens and logits with those offsets (a
    prompt in chunks of 8, then decode steps), which are not the ones without them. Offsets three
    times the keys' size make the difference plain."""
    from kvc.runtime.models.method_inputs import save_input

    device = "cpu"
    if backend == "triton":
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        device = triton_device_and_ops("spec")[0].type
    cfg = hf.config
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    offsets = 3 * torch.randn(shape, generator=torch.Generator().manual_seed(3))
    save_input(tmp_path / "key_means.safetensors", "k_mean", offsets)
    llm = make_llm(model_dir, method=OFFSETS, method_inputs=str(tmp_path), device=device, attention_backend=backend,
                   cuda_graphs=False, max_num_batched_tokens=8, max_prefill_chunk=8)
    store = llm.engine.attention.store
    assert store.spec.keys.offset == "k_mean"
    torch.testing.assert_close(store["k_mean"].float().cpu(), offsets)
    spy = Logits(monkeypatch)
    p, params = prompt(21, 5), greedy(6)
    out = llm.generate(p, params)[0]
    check(out.token_ids, spy.of(params).cpu(), ref.generate(hf, ref.Session(offsets=offsets), p, 6, chunk=8))
    plain = ref.generate(hf, ref.Session(), p, 6, chunk=8)[1]
    assert (plain - spy.of(params).cpu()).abs().max() > 10 * ATOL, "the offsets change nothing: the test is blind"


def test_a_model_without_offsets_gets_zeros(model_dir, caplog) -> None:
    """`input k_mean ... or zeros`: a model with no file (and no shipped one) serves TurboQuant's own
    quantizer, the offsets zero, and the log says how to write them; methods/turboquant.kvm has none."""
    with caplog.at_level("WARNING"):
        llm = make_llm(model_dir, method=OFFSETS)
    assert float(llm.engine.attention.store["k_mean"].abs().max()) == 0
    assert "kvc calibrate" in caplog.text and "key_means.safetensors" in caplog.text
    assert make_llm(model_dir).engine.attention.store.spec.keys.offset is None
