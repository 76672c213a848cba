"""The compiled `palu` method (methods/palu.kvm) served on tiny random Llama and Qwen3 models, against
the hand-written Palu reference (tests/references/palu.py): K and V stored as one low-rank latent
per group of KV heads, from an SVD of the projection weights (`kvc calibrate palu`), keys cached
before RoPE and rotated at their slots when read; a prefill chunk reads its own tokens exactly.
Greedy tokens and every sampled logit row match the reference through a batch, chunked prefills, a
prefix-cache hit, a chain continued, a preemption; at full rank Palu is `full`; the pool holds the
tokens its bytes say; bad input gets clear errors.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch

from kvc.runtime.calibrate.cli import run as calibrate
from kvc.runtime.chains import ChainSpec
from kvc.runtime.config import EngineConfig
from kvc.runtime.engine import Engine
from kvc.runtime.errors import ConfigError
from kvc.runtime.kv import lowrank
from kvc.runtime.llm import LLM
from kvc.runtime.models.method_inputs import load_input
from tests.kernels.sm90 import compiles_for_sm90
from tests.methods import served
from tests.models.tiny import load_hf, make_tiny_llama, make_tiny_qwen3
from tests.references import palu as ref
from tests.runtime.chained import check_books
from tests.runtime.test_contract_methods import ATOL, Logits, check, greedy, prompt

HEAD_DIM = 16


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    make = make_tiny_llama if request.param == "llama" else make_tiny_qwen3
    return make(tmp_path_factory.mktemp(f"palu-{request.param}"), seed=5, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, initializer_range=0.25)


@pytest.fixture(scope="module")
def hf(model_dir: Path):
    return load_hf(model_dir)


POSTROPE = str(Path(__file__).resolve().parents[2] / "bench" / "variants" / "palu_postrope.kvm")


def calibrated(model_dir: Path, out: Path, decompose: str = "svd", method: str = "palu", **params) -> Path:
    """`kvc calibrate METHOD --model DIR --out OUT/FILE --decompose D --method-param k=v ...` (FILE: the
    method's input file): the folder (`svd` by default: the reference's projections)."""
    file = "palu_postrope.safetensors" if method == POSTROPE else "palu.safetensors"
    args = argparse.Namespace(method=method, model=str(model_dir), out=str(out / file),
                              method_param=[f"{k}={v}" for k, v in params.items()], device="cpu",
                              decompose=decompose, calibration=None, samples=3, context=24, seed=5)
    assert calibrate(args) == 0
    return out


@pytest.fixture(scope="module")
def inputs(model_dir: Path, tmp_path_factory) -> Path:
    """Projections at ratio 0.5, two KV heads a group (of the model's four)."""
    return calibrated(model_dir, tmp_path_factory.mktemp("palu-inputs"), ratio=0.5, heads_per_group=2)


PARAMS = {"ratio": 0.5, "heads_per_group": 2}


def make_llm(model_dir: Path, inputs: Path, params: dict = PARAMS, method: str = "palu", **options) -> LLM:
    config = EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=2**22, method=method,
                          method_params=params, method_inputs=str(inputs),
                          **{"max_num_batched_tokens": 4096, "device": "cpu", **options})
    return LLM.from_engine(Engine(config))


def session(hf, group: int = 2, rank: int = 16) -> ref.Session:
    return ref.session(hf, group, rank)


# ---- the projections ----------------------------------------------------------------------------


def test_the_projections_span_the_reference_subspaces(model_dir, hf, inputs) -> None:
    """`kvc calibrate palu` writes, per layer and KV head, its rows of the group's basis: orthonormal
    columns per group spanning the reference's SVD subspace (U U^T equal), down = up; K's rows
    carry the k-norm weight where the model has one (Qwen3)."""
    want = ref.bases(hf, 2, 16)
    for name in ("k", "v"):
        down, up = (load_input(inputs / "palu.safetensors", f"{name}_{part}") for part in ("down", "up"))
        assert down.shape == (2, 4, HEAD_DIM, 16) and torch.equal(down, up)
        for layer in range(2):
            for g in range(2):
                u = down[layer, 2 * g:2 * g + 2].reshape(2 * HEAD_DIM, 16).double()
                torch.testing.assert_close(u.T @ u, torch.eye(16, dtype=torch.float64), atol=1e-5, rtol=0)
                w = torch.from_numpy(want[layer][name][g])
                torch.testing.assert_close(u @ u.T, w @ w.T, atol=1e-5, rtol=0)


def test_the_whitened_projections_are_the_keys_principal_directions(model_dir, hf, tmp_path) -> None:
    """`--decompose whiten` (the default): per layer and group, the top eigenvectors of the second
    moment of the keys the cache stores (before RoPE) and of the values, over the calibration ids
    (random here: the tiny model has no tokenizer); the reference computes the moments from the HF
    model's own keys over the same ids."""
    folder = calibrated(model_dir, tmp_path, "whiten", ratio=0.5, heads_per_group=2)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, hf.config.vocab_size, (3 * 24,), generator=gen).view(3, 24).tolist()
    want = ref.whitened_bases(hf, ids, 2, 16)
    for name in ("k", "v"):
        got = load_input(folder / "palu.safetensors", f"{name}_down")
        for layer in range(2):
            for g in range(2):
                u = got[layer, 2 * g:2 * g + 2].reshape(2 * HEAD_DIM, 16).double()
                w = torch.from_numpy(want[layer][name][g])
                torch.testing.assert_close(u @ u.T, w @ w.T, atol=1e-4, rtol=0)
    weights = load_input(calibrated(model_dir, tmp_path / "svd", ratio=0.5, heads_per_group=2) / "palu.safetensors",
                         "k_down")
    assert (weights[0, :2].reshape(32, 16) @ weights[0, :2].reshape(32, 16).T
            - got[0, :2].reshape(32, 16) @ got[0, :2].reshape(32, 16).T).abs().max() > 1e-2  # another subspace


def test_keys_round_trip_through_rope_at_full_rank() -> None:
    """With a full-rank basis the stored latent gives back the post-RoPE keys at their positions (the
    rotation back to position 0 at the store and forward at the read cancel)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, 8, generator=gen)
    q = torch.linalg.qr(torch.randn(16, 16, generator=gen))[0]
    down = torch.cat([q.reshape(2, 8, 16)] * 2)  # two groups of two heads
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    pos = torch.arange(7, 12)
    latent = lowrank.encode(x, down, 2, pos, inv_freq)  # [5, 4, 8]
    back = lowrank.decode(latent.transpose(0, 1), down, 2, pos, inv_freq)
    torch.testing.assert_close(back, x.transpose(0, 1), atol=1e-5, rtol=0)


# ---- served against the reference ---------------------------------------------------------------


def test_batch_equals_the_reference(model_dir, hf, inputs, monkeypatch) -> None:
    """Prompts of several lengths, one prefill chunk each, then decode steps: the reference's tokens and
    logits; and the projection changes them (half rank against exact K/V)."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, inputs)
    prompts = [prompt(n, seed) for n, seed in ((5, 1), (16, 2), (23, 3), (41, 4))]
    params = [greedy(10) for _ in prompts]
    outs = llm.generate(prompts, params)
    check_books(llm.engine)
    for p, out, sp in zip(prompts, outs, params):
        want = ref.generate(hf, session(hf), p, 10)
        check(out.token_ids, spy.of(sp), want)
    exact = ref.generate(hf, session(hf, 2, 32), prompts[3], 10)[1]  # full rank
    assert (exact - want[1]).abs().max() > 10 * ATOL, "the projection changes nothing: the test is blind"


def test_chunked_prefill_reads_earlier_chunks_as_stored(model_dir, hf, inputs, monkeypatch) -> None:
    """Chunks of 8: each reads its own tokens exactly and the earlier ones through the latent (and
    RoPE at their slots), as the reference chunked the same way does."""
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, inputs, max_num_batched_tokens=8, max_prefill_chunk=8)
    p, params = prompt(29, 9), greedy(6)
    out = llm.generate(p, params)[0]
    check(out.token_ids, spy.of(params), ref.generate(hf, session(hf), p, 6, chunk=8))
    one = ref.generate(hf, session(hf), p, 6)[1]
    assert (one - spy.of(params)).abs().max() > 10 * ATOL  # one chunk would differ: the chunking is seen


@pytest.mark.parametrize("group", [1, 4])
def test_other_groupings_equal_the_reference(model_dir, hf, tmp_path, monkeypatch, group: int) -> None:
    """One KV head a group (Palu's M-LRD) and all four in one group: the reference at that grouping."""
    spy = Logits(monkeypatch)
    params = {"ratio": 0.5, "heads_per_group": group}
    llm = make_llm(model_dir, calibrated(model_dir, tmp_path, **params), params)
    p, sp = prompt(19, 6), greedy(6)
    out = llm.generate(p, sp)[0]
    check(out.token_ids, spy.of(sp), ref.generate(hf, session(hf, group, 8 * group), p, 6))


def test_keys_after_rope_equal_the_reference(model_dir, hf, tmp_path, monkeypatch) -> None:
    """bench/variants/palu_postrope.kvm caches keys after RoPE, whitened by post-RoPE keys (the svd of the
    weights does not span them: refused), and its decode never rebuilds a key (the query absorbs the up
    projection): the reference with keys projected as the model gives them, chunked and in a batch."""
    params = {"ratio": 0.5, "heads_per_group": 2}
    folder = calibrated(model_dir, tmp_path, "whiten", method=POSTROPE, **params)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, hf.config.vocab_size, (3 * 24,), generator=gen).view(3, 24).tolist()
    bases = ref.whitened_bases(hf, ids, 2, 16, prerope=False)
    got = load_input(folder / "palu_postrope.safetensors", "k_down")
    u = got[1, :2].reshape(2 * HEAD_DIM, 16).double()
    w = torch.from_numpy(bases[1]["k"][0])
    torch.testing.assert_close(u @ u.T, w @ w.T, atol=1e-4, rtol=0)
    before = torch.from_numpy(ref.whitened_bases(hf, ids, 2, 16)[1]["k"][0])
    assert (before @ before.T - w @ w.T).abs().max() > 1e-2  # RoPE moves the keys' principal directions
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, folder, params, method=POSTROPE, max_num_batched_tokens=16, max_prefill_chunk=16)
    assert not llm.engine.attention.store.spec.prerope
    prompts = [prompt(n, seed) for n, seed in ((23, 3), (9, 4))]
    sps = [greedy(8) for _ in prompts]
    inv_freq = hf.model.rotary_emb.inv_freq.detach().float()
    for p, out, sp in zip(prompts, llm.generate(prompts, sps), sps):
        want = ref.generate(hf, ref.Session(bases, inv_freq, prerope=False), p, 8, chunk=16)
        check(out.token_ids, spy.of(sp), want)
    with pytest.raises(ConfigError, match="whiten"):
        calibrated(model_dir, tmp_path / "svd", "svd", method=POSTROPE, **params)


def test_full_rank_is_full(model_dir, tmp_path) -> None:
    """At ratio 0 the latent spans every key and value: Palu's tokens are `full`'s, chunked or not."""
    params = {"ratio": 0.0, "heads_per_group": 2}
    palu = make_llm(model_dir, calibrated(model_dir, tmp_path, **params), params, max_prefill_chunk=8)
    full = LLM.from_engine(Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                               kv_cache_memory=2**22, method="full")))
    prompts = [prompt(n, seed) for n, seed in ((13, 1), (30, 2))]
    assert [o.token_ids for o in palu.generate(prompts, greedy(8))] == [
        o.token_ids for o in full.generate(prompts, greedy(8))]


def test_prefix_cache_hit(model_dir, hf, inputs, monkeypatch) -> None:
    """A hit reads the shared pages' latents at their slots (pages of 4 tokens)."""
    llm = make_llm(model_dir, inputs, page_size=4)
    served.prefix_cache_hit(llm, Logits(monkeypatch), partial(ref.generate, hf), partial(session, hf))


def test_chain_continued_and_forked(model_dir, hf, inputs, monkeypatch) -> None:
    llm = make_llm(model_dir, inputs)
    served.chain_continued_and_forked(llm, Logits(monkeypatch), partial(ref.generate, hf), partial(session, hf))


def test_preemption_recomputes(model_dir, hf, inputs, monkeypatch) -> None:
    llm = make_llm(model_dir, inputs, page_size=4)
    assert llm.engine.scheduler.prefix_caching
    served.preemption_recomputes(llm, Logits(monkeypatch), partial(ref.generate, hf), partial(session, hf), 4, True,
                                 14)


def test_the_graph_step_run_uncaptured(model_dir, hf, inputs, monkeypatch) -> None:
    """Decode-only steps through the CUDA-graph runner's own step (static buffers, a padding row), run
    without capture on the CPU: each new key stored at its slot's position."""
    prompts = [prompt(n, seed) for n, seed in ((13, 21), (18, 22), (6, 23))]
    llm = make_llm(model_dir, inputs, max_model_len=80, max_num_seqs=6)
    replays = served.graph_steps(llm, monkeypatch)
    outs = llm.generate(prompts, [greedy(8) for _ in prompts])
    assert 3 in replays
    for p, out in zip(prompts, outs):
        assert out.token_ids == ref.generate(hf, session(hf), p, 8)[0]


# ---- the Triton kernels (the `lowrank` attention variant) -------------------------------------------


def test_the_triton_backend_equals_the_reference(model_dir, hf, inputs, monkeypatch) -> None:
    """The generated `lowrank` kernels (interpreted here): the store projects, the decode kernel rebuilds
    keys from the group's latent tiles (RoPE at the slots) and keeps values in the latent; the prefill
    runs the plain kernel over the rebuilt context, its chunk as computed: the reference's tokens and
    logits, with chunked prefill."""
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device, _ = triton_device_and_ops("lowrank")
    spy = Logits(monkeypatch)
    llm = make_llm(model_dir, inputs, device=device.type, attention_backend="triton", cuda_graphs=False,
                   max_num_batched_tokens=16, max_prefill_chunk=16)
    assert llm.engine.attention.variant == "lowrank"
    # (21, 1) ties two tokens on Qwen3 at chunks of 16 (logits 1e-6 apart): float32 rounding picks either
    prompts = [prompt(n, seed) for n, seed in ((21, 2), (9, 4))]
    params = [greedy(8) for _ in prompts]
    for p, out, sp in zip(prompts, llm.generate(prompts, params), params):
        check(out.token_ids, spy.of(sp).cpu(), ref.generate(hf, session(hf), p, 8, chunk=16))


def test_the_decode_kernel_equals_the_torch_path() -> None:
    """The split decode kernel against torch_ops over the same pages: groups of 1, 2 and 4 KV heads,
    keys before RoPE or not, contexts across pages and splits, one row of context 0 (padding)."""
    pytest.importorskip("triton")
    from kvc.runtime.attention import torch_ops
    from kvc.runtime.attention.sources import LowRankPages
    from kvc.runtime.kv.spec import LowRank
    from tests.kernels.paged_cases import triton_device_and_ops

    device, ops = triton_device_and_ops("lowrank")
    gen = torch.Generator().manual_seed(3)
    heads, q_heads, dim, page, pages = 4, 8, 16, 8, 40
    for group, share, prerope in ((1, 8, True), (2, 8, False), (4, 4, True)):
        rank = group * share
        basis = torch.linalg.qr(torch.randn(group * dim, rank, generator=gen))[0].reshape(group, dim, rank)
        up = torch.cat([basis] * (heads // group))
        enc = LowRank("l", "d", "u", group, prerope=prerope)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        sources = [LowRankPages(enc if w == "k" else LowRank("l", "d", "u", group), torch.randn(
            pages + 1, heads, page, share, generator=gen), up, up, dim, torch.float32, inv_freq) for w in "kv"]
        lens = torch.tensor([70, 0, 9, 200], dtype=torch.int32)
        tables = torch.stack([torch.randperm(pages, generator=gen)[:26] for _ in range(4)]).int()
        q = torch.randn(4, q_heads, dim, generator=gen)
        want = torch_ops.paged_decode(q, *sources, tables, lens, 0.25, max_context_len=200)
        moved = [LowRankPages(s.enc, s.latent.to(device), s.down.to(device), s.up.to(device), dim, torch.float32,
                              inv_freq.to(device)) for s in sources]
        for knobs in ({}, {"num_splits": 3, "block_n": 16}):
            got = ops.paged_decode(q.to(device), *moved, tables.to(device), lens.to(device), 0.25, max_context_len=200,
                                   **knobs)
            torch.testing.assert_close(got.cpu()[[0, 2, 3]], want[[0, 2, 3]], atol=1e-4, rtol=1e-4)


# ---- bytes and bad input ------------------------------------------------------------------------


def test_the_pool_holds_twice_full_s_tokens_at_half_rank(model_dir, inputs) -> None:
    """At ratio 0.5 a token costs half of full's bytes per layer (its latent shares, in the model dtype),
    so the same KV memory buys about twice the pages; the projections are stored once per layer, off the
    budget."""
    palu = make_llm(model_dir, inputs).engine
    full = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory=2**22))
    spec = palu.attention.store.spec
    assert spec.bytes_per_token(4) * 2 == full.attention.store.spec.bytes_per_token(4)
    assert spec.bytes_per_layers(4, 2) == 2 * 2 * 4 * (2 * HEAD_DIM * 16) * 4  # k, v x down, up
    page = spec.bytes_per_page(4, palu.config.page_size)
    assert page * 2 == full.attention.store.spec.bytes_per_page(4, full.config.page_size)
    assert palu.num_pages == (2**22 - spec.bytes_per_layers(4, 2)) // page  # the projections off the budget first
    assert palu.num_pages > 1.9 * full.num_pages


def test_bad_input_gets_clear_errors(model_dir, inputs, tmp_path) -> None:
    with pytest.raises(ConfigError, match="kvc calibrate palu"):  # no projections anywhere
        make_llm(model_dir, tmp_path)
    with pytest.raises(ConfigError, match="has shape"):  # projections of another grouping
        make_llm(model_dir, inputs, {"ratio": 0.5, "heads_per_group": 1})
    with pytest.raises(ConfigError, match="ratio"):
        make_llm(model_dir, inputs, {"ratio": 1.0, "heads_per_group": 2})


def test_a_chain_of_keys_before_rope_cannot_be_pruned(model_dir, inputs) -> None:
    from kvc.runtime.chain_prune import InvalidPrune, PruneRequest

    llm = make_llm(model_dir, inputs)
    first = llm.generate(prompt(30, 3), greedy(2), chain=ChainSpec(open=True))[0]
    with pytest.raises(InvalidPrune, match="before RoPE"):
        llm.engine.prune_chain(first.chain_id, None, PruneRequest(token_ranges=((0, 8),), keep=0.5))
    assert llm.generate(prompt(30, 3) + first.token_ids + [5], greedy(2),
                        chain=ChainSpec(continue_id=first.chain_id))[0].num_cached_tokens == 31  # lost nothing


def test_the_shipped_projections_fit_the_default_model() -> None:
    """The embedded model's shipped palu.safetensors: its 30 layers, 3 KV heads of 64 channels, one head
    a group (gcd(4, 3)) at ratio 0.5, orthonormal columns."""
    from kvc.runtime.models.method_inputs import SHIPPED

    path = SHIPPED / "SmolLM2-135M-Instruct.Q4_1" / "palu.safetensors"
    k = load_input(path, "k_down")
    assert k.shape == (30, 3, 64, 32)
    gram = k[7, 1].double().T @ k[7, 1].double()
    assert np.allclose(gram.numpy(), np.eye(32), atol=1e-5)


def test_the_decode_kernel_compiles_for_sm90() -> None:
    """The split decode kernel at the Qwen3-30B-A3B shape, four KV heads a group at half rank, with and
    without RoPE, compiles for an H100/H200 (ptxas here)."""
    compiles_for_sm90("tests.kernels.sm90_compile_lowrank")


def test_any_positive_head_group_checks() -> None:
    """A head group need not divide the model's KV heads (the runtime takes their gcd): 3 checks; a
    group of 0 is a positioned error."""
    from kvc.dsl import METHODS_DIR, KvmError, check_file, check_source

    check_file(METHODS_DIR / "palu.kvm", {"heads_per_group": 3})
    source = (METHODS_DIR / "palu.kvm").read_text().replace("group = heads_per_group)", "group = 0)")
    with pytest.raises(KvmError, match="the head group must be positive"):
        check_source(source, "palu.kvm")
