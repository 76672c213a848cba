"""`Engine.clone_sequence` (the throughput benchmark's decode batch): a decoding sequence copied into
new running sequences, each with its own pages, bookkeeping, method state (`Hook.CLONE`) and
sampling generator state.

The oracle is the same request run alone: greedy tokens of the source and of every clone equal the
independent run's, for `full` (no hooks), SnapKV (compacted at prefill end), H2O (per-token state
that decides every decode step's eviction) and StreamingLLM (step_end eviction). After every step
the clones hold exactly the source's K/V (dense keys and values per layer) in pages of their own.
Without the method's clone hook an H2O clone diverges (so the hook is what makes it exact), and a
clone that does not fit is refused whole, changing nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvc.runtime.errors import ConfigError, OutOfKVMemory
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import Hook, LayerCacheView
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_qwen3

PAGE = 5
PROMPT_LEN = 61
TOKENS = 14
CASES = {
    "full": {},
    "snapkv": {"budget": 24, "window": 8},
    "h2o": {"heavy": 0.2, "recent": 0.15},
    "streamingllm": {"sink": 4, "recent": 18},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def make_engine(model_dir: Path, method: str, **options):
    opts = {**dict(device="cpu", dtype="float32", page_size=PAGE, max_num_batched_tokens=64, max_prefill_chunk=32,
                   attention_backend="torch", enable_prefix_caching=False), **options}
    return LLM(str(model_dir), method=method, method_params=CASES[method] or None, **opts).engine


def prompt(seed: int = 3) -> list[int]:
    return torch.randint(3, 300, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)


def dense(engine, seq, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    view = LayerCacheView(engine.attention.store, seq.page_tables[layer],
                          seq.kv_lens[layer], seq.kv_starts[layer])
    return view.keys(), view.values()


def decode_until(engine, seq, generated: int) -> None:
    while seq.num_generated < generated:
        engine.step()


@pytest.mark.parametrize("method", sorted(CASES))
def test_clones_decode_like_the_request_alone(model_dir, method):
    alone = make_engine(model_dir, method)
    ref = alone.add_request(prompt(), greedy())
    while alone.has_unfinished():
        alone.step()

    engine = make_engine(model_dir, method)
    source = engine.add_request(prompt(), greedy())
    decode_until(engine, source, 3)  # past prefill end and two decode steps: decode state exists
    clones = engine.clone_sequence(source, 2)
    seqs = [source, *clones]
    assert engine.scheduler.num_running == 3
    owned = [p for s in seqs for t in s.page_tables for p in t]
    assert len(owned) == len(set(owned)), "every clone owns its pages"
    while engine.has_unfinished():
        engine.step()
        for clone in clones:
            if clone.is_finished:
                continue
            assert clone.kv_lens == source.kv_lens and clone.kv_starts == source.kv_starts
            for layer in range(engine.spec.num_layers):
                for got, want in zip(dense(engine, clone, layer), dense(engine, source, layer)):
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for seq in seqs:
        assert seq.generated_ids == ref.generated_ids, f"{method}: seq {seq.seq_id}"
    assert engine.pool.num_free == engine.pool.num_pages
    if method != "full":
        assert Hook.CLONE in engine.method.hooks
        m = engine.method
        assert not m._q and not m._state and not m._pending and not m._decode_state


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_clones_under_the_triton_backend(model_dir, method):
    """The GPU path's kernels (paged attention, decode statistics, compaction), interpreted on the
    CPU: clones still decode the source's tokens."""
    engine = make_engine(model_dir, method, attention_backend="triton")
    source = engine.add_request(prompt(), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    decode_until(engine, source, 2)
    clones = engine.clone_sequence(source, 2)
    while engine.has_unfinished():
        engine.step()
    assert all(c.generated_ids == source.generated_ids for c in clones)
    assert engine.pool.num_free == engine.pool.num_pages


def test_h2o_clone_without_its_state_diverges(model_dir, monkeypatch):
    """The clone hook is what makes an H2O clone exact when its state lives in per-row dicts
    (`use_state_planes = False`; in state planes it travels with the copied pages,
    tests/runtime/test_state_planes.py): with fresh (zero) accumulated attention the clone keeps
    other tokens than its source at the next eviction."""
    from kvc.runtime.compiled.method import CompiledMethod

    monkeypatch.setattr(CompiledMethod, "use_state_planes", False)
    engine = make_engine(model_dir, "h2o")
    monkeypatch.setattr(engine.method, "clone", lambda src, dst: None)
    source = engine.add_request(prompt(), greedy())
    decode_until(engine, source, 3)
    (clone,) = engine.clone_sequence(source, 1)
    for _ in range(3):
        engine.step()
    differs = [not torch.equal(dense(engine, clone, layer)[0], dense(engine, source, layer)[0])
               for layer in range(engine.spec.num_layers)]
    assert any(differs)


def test_seeded_clone_samples_what_its_source_draws(model_dir):
    params = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=11, ignore_eos=True)
    engine = make_engine(model_dir, "snapkv")
    source = engine.add_request(prompt(), params)
    decode_until(engine, source, 2)
    clones = engine.clone_sequence(source, 2)
    while engine.has_unfinished():
        engine.step()
    assert all(c.generated_ids == source.generated_ids for c in clones)


def test_clone_that_does_not_fit_is_refused_whole(model_dir):
    # 60 pages: the source holds 2 layers x ceil(63 / 5) = 26 pages of `full`; one clone fits, two do not
    page_bytes = 2 * 2 * 16 * 4 * PAGE  # K and V, 2 KV heads, head dim 16, float32
    engine = make_engine(model_dir, "full", kv_cache_memory=60 * page_bytes, max_num_seqs=4)
    assert engine.num_pages == 60
    source = engine.add_request(prompt(), greedy())
    decode_until(engine, source, 2)
    free, running = engine.pool.num_free, engine.scheduler.num_running
    with pytest.raises(OutOfKVMemory, match="cloning 2 sequences of 26 KV pages"):
        engine.clone_sequence(source, 2)
    assert engine.pool.num_free == free and engine.scheduler.num_running == running
    assert set(engine.sequences) == {source.seq_id}
    with pytest.raises(ConfigError, match="max_num_seqs"):
        engine.clone_sequence(source, 4)  # 3 seats left
    (clone,) = engine.clone_sequence(source, 1)
    assert engine.pool.num_free == free - 26
    while engine.has_unfinished():
        engine.step()
    assert clone.generated_ids == source.generated_ids


def test_only_a_decoding_sequence_can_be_cloned(model_dir):
    engine = make_engine(model_dir, "snapkv")
    waiting = engine.add_request(prompt(), greedy())
    with pytest.raises(ValueError, match="cannot be cloned"):
        engine.clone_sequence(waiting, 1)
    engine.step()  # its first chunk: still prefilling
    assert waiting.is_prefill
    with pytest.raises(ValueError, match="cannot be cloned"):
        engine.clone_sequence(waiting, 1)
    with pytest.raises(ConfigError, match="non-negative"):
        engine.clone_sequence(waiting, -1)
