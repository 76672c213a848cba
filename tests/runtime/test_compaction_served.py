"""Re-compaction served end to end: an Ada-KV sequence whose layers are compacted again while
decoding, over the per-head start slots the first compaction left.

The served method is kvc's compiled `adakv` (prefill_end: per-head variable counts, stored
right-aligned) with a `step_end` hook added by this test: at chosen decode steps it returns a new
keep plan over each KV head's stored tokens (slots [start_h, length)): per-head variable counts
(again right-aligned, from the old starts) or equal counts (the layer goes back to start 0). The
oracle is `tests/references/model_forward` (per-KV-head caches in Python lists, no pages): the
same Ada-KV prefill compression, then at the same decode steps the same tokens of each head kept
(the plan is recorded relative to the head's own tokens). Checked: greedy tokens and logits of
every step (1e-4 relative), the layer's physical length, start slots and pages after every
re-compaction, one compaction call per layer with both sequences' plans, an idle pool at the end.
Torch backend on tiny Llama and Qwen3; the Triton backend (attention and compaction kernels,
TRITON_INTERPRET=1 without a GPU) on Qwen3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvc.runtime.model_runner as model_runner
import kvc.runtime.kv.executor as executor_module
from kvc.runtime.llm import LLM
from kvc.runtime.method_api import Hook, KeepPlan, StepView
from kvc.runtime.sampling_params import SamplingParams
from tests.models.tiny import make_tiny_llama, make_tiny_qwen3
from tests.references import model_forward as mf

STEPS = 8  # tokens generated: the first from the prefill, then 7 decoding steps
PAGE = 7
REF = {"budget": 24, "window": 4, "kernel": 5, "pool": "avg", "alpha": 0.5}  # kvpress-style Ada-KV
KVC_PARAMS = {"budget": 24, "window": 4, "kernel": 5, "alpha": (max(0, 12 - 4) + 0.5) / 20}
EVICT_AT = {1: "variable", 2: "variable", 4: "equal", 5: "variable"}  # decode step -> plan kind


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model_dir(request, tmp_path_factory) -> Path:
    if request.param == "llama":
        return make_tiny_llama(tmp_path_factory.mktemp("llama"))
    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3"), num_attention_heads=8, num_key_value_heads=4)


class Recompacting:
    """Adds the re-compacting `step_end` to the engine's method (instance attributes only) and
    records, per (sequence, layer, step), the kept tokens of each head relative to its own tokens."""

    def __init__(self, engine) -> None:
        method = engine.method
        self.counts: dict[tuple[int, int], list[int]] = {}  # tokens each head holds after the last plan
        self.chosen: dict[tuple[int, int, int], list[list[int]]] = {}
        prefill_end = method.prefill_end

        def spy_prefill_end(layer, view):
            plan = prefill_end(layer, view)
            heads = view.k.shape[1]
            if plan is None:
                counts = [view.cache.length] * heads
            elif plan.lengths is None:
                counts = [plan.indices.shape[1]] * heads
            else:
                counts = plan.lengths.tolist()
            self.counts[view.seq_id, layer] = counts
            return plan

        method.prefill_end = spy_prefill_end
        method.step_end = self.step_end
        method.step_end_due = lambda layer, *facts: None  # every row: this step_end decides step by step
        method.hooks = method.hooks | {Hook.STEP_END}

    def step_end(self, layer: int, view: StepView) -> KeepPlan | None:
        step = view.context_len - view.prompt_len
        kind = EVICT_AT.get(step)
        key = (view.seq_id, layer)
        counts = self.counts[key]
        length = view.cache.length
        stored = [c + length - max(counts) for c in counts]  # decoded tokens joined every head
        if kind is None:
            self.counts[key] = stored
            return None
        heads = len(stored)
        if kind == "equal":
            keep_n = [max(1, min(stored) - 2)] * heads
        else:  # varied per head, the most-keeping head not always the same one
            keep_n = [max(1, n * (1 + (h + step) % heads) // (heads + 1)) for h, n in enumerate(stored)]
        g = torch.Generator().manual_seed(1000 * view.seq_id + 10 * layer + step)
        rel = []
        for n, c in zip(stored, keep_n):
            older = torch.randperm(n - 1, generator=g)[: c - 1].sort().values.tolist()
            rel.append(older + [n - 1])  # the newest token stays, as eviction methods keep it
        self.chosen[view.seq_id, layer, step] = rel
        self.counts[key] = keep_n
        indices = torch.zeros((heads, max(keep_n)), dtype=torch.long)
        for h, r in enumerate(rel):
            indices[h, : len(r)] = torch.tensor(r) + (length - stored[h])  # slots [start_h, length)
        device = view.cache.device
        return KeepPlan(indices.to(device), None if kind == "equal" else torch.tensor(keep_n))


def reference(hf, prompt: list[int], chosen: dict[tuple[int, int], list[list[int]]]):
    """Greedy tokens and logits of the oracle keeping, at (layer, step), head h's tokens chosen[h]."""
    layers, prompt_logits = mf.prefill(hf, torch.tensor(prompt))
    _, caches = mf.compress(layers, "adakv", **REF)
    tokens, logits = [int(prompt_logits[-1].argmax())], [prompt_logits[-1]]
    for step in range(1, STEPS):
        def evict(layer, q, past, step=step):
            rel = chosen.get((layer, step))
            if rel is None:
                return
            for h, idx in enumerate(rel):
                past.keys[h] = past.keys[h][idx]
                past.values[h] = past.values[h][idx]

        with mf._reference_attention(hf, mf._Session(caches=caches, after_decode=evict)):
            row = mf._logits(hf, torch.tensor([tokens[-1]]), len(prompt) + step - 1)[-1]
        logits.append(row)
        tokens.append(int(row.argmax()))
    return tokens, torch.stack(logits)


def serve(model_dir: Path, backend: str):
    llm = LLM(str(model_dir), method="adakv", method_params=KVC_PARAMS, device="cpu", dtype="float32",
              page_size=PAGE, max_num_batched_tokens=256, attention_backend=backend)
    engine = llm.engine
    spy = Recompacting(engine)
    calls: list[int] = []  # plans per compaction call
    logits: dict[int, list[torch.Tensor]] = {}
    compact, sample = executor_module.compact_tensors, model_runner.sample

    def spy_compact(tensors, batch, **kwargs):
        calls.append(len(batch.lengths))
        return compact(tensors, batch, **kwargs)

    def spy_sample(rows, params, *args, **kwargs):
        for row, p in zip(rows, params):
            logits.setdefault(id(p), []).append(row.detach().clone())
        return sample(rows, params, *args, **kwargs)

    g = torch.Generator().manual_seed(31)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (46, 71)]
    params = [SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True) for _ in prompts]
    executor_module.compact_tensors, model_runner.sample = spy_compact, spy_sample
    layouts = []  # after each decode step: per sequence per layer (kv_len, starts, pages)
    try:
        seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished():
            engine.step()
            layouts.append([(s.num_computed_tokens - s.num_prompt_tokens, list(s.kv_lens), list(s.kv_starts),
                             [len(t) for t in s.page_tables]) for s in seqs])
    finally:
        executor_module.compact_tensors, model_runner.sample = compact, sample
    assert engine.pool.num_free == engine.pool.num_pages
    return engine, spy, calls, prompts, seqs, [torch.stack(logits[id(sp)]) for sp in params], layouts


def check(hf, model_dir: Path, backend: str) -> None:
    engine, spy, calls, prompts, seqs, logits, layouts = serve(model_dir, backend)
    num_layers, heads = engine.spec.num_layers, engine.spec.num_kv_heads
    # both prompts prefill in one step and decode together: one call per layer holds both plans
    assert calls == [2] * (num_layers * (1 + len(EVICT_AT))), calls
    ragged = 0
    for i, (prompt, seq) in enumerate(zip(prompts, seqs)):
        chosen = {(layer, step): rel for (sid, layer, step), rel in spy.chosen.items() if sid == seq.seq_id}
        assert len(chosen) == num_layers * len(EVICT_AT)
        want_tokens, want_logits = reference(hf, prompt, chosen)
        assert seq.generated_ids == want_tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(logits[i], want_logits, rtol=1e-4, atol=1e-4 * float(want_logits.abs().max()))
        for step, kind in EVICT_AT.items():
            after = next(lay[i] for lay in layouts if lay[i][0] == step)
            _, kv_lens, starts, pages = after
            for layer in range(num_layers):
                counts = [len(r) for r in chosen[layer, step]]
                physical = max(counts)
                assert kv_lens[layer] == physical
                # the pages the kept tokens need, and the next token's when the step's token started it
                assert pages[layer] in (-(-physical // PAGE), -(-(physical + 1) // PAGE))
                want_starts = [physical - c for c in counts]
                assert (starts[layer] or [0] * heads) == want_starts
                ragged += any(want_starts)
                if kind == "equal":
                    assert starts[layer] is None
    assert ragged > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recompaction_matches_the_reference(model_dir, hf, backend):
    if backend == "triton":
        if "qwen3" not in model_dir.name:
            pytest.skip("the interpreted Triton run covers one model")
        pytest.importorskip("triton")
        from tests.kernels.paged_cases import triton_device_and_ops

        triton_device_and_ops()  # re-imports triton under the interpreter if needed
    check(hf, model_dir, backend)


def test_compiled_plans_keep_counts_on_the_host():
    """The compiled adapter's plans: equal counts -> no lengths; per-head counts -> a CPU tensor
    (the engine reads the new layout without a device sync), indices padded on the cache's device."""
    from kvc.runtime.compiled.prefill import keep_plan as _keep_plan

    equal = _keep_plan([torch.tensor([0, 4]), torch.tensor([1, 2])], torch.device("cpu"))
    assert equal.lengths is None and equal.indices.tolist() == [[0, 4], [1, 2]]
    ragged = _keep_plan([torch.tensor([3]), torch.tensor([0, 1, 5]), torch.tensor([], dtype=torch.long)],
                        torch.device("cpu"))
    assert ragged.lengths.device.type == "cpu" and ragged.lengths.tolist() == [1, 3, 0]
    assert ragged.indices.tolist() == [[3, 0, 0], [0, 1, 5], [0, 0, 0]] and ragged.kept == 3
