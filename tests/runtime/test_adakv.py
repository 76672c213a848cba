"""Ada-KV (per-head variable kept counts) served end to end: `LLM(model, method="adakv")` against
the hand-written oracle (tests/references/eviction.rank_adakv, validated against kvpress 0.5.5
AdaKVPress, run through tests/references/model_forward's per-KV-head cache).

Tiny random Llama (2 KV heads) and Qwen3 (4 KV heads, GQA group 2), float32 CPU, chunked prefill
of 32, page sizes dividing no prompt length. Checked: greedy tokens, kept token indices per layer
and KV head, the right-aligned page layout (head h's kept keys in slots [M - len_h, M)), next-token
logits (1e-4 relative), pages held after prefill = ceil(M / page) per layer, and a page pool back
to idle after every request finished (preemption included).

kvc's `alpha` counts the safeguard outside the window, kvpress's counts window tokens first
(tests/compiler/test_lowering.py::test_adakv): `kvc_params` converts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvc.runtime.engine import Engine
from kvc.runtime.llm import LLM
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references import model_forward as mf

STEPS = 6
LENGTHS = [17, 46, 71, 101]  # 17: shorter than the budget (keeps everything, no plan)
# reference (kvpress-style) parameters: budget per KV head on average, window, kernel, alpha
REFERENCES = {
    "safeguard-beyond-window": {"budget": 24, "window": 4, "kernel": 5, "pool": "avg", "alpha": 0.5},
    "window-covers-safeguard": {"budget": 20, "window": 8, "kernel": 3, "pool": "avg", "alpha": 0.2},
}


def kvc_params(ref: dict) -> dict:
    budget, window = ref["budget"], ref["window"]
    extra = max(0, max(1, int(ref["alpha"] * budget)) - window)
    return {"budget": budget, "window": window, "kernel": ref["kernel"], "alpha": (extra + 0.5) / (budget - window)}


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    if request.param == "llama":
        return make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), num_attention_heads=8, num_key_value_heads=4)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


def make_llm(model_dir: Path, ref: dict, page_size: int = 7, backend: str = "torch", device: str = "cpu",
             **options) -> LLM:
    return LLM(str(model_dir), method="adakv", method_params=kvc_params(ref), device=device, dtype="float32",
               page_size=page_size, max_num_batched_tokens=96, max_prefill_chunk=32, attention_backend=backend,
               **options)


def greedy(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)


def oracle_kept(hf, prompt: list[int], ref: dict):
    """(per layer LayerPrompt, per layer per KV head kept prompt indices) of the reference."""
    layers, _ = mf.prefill(hf, torch.tensor(prompt))
    rankings, _ = mf.compress(layers, "adakv", **ref)
    return layers, [[t.sort().values for t in ranking.kept()] for ranking in rankings]


class Probe:
    """Records an engine's keep plans (per layer) and the logits of each sampled row."""

    def __init__(self, engine: Engine) -> None:
        self.plans: dict[int, object] = {}
        self.logits: list[torch.Tensor] = []
        method, model = engine.method, engine.runner.model
        prefill_end, compute_logits = method.prefill_end, model.compute_logits

        def spy_plan(layer, view):
            plan = prefill_end(layer, view)
            self.plans[layer] = plan
            return plan

        def spy_logits(hidden, out=None):
            out = compute_logits(hidden, out=out)
            self.logits.append(out.detach().clone())
            return out

        method.prefill_end = spy_plan
        model.compute_logits = spy_logits

    def kept(self, layer: int, length: int, num_kv_heads: int) -> list[torch.Tensor]:
        plan = self.plans[layer]
        if plan is None:
            return [torch.arange(length)] * num_kv_heads
        counts = plan.lengths.tolist() if plan.lengths is not None else [plan.kept] * num_kv_heads
        return [plan.indices[h, : counts[h]].cpu() for h in range(num_kv_heads)]


@pytest.mark.parametrize("case", sorted(REFERENCES))
def test_tokens_match_the_oracle(model_dir, hf, case):
    ref = REFERENCES[case]
    llm = make_llm(model_dir, ref)
    prompts = prompts_of(LENGTHS, seed=21)
    outs = llm.generate(prompts, greedy())
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    for prompt, out in zip(prompts, outs):
        want = mf.greedy_compressed(hf, torch.tensor(prompt), STEPS, "adakv", **ref)[0].tolist()
        assert list(out.token_ids) == want, f"{case}, prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("case,page_size", [("safeguard-beyond-window", 7), ("window-covers-safeguard", 16)])
def test_kept_layout_logits_and_pages(model_dir, hf, case, page_size):
    ref = REFERENCES[case]
    engine = make_llm(model_dir, ref, page_size=page_size).engine
    layers, kv_heads = engine.spec.num_layers, engine.spec.num_kv_heads
    ragged = 0
    for prompt in prompts_of(LENGTHS[1:], seed=22):
        probe = Probe(engine)
        seq = engine.add_request(prompt, greedy())
        while seq.is_prefill:
            engine.step()
        ref_layers, want_kept = oracle_kept(hf, prompt, ref)
        used = 0
        for layer in range(layers):
            got = probe.kept(layer, len(prompt), kv_heads)
            for h in range(kv_heads):
                assert torch.equal(got[h], want_kept[layer][h]), f"layer {layer} head {h}, {len(prompt)} tokens"
            counts = [len(t) for t in want_kept[layer]]
            physical = max(counts)
            ragged += len(set(counts)) > 1
            assert physical < len(prompt)
            assert seq.kv_lens[layer] == physical
            starts = seq.kv_starts[layer] or [0] * kv_heads
            assert starts == [physical - n for n in counts]
            assert len(seq.page_tables[layer]) == -(-physical // page_size)
            assert engine.method.budget.kept(len(prompt), layer) >= physical  # admission never under-reserves
            used += len(seq.page_tables[layer])
            # the right-aligned layout: head h's kept keys sit in slots [M - len_h, M), in order
            view_keys = _dense(engine.attention.k_cache, seq.page_tables[layer], physical)
            for h in range(kv_heads):
                want_k = ref_layers[layer].k[h, want_kept[layer][h]]
                torch.testing.assert_close(view_keys[h, starts[h]:], want_k, atol=1e-5, rtol=1e-5)
        assert engine.pool.num_used == used
        while engine.has_unfinished():
            engine.step()
        assert engine.pool.num_free == engine.pool.num_pages
        want_tokens, want_logits = mf.greedy_compressed(hf, torch.tensor(prompt), STEPS, "adakv", **ref)
        assert seq.generated_ids == want_tokens.tolist()
        got_logits = torch.cat(probe.logits)
        assert got_logits.shape == want_logits.shape
        torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4 * float(want_logits.abs().max()))
    assert ragged > 0, "no layer kept unequal counts per head: the case does not exercise Ada-KV"


def _dense(cache: torch.Tensor, pages: list[int], length: int) -> torch.Tensor:
    return cache[torch.tensor(pages)].movedim(1, 0).flatten(1, 2)[:, :length]  # [Hkv, length, D]


def test_preemption_stays_leak_free(model_dir, hf):
    """A pool too small for every request at once: sequences are preempted (and recomputed, which
    re-compresses prompt + generated tokens), every page comes back, and the sequences that were
    never preempted still match the oracle."""
    ref = REFERENCES["safeguard-beyond-window"]
    bytes_per_page = 2 * hf.config.num_key_value_heads * 7 * hf.config.head_dim * 4
    llm = make_llm(model_dir, ref, kv_cache_memory=46 * bytes_per_page)
    engine = llm.engine
    assert engine.num_pages == 46
    prompts = prompts_of([101, 90, 77, 64, 46], seed=23)
    seqs = [engine.add_request(p, greedy(12)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        assert engine.pool.num_used + engine.pool.num_free == engine.pool.num_pages
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages
    assert all(len(s.generated_ids) == 12 for s in seqs)
    assert not engine.method._q and not engine.method._state
    clean = [(p, s) for p, s in zip(prompts, seqs) if s.num_preemptions == 0]
    assert clean
    for prompt, seq in clean:
        assert seq.generated_ids == mf.greedy_compressed(hf, torch.tensor(prompt), 12, "adakv", **ref)[0].tolist()


def test_triton_backend_matches_torch(model_dir, monkeypatch):
    """The Triton kernels with per-head starts (TRITON_INTERPRET=1 without a GPU) serve the same
    tokens as the torch backend."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from tests.kernels.paged_cases import triton_device_and_ops

    device = str(triton_device_and_ops()[0])  # re-imports triton under the interpreter if needed
    ref = REFERENCES["safeguard-beyond-window"]
    prompts = prompts_of([46, 71], seed=24)
    want = [list(o.token_ids) for o in make_llm(model_dir, ref, device=device).generate(prompts, greedy(4))]
    llm = make_llm(model_dir, ref, backend="triton", device=device)
    got = [list(o.token_ids) for o in llm.generate(prompts, greedy(4))]
    assert got == want
    assert llm.engine.pool.num_free == llm.engine.pool.num_pages
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
